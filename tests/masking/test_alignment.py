"""alignment_mask (gradient masking before the base) against the numpy reference."""

import algorithm1 as ref
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma


def _grads(shape, steps=5, seed=0):
  rng = np.random.default_rng(seed)
  drift = rng.normal(size=shape)
  return [(drift + rng.normal(size=shape)).astype(np.float32) for _ in range(steps)]


@pytest.mark.parametrize("granularity", ["tensor", "row", "element"])
def test_reference_line_matches_numpy_sparse_moments(granularity):
  shape = (4, 6)
  p0 = np.random.default_rng(1).normal(size=shape).astype(np.float32)
  grads = _grads(shape)
  # The design's reference line, verbatim apart from the granularity.
  tx = optax.chain(
    magma.alignment_mask(tau=2.0, granularity=granularity), optax.adam(1e-3)
  )
  params = {"w": jnp.asarray(p0)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  traj, masks = [], []
  for g in grads:
    updates, state = step({"w": jnp.asarray(g)}, state, params)
    params = optax.apply_updates(params, updates)
    traj.append(np.asarray(params["w"]))
    masks.append(np.asarray(magma.mask_stats(state)["mask"]["w"]))
  assert step._cache_size() == 1
  expected = ref.alignment_chain_run(
    ref.NumpyAdam(1e-3), p0, grads, masks, granularity=granularity
  )
  for got, want in zip(traj, expected, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_cosine_is_scale_invariant_and_zero_safe():
  layout = magma.block_layout((4, 3), "row")
  from magma_optax.masking.alignment import block_cosine

  a = jnp.asarray(np.random.default_rng(2).normal(size=(4, 3)), jnp.float32)
  a = a.at[1].set(0.0)
  c1 = block_cosine(layout, a, a)
  c2 = block_cosine(layout, 3.0 * a, a)
  np.testing.assert_allclose(c1, [1, 0, 1, 1], atol=1e-6)
  np.testing.assert_allclose(c1, c2, atol=1e-6)
  np.testing.assert_allclose(block_cosine(layout, a, -a), [-1, 0, -1, -1], atol=1e-6)


def test_tau_schedule_changes_scores():
  params = {"w": jnp.zeros((4,))}
  g = {"w": jnp.ones((4,))}
  tau = optax.piecewise_constant_schedule(2.0, {1: 0.25})  # 2.0, then 0.5
  tx = magma.alignment_mask(tau=tau, keep_prob=1.0, key=0)
  state = tx.init(params)
  _, state = tx.update(g, state)
  s1 = 0.9 * 0.5 + 0.1 * jax.nn.sigmoid(1.0 / 2.0)
  np.testing.assert_allclose(state.scores["w"], s1, rtol=1e-6)
  _, state = tx.update(g, state)
  np.testing.assert_allclose(
    state.scores["w"], 0.9 * s1 + 0.1 * jax.nn.sigmoid(2.0), rtol=1e-6
  )


@pytest.mark.parametrize(
  "kwargs,match",
  [
    ({"tau": 0.0}, "tau"),
    ({"keep_prob": 0.0}, "keep_prob"),
    ({"score_decay": 1.0}, "score_decay"),
    ({"momentum_decay": 1.5}, "momentum"),
    ({"init_score": -0.1}, "init_score"),
    ({"granularity": (0,)}, "granularity"),
    ({"stack_axes": 1.5}, "stack_axes"),
    ({"key": 1.5}, "key"),
  ],
)
def test_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    magma.alignment_mask(**kwargs)
