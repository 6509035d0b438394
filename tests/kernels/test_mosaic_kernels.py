"""The Mosaic TPU and Mosaic GPU kernels, each in its backend's interpreter, vs XLA.

``interpret="tpu"`` runs :mod:`pallas_tpu` in ``pltpu.InterpretParams()`` (jax 0.10.2
and 0.12), ``interpret="gpu"`` runs :mod:`pallas_mgpu` in
``plgpu.InterpretGPUParams()`` (jax >= 0.11.2; skipped with the reason on older jax).
The reference is the XLA path (:mod:`reference`), itself checked against float64
numpy in test_masked_adam.py. Fresh random inputs per case; every grid has at most
16 steps.

Tolerances: float32 outputs rtol 1e-5 / atol 1e-7 (same f32 expressions, other
fusion); bfloat16 outputs rtol 1e-2 (both paths compute in f32 and round once: one
bf16 ulp is 2**-8 relative) and atol 1e-6 (where m' cancels to ~1e-9, the f32
residue differs by the order of evaluation); the per-block f32 sums rtol 2e-5 for
float32 inputs (f32 sums in another order: per tile, then accumulated over the
grid) and rtol 1e-3 for bfloat16 ones: the sums see the stored bf16 moment, and a
last-bit difference in the f32 m' can round one entry of it to the neighbouring
bf16 value, moving one term of a sum by 2**-8 of itself (seen: 2e-4 relative on a
sum of 50).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma
from magma_optax import kernels
from magma_optax._core import blocks as _blocks
from magma_optax._core import compat as _compat
from magma_optax.kernels import dispatch
from magma_optax.kernels import mosaic_tpu as pallas_tpu

NO_GPU_INTERPRETER = (
  f"jax {jax.__version__} has no Mosaic GPU interpreter"
  " (plgpu.InterpretGPUParams is public from jax 0.11.2)"
)
INTERPRETERS = [
  "tpu",
  pytest.param(
    "gpu",
    marks=pytest.mark.skipif(not _compat.has_mosaic_gpu(), reason=NO_GPU_INTERPRETER),
  ),
]

# (shape, granularity, stack_axes, block sizes, dtype, masked). Masked cases use the
# parameter mask, the others weight decay.
CASES = [
  # TPU: one block per row, 13 blocks padded to 2 tiles of 8 rows.
  ((13, 50), "row", 0, kernels.BlockSizes(8, 64), jnp.float32, False),
  # int8 mask: tiles of 32 rows (the int8 sublane count); 70 blocks padded to 96.
  ((70, 50), "row", 0, kernels.BlockSizes(32, 64), jnp.bfloat16, True),
  # One block of 3201 entries: 26 rows of 128 lanes, padded to 4 tiles of 8 rows
  # walked along the "arbitrary" axis (the sums accumulate over 4 steps).
  ((33, 97), "tensor", 0, kernels.BlockSizes(8, 128), jnp.float32, False),
  # Stacked blocks of 8320 entries, each 65 rows -> 3 tiles of 32: a 2 x 3 grid.
  ((2, 64, 130), "tensor", 1, kernels.BlockSizes(32, 128), jnp.bfloat16, True),
  ((5, 3), "element", 0, None, jnp.float32, True),  # default sizes
  ((129,), "tensor", 0, None, jnp.float32, False),
]


def _tpu_grid_steps(shape, gran, stack, sizes, dtype, masked):
  layout = _blocks.block_layout(shape, gran, stack)
  nb, bs = layout.num_blocks, layout.block_size
  sub = pallas_tpu.sublanes(dtype, *([jnp.int8] if masked else []))
  cols, rows = pallas_tpu.plan_tiles(bs, nb, layout.expanded_shape[-1], sub, sizes)
  if cols is None:
    return -(-nb // rows)
  num_rows = -(-bs // cols)
  return nb * -(-num_rows // rows)


def _gpu_grid_steps(shape, gran, stack, sizes, dtype, masked):
  del dtype, masked
  layout = _blocks.block_layout(shape, gran, stack)
  sizes = sizes or kernels.BlockSizes.get_default(layout.block_size, layout.num_blocks)
  rows = layout.num_blocks * -(-layout.block_size // sizes.block_cols)
  return -(-rows // sizes.block_rows)


def test_cases_are_small_and_exercise_the_tpu_layouts():
  for case in CASES:
    assert _tpu_grid_steps(*case) <= 16, case
    assert _gpu_grid_steps(*case) <= 16, case
  # Both views, padding, and an accumulation over several "arbitrary" steps.
  assert _tpu_grid_steps(*CASES[2]) == 4
  assert _tpu_grid_steps(*CASES[3]) == 6


def _inputs(shape, dtype, seed):
  k = jax.random.split(jax.random.key(seed), 6)
  g = jax.random.normal(k[0], shape).astype(dtype)
  m = (0.1 * jax.random.normal(k[1], shape)).astype(dtype)
  v = (0.01 * jax.random.uniform(k[2], shape)).astype(dtype)
  p = jax.random.normal(k[3], shape).astype(dtype)
  pm = jax.random.bernoulli(k[4], 0.7, shape)
  return g, m, v, p, pm, k[5]


@pytest.mark.parametrize("interpret", INTERPRETERS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_in_its_interpreter_matches_xla(case, interpret):
  shape, gran, stack, sizes, dtype, masked = CASES[case]
  g, m, v, p, pm, key = _inputs(shape, dtype, seed=100 + case)
  layout = _blocks.block_layout(shape, gran, stack)
  kw = dict(
    count=jnp.asarray(5, jnp.int32),
    learning_rate=jnp.asarray(3e-3),
    scale=jax.random.uniform(key, layout.block_shape),
    layout=layout,
    param_mask=pm if masked else None,
    params=None if masked else p,
    weight_decay=0.0 if masked else 0.1,
  )
  want = kernels.masked_adam(g, m, v, implementation="xla", **kw)
  got = kernels.masked_adam(
    g, m, v, implementation="pallas", interpret=interpret, block_sizes=sizes, **kw
  )
  tol = dict(rtol=1e-5, atol=1e-7) if dtype == jnp.float32 else dict(rtol=1e-2)
  if dtype == jnp.bfloat16:  # m' = 0.1 g + 0.9 m cancels to ~1e-9 in a few entries
    tol["atol"] = 1e-6
  for name in ("mu", "nu", "update"):
    a, b = getattr(got, name), getattr(want, name)
    assert a.dtype == b.dtype == dtype and a.shape == shape, name
    np.testing.assert_allclose(
      np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name, **tol
    )
  for name in ("mu_dot_grad", "mu_sq_norm", "grad_sq_norm"):
    a, b = getattr(got, name), getattr(want, name)
    assert a.dtype == jnp.float32 and a.shape == layout.block_shape, name
    stol = dict(rtol=2e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-3)
    np.testing.assert_allclose(a, b, err_msg=name, **stol)
  if masked:  # entries that do not exist keep their moments and get no update
    off = ~np.asarray(pm)
    np.testing.assert_array_equal(np.asarray(got.mu)[off], np.asarray(m)[off])
    np.testing.assert_array_equal(np.asarray(got.update)[off], 0)


def test_tpu_default_plan_with_rows_of_the_last_dim_matches_xla():
  """No multiple of 128 divides 1040 * 150: the default plan takes rows of the
  leaf's own 150 columns (no padding copy) and 5 tiles of 208 rows, accumulated."""
  shape = (1040, 150)
  assert pallas_tpu.plan_tiles(shape[0] * shape[1], 1, shape[1], 8) == (150, 208)
  g, m, v, p, _, key = _inputs(shape, jnp.float32, seed=3)
  kw = dict(count=2, learning_rate=1e-3, weight_decay=0.1, params=p)
  kw["scale"] = jax.random.uniform(key, ())
  want = kernels.masked_adam(g, m, v, implementation="xla", **kw)
  got = kernels.masked_adam(g, m, v, implementation="pallas", interpret="tpu", **kw)
  for name, a, b in zip(want._fields, got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("interpret", INTERPRETERS)
def test_kernel_under_vmap_matches_xla_per_example(interpret):
  """Mosaic kernels are mapped one example at a time (pallas_call's batching rule
  would add a grid axis the TPU kernel's dimension semantics do not name)."""
  layout = _blocks.block_layout((8, 128), "row")
  batch = [_inputs((8, 128), jnp.float32, seed=20 + s) for s in range(3)]
  g, m, v, _, pm, _ = (jnp.stack(x) for x in zip(*batch, strict=True))
  scale = jax.random.uniform(jax.random.key(4), (3, 8))

  def step(g, m, v, pm, scale, impl, interpret=False):
    return kernels.masked_adam(
      g, m, v, count=2, learning_rate=1e-2, scale=scale, layout=layout,
      param_mask=pm, implementation=impl, interpret=interpret,
    )  # fmt: skip

  got = jax.jit(jax.vmap(lambda *a: step(*a, "pallas", interpret)))(g, m, v, pm, scale)
  for i in range(3):
    want = step(g[i], m[i], v[i], pm[i], scale[i], "xla")
    for name, a, b in zip(want._fields, got, want, strict=True):
      np.testing.assert_allclose(a[i], b, rtol=2e-5, atol=1e-7, err_msg=name)


def _params():
  k = jax.random.split(jax.random.key(7), 3)
  return {
    "attn": {"q_proj": {"kernel": jax.random.normal(k[0], (6, 40))}},
    "mlp": {"up_proj": {"kernel": jax.random.normal(k[1], (3, 4, 5))}},
    "norm": {"scale": jax.random.normal(k[2], (33,))},
  }


def _run(tx, params, steps):
  state, update, out = tx.init(params), jax.jit(tx.update), []
  for t in range(steps):
    key = jax.random.fold_in(jax.random.key(1), t)
    grads = jax.tree.map(
      lambda x, key=key: (
        jax.random.normal(jax.random.fold_in(key, x.size), x.shape) + 0.3 * x
      ),
      params,
    )
    u, state = update(grads, state, params)
    params = optax.apply_updates(params, u)
    out.append(u)
  return out, state


@pytest.mark.parametrize("interpret", INTERPRETERS)
def test_adam_magma_with_the_kernel_equals_magma_adam(interpret):
  """3 steps, row blocks: masks equal bitwise, updates to rtol 1e-5 / atol 1e-9
  (the kernel's sums are derived from m_{t-1} and g, f32 rounding only)."""
  params = _params()
  want, want_state = _run(
    magma.magma(optax.adam(1e-2), key=4, granularity="row"), params, 3
  )
  tx = magma.adam_magma(
    1e-2, key=4, granularity="row", implementation="pallas", interpret=interpret
  )
  got, got_state = _run(tx, params, 3)
  for u_got, u_want in zip(got, want, strict=True):
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9),
      u_got,
      u_want,
    )
  masks_got = magma.mask_stats(got_state)["mask"]
  masks_want = magma.mask_stats(want_state)["mask"]
  jax.tree.map(np.testing.assert_array_equal, masks_got, masks_want)
  # Not vacuous: some blocks were masked out, some kept.
  drawn = np.concatenate([np.ravel(x) for x in jax.tree.leaves(masks_got)])
  assert 0 < drawn.mean() < 1


@pytest.mark.parametrize("bad", ["cpu", "TPU", 1, None, "mosaic"])
def test_bad_interpret_values_raise(bad):
  g = jnp.ones((4, 8))
  with pytest.raises(ValueError, match="interpret must be"):
    kernels.masked_adam(g, g, g, count=1, learning_rate=1e-3, interpret=bad)
  tx = magma.adam_magma(1e-3, implementation="pallas", interpret=bad)
  with pytest.raises(ValueError, match="interpret must be"):
    tx.update({"w": g}, tx.init({"w": g}), {"w": g})


def test_missing_interpreter_names_the_jax_version():
  g = jnp.ones((4, 8))
  if _compat.has_mosaic_gpu():
    assert dispatch.check_interpret("gpu") == "gpu"  # the positive control
    return
  with pytest.raises(ValueError, match=r"jax >= 0\.11\.2") as err:
    kernels.masked_adam(g, g, g, count=1, learning_rate=1e-3, interpret="gpu")
  assert jax.__version__ in str(err.value)
  # Also through the default implementation (an interpreter request is explicit).
  with pytest.raises(ValueError, match=r"jax >= 0\.11\.2"):
    kernels.masked_adam(
      g, g, g, count=1, learning_rate=1e-3, implementation=None, interpret="gpu"
    )


class _Device:
  def __init__(self, kind, capability):
    self.device_kind, self.compute_capability = kind, capability


@pytest.mark.parametrize(
  "backend, device, want",
  [
    ("tpu", None, "mosaic_tpu"),
    ("gpu", _Device("NVIDIA H100 80GB HBM3", "9.0"), "hopper"),
    ("gpu", _Device("NVIDIA H200", "9.0"), "hopper"),
    ("gpu", _Device("NVIDIA A100-SXM4-80GB", "8.0"), "triton"),
  ],
)
def test_pallas_picks_the_backends_kernel(monkeypatch, backend, device, want):
  """TPU -> Mosaic TPU; Hopper on jax >= 0.12 -> Mosaic GPU (no Triton lowering,
  hence no Triton deprecation warning); Triton only where it is the only option."""
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  if device is not None:
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
  if want == "hopper":
    mosaic_gpu = _compat.JAX_VERSION >= dispatch.MOSAIC_GPU_FROM
    want = "mosaic_gpu" if _compat.has_mosaic_gpu() and mosaic_gpu else "triton"
  assert dispatch.pallas_backend(False) == want
  assert dispatch.pallas_backend("tpu") == "mosaic_tpu"
  assert dispatch.pallas_backend(True) == "triton"


@pytest.mark.skipif(not _compat.has_mosaic_gpu(), reason=NO_GPU_INTERPRETER)
def test_mosaic_gpu_tiles_fit_bulk_copies():
  from magma_optax.kernels import mosaic_gpu as pallas_mgpu

  g = jnp.ones((4, 8))
  with pytest.raises(ValueError, match="multiple of 4"):
    pallas_mgpu.masked_adam_pallas_mgpu(
      g, g, g, jnp.ones(16), interpret=True,
      block_sizes=kernels.BlockSizes(2, 8),
    )  # fmt: skip


def test_tpu_tiles_are_checked():
  with pytest.raises(ValueError, match="multiple of 128"):
    pallas_tpu.check_tiles(kernels.BlockSizes(8, 64), 1000, 16, 8)
  with pytest.raises(ValueError, match="multiple of 32"):
    pallas_tpu.check_tiles(kernels.BlockSizes(16, 128), 1000, 64, 32)
  pallas_tpu.check_tiles(kernels.BlockSizes(16, 128), 100, 10, 32)  # whole dim: ok
  assert pallas_tpu.sublanes(jnp.float32) == 8
  assert pallas_tpu.sublanes(jnp.float32, jnp.bfloat16) == 16
  assert pallas_tpu.sublanes(jnp.bfloat16, jnp.int8) == 32


@pytest.mark.parametrize(
  "shape, granularity, sub",
  [
    ((4096, 1024), "tensor", 8),
    ((32000, 768), "tensor", 16),  # an embedding
    ((1000, 769), "tensor", 8),  # no multiple of 128 divides: rows of 769
    ((3072, 768), "row", 32),
    ((10_000, 32), "element", 32),
  ],
)
def test_default_tpu_tiles_are_legal_and_need_no_padding(shape, granularity, sub):
  layout = _blocks.block_layout(shape, granularity)
  nb, bs = layout.num_blocks, layout.block_size
  cols, rows = pallas_tpu.plan_tiles(bs, nb, shape[-1], sub)
  num_rows = nb if cols is None else bs // cols
  assert cols is None or bs % cols == 0, cols  # no padded columns
  assert num_rows % rows == 0, (num_rows, rows)  # no padded rows
  assert rows == num_rows or rows % sub == 0, rows  # TPU-legal
  lanes = -(-(bs if cols is None else cols) // 128) * 128
  assert rows * lanes <= 1 << 17  # fits the VMEM budget
  # The positive control: 4099 rows (a prime) have no divisor: padded to whole tiles.
  cols, rows = pallas_tpu.plan_tiles(1024 * 4099, 1, 1024, 8)
  assert cols == 1024 and 4099 % rows != 0 and rows % 8 == 0
