"""Tests for magma_optax.periodic_mask and the sparsity schedules (numpy references)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo import entry_copies
from algorithm1 import join_shard_parts
from algorithm1 import shard_parts

import magma_optax as magma
from magma_optax.pruning import periodic as _periodic

# Repeated shapes: leaves of one shape are ranked by one computation over their stack.
SHAPES = [(1,), (5,), (4, 5), (2, 9, 1), (2, 2, 4, 4), (4, 5), (5,), (4, 5)]
# One sparsity per step, so a single compiled step covers all of them.
TARGETS = np.array([0.0, 0.3, 0.5, 0.9, 0.25, 0.75, 0.1, 0.6], np.float32)


def _forced(form):
  """A context in which the refresh takes ``form``: ``"device"`` forces the form a
  GPU or TPU compiles on this CPU; ``"cpu"`` is what XLA:CPU compiles anyway."""
  patch = pytest.MonkeyPatch.context()
  if form == "device":
    with patch as p:
      p.setattr(_periodic, "_per_backend", lambda f, *ops: f(*ops, device=True))
      yield
  else:
    yield


@pytest.fixture(autouse=True)
def refresh_form(request):
  """The refresh's form: XLA:CPU's unless a test asks for both (``BOTH_FORMS``)."""
  form = getattr(request, "param", "cpu")
  yield from _forced(form)


# Tests of the refreshed masks run on both forms of the refresh (the device form
# must find the same masks and counts).
BOTH_FORMS = pytest.mark.parametrize("refresh_form", ["cpu", "device"], indirect=True)


def np_keep(score, active, sparsity):
  """Reference exact top-k: score desc, then active first, then low flat index."""
  s = np.asarray(score, np.float32).ravel()
  a = np.asarray(active).ravel()
  n = s.size
  keep = n - int(np.round(np.float32(sparsity) * n))
  order = np.lexsort((np.arange(n), ~a, -s))
  out = np.zeros(n, bool)
  out[order[:keep]] = True
  return out.reshape(np.shape(score))


def np_n_m(score, active, n, m, axis):
  s = np.moveaxis(np.asarray(score, np.float32), axis, -1)
  a = np.moveaxis(np.asarray(active), axis, -1)
  out = np.zeros(s.shape, bool)
  for idx in np.ndindex(*s.shape[:-1]):
    for g in range(s.shape[-1] // m):
      sl = slice(g * m, (g + 1) * m)
      order = np.lexsort((np.arange(m), ~a[idx][sl], -s[idx][sl]))
      block = np.zeros(m, bool)
      block[order[:n]] = True
      out[idx][sl] = block
  return np.moveaxis(out, -1, axis)


def random_tree(seed, shapes=SHAPES):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {
    f"p{i}": jax.random.normal(k, s)
    for i, (k, s) in enumerate(zip(keys, shapes, strict=True))
  }


@pytest.fixture(scope="module", params=["cpu", "device"])
def per_leaf_run(request):
  """Runs periodic_mask(sgd) with every=1 and a per-step target; records everything
  (on both forms of the refresh)."""
  for _ in _forced(request.param):
    return _per_leaf_run()


def _per_leaf_run():
  schedule = lambda count: jnp.asarray(TARGETS)[jnp.minimum(count, len(TARGETS) - 1)]
  tx = magma.periodic_mask(optax.sgd(0.1), sparsity=schedule, every=1)
  params = random_tree(0)
  state = tx.init(params)
  step = jax.jit(tx.update)
  records = []
  for t in range(len(TARGETS)):
    grads = random_tree(100 + t)
    old_mask = state.mask
    updates, state = step(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    records.append((params, grads, old_mask, state, updates, new_params))
    params = new_params
  return records, step


def test_exact_sparsity_every_shape_every_step(per_leaf_run):
  records, _ = per_leaf_run
  for t, (params, grads, old_mask, state, _, new_params) in enumerate(records):
    regrown = 0
    for name in params:
      p, g = np.asarray(params[name]), np.asarray(grads[name])
      score = np.abs(p).astype(np.float32) * np.abs(g).astype(np.float32)
      want = np_keep(score, np.asarray(old_mask[name]), TARGETS[t])
      np.testing.assert_array_equal(np.asarray(state.mask[name]), want)
      regrown += int(np.sum(want & ~np.asarray(old_mask[name])))
      # Pruned weights are exactly zero after optax.apply_updates.
      assert np.all(np.asarray(new_params[name])[~want] == 0.0)
    assert int(state.num_regrown) == regrown
    assert float(state.target_sparsity) == pytest.approx(TARGETS[t])


def test_update_identity_is_exact(per_leaf_run):
  records, _ = per_leaf_run
  for params, grads, _, state, updates, new_params in records:
    for name in params:
      p, u = np.asarray(params[name]), np.asarray(updates[name])
      m = np.asarray(state.mask[name])
      np.testing.assert_array_equal(p + u, m * (p + u))
      # Kept weights take the inner SGD(0.1) step; pruned ones are exactly zero.
      g = np.asarray(grads[name])
      want = np.where(m, p - 0.1 * g, 0.0)
      np.testing.assert_allclose(new_params[name], want, rtol=1e-6, atol=1e-7)


def test_no_recompilation(per_leaf_run):
  _, step = per_leaf_run
  assert step._cache_size() == 1


def test_reported_sparsity(per_leaf_run):
  records, _ = per_leaf_run
  _, _, _, state, _, _ = records[-1]
  masks = [np.asarray(m) for m in jax.tree.leaves(state.mask)]
  pruned = sum((~m).sum() for m in masks) / sum(m.size for m in masks)
  assert float(state.sparsity) == pytest.approx(pruned, abs=1e-6)


@BOTH_FORMS
def test_ties_keep_active_then_low_index():
  params = {"w": jnp.ones((2, 4))}
  tx = magma.periodic_mask(
    optax.sgd(0.0), sparsity=0.5, every=1, importance="magnitude"
  )
  state = tx.init(params)
  step = jax.jit(tx.update)
  _, state = step(params, state, params)
  # All scores tie, all active: the four lowest flat indices stay.
  np.testing.assert_array_equal(
    np.asarray(state.mask["w"]).ravel(), [1, 1, 1, 1, 0, 0, 0, 0]
  )
  # Ties with a current mask: active entries win over inactive ones.
  old = jnp.array([[False, True, False, True], [False, True, False, True]])
  state = state._replace(mask={"w": old})
  _, state = step(params, state, params)
  np.testing.assert_array_equal(np.asarray(state.mask["w"]), np.asarray(old))


@BOTH_FORMS
def test_nan_scores_rank_last():
  params = {"w": jnp.array([1.0, jnp.nan, 3.0, 2.0])}
  tx = magma.periodic_mask(
    optax.sgd(0.0), sparsity=0.5, every=1, importance="magnitude"
  )
  _, state = tx.update(params, tx.init(params), params)
  np.testing.assert_array_equal(np.asarray(state.mask["w"]), [0, 0, 1, 1])


@BOTH_FORMS
def test_global_ranking_matches_numpy():
  params = random_tree(1, [(3, 4), (10,)])
  grads = random_tree(2, [(3, 4), (10,)])
  tx = magma.periodic_mask(optax.sgd(0.1), sparsity=0.6, every=1, ranking="global")
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  score = np.concatenate(
      [np.abs(np.asarray(params[k])).ravel() * np.abs(np.asarray(grads[k])).ravel()
       for k in ("p0", "p1")]
  )  # fmt: skip
  want = np_keep(score, np.ones(score.size, bool), 0.6)
  got = np.concatenate([np.asarray(state.mask[k]).ravel() for k in ("p0", "p1")])
  np.testing.assert_array_equal(got, want)


@BOTH_FORMS
@pytest.mark.parametrize("axis", [-1, 0])
def test_n_m_structure(axis):
  params = random_tree(3, [(4, 8)])
  grads = random_tree(4, [(4, 8)])
  tx = magma.periodic_mask(optax.sgd(0.1), structure=(2, 4), every=1, axis=axis)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  m = np.asarray(state.mask["p0"])
  score = np.abs(np.asarray(params["p0"])) * np.abs(np.asarray(grads["p0"]))
  np.testing.assert_array_equal(m, np_n_m(score, np.ones_like(m), 2, 4, axis))
  groups = np.moveaxis(m, axis, -1).reshape(-1, 4)
  assert np.all(groups.sum(-1) == 2)
  new = np.asarray(optax.apply_updates(params, updates)["p0"])
  assert np.all(np.moveaxis(new != 0, axis, -1).reshape(-1, 4).sum(-1) <= 2)
  assert float(state.sparsity) == pytest.approx(0.5)


@BOTH_FORMS
def test_n_m_ties_are_deterministic():
  params = {"w": jnp.ones((2, 8))}
  tx = magma.periodic_mask(optax.sgd(0.0), structure=(1, 4), every=1)
  _, state = tx.update(params, tx.init(params), params)
  np.testing.assert_array_equal(
    np.asarray(state.mask["w"]), [[1, 0, 0, 0, 1, 0, 0, 0]] * 2
  )


def test_weights_stay_zero_over_many_steps():
  params = random_tree(5, [(6, 8), (8,)])
  tx = magma.periodic_mask(
    optax.adam(0.05), sparsity=0.7, every=10, importance="magnitude"
  )
  state = tx.init(params)
  step = jax.jit(tx.update)
  for t in range(25):
    grads = random_tree(200 + t, [(6, 8), (8,)])
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
    for k in params:
      m = np.asarray(state.mask[k])
      assert np.all(np.asarray(params[k])[~m] == 0.0), (t, k)
      assert (~m).sum() == round(0.7 * m.size)
  assert step._cache_size() == 1


@BOTH_FORMS
def test_regrown_weights_have_zeroed_moments():
  b1, b2 = 0.9, 0.999
  shape = (4, 6)
  tx = magma.periodic_mask(
    optax.adam(0.01, b1=b1, b2=b2),
    sparsity=0.5,
    every=3,
    importance=lambda p, g: jnp.abs(g),  # gradient-based growth: regrowth happens
  )
  params = random_tree(6, [shape])
  state = tx.init(params)
  step = jax.jit(tx.update)
  seen_regrowth = False
  for t in range(9):
    grads = random_tree(300 + t, [shape])
    old_mask = np.asarray(state.mask["p0"])
    mu0 = np.asarray(state.inner_state[0].mu["p0"])
    nu0 = np.asarray(state.inner_state[0].nu["p0"])
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
    g = np.asarray(grads["p0"])
    mu1 = np.asarray(state.inner_state[0].mu["p0"])
    nu1 = np.asarray(state.inner_state[0].nu["p0"])
    new_mask = np.asarray(state.mask["p0"])
    regrown = new_mask & ~old_mask
    if t % 3 == 0:
      assert int(state.num_regrown) == regrown.sum()
    else:
      np.testing.assert_array_equal(new_mask, old_mask)
    # Regrown entries start from zero moments; every other entry keeps its history.
    want_mu = np.where(regrown, 0.0, mu0) * b1 + (1 - b1) * g
    want_nu = np.where(regrown, 0.0, nu0) * b2 + (1 - b2) * g * g
    np.testing.assert_allclose(mu1, want_mu, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(nu1, want_nu, rtol=1e-6, atol=1e-8)
    seen_regrowth |= bool(regrown.any())
    assert np.all(np.asarray(params["p0"])[~new_mask] == 0.0)
  assert seen_regrowth


def test_sparsity_zero_equals_inner_exactly():
  params = random_tree(7, [(3, 5)])
  grads = random_tree(8, [(3, 5)])
  tx = magma.periodic_mask(optax.adam(1e-2), sparsity=0.0, every=1)
  ref = optax.adam(1e-2)
  s, r = tx.init(params), ref.init(params)
  step, ref_step = jax.jit(tx.update), jax.jit(ref.update)
  for _ in range(3):
    u, s = step(grads, s, params)
    v, r = ref_step(grads, r, params)
    np.testing.assert_array_equal(np.asarray(u["p0"]), np.asarray(v["p0"]))


def test_param_mask_reaches_inner_and_where_scopes():
  def echo_mask():
    def update(updates, state, params=None, *, param_mask=None, **extra):
      out = jax.tree.map(
        lambda u, m: u if isinstance(m, optax.MaskedNode) else m.astype(u.dtype),
        updates,
        param_mask,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
      )
      return out, state

    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)

  params = {"w": jnp.arange(1.0, 9.0), "bias": jnp.ones(3)}
  tx = magma.periodic_mask(
    echo_mask(),
    sparsity=0.5,
    every=1,
    importance="magnitude",
    where=lambda path, x: x.size > 3,
  )
  grads = jax.tree.map(lambda x: 2 * jnp.ones_like(x), params)
  updates, state = tx.update(grads, tx.init(params), params)
  assert isinstance(state.mask["bias"], optax.MaskedNode)
  np.testing.assert_array_equal(np.asarray(updates["bias"]), [2.0, 2.0, 2.0])
  want_mask = np.arange(8) >= 4
  np.testing.assert_array_equal(np.asarray(state.mask["w"]), want_mask)
  np.testing.assert_array_equal(
    np.asarray(updates["w"]), np.where(want_mask, 1.0, -np.arange(1.0, 9.0))
  )
  got = optax.tree_utils.tree_get(state, "PeriodicMaskState")
  assert got is state


def test_refresh_window_start_every_end():
  tx = magma.periodic_mask(
    optax.sgd(0.0), sparsity=0.5, every=3, start=2, end=8, schedule="linear"
  )
  params = {"w": jnp.arange(1.0, 41.0)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  targets = []
  for _ in range(14):
    _, state = step(params, state, params)
    targets.append(float(state.target_sparsity))
  ramp = magma.linear_sparsity_schedule(0.5, begin_step=2, end_step=8)
  want, current = [], 0.0
  for t in range(14):
    if t >= 2 and (t - 2) % 3 == 0 and t <= 8:
      current = float(ramp(t))
    want.append(current)
  np.testing.assert_allclose(targets, want, atol=1e-7)
  assert targets[-1] == pytest.approx(0.5)


@pytest.mark.parametrize("power", [1.0, 3.0])
def test_polynomial_schedule_matches_formula(power):
  sched = magma.polynomial_sparsity_schedule(
    0.8, begin_step=10, end_step=50, initial_sparsity=0.1, power=power
  )
  for t in [0, 10, 20, 30, 49, 50, 100]:
    frac = min(max(t - 10, 0), 40) / 40
    want = 0.8 + (0.1 - 0.8) * (1 - frac) ** power
    assert float(jax.jit(sched)(t)) == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(sparsity=-0.1, every=1), "sparsity"),
    (dict(sparsity=1.0, every=1), "sparsity"),
    (dict(sparsity=0.5, every=0), "every"),
    (dict(sparsity=0.5, every=1.5), "every"),
    (dict(structure=(5, 4), every=1), "structure"),
    (dict(structure=(0, 4), every=1), "structure"),
    (dict(structure=(2, 4), sparsity=0.3, every=1), "contradicts"),
    (dict(sparsity=0.5, every=1, start=-1), "start"),
    (dict(sparsity=0.5, every=1, start=5, end=2), "end"),
    (dict(sparsity=0.5, every=1, importance="random"), "importance"),
    (dict(sparsity=0.5, every=1, ranking="layer"), "ranking"),
    (dict(sparsity=0.5, every=1, schedule="cosine"), "schedule"),
    (dict(sparsity=0.5, every=1, schedule="cubic"), "end"),
    (dict(every=1), "sparsity is required"),
  ],
)
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    magma.periodic_mask(optax.sgd(0.1), **kwargs)


def test_bad_schedule_arguments_raise():
  with pytest.raises(ValueError, match="final_sparsity"):
    magma.polynomial_sparsity_schedule(1.0, begin_step=0, end_step=10)
  with pytest.raises(ValueError, match="end_step"):
    magma.linear_sparsity_schedule(0.5, begin_step=10, end_step=10)


def test_bad_inputs_at_init_and_update():
  tx = magma.periodic_mask(optax.sgd(0.1), structure=(2, 4), every=1)
  with pytest.raises(ValueError, match="multiple of 4"):
    tx.init({"w": jnp.ones((3, 5))})
  tx = magma.periodic_mask(optax.sgd(0.1), sparsity=0.5, every=1)
  params = {"w": jnp.ones(4)}
  with pytest.raises(ValueError, match="needs the parameters"):
    tx.update(params, tx.init(params))
  tx = magma.periodic_mask(
    optax.sgd(0.1), sparsity=0.5, every=1, importance=lambda p, g: jnp.ones(2)
  )
  with pytest.raises(ValueError, match="one score per entry"):
    tx.update(params, tx.init(params), params)
  # It makes the parameter mask: one handed to it (nested in another periodic_mask,
  # or passed by hand) is refused, not a TypeError from optax.chain.
  tx = magma.periodic_mask(optax.sgd(0.1), sparsity=0.5, every=1)
  with pytest.raises(ValueError, match="takes none"):
    tx.update(params, tx.init(params), params, param_mask={"w": jnp.ones(4, bool)})
  nested = magma.periodic_mask(
    optax.chain(
      magma.periodic_mask(optax.sgd(0.1), sparsity=0.5, every=1), optax.sgd(0.1)
    ),
    sparsity=0.25,
    every=1,
  )
  with pytest.raises(ValueError, match="takes none"):
    nested.update(params, nested.init(params), params)


def test_top_k_with_heavy_ties_matches_numpy():
  from magma_optax.pruning.topk import top_k_mask as _top_k_mask

  rng = np.random.default_rng(9)
  top_k = jax.jit(_top_k_mask)
  values = np.array([-np.inf, -1.5, -0.0, 0.0, 1e-30, 2.0, np.inf], np.float32)
  n = 37  # one shape: one compilation
  for trial in range(12):
    score = rng.choice(values, size=n) + np.float32(0.0)  # as _scores does
    active = rng.random(n) < 0.5
    k = int(rng.integers(0, n + 1))
    got = np.asarray(top_k(jnp.asarray(score), jnp.asarray(active), k))
    want = np_keep(score, active, 1.0 - k / n)
    assert got.sum() == k, trial
    np.testing.assert_array_equal(got, want, err_msg=str(trial))


def _large_leaf_cases(rng, shape):
  """(name, score, active, k) cases for the sampled search (leaves of >= 2**16)."""
  n = int(np.prod(shape))
  cont = np.abs(rng.standard_normal(n) * rng.standard_normal(n))
  zeros = cont.copy()
  zeros[rng.permutation(n)[: int(0.3 * n)]] = 0.0  # pruned weights score 0
  nonzero = int(np.sum(zeros > 0))
  tied_cut = cont.copy()
  order = np.argsort(-tied_cut, kind="stable")
  k_tied = n // 3
  tied_cut[order[k_tied - 2 : k_tied + 2]] = tied_cut[order[k_tied - 1]]  # 4 tie
  infs = cont.copy()
  infs[rng.permutation(n)[:300]] = np.inf
  infs[rng.permutation(n)[:300]] = -np.inf  # NaN scores become -inf
  cases = [
    ("continuous", cont, int(rng.integers(1, n))),
    ("with +-inf", infs, n // 2),
    ("with +-inf, cut in the +inf block", infs, 100),
    ("ramp cut just above the zeros", zeros, nonzero - 50),
    ("constant target after a refresh", zeros, nonzero),
    ("few distinct values", rng.integers(0, 5, n).astype(float), n // 3 + 7),
    ("4 ties at the cut, 2 fit", tied_cut, k_tied),
    ("lognormal", np.exp(4 * rng.standard_normal(n)), n // 20),
    ("k = 0", cont, 0),
    ("k = 1", cont, 1),
    ("k = n - 1", zeros, n - 1),
    ("k = n", cont, n),
  ]
  for name, score, k in cases:
    score = (score.astype(np.float32) + np.float32(0.0)).reshape(shape)
    yield name, score, rng.random(shape) < 0.5, k


def test_top_k_of_large_leaves_matches_numpy():
  # Leaves of >= 2**16 entries take the sampled search (bracket from a grid sample,
  # interpolation, a step over the zero block, tie splitting by index walk or
  # bisection); smaller ones the bit bisection tested above.
  from magma_optax.pruning.topk import top_k_mask as _top_k_mask
  from magma_optax.pruning.topk import top_k_masks as _top_k_masks

  rng = np.random.default_rng(11)
  shape = (256, 512)
  top_k = jax.jit(_top_k_mask)
  for name, score, active, k in _large_leaf_cases(rng, shape):
    got = np.asarray(top_k(jnp.asarray(score), jnp.asarray(active), k))
    want = np_keep(score, active, 1.0 - k / score.size)
    assert got.sum() == k, name
    np.testing.assert_array_equal(got, want, err_msg=name)

  # Global ranking: a second, 1-D leaf joins the sample and the counts.
  top_k_2 = jax.jit(_top_k_masks)
  other = np.abs(rng.standard_normal(3000)).astype(np.float32)
  for name, score, active, k in list(_large_leaf_cases(rng, shape))[:5]:
    got = top_k_2(
      [jnp.asarray(score), jnp.asarray(other)],
      [jnp.asarray(active), jnp.ones(3000, bool)],
      k,
    )
    flat = np.concatenate([np.asarray(g).ravel() for g in got])
    want = np_keep(
      np.concatenate([score.ravel(), other]),
      np.concatenate([active.ravel(), np.ones(3000, bool)]),
      1.0 - k / (score.size + 3000),
    )
    np.testing.assert_array_equal(flat, want, err_msg=name)


@BOTH_FORMS
def test_ordinary_steps_do_not_copy_the_masks():
  # The refresh is a while loop of zero or one iteration, which updates the masks
  # in place; a lax.cond copied every mask on every step (measured: +13 % per step
  # on XLA:CPU with donated buffers). Checked on the compiled, donated step.
  params = {"w": jnp.ones((64, 48)), "b": jnp.ones(48)}
  tx = magma.periodic_mask(optax.adam(1e-3), sparsity=0.5, every=10)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def step_keeping_the_old_masks(p, s, g):  # positive control: must copy them
    u, new = tx.update(g, s, p)
    return optax.apply_updates(p, u), new, s.mask

  def mask_copies(fn):
    return entry_copies(fn, (params, tx.init(params), params), r"pred\[[0-9,]+\]")

  assert not mask_copies(step)
  # The same search finds the copies where they must be (both leaves' masks), so a
  # change in how XLA prints HLO cannot make the check above vacuous.
  found = mask_copies(step_keeping_the_old_masks)
  assert any("pred[64,48]" in c for c in found) and any("pred[48]" in c for c in found)


@BOTH_FORMS
def test_global_ranking_ties_follow_leaf_order():
  params = {"a": jnp.ones((2, 3)), "b": jnp.ones(4)}  # flattened order: a, then b
  tx = magma.periodic_mask(
    optax.sgd(0.0), sparsity=0.4, every=1, importance="magnitude", ranking="global"
  )
  _, state = jax.jit(tx.update)(params, tx.init(params), params)
  np.testing.assert_array_equal(np.asarray(state.mask["a"]), np.ones((2, 3), bool))
  np.testing.assert_array_equal(np.asarray(state.mask["b"]), [0, 0, 0, 0])


@pytest.mark.parametrize("shape", [(4, 2**23), (2**24 + 4,), (4, 16, 2**19)])
def test_counts_stay_exact_beyond_float32_integers(shape):
  # Counts are float32 sums where XLA:CPU vectorises them (the last shape first
  # counts chunks of 16 rows in uint8). Here the true count is odd and above 2**24,
  # so no float32 number equals it: a plain float32 sum would be off, and the count
  # must switch to int32 partial sums.
  from magma_optax.pruning.topk import count_true as _count

  n = int(np.prod(shape))
  assert int(np.float32(n - 1)) != n - 1
  mask = jnp.ones(shape, bool).reshape(-1).at[n // 3].set(False).reshape(shape)
  assert int(jax.jit(lambda m: _count([m]))(mask)) == n - 1


def test_inject_hyperparams_needs_static_ints_and_says_so():
  params = {"w": jnp.arange(8.0).reshape(2, 4)}
  with pytest.raises(ValueError, match="static_args=\\('every', 'start'"):
    optax.inject_hyperparams(magma.periodic_mask)(
      optax.sgd(0.1), sparsity=0.5, every=1
    ).init(params)
  tx = optax.inject_hyperparams(
    magma.periodic_mask, static_args=("every", "start", "axis")
  )(optax.sgd(0.1), sparsity=0.5, every=1)
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(params, state, params)
  # The injected sparsity is used: half of the 8 weights are pruned.
  pruned = optax.apply_updates(params, updates)["w"]
  assert int(jnp.sum(pruned == 0)) == 4


@BOTH_FORMS
def test_sparsity_schedule_beyond_one_is_clipped():
  params = {"w": jnp.arange(1.0, 17.0).reshape(4, 4)}
  tx = magma.periodic_mask(optax.sgd(0.0), sparsity=lambda c: 0.5 + c, every=1)
  state, step = tx.init(params), jax.jit(tx.update)
  for _ in range(3):
    _, state = step(params, state, params)
  assert float(state.target_sparsity) == 1.0  # 2.5 clipped
  assert float(state.sparsity) == 1.0


@BOTH_FORMS
@pytest.mark.parametrize("ranking", ["per_leaf", "global"])
def test_zero_size_leaves(ranking):
  params = {"e": jnp.zeros((0, 4)), "w": jnp.arange(1.0, 17.0).reshape(4, 4)}
  inner = magma.sparse_state(optax.adam(1e-2), mode="compact", density=0.5)
  tx = magma.periodic_mask(inner, sparsity=0.5, every=1, ranking=ranking)
  u, state = jax.jit(tx.update)(params, tx.init(params), params)
  assert u["e"].shape == (0, 4)
  assert int(np.sum(np.asarray(state.mask["w"]))) == 8


@BOTH_FORMS
def test_regrown_moments_reset_inside_masked_subtrees():
  # optax.masked with a mask prefix puts a MaskedNode in place of the whole "b"
  # subtree of Adam's moments; the regrowth reset must still find mu and nu (the
  # moments were skipped when found by exact structure only).
  b1 = 0.9
  params = {"a": jnp.ones(8), "b": {"c": jnp.ones(2), "d": jnp.ones(2)}}
  inner = optax.masked(optax.adam(0.01, b1=b1), {"a": True, "b": False})
  tx = magma.periodic_mask(
    inner, sparsity=0.5, every=1, importance=lambda p, g: jnp.abs(g)
  )
  state, step = tx.init(params), jax.jit(tx.update)
  assert isinstance(state.inner_state.inner_state[0].mu["b"], optax.MaskedNode)
  seen_regrowth = False
  for t in range(4):
    g = jnp.asarray(np.random.default_rng(t).normal(size=8), jnp.float32)
    grads = {"a": g, "b": {"c": jnp.ones(2), "d": jnp.ones(2)}}
    old_mask = np.asarray(state.mask["a"])
    mu0 = np.asarray(state.inner_state.inner_state[0].mu["a"])
    _, state = step(grads, state, params)
    regrown = np.asarray(state.mask["a"]) & ~old_mask
    seen_regrowth |= bool(regrown.any())
    want = np.where(regrown, 0.0, mu0) * b1 + (1 - b1) * np.asarray(g)
    mu1 = np.asarray(state.inner_state.inner_state[0].mu["a"])
    np.testing.assert_allclose(mu1, want, rtol=1e-6, atol=1e-7)
  assert seen_regrowth


@BOTH_FORMS
def test_only_zero_size_leaves_prune_nothing():
  params = {"e": jnp.zeros((0, 4))}
  tx = magma.periodic_mask(optax.adam(0.1), sparsity=0.5, every=1, ranking="global")
  u, state = jax.jit(tx.update)(params, tx.init(params), params)
  assert u["e"].shape == (0, 4)
  assert float(state.sparsity) == 0.0  # was 1.0: 1 - 0 kept / max(0, 1)
  assert float(state.target_sparsity) == 0.5


def np_tile_sums(score, block):
  r, c = block
  *lead, rows, cols = score.shape
  return score.reshape(*lead, rows // r, r, cols // c, c).sum(axis=(-3, -1))


def np_untile(tiles, block):
  return np.repeat(np.repeat(tiles, block[0], axis=-2), block[1], axis=-1)


@BOTH_FORMS
@pytest.mark.parametrize("ranking", ["per_leaf", "global"])
def test_tile_masks_match_numpy(ranking):
  block = (2, 4)
  # A stacked leaf (tiles over the last two axes), and leaves of one tile grid.
  shapes = [(4, 8), (3, 2, 12), (4, 8), (4, 8)]
  schedule = lambda count: jnp.asarray([0.5, 0.25, 0.75])[jnp.minimum(count // 2, 2)]
  tx = magma.periodic_mask(
    optax.sgd(0.1), sparsity=schedule, every=2, block=block, ranking=ranking
  )
  params = random_tree(7, shapes)
  state, step = tx.init(params), jax.jit(tx.update)
  for t in range(6):
    grads = random_tree(400 + t, shapes)
    old = {k: np.asarray(v) for k, v in state.mask.items()}
    updates, state = step(grads, state, params)
    keys = sorted(params)
    scores = [
      np_tile_sums(np.abs(np.asarray(params[k])) * np.abs(np.asarray(grads[k])), block)
      for k in keys
    ]
    actives = [np_tile_sums(old[k], block) > 0 for k in keys]
    target = float(schedule(t))
    if t % 2:  # no refresh: the mask stays
      want = [old[k] for k in keys]
    elif ranking == "per_leaf":
      want = [
        np_untile(np_keep(s, a, target), block)
        for s, a in zip(scores, actives, strict=True)
      ]
    else:
      flat = np_keep(
        np.concatenate([s.ravel() for s in scores]),
        np.concatenate([a.ravel() for a in actives]),
        target,
      )
      sizes = np.cumsum([0] + [s.size for s in scores])
      want = [
        np_untile(flat[a:b].reshape(s.shape), block)
        for s, a, b in zip(scores, sizes[:-1], sizes[1:], strict=True)
      ]
    for k, w in zip(keys, want, strict=True):
      np.testing.assert_array_equal(np.asarray(state.mask[k]), w)
    params = optax.apply_updates(params, updates)
    for k in keys:  # pruned tiles are exactly zero after every step
      assert np.all(np.asarray(params[k])[~np.asarray(state.mask[k])] == 0.0)
  assert step._cache_size() == 1


@BOTH_FORMS
def test_tile_masks_balanced_over_shards_match_numpy():
  block = (2, 4)
  shapes = [(8, 16), (3, 4, 16)]
  # A callable, as tile_shards gives; p1 also split along its stacking axis.
  parts_of = {"p0": (2, 2), "p1": (3, 1, 2)}
  schedule = lambda count: jnp.asarray([0.5, 0.25, 0.75])[jnp.minimum(count // 2, 2)]
  tx = magma.periodic_mask(
    optax.sgd(0.1), sparsity=schedule, every=2, block=block,
    shards=lambda path, leaf: parts_of[path[-1].key],
  )  # fmt: skip
  params = random_tree(8, shapes)
  state, step = tx.init(params), jax.jit(tx.update)
  balanced_differently = False
  for t in range(3):  # refreshes at 0 and 2 (targets 0.5, 0.25)
    grads = random_tree(500 + t, shapes)
    old = {k: np.asarray(v) for k, v in state.mask.items()}
    updates, state = step(grads, state, params)
    for k, parts in parts_of.items():
      score = np.abs(np.asarray(params[k])) * np.abs(np.asarray(grads[k]))
      tiles = shard_parts(np_tile_sums(score, block), parts)
      active = shard_parts(np_tile_sums(old[k], block) > 0, parts)
      if t % 2:
        want = old[k]
      else:
        keep = np.empty(tiles.shape, bool)
        for i in np.ndindex(*parts):
          keep[i] = np_keep(tiles[i], active[i], float(schedule(t)))
        n = len(parts)
        want = np_untile(join_shard_parts(keep, n), block)
        one_top_k = np_untile(
          np_keep(
            join_shard_parts(tiles, n), join_shard_parts(active, n), float(schedule(t))
          ),
          block,
        )
        balanced_differently |= not np.array_equal(want, one_top_k)
      np.testing.assert_array_equal(np.asarray(state.mask[k]), want, err_msg=k)
    params = optax.apply_updates(params, updates)
  assert balanced_differently  # the per-part top-k is not the leaf's top-k here
  assert step._cache_size() == 1
  with pytest.raises(ValueError, match="ranking='per_leaf'"):
    magma.periodic_mask(
      optax.sgd(0.1), sparsity=0.5, every=1, block=block, shards=(2, 1),
      ranking="global",
    )  # fmt: skip
  with pytest.raises(ValueError, match="give block too"):
    magma.periodic_mask(optax.sgd(0.1), sparsity=0.5, every=1, shards=(2, 1))
  tx = magma.periodic_mask(
    optax.sgd(0.1), sparsity=0.5, every=1, block=block, shards=(3, 1)
  )
  with pytest.raises(ValueError, match=r"leaf \['p0'\] .* multiples of \(6, 4\)"):
    tx.init(params)
  # Rounded per part: 4 tiles at sparsity 0.9 keep none (the leaf's 16 would keep
  # 2), a whole layer pruned: refused. 0.75 keeps one per part; zero-size leaves
  # have nothing to split.
  w = {"e": jnp.zeros((0, 6)), "w": jnp.ones((8, 8))}
  for sparsity, ok in ((0.9, False), (0.75, True)):
    tx = magma.periodic_mask(
      optax.sgd(0.1), sparsity=sparsity, every=1, block=(2, 2), shards=(2, 2)
    )
    if ok:
      _, state = tx.update(w, tx.init(w), w)
      assert int(state.mask["w"].sum()) == 4 * 4
    else:
      with pytest.raises(ValueError, match=r"parts of 4, and sparsity=0.9 keeps none"):
        tx.init(w)


@BOTH_FORMS
def test_tile_ties_keep_active_then_low_tile_index():
  params = {"w": jnp.ones((4, 4))}
  tx = magma.periodic_mask(
    optax.sgd(0.0), sparsity=0.5, every=1, importance="magnitude", block=(2, 2)
  )
  state = tx.init(params)
  _, state = tx.update(params, state, params)
  # All tiles tie and are active: tiles 0 and 1 (the top row of tiles) stay.
  np.testing.assert_array_equal(
    np.asarray(state.mask["w"]), np_untile(np.array([[1, 1], [0, 0]], bool), (2, 2))
  )
  # With a current mask, active tiles win over inactive ones.
  old = np_untile(np.array([[0, 1], [1, 0]], bool), (2, 2))
  _, state = tx.update(params, state._replace(mask={"w": jnp.asarray(old)}), params)
  np.testing.assert_array_equal(np.asarray(state.mask["w"]), old)


def test_tile_arguments_and_shapes_are_checked():
  with pytest.raises(ValueError, match="block must be"):
    magma.periodic_mask(optax.sgd(0.1), sparsity=0.5, every=1, block=(0, 4))
  with pytest.raises(ValueError, match="not both"):
    magma.periodic_mask(optax.sgd(0.1), structure=(2, 4), every=1, block=(2, 2))
  tx = magma.periodic_mask(optax.sgd(0.1), sparsity=0.5, every=1, block=(2, 4))
  with pytest.raises(ValueError, match=r"leaf \['w'\] has shape \(4, 6\)"):
    tx.init({"w": jnp.ones((4, 6))})
  with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(8,\)"):
    tx.init({"b": jnp.ones(8), "w": jnp.ones((4, 8))})
  # Scoped out with `where`, the bias is left alone.
  tx = magma.periodic_mask(
    optax.sgd(0.1),
    sparsity=0.5,
    every=1,
    block=(2, 4),
    where={"b": False, "e": True, "w": True},
  )
  params = {"b": jnp.ones(8), "e": jnp.zeros((0, 8)), "w": jnp.ones((4, 8))}
  u, state = jax.jit(tx.update)(params, tx.init(params), params)
  assert int(np.asarray(state.mask["w"]).sum()) == 16
  assert u["e"].shape == (0, 8)  # zero-size leaves tile trivially


def test_shards_on_explicit_axes_are_checked_at_init_and_keep_the_masks_sharded():
  # A (1, 1) mesh of Explicit axes (no jax.set_mesh: the arrays' mesh is used).
  P = jax.sharding.PartitionSpec
  explicit = (jax.sharding.AxisType.Explicit,) * 2
  mesh = jax.make_mesh((1, 1), ("x", "y"), axis_types=explicit)
  sharding = jax.sharding.NamedSharding(mesh, P("x", None, None))
  params = {"w": jax.device_put(jnp.arange(128.0).reshape(2, 8, 8), sharding)}
  kw = dict(sparsity=0.5, every=1, block=(2, 2))
  # The leading axis is sharded but not counted: its parts would span devices.
  with pytest.raises(ValueError, match="every part must lie on one device"):
    magma.periodic_mask(optax.sgd(0.1), shards=(2, 2), **kw).init(params)
  tx = magma.periodic_mask(optax.sgd(0.1), shards=(1, 2, 2), **kw)
  state = tx.init(params)  # plain init: the mask gets the parameter's type
  assert jax.typeof(state.mask["w"]).sharding.spec == P("x", None, None)
  step = jax.jit(tx.update)
  for _ in range(2):  # the refresh loop's carry keeps its type
    _, state = step(params, state, params)
  # Parts (2, 4, 4) of 8 tiles, 4 kept in each: 16 entries.
  per_part = np.asarray(state.mask["w"]).reshape(2, 2, 4, 2, 4).sum(axis=(0, 2, 4))
  np.testing.assert_array_equal(per_part, np.full((2, 2), 16))


@pytest.mark.parametrize("block", [None, (2, 4)])
def test_leaves_of_one_shape_share_one_refresh_computation(block):
  # On XLA:CPU every step pays for each buffer of the program, refresh or not, so
  # the refresh must not grow with the number of same-shaped leaves.
  def loops(n):
    params = {f"w{i}": jnp.ones((4, 8)) for i in range(n)}
    tx = magma.periodic_mask(optax.adam(0.1), sparsity=0.5, every=3, block=block)
    text = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
    return text.count("stablehlo.while")

  assert loops(8) == loops(2)


def test_stacks_of_leaves_hold_at_most_the_cap():
  from magma_optax._core import trees as _trees

  xs = [jnp.zeros((4, 8))] * 5 + [jnp.zeros(3), jnp.zeros((4, 8), jnp.bool_)]
  assert _trees.same_shape_groups(xs, 64) == [[0, 1], [2, 3], [4], [5], [6]]
  assert _trees.same_shape_groups(xs[:2], 31) == [[0], [1]]  # a leaf over it: alone


@BOTH_FORMS
@pytest.mark.parametrize("importance", ["callable", "magnitude"])
@pytest.mark.parametrize("ranking", ["per_leaf", "global"])
def test_tiles_with_nan_inf_and_signed_zero_scores_match_numpy(ranking, importance):
  # Built-in entry scores are summed per tile without the entry-level NaN -> -inf
  # select (so they fuse into the sums); a callable's are written out first. The
  # tiles must rank as if the select were there, either way.
  block = (2, 2)
  w = np.arange(1.0, 33.0, dtype=np.float32).reshape(4, 8)
  w[0, 0] = np.nan  # tile (0, 0): NaN with finite entries
  w[0, 2], w[1, 3] = np.nan, np.inf  # tile (0, 1): NaN and +inf
  w[2, 0] = np.inf  # tile (1, 0): +inf alone: ranks first
  w[2, 2:4] = -np.inf  # custom scores below: -inf and +inf in one tile (1, 1)
  w[3, 2] = np.inf
  w[2:4, 4:6] = -0.0  # tile (1, 2): all -0.0
  w[0:2, 6:8] = 0.0  # tile (0, 3): all +0.0, ties with (1, 2)
  params = {"a": jnp.asarray(w), "b": jnp.asarray(w[::-1].copy())}
  if importance == "callable":
    score = lambda p, g: p  # the parameter itself: signed, with NaN and infinities
    np_score = lambda w: w
  else:
    score, np_score = importance, np.abs
  tx = magma.periodic_mask(
    optax.sgd(0.0),
    sparsity=0.5,
    every=1,
    block=block,
    importance=score,
    ranking=ranking,
  )
  _, state = jax.jit(tx.update)(params, tx.init(params), params)
  keys = sorted(params)
  tiles = []
  for k in keys:
    s = np_score(np.asarray(params[k], np.float32))
    s = np.where(np.isnan(s), -np.inf, s) + np.float32(0.0)
    with np.errstate(invalid="ignore"):
      t = np_tile_sums(s, block)
    tiles.append(np.where(np.isnan(t), -np.inf, t) + np.float32(0.0))
  active = [np.ones(t.shape, bool) for t in tiles]
  if ranking == "per_leaf":
    want = [np_keep(t, a, 0.5) for t, a in zip(tiles, active, strict=True)]
  else:
    flat = np_keep(np.concatenate([t.ravel() for t in tiles]), np.ones(16, bool), 0.5)
    want = [flat[:8].reshape(2, 4), flat[8:].reshape(2, 4)]
  for k, m in zip(keys, want, strict=True):
    np.testing.assert_array_equal(np.asarray(state.mask[k]), np_untile(m, block))


def _equal_products(rows):
  """(p, g) of shape (rows, 4): every tile of (1, 2) entries scores exactly the same
  per entry (even tiles: p = fl(a * b), g = 1; odd tiles: p = a, g = b), for a pair
  (a, b) whose tile sum differs if one product enters it unrounded (an FMA)."""
  rng = np.random.default_rng(0)
  for _ in range(10000):
    a, b = (
      rng.uniform(1, 2, 2).astype(np.float32),
      rng.uniform(1, 2, 2).astype(np.float32),
    )
    ab = a * b
    plain = np.float32(ab[0] + ab[1])
    fused = np.float32(np.float64(ab[0]) + np.float64(a[1]) * np.float64(b[1]))
    if plain != fused:
      break
  else:
    raise AssertionError("no pair found")
  p, g = np.zeros((rows, 4), np.float32), np.zeros((rows, 4), np.float32)
  p[:, :2], g[:, :2] = ab, 1.0
  p[:, 2:], g[:, 2:] = a, b
  return p, g


@BOTH_FORMS
@pytest.mark.machine_code
@pytest.mark.parametrize("ranking", ["per_leaf", "global"])
@pytest.mark.parametrize("importance", ["callable", "magnitude_grad"])
def test_tiles_of_equal_entry_scores_tie(importance, ranking):
  # Every tile's entries score the same bits, so all tiles tie and the lower half
  # of the tile indices is kept. Summing a product unrounded (XLA:CPU fusing the
  # callable's p * g into the tile sum as an FMA) broke the ties: every odd tile
  # was kept instead.
  p, g = _equal_products(32)
  score = (lambda p, g: p * g) if importance == "callable" else importance
  tx = magma.periodic_mask(
    optax.sgd(0.0),
    sparsity=0.5,
    every=1,
    block=(1, 2),
    importance=score,
    ranking=ranking,
  )
  params, grads = {"w": jnp.asarray(p)}, {"w": jnp.asarray(g)}
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  want = np.arange(64).reshape(32, 2) < 32
  np.testing.assert_array_equal(np.asarray(state.mask["w"])[:, ::2], want)


@BOTH_FORMS
@pytest.mark.machine_code
def test_tiles_rank_a_bfloat16_callable_on_its_rounded_output():
  # The callable computes in bfloat16; the tiles rank the sums of its (rounded)
  # outputs, as a reference on those outputs does. Fused into the sum, XLA skipped
  # the rounding (excess precision) and swapped two tiles here.
  imp = lambda p, g: jnp.abs(p * g)
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w": jax.random.normal(k1, (64, 64)).astype(jnp.bfloat16)}
  grads = {"w": jax.random.normal(k2, (64, 64)).astype(jnp.bfloat16)}
  tx = magma.periodic_mask(
    optax.sgd(0.0), sparsity=0.5, every=1, block=(2, 2), importance=imp
  )
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  s = np.asarray(imp(params["w"], grads["w"]).astype(jnp.float32))
  sums = np_tile_sums(s.astype(np.float64), (2, 2))
  want = np_keep(sums, np.ones(sums.shape, bool), 0.5)
  np.testing.assert_array_equal(np.asarray(state.mask["w"]), np_untile(want, (2, 2)))


@BOTH_FORMS
@pytest.mark.parametrize("jit", [False, True])
def test_signed_zero_scores_tie(jit):
  # -0.0 and +0.0 tie, so the lower index is kept: the two -0.0 entries come first.
  # (A `+ 0.0` meant to turn -0.0 into +0.0 was folded away by XLA.)
  g = jnp.asarray([-0.0, -0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
  params = {"w": jnp.ones(8)}
  tx = magma.periodic_mask(
    optax.sgd(0.0), sparsity=0.25, every=1, importance=lambda p, g: g
  )
  update = jax.jit(tx.update) if jit else tx.update
  _, state = update({"w": g}, tx.init(params), params)
  np.testing.assert_array_equal(state.mask["w"], [1, 1, 0, 0, 1, 1, 1, 1])


REVERSE_CASES = {
  "element": {"sparsity": 0.5},
  "n_m": {"structure": (2, 4)},
  "tiles": {"sparsity": 0.5, "block": (2, 4)},
  "compact_inner": {"sparsity": 0.5, "inner": "compact"},
}


@pytest.mark.parametrize("refresh_form", ["device"], indirect=True)
@pytest.mark.parametrize("name, loop", [("element", "scan"), ("tiles", "python")])
def test_reverse_mode_through_device_refreshes(name, loop):
  test_reverse_mode_through_refreshes(REVERSE_CASES[name], loop)


@pytest.mark.parametrize("loop", ["python", "scan"])
@pytest.mark.parametrize("kw", REVERSE_CASES.values(), ids=REVERSE_CASES.keys())
def test_reverse_mode_through_refreshes(kw, loop):
  # d loss(params after 3 steps) / d learning rate through refreshes every step,
  # the steps unrolled in Python or in a lax.scan: the refresh's zero-or-one-step
  # loop, the moment reset nested in it and compact storage's loops take their
  # tangents from a cond (_xla_cpu.run_if's JVP rule). Before, jax.grad failed from
  # the second step (a while_loop has no reverse mode), and in a scan from the
  # first. Checked against a central finite difference (tolerance 2 %).
  kw = dict(kw)
  inner = kw.pop("inner", None)
  rng = np.random.default_rng(3)
  grads = jnp.asarray(rng.normal(size=(3, 4, 8)).astype(np.float32))
  w0 = jnp.asarray(rng.normal(size=(4, 8)).astype(np.float32))

  def loss(lr):
    base = optax.adam(lr)
    if inner == "compact":
      base = magma.sparse_state(base, mode="compact", density=0.5)
    tx = magma.periodic_mask(base, every=1, **kw)

    def step(carry, g):
      p, state = carry
      u, state = tx.update({"w": g * p["w"]}, state, p)
      return (optax.apply_updates(p, u), state), None

    carry = ({"w": w0}, tx.init({"w": w0}))
    if loop == "scan":
      carry, _ = jax.lax.scan(step, carry, grads)
    else:
      for g in grads:
        carry, _ = step(carry, g)
    return jnp.sum(carry[0]["w"] ** 2)

  got = float(jax.jit(jax.grad(loss))(0.01))
  h, value = 1e-3, jax.jit(loss)  # one compile, two calls
  want = (float(value(0.01 + h)) - float(value(0.01 - h))) / (2 * h)
  assert abs(want) > 1e-3  # the learning rate matters to the loss
  np.testing.assert_allclose(got, want, rtol=2e-2)
