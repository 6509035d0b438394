"""Complex parameters in sparse state: every storage keeps a complex leaf's state
(the base runs on the stored entries), and sparse_adam takes Adam's complex step
there -- never dropping the imaginary part."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma


def _complex(key, shape):
  kr, ki = jax.random.split(key)
  return jax.random.normal(kr, shape) + 1j * jax.random.normal(ki, shape)


LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8

# (storage arguments, a mask that fits them): 8 x 8 leaves.
_QUADRANT = np.zeros((8, 8), bool)
_QUADRANT[:4, :4] = True
_PER_PART = np.zeros((8, 8), bool)
for _r in (0, 4):
  for _c in (0, 4):
    _PER_PART[_r : _r + 2, _c : _c + 2] = True
STORAGES = {
  "skip": ({}, _QUADRANT),
  "offload": ({"mode": "offload"}, _QUADRANT),
  "compact": ({"mode": "compact", "density": 0.25}, _QUADRANT),
  "n_m": ({"mode": "compact", "structure": (2, 4)}, np.tile([1, 0, 0, 1], (8, 2)) > 0),
  "tiles": ({"mode": "compact", "density": 0.25, "block": (4, 4)}, _QUADRANT),
  "tiles_per_shard": (
    {"mode": "compact", "density": 0.25, "block": (2, 2), "shards": (2, 2)},
    _PER_PART,
  ),
}


def _numpy_masked_adam(grads, masks):
  """Complex Adam per entry in complex128 (optax.adam's formulas: nu is the EMA of
  |g|^2); where an entry's mask is False its update is 0 and its moments stay."""
  m = np.zeros(grads[0].shape, np.complex128)
  v = np.zeros(grads[0].shape)
  out = []
  for t, (g, mask) in enumerate(zip(grads, masks, strict=True), start=1):
    g = np.asarray(g, np.complex128)
    m = np.where(mask, B1 * m + (1 - B1) * g, m)
    v = np.where(mask, B2 * v + (1 - B2) * np.abs(g) ** 2, v)
    u = -LR * (m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**t)) + EPS)
    out.append((np.where(mask, u, 0), m.copy()))
  return out


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("factory", ["sparse_state", "sparse_adam"])
def test_sparse_state_on_complex_honours_the_mask_and_equals_adam(factory, storage):
  kwargs, mask = STORAGES[storage]
  kwargs = {**kwargs, "where": {"w": True, "b": False}}
  if factory == "sparse_state":
    tx = magma.sparse_state(optax.adam(LR, B1, B2, EPS), **kwargs)
  else:
    tx = magma.sparse_adam(LR, B1, B2, EPS, **kwargs)
  params = {"w": _complex(jax.random.key(5), (8, 8)), "b": jnp.ones(3)}
  keys = jax.random.split(jax.random.key(6), 3)
  grads = [_complex(k, (8, 8)) for k in keys]
  # Skip storage keeps every entry's moments: all active first, then frozen where
  # inactive. Compact storage holds the masked entries only, from the start.
  dense = storage in ("skip", "offload")
  masks = [np.ones((8, 8), bool) if dense else mask, mask, mask]
  want = _numpy_masked_adam(grads, masks)
  state = tx.init(params)
  step = jax.jit(tx.update)
  for g, m, (u_want, _) in zip(grads, masks, want, strict=True):
    updates, state = step(
      {"w": g, "b": jnp.ones(3)}, state, params, param_mask={"w": m, "b": None}
    )
    u = np.asarray(updates["w"])
    assert u.dtype == np.complex64
    np.testing.assert_array_equal(u[~m], 0)
    np.testing.assert_allclose(u, u_want, rtol=2e-5, atol=1e-7)
  assert np.abs(np.imag(u[mask])).min() > 0  # the imaginary part is there
  if dense:  # the inactive entries' moments are the first step's, frozen
    mu = np.asarray(state.base_state[0].mu["w"])
    np.testing.assert_allclose(mu, want[-1][1], rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(mu[~mask], want[0][1][~mask], rtol=1e-6)


def test_the_issue_example_keeps_the_imaginary_part():
  p = {"w": jnp.array([1 + 1j, 2 - 1j], jnp.complex64)}
  g = {"w": jnp.array([0.5 + 2j, -1 + 0.5j], jnp.complex64)}
  adam = optax.adam(1e-2)
  want = adam.update(g, adam.init(p), p)[0]["w"]
  for tx in (magma.sparse_state(optax.adam(1e-2)), magma.sparse_adam(1e-2)):
    got = tx.update(g, tx.init(p), p)[0]["w"]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    got = tx.update(g, tx.init(p), p, param_mask={"w": jnp.array([True, False])})
    np.testing.assert_allclose(got[0]["w"], [want[0], 0], rtol=1e-6)


def test_periodic_mask_sparse_adam_on_complex():
  # The composition: periodic_mask hands its magnitude mask to compact storage,
  # whose complex step equals Adam on the kept entries.
  p = {"c": _complex(jax.random.key(11), (8, 8))}
  g = {"c": _complex(jax.random.key(12), (8, 8))}
  tx = magma.periodic_mask(
    magma.sparse_adam(LR, mode="compact", density=0.25, block=(4, 4)),
    sparsity=0.75, every=1, block=(4, 4),
  )  # fmt: skip
  updates, state = jax.jit(tx.update)(g, tx.init(p), p)
  mask = np.asarray(state.mask["c"])
  assert mask.sum() == 16
  adam = optax.adam(LR)
  u_adam = np.asarray(adam.update(g, adam.init(p), p)[0]["c"])
  new = np.asarray(optax.apply_updates(p, updates)["c"])
  np.testing.assert_array_equal(new[~mask], 0)
  np.testing.assert_allclose(new[mask], (np.asarray(p["c"]) + u_adam)[mask], rtol=1e-6)
