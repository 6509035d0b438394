"""magma_optax: masked updates for adaptive optimizers, as optax transforms.

SkipUpdate and Magma (Joo et al., On Surprising Effectiveness of Masking Updates in
Adaptive Optimizers, arXiv 2602.15322, 2026), block masks, and sparse training.
"""

from magma_optax import sharding  # public submodule: magma_optax.sharding
from magma_optax._core.blocks import BlockLayout
from magma_optax._core.blocks import block_layout
from magma_optax._core.labels import attention_mlp_weights
from magma_optax._core.labels import transformer_labels
from magma_optax.masking.adam_magma import AdamMagmaState
from magma_optax.masking.adam_magma import adam_magma
from magma_optax.masking.alignment import AlignmentMaskState
from magma_optax.masking.alignment import alignment_mask
from magma_optax.masking.bernoulli import BernoulliMaskState
from magma_optax.masking.bernoulli import bernoulli_mask
from magma_optax.masking.damping import damping
from magma_optax.masking.methods import MaskedUpdateState
from magma_optax.masking.methods import magma
from magma_optax.masking.methods import skip_update
from magma_optax.masking.scope_report import ScopeReport
from magma_optax.masking.scope_report import ScopeRow
from magma_optax.masking.scope_report import scope_report
from magma_optax.masking.stats import mask_stats
from magma_optax.pruning.masked_decay import MaskedWeightDecayState
from magma_optax.pruning.masked_decay import masked_weight_decay
from magma_optax.pruning.periodic import PeriodicMaskState
from magma_optax.pruning.periodic import periodic_mask
from magma_optax.pruning.schedules import linear_sparsity_schedule
from magma_optax.pruning.schedules import polynomial_sparsity_schedule
from magma_optax.sparse.adam import sparse_adam
from magma_optax.sparse.errors import check_sparse_state
from magma_optax.sparse.offload import host_offload_available
from magma_optax.sparse.offload import offload_sparse_state
from magma_optax.sparse.state import SparseState
from magma_optax.sparse.state import sparse_state

__version__ = "0.1.0"

__all__ = (
  "AdamMagmaState",
  "AlignmentMaskState",
  "BernoulliMaskState",
  "BlockLayout",
  "MaskedUpdateState",
  "MaskedWeightDecayState",
  "PeriodicMaskState",
  "ScopeReport",
  "ScopeRow",
  "SparseState",
  "adam_magma",
  "alignment_mask",
  "attention_mlp_weights",
  "bernoulli_mask",
  "block_layout",
  "check_sparse_state",
  "damping",
  "host_offload_available",
  "linear_sparsity_schedule",
  "magma",
  "mask_stats",
  "masked_weight_decay",
  "offload_sparse_state",
  "periodic_mask",
  "polynomial_sparsity_schedule",
  "scope_report",
  "sharding",
  "skip_update",
  "sparse_adam",
  "sparse_state",
  "transformer_labels",
)
