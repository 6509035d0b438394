"""Flat compact storage: the base's state for the active entries only.

A ``(capacity,)`` vector per leaf holds the active entries in flat-index order,
gathered from the gradient and scattered back into the update; the stored set is
kept as packed bits (1 bit per entry) and, with ``cache_index``, as the slots'
int32 indices, rebuilt only on the steps where the mask changes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from magma_optax.sparse import indices as _indices
from magma_optax.sparse import storage as _storage


@dataclasses.dataclass(frozen=True)
class Compact(_storage.Storage):
  """Flat compact storage: a ``(capacity,)`` vector of the active entries.

  Slot ``j`` holds the ``j``-th active entry in flat-index order; the stored set
  is kept as packed bits (1 bit per entry) and, with ``cache_index``, as the
  slots' int32 indices too (the step's index, rebuilt only when the mask changes).
  """

  capacity: int
  limit: str  # how the capacity was set, for the overflow message
  cache_index: bool = True

  scoped = True
  needs_mask = True
  compact = True
  failure_values = 1

  @property
  def stored_shape(self):
    return (self.capacity,)

  def init_leaf(self, x):
    return jnp.zeros(self.stored_shape, x.dtype)

  def init_bits(self):
    bits = jnp.zeros(((self.size + 7) // 8,), jnp.uint8)
    if not self.cache_index:
      return bits
    # The stored entries twice: packed bits (to see cheaply whether the mask
    # changed) and their indices (the step's ctx, rebuilt only when it changed).
    return bits, jnp.full((self.capacity,), self.size, jnp.int32)

  def failure_message(self, active: int, at_least: bool = False) -> str:
    return (
      f"sparse_state compact capacity overflow: leaf {self.name} (size"
      f" {self.size}) has {_storage.at_least(at_least)}{active} active entries in its"
      " parameter mask, more than"
      f" its compact storage holds: capacity {self.limit} = {self.capacity}."
      f" Raise `density` to at least {active / self.size:.4g} (the densest mask"
      " of the run: under a sparsity ramp, the early masks), or use mode='skip'."
    )

  def bound_problem(self, bound):
    if bound.entries is not None and bound.entries > self.capacity:
      return self.failure_message(bound.entries, not bound.exact)
    return None

  def bound_suffices(self, bound):
    return bound.exact and bound.entries is not None and bound.entries <= self.capacity

  def prepare(self, mask, bits, grad, whole=False, record=False):
    del whole
    _storage.reject_explicit(grad, mask, "unstructured compact storage", "entries")
    flat = mask.reshape(-1)
    if not self.cache_index:
      if record:  # a mask that does not fit: the stored entries instead
        idx, n_active, flat = _storage.held(
          record,
          lambda f: _indices.active_or_stored(f, bits, self.capacity),
          lambda f: (*_indices.active_indices(f, self.capacity), f),
          flat,
        )
      else:
        idx, n_active = _indices.active_indices(flat, self.capacity)
      check = _storage.check_capacity(n_active, self.capacity, self.failure_message)
      new_bits = jnp.packbits(flat)
      return idx, new_bits, jnp.any(new_bits != bits), check
    new_bits = jnp.packbits(flat)
    # The index build reads every entry (a serial scatter on XLA:CPU): only when
    # the mask changed (`rebuild`). Until then the stored indices, whose count was
    # checked when they were built.
    old_bits, old_idx = bits
    return old_idx, (new_bits, old_idx), jnp.any(new_bits != old_bits), None

  @property
  def rebuilds(self):
    return self.cache_index

  def rebuild(self, mask, stored=None):
    """The active entries' indices and count; given the ``stored`` packed bits, a
    mask with more active entries than the capacity gives the stored ones'
    indices (and its own count)."""
    if stored is None:
      return _indices.active_indices(mask.reshape(-1), self.capacity)
    return _indices.active_or_stored(mask.reshape(-1), stored, self.capacity)[:2]

  def rebuilt_check(self, n_active):
    return _storage.check_capacity(n_active, self.capacity, self.failure_message)

  def remap(self, ctx, x, bits):
    if self.cache_index:
      return _indices.moved(ctx, x, bits[1], self.size)
    old_mask = jnp.unpackbits(bits, count=self.size).astype(jnp.bool_)
    old_idx, _ = _indices.active_indices(old_mask, self.capacity)
    return _indices.moved(ctx, x, old_idx, self.size)

  def gather(self, ctx, x):
    return jnp.take(
      x.reshape(-1), ctx, mode="fill", fill_value=0, indices_are_sorted=True
    )

  def stored_mask(self, ctx, mask):
    del mask
    return ctx < self.size

  def scatter(self, ctx, mask, u):
    del mask
    full = (
      jnp.zeros((self.size,), u.dtype)
      .at[ctx]
      .set(u, mode="drop", indices_are_sorted=True)
    )
    return full.reshape(self.shape)
