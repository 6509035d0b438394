"""The fused Adam step over the active tiles of compact tile storage."""

from magma_optax.kernels.tiles.api import TileAdamOutput
from magma_optax.kernels.tiles.api import tile_adam

__all__ = ("TileAdamOutput", "tile_adam")
