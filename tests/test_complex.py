"""Complex parameters: the block-mask transforms treat a complex leaf as the real
vector (Re, Im) of twice the length -- cosines from the real inner product, norms
from magnitudes -- and never drop the imaginary part."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma


def _complex(key, shape):
  kr, ki = jax.random.split(key)
  return jax.random.normal(kr, shape) + 1j * jax.random.normal(ki, shape)


def _as_real(z):
  return jnp.stack([jnp.real(z), jnp.imag(z)], axis=-1)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_alignment_mask_on_complex_equals_its_real_view(granularity):
  # Row blocks of a (4, 6) complex leaf are (6, 2) slabs of the real view.
  real_gran = granularity if granularity == "tensor" else (1, 6, 2)
  keys = jax.random.split(jax.random.key(0), 4)
  grads = [_complex(k, (4, 6)) for k in keys]
  tx_c = magma.alignment_mask(keep_prob=1.0, granularity=granularity, key=1)
  tx_r = magma.alignment_mask(keep_prob=1.0, granularity=real_gran, key=1)
  sc = tx_c.init({"w": grads[0]})
  sr = tx_r.init({"w": _as_real(grads[0])})
  for g in grads:
    uc, sc = tx_c.update({"w": g}, sc)
    ur, sr = tx_r.update({"w": _as_real(g)}, sr)
    np.testing.assert_allclose(_as_real(uc["w"]), ur["w"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    np.ravel(sc.scores["w"]), np.ravel(sr.scores["w"]), rtol=1e-6
  )
  assert not np.allclose(np.ravel(sc.scores["w"]), 0.5)  # the scores moved


def test_damping_on_complex_uses_magnitudes():
  z = _complex(jax.random.key(2), (3, 5))
  out, _ = magma.damping(0.5, granularity="row").update({"w": z}, optax.EmptyState())
  ref, _ = magma.damping(0.5, granularity=(1, 5, 2)).update(
    {"w": _as_real(z)}, optax.EmptyState()
  )
  np.testing.assert_allclose(_as_real(out["w"]), ref["w"], rtol=1e-6)


def test_magma_adam_on_complex_masks_with_the_real_cosine():
  # magma(adam) on a complex leaf: the update is s * z * Adam's complex update, with
  # the score from the real cosine of Adam's complex first moment and the gradient.
  p = {"w": jnp.zeros((2, 3), jnp.complex64)}
  g = {"w": _complex(jax.random.key(3), (2, 3))}
  tx = magma.magma(optax.adam(1e-2), keep_prob=1.0, key=0)
  state = tx.init(p)
  u, state = tx.update(g, state, p)
  base_u, _ = optax.adam(1e-2).update(g, optax.adam(1e-2).init(p), p)
  s = state.mask_state.scores["w"]
  mu = state.inner_state[0].mu["w"]
  a, b = np.ravel(_as_real(mu)), np.ravel(_as_real(g["w"]))
  cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
  np.testing.assert_allclose(s, 0.9 * 0.5 + 0.1 / (1 + np.exp(-cos / 2.0)), rtol=1e-6)
  np.testing.assert_allclose(u["w"], s * base_u["w"], rtol=1e-6)
  assert jnp.iscomplexobj(u["w"]) and np.any(np.imag(u["w"]) != 0)


def test_adam_magma_refuses_complex():
  with pytest.raises(ValueError, match="complex"):
    magma.adam_magma(1e-2).init({"w": jnp.zeros(3, jnp.complex64)})


# --- sparse state and periodic masks on complex leaves ------------------------------

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
