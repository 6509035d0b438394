"""The tile kernels (:mod:`pallas_tiles`), each in its backend's interpreter, vs XLA.

The reference gathers the active tiles of g with a fill for the empty slots and runs
:func:`reference.tile_adam` on them (the XLA path of compact tile storage). Mosaic TPU
runs in ``pltpu.InterpretParams()`` and Triton in the generic interpreter (both jax
lines), Mosaic GPU in ``plgpu.InterpretGPUParams()`` (jax >= 0.11.2; skipped with the
reason on older jax). Grids have at most 8 steps (slots, or groups of slots).

Tolerances: float32 outputs rtol 1e-6 (the same f32 expressions; XLA may fuse
``0.2 g + 0.8 m`` into an FMA, the interpreters do not: a last-bit difference);
bfloat16 outputs rtol 1e-2 (both round the same f32 value once: one bf16 ulp is
2**-8 relative, a last-bit f32 difference may round to the neighbour); and atol 1e-6
of the array's largest magnitude, for entries where m' = (1 - b1) g + b1 m cancels
to ~1e-5 of its terms, so that one ulp of the terms is a large relative error
(seen: 5e-5 relative, 1e-8 absolute on an array of magnitude 0.15).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magma_optax._core import compat as _compat
from magma_optax.kernels import reference
from magma_optax.kernels.tiles import pallas as pallas_tiles

NO_GPU_INTERPRETER = (
  f"jax {jax.__version__} has no Mosaic GPU interpreter"
  " (plgpu.InterpretGPUParams is public from jax 0.11.2)"
)
HAS_MGPU = _compat.has_mosaic_gpu()
BACKENDS = ["triton", "mosaic_tpu"] + (["mosaic_gpu"] if HAS_MGPU else [])
ALL_BACKENDS = [
  "triton",
  "mosaic_tpu",
  pytest.param(
    "mosaic_gpu", marks=pytest.mark.skipif(not HAS_MGPU, reason=NO_GPU_INTERPRETER)
  ),
]


def tile_adam_xla(g4, mu, nu, tile_index, hyper):
  """The reference: gather the slots' tiles (0 for an empty slot), then Adam."""
  _, _, cols, _ = g4.shape
  g = g4.at[tile_index // cols, :, tile_index % cols, :].get(
    mode="fill", fill_value=0, indices_are_sorted=True
  )
  new_m, new_v, u = reference.tile_adam(g, mu, nu, None, None, hyper)
  return new_m.astype(mu.dtype), new_v.astype(nu.dtype), u.astype(g4.dtype)


def _inputs(seed, view, k, active, g_dtype, m_dtype=jnp.float32):
  rows, r, cols, c = view
  keys = jax.random.split(jax.random.key(seed), 4)
  g4 = jax.random.normal(keys[0], view).astype(g_dtype)
  mu = (0.1 * jax.random.normal(keys[1], (k, r, c))).astype(m_dtype)
  nu = (0.01 * jax.random.uniform(keys[2], (k, r, c))).astype(jnp.float32)
  tiles = jnp.sort(jax.random.permutation(keys[3], rows * cols)[:active])
  tile_index = jnp.full((k,), rows * cols, jnp.int32).at[:active].set(tiles)
  return g4, mu, nu, tile_index


# (view (rows, r, cols, c), K, active slots, g dtype, mu dtype, count, lr, backends)
CASES = [
  ((4, 8, 2, 128), 5, 3, jnp.float32, jnp.float32, 1, 1e-3, BACKENDS),
  ((4, 8, 2, 128), 4, 2, jnp.bfloat16, jnp.bfloat16, 100, 1.0, BACKENDS),
  ((3, 1, 4, 128), 6, 6, jnp.float32, jnp.float32, 3, 3e-2, BACKENDS),  # no empty
  ((2, 16, 3, 128), 3, 0, jnp.bfloat16, jnp.float32, 2, 1e-3, BACKENDS),  # all empty
  ((4, 4, 4, 32), 6, 4, jnp.float32, jnp.bfloat16, 5, 1e-2, ["triton", "mosaic_gpu"]),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_tile_kernel_matches_xla_reference(backend, case):
  view, k, active, g_dtype, m_dtype, count, lr, backends = CASES[case]
  if backend not in backends:
    pytest.skip(f"block {view[1], view[3]} is not legal on {backend}")
  constants = reference.AdamConstants(b1=0.8, b2=0.99, eps=1e-6, eps_root=1e-12)
  hyper = reference.hyperparams(count, lr, 0.0, constants)
  args = _inputs(case, view, k, active, g_dtype, m_dtype)
  want = jax.jit(tile_adam_xla)(*args, hyper)
  got = jax.jit(
    lambda *a: pallas_tiles.tile_adam_pallas(*a, hyper, backend=backend, interpret=True)
  )(*args)
  for name, a, b in zip(("mu", "nu", "update"), got, want, strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    rtol = 1e-6 if a.dtype == jnp.float32 else 1e-2
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    atol = 1e-6 * np.max(np.abs(b))  # where m' cancels (below)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)
  # Empty slots saw a zero gradient: their update is that of g = 0, not of a tile.
  empty = np.asarray(args[3]) == view[0] * view[2]
  zero = reference.tile_adam(
    jnp.zeros(args[1].shape), args[1], args[2], None, None, hyper
  )
  np.testing.assert_allclose(
    np.asarray(got[2], np.float32)[empty],
    np.asarray(zero[2].astype(g_dtype), np.float32)[empty],
    rtol=1e-6,
  )


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_leaf_with_leading_axes(backend):
  """A (2, 16, 256) leaf in (8, 128) tiles: the view (4, 8, 2, 128)."""
  constants = reference.AdamConstants()
  hyper = reference.hyperparams(4, 1e-3, 0.0, constants)
  leaf = jax.random.normal(jax.random.key(0), (2, 16, 256))
  g4 = leaf.reshape(4, 8, 2, 128)
  tile_index = jnp.array([0, 3, 6, 8], jnp.int32)
  mu = nu = jnp.full((4, 8, 128), 0.5)
  got = pallas_tiles.tile_adam_pallas(
    g4, mu, nu, tile_index, hyper, backend=backend, interpret=True
  )
  # Tile 3 is rows 8..15 of the first matrix, columns 128..255.
  new_m, _, _ = reference.tile_adam(
    leaf[0, 8:16, 128:], mu[1], nu[1], None, None, hyper
  )
  np.testing.assert_allclose(got[0][1], new_m, rtol=1e-6)
  want = tile_adam_xla(g4, mu, nu, tile_index, hyper)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize(
  ("block", "backend", "needle"),
  [
    ((8, 96), "triton", "powers of two"),
    ((3, 128), "triton", "powers of two"),
    ((8, 64), "mosaic_tpu", "multiple of 128"),
    pytest.param(
      (8, 128),
      "mosaic_gpu",
      "jax >= 0.11.2",
      marks=pytest.mark.skipif(HAS_MGPU, reason="jax >= 0.11.2"),
    ),
    pytest.param(
      (8, 512),
      "mosaic_gpu",
      "TMA",
      marks=pytest.mark.skipif(not HAS_MGPU, reason=NO_GPU_INTERPRETER),
    ),
    pytest.param(
      (8, 2),
      "mosaic_gpu",
      "16 bytes",
      marks=pytest.mark.skipif(not HAS_MGPU, reason=NO_GPU_INTERPRETER),
    ),
    pytest.param(
      (256, 128),
      "mosaic_gpu",
      "shared memory",
      marks=pytest.mark.skipif(not HAS_MGPU, reason=NO_GPU_INTERPRETER),
    ),
    ((8, 128), "cuda", "backend must be"),
  ],
)
def test_why_unavailable_explains_illegal_blocks(block, backend, needle):
  reason = pallas_tiles.why_unavailable(block, (jnp.float32,), backend)
  assert isinstance(reason, str) and needle in reason
  g4 = jnp.zeros((1, block[0], 1, block[1]))
  mu = jnp.zeros((1,) + block)
  hyper = reference.hyperparams(1, 1e-3, 0.0, reference.AdamConstants())
  with pytest.raises(ValueError, match=needle):
    pallas_tiles.tile_adam_pallas(
      g4, mu, mu, jnp.zeros((1,), jnp.int32), hyper,
      backend=backend, interpret=True,
    )  # fmt: skip


@pytest.mark.parametrize(
  ("block", "dtypes", "backend"),
  [
    ((1, 128), (jnp.float32,), "triton"),
    ((16, 256), (jnp.bfloat16, jnp.float32), "triton"),
    ((1, 128), (jnp.float32,), "mosaic_tpu"),
    ((24, 384), (jnp.bfloat16,), "mosaic_tpu"),
    pytest.param(
      (1, 128),
      (jnp.bfloat16, jnp.float32),
      "mosaic_gpu",
      marks=pytest.mark.skipif(not HAS_MGPU, reason=NO_GPU_INTERPRETER),
    ),
  ],
)
def test_why_unavailable_accepts_legal_blocks(block, dtypes, backend):
  assert pallas_tiles.why_unavailable(block, dtypes, backend) is None


def test_mosaic_tpu_partial_last_group_of_slots(monkeypatch):
  """K = 5 slots, 2 per grid step: the last step's second slot lies past K."""
  monkeypatch.setattr(pallas_tiles, "TPU_STEP_ENTRIES", 2 * 8 * 128)
  assert pallas_tiles.tpu_slots_per_step(5, 8, 128, (jnp.float32,)) == 2
  constants = reference.AdamConstants()
  hyper = reference.hyperparams(2, 1e-2, 0.0, constants)
  args = _inputs(7, (2, 8, 3, 128), 5, 4, jnp.float32)
  want = tile_adam_xla(*args, hyper)
  got = pallas_tiles.tile_adam_pallas(
    *args, hyper, backend="mosaic_tpu", interpret=True
  )
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.max(np.abs(b)))
