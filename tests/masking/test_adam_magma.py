"""adam_magma: the same updates, masks and scores as magma(optax.adam / adamw).

Tolerance: updates agree to rtol 1e-5 / atol 1e-9 (lr 1e-2, updates ~1e-3): the fused
path forms the block sums in another order (and carries ||mu||^2), float32 rounding
only. The Bernoulli masks are equal exactly (same draw functions, same key).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma

STEPS = 4
TOL = dict(rtol=1e-5, atol=1e-9)


def _params():
  k = jax.random.split(jax.random.key(0), 4)
  return {
    "attn": {"q_proj": {"kernel": jax.random.normal(k[0], (6, 10))}},
    "mlp": {"up_proj": {"kernel": jax.random.normal(k[1], (3, 4, 5))}},
    "norm": {"scale": jax.random.normal(k[2], (33,))},
  }


def _grads(params, t):
  key = jax.random.fold_in(jax.random.key(1), t)
  return jax.tree.map(
    lambda x: jax.random.normal(jax.random.fold_in(key, x.size), x.shape) + 0.3 * x,
    params,
  )


def _run(tx, params, steps=STEPS, **extra):
  state = tx.init(params)
  update = jax.jit(tx.update)
  out = []
  for t in range(steps):
    u, state = update(_grads(params, t), state, params, **extra)
    params = optax.apply_updates(params, u)
    out.append(u)
  return out, state, update


@pytest.fixture(scope="module")
def params():
  return _params()


CASES = {
  "adam-tensor": dict(),
  "adamw-row": dict(weight_decay=0.1, granularity="row"),
  "adam-column-scoped": dict(granularity="column", where=magma.attention_mlp_weights),
  "adam-by-label": dict(keep_prob={"attention": 0.7, "mlp": 0.4}),
  "adam-schedules": dict(
    learning_rate=optax.linear_schedule(1e-2, 1e-3, 4), tau=lambda c: 2.0 + c
  ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_equals_magma_wrapper(params, name):
  kw = dict(CASES[name])
  lr = kw.pop("learning_rate", 1e-2)
  wd = kw.pop("weight_decay", 0.0)
  base = optax.adamw(lr, weight_decay=wd) if wd else optax.adam(lr)
  want, want_state, _ = _run(magma.magma(base, key=5, **kw), params)
  got, got_state, update = _run(
    magma.adam_magma(lr, weight_decay=wd, key=5, implementation="xla", **kw),
    params,
  )
  for u_got, u_want in zip(got, want, strict=True):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), u_got, u_want)
  stats_got, stats_want = magma.mask_stats(got_state), magma.mask_stats(want_state)
  jax.tree.map(np.testing.assert_array_equal, stats_got["mask"], stats_want["mask"])
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
    stats_got["scores"],
    stats_want["scores"],
  )
  np.testing.assert_allclose(
    stats_got["active_fraction"], stats_want["active_fraction"]
  )
  assert int(stats_got["step"]) == STEPS
  # Adam's moments are where optax keeps them, and equal.
  inner = want_state.inner_state
  mu = optax.tree_utils.tree_get(inner, "mu")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got_state.mu, mu)
  assert update._cache_size() == 1  # compiled once for all steps


def test_pallas_interpret_equals_wrapper(params):
  kw = dict(key=2, granularity="row")
  want, _, _ = _run(magma.magma(optax.adam(1e-2), **kw), params, steps=2)
  got, state, _ = _run(
    magma.adam_magma(1e-2, implementation="pallas", interpret=True, **kw),
    params,
    steps=2,
  )
  for u_got, u_want in zip(got, want, strict=True):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), u_got, u_want)
  # The carried ||mu||^2 is the kernel's exact one.
  jax.tree.map(
    lambda n, m: np.testing.assert_allclose(n, jnp.sum(m * m, -1), rtol=1e-5),
    state.mu_sq_norm,
    state.mu,
  )


def test_carried_norm_stays_exact_over_many_steps():
  p = {"w": jnp.ones((4, 8))}
  tx = magma.adam_magma(1e-2, implementation="xla")
  state = tx.init(p)

  def body(state, t):
    g = {"w": jnp.sin(jnp.arange(32.0).reshape(4, 8) * (t + 1.0))}
    return tx.update(g, state, p)[1], None

  state, _ = jax.lax.scan(body, state, jnp.arange(200.0))
  want = jnp.sum(state.mu["w"] ** 2)
  np.testing.assert_allclose(state.mu_sq_norm["w"], want, rtol=1e-5)


def _score_run(tx, p, grads):
  state = tx.init(p)
  update = jax.jit(tx.update)
  for g in grads:
    _, state = update(g, state, p)
  return np.asarray(state.mask_state.scores["w"], np.float64)


def _numpy_scores(grads, blocks):
  """float64 Magma scores (tau 2) of Adam's m_t, ``blocks`` rows per... one block
  per row of the reshaped gradient."""
  m = 0.0
  s = 0.5
  for g in grads:
    g = np.asarray(g["w"], np.float64).reshape(blocks, -1)
    m = 0.9 * m + 0.1 * g
    cos = (m * g).sum(-1) / np.sqrt((m * m).sum(-1) * (g * g).sum(-1))
    s = 0.9 * s + 0.1 / (1 + np.exp(-cos / 2.0))
  return s


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("case", ["tensor-cancels", "element-random"])
def test_cosine_exact_where_the_momentum_cancels(implementation, case):
  # tensor-cancels: g_2 = -(0.9 + d) g_1, so m_2 = -0.1 d g_1 is parallel to g_2
  # (cosine 1) and ||m_2||^2 derived from the carry has lost its digits.
  # element-random: single-entry blocks, where m_t nearly cancels in some entries
  # every few steps (they sum ||m_t||^2 directly).
  rng = np.random.default_rng(0)
  if case == "tensor-cancels":
    v = rng.standard_normal((8, 32)).astype(np.float32)
    grads = [{"w": jnp.asarray(v)}, {"w": jnp.asarray(-(0.9 + 1e-4) * v)}]
    granularity, blocks = "tensor", 1
  else:
    grads = [
      {"w": jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)} for _ in range(6)
    ]
    granularity, blocks = "element", 256
  p = {"w": jnp.zeros((8, 32))}
  kw = dict(key=0, granularity=granularity)
  extra = {}
  if implementation == "pallas":
    extra = dict(interpret=True, block_sizes=magma.kernels.BlockSizes(8, 32))
  got = _score_run(
    magma.adam_magma(1e-3, implementation=implementation, **kw, **extra), p, grads
  )
  wrapper = _score_run(magma.magma(optax.adam(1e-3), **kw), p, grads)
  want = _numpy_scores(grads, blocks).reshape(got.shape)
  # Before direct sums where the carry cancels: 6e-3 off (tensor, d = 1e-4) and
  # up to 5.6e-3 (element blocks). The float64 reference differs by m_t's own
  # float32 rounding (relative 1e-2 per entry at d = 1e-4): 2e-5 in a score.
  np.testing.assert_allclose(got, wrapper, atol=2e-6)
  np.testing.assert_allclose(got, want, atol=2e-5)


def _numpy_masked_magma(params, grads_list, param_masks, lr=1e-2, key=5):
  """Independent float64 Adam+Magma with a parameter mask (one tensor block)."""
  mask_tx = magma.adam_magma(lr, key=key, implementation="xla")
  # The Bernoulli draws are the package's (their equality is tested above); the
  # arithmetic below is numpy's own.
  state = mask_tx.init(params)
  m = np.zeros(params.shape)
  v = np.zeros(params.shape)
  s = 0.5
  outs = []
  for t, (g, pm) in enumerate(zip(grads_list, param_masks, strict=True)):
    _, state = mask_tx.update(g, state, params, param_mask=pm)
    z = float(magma.mask_stats(state)["mask"])
    g = np.asarray(g, np.float64)
    pm = np.asarray(pm)
    new_m = np.where(pm, 0.9 * m + 0.1 * g, m)
    new_v = np.where(pm, 0.999 * v + 0.001 * g * g, v)
    a, b = np.where(pm, new_m, 0), np.where(pm, g, 0)
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    s = 0.9 * s + 0.1 / (1 + np.exp(-cos / 2.0))
    c = t + 1
    u = (new_m / (1 - 0.9**c)) / (np.sqrt(new_v / (1 - 0.999**c)) + 1e-8)
    outs.append(np.where(pm, -lr * s * z * u, 0.0))
    m, v = new_m, new_v
  return outs


def test_param_mask_matches_numpy():
  p = jnp.linspace(-1.0, 1.0, 24)
  keys = jax.random.split(jax.random.key(3), 8)
  grads = [jax.random.normal(keys[t], (24,)) for t in range(4)]
  pms = [jax.random.bernoulli(keys[4 + t], 0.6, (24,)) for t in range(4)]
  want = _numpy_masked_magma(p, grads, pms)
  tx = magma.adam_magma(1e-2, key=5, implementation="xla")
  state = tx.init(p)
  for g, pm, w in zip(grads, pms, want, strict=True):
    u, state = jax.jit(tx.update)(g, state, p, param_mask=pm)
    np.testing.assert_allclose(u, w, rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(np.asarray(u)[~np.asarray(pm)], 0)
  np.testing.assert_allclose(state.mu_sq_norm, jnp.sum(state.mu**2), rtol=1e-6)


def test_bfloat16_params_keep_dtypes_and_track_wrapper():
  p = {"w": jnp.linspace(-1, 1, 48).reshape(6, 8).astype(jnp.bfloat16)}
  g = {"w": jnp.cos(jnp.arange(48.0)).reshape(6, 8).astype(jnp.bfloat16)}
  tx = magma.adam_magma(1e-2, key=1, implementation="xla")
  u, state = tx.update(g, tx.init(p), p)
  assert u["w"].dtype == state.mu["w"].dtype == state.nu["w"].dtype == jnp.bfloat16
  ref = magma.magma(optax.adam(1e-2), key=1)
  want, _ = ref.update(g, ref.init(p), p)
  # optax computes in bf16, the kernel in f32 and rounds once: a few bf16 ulps.
  np.testing.assert_allclose(
    np.asarray(u["w"], np.float32), np.asarray(want["w"], np.float32), rtol=3e-2
  )


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(b1=1.0), "b1"),
    (dict(b2=-0.1), "b2"),
    (dict(eps=-1.0), "eps"),
    (dict(tau=0.0), "tau"),
    (dict(keep_prob=0.0), "keep_prob"),
    (dict(weight_decay=-1.0), "weight_decay"),
    (dict(granularity="rows"), "granularity"),
    (dict(implementation="cuda"), "implementation"),
  ],
)
def test_bad_hyperparameters_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    magma.adam_magma(1e-3, **kwargs)


def test_weight_decay_needs_params_and_pallas_needs_accelerator():
  p = {"w": jnp.ones((2, 3))}
  tx = magma.adam_magma(1e-3, weight_decay=0.1)
  with pytest.raises(ValueError, match="needs the params"):
    tx.update(p, tx.init(p))
  if jax.default_backend() == "cpu":
    tx = magma.adam_magma(1e-3, implementation="pallas")
    with pytest.raises(ValueError, match="interpret=True"):
      tx.update(p, tx.init(p), p)


def test_inject_hyperparams(params):
  static = ("b1", "b2", "eps", "eps_root", "implementation")
  injected = optax.inject_hyperparams(magma.adam_magma, static_args=static)(
    learning_rate=1e-2, tau=2.0, keep_prob=0.5, key=5, implementation="xla"
  )
  plain = magma.adam_magma(1e-2, key=5, implementation="xla")
  got, state, _ = _run(injected, params, steps=2)
  want, _, _ = _run(plain, params, steps=2)
  for a, b in zip(got, want, strict=True):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **TOL), a, b)
  assert int(magma.mask_stats(state)["step"]) == 2
  # optax's idiom, every numeric argument injected (tests/test_inject_hyperparams.py
  # checks it against the static step).
  every = optax.inject_hyperparams(magma.adam_magma)(learning_rate=1e-2, key=5)
  updates, _ = jax.jit(every.update)(params, every.init(params), params)
  want, _ = jax.jit(plain.update)(params, plain.init(params), params)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5), updates, want)


def test_complex_parameters_are_a_clear_error_not_a_real_update():
  params = {"w": jnp.ones((2, 3), jnp.complex64), "r": jnp.ones(3)}
  grads = {"w": (1 + 2j) * jnp.ones((2, 3), jnp.complex64), "r": jnp.ones(3)}
  tx = magma.adam_magma(1e-2)
  with pytest.raises(ValueError, match="does not support complex"):
    tx.init(params)
  real_state = tx.init({"w": jnp.ones((2, 3)), "r": jnp.ones(3)})
  with pytest.raises(ValueError, match=r"complex parameters \(at \[\"\['w'\]\"\]\)"):
    tx.update(grads, real_state, params)
  # The wrapper masks complex leaves (real cosine; tests/masking/test_complex.py): with
  # keep_prob=1 its update is the score times Adam's complex update.
  wrapped = magma.magma(optax.adam(1e-2), keep_prob=1.0)
  u, state = wrapped.update(grads, wrapped.init(params), params)
  want, _ = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params))
  s = state.mask_state.scores["w"]
  np.testing.assert_allclose(u["w"], s * want["w"], rtol=1e-6)
  assert np.any(np.imag(u["w"]) != 0)


@pytest.mark.parametrize(
  "param_shape, mask_shape", [((8,), (1, 8)), ((4, 8), (8,)), ((8,), (4, 8))]
)
def test_param_mask_of_another_shape_raises_not_broadcast(param_shape, mask_shape):
  # Broadcast, a (1, 8) mask grew the update and the moments to (1, 8), and an (8,)
  # mask on a (4, 8) leaf masked every row alike, without an error.
  p = {"w": jnp.ones(param_shape)}
  tx = magma.adam_magma(1e-2, implementation="xla")
  mask = {"w": jnp.ones(mask_shape, bool)}
  with pytest.raises(ValueError, match=r"param_mask leaf 0 has shape"):
    tx.update(p, tx.init(p), p, param_mask=mask)
  # The right shape, in any dtype, is read as truth values.
  u, _ = tx.update(p, tx.init(p), p, param_mask={"w": jnp.zeros(param_shape)})
  np.testing.assert_array_equal(u["w"], 0.0)
