"""Block sizes of the Pallas kernels: a frozen config with a heuristic.

:class:`BlockSizes` holds the rows and columns of a kernel's tile;
:meth:`BlockSizes.get_default` picks them from a leaf's block size and count.
"""

from __future__ import annotations

import dataclasses


def _next_power_of_2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile shape of the Pallas kernel (all fields static).

  Attributes:
    block_rows: rows per tile (power of two).
    block_cols: entries per row (power of two); every mask block is padded to a
      multiple of it.
    num_warps: Triton warps per program (``None``: 4).
  """

  block_rows: int = 4
  block_cols: int = 1024
  num_warps: int | None = None

  def __post_init__(self):
    for name in ("block_rows", "block_cols"):
      value = getattr(self, name)
      if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < 1
        or value & (value - 1)
      ):
        raise ValueError(f"{name} must be a power of two >= 1; got {value!r}.")
    if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(
        f"num_warps must be None or one of 1, 2, 4, 8, 16; got {self.num_warps!r}."
      )

  @classmethod
  def get_default(cls, block_size: int, num_blocks: int) -> BlockSizes:
    """The heuristic: rows of up to 1024 entries, tiles of about 4096 entries.

    Args:
      block_size: entries per mask block.
      num_blocks: number of mask blocks in the leaf.

    Returns:
      A :class:`BlockSizes` whose tile is never much larger than the leaf.
    """
    cols = min(1024, _next_power_of_2(block_size))
    rows_per_block = -(-block_size // cols)
    rows = min(max(4096 // cols, 1), _next_power_of_2(rows_per_block * num_blocks))
    return cls(block_rows=rows, block_cols=cols, num_warps=4 if cols >= 512 else 2)
