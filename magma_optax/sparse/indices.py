"""Sorted indices of the active items of a mask, and the slot maps between two of them.

Compact storage keeps the ``j``-th active item (entry or tile) in slot ``j``:
:func:`active_indices` finds the items' indices, :func:`slot_indices` the slot of
each item, and :func:`moved` carries stored values to the slots of a new set.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def active_indices(flat_mask: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """``jnp.nonzero(flat_mask, size=size, fill_value=len(flat_mask))[0]``, faster, and
  the number of active entries (int32).

  ``jnp.nonzero`` runs a cumulative sum over every entry (slow on XLA:CPU). Here the
  mask is packed into 32-bit words: the cumulative sum runs over the words' popcounts
  (1/32 of the entries), and an entry's slot is its word's start plus a popcount of
  the bits below it. Every entry then writes ``min(slot, its index)`` -- an inactive
  entry writes the fill value to the slot of the next active entry, which that entry
  overrides -- so the scatter's indices are sorted and no entry is dropped by a
  branch. Slots past ``size`` are dropped: the first ``size`` active entries are kept.
  """
  n = flat_mask.shape[0]
  words = jnp.pad(flat_mask, (0, -n % 32)).reshape(-1, 32)
  bit = jnp.uint32(1) << jnp.arange(32, dtype=jnp.uint32)
  # Disjoint bits: the sum is their bitwise or.
  packed = jnp.sum(jnp.where(words, bit, jnp.uint32(0)), axis=1, dtype=jnp.uint32)
  count = jax.lax.population_count(packed).astype(jnp.int32)
  start = jnp.cumsum(count) - count
  below = jax.lax.population_count(packed[:, None] & (bit - 1)).astype(jnp.int32)
  slot = (start[:, None] + below).reshape(-1)
  index = jnp.where(words.reshape(-1), jnp.arange(words.size, dtype=jnp.int32), n)
  indices = (
    jnp.full((size,), n, jnp.int32)
    .at[slot]
    .min(index, mode="drop", indices_are_sorted=True)
  )
  return indices, jnp.sum(count)


def active_or_stored(
  flat: jax.Array, packed: jax.Array, capacity: int, also: Any = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`active_indices` of ``flat`` -- or, where it has more active items than
  ``capacity`` or ``also`` holds, of the stored set ``packed`` (packed bits) --,
  the number of active items of ``flat``, and the set whose indices these are
  (``on_error="record"``: a mask that does not fit leaves the stored set)."""
  n_active = jnp.sum(flat, dtype=jnp.int32)
  stored = jnp.unpackbits(packed, count=flat.shape[0]).astype(jnp.bool_)
  flat = jnp.where((n_active > capacity) | also, stored, flat)
  return active_indices(flat, capacity)[0], n_active, flat


def slot_indices(ctx: jax.Array, num: int) -> jax.Array:
  """Inverse of the sorted active indices ``ctx`` (fill ``num``): per item its slot
  in ``ctx``, ``len(ctx)`` for items that have none."""
  k = ctx.shape[0]
  return (
    jnp.full((num,), k, jnp.int32)
    .at[ctx]
    .set(jnp.arange(k, dtype=jnp.int32), mode="drop", indices_are_sorted=True)
  )


def moved(ctx: jax.Array, x: jax.Array, old_ctx: jax.Array, num: int) -> jax.Array:
  """Stored entries ``x`` (slots of ``old_ctx``) moved to the slots of ``ctx``;
  items new in ``ctx`` start from zero. Both are sorted, filled with ``num``."""
  return from_slots(x, old_slots(ctx, old_ctx, num))


def old_slots(ctx: jax.Array, old_ctx: jax.Array, num: int) -> jax.Array:
  """Per slot of ``ctx``, its item's slot in ``old_ctx`` (``len(old_ctx)``: none).

  Through the old slot of every item (a scatter of ``len(old_ctx)`` slots into
  ``num`` items, then a gather), which XLA:CPU runs faster than a ``searchsorted``
  of ``ctx`` in ``old_ctx``.
  """
  return slot_indices(old_ctx, num).at[ctx].get(mode="fill", fill_value=len(old_ctx))


def from_slots(x: jax.Array, slots: jax.Array) -> jax.Array:
  """``x[slots]``, zero where a slot is out of range (:func:`old_slots`)."""
  return x.at[slots].get(mode="fill", fill_value=0)
