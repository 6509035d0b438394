"""Flax pieces for magma_optax (needs the ``flax`` extra: ``pip install magma-optax[demo]``).

Not imported by ``import magma_optax``: the core package depends on jax, optax and chex
only.
"""
