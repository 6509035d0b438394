"""The fused masked-Adam kernel: XLA vs plain numpy, Pallas (interpret) vs XLA.

Pallas runs in interpret mode on CPU, so shapes are small and every grid has at most
16 steps (the block sizes are chosen per case).
"""

import _hlo
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magma_optax import kernels
from magma_optax._core import blocks as _blocks
from magma_optax._core import compat as _compat
from magma_optax.kernels import api
from magma_optax.kernels import dispatch
from magma_optax.kernels import partitioned
from magma_optax.kernels import reference
from magma_optax.kernels import triton as pallas_gpu

B1, B2, EPS = 0.9, 0.999, 1e-8


def _inputs(shape, dtype, seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  g = jax.random.normal(k[0], shape, jnp.float32)
  m = 0.1 * jax.random.normal(k[1], shape, jnp.float32)
  v = jax.random.uniform(k[2], shape, jnp.float32) * 0.01
  p = jax.random.normal(k[3], shape, jnp.float32)
  pm = jax.random.bernoulli(k[4], 0.7, shape)
  cast = lambda x: x.astype(dtype)
  return cast(g), cast(m), cast(v), cast(p), pm


def _numpy_adam(g, m, v, p, pm, scale_leaf, count, lr, wd):
  """Independent float64 numpy version of one masked AdamW step."""
  g, m, v, p = (np.asarray(x, np.float64) for x in (g, m, v, p))
  new_m = B1 * m + (1 - B1) * g
  new_v = B2 * v + (1 - B2) * g * g
  u = (new_m / (1 - B1**count)) / (np.sqrt(new_v / (1 - B2**count)) + EPS)
  u = -lr * scale_leaf * (u + wd * p)
  if pm is not None:
    pm = np.asarray(pm)
    new_m, new_v = np.where(pm, new_m, m), np.where(pm, new_v, v)
    u = np.where(pm, u, 0.0)
  return new_m, new_v, u


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("granularity", ["tensor", "row", "column"])
def test_reference_matches_numpy(granularity, masked):
  shape = (6, 10)
  g, m, v, p, pm = _inputs(shape, jnp.float32)
  pm = pm if masked else None
  layout = _blocks.block_layout(shape, granularity)
  scale = jnp.linspace(0.1, 1.0, layout.num_blocks).reshape(layout.block_shape)
  out = kernels.masked_adam(
    g, m, v, count=3, learning_rate=1e-2, weight_decay=0.05, params=p,
    param_mask=pm, scale=scale, layout=layout, implementation="xla",
  )  # fmt: skip
  want_m, want_v, want_u = _numpy_adam(
    g, m, v, p, pm, np.asarray(layout.to_leaf(scale)), 3, 1e-2, 0.05
  )
  np.testing.assert_allclose(out.mu, want_m, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(out.nu, want_v, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(out.update, want_u, rtol=1e-5, atol=1e-9)
  keep = np.ones(shape, bool) if pm is None else np.asarray(pm)
  mm, gg = np.where(keep, want_m, 0.0), np.where(keep, np.asarray(g, np.float64), 0)
  block_sum = lambda x: np.asarray(layout.block_sum(jnp.asarray(x)))
  np.testing.assert_allclose(out.mu_dot_grad, block_sum(mm * gg), rtol=1e-5)
  np.testing.assert_allclose(out.mu_sq_norm, block_sum(mm * mm), rtol=1e-5)
  np.testing.assert_allclose(out.grad_sq_norm, block_sum(gg * gg), rtol=1e-5)


# (shape, granularity, stack_axes, block sizes): odd sizes that need padding of both
# the columns and the rows, several blocks per leaf, one element per block.
PALLAS_CASES = [
  ((13, 50), "row", 0, kernels.BlockSizes(8, 16)),  # 4 padded rows per block
  ((3, 7, 11), "tensor", 0, kernels.BlockSizes(4, 32)),
  ((4, 5, 6), "tensor", 1, kernels.BlockSizes(2, 32)),
  ((5, 3), "element", 0, kernels.BlockSizes(4, 1)),
  ((129,), "tensor", 0, None),
]


def _grid_steps(shape, granularity, stack_axes, sizes):
  layout = _blocks.block_layout(shape, granularity, stack_axes)
  sizes = sizes or kernels.BlockSizes.get_default(layout.block_size, layout.num_blocks)
  rows_per_block = -(-layout.block_size // sizes.block_cols)
  return -(-(layout.num_blocks * rows_per_block) // sizes.block_rows)


def test_pallas_cases_are_small():
  for shape, gran, stack, sizes in PALLAS_CASES:
    assert _grid_steps(shape, gran, stack, sizes) <= 16, (shape, gran)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", range(len(PALLAS_CASES)))
def test_pallas_interpret_matches_xla(case, dtype):
  shape, granularity, stack_axes, sizes = PALLAS_CASES[case]
  g, m, v, p, pm = _inputs(shape, dtype, seed=case)
  layout = _blocks.block_layout(shape, granularity, stack_axes)
  scale = jax.random.uniform(jax.random.key(10 + case), layout.block_shape)
  use_mask = case % 2 == 0  # half the cases with a parameter mask, half with decay
  kw = dict(
    count=jnp.asarray(4, jnp.int32),
    learning_rate=jnp.asarray(3e-3),
    scale=scale,
    layout=layout,
    param_mask=pm if use_mask else None,
    params=None if use_mask else p,
    weight_decay=0.0 if use_mask else 0.1,
  )
  want = kernels.masked_adam(g, m, v, implementation="xla", **kw)
  got = kernels.masked_adam(
    g, m, v, implementation="pallas", interpret=True, block_sizes=sizes, **kw
  )
  tol = dict(rtol=1e-5, atol=1e-7) if dtype == jnp.float32 else dict(rtol=1e-2)
  for name in ("mu", "nu", "update"):
    a, b = getattr(got, name), getattr(want, name)
    assert a.dtype == b.dtype == dtype, name
    assert a.shape == shape
    # bf16: both paths compute in f32 and round once; allow one bf16 ulp.
    np.testing.assert_allclose(
      np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name, **tol
    )
  for name in ("mu_dot_grad", "mu_sq_norm", "grad_sq_norm"):
    a, b = getattr(got, name), getattr(want, name)
    assert a.dtype == jnp.float32 and a.shape == layout.block_shape, name
    # f32 accumulation in a different order (per-row partials, then per block).
    rtol = 2e-5 if dtype == jnp.float32 else 1e-4
    np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6, err_msg=name)
  if use_mask:  # entries that do not exist keep their moments and get no update
    off = ~np.asarray(pm)
    np.testing.assert_array_equal(np.asarray(got.mu)[off], np.asarray(m)[off])
    np.testing.assert_array_equal(np.asarray(got.update)[off], 0)


def test_pallas_scale_callable_uses_exact_derived_sums():
  shape = (16, 24)
  g, m, v, _, _ = _inputs(shape, jnp.float32, seed=7)
  layout = _blocks.block_layout(shape, "row")
  seen = {}

  def scale(dot, mm, gg):
    seen["sums"] = (dot, mm, gg)
    return jax.nn.sigmoid(dot / jnp.sqrt(mm * gg))

  kw = dict(count=2, learning_rate=1e-3, layout=layout, scale=scale)
  got = kernels.masked_adam(
    g, m, v, implementation="pallas", interpret=True,
    block_sizes=kernels.BlockSizes(8, 32), **kw,
  )  # fmt: skip
  derived = seen["sums"]
  want = kernels.masked_adam(g, m, v, implementation="xla", **kw)
  # The sums derived from m_{t-1} equal the kernel's direct sums of m_t.
  for d, direct in zip(derived, got[3:], strict=True):
    np.testing.assert_allclose(d, direct, rtol=1e-5)
  np.testing.assert_allclose(got.update, want.update, rtol=1e-5, atol=1e-9)


def test_carried_and_derived_sums_equal_direct():
  shape = (8, 12)
  g, m, _, _, _ = _inputs(shape, jnp.float32, seed=3)
  layout = _blocks.block_layout(shape, "row")
  new_m = 0.9 * m + 0.1 * g
  dot = layout.block_sum(new_m * g)
  mm = layout.block_sum(new_m * new_m)
  gg = layout.block_sum(g * g)
  derived = api.derived_sums(layout, m, g, 0.9)
  carried = api.carried_sums(layout, new_m, g, layout.block_sum(m * m), 0.9)
  for got in (derived, carried):
    for a, b in zip(got, (dot, mm, gg), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _cancelling_inputs(shape=(2, 32), d=1e-4, seed=4):
  """Row 0: g = -(b1 / (1 - b1) + d) m_{t-1}, so m_t = -(1 - b1) d m_{t-1} nearly
  cancels, parallel to g (cosine -1... +1 exactly); row 1: random."""
  k = jax.random.split(jax.random.key(seed), 2)
  m = jax.random.normal(k[0], shape)
  g = jax.random.normal(k[1], shape)
  g = g.at[0].set(-(B1 / (1 - B1) + d) * m[0])
  return g, m


def _direct_sums64(m, g):
  """float64 row sums of m_t as the step stores it (float32) with g."""
  new_m = np.asarray((1 - B1) * g + B1 * m, np.float64)
  g = np.asarray(g, np.float64)
  return (new_m * g).sum(-1), (new_m * new_m).sum(-1), (g * g).sum(-1)


def test_derived_and_carried_sums_mark_cancelled_blocks_nan():
  shape = (2, 32)
  layout = _blocks.block_layout(shape, "row")
  g, m = _cancelling_inputs(shape)
  dot64, mm64, gg64 = _direct_sums64(m, g)
  new_m = (B1 * m + (1 - B1) * g).astype(jnp.float32)
  derived = api.derived_sums(layout, m, g, B1)
  carried = api.carried_sums(layout, new_m, g, layout.block_sum(m * m), B1)
  for dot, mm, gg in (derived, carried):
    # The cancelled block is NaN ("sum it directly"), not a wrong value...
    assert np.isnan(mm[0]), mm
    # ... the other is the direct sum's value.
    np.testing.assert_allclose(mm[1], mm64[1], rtol=1e-5)
    np.testing.assert_allclose(gg, gg64, rtol=1e-5)
    np.testing.assert_allclose(dot[1], dot64[1], rtol=1e-5)
  # Without the check the derived value would be far off: the test can fail.
  naive = (
    B1 * B1 * float(jnp.sum(m[0] ** 2))
    + 2 * B1 * (1 - B1) * float(jnp.sum(m[0] * g[0]))
    + (1 - B1) ** 2 * float(jnp.sum(g[0] ** 2))
  )
  assert abs(naive - mm64[0]) > 0.1 * mm64[0]
  # All-zero blocks are exact zeros, not NaN.
  z = jnp.zeros(shape)
  for _, mm, _ in (
    api.derived_sums(layout, z, z, B1),
    api.carried_sums(layout, z, z, jnp.zeros(2), B1),
  ):
    np.testing.assert_array_equal(mm, 0.0)


@pytest.mark.parametrize(
  "implementation, interpret", [("xla", False), ("pallas", True)]
)
def test_scale_callable_sees_direct_sums_where_the_recursion_cancels(
  implementation, interpret
):
  shape = (2, 32)
  layout = _blocks.block_layout(shape, "row")
  g, m = _cancelling_inputs(shape)
  v = jnp.full(shape, 0.01)
  dot64, mm64, gg64 = _direct_sums64(m, g)
  seen = {}

  def scale(dot, mm, gg):  # records the sums the step computed (under jit)
    jax.debug.callback(lambda *s: seen.setdefault("sums", s), dot, mm, gg)
    return jax.nn.sigmoid(dot / jnp.sqrt(mm * gg))

  kw = dict(count=2, learning_rate=1e-3, layout=layout, scale=scale)
  if implementation == "pallas":
    kw["block_sizes"] = kernels.BlockSizes(2, 32)

  @jax.jit
  def step(g, m, v, prev):
    if implementation == "xla":  # the carried path
      kw["mu_sq_norm_prev"] = prev
    return kernels.masked_adam(
      g, m, v, implementation=implementation, interpret=interpret, **kw
    ).update

  jax.block_until_ready(step(g, m, v, layout.block_sum(m * m)))
  dot, mm, gg = (np.asarray(x, np.float64) for x in seen["sums"])
  # Row 0's m_t is itself ill-conditioned in float32 (relative rounding ~5e-3 at
  # d = 1e-4: XLA and the kernel may contract the EMA differently), so its sum
  # agrees to 2e-2; the recursion alone is off by more than 10% there (above).
  np.testing.assert_allclose(mm[0], mm64[0], rtol=2e-2)
  np.testing.assert_allclose(mm[1], mm64[1], rtol=1e-5)
  cos = dot / np.sqrt(mm * gg)
  np.testing.assert_allclose(cos, dot64 / np.sqrt(mm64 * gg64), atol=2e-3)
  assert abs(cos[0] - 1.0) < 2e-3  # m_t nearly parallel to g in the cancelled row


def test_explicit_pallas_off_accelerator_fails_with_reason():
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU message")
  g = jnp.ones((4, 4))
  for request in ("pallas", ("pallas",)):
    with pytest.raises(ValueError, match="interpret=True") as err:
      kernels.masked_adam(g, g, g, count=1, learning_rate=1e-3, implementation=request)
    assert "GPU" in str(err.value) and "'cpu'" in str(err.value)


def test_default_and_sequence_fall_back_to_xla():
  layout = _blocks.block_layout((4, 4), "tensor")
  col = _blocks.block_layout((4, 4), "column")
  # The default is XLA until benchmarks/gpu_check.py has validated the kernel.
  assert kernels.resolve_implementation(None, layout=layout) == "xla"
  # A sequence is resolved per platform the step is lowered for: the kernel on a
  # GPU or a TPU, XLA elsewhere (here, the CPU), with the XLA path's values.
  seq = ("pallas", "xla")
  assert kernels.resolve_implementation(seq, layout=layout) == "pallas"
  assert dispatch.off_device(seq) == "xla" and dispatch.off_device("pallas") is None
  g, m, v, _, _ = _inputs((4, 4), jnp.float32)
  kw = dict(count=2, learning_rate=1e-2, scale=jnp.asarray(0.5))
  got = kernels.masked_adam(g, m, v, implementation=seq, **kw)
  want = kernels.masked_adam(g, m, v, implementation="xla", **kw)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
  assert (
    kernels.resolve_implementation("pallas", layout=layout, interpret=True) == "pallas"
  )
  # Non-contiguous blocks: the default falls back, an explicit request says why.
  assert kernels.resolve_implementation(None, layout=col, interpret=True) == "xla"
  with pytest.raises(ValueError, match="contiguous"):
    kernels.resolve_implementation("pallas", layout=col, interpret=True)
  with pytest.raises(ValueError, match="implementation must be one of"):
    kernels.resolve_implementation("triton", layout=layout)
  with pytest.raises(ValueError, match="empty"):
    kernels.resolve_implementation((), layout=layout)
  with pytest.raises(ValueError, match="contiguous"):
    pallas_gpu.masked_adam_pallas(
      jnp.ones((4, 4)), jnp.ones((4, 4)), jnp.ones((4, 4)), jnp.ones(16),
      layout=col, interpret=True,
    )  # fmt: skip


def test_block_sizes_config():
  assert kernels.BlockSizes.get_default(3_000_000, 1) == kernels.BlockSizes(4, 1024, 4)
  small = kernels.BlockSizes.get_default(50, 37)
  assert small.block_cols == 64 and small.block_rows * small.block_cols <= 4096
  one = kernels.BlockSizes.get_default(1, 15)
  assert one.block_cols == 1 and one.block_rows == 16
  for bad in (dict(block_rows=3), dict(block_cols=0), dict(num_warps=3)):
    with pytest.raises(ValueError):
      kernels.BlockSizes(**bad)


def test_shape_checks():
  with pytest.raises(ValueError, match="one shape"):
    kernels.masked_adam(
      jnp.ones(3), jnp.ones(4), jnp.ones(3), count=1, learning_rate=1.0
    )
  with pytest.raises(ValueError, match="layout is for shape"):
    kernels.masked_adam(
      jnp.ones(3), jnp.ones(3), jnp.ones(3), count=1, learning_rate=1.0,
      layout=_blocks.block_layout((4,), "tensor"),
    )  # fmt: skip


@pytest.mark.parametrize(
  "entry",
  [pallas_gpu.masked_adam_pallas, partitioned.masked_adam_pallas_partitioned],
  ids=["kernel", "partitioned"],
)
@pytest.mark.parametrize("masked", [False, True])
def test_pallas_kernel_lowers_to_triton_without_a_gpu(masked, entry):
  """Cross-lowering for CUDA runs the Pallas -> Triton lowering on any host.

  It catches unsupported ops in the kernel body; compiling the Triton IR to PTX and
  running it needs a GPU (benchmarks/gpu_check.py). On jax >= 0.11 the lowering
  emits jax's deprecation warning for the Triton backend, and only there.
  """
  import warnings

  from jax import export

  shape = (100, 300)
  layout = _blocks.block_layout(shape, "row")
  dtype = jnp.bfloat16 if masked else jnp.float32

  def fused(g, m, v, p, pm, scale, hyper):
    return entry(
      g, m, v, hyper, scale=scale, layout=layout,
      param_mask=pm if masked else None, params=None if masked else p,
    )  # fmt: skip

  spec = jax.ShapeDtypeStruct
  args = [spec(shape, dtype)] * 4 + [
    spec(shape, jnp.bool_), spec((100,), jnp.float32),
    spec((reference.NUM_HYPERPARAMS,), jnp.float32),
  ]  # fmt: skip
  triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  with warnings.catch_warnings(record=True) as caught, _hlo.abstract_gpu():
    warnings.simplefilter("always")
    exported = export.export(
      jax.jit(fused), platforms=["cuda"], disabled_checks=[triton]
    )(*args)
  text = exported.mlir_module()
  assert "xla.gpu.triton" in text
  assert len(exported.out_avals) == 6
  deprecations = [w for w in caught if "Triton backend is deprecated" in str(w.message)]
  assert bool(deprecations) == _compat.TRITON_DEPRECATED, caught


def test_default_path_lowers_no_pallas_kernel_and_no_triton_warning(monkeypatch):
  """The XLA default never reaches the Pallas kernel, so jax's Triton deprecation
  warning (jax >= 0.11) cannot show; an explicit ``"pallas"`` request does reach it
  (the positive control, on any jax: the same counter sees its calls)."""
  import warnings

  import optax

  import magma_optax as magma
  from magma_optax.kernels import grouped

  calls = []

  def counted(kernel):
    def call(*args, **kwargs):
      calls.append(kernel.__name__)
      return kernel(*args, **kwargs)

    return call

  for module, name in (
    (pallas_gpu, "masked_adam_pallas"),
    (grouped, "masked_adam_grouped"),
  ):
    monkeypatch.setattr(module, name, counted(getattr(module, name)))
  params = {"w": jnp.ones((8, 16)), "b": jnp.ones(16)}

  def steps(*txs):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      for tx in txs:
        jax.jit(tx.update)(params, tx.init(params), params)
    return [w for w in caught if "Triton" in str(w.message)]

  assert not steps(magma.adam_magma(1e-3), magma.magma(optax.adam(1e-3)))
  assert not calls
  steps(magma.adam_magma(1e-3, implementation="pallas", interpret=True))
  assert calls == ["masked_adam_grouped"]  # one kernel call for both leaves
  steps(
    magma.adam_magma(
      1e-3, implementation="pallas", interpret=True, block_sizes=kernels.BlockSizes()
    )
  )
  assert calls[1:] == ["masked_adam_pallas"] * 2  # the per-leaf kernel, per leaf


def test_pallas_under_vmap_matches_xla_per_example():
  """The partitioned kernel has a vmap rule (custom_partitioning alone has none)."""
  shape, layout = (8, 128), _blocks.block_layout((8, 128), "row")
  batch = [_inputs(shape, jnp.float32, seed=s) for s in range(3)]
  g, m, v, p, pm = (jnp.stack(x) for x in zip(*batch, strict=True))
  scale = jax.random.uniform(jax.random.key(3), (3, 8))

  def step(g, m, v, pm, scale, impl):
    return kernels.masked_adam(
      g, m, v, count=2, learning_rate=1e-2, scale=scale, layout=layout,
      param_mask=pm, implementation=impl, interpret=impl == "pallas",
    )  # fmt: skip

  got = jax.jit(jax.vmap(lambda *a: step(*a, "pallas")))(g, m, v, pm, scale)
  for i in range(3):
    want = step(g[i], m[i], v[i], pm[i], scale[i], "xla")
    for a, b in zip(got, want, strict=True):
      np.testing.assert_allclose(a[i], b, rtol=2e-5, atol=1e-7)
