"""Fused kernels: one Adam + mask + per-block scale pass, with Magma's partial sums.

Layout as in levanter's kernels: :mod:`api` is the entry point
(:func:`masked_adam`, with ``implementation=``), :mod:`reference` the plain-jnp
version (the XLA path), :mod:`pallas_gpu` the Pallas kernel, :mod:`partitioned` the
kernel on sharded leaves (one call per shard), :mod:`config` the block sizes;
:mod:`tiles` (:func:`tile_adam`) the Adam step over compact tile storage that
visits only the active tiles (:mod:`pallas_tiles` its kernel).
Importing this package does not need a GPU.
"""

from magma_optax.kernels.api import DEFAULT_IMPLEMENTATIONS
from magma_optax.kernels.api import IMPLEMENTATIONS
from magma_optax.kernels.api import PendingAdam
from magma_optax.kernels.api import derived_sums
from magma_optax.kernels.api import finish_masked_adam
from magma_optax.kernels.api import finish_masked_adam_many
from magma_optax.kernels.api import masked_adam
from magma_optax.kernels.api import resolve_implementation
from magma_optax.kernels.api import start_masked_adam
from magma_optax.kernels.config import BlockSizes
from magma_optax.kernels.reference import AdamConstants
from magma_optax.kernels.reference import MaskedAdamOutput
from magma_optax.kernels.reference import masked_adam_reference
from magma_optax.kernels.tiles import TileAdamOutput
from magma_optax.kernels.tiles import tile_adam

__all__ = (
  "DEFAULT_IMPLEMENTATIONS",
  "IMPLEMENTATIONS",
  "AdamConstants",
  "BlockSizes",
  "MaskedAdamOutput",
  "PendingAdam",
  "TileAdamOutput",
  "derived_sums",
  "finish_masked_adam",
  "finish_masked_adam_many",
  "masked_adam",
  "masked_adam_reference",
  "resolve_implementation",
  "start_masked_adam",
  "tile_adam",
)
