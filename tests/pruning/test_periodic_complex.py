"""Complex parameters in periodic_mask: a complex weight or gradient counts by its
magnitude, for entries, tiles and N:M groups."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma

LR = 1e-2


def _complex(key, shape):
  kr, ki = jax.random.split(key)
  return jax.random.normal(kr, shape) + 1j * jax.random.normal(ki, shape)


def _top_k_numpy(scores, keep):
  """The ``keep`` highest scores (no ties in these tests)."""
  flat = np.asarray(scores).ravel()
  out = np.zeros(flat.shape, bool)
  out[np.argsort(-flat, kind="stable")[:keep]] = True
  return out.reshape(np.shape(scores))


@pytest.mark.parametrize("importance", ["magnitude_grad", "magnitude"])
@pytest.mark.parametrize("select", ["all", "where"])
def test_periodic_mask_prunes_complex_leaves_by_magnitude(importance, select):
  p = {"c": _complex(jax.random.key(7), (6, 8)), "r": jnp.ones((4, 4))}
  g = {"c": _complex(jax.random.key(8), (6, 8)), "r": jnp.ones((4, 4))}
  where = None if select == "all" else {"c": True, "r": False}
  tx = magma.periodic_mask(
    optax.adam(LR), sparsity=0.5, every=1, importance=importance, where=where
  )
  updates, state = jax.jit(tx.update)(g, tx.init(p), p)
  w, grad = np.asarray(p["c"]), np.asarray(g["c"])
  scores = np.abs(w) * (np.abs(grad) if importance == "magnitude_grad" else 1)
  want = _top_k_numpy(scores, 24)
  np.testing.assert_array_equal(state.mask["c"], want)
  new = np.asarray(optax.apply_updates(p, updates)["c"])
  np.testing.assert_array_equal(new[~want], 0)  # real and imaginary parts
  adam = optax.adam(LR)
  u_adam = np.asarray(adam.update(g, adam.init(p), p)[0]["c"])
  np.testing.assert_allclose(new[want], (w + u_adam)[want], rtol=1e-6)


@pytest.mark.parametrize("kind", ["block", "structure"])
def test_periodic_mask_ranks_complex_tiles_and_groups_by_magnitude(kind):
  p = {"c": _complex(jax.random.key(9), (8, 8))}
  g = {"c": _complex(jax.random.key(10), (8, 8))}
  scores = np.abs(np.asarray(p["c"])) * np.abs(np.asarray(g["c"]))
  if kind == "block":
    tx = magma.periodic_mask(optax.adam(LR), sparsity=0.75, every=1, block=(4, 4))
    tile_sums = scores.reshape(2, 4, 2, 4).sum(axis=(1, 3))
    want = np.kron(_top_k_numpy(tile_sums, 1), np.ones((4, 4))) > 0
  else:
    tx = magma.periodic_mask(optax.adam(LR), every=1, structure=(2, 4))
    groups = scores.reshape(8, 2, 4)
    want = np.stack([
      np.stack([_top_k_numpy(row, 2) for row in grp]) for grp in groups
    ]).reshape(8, 8)  # fmt: skip
  _, state = tx.update(g, tx.init(p), p)
  np.testing.assert_array_equal(state.mask["c"], want)
