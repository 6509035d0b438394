"""Compact tile storage: the base's state for the active ``r x c`` tiles only.

``(capacity, r, c)`` per leaf plus 1 bit per tile. Gathers and scatters move whole
tiles, and the update is expanded from the compact tiles by a per-tile slot map
that XLA fuses into ``optax.apply_updates``. Leaves with the same number of tiles
and capacity find their tile sets, slot maps and old slots over one stack.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from magma_optax._core import shard_map as _shard_map
from magma_optax._core import xla_cpu as _xla_cpu
from magma_optax.kernels.tiles import api as tiles
from magma_optax.sparse import indices as _indices
from magma_optax.sparse import storage as _storage


@dataclasses.dataclass(frozen=True)
class Tiles(_storage.Storage):
  """Compact tile storage: ``(capacity, r, c)``, the active ``r x c`` tiles of the
  last two axes.

  The leaf is viewed (a reshape, no copy) as ``(rows, r, cols, c)`` with ``rows`` =
  the leading axes times ``R / r`` and ``cols = C / c``; tile ``t`` is ``(t //
  cols, t % cols)``. Slot ``j`` holds the ``j``-th active tile in that order; the
  stored tile set is kept as packed bits (1 bit per tile). Gathers and scatters move
  whole tiles (``c`` contiguous entries per row of a tile). The update is expanded
  from the compact tiles by a per-tile slot map (a gather over tiles), not scattered
  into a zero array: XLA fuses that gather into ``optax.apply_updates``, so no
  parameter-sized update is written.
  """

  block: tuple[int, int]
  capacity: int
  limit: str  # how the capacity was set, for the overflow message
  hint: str = ""  # appended to the overflow message

  scoped = True
  needs_mask = True
  compact = True
  failure_values = 2

  @functools.cached_property
  def view(self) -> tuple[int, ...]:
    """The leaf seen as ``(rows, r, cols, c)``."""
    return tiles.tile_view(self.shape, self.block)

  @property
  def num_tiles(self) -> int:
    return self.view[0] * self.view[2]

  @property
  def unit(self) -> str:
    """What holds the tiles, for the messages."""
    return f"leaf {self.name}"

  @property
  def stored_shape(self):
    return (self.capacity, *self.block)

  def init_leaf(self, x):
    return jnp.zeros(self.stored_shape, x.dtype)

  def init_bits(self):
    return jnp.zeros(((self.num_tiles + 7) // 8,), jnp.uint8)

  def _overflow(
    self, active: int, unit: str | None = None, at_least: bool = False
  ) -> str:
    least = _storage.at_least(at_least)
    return (
      f"sparse_state compact capacity overflow: {unit or self.unit} ({self.num_tiles}"
      f" tiles of {self.block[0]}x{self.block[1]}) has {least}{active}"
      " active tiles in its parameter mask, more than its compact storage holds:"
      f" capacity {self.limit} = {self.capacity}. Raise `density` to at least"
      f" {active / self.num_tiles:.4g} (the densest mask of the run: under a"
      f" sparsity ramp, the early masks), or use mode='skip'.{self.hint}"
    )

  def failure_message(self, differ: int, active: int, unit: str | None = None) -> str:
    if not differ:
      return self._overflow(active, unit)
    r, c = self.block
    return (
      f"sparse_state: the parameter mask of {unit or self.unit} is not made of whole"
      f" {r}x{c} tiles (block={self.block}): some entries differ from the first"
      f" entry of their tile. Build it with periodic_mask(..., block=({r}, {c})),"
      " give sparse_state the same block, or use mode='skip'."
    )

  def bound_problem(self, bound, unit=None, parts=None):
    """``parts``: the counts this storage's leaf is split into, where it is a part
    (per-shard tile storage); the bound's tiles then count per part if its parts
    are the same, and are not known otherwise."""
    n = self._bound_tiles(bound, parts)
    if n is None:
      if bound.entries is not None and bound.exact and not self._tiled(bound):
        return self._untiled(bound)
      return None
    at_least = not bound.exact
    return self._overflow(n, unit, at_least) if n > self.capacity else None

  def bound_suffices(self, bound, parts=None):
    # Every mask must be whole tiles: an all-active bound counts its tiles
    # whatever masks come later, so the bound's own tiles must be made of these.
    n = self._bound_tiles(bound, parts)
    return bound.exact and self._tiled(bound) and n is not None and n <= self.capacity

  def _tiled(self, bound):
    """Whether ``bound``'s masks are made of tiles that are whole numbers of these."""
    r, c = self.block
    return bound.block is not None and not (bound.block[0] % r or bound.block[1] % c)

  def _bound_tiles(self, bound, parts=None):
    """The active ``r x c`` tiles (per part, with ``parts``) of the masks that
    ``bound`` describes, which are then made of whole such tiles; ``None`` where
    they may not be, or their count is not known."""
    if bound.all_active:
      return self.num_tiles
    if bound.entries is None or bound.tiles is None or not self._tiled(bound):
      return None
    if parts is not None and bound.parts != parts:
      return None
    # Tiles of r x c per tile of the bound, times the bound's parts per this one.
    r, c = self.block
    per = (bound.block[0] // r) * (bound.block[1] // c)
    if parts is None:
      per *= math.prod(bound.parts or (1,))
    return bound.tiles * per

  def _untiled(self, bound):
    """Why masks of ``bound``'s exact count certainly are not whole tiles, or
    ``None``: whole ``r x c`` tiles hold a multiple of ``r * c`` entries, per leaf,
    and per part of ``bound.parts`` where such tiles lie within its parts."""
    r, c = self.block
    count, where = bound.entries, ""
    if bound.parts is not None:
      k = len(bound.parts)
      part = [n // p for n, p in zip(bound.shape[-k:], bound.parts, strict=True)]
      if part[-2] % r == 0 and part[-1] % c == 0:
        count //= math.prod(bound.parts)
        sizes = "x".join(map(str, bound.parts))
        where = f" in each of its {sizes} shard parts"
    if count % (r * c) == 0:
      return None
    made_of = "entries" if bound.block is None else "{}x{} tiles".format(*bound.block)
    return (
      f"sparse_state: the parameter masks of leaf {self.name} will be made of"
      f" {made_of} ({count} active entries{where}, not a multiple of"
      f" {r * c}), not of the whole {r}x{c} tiles (block={self.block}) that its"
      f" compact tile storage keeps. Give periodic_mask block=({r}, {c}) (or"
      " tiles that are whole numbers of them) and the same shards, or use"
      " mode='skip'."
    )

  def prepare(self, mask, bits, grad, whole=False, record=False):
    return self.prepare_group([self], [mask], [bits], [grad], [whole], record)[0]

  def batch_key(self):
    return (Tiles, self.num_tiles, self.capacity)

  @staticmethod
  def prepare_group(storages, masks, bits, grads, whole, record):
    """``prepare`` of leaves of one ``batch_key``: their tile sets found over one
    stack of their tiles (per leaf some 20 small computations, each a launch of
    its own on XLA:CPU)."""
    flat, differ = [], []
    for s, m, g, w in zip(storages, masks, grads, whole, strict=True):
      _storage.reject_explicit(g, m, "compact tile storage", "tiles")
      f, d = s.tiles_of(m, w)
      flat.append(f)
      differ.append(d)
    flat, differ, old_bits = jnp.stack(flat), jnp.stack(differ), jnp.stack(bits)
    # Recording, a mask that fails the checks is replaced by the stored tiles.
    fallback = differ if record else None
    idx, new_bits, changed, n_active = jax.vmap(storages[0].tile_set)(
      flat, old_bits, fallback
    )
    bad = differ | (n_active > storages[0].capacity)
    kind = jnp.where(differ, _storage.UNTILED, _storage.OVERFLOW)
    stacked = _storage.Stacked(idx, old_bits, changed)
    return [
      (
        idx[k],
        new_bits[k],
        changed[k],
        _storage.Check(bad[k], s.failure_message, (differ[k], n_active[k]), kind[k]),
        (stacked, k),
      )
      for k, s in enumerate(storages)
    ]

  def tiles_of(self, mask, whole=False):
    """Per tile whether it is active (its first entry), flat; and whether the mask
    is not made of whole tiles (``whole``: promised to be, not read: only the
    tiles' first entries are)."""
    m4 = mask.reshape(self.view).astype(jnp.uint8)
    if whole:
      return m4[:, 0, :, 0].reshape(-1) > 0, jnp.zeros([], jnp.bool_)
    # One pass over the mask: every entry must equal its tile's first entry. A max
    # of uint8 xors: XLA:CPU materialises the boolean comparison of any() before
    # reducing it.
    differ = jnp.max(m4 ^ m4[:, :1, :, :1], initial=0) > 0
    return m4[:, 0, :, 0].reshape(-1) > 0, differ

  def tile_set(self, flat, bits, fallback=None):
    """The sorted indices of the active tiles ``flat``, the new bits, whether the
    stored set changed, and the active count. Where ``fallback`` holds, the stored
    tiles instead, as where ``flat`` has more than the capacity (and the count of
    ``flat``)."""
    if fallback is None:
      idx, n_active = _indices.active_indices(flat, self.capacity)
    else:
      idx, n_active, flat = _indices.active_or_stored(
        flat, bits, self.capacity, fallback
      )
    new_bits = jnp.packbits(flat)
    return idx, new_bits, jnp.any(new_bits != bits), n_active

  def remap_key(self, ctx, bits, entries, fresh):
    if not entries or self.rebuilds:
      return None
    arrays = [ctx, bits, *entries, *fresh]
    return (
      type(self),
      self.num_tiles,
      self.capacity,
      tuple((jnp.shape(x), jnp.result_type(x)) for x in arrays),
      frozenset().union(*map(_shard_map.varying, arrays)),
    )

  def old_slots(self, ctx, bits):
    """Per slot of ``ctx``, its tile's slot in the stored set ``bits`` were
    (``capacity``: a tile new to the set)."""
    old_tiles = jnp.unpackbits(bits, count=self.num_tiles).astype(jnp.bool_)
    old_idx, _ = _indices.active_indices(old_tiles, self.capacity)
    return _indices.old_slots(ctx, old_idx, self.num_tiles)

  def remap(self, ctx, x, bits):
    return _indices.from_slots(x, self.old_slots(ctx, bits))

  @staticmethod
  def remap_group(storages, ctx, bits, entries, fresh):
    """``remap_fresh`` of every base-state entry (``entries``, their ``fresh``
    values) of leaves of one ``remap_key``: their old slots found over
    one stack of their ``ctx`` and ``bits`` (given stacked; some 20 computations
    per leaf on a few hundred tiles, see ``prepare_group``), each leaf's entries
    moved apart (a stack of them would be a temporary the size of their
    moments)."""
    slots = jax.vmap(storages[0].old_slots)(ctx, bits)
    out = []
    for k, (s, xs, fs) in enumerate(zip(storages, entries, fresh, strict=True)):
      kept = (slots[k] < s.capacity)[:, None, None]
      out.append([
        jnp.where(kept, _indices.from_slots(x, slots[k]), f.astype(x.dtype))
        for x, f in zip(xs, fs, strict=True)
      ])  # fmt: skip
    return out

  def gather(self, ctx, x):
    return tiles.gather_tiles(x.reshape(self.view), ctx)

  def stored_mask(self, ctx, mask):
    del mask
    return jnp.broadcast_to((ctx < self.num_tiles)[:, None, None], self.stored_shape)

  def scatter(self, ctx, mask, u, slot=None, any_stored=None):
    """``slot``: ``_indices.slot_indices(ctx, num_tiles)``, where already known;
    ``any_stored``: whether this leaf or others stored anything (the branch that
    computes ``u`` then runs; with nothing stored, the expansion is zero anyway)."""
    del mask
    if any_stored is None:
      any_stored = ctx[0] < self.num_tiles
    return self.expand(ctx, _xla_cpu.computed_once(u, any_stored), slot)

  @staticmethod
  def scatter_group(storages, ctx, masks, us):
    """``scatter`` of leaves of one ``batch_key``, their slot maps found over
    one stack (see ``prepare_group``)."""
    num = storages[0].num_tiles
    stacked = jnp.stack(ctx)
    slots = jax.vmap(lambda c: _indices.slot_indices(c, num))(stacked)
    # One predicate for the group's branches: each leaf's own would be a slice
    # of every step (a launch per leaf on XLA:CPU).
    any_stored = jnp.any(stacked[:, 0] < num)
    return [
      s.scatter(c, m, u, slots[k], any_stored)
      for k, (s, c, m, u) in enumerate(zip(storages, ctx, masks, us, strict=True))
    ]

  def expand(self, ctx, u, slot=None):
    """The stored-shaped ``u`` leaf-shaped, zero in the tiles not stored."""
    rows, r, cols, c = self.view
    if slot is None:
      slot = _indices.slot_indices(ctx, self.num_tiles)
    slot = slot.reshape(rows, cols)
    # Slot `capacity` (an inactive tile) is out of range: the gather fills zeros.
    full = jnp.take(u, slot, axis=0, mode="fill", fill_value=0)  # (rows, cols, r, c)
    return jnp.swapaxes(full, 1, 2).reshape(self.shape)

  def fused_adam(self, ctx, mask, g, m, v, args):
    del mask
    arrays = constant_arrays(args.constants)
    return tile_step(g, m, v, ctx, args.count, args.learning_rate, args, arrays)


def constant_arrays(constants: Any) -> dict[str, Any]:
  """Adam's constants given as arrays (injected), for a step that takes them as
  arguments (a per-part step needs its arrays passed in); Python floats stay
  closed over (``1 - b`` in double, as ``optax.adam``)."""
  return {
    k: x for k, x in constants._asdict().items() if not isinstance(x, int | float)
  }


def tile_step(g, m, v, ctx, count, learning_rate, args: _storage.AdamArgs, arrays):
  """:func:`magma_optax.kernels.tile_adam` on a leaf (or part) of tile storage;
  ``arrays``: :func:`constant_arrays` of ``args.constants``."""
  c = args.constants._replace(**arrays)
  return tiles.tile_adam(
    g, m, v, ctx, count=count, learning_rate=learning_rate, b1=c.b1, b2=c.b2,
    eps=c.eps, eps_root=c.eps_root, implementation=args.implementation,
    interpret=args.interpret,
  )  # fmt: skip
