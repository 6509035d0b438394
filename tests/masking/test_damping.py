"""damping: u_b / (1 + c ||u_b||) per block, against numpy."""

import algorithm1 as ref
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma


@pytest.mark.parametrize("granularity", ["tensor", "row", "column", (2, 3)])
def test_damping_matches_numpy(granularity):
  u = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
  tx = magma.damping(0.7, granularity=granularity)
  out, _ = jax.jit(tx.update)({"w": jnp.asarray(u)}, tx.init({"w": u}))
  ids, n = ref.block_ids(u.shape, granularity)
  norm = np.sqrt(ref.block_sums(u * u, ids, n))
  np.testing.assert_allclose(out["w"], u / (1 + 0.7 * norm)[ids], rtol=1e-6)


def test_zero_coefficient_is_identity_and_where_scopes():
  params = {"a": jnp.ones((3, 3)), "b": jnp.ones((2,))}
  out, _ = magma.damping(0.0).update(params, optax.EmptyState())
  jax.tree.map(np.testing.assert_array_equal, out, params)
  tx = magma.damping(1.0, where=lambda path, leaf: leaf.ndim == 2)
  out, _ = tx.update(params, tx.init(params))
  np.testing.assert_allclose(out["a"], 1 / (1 + 3.0))
  np.testing.assert_array_equal(out["b"], 1.0)


def test_damping_in_a_chain_after_adam():
  """chain(adam, damping) damps Adam's own update, step after step (numpy Adam)."""
  rng = np.random.default_rng(1)
  grads = [rng.normal(size=(3, 5)).astype(np.float32) for _ in range(3)]
  lr, c, b1, b2, eps = 0.5, 0.3, 0.9, 0.999, 1e-8
  tx = optax.chain(optax.adam(lr), magma.damping(c, granularity="row"))
  params = {"w": jnp.zeros((3, 5))}
  state, step = tx.init(params), jax.jit(tx.update)
  m = v = np.zeros((3, 5))
  for t, g in enumerate(grads, start=1):
    updates, state = step({"w": jnp.asarray(g)}, state, params)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    adam = -lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    want = adam / (1 + c * np.linalg.norm(adam, axis=1, keepdims=True))
    np.testing.assert_allclose(updates["w"], want, rtol=1e-5, atol=1e-7)
    assert not np.allclose(want, adam, rtol=1e-2)  # the damping is not negligible


def test_bad_coefficient():
  with pytest.raises(ValueError, match="coefficient"):
    magma.damping(-1.0)


def test_huge_and_infinite_updates():
  """Finite 1e20 blocks are damped by their true norm (no float32 overflow to 0 or
  NaN); an inf poisons only its own entry; c = 0 is the identity even then."""
  u = jnp.full((3, 4), 1e20)
  out, _ = magma.damping(0.1).update({"w": u}, optax.EmptyState())
  np.testing.assert_allclose(out["w"], 1e20 / (1 + 0.1 * np.sqrt(12) * 1e20), 1e-6)
  out, _ = magma.damping(0.0).update({"w": u}, optax.EmptyState())
  np.testing.assert_array_equal(out["w"], u)
  v = jnp.ones((3, 4)).at[0, 0].set(jnp.inf)
  out, _ = magma.damping(0.0).update({"w": v}, optax.EmptyState())
  np.testing.assert_array_equal(out["w"], v)
  out, _ = magma.damping(0.1, granularity="row").update({"w": v}, optax.EmptyState())
  w = np.asarray(out["w"])
  assert np.isfinite(w).sum() == 11  # only the inf entry is not finite
  np.testing.assert_array_equal(w[0, 1:], 0.0)  # 1 / (1 + c * inf)
  np.testing.assert_allclose(w[1:], 1 / (1 + 0.1 * 2.0), rtol=1e-6)


def test_schedule_coefficient_is_refused_at_construction():
  with pytest.raises(ValueError, match="not a schedule"):
    magma.damping(optax.linear_schedule(0.0, 1.0, 10))
