"""N:M compact storage: ``n`` slots for every group of ``m`` consecutive entries.

The stored leaf has the parameter's shape with the group axis shrunk by ``n / m``,
plus ``m`` bits per group. Every operation is element-wise or a reduction within a
group, so a leaf sharded along any axis (the group axis too, in whole groups) stays
local: no gather, no scatter, no flat index.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from magma_optax._core import sharded as _sharded
from magma_optax._core import xla_cpu as _xla_cpu
from magma_optax.sparse import storage as _storage


class Groups(NamedTuple):
  """Compact storage of an N:M mask, group by group (``m`` consecutive entries along
  ``axis``): the leaf's shape with ``axis`` shrunk by ``n / m``.

  Slot ``s`` of a group holds its ``s``-th active entry (in index order). Every
  operation is element-wise or a reduction over the ``m`` (or ``n``) entries of one
  group, so a leaf sharded along any axis -- ``axis`` too, in whole groups -- stays
  local: no gather, no scatter, no flat index.
  """

  shape: tuple[int, ...]
  axis: int  # non-negative
  n: int
  m: int

  def _resized(self, size: int) -> tuple[int, ...]:
    return self.shape[: self.axis] + (size,) + self.shape[self.axis + 1 :]

  @property
  def stored_shape(self) -> tuple[int, ...]:
    return self._resized(self.shape[self.axis] // self.m * self.n)

  @property
  def bits_shape(self) -> tuple[int, ...]:
    return self._resized(self.shape[self.axis] // self.m)

  @property
  def bits_dtype(self) -> Any:
    return jnp.uint8 if self.m <= 8 else jnp.uint16 if self.m <= 16 else jnp.uint32

  def _split(self, x: jax.Array, width: int) -> jax.Array:
    x = jnp.moveaxis(x, self.axis, -1)
    return x.reshape(*x.shape[:-1], x.shape[-1] // width, width)

  def _join(self, y: jax.Array) -> jax.Array:
    y = y.reshape(*y.shape[:-2], y.shape[-2] * y.shape[-1])
    return jnp.moveaxis(y, -1, self.axis)

  def slots(self, mask: jax.Array) -> jax.Array:
    """int8 ``(..., groups, m)``: each entry's slot in its group; ``n`` for none
    (inactive, or beyond the ``n``-th active entry)."""
    active = self._split(mask, self.m).astype(jnp.int8)
    # Unrolled over the m entries (as below): XLA:CPU runs reductions and scans
    # over a tiny trailing axis slower than these element-wise selections.
    rank = [jnp.zeros_like(active[..., 0])]  # zeros_like keeps the sharding
    for i in range(self.m - 1):
      rank.append(rank[-1] + active[..., i])
    rank = jnp.stack(rank, axis=-1)
    return jnp.where((active > 0) & (rank < self.n), rank, jnp.int8(self.n))

  def per_group(self, mask: jax.Array) -> jax.Array:
    return jnp.sum(self._split(mask, self.m), axis=-1, dtype=jnp.int32)

  def compact(self, x: jax.Array, slots: jax.Array) -> jax.Array:
    """Leaf-shaped -> stored-shaped (empty slots 0)."""
    v = self._split(x, self.m)
    out = []
    for s in range(self.n):
      acc = jnp.zeros_like(v[..., 0])
      for i in range(self.m):
        acc = jnp.where(slots[..., i] == s, v[..., i], acc)
      out.append(acc)
    return self._join(jnp.stack(out, axis=-1))

  def expand(self, c: jax.Array, slots: jax.Array) -> jax.Array:
    """Stored-shaped -> leaf-shaped (0 where no slot)."""
    v = self._split(c, self.n)
    out = []
    for i in range(self.m):
      acc = jnp.zeros_like(v[..., 0])
      for s in range(self.n):
        acc = jnp.where(slots[..., i] == s, v[..., s], acc)
      out.append(acc)
    return self._join(jnp.stack(out, axis=-1))

  def filled(self, slots: jax.Array) -> jax.Array:
    """Stored-shaped bool: the slot holds an entry."""
    used = []
    for s in range(self.n):
      acc = slots[..., 0] == s
      for i in range(1, self.m):
        acc = acc | (slots[..., i] == s)
      used.append(acc)
    return self._join(jnp.stack(used, axis=-1))

  def pack(self, mask: jax.Array) -> jax.Array:
    """One integer of ``m`` bits per group (``bits_shape``)."""
    dtype = self.bits_dtype
    bit = jnp.left_shift(jnp.ones([], dtype), jnp.arange(self.m, dtype=dtype))
    picked = jnp.where(self._split(mask, self.m), bit, jnp.zeros([], dtype))
    return jnp.moveaxis(jnp.sum(picked, axis=-1, dtype=dtype), -1, self.axis)

  def unpack(self, bits: jax.Array) -> jax.Array:
    b = jnp.moveaxis(bits, self.axis, -1)[..., None]
    shift = jnp.arange(self.m).astype(self.bits_dtype)
    return self._join(((b >> shift) & 1).astype(jnp.bool_))


@dataclasses.dataclass(frozen=True)
class Grouped(_storage.Storage):
  """N:M compact storage (:class:`Groups`): ``n`` slots per group of ``m``."""

  groups: Groups

  scoped = True
  needs_mask = True
  compact = True
  places_state = True
  failure_values = 1

  @property
  def stored_shape(self):
    return self.groups.stored_shape

  def init_leaf(self, x):
    return self.place(jnp.zeros(self.stored_shape, x.dtype), x)

  def init_bits(self):
    return jnp.zeros(self.groups.bits_shape, self.groups.bits_dtype)

  def place(self, stored, x):
    """``stored`` with the partition spec of ``x`` where ``x`` is sharded over
    ``Explicit`` mesh axes (the stored arrays and bits keep every axis of the
    parameter; the groups' axis shrinks by whole groups per device)."""
    self._check_explicit(x)
    return _sharded.put_like(stored, x)

  def _check_explicit(self, x):
    """Under ``Explicit`` mesh axes every device must hold whole groups."""
    spec = _sharded.explicit_spec(x)
    if spec is None:
      return
    g = self.groups
    pieces = _sharded.mesh_axis_size(jax.typeof(x).sharding.mesh, spec[g.axis])
    if g.shape[g.axis] % (pieces * g.m):
      raise ValueError(
        f"sparse_state: N:M compact storage (structure=({g.n}, {g.m}), groups of"
        f" {g.m} along axis {g.axis}) of leaf {self.name}, shape {g.shape},"
        f" sharded over Explicit mesh axes as {jax.sharding.PartitionSpec(*spec)}:"
        f" axis {g.axis} is split into {pieces} pieces of"
        f" {g.shape[g.axis] / pieces:g} entries, not whole groups of {g.m}. Shard"
        " that axis into fewer pieces, group along another axis (axis=), or use"
        " mode='skip'."
      )

  def failure_message(self, active: int, at_least: bool = False) -> str:
    g, least = self.groups, _storage.at_least(at_least)
    return (
      f"sparse_state compact capacity overflow: a group of {g.m} entries has"
      f" {least}{active} active but structure=({g.n}, {g.m}) stores"
      f" {g.n} (leaf {self.name}, groups along axis {g.axis}); the mask is not N:M"
      " along `axis` (give periodic_mask the same structure and axis, or use"
      " mode='skip')."
    )

  def bound_problem(self, bound):
    g = self.groups
    if bound.all_active and g.n < g.m:
      return self.failure_message(g.m)
    nm = bound.structure
    if nm is not None and bound.axis == g.axis and g.m % nm[1] == 0:
      per_group = nm[0] * (g.m // nm[1])  # exactly, in every group of m
      if per_group > g.n:
        return self.failure_message(per_group)
    groups = self.size // g.m
    if bound.entries is not None and bound.entries > groups * g.n:
      # More than all the slots: the fullest group has at least the mean.
      return self.failure_message(-(-bound.entries // groups), at_least=True)
    return None

  def bound_suffices(self, bound):
    g, nm = self.groups, bound.structure
    if bound.all_active:
      return g.n == g.m
    if nm is None or bound.axis != g.axis or g.m % nm[1]:
      return False
    return nm[0] * (g.m // nm[1]) <= g.n  # exactly, in every group of m

  def prepare(self, mask, bits, grad, whole=False, record=False):
    del whole
    self._check_explicit(grad)
    self._check_explicit(mask)
    g = self.groups
    check = _storage.check_capacity(
      jnp.max(g.per_group(mask)), g.n, self.failure_message
    )
    if record:  # a mask that does not fit: the stored entries instead
      mask = _storage.held(
        record, lambda m: jnp.where(check.bad, g.unpack(bits), m), lambda m: m, mask
      )
    slots = g.slots(mask)
    new_bits = g.pack(mask)
    return slots, new_bits, jnp.any(new_bits != bits), check

  def remap(self, ctx, x, bits):
    g = self.groups
    return g.compact(g.expand(x, g.slots(g.unpack(bits))), ctx)

  def gather(self, ctx, x):
    return self.groups.compact(x, ctx)

  def stored_mask(self, ctx, mask):
    del mask
    return self.groups.filled(ctx)

  def scatter(self, ctx, mask, u):
    del mask
    # Each entry's select reads n stored entries: fused, the update would be
    # evaluated m times per stored entry.
    u = _xla_cpu.computed_once(u, jnp.any(ctx < self.groups.n))
    return self.groups.expand(u, ctx)
