"""A leaf seen as rows of its blocks: the layout the Pallas kernels tile.

Each block of a :class:`magma_optax.BlockLayout` must be contiguous in memory
(:func:`is_contiguous`); :func:`to_rows` pads each block to a multiple of the
kernel's columns and the rows to a multiple of its rows, :func:`from_rows` undoes
it, and :func:`row_sums_to_blocks` adds the kernel's per-row partial sums per block.
:class:`RowView` does all three for one masked-Adam call.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from magma_optax._core import blocks as _blocks
from magma_optax.kernels import reference


def is_contiguous(layout: _blocks.BlockLayout) -> bool:
  """Whether each block of ``layout`` is one contiguous run of memory."""
  n = len(layout.expanded_shape)
  k = len(layout.reduce_axes)
  return tuple(layout.reduce_axes) == tuple(range(n - k, n))


def check_contiguous(layout: _blocks.BlockLayout) -> None:
  """Raises ``ValueError`` unless every block of ``layout`` is contiguous."""
  if not is_contiguous(layout):
    raise ValueError(
      "the Pallas kernel needs each mask block contiguous in memory (granularity"
      " 'tensor', 'row' or 'element'); this leaf's layout"
      f" {layout.expanded_shape} reduces axes {layout.reduce_axes}."
    )


def to_rows(x, num_blocks, block_size, padded_size, num_rows, cols):
  """(leaf) -> (num_rows, cols): blocks padded to ``padded_size``, rows padded."""
  x = x.reshape(num_blocks, block_size)
  if padded_size != block_size:
    x = jnp.pad(x, ((0, 0), (0, padded_size - block_size)))
  x = x.reshape(-1, cols)
  if x.shape[0] != num_rows:
    x = jnp.pad(x, ((0, num_rows - x.shape[0]), (0, 0)))
  return x


def from_rows(x, shape, num_blocks, block_size, padded_size):
  """(num_rows, cols) -> the leaf: the inverse of :func:`to_rows`."""
  x = x[: num_blocks * padded_size // x.shape[1]].reshape(num_blocks, padded_size)
  return x[:, :block_size].reshape(shape)


def row_sums_to_blocks(row_sums, layout: _blocks.BlockLayout, rows_per_block: int):
  """Per-row partial sums -> per-block sums of ``layout.block_shape``."""
  nb = layout.num_blocks
  per_block = row_sums[: nb * rows_per_block].reshape(nb, rows_per_block)
  return jnp.sum(per_block, axis=1).reshape(layout.block_shape)


def out_shapes(view, sums, grad, mu, nu) -> tuple:
  """A masked-Adam kernel's results: new mu, nu and update of shape ``view`` (in
  the dtypes of ``mu``, ``nu``, ``grad``), and three float32 sums of shape ``sums``."""
  sums = jax.ShapeDtypeStruct(sums, jnp.float32)
  return (
    jax.ShapeDtypeStruct(view, mu.dtype),
    jax.ShapeDtypeStruct(view, nu.dtype),
    jax.ShapeDtypeStruct(view, grad.dtype),
    sums,
    sums,
    sums,
  )


@dataclasses.dataclass(frozen=True)
class RowView:
  """One leaf's masked-Adam operands as rows of ``cols`` entries, tiled by ``rows``.

  Each block is padded to ``padded`` entries (``rows_per_block`` rows), the rows to
  ``num_rows``, a multiple of ``rows``.
  """

  layout: _blocks.BlockLayout
  shape: tuple[int, ...]
  rows: int
  cols: int

  @property
  def padded(self) -> int:
    return -(-self.layout.block_size // self.cols) * self.cols

  @property
  def rows_per_block(self) -> int:
    return self.padded // self.cols

  @property
  def num_rows(self) -> int:
    n = self.layout.num_blocks * self.rows_per_block
    return -(-n // self.rows) * self.rows

  def to_rows(self, x: jax.Array) -> jax.Array:
    layout = self.layout
    return to_rows(
      x, layout.num_blocks, layout.block_size, self.padded, self.num_rows, self.cols
    )

  def from_rows(self, x: jax.Array) -> jax.Array:
    layout = self.layout
    return from_rows(x, self.shape, layout.num_blocks, layout.block_size, self.padded)

  def inputs(self, grad, mu, nu, hyper, scale, param_mask, params) -> list:
    """The kernel's operands: hyper, the per-row scale, grad, mu, nu rows, then
    the int8 mask rows and the parameter rows where given."""
    layout = self.layout
    if scale is None:
      scale = jnp.ones(layout.block_shape, jnp.float32)
    scale = jnp.asarray(scale, jnp.float32).reshape(layout.num_blocks)
    row_scale = jnp.repeat(scale, self.rows_per_block)
    row_scale = jnp.pad(row_scale, (0, self.num_rows - row_scale.shape[0]))
    out = [hyper.astype(jnp.float32), row_scale]
    out += [self.to_rows(x) for x in (grad, mu, nu)]
    if param_mask is not None:
      out.append(self.to_rows(param_mask.astype(jnp.int8)))
    if params is not None:
      out.append(self.to_rows(params))
    return out

  def out_shape(self, grad, mu, nu) -> tuple:
    """The kernel's results: new mu, nu and update rows, three per-row sums."""
    return out_shapes((self.num_rows, self.cols), (self.num_rows,), grad, mu, nu)

  def outputs(self, new_m, new_v, u, dot, msq, gsq) -> reference.MaskedAdamOutput:
    """The kernel's results back on the leaf and its blocks."""
    sums = (
      row_sums_to_blocks(x, self.layout, self.rows_per_block) for x in (dot, msq, gsq)
    )
    back = self.from_rows
    return reference.MaskedAdamOutput(back(new_m), back(new_v), back(u), *sums)
