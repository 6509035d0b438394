"""sparse_adam and kernels.tiles.tile_adam: Adam's step fused per sparse storage.

References: ``sparse_state(optax.adam(...), block=...)`` (the composition
``sparse_adam`` must reproduce: moments bit for bit, updates to float32 rounding,
since XLA fuses the two programs differently) and a plain-numpy per-tile Adam step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma
from magma_optax._core import compat as _compat
from magma_optax.kernels.tiles import api as tiles

BLOCK = (8, 128)
PARAMS = {
  "w": jax.random.normal(jax.random.PRNGKey(0), (16, 256)),
  "x": jax.random.normal(jax.random.PRNGKey(1), (2, 8, 128)),
  "b": jnp.ones((8,)),
}


def _matrices(path, x):
  del path
  return x.ndim >= 2


def _pruned(inner, **kwargs):
  return magma.periodic_mask(inner, sparsity=0.5, every=3, where=_matrices, **kwargs)


def _run(tx, steps=4):  # mask refreshes at steps 0 and 3
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  params, updates = PARAMS, []
  for t in range(steps):
    keys = dict(zip(PARAMS, jax.random.split(jax.random.PRNGKey(t), 3), strict=True))
    grads = {k: jax.random.normal(keys[k], x.shape) for k, x in PARAMS.items()}
    u, state = update(grads, state, params)
    params = optax.apply_updates(params, u)
    updates.append(u)
  return updates, state


STORAGES = {  # name: (sparse_state's storage arguments, periodic_mask's)
  "tiles": (dict(mode="compact", density=0.5, block=BLOCK), dict(block=BLOCK)),
  "tiles offload": (dict(mode="offload", density=0.5, block=BLOCK), dict(block=BLOCK)),
  "skip": (dict(mode="skip"), {}),
  "flat compact": (dict(mode="compact", density=0.5), {}),
  "2:4 compact": (dict(mode="compact", structure=(2, 4)), dict(structure=(2, 4))),
}


@pytest.mark.parametrize(
  "name, schedule", [(name, name == "tiles") for name in STORAGES]
)
def test_equals_sparse_state_of_adam(name, schedule):
  lr = optax.linear_schedule(1e-2, 1e-3, 5) if schedule else 1e-2
  storage, pruning = STORAGES[name]
  storage = dict(storage, where=_matrices)
  ref = _pruned(magma.sparse_state(optax.adam(lr), **storage), **pruning)
  got = _pruned(magma.sparse_adam(lr, **storage), **pruning)
  ref_u, ref_state = _run(ref)
  got_u, got_state = _run(got)
  assert jax.tree.structure(got_state) == jax.tree.structure(ref_state)
  leaves = zip(jax.tree.leaves(got_state), jax.tree.leaves(ref_state), strict=True)
  for x, y in leaves:
    np.testing.assert_array_equal(x, y)  # moments, masks, bits, counts
  leaves = zip(jax.tree.leaves(got_u), jax.tree.leaves(ref_u), strict=True)
  for x, y in leaves:
    np.testing.assert_allclose(x, y, rtol=2e-6, atol=1e-9)
  # Pruned weights stay exactly zero: the update is zero wherever the mask is off.
  mask = np.asarray(got_state.mask["w"])
  assert not np.any(np.asarray(got_u[-1]["w"])[~mask])
  assert 0 < np.mean(mask) < 1


def _numpy_tile_adam(g, mu, nu, index, t, lr, b1=0.9, b2=0.999, eps=1e-8):
  """Algorithm: per slot, the tile's gradient (0 for an empty slot), then Adam."""
  rows, r, cols, c = g.shape
  out = []
  for j, tile in enumerate(index):
    gt = g[tile // cols, :, tile % cols, :] if tile < rows * cols else 0.0 * mu[j]
    m = (1 - b1) * gt + b1 * mu[j]
    v = (1 - b2) * gt * gt + b2 * nu[j]
    u = -lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    out.append((m, v, u))
  return [np.stack(x) for x in zip(*out, strict=True)]


def test_tile_adam_matches_numpy():
  rng = np.random.default_rng(0)
  g = rng.normal(size=(2, 16, 512)).astype(np.float32)  # view (4, 8, 4, 128)
  mu = rng.normal(size=(5, *BLOCK)).astype(np.float32)
  nu = rng.uniform(size=(5, *BLOCK)).astype(np.float32)
  index = np.array([0, 6, 7, 15, 16], np.int32)  # slot 4 is empty (16 tiles)
  mu[4] = nu[4] = 0.0
  got = tiles.tile_adam(
    jnp.asarray(g), jnp.asarray(mu), jnp.asarray(nu), jnp.asarray(index),
    count=3, learning_rate=1e-2,
  )  # fmt: skip
  want = _numpy_tile_adam(g.reshape(4, 8, 4, 128), mu, nu, index, 3, 1e-2)
  for x, y in zip(got, want, strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  assert not np.any(np.asarray(got.update[4]))


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_empty_slots_read_no_gradient(bad):
  # The XLA gather clamps an empty slot's index (the tile count, 16) per axis, to
  # the last row's first tile (12), and selects 0 for it: NaN or inf there, or in
  # any tile not stored, must not reach the moments an empty slot keeps (here
  # nonzero).
  rng = np.random.default_rng(1)
  g = rng.normal(size=(2, 16, 512)).astype(np.float32)  # view (4, 8, 4, 128)
  index = np.array([0, 6, 7, 15, 16, 16], np.int32)
  g4 = g.reshape(4, 8, 4, 128)
  for t in set(range(16)) - set(index.tolist()):
    g4[t // 4, :, t % 4, :] = bad
  mu = rng.normal(size=(6, *BLOCK)).astype(np.float32)
  nu = rng.uniform(size=(6, *BLOCK)).astype(np.float32)
  got = tiles.tile_adam(
    jnp.asarray(g), jnp.asarray(mu), jnp.asarray(nu), jnp.asarray(index),
    count=2, learning_rate=1e-2,
  )  # fmt: skip
  want = _numpy_tile_adam(g4, mu, nu, index, 2, 1e-2)
  for x, y in zip(got, want, strict=True):
    assert np.all(np.isfinite(np.asarray(x)))
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(got.mu[4:], np.float32(0.9) * mu[4:])
  gathered = tiles.gather_tiles(jnp.asarray(g4), jnp.asarray(index))
  np.testing.assert_array_equal(gathered[4:], 0.0)
  np.testing.assert_array_equal(
    gathered[:4], np.stack([g4[t // 4, :, t % 4] for t in index[:4]])
  )


def test_bad_input():
  with pytest.raises(ValueError, match="mode must be one of"):
    magma.sparse_adam(1e-3, mode="dense")
  with pytest.raises(ValueError, match="needs mode='compact'"):
    magma.sparse_adam(1e-3, density=0.5, block=BLOCK)  # tiles in skip mode
  with pytest.raises(ValueError, match="chooses the kernel of tile storage"):
    magma.sparse_adam(1e-3, implementation="pallas", interpret=True)
  with pytest.raises(ValueError, match=r"b1 must lie in \[0.0, 1.0\)"):
    magma.sparse_adam(1e-3, jnp.asarray(1.5))  # an array is fine, if in range
  with pytest.raises(ValueError, match="eps must be a float or a scalar array"):
    magma.sparse_adam(1e-3, eps="x")
  with pytest.raises(ValueError, match="b2 must be .*not a schedule"):
    magma.sparse_adam(1e-3, b2=optax.constant_schedule(0.9))
  with pytest.raises(ValueError, match="implementation must be one of"):
    magma.sparse_adam(
      1e-3, mode="compact", density=0.5, block=BLOCK, implementation="triton"
    )
  for lr in ("x", None, True, [1e-3], jnp.ones(3)):
    with pytest.raises(ValueError, match="learning_rate must be a real scalar"):
      magma.sparse_adam(lr)
  for impl in (3, ["xla", 1]):
    with pytest.raises(ValueError, match="implementation must be one of"):
      magma.sparse_adam(
        1e-3, mode="compact", density=0.5, block=BLOCK, implementation=impl
      )
  with pytest.raises(ValueError, match="density must be"):
    magma.sparse_adam(1e-3, mode="compact", density=True)
  with pytest.raises(ValueError, match="interpret must be"):
    magma.sparse_adam(1e-3, interpret="cpu")
  with pytest.raises(ValueError, match="density must be"):
    magma.sparse_adam(1e-3, mode="compact", density=1.5)
  g, m = jnp.ones((16, 256)), jnp.zeros((2, *BLOCK))
  index = jnp.zeros((2,), jnp.int32)
  with pytest.raises(ValueError, match="not made of 8x128 tiles"):
    tiles.tile_adam(jnp.ones((12, 256)), m, m, index, count=1, learning_rate=1.0)
  with pytest.raises(ValueError, match="one shape"):
    tiles.tile_adam(g, m, m[:1], index, count=1, learning_rate=1.0)
  with pytest.raises(ValueError, match="integer vector of the 2 slots"):
    tiles.tile_adam(g, m, m, index[:1], count=1, learning_rate=1.0)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU fallback")
def test_explicit_pallas_request_fails_fast_on_cpu():
  with pytest.raises(ValueError, match="Pallas kernels need a GPU or a TPU"):
    magma.sparse_adam(
      1e-3, mode="compact", density=0.5, block=BLOCK, implementation="pallas"
    )
  # A sequence falls back to the first that can run.
  tx = magma.sparse_adam(
    1e-3, mode="compact", density=1.0, density_threshold=1.0, block=BLOCK,
    implementation=("pallas", "xla"),
  )  # fmt: skip
  params = {"w": jnp.ones((16, 256))}
  mask = {"w": jnp.ones((16, 256), bool)}
  u, _ = jax.jit(tx.update)(params, tx.init(params), params, param_mask=mask)
  np.testing.assert_allclose(u["w"], -1e-3, rtol=1e-5)


def test_inject_hyperparams_learning_rate():
  # Adam's constants static too: bit-equal (injected, 1 - b2 of a float32 b2
  # differs in its last bits; tests/test_inject_hyperparams.py).
  make = optax.inject_hyperparams(
    magma.sparse_adam,
    static_args=magma.sparse_adam.static_args + ("b1", "b2", "eps", "eps_root"),
  )
  tx = make(learning_rate=1e-2, mode="compact", density=0.5, block=BLOCK)
  want = magma.sparse_adam(1e-2, mode="compact", density=0.5, block=BLOCK)
  params = {"w": PARAMS["w"]}
  mask = {"w": jnp.arange(16 * 256).reshape(16, 256) < 8 * 256}
  u, _ = tx.update(params, tx.init(params), params, param_mask=mask)
  v, _ = want.update(params, want.init(params), params, param_mask=mask)
  np.testing.assert_array_equal(u["w"], v["w"])


@pytest.mark.parametrize(
  "interpret",
  [
    True,
    "tpu",
    pytest.param(
      "gpu",
      marks=pytest.mark.skipif(
        not _compat.has_mosaic_gpu(), reason="Mosaic GPU needs jax >= 0.12"
      ),
    ),
  ],
)
def test_pallas_kernel_in_interpreter_matches_xla(interpret):
  params = {"w": PARAMS["w"], "b": PARAMS["b"]}  # one tile leaf, one dense leaf
  kwargs = dict(mode="compact", density=0.5, block=BLOCK, where=_matrices)

  def run(**impl):
    tx = _pruned(magma.sparse_adam(1e-2, **kwargs, **impl), block=BLOCK)
    state = tx.init(params)
    update = jax.jit(tx.update)  # the interpreted kernel runs compiled
    p = params
    for t in range(4):  # a refresh at step 3 moves and resets tiles
      g = jax.tree.map(lambda x, t=t: jnp.cos(x * (t + 1)), p)
      u, state = update(g, state, p)
      p = optax.apply_updates(p, u)
    return p, state

  want = run(implementation="xla")
  got = run(implementation="pallas", interpret=interpret)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(
      np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-5, atol=1e-7
    )
