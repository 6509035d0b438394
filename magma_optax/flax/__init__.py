"""Flax pieces for magma_optax (needs flax: ``pip install "magma-optax[demo]"``).

Not imported by ``import magma_optax``: the core package depends on jax, optax and chex
only.
"""

from magma_optax.flax import llama
from magma_optax.flax.llama import Llama, LlamaConfig

__all__ = (
  "Llama",
  "LlamaConfig",
  "llama",
)
