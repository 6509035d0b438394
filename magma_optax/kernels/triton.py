"""The fused masked-Adam step as a Pallas Triton kernel (GPU; interpreter on CPU).

One pass over memory per leaf: each program loads a tile of g, m, v (and p for
weight decay, the parameter mask where given), computes the new moments, the masked
update and the three per-row partial sums of Magma's cosine in float32, and stores
them (m, v aliased to m', v'). The leaf is seen as rows of its blocks
(:mod:`magma_optax.kernels.rows`). It runs for CUDA and ROCm where the Mosaic GPU
kernel does not, with explicit ``block_sizes`` or where the step may be partitioned
over devices (else :mod:`magma_optax.kernels.grouped` takes many leaves in one
call), and under the generic Pallas interpreter (``interpret=True``).
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


def _kernel(*refs, has_mask, has_params):
  """One (block_rows, block_cols) tile; see the module docstring."""
  it = iter(refs)
  hyper_ref, scale_ref, g_ref, m_ref, v_ref = (next(it) for _ in range(5))
  mask_ref = next(it) if has_mask else None
  p_ref = next(it) if has_params else None
  m_out, v_out, u_out, dot_out, msq_out, gsq_out = it
  g = g_ref[...].astype(jnp.float32)
  keep = mask_ref[...] != 0 if has_mask else None
  p = p_ref[...] if has_params else None
  new_m, new_v, u = reference.tile_adam(g, m_ref[...], v_ref[...], keep, p, hyper_ref)
  u = u * scale_ref[...][:, None]
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
  dot_out[...] = jnp.sum(sm * g, axis=1)
  msq_out[...] = jnp.sum(sm * sm, axis=1)
  gsq_out[...] = jnp.sum(g * g, axis=1)


def masked_adam_pallas(
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
  """The Pallas version of :func:`reference.masked_adam_reference` (same arguments).

  Args:
    block_sizes: tile shape; default :meth:`BlockSizes.get_default`.
    interpret: run in the Pallas interpreter (any backend; slow, for tests).

  Raises:
    ValueError: if the layout's blocks are not contiguous.
  """
  pl = _compat.pallas()  # imported on first use

  layout = layout or reference.tensor_layout(grad.shape)
  _rows.check_contiguous(layout)
  shape = tuple(grad.shape)
  nb = layout.num_blocks
  bs = layout.block_size
  if math.prod(shape) == 0:
    return reference.masked_adam_reference(
      grad, mu, nu, hyper, scale=scale, layout=layout,
      param_mask=param_mask, params=params,
    )  # fmt: skip
  sizes = block_sizes or config_lib.BlockSizes.get_default(bs, nb)
  cols, rows = sizes.block_cols, sizes.block_rows
  view = _rows.RowView(layout, shape, rows, cols)
  inputs = view.inputs(grad, mu, nu, hyper, scale, param_mask, params)
  tile = pl.BlockSpec((rows, cols), lambda i: (i, 0))
  row_vec = pl.BlockSpec((rows,), lambda i: (i,))
  hyper_spec = pl.BlockSpec((reference.NUM_HYPERPARAMS,), lambda i: (0,))
  in_specs = [hyper_spec, row_vec] + [tile] * (len(inputs) - 2)
  out_shape = view.out_shape(grad, mu, nu)
  compiler_params = None
  if not interpret:
    compiler_params = _compat.triton_compiler_params(sizes.num_warps or 4)
  kernel = functools.partial(
    _kernel,
    has_mask=param_mask is not None,
    has_params=params is not None,
  )
  new_m, new_v, u, dot, msq, gsq = pl.pallas_call(
    kernel,
    out_shape=out_shape,
    grid=(view.num_rows // rows,),
    in_specs=in_specs,
    out_specs=(tile, tile, tile, row_vec, row_vec, row_vec),
    input_output_aliases={3: 0, 4: 1},
    compiler_params=compiler_params,
    interpret=interpret,
    name="masked_adam",
  )(*inputs)
  return view.outputs(new_m, new_v, u, dot, msq, gsq)
