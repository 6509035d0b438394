"""A leaf seen as rows of its blocks: the layout the Pallas kernels tile.

Each block of a :class:`magma_optax.BlockLayout` must be contiguous in memory
(:func:`is_contiguous`); :func:`to_rows` pads each block to a multiple of the
kernel's columns and the rows to a multiple of its rows, :func:`from_rows` undoes
it, and :func:`row_sums_to_blocks` adds the kernel's per-row partial sums per block.
"""

from __future__ import annotations

import jax.numpy as jnp

from magma_optax._core import blocks as _blocks


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
