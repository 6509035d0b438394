"""The fused masked-Adam step as a Mosaic TPU kernel (TPU; its interpreter on CPU).

The per-entry work is :mod:`magma_optax.kernels.triton`'s; the layout is TPU's: the
leaf is seen with each block contiguous, one block per row or one block's rows per
tile (:func:`plan_tiles`, TPU-legal tiles), the grid's second, ``"arbitrary"`` axis
walks one block's tiles while its three sums accumulate in VMEM, and the
hyperparameters are scalar-prefetch operands in SMEM. ``interpret="tpu"`` runs it in
``pltpu.InterpretParams()``; ``benchmarks/tpu_check.py`` compiles it on a TPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from magma_optax._core import blocks as _blocks
from magma_optax._core import compat as _compat
from magma_optax.kernels import config as config_lib
from magma_optax.kernels import reference
from magma_optax.kernels import rows as _rows

LANES = 128
MAX_ROW = 4096  # entries of one row of a long block
TILE_ENTRIES = 1 << 17  # double-buffered tiles within the default scoped VMEM


def sublanes(*dtypes) -> int:
  """Rows of a TPU tile for the narrowest of ``dtypes`` (8 for 32-bit, 16, 32)."""
  return max(8 * 4 // jnp.dtype(d).itemsize for d in dtypes)


def check_tiles(
  sizes: config_lib.BlockSizes, block_size: int, num_rows: int, sub: int
) -> None:
  """Raises ``ValueError`` unless ``sizes`` gives TPU-legal tiles for this leaf.

  ``num_rows``: the rows of the leaf's view (a tile spanning all of them is legal
  at any count).
  """
  if block_size > sizes.block_cols and sizes.block_cols % LANES:
    raise ValueError(
      f"block_cols={sizes.block_cols} must be a multiple of {LANES} on a TPU when"
      f" mask blocks ({block_size} entries) span several rows."
    )
  if num_rows > sizes.block_rows and sizes.block_rows % sub:
    raise ValueError(
      f"block_rows={sizes.block_rows} must be a multiple of {sub} on a TPU for"
      " these dtypes (8 rows for 32-bit, 16 for 16-bit, 32 for the int8 mask)."
    )


def _largest_divisor(n: int, step: int, limit: int) -> int | None:
  """The largest multiple of ``step`` that is at most ``limit`` and divides ``n``."""
  for k in range(limit // step * step, 0, -step):
    if n % k == 0:
      return k
  return None


def plan_tiles(
  block_size: int,
  num_blocks: int,
  last_dim: int,
  sub: int,
  block_sizes: config_lib.BlockSizes | None = None,
) -> tuple[int | None, int]:
  """``(cols, rows)`` of the kernel's view of a leaf (``docs/design/internals.md``).

  ``cols is None``: one block per row, tiles of ``rows`` blocks. Else each block is
  rows of ``cols`` entries and a tile is ``rows`` of them. ``block_sizes`` given:
  ``block_cols`` is the row length of long blocks (blocks of at most that many
  entries are one row each) and ``block_rows`` the tile's rows, checked by
  :func:`check_tiles`. Otherwise the heuristic: tiles of about 2**17 entries (in
  VMEM rows take whole 128-lane registers), blocks of up to 4096 entries one row
  each, longer blocks cut into rows of a multiple of 128 that divides the block
  (else the leaf's last dimension when at least 128 lanes, else 4096 lanes,
  padded), and ``rows`` a multiple of ``sub`` that divides the row count when one
  of at least a quarter of a tile does -- so that no copy pads a leaf whose sizes
  allow a tile without one.

  Args:
    block_size: entries per mask block.
    num_blocks: number of mask blocks.
    last_dim: the leaf's last dimension (divides ``block_size`` for blocks of
      more than one entry).
    sub: the sublane count of the narrowest dtype (:func:`sublanes`).
    block_sizes: optional explicit tile shape.

  Returns:
    ``(cols, rows)``.

  Raises:
    ValueError: if ``block_sizes`` does not give TPU-legal tiles.
  """
  if block_sizes is not None:
    cols = None if block_size <= block_sizes.block_cols else block_sizes.block_cols
    num_rows = num_blocks if cols is None else -(-block_size // cols)
    check_tiles(block_sizes, block_size, num_rows, sub)
    return cols, min(num_rows, block_sizes.block_rows)
  if block_size <= MAX_ROW:
    cols, num_rows, lanes = None, num_blocks, _round_up(block_size, LANES)
  else:
    cols = _largest_divisor(block_size, LANES, MAX_ROW)
    if cols is None:
      fits = LANES <= last_dim <= MAX_ROW and block_size % last_dim == 0
      cols = last_dim if fits else MAX_ROW
    num_rows, lanes = -(-block_size // cols), _round_up(cols, LANES)
  target = max(sub, TILE_ENTRIES // lanes // sub * sub)
  if num_rows <= target:
    return cols, num_rows  # one tile spans the rows: legal at any count
  rows = _largest_divisor(num_rows, sub, target)
  return cols, rows if rows is not None and 4 * rows >= target else target


def _kernel(hyper_ref, scale_ref, *refs, has_mask, has_params):
  """One tile; the sums' output blocks stay resident along grid axis 1."""
  it = iter(refs)
  g_ref, m_ref, v_ref = next(it), next(it), next(it)
  mask_ref = next(it) if has_mask else None
  p_ref = next(it) if has_params else None
  m_out, v_out, u_out, dot_out, msq_out, gsq_out = it
  pl = _compat.pallas()

  @pl.when(pl.program_id(1) == 0)
  def _init():
    for ref in (dot_out, msq_out, gsq_out):
      ref[...] = jnp.zeros(ref.shape, jnp.float32)

  g = g_ref[...].astype(jnp.float32)
  keep = mask_ref[...].astype(jnp.int32) != 0 if has_mask else None
  p = p_ref[...] if has_params else None
  new_m, new_v, u = reference.tile_adam(g, m_ref[...], v_ref[...], keep, p, hyper_ref)
  u = u * scale_ref[...]  # (rows, 1) or (1, 1, 1): broadcast over the tile
  out_m = new_m.astype(m_out.dtype)
  # The sums see the stored moment, as a cosine computed after the step would.
  sm = out_m.astype(jnp.float32)
  if has_mask:
    u = jnp.where(keep, u, 0.0)
    sm = jnp.where(keep, sm, 0.0)
    g = jnp.where(keep, g, 0.0)
  m_out[...] = out_m
  v_out[...] = new_v.astype(v_out.dtype)
  u_out[...] = u.astype(u_out.dtype)
  dot_out[...] += _tile_sum(sm * g)
  msq_out[...] += _tile_sum(sm * sm)
  gsq_out[...] += _tile_sum(g * g)


def _tile_sum(x):
  """A tile's per-block sum, keeping dims: (rows, n) -> (rows, 1) for the view of
  short blocks, (1, rows, cols) -> (1, 1, 1) for long ones. One axis at a time
  (lanes, then sublanes), the reductions Mosaic lowers directly."""
  x = jnp.sum(x, axis=-1, keepdims=True)
  return jnp.sum(x, axis=-2, keepdims=True) if x.ndim == 3 else x


def _round_up(n: int, k: int) -> int:
  return -(-n // k) * k


def masked_adam_pallas_tpu(
  grad: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
  hyper: jax.Array,
  *,
  scale: jax.Array | None = None,
  layout: _blocks.BlockLayout | None = None,
  param_mask: jax.Array | None = None,
  params: jax.Array | None = None,
  block_sizes: config_lib.BlockSizes | None = None,
  interpret: bool = False,
) -> reference.MaskedAdamOutput:
  """The Mosaic TPU version of :func:`reference.masked_adam_reference`.

  Args:
    block_sizes: tile shape (see :func:`plan_tiles`); default: its heuristic.
    interpret: run in the TPU interpreter (``pltpu.InterpretParams()``, on CPU).

  Raises:
    ValueError: if the layout's blocks are not contiguous, or ``block_sizes``
      does not give TPU-legal tiles.
  """
  pl = _compat.pallas()
  pltpu = _compat.pallas_tpu()
  layout = layout or reference.tensor_layout(grad.shape)
  _rows.check_contiguous(layout)
  shape = tuple(grad.shape)
  nb, bs = layout.num_blocks, layout.block_size
  if math.prod(shape) == 0:
    return reference.masked_adam_reference(
      grad, mu, nu, hyper, scale=scale, layout=layout,
      param_mask=param_mask, params=params,
    )  # fmt: skip
  dtypes = [grad.dtype, mu.dtype, nu.dtype]
  dtypes += [jnp.int8] if param_mask is not None else []
  dtypes += [params.dtype] if params is not None else []
  sub = sublanes(*dtypes)
  cols, rows = plan_tiles(bs, nb, layout.expanded_shape[-1], sub, block_sizes)
  if cols is None:  # one block per row: (nb, bs), tiles of blocks
    nb_pad = _round_up(nb, rows)
    view = (nb_pad, bs)
    tile, small = (rows, bs), (rows, 1)
    grid = (nb_pad // rows, 1)
    tile_map = lambda i, j, h: (i, 0)
    small_map = lambda i, j, h: (i, 0)
    bs_pad = bs
  else:  # each block is R rows of cols lanes: (nb, R, cols), tiles within a block
    r_pad = _round_up(-(-bs // cols), rows)
    nb_pad, bs_pad = nb, r_pad * cols
    view = (nb, r_pad, cols)
    tile, small = (1, rows, cols), (1, 1, 1)
    grid = (nb, r_pad // rows)
    tile_map = lambda i, j, h: (i, j, 0)
    small_map = lambda i, j, h: (i, 0, 0)

  def to_view(x):
    x = x.reshape(nb, bs)
    if (nb_pad, bs_pad) != (nb, bs):  # pad only where the shape needs it
      x = jnp.pad(x, ((0, nb_pad - nb), (0, bs_pad - bs)))
    return x.reshape(view)

  def from_view(x):
    return x.reshape(nb_pad, bs_pad)[:nb, :bs].reshape(shape)

  if scale is None:
    scale = jnp.ones(layout.block_shape, jnp.float32)
  scale = jnp.asarray(scale, jnp.float32).reshape(nb)
  scale = jnp.pad(scale, (0, nb_pad - nb)).reshape((nb_pad,) + (1,) * (len(view) - 1))
  leaves = [grad, mu, nu]
  leaves += [param_mask.astype(jnp.int8)] if param_mask is not None else []
  leaves += [params] if params is not None else []
  tile_spec = pl.BlockSpec(tile, tile_map)
  small_spec = pl.BlockSpec(small, small_map)
  out_shape = _rows.out_shapes(view, scale.shape, grad, mu, nu)
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,  # hyper: SMEM scalars
    grid=grid,
    in_specs=[small_spec] + [tile_spec] * len(leaves),
    out_specs=[tile_spec] * 3 + [small_spec] * 3,
  )
  kernel = functools.partial(
    _kernel,
    has_mask=param_mask is not None,
    has_params=params is not None,
  )
  new_m, new_v, u, dot, msq, gsq = pl.pallas_call(
    kernel,
    out_shape=out_shape,
    grid_spec=grid_spec,
    # Operand indices count the scalar-prefetch operand: (hyper, scale, g, m, v).
    input_output_aliases={3: 0, 4: 1},
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    interpret=pltpu.InterpretParams() if interpret else False,
    name="masked_adam_tpu",
  )(hyper.astype(jnp.float32), scale, *(to_view(x) for x in leaves))

  def block_sums(x):
    return x.reshape(nb_pad)[:nb].reshape(layout.block_shape)

  return reference.MaskedAdamOutput(
    from_view(new_m),
    from_view(new_v),
    from_view(u),
    block_sums(dot),
    block_sums(msq),
    block_sums(gsq),
  )
