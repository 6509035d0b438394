"""Fused kernels: one Adam + mask + per-block scale pass, with Magma's partial sums.

:func:`masked_adam` (:mod:`~magma_optax.kernels.api`, with ``implementation=``:
:mod:`~magma_optax.kernels.dispatch`) runs the XLA reference
(:mod:`~magma_optax.kernels.reference`) or a Pallas kernel named as
``dispatch.pallas_backend()`` names it (:mod:`~magma_optax.kernels.triton`,
:mod:`~magma_optax.kernels.mosaic_gpu`, :mod:`~magma_optax.kernels.mosaic_tpu`), per
shard on sharded leaves (:mod:`~magma_optax.kernels.partitioned`); :func:`tile_adam`
is Adam over the active tiles of compact tile storage. Knows nothing of masking,
pruning or sparse state; importing it needs no GPU.
"""

from magma_optax.kernels.api import PendingAdam
from magma_optax.kernels.api import derived_sums
from magma_optax.kernels.api import finish_masked_adam
from magma_optax.kernels.api import finish_masked_adam_many
from magma_optax.kernels.api import masked_adam
from magma_optax.kernels.api import start_masked_adam
from magma_optax.kernels.config import BlockSizes
from magma_optax.kernels.dispatch import DEFAULT_IMPLEMENTATIONS
from magma_optax.kernels.dispatch import IMPLEMENTATIONS
from magma_optax.kernels.dispatch import resolve_implementation
from magma_optax.kernels.reference import AdamConstants
from magma_optax.kernels.reference import MaskedAdamOutput
from magma_optax.kernels.reference import masked_adam_reference
from magma_optax.kernels.tiles.api import TileAdamOutput
from magma_optax.kernels.tiles.api import tile_adam

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
