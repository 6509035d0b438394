"""Flax pieces for magma_optax (needs flax: ``pip install "magma-optax[demo]"``).

Not imported by ``import magma_optax``: the core package depends on jax, optax and chex
only.
"""

from magma_optax.flax import llama
from magma_optax.flax import scaling
from magma_optax.flax.llama import Llama
from magma_optax.flax.llama import LlamaConfig
from magma_optax.flax.scaling import ScaledMaskedDense
from magma_optax.flax.scaling import ScaledMaskedLinear
from magma_optax.flax.scaling import SparsityMask
from magma_optax.flax.scaling import assign_masks
from magma_optax.flax.scaling import knowledge_distillation_loss

__all__ = (
  "Llama",
  "LlamaConfig",
  "ScaledMaskedDense",
  "ScaledMaskedLinear",
  "SparsityMask",
  "assign_masks",
  "knowledge_distillation_loss",
  "llama",
  "scaling",
)
