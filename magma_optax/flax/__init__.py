"""Flax pieces for magma_optax (needs flax: ``pip install "magma-optax[flax]"``).

Not imported by ``import magma_optax``: the core package depends on jax, optax and
numpy only.
"""

try:
  import flax  # noqa: F401
except ImportError as e:  # say which extra brings it
  raise ImportError(
    "magma_optax.flax needs flax, which magma_optax does not install by default:"
    ' pip install "magma-optax[flax]" (or "magma-optax[demo]" for the demo too).'
  ) from e

from magma_optax.demo import llama
from magma_optax.demo.llama import Llama
from magma_optax.demo.llama import LlamaConfig
from magma_optax.flax import scaling
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
