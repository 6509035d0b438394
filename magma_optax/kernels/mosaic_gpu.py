"""The fused masked-Adam step as a Mosaic GPU kernel (Hopper GPUs, jax >= 0.12).

The simplest correct kernel: the leaf in the row layout of
:mod:`magma_optax.kernels.rows`, a 1-D grid, and per tile TMA copies of g, m, v (the
mask, the params) to shared memory, the step in registers, and copies of m', v' and
the update back (m, v aliased to m', v'); the per-row sums are added per block after
it. ``interpret="gpu"`` runs it in ``plgpu.InterpretGPUParams()`` (jax >= 0.11.2);
``benchmarks/gpu_check.py`` compiles it on a Hopper GPU. Why a second GPU kernel,
where each GPU kernel runs, and what is not done: ``docs/design/internals.md``.
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


def _kernel(*refs, has_mask, has_params, rows, cols, num_tiles, num_programs):
  """Program i updates tiles i, i + P, i + 2P, ... (P = ``num_programs``): each
  tile of (rows, cols) is copied in, updated and copied out."""
  pl = _compat.pallas()
  plgpu = _compat.pallas_mosaic_gpu()
  n_in = 5 + has_mask + has_params
  ins, outs = refs[:n_in], refs[n_in:]
  hyper_g, scale_g = ins[:2]
  leaves_g = ins[2:]  # g, m, v[, mask][, params]
  m_g, v_g, u_g, dot_g, msq_g, gsq_g = outs

  def scoped(hyper_s, scale_s, *rest):
    @pl.loop(0, -(-num_tiles // num_programs))
    def _step(k):
      t = pl.program_id(0) + k * num_programs

      @pl.when(t < num_tiles)
      def _tile():
        one_tile(pl.ds(t * rows, rows), hyper_s, scale_s, *rest)

  def one_tile(tile, hyper_s, scale_s, *rest):
    leaves_s = rest[: len(leaves_g)]
    dot_s, msq_s, gsq_s, barriers = rest[len(leaves_g) :]
    copies = [(hyper_g, hyper_s), (scale_g.at[tile], scale_s)]
    copies += [(x.at[tile], s) for x, s in zip(leaves_g, leaves_s, strict=True)]
    for k, (src, dst) in enumerate(copies):
      plgpu.copy_gmem_to_smem(src, dst, barriers.at[k])
    for k in range(len(copies)):
      plgpu.barrier_wait(barriers.at[k])
    it = iter(leaves_s)
    g_s, m_s, v_s = next(it), next(it), next(it)
    mask_s = next(it) if has_mask else None
    p_s = next(it) if has_params else None
    g = g_s[...].astype(jnp.float32)
    keep = mask_s[...].astype(jnp.int32) != 0 if has_mask else None
    p = p_s[...] if has_params else None
    new_m, new_v, u = reference.tile_adam(g, m_s[...], v_s[...], keep, p, hyper_s)
    u = u * scale_s[...][:, None]
    out_m = new_m.astype(m_s.dtype)
    sm = out_m.astype(jnp.float32)  # the sums see the stored moment
    if has_mask:
      u = jnp.where(keep, u, 0.0)
      sm = jnp.where(keep, sm, 0.0)
      g = jnp.where(keep, g, 0.0)
    # The results overwrite the SMEM copies of m, v and g (same dtypes).
    m_s[...] = out_m
    v_s[...] = new_v.astype(v_s.dtype)
    g_s[...] = u.astype(g_s.dtype)
    dot_s[...] = jnp.sum(sm * g, axis=1)
    msq_s[...] = jnp.sum(sm * sm, axis=1)
    gsq_s[...] = jnp.sum(g * g, axis=1)
    plgpu.commit_smem()  # make the SMEM writes visible to the TMA engine
    for src, dst in ((m_s, m_g), (v_s, v_g), (g_s, u_g)):
      plgpu.copy_smem_to_gmem(src, dst.at[tile])
    for src, dst in ((dot_s, dot_g), (msq_s, msq_g), (gsq_s, gsq_g)):
      plgpu.copy_smem_to_gmem(src, dst.at[tile])
    plgpu.wait_smem_to_gmem(0)  # the SMEM buffers are reused by the next tile

  smem = plgpu.SMEM
  scratch = [
    smem((reference.NUM_HYPERPARAMS,), jnp.float32),
    smem((rows,), jnp.float32),
  ]
  scratch += [smem((rows, cols), x.dtype) for x in leaves_g]
  scratch += [smem((rows,), jnp.float32)] * 3
  scratch.append(plgpu.Barrier(num_barriers=2 + len(leaves_g)))
  pl.run_scoped(scoped, *scratch)


def masked_adam_pallas_mgpu(
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
  """The Mosaic GPU version of :func:`reference.masked_adam_reference`.

  Args:
    block_sizes: tile shape; default :meth:`BlockSizes.get_default` with at
      least 4 rows and 16 entries (TMA copies whole multiples of 16 bytes).
    interpret: run in the Mosaic GPU interpreter (``plgpu.InterpretGPUParams()``,
      on CPU; jax >= 0.11.2).

  Raises:
    ValueError: if the layout's blocks are not contiguous, the tile is too small
      for TMA copies, or this jax has no Mosaic GPU Pallas API.
  """
  pl = _compat.pallas()
  plgpu = _compat.pallas_mosaic_gpu()
  layout = layout or reference.tensor_layout(grad.shape)
  _rows.check_contiguous(layout)
  shape = tuple(grad.shape)
  nb, bs = layout.num_blocks, layout.block_size
  if math.prod(shape) == 0:
    return reference.masked_adam_reference(
      grad, mu, nu, hyper, scale=scale, layout=layout,
      param_mask=param_mask, params=params,
    )  # fmt: skip
  if block_sizes is None:
    sizes = config_lib.BlockSizes.get_default(bs, nb)
    cols, rows = sizes.block_cols, max(sizes.block_rows, 4, 16 // sizes.block_cols)
  else:
    cols, rows = block_sizes.block_cols, block_sizes.block_rows
  if rows % 4 or rows * cols % 16:
    raise ValueError(
      "the Mosaic GPU kernel copies tiles and per-row vectors with bulk TMA"
      " copies of whole multiples of 16 bytes: block_rows must be a multiple of 4"
      f" and block_rows * block_cols of 16; got {rows} x {cols}."
    )
  view = _rows.RowView(layout, shape, rows, cols)
  inputs = view.inputs(grad, mu, nu, hyper, scale, param_mask, params)
  num_tiles = view.num_rows // rows
  # One tile per program on a GPU. The GPU interpreter keeps the writes of program
  # 0 only (docs/design/internals.md), so there one program walks over all tiles:
  # the same code, with P = 1.
  num_programs = 1 if interpret else num_tiles
  gmem = pl.BlockSpec(memory_space=plgpu.GMEM)
  out_shape = view.out_shape(grad, mu, nu)
  kernel = functools.partial(
    _kernel,
    has_mask=param_mask is not None,
    has_params=params is not None,
    rows=rows,
    cols=cols,
    num_tiles=num_tiles,
    num_programs=num_programs,
  )
  new_m, new_v, u, dot, msq, gsq = pl.pallas_call(
    kernel,
    out_shape=out_shape,
    grid=(num_programs,),
    in_specs=[gmem] * len(inputs),
    out_specs=[gmem] * len(out_shape),
    input_output_aliases={3: 0, 4: 1},
    compiler_params=plgpu.CompilerParams(),
    interpret=plgpu.InterpretGPUParams() if interpret else False,
    name="masked_adam_mgpu",
  )(*inputs)
  return view.outputs(new_m, new_v, u, dot, msq, gsq)
