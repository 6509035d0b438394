"""Compact tile storage per shard: each part of a sharded leaf stores its own tiles.

The leaf's last ``k >= 2`` axes are split into ``s_1 x ... x s_k`` equal parts (a
device's shard), each a :class:`magma_optax.sparse.tiles.Tiles` of its own, stored as
``(s_1, ..., s_k, capacity, r, c)``: indices are local to a part and every method
is the part's, ``vmap``-ed over the parts, so no tile crosses devices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from magma_optax._core import geometry as _geometry
from magma_optax._core import sharded as _sharded
from magma_optax._core import xla_cpu as _xla_cpu
from magma_optax.sparse import storage as _storage
from magma_optax.sparse import tiles as _tiles
from magma_optax.sparse.tiles import Tiles


@dataclasses.dataclass(frozen=True)
class ShardedTiles(_storage.Storage):
  """Compact tile storage per shard: ``(s_1, ..., s_k, capacity, r, c)``; part
  ``(a_1, ..., a_k)`` is :func:`magma_optax._core.geometry.split_parts`'s."""

  block: tuple[int, int]
  parts: tuple[int, ...]
  capacity: int
  limit: str  # how the capacity was set, for the overflow message

  scoped = True
  needs_mask = True
  compact = True
  places_state = True

  @property
  def failure_values(self) -> int:
    return 2 + len(self.parts)

  @functools.cached_property
  def part(self) -> Tiles:
    """The tile storage of one part."""
    k = len(self.parts)
    split = self.shape[len(self.shape) - k :]
    part_shape = (
      *self.shape[: len(self.shape) - k],
      *(n // p for n, p in zip(split, self.parts, strict=True)),
    )
    hint = (
      f" A mask with the same number of tiles in every part comes from"
      f" periodic_mask(..., block={self.block}, shards={tuple(self.parts)})."
    )
    return Tiles(part_shape, self.name, self.block, self.capacity, self.limit, hint)

  @property
  def stored_shape(self):
    return (*self.parts, *self.part.stored_shape)

  def init_leaf(self, x):
    return self.place(jnp.zeros(self.stored_shape, x.dtype), x)

  def init_bits(self):
    return jnp.zeros((*self.parts, *self.part.init_bits().shape), jnp.uint8)

  def place(self, stored, x):
    """``stored`` with its parts sharded like ``x``'s split axes, where ``x`` is
    sharded over ``Explicit`` mesh axes (elsewhere unchanged): the state then has
    the types the step gives it."""
    spec = _sharded.explicit_spec(x)
    if spec is None:
      return stored
    self._check_explicit(x)
    return _sharded.put_like(stored, x, spec[len(spec) - len(self.parts) :])

  def declared_axes(self):
    # The stored arrays' leading axes index the parts: the parameter's shards.
    ndim = len(self.shape)
    axes = tuple(range(ndim - len(self.parts), ndim))
    return (
      (self.name, self.stored_shape, (*axes, None, None, None)),
      (self.name, tuple(self.init_bits().shape), (*axes, None)),
    )

  def _check_explicit(self, x):
    """Under ``Explicit`` mesh axes every part must lie on one device."""
    _geometry.check_parts_on_devices(x, self.parts, "sparse_state", self.name)

  def per_part(self, fn, *args, in_axes=0, order=None):
    """``vmap(...(vmap(fn)))(*args)`` over the parts (the leading ``k`` axes);
    under ``Explicit`` mesh axes with them as ``Auto`` inside
    (:func:`magma_optax._core.sharded.like_auto`), the outputs sharded like the parts
    of ``args[0]``. ``order``: ``fn`` takes ``args`` in that order."""
    if order is not None:
      inner = fn
      fn = lambda *a: inner(*(a[i] for i in order))  # noqa: E731
    batched = fn
    for _ in self.parts:
      batched = jax.vmap(batched, in_axes)
    return _sharded.like_auto(batched, args[0], *args, axes=len(self.parts))

  def prepare(self, mask, bits, grad, whole=False, record=False):
    self._check_explicit(grad)
    self._check_explicit(mask)
    flat, differ = self.per_part(
      functools.partial(self.part.tiles_of, whole=whole),
      _geometry.split_parts(mask, self.parts),
    )
    if record:  # the parts' counts first: a failing leaf keeps every part's tiles
      n_active = self.per_part(lambda f: jnp.sum(f, dtype=jnp.int32), flat)
    else:
      idx, new_bits, changed, n_active = self.per_part(self.part.tile_set, flat, bits)

    def worst(differ, n_active):
      # The part the error names: the first one not made of whole tiles, else the
      # fullest one (a flat index: with the mesh axes as Auto, which Explicit
      # ones do not allow for every split).
      at = jnp.where(jnp.any(differ), jnp.argmax(differ), jnp.argmax(n_active))
      return jnp.any(differ), jnp.max(n_active), *jnp.unravel_index(at, self.parts)

    differ, n_active, *where = _sharded.like_auto(
      worst, differ, differ, n_active, axes=0
    )
    check = _storage.Check(
      differ | (n_active > self.capacity),
      self.failure_message,
      (differ, n_active, *where),
      jnp.where(differ, _storage.UNTILED, _storage.OVERFLOW),
    )
    if record:
      idx, new_bits, changed, _ = self.per_part(
        self.part.tile_set, flat, bits, check.bad, in_axes=(0, 0, None)
      )
    return idx, new_bits, jnp.any(changed), check

  def failure_message(self, differ: int, active: int, *where: int) -> str:
    sizes = "x".join(map(str, self.parts))
    unit = f"part {tuple(where)} of the {sizes} shard parts of leaf {self.name}"
    return self.part.failure_message(differ, active, unit)

  def bound_problem(self, bound):
    sizes = "x".join(map(str, self.parts))
    unit = f"each of the {sizes} shard parts of leaf {self.name}"
    return self.part.bound_problem(bound, unit, self.parts)

  def bound_suffices(self, bound):
    return self.part.bound_suffices(bound, self.parts)

  def remap(self, ctx, x, bits):
    # Sharded like the state it rewrites (the loop's carry keeps its type).
    return self.per_part(self.part.remap, x, ctx, bits, order=(1, 0, 2))

  def gather(self, ctx, x):
    return self.per_part(self.part.gather, ctx, _geometry.split_parts(x, self.parts))

  def stored_mask(self, ctx, mask):
    del mask
    return self.per_part(lambda c: self.part.stored_mask(c, None), ctx)

  def scatter(self, ctx, mask, u):
    del mask
    # Once for all parts (under the parts' vmap a branch would be a select).
    u = _xla_cpu.computed_once(u, jnp.any(ctx[..., 0] < self.part.num_tiles))
    part = lambda c, v: self.part.expand(c, v)  # noqa: E731
    scattered = self.per_part(part, ctx, u)
    return _geometry.join_parts(scattered, len(self.parts))

  def fused_adam(self, ctx, mask, g, m, v, args):
    del mask
    # One step per part, batched over them; count, learning rate and injected
    # (array) constants come in as arguments (under Explicit axes the parts run
    # with the axes as Auto).
    g = _geometry.split_parts(g, self.parts)

    def step(g, m, v, c, n, lr, arrays):
      return _tiles.tile_step(g, m, v, c, n, lr, args, arrays)

    axes = (0, 0, 0, 0, None, None, None)
    arrays = _tiles.constant_arrays(args.constants)
    return self.per_part(
      step, g, m, v, ctx, args.count, args.learning_rate, arrays, in_axes=axes
    )
