"""magma(base), skip_update(base) vs the numpy Algorithm 1 and exact optax peers."""

import algorithm1 as ref
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma

STEPS = 6


def _grads(shape, steps=STEPS, seed=0):
  rng = np.random.default_rng(seed)
  # A drifting mean makes momentum and gradient partly aligned, so scores move.
  drift = rng.normal(size=shape)
  return [(drift + rng.normal(size=shape)).astype(np.float32) for _ in range(steps)]


def _run(tx, params, grads_seq):
  """Jitted run; returns the trajectory, the recorded masks and the final state."""
  state = tx.init(params)
  step = jax.jit(tx.update)
  traj, masks = [], []
  for g in grads_seq:
    updates, state = step(jax.tree.map(jnp.asarray, g), state, params)
    params = optax.apply_updates(params, updates)
    traj.append(params)
    masks.append(magma.mask_stats(state)["mask"])
  assert step._cache_size() == 1, "recompiled after the first step"
  return traj, masks, state


BASES = {
  "adam": lambda: optax.adam(1e-2),
  "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
  "rmsprop": lambda: optax.rmsprop(1e-2),
  "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
  "lion": lambda: optax.lion(1e-3),
  "muon": lambda: optax.contrib.muon(1e-2),
}


def _params():
  rng = np.random.default_rng(1)
  return {
    "dense": {
      "kernel": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32),
      "bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
    },
    "step": jnp.asarray(3, jnp.int32),
  }


def _grad_tree(params, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda p: (
      jnp.asarray(rng.normal(size=p.shape), p.dtype)
      if jnp.issubdtype(p.dtype, jnp.floating)
      else jnp.zeros_like(p)
    ),
    params,
  )


def _float_params():
  params = _params()
  del params["step"]
  return params


@pytest.mark.parametrize("name", sorted(BASES))
def test_skip_update_keep_prob_one_is_base_exactly(name):
  params = _float_params()
  grads = [_grad_tree(params, s) for s in range(4)]
  base_traj, _, _ = _run_plain(BASES[name](), params, grads)
  traj, _, _ = _run(magma.skip_update(BASES[name](), keep_prob=1.0), params, grads)
  for a, b in zip(base_traj, traj, strict=True):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def _run_plain(tx, params, grads_seq):
  state = tx.init(params)
  step = jax.jit(tx.update)
  traj = []
  for g in grads_seq:
    updates, state = step(g, state, params)
    params = optax.apply_updates(params, updates)
    traj.append(params)
  return traj, None, state


def _first_moments(inner_state, params):
  """Per leaf, the base state's ``mu`` / ``trace`` (numpy), or None."""
  found = {}
  for field in ("mu", "trace"):
    for _, tree in optax.tree_utils.tree_get_all_with_path(inner_state, field):
      for path, x in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda v: isinstance(v, optax.MaskedNode)
      )[0]:
        if not isinstance(x, optax.MaskedNode):
          found.setdefault(jax.tree_util.keystr(path), np.asarray(x, np.float64))
  return {
    jax.tree_util.keystr(p): found.get(jax.tree_util.keystr(p))
    for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  }


@pytest.mark.parametrize("name", sorted(BASES))
def test_magma_runs_on_every_base_and_finds_its_momentum(name):
  """Lockstep with the base: each step's update is s_t * Delta_t, with s_t from the
  cosine of the base's own first moment (or an EMA where it has none) and g_t."""
  params = _float_params()
  grads = [_grad_tree(params, s) for s in range(3)]
  tx, base = magma.magma(BASES[name](), key=1, keep_prob=1.0), BASES[name]()
  state, step = tx.init(params), jax.jit(tx.update)
  scores = {k: 0.5 for k in _first_moments(state.inner_state, params)}
  own = {k: 0.0 for k in scores}
  for g in grads:
    deltas, inner = base.update(g, state.inner_state, params)  # the base alone
    moments = _first_moments(inner, params)
    u, state = step(g, state, params)
    flat_g = {jax.tree_util.keystr(p): x for p, x in
              jax.tree_util.tree_flatten_with_path(g)[0]}  # fmt: skip
    flat_d = {jax.tree_util.keystr(p): x for p, x in
              jax.tree_util.tree_flatten_with_path(deltas)[0]}  # fmt: skip
    flat_u = {jax.tree_util.keystr(p): x for p, x in
              jax.tree_util.tree_flatten_with_path(u)[0]}  # fmt: skip
    for k, gk in flat_g.items():
      gk = np.asarray(gk, np.float64)
      if moments[k] is None:  # the wrapper's own EMA of the gradient
        own[k] = 0.9 * own[k] + 0.1 * gk
        mu = own[k]
      else:
        mu = moments[k]
      cos = float(ref.block_cosine(mu, gk, np.zeros(gk.shape, int), 1)[0])
      scores[k] = 0.9 * scores[k] + 0.1 * ref.sigmoid(cos / 2.0)
      np.testing.assert_allclose(
        flat_u[k], scores[k] * np.asarray(flat_d[k]), rtol=2e-5, atol=1e-8,
        err_msg=f"{name} {k}",
      )  # fmt: skip
    params = optax.apply_updates(params, u)
  own_buffers = jax.tree.leaves(state.mask_state.momentum)
  if name in ("rmsprop",):
    assert own_buffers, "rmsprop keeps no momentum: the wrapper must keep its own EMA"
  else:
    assert not own_buffers, f"{name} has a first moment: no second buffer expected"


def test_skip_update_equals_chain_with_bernoulli_mask():
  params = _float_params()
  grads = [_grad_tree(params, s) for s in range(5)]
  a, _, _ = _run(
    magma.skip_update(optax.adam(1e-2), keep_prob=0.5, key=7), params, grads
  )
  b, _, _ = _run(
    optax.chain(optax.adam(1e-2), magma.bernoulli_mask(0.5, key=7)), params, grads
  )
  for x, y in zip(a, b, strict=True):
    jax.tree.map(np.testing.assert_array_equal, x, y)


GRANULARITIES = ["tensor", "row", "column", "element", (2, 2)]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("keep_prob", [1.0, 0.5])
def test_magma_adam_matches_numpy_algorithm1(granularity, keep_prob):
  shape = (4, 6)
  p0 = np.random.default_rng(2).normal(size=shape).astype(np.float32)
  grads = _grads(shape)
  tx = magma.magma(
    optax.adam(1e-2), keep_prob=keep_prob, key=3, granularity=granularity
  )
  traj, masks, _ = _run(tx, {"w": jnp.asarray(p0)}, [{"w": g} for g in grads])
  z = [np.asarray(m["w"]) for m in masks]
  if keep_prob == 1.0:
    assert all(m.all() for m in z)
  else:
    assert 0 < np.mean(np.concatenate([m.ravel() for m in z])) < 1
  expected = ref.magma_run(ref.NumpyAdam(1e-2), p0, grads, z, granularity=granularity)
  for got, want in zip(traj, expected, strict=True):
    np.testing.assert_allclose(np.asarray(got["w"]), want, rtol=1e-5, atol=1e-6)


def _tau_to_zero(count):
  """2.0 at step 0 (what construction checks), then 0 and below."""
  return jnp.where(count == 0, 2.0, -0.5 * count + 0.5)


@pytest.mark.parametrize("make", ["magma", "adam_magma"])
def test_a_tau_schedule_is_raised_to_its_floor_at_every_step(make):
  # A schedule that reaches 0 (and goes negative) after step 0: the step uses the
  # documented floor, so scores and updates stay finite and equal Algorithm 1 at
  # tau = max(tau_t, floor). Row blocks with a zero row: a zero cosine, 0 / 0 at
  # tau = 0.
  shape = (4, 6)
  p0 = np.random.default_rng(3).normal(size=shape).astype(np.float32)
  grads = _grads(shape)
  for g in grads[1:]:
    g[1] = 0.0
  if make == "magma":
    tx = magma.magma(
      optax.adam(1e-2), tau=_tau_to_zero, keep_prob=1.0, granularity="row"
    )
  else:
    tx = magma.adam_magma(1e-2, tau=_tau_to_zero, keep_prob=1.0, granularity="row")
  traj, _, _ = _run(tx, {"w": jnp.asarray(p0)}, [{"w": g} for g in grads])
  floor = 1e-3  # the documented floor
  tau = lambda t: max(float(_tau_to_zero(t)), floor)
  assert tau(1) == floor  # the schedule is below the floor from step 1
  want = ref.magma_run(ref.NumpyAdam(1e-2), p0, grads, [np.ones(4)] * STEPS,
                       granularity="row", tau=tau)  # fmt: skip
  for got, w in zip(traj, want, strict=True):
    assert np.isfinite(np.asarray(got["w"])).all()
    np.testing.assert_allclose(np.asarray(got["w"]), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "make",
  [
    lambda tau: magma.alignment_mask(tau),
    lambda tau: magma.magma(optax.adam(1e-3), tau=tau),
    lambda tau: magma.adam_magma(1e-3, tau=tau),
  ],
  ids=["alignment_mask", "magma", "adam_magma"],
)
def test_a_constant_tau_below_the_floor_is_refused(make):
  with pytest.raises(ValueError, match=r"tau must lie in \[0.001, inf\); got 0.0001"):
    make(1e-4)
  make(1e-3)  # control: the floor itself is a valid tau


@pytest.mark.parametrize(
  "base,np_base,key",
  [
    (lambda: optax.rmsprop(1e-2), lambda: ref.NumpyRMSProp(1e-2), None),
    (
      lambda: optax.sgd(1e-2, momentum=0.9),
      lambda: ref.NumpySGDMomentum(1e-2, 0.9),
      "trace",
    ),
  ],
  ids=["rmsprop_own_ema", "sgd_trace"],
)
def test_magma_momentum_source_matches_numpy(base, np_base, key):
  shape = (3, 5)
  p0 = np.random.default_rng(4).normal(size=shape).astype(np.float32)
  grads = _grads(shape, seed=5)
  traj, masks, _ = _run(
    magma.magma(base(), key=0), {"w": jnp.asarray(p0)}, [{"w": g} for g in grads]
  )
  z = [np.asarray(m["w"]) for m in masks]
  expected = ref.magma_run(np_base(), p0, grads, z, momentum_key=key)
  for got, want in zip(traj, expected, strict=True):
    np.testing.assert_allclose(np.asarray(got["w"]), want, rtol=1e-5, atol=1e-6)


def test_magma_own_momentum_option_matches_numpy():
  shape = (3, 5)
  p0 = np.random.default_rng(6).normal(size=shape).astype(np.float32)
  grads = _grads(shape, seed=7)
  tx = magma.magma(
    optax.adam(1e-2),
    momentum="own",
    momentum_decay=0.8,
    tau=0.5,
    score_decay=0.5,
    init_score=0.2,
    key=2,
  )
  traj, masks, state = _run(tx, {"w": jnp.asarray(p0)}, [{"w": g} for g in grads])
  assert jax.tree.leaves(state.mask_state.momentum)
  z = [np.asarray(m["w"]) for m in masks]
  expected = ref.magma_run(
    ref.NumpyAdam(1e-2),
    p0,
    grads,
    z,
    momentum_key=None,
    momentum_decay=0.8,
    tau=0.5,
    score_decay=0.5,
    init_score=0.2,
  )
  for got, want in zip(traj, expected, strict=True):
    np.testing.assert_allclose(np.asarray(got["w"]), want, rtol=1e-5, atol=1e-6)


def test_skip_update_matches_numpy_with_recorded_masks():
  shape = (4, 6)
  p0 = np.random.default_rng(8).normal(size=shape).astype(np.float32)
  grads = _grads(shape, seed=9)
  tx = magma.skip_update(optax.adam(1e-2), keep_prob=0.25, key=5, granularity="row")
  traj, masks, _ = _run(tx, {"w": jnp.asarray(p0)}, [{"w": g} for g in grads])
  z = [np.asarray(m["w"]) for m in masks]
  expected = ref.magma_run(
    ref.NumpyAdam(1e-2), p0, grads, z, granularity="row", keep_prob=0.25, rescale=True
  )
  for got, want in zip(traj, expected, strict=True):
    np.testing.assert_allclose(np.asarray(got["w"]), want, rtol=1e-5, atol=1e-6)


def test_stacked_layers_get_one_block_per_slice():
  shape = (3, 4, 5)  # 3 stacked layers
  p0 = np.random.default_rng(10).normal(size=shape).astype(np.float32)
  grads = _grads(shape, seed=11)
  tx = magma.magma(optax.adam(1e-2), key=4, stack_axes=1)
  traj, masks, state = _run(tx, {"w": jnp.asarray(p0)}, [{"w": g} for g in grads])
  assert state.mask_state.scores["w"].shape == (3,)
  z = [np.asarray(m["w"]) for m in masks]
  expected = ref.magma_run(ref.NumpyAdam(1e-2), p0, grads, z, stack_axes=1)
  for got, want in zip(traj, expected, strict=True):
    np.testing.assert_allclose(np.asarray(got["w"]), want, rtol=1e-5, atol=1e-6)


def test_where_scopes_masking_and_others_take_the_base_update():
  params = _float_params()
  grads = [_grad_tree(params, s) for s in range(4)]
  only_kernel = lambda path, leaf: leaf.ndim >= 2
  traj, masks, _ = _run(
    magma.magma(optax.adam(1e-2), where=only_kernel, key=0), params, grads
  )
  base, _, _ = _run_plain(optax.adam(1e-2), params, grads)
  for got, want in zip(traj, base, strict=True):
    np.testing.assert_array_equal(got["dense"]["bias"], want["dense"]["bias"])
  assert isinstance(masks[0]["dense"]["bias"], optax.MaskedNode)
  # The same scope as a pytree of bools.
  tree_scope = {"dense": {"kernel": True, "bias": False}}
  traj2, _, _ = _run(
    magma.magma(optax.adam(1e-2), where=tree_scope, key=0), params, grads
  )
  for a, b in zip(traj, traj2, strict=True):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_integer_and_none_leaves_pass_through():
  params = _params()
  grads = [_grad_tree(params, s) for s in range(2)]
  tx = optax.chain(optax.sgd(1e-2), magma.bernoulli_mask(0.5))
  traj, masks, _ = _run(tx, params, grads)
  assert isinstance(masks[0]["step"], optax.MaskedNode)
  assert traj[-1]["step"] == 3
  with_none = {"w": jnp.ones((2, 3)), "absent": None}
  for tx in (
    magma.magma(optax.adam(1e-2)),
    magma.skip_update(optax.adam(1e-2)),
    magma.alignment_mask(),
    magma.damping(0.1),
  ):
    updates, _ = jax.jit(tx.update)(with_none, tx.init(with_none), with_none)
    assert updates["absent"] is None and updates["w"].shape == (2, 3)


def test_zero_gradients_never_put_nan_in_state():
  params = {"w": jnp.ones((3, 4)), "v": jnp.ones((5,))}
  zeros = [jax.tree.map(jnp.zeros_like, params)] * 3
  for tx in (
    magma.magma(optax.adam(1e-2)),
    magma.magma(optax.rmsprop(1e-2)),
    magma.alignment_mask(),
  ):
    _, _, state = _run(tx, params, zeros)
    for leaf in jax.tree.leaves(state):
      if jnp.issubdtype(leaf.dtype, jnp.floating):
        assert np.isfinite(leaf).all()
    scores = magma.mask_stats(state)["scores"]
    # cos(0, 0) = 0 -> sigmoid(0) = 0.5, and s_0 = 0.5: the score stays at 0.5.
    jax.tree.map(lambda s: np.testing.assert_allclose(s, 0.5, rtol=1e-6), scores)


def test_bf16_updates_keep_their_dtype_and_scores_are_f32():
  p32 = {"w": jnp.asarray(np.random.default_rng(3).normal(size=(8, 8)), jnp.float32)}
  p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
  g16 = jax.tree.map(lambda x: (x * 0.5 + 0.1).astype(jnp.bfloat16), p16)
  for base in (optax.adam(1e-2), optax.adam(1e-2, mu_dtype=jnp.float32)):
    plain, _ = base.update(g16, base.init(p16), p16)
    tx = magma.magma(base, key=0)
    updates, state = jax.jit(tx.update)(g16, tx.init(p16), p16)
    assert updates["w"].dtype == plain["w"].dtype  # whatever the base emits
    assert state.mask_state.scores["w"].dtype == jnp.float32
  for tx in (magma.bernoulli_mask(0.5), magma.alignment_mask(), magma.damping(0.1)):
    updates, _ = jax.jit(tx.update)(g16, tx.init(p16), p16)
    assert updates["w"].dtype == jnp.bfloat16
  # Scores are computed in f32 from the bf16 inputs: equal to the f32 run's scores.
  tx = magma.alignment_mask(keep_prob=1.0)
  _, s16 = tx.update(g16, tx.init(p16))
  _, s32 = tx.update(jax.tree.map(lambda x: x.astype(jnp.float32), g16), tx.init(p32))
  np.testing.assert_allclose(s16.scores["w"], s32.scores["w"], rtol=1e-6)


def test_multisteps_around_wrapper():
  params = {"w": jnp.ones((4, 4))}
  inner = magma.magma(optax.adam(1e-2), key=0, keep_prob=1.0)
  tx = optax.MultiSteps(inner, every_k_schedule=2)
  state = tx.init(params)
  step = jax.jit(tx.update)
  g1 = {"w": jax.random.normal(jax.random.key(1), (4, 4))}
  g2 = {"w": jax.random.normal(jax.random.key(2), (4, 4))}
  u1, state = step(g1, state, params)
  np.testing.assert_array_equal(u1["w"], 0.0)  # accumulating
  assert int(magma.mask_stats(state)["step"]) == 0
  u2, state = step(g2, state, params)
  assert int(magma.mask_stats(state)["step"]) == 1
  assert step._cache_size() == 1
  # The wrapper saw one step with the mean gradient, as it would alone.
  mean = jax.tree.map(lambda a, b: (a + b) / 2, g1, g2)
  want, _ = inner.update(mean, inner.init(params), params)
  np.testing.assert_allclose(u2["w"], want["w"], rtol=1e-6)
  assert np.all(np.asarray(u2["w"]) != 0)


def test_extra_args_are_passed_to_the_base():
  seen = {}

  def probe():
    def init_fn(params):
      return optax.EmptyState()

    def update_fn(updates, state, params=None, *, value=None, **extra):
      seen["value"] = value
      return updates, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

  params = {"w": jnp.ones((2, 2))}
  for tx in (magma.magma(probe()), magma.skip_update(probe())):
    state = tx.init(params)
    tx.update(params, state, params, value=0.3)
    assert seen.pop("value") == 0.3


@pytest.mark.parametrize(
  "kwargs,match",
  [
    ({"tau": 0.0}, "tau"),
    ({"tau": -1.0}, "tau"),
    ({"keep_prob": 0.0}, "keep_prob"),
    ({"keep_prob": 1.5}, "keep_prob"),
    ({"score_decay": 1.0}, "score_decay"),
    ({"momentum_decay": -0.1}, "momentum_decay"),
    ({"init_score": 2.0}, "init_score"),
    ({"momentum": "base"}, "momentum"),
    ({"granularity": "block"}, "granularity"),
    ({"keep_prob": lambda count: 0.0 * count}, "keep_prob"),
    ({"keep_prob": {}}, "keep_prob"),
    ({"keep_prob": "half"}, "keep_prob"),
  ],
)
def test_bad_hyperparameters_raise_at_construction(kwargs, match):
  with pytest.raises(ValueError, match=match):
    magma.magma(optax.adam(1e-3), **kwargs)


def test_skip_update_bad_input():
  with pytest.raises(ValueError, match=r"keep_prob must lie in \(0.0, 1.0\]"):
    magma.skip_update(optax.adam(1e-3), keep_prob=0.0)
  with pytest.raises(ValueError, match="rescale"):
    magma.skip_update(optax.adam(1e-3), rescale="yes")
  with pytest.raises(ValueError, match="key"):
    magma.skip_update(optax.adam(1e-3), key="seed")
  # Beyond int32: a ValueError naming the key (was a bare OverflowError).
  with pytest.raises(ValueError, match=r"key=1099511627776 does not fit in an int32"):
    magma.skip_update(optax.adam(1e-3), key=2**40)


@pytest.mark.parametrize(
  "make",
  [
    lambda: magma.magma(optax.adam(1e-3), key=1),
    lambda: magma.skip_update(optax.adam(1e-3), key=1),
    lambda: magma.adam_magma(1e-3, key=1),
    lambda: optax.chain(magma.alignment_mask(key=1), optax.sgd(1e-3)),
    lambda: optax.chain(magma.bernoulli_mask(0.5, key=1), optax.sgd(1e-3)),
  ],
)
def test_init_after_a_donated_step(make):
  # Training loops donate the optimizer state; the PRNG key inside it must be a
  # buffer of that state alone, or the next init() hands out a deleted key.
  tx = make()
  params = {"w": jnp.ones((4, 4))}
  step = jax.jit(lambda s, g: tx.update(g, s, params)[1], donate_argnums=0)
  jax.block_until_ready(step(tx.init(params), params))
  jax.block_until_ready(step(tx.init(params), params))


@pytest.mark.parametrize(
  "factory, kwargs",
  [
    (magma.magma, {"tau": 2.0}),
    (magma.skip_update, {"keep_prob": 0.5}),
    (magma.adam_magma, {}),
  ],
)
def test_injected_state_owns_its_buffers(factory, kwargs):
  # optax.inject_hyperparams keeps every numeric argument as an array in the state;
  # no other state leaf may be that same buffer (a donated step would donate it
  # twice), and the defaults of static arguments must not be picked up.
  base = (1e-3,) if factory is magma.adam_magma else (optax.adam(1e-3),)
  static = ("b1", "b2", "eps", "eps_root") if factory is magma.adam_magma else ()
  tx = optax.inject_hyperparams(factory, static_args=static)(*base, **kwargs)
  params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
  state = tx.init(params)
  arrays = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
  assert len({id(x) for x in arrays}) == len(arrays)
  step = jax.jit(lambda s, g: tx.update(g, s, params)[1], donate_argnums=0)
  jax.block_until_ready(step(step(state, params), params))
