"""Flax layers for sparse training (needs flax: ``pip install "magma-optax[flax]"``).

Learnable weight scaling over a parameter mask (:class:`ScaledMaskedLinear`,
:class:`ScaledMaskedDense`), the mask as a variable (:class:`SparsityMask`,
:func:`assign_masks`) and a distillation loss. Not imported by ``import
magma_optax``; the demo's model is :mod:`magma_optax.demo.llama`.
"""

try:
  import flax  # noqa: F401
except ImportError as e:  # say which extra brings it
  raise ImportError(
    "magma_optax.flax needs flax, which magma_optax does not install by default:"
    ' pip install "magma-optax[flax]" (or "magma-optax[demo]" for the demo too).'
  ) from e

from magma_optax.flax import scaling
from magma_optax.flax.scaling import ScaledMaskedDense
from magma_optax.flax.scaling import ScaledMaskedLinear
from magma_optax.flax.scaling import SparsityMask
from magma_optax.flax.scaling import assign_masks
from magma_optax.flax.scaling import knowledge_distillation_loss

__all__ = (
  "ScaledMaskedDense",
  "ScaledMaskedLinear",
  "SparsityMask",
  "assign_masks",
  "knowledge_distillation_loss",
  "scaling",
)
