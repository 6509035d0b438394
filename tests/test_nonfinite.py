"""Extreme and non-finite values: the masks poison nothing the base optimizer does not.

Block sums are float32; where they overflow or meet an inf/NaN entry the cosine is
undefined and the block keeps its previous score (``_alignment.next_score``), so the
score stays finite and the update is non-finite exactly where the base's is.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma

PARAMS = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
WRAPPERS = {
  "magma(adam)": lambda: magma.magma(optax.adam(1e-2), keep_prob=1.0),
  "adam_magma": lambda: magma.adam_magma(1e-2, keep_prob=1.0),
  "alignment_mask": lambda: optax.chain(
    magma.alignment_mask(keep_prob=1.0), optax.adam(1e-2)
  ),
  "skip_update": lambda: magma.skip_update(optax.adam(1e-2), keep_prob=1.0),
}


def _run(tx, grads):
  state, step = tx.init(PARAMS), jax.jit(tx.update)
  out = []
  for g in grads:
    u, state = step(g, state, PARAMS)
    out.append(u)
  return out, state


@pytest.mark.parametrize("name", sorted(WRAPPERS))
@pytest.mark.parametrize("magnitude", [1e17, 1e30])
def test_huge_finite_gradients_give_finite_updates_and_scores(name, magnitude):
  g = jax.tree.map(lambda x: jnp.full(x.shape, magnitude), PARAMS)
  ones = jax.tree.map(jnp.ones_like, PARAMS)
  updates, state = _run(WRAPPERS[name](), [g, g, ones])
  for u in updates:
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u)), name
  scores = magma.mask_stats(state)["scores"]
  if scores is not None:
    assert all(bool(jnp.all(jnp.isfinite(s))) for s in jax.tree.leaves(scores))


def test_wrapper_and_fused_agree_on_extreme_inputs():
  g = {"w": jnp.full((4, 8), 1e30), "b": jnp.linspace(-1e20, 1e20, 8)}
  ones = jax.tree.map(jnp.ones_like, PARAMS)
  a, sa = _run(WRAPPERS["magma(adam)"](), [g, ones, g])
  b, sb = _run(WRAPPERS["adam_magma"](), [g, ones, g])
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5)
  for x, y in zip(
    jax.tree.leaves(magma.mask_stats(sa)["scores"]),
    jax.tree.leaves(magma.mask_stats(sb)["scores"]),
    strict=True,
  ):
    np.testing.assert_allclose(x, y, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(WRAPPERS))
@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_one_bad_entry_poisons_what_adam_poisons(name, bad):
  g_bad = jax.tree.map(lambda x: jnp.ones(x.shape), PARAMS)
  g_bad["w"] = g_bad["w"].at[1, 2].set(bad)
  ones = jax.tree.map(jnp.ones_like, PARAMS)
  grads = [ones, g_bad, ones, ones]
  got, state = _run(WRAPPERS[name](), grads)
  want, _ = _run(optax.adam(1e-2), grads)
  for u, v in zip(got, want, strict=True):
    for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(v), strict=True):
      np.testing.assert_array_equal(np.isfinite(x), np.isfinite(y))
  scores = magma.mask_stats(state)["scores"]
  if scores is not None:
    assert all(bool(jnp.all(jnp.isfinite(s))) for s in jax.tree.leaves(scores))
    # The clean leaf's score follows cos = 1 for all four steps.
    sigmoid = 1 / (1 + np.exp(-0.5))
    np.testing.assert_allclose(scores["b"], 0.5 + (sigmoid - 0.5) * (1 - 0.9**4), 1e-6)


def test_apply_if_finite_skips_the_bad_step_and_keeps_the_scores():
  tx = optax.apply_if_finite(magma.magma(optax.adam(1e-2)), max_consecutive_errors=3)
  ones = jax.tree.map(jnp.ones_like, PARAMS)
  bad = {**ones, "w": ones["w"].at[0, 0].set(jnp.inf)}
  state, step = tx.init(PARAMS), jax.jit(tx.update)
  _, state = step(ones, state, PARAMS)
  before = magma.mask_stats(state)
  u, state = step(bad, state, PARAMS)
  after = magma.mask_stats(state)
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))  # step skipped
  assert int(state.notfinite_count) == 1
  for x, y in zip(
    jax.tree.leaves(before["scores"]), jax.tree.leaves(after["scores"]), strict=True
  ):
    np.testing.assert_array_equal(x, y)
  assert int(after["step"]) == int(before["step"])


def _huge(shape, t):
  """Finite gradients whose float32 block sums overflow (entries up to 1.8e19, with
  signs and sizes varying per entry and per step), between ordinary steps. Adam's
  own g * g stays finite (<= 3.3e38); a row's sum of them does not."""
  rng = np.random.default_rng(t)
  g = rng.uniform(-1.5, 1.5, size=shape) + 0.3
  return (g * (1e19 if t in (1, 2, 4) else 1.0)).astype(np.float32)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_adam_magma_carry_recovers_after_overflowing_sums(granularity):
  # adam_magma carries ||m||^2 per block (kernels.carried_sums). An overflowing
  # step used to leave it NaN (tensor) or clipped to 0 (row) for good, so its scores
  # froze or drifted away from magma(adam)'s, which sums directly every step. Now
  # the carry is re-summed after such a step: both keep the block's score on the
  # overflowing steps and agree on every step, and the carry is the direct norm.
  shape, steps = (4, 8), 7
  grads = [{"w": jnp.asarray(_huge(shape, t))} for t in range(steps)]
  kw = dict(keep_prob=1.0, granularity=granularity)
  runs = {
    "magma(adam)": magma.magma(optax.adam(1e-2), **kw),
    "adam_magma": magma.adam_magma(1e-2, **kw),
    "adam_magma pallas": magma.adam_magma(
      1e-2, implementation="pallas", interpret=True, **kw
    ),
  }
  got = {}
  for name, tx in runs.items():
    params = {"w": jnp.ones(shape)}
    state, step = tx.init(params), jax.jit(tx.update)
    history = []
    for g in grads:
      u, state = step(g, state, params)
      params = optax.apply_updates(params, u)
      history.append((params["w"], magma.mask_stats(state)["scores"]["w"]))
    got[name] = history, state
  want, _ = got.pop("magma(adam)")
  for name, (history, state) in got.items():
    for t, ((p, s), (p_want, s_want)) in enumerate(zip(history, want, strict=True)):
      np.testing.assert_allclose(p, p_want, rtol=1e-5, err_msg=f"{name} step {t}")
      np.testing.assert_allclose(s, s_want, rtol=1e-5, err_msg=f"{name} step {t}")
    mu = state.mu["w"].astype(jnp.float32)
    direct = jnp.sum(mu * mu) if granularity == "tensor" else jnp.sum(mu * mu, -1)
    np.testing.assert_allclose(state.mu_sq_norm["w"], direct, rtol=1e-4)
  # The overflowing steps kept the score (a 32-entry block overflows on every huge
  # step; some 8-entry rows do not).
  kept = [bool(np.all(want[t][1] == want[t - 1][1])) for t in (1, 2, 4)]
  assert (
    all(kept)
    if granularity == "tensor"
    else not all(bool(np.all(want[t][1] != want[t - 1][1])) for t in (1, 2, 4))
  )


def test_adam_magma_agrees_when_the_moment_norm_comes_back_below_float32_max():
  # One spike (entries up to 1.8e19): ||m||^2 overflows float32 and then decays by
  # b1^2 per step. On the step where ||m_{t-1}||^2 is still inf but ||m_t||^2 is
  # finite, magma(adam) sums m_t directly; adam_magma derived it from the inf
  # (carry or m_{t-1}), kept the score, and stayed ~1 % behind for dozens of steps.
  # Now it sums m_t directly after such a step.
  shape, steps = (32, 32), 12
  rng = np.random.default_rng(0)
  grads = [
    {"w": jnp.asarray(rng.uniform(0.2, 1.0, shape).astype(np.float32) * s)}
    for s in [1.8e19] + [1.0] * (steps - 1)
  ]
  kw = dict(keep_prob=1.0)
  runs = {
    "magma(adam)": magma.magma(optax.adam(1e-2), **kw),
    "adam_magma": magma.adam_magma(1e-2, **kw),
    "adam_magma pallas": magma.adam_magma(
      1e-2, implementation="pallas", interpret=True, **kw
    ),
  }
  scores, norms = {}, []
  for name, tx in runs.items():
    params = {"w": jnp.ones(shape)}
    state, step = tx.init(params), jax.jit(tx.update)
    scores[name] = []
    for g in grads:
      _, state = step(g, state, params)
      scores[name].append(float(magma.mask_stats(state)["scores"]["w"]))
      if name == "adam_magma":
        mu = state.mu["w"]
        norms.append(float(jnp.sum(mu * mu)))
  # The scenario happens: ||m||^2 overflows, then comes back below float32's max.
  assert np.isinf(norms[0]) and np.isfinite(norms[-1])
  want = scores.pop("magma(adam)")
  for name, got in scores.items():
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
