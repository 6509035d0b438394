"""Adam over compact tile storage as Pallas kernels that visit only the active tiles.

A leaf is viewed as ``g4`` of shape ``(rows, r, cols, c)``; the moments are ``(K, r,
c)`` arrays of ``K`` slots, slot ``j`` holding tile ``tile_index[j]`` (sorted; the
number of tiles marks an empty slot, which gets a zero gradient's update). A
kernel's grid runs over the slots, loads each slot's tile of ``g`` directly and
writes ``m'``, ``v'`` and the update: work and bytes follow ``K``, not the leaf.
One kernel per backend (``"mosaic_tpu"``, ``"triton"``, ``"mosaic_gpu"``);
:func:`why_unavailable` says what each needs. Design notes:
``docs/design/internals.md``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from magma_optax._core import compat as _compat
from magma_optax.kernels import reference

LANES = 128
TPU_STEP_ENTRIES = 1 << 16  # entries per Mosaic TPU grid step (all its slots)
TMA_BOX = 256  # the largest TMA box dimension
MGPU_SMEM_BYTES = 96 * 1024  # SMEM for one tile of g, m, v (of 227 KiB on Hopper)
MGPU_SLOTS = 4  # slots per group: their 4 int32 indices are one 16-byte TMA copy


def _is_power_of_two(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def why_unavailable(block: tuple[int, int], dtypes: Any, backend: str) -> str | None:
  """Why ``backend`` cannot run tiles of ``block`` for ``dtypes`` (``None``: it can).

  Args:
    block: the tile shape ``(r, c)``.
    dtypes: the dtypes of g, m and v (any iterable of dtype-likes).
    backend: ``"triton"``, ``"mosaic_tpu"`` or ``"mosaic_gpu"``.

  Returns:
    ``None``, or one sentence saying why not and what would work.
  """
  r, c = block
  for dtype in dtypes:
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
      return f"the tile kernels take float arrays; got {jnp.dtype(dtype).name}."
  if backend == "triton":
    if not (_is_power_of_two(r) and _is_power_of_two(c)):
      return (
        f"the Triton tile kernel needs r and c powers of two (Triton blocks); got"
        f" block {block}."
      )
    return None
  if backend == "mosaic_tpu":
    if r < 1 or c % LANES:
      return (
        f"the Mosaic TPU tile kernel needs c a multiple of {LANES} (TPU lanes) and"
        f" r >= 1; got block {block}."
      )
    return None
  if backend == "mosaic_gpu":
    if not _compat.has_mosaic_gpu():
      return (
        f"the Mosaic GPU tile kernel needs jax >= 0.11.2 (jax {jax.__version__} is"
        " installed); use the Triton kernel."
      )
    widths = [c * jnp.dtype(d).itemsize for d in dtypes]
    smem = sum(r * w for w in widths)
    if not (1 <= r <= TMA_BOX and 1 <= c <= TMA_BOX) or any(w % 16 for w in widths):
      return (
        f"the Mosaic GPU tile kernel copies tiles with TMA: r and c at most"
        f" {TMA_BOX}, and rows of c entries a multiple of 16 bytes; got block"
        f" {block}."
      )
    if smem > MGPU_SMEM_BYTES:
      return (
        f"the Mosaic GPU tile kernel keeps a tile of g, m and v in shared memory:"
        f" at most {MGPU_SMEM_BYTES} bytes; block {block} needs {smem}."
      )
    return None
  return f"backend must be 'triton', 'mosaic_tpu' or 'mosaic_gpu'; got {backend!r}."


def tile_adam_pallas(
  g4: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
  tile_index: jax.Array,
  hyper: jax.Array,
  *,
  backend: str,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One Adam step on the active tiles of a leaf (see the module docstring).

  Args:
    g4: the gradient viewed as ``(rows, r, cols, c)``; any float dtype.
    mu: first moments of the slots, ``(K, r, c)``; any float dtype.
    nu: second moments of the slots, ``(K, r, c)``; any float dtype.
    tile_index: int32 ``(K,)``, sorted, in ``[0, rows * cols]``; ``rows * cols``
      marks an empty slot.
    hyper: f32[NUM_HYPERPARAMS] from :func:`reference.hyperparams`.
    backend: ``"triton"``, ``"mosaic_tpu"`` or ``"mosaic_gpu"``.
    interpret: run in that backend's interpreter (CPU) instead of compiling.

  Returns:
    ``(new_mu, new_nu, update)``: ``(K, r, c)`` each, in mu's, nu's and g4's dtypes.

  Raises:
    ValueError: if the backend cannot run these tiles (:func:`why_unavailable`) or
      the shapes disagree.

  Example:

    >>> import jax.numpy as jnp
    >>> from magma_optax.kernels.tiles import pallas as pallas_tiles
    >>> from magma_optax.kernels import reference
    >>> hyper = reference.hyperparams(1, 1e-3, 0.0, reference.AdamConstants())
    >>> g4 = jnp.ones((2, 1, 2, 16)).at[1, :, 0].set(2.0)  # 4 tiles of (1, 16)
    >>> mu = nu = jnp.zeros((3, 1, 16))
    >>> tile_index = jnp.array([1, 2, 4], jnp.int32)  # tiles 1, 2; slot 2 is empty
    >>> m, v, u = pallas_tiles.tile_adam_pallas(
    ...   g4, mu, nu, tile_index, hyper, backend="triton", interpret=True
    ... )
    >>> [float(x) for x in m[:, 0, 0]]
    [0.1..., 0.2..., 0.0]
    >>> u.shape
    (3, 1, 16)
  """
  rows, r, cols, c = g4.shape
  k = tile_index.shape[0]
  if mu.shape != (k, r, c) or nu.shape != (k, r, c):
    raise ValueError(
      f"mu and nu must be (K, r, c) = {(k, r, c)} for g4 {g4.shape} and"
      f" tile_index {tile_index.shape}; got {mu.shape} and {nu.shape}."
    )
  reason = why_unavailable((r, c), (g4.dtype, mu.dtype, nu.dtype), backend)
  if reason is not None:
    raise ValueError(reason)
  if k == 0 or rows * cols == 0:
    shape = (k, r, c)
    return (
      jnp.zeros(shape, mu.dtype),
      jnp.zeros(shape, nu.dtype),
      jnp.zeros(shape, g4.dtype),
    )
  kernel = {"mosaic_tpu": _tpu, "triton": _triton, "mosaic_gpu": _mgpu}[backend]
  return kernel(
    g4,
    mu,
    nu,
    tile_index.astype(jnp.int32),
    hyper.astype(jnp.float32),
    interpret,
  )


def _out_shapes(g4, mu, nu):
  k, r, c = mu.shape
  return (
    jax.ShapeDtypeStruct((k, r, c), mu.dtype),
    jax.ShapeDtypeStruct((k, r, c), nu.dtype),
    jax.ShapeDtypeStruct((k, r, c), g4.dtype),
  )


def _store(new_m, new_v, u, m_out, v_out, u_out):
  m_out[...] = new_m.astype(m_out.dtype)
  v_out[...] = new_v.astype(v_out.dtype)
  u_out[...] = u.astype(u_out.dtype)


def _triton_kernel(idx_ref, hyper_ref, g_ref, m_ref, v_ref, *outs, shape):
  """Slot ``program_id(0)``: its tile of ``g`` loaded at the index it stores."""
  pl = _compat.pallas()
  cols, r, c, num_tiles = shape
  t = idx_ref[0]
  tc = jnp.minimum(t, num_tiles - 1)  # an empty slot reads the last tile, then 0
  g = g_ref[pl.ds((tc // cols) * r, r), pl.ds((tc % cols) * c, c)]
  g = jnp.where(t < num_tiles, g.astype(jnp.float32), 0.0)
  new_m, new_v, u = reference.tile_adam(
    g, m_ref[...], v_ref[...], None, None, hyper_ref
  )
  _store(new_m, new_v, u, *outs)


def _triton(g4, mu, nu, tile_index, hyper, interpret):
  pl = _compat.pallas()
  rows, r, cols, c = g4.shape
  k = mu.shape[0]
  slot = pl.BlockSpec((None, r, c), lambda j: (j, 0, 0))
  in_specs = [
    pl.BlockSpec((1,), lambda j: (j,)),
    pl.BlockSpec((reference.NUM_HYPERPARAMS,), lambda j: (0,)),
    pl.BlockSpec((rows * r, cols * c), lambda j: (0, 0)),  # loads pick the tile
    slot,
    slot,
  ]
  compiler_params = None
  if not interpret:
    compiler_params = _compat.triton_compiler_params(4 if r * c >= 2048 else 1)
  kernel = functools.partial(_triton_kernel, shape=(cols, r, c, rows * cols))
  return pl.pallas_call(
    kernel,
    out_shape=_out_shapes(g4, mu, nu),
    grid=(k,),
    in_specs=in_specs,
    out_specs=(slot, slot, slot),
    input_output_aliases={3: 0, 4: 1},
    compiler_params=compiler_params,
    interpret=interpret,
    name="tile_adam",
  )(tile_index, hyper, g4.reshape(rows * r, cols * c), mu, nu)


def _tpu_kernel(
  idx_ref, hyper_ref, g_hbm, m_ref, v_ref, m_out, v_out, u_out, g_buf, sems, *,
  shape,
):  # fmt: skip
  """Slots ``i S .. i S + S - 1``: their tiles of ``g`` DMA'd from HBM by index."""
  pl = _compat.pallas()
  pltpu = _compat.pallas_tpu()
  k, s, cols, c, num_tiles = shape
  first = pl.program_id(0) * s

  def copy(q):
    # Slots past K (a partial last block) copy the last slot's tile: written nowhere.
    t = jnp.minimum(idx_ref[jnp.minimum(first + q, k - 1)], num_tiles - 1)
    src = g_hbm.at[t // cols, :, pl.ds(pl.multiple_of((t % cols) * c, c), c)]
    return pltpu.make_async_copy(src, g_buf.at[q], sems.at[q])

  @pl.loop(0, s)
  def _start(q):
    copy(q).start()

  @pl.loop(0, s)
  def _wait(q):
    copy(q).wait()

  @pl.loop(0, s)
  def _zero_empty(q):
    @pl.when(idx_ref[jnp.minimum(first + q, k - 1)] >= num_tiles)
    def _():
      g_buf[q] = jnp.zeros(g_buf.shape[1:], g_buf.dtype)

  new_m, new_v, u = reference.tile_adam(
    g_buf[...], m_ref[...], v_ref[...], None, None, hyper_ref
  )
  _store(new_m, new_v, u, m_out, v_out, u_out)


def tpu_slots_per_step(k: int, r: int, c: int, dtypes: Any) -> int:
  """Slots per Mosaic TPU grid step: about ``TPU_STEP_ENTRIES`` entries, at most K.

  ``r`` counts as padded to the sublanes of the narrowest dtype (the tiles' rows in
  vector registers and VMEM).
  """
  sub = max(8 * 4 // jnp.dtype(d).itemsize for d in dtypes)
  return max(1, min(k, TPU_STEP_ENTRIES // (-(-r // sub) * sub * c)))


def _tpu(g4, mu, nu, tile_index, hyper, interpret):
  pl = _compat.pallas()
  pltpu = _compat.pallas_tpu()
  rows, r, cols, c = g4.shape
  k = mu.shape[0]
  s = tpu_slots_per_step(k, r, c, (g4.dtype, mu.dtype, nu.dtype))
  block = pl.BlockSpec((s, r, c), lambda i, idx, h: (i, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,  # tile_index, hyper: SMEM scalars
    grid=(math.ceil(k / s),),
    in_specs=[pl.BlockSpec(memory_space=pl.ANY), block, block],
    out_specs=[block, block, block],
    scratch_shapes=[
      pltpu.VMEM((s, r, c), g4.dtype),
      pltpu.SemaphoreType.DMA((s,)),
    ],
  )
  # m, v aliased to m', v'. Not in the TPU interpreter when the last block is
  # partial, where an aliased output fails to lower (docs/design/internals.md). A
  # TPU masks the last block's write-back.
  aliases = {} if interpret and k % s else {3: 0, 4: 1}
  kernel = functools.partial(_tpu_kernel, shape=(k, s, cols, c, rows * cols))
  return pl.pallas_call(
    kernel,
    out_shape=_out_shapes(g4, mu, nu),
    grid_spec=grid_spec,
    # Operand indices count the scalar-prefetch operands: (idx, hyper, g, m, v).
    input_output_aliases=aliases,
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
    interpret=pltpu.InterpretParams() if interpret else False,
    name="tile_adam_tpu",
  )(tile_index, hyper, g4.reshape(rows, r, cols * c), mu, nu)


def _mgpu_kernel(
  idx_g, hyper_g, g_g, m_g, v_g, m_out, v_out, u_out, *, shape, num_programs,
):  # fmt: skip
  """Program p takes the groups of slots p, p + P, ...: per group the 4 indices
  are copied to SMEM, then per slot its tile of g (by index), m and v are copied
  in, updated and copied out."""
  pl = _compat.pallas()
  plgpu = _compat.pallas_mosaic_gpu()
  k, r, c, cols, num_tiles, num_groups = shape

  def scoped(idx_s, hyper_s, g_s, m_s, v_s, barriers):
    plgpu.copy_gmem_to_smem(hyper_g, hyper_s, barriers.at[0])
    plgpu.barrier_wait(barriers.at[0])

    def one_slot(j, t):
      tc = jnp.minimum(t, num_tiles - 1)  # an empty slot reads the last tile, then 0
      tile = g_g.at[pl.ds((tc // cols) * r, r), pl.ds((tc % cols) * c, c)]
      copies = [(tile, g_s), (m_g.at[j], m_s), (v_g.at[j], v_s)]
      for b, (src, dst) in enumerate(copies, start=2):
        plgpu.copy_gmem_to_smem(src, dst, barriers.at[b])
      for b in range(2, 2 + len(copies)):
        plgpu.barrier_wait(barriers.at[b])
      g = jnp.where(t < num_tiles, g_s[...].astype(jnp.float32), 0.0)
      new_m, new_v, u = reference.tile_adam(g, m_s[...], v_s[...], None, None, hyper_s)
      _store(new_m, new_v, u, m_s, v_s, g_s)  # over the SMEM copies (same dtypes)
      plgpu.commit_smem()  # make the SMEM writes visible to the TMA engine
      for src, dst in ((m_s, m_out), (v_s, v_out), (g_s, u_out)):
        plgpu.copy_smem_to_gmem(src, dst.at[j])
      plgpu.wait_smem_to_gmem(0)  # the SMEM buffers are reused by the next slot

    @pl.loop(0, -(-num_groups // num_programs))
    def _step(n):
      group = pl.program_id(0) + n * num_programs

      @pl.when(group < num_groups)
      def _group():
        first = group * MGPU_SLOTS
        plgpu.copy_gmem_to_smem(
          idx_g.at[pl.ds(first, MGPU_SLOTS)], idx_s, barriers.at[1]
        )
        plgpu.barrier_wait(barriers.at[1])
        for q in range(MGPU_SLOTS):
          pl.when(first + q < k)(functools.partial(one_slot, first + q, idx_s[q]))

  smem = plgpu.SMEM
  pl.run_scoped(
    scoped,
    smem((MGPU_SLOTS,), jnp.int32),
    smem((reference.NUM_HYPERPARAMS,), jnp.float32),
    smem((r, c), g_g.dtype),
    smem((r, c), m_g.dtype),
    smem((r, c), v_g.dtype),
    plgpu.Barrier(num_barriers=5),
  )


def _mgpu(g4, mu, nu, tile_index, hyper, interpret):
  pl = _compat.pallas()
  plgpu = _compat.pallas_mosaic_gpu()
  rows, r, cols, c = g4.shape
  k = mu.shape[0]
  num_groups = -(-k // MGPU_SLOTS)
  # Whole groups of indices (empty slots past K, skipped): K int32s, not the state.
  idx = jnp.pad(
    tile_index, (0, num_groups * MGPU_SLOTS - k), constant_values=rows * cols
  )
  # One group per program on a GPU; in the interpreter one program takes all: it
  # keeps the writes of program 0 only (docs/design/internals.md).
  num_programs = 1 if interpret else num_groups
  gmem = pl.BlockSpec(memory_space=plgpu.GMEM)
  kernel = functools.partial(
    _mgpu_kernel,
    shape=(k, r, c, cols, rows * cols, num_groups),
    num_programs=num_programs,
  )
  return pl.pallas_call(
    kernel,
    out_shape=_out_shapes(g4, mu, nu),
    grid=(num_programs,),
    in_specs=[gmem] * 5,
    out_specs=[gmem] * 3,
    input_output_aliases={3: 0, 4: 1},
    compiler_params=plgpu.CompilerParams(),
    interpret=plgpu.InterpretGPUParams() if interpret else False,
    name="tile_adam_mgpu",
  )(idx, hyper, g4.reshape(rows * r, cols * c), mu, nu)
