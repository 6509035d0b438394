"""magma_optax: masked updates for adaptive optimizers, as optax transforms.

SkipUpdate and Magma (Joo et al., On Surprising Effectiveness of Masking Updates in
Adaptive Optimizers, arXiv 2602.15322, 2026), block masks, and sparse training.
"""

from magma_optax import sharding  # public submodule: magma_optax.sharding
from magma_optax._alignment import AlignmentMaskState
from magma_optax._alignment import alignment_mask
from magma_optax._blocks import BlockLayout
from magma_optax._blocks import block_layout
from magma_optax._damping import damping
from magma_optax._masks import BernoulliMaskState
from magma_optax._masks import bernoulli_mask
from magma_optax._scoping import attention_mlp_weights
from magma_optax._scoping import transformer_labels
from magma_optax._stats import mask_stats
from magma_optax._wrappers import MaskedUpdateState
from magma_optax._wrappers import magma
from magma_optax._wrappers import skip_update

__version__ = "0.1.0"

__all__ = (
    "AlignmentMaskState",
    "BernoulliMaskState",
    "BlockLayout",
    "MaskedUpdateState",
    "alignment_mask",
    "attention_mlp_weights",
    "bernoulli_mask",
    "block_layout",
    "damping",
    "magma",
    "mask_stats",
    "sharding",
    "skip_update",
    "transformer_labels",
)
