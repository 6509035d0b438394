"""Skip storage: the base's state kept for every entry, frozen where the mask is off.

The base runs on the whole leaf; inactive entries keep their state and get a zero
update. The new state is frozen where the base computes it
(:mod:`magma_optax.sparse.freeze`), so that the base's update reads it in place.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from magma_optax._core import trees as _trees
from magma_optax._core import xla_cpu as _xla_cpu
from magma_optax.kernels import reference
from magma_optax.sparse import storage as _storage


@dataclasses.dataclass(frozen=True)
class Skip(_storage.Storage):
  """Dense storage, masked: inactive entries keep their state, their update is 0."""

  scoped = True
  freezable = True

  def freeze(self, ctx, mask, new, old):
    del ctx
    return new if mask is None else _xla_cpu.kept(mask, new, old)

  def scatter(self, ctx, mask, u):
    del ctx
    return u if mask is None else jnp.where(mask, u, jnp.zeros([], u.dtype))

  def fused_adam(self, ctx, mask, g, m, v, args):
    if mask is None or _trees.is_masked(mask):
      return super().fused_adam(ctx, mask, g, m, v, args)
    # The frozen moments merged first (reference.moments keeps them), and the
    # update computed from them as stored: XLA writes them in place and the
    # update's loop reads them there (_xla_cpu.in_place).
    m32, v32 = reference.moments(g, m, v, args.hyper, mask)
    m32, v32 = _xla_cpu.in_place((m32.astype(m.dtype), v32.astype(v.dtype)))
    return _storage.adam_update(m32, v32, g, m, v, args)
