"""How one leaf's base-optimizer state is kept: the interface every storage implements.

:func:`magma_optax.sparse_state` picks one :class:`Storage` per leaf; the step
(:mod:`magma_optax.sparse.step`) runs the same calls for every leaf, and what differs
between storages is a method or a flag of theirs. The storages of a state are part
of its tree structure (:class:`StorageLayout`, static), so that a restored state
still says how it is stored.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import ClassVar
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from magma_optax._core import blocks as _blocks
from magma_optax._core import mask_bounds as _mask_bounds
from magma_optax._core import sharded as _sharded
from magma_optax.kernels import reference
from magma_optax.kernels.tiles import api as tiles

# Kinds of a failed check of a parameter mask (recorded per leaf, see errors.py).
OVERFLOW = 1  # more active entries, groups or tiles than the capacity
UNTILED = 2  # a mask not made of whole tiles


class Check(NamedTuple):
  """A step's error condition: ``ValueError(describe(*values))`` if ``bad``;
  ``kind``: :data:`OVERFLOW` or :data:`UNTILED` (an int, or a traced int32)."""

  bad: jax.Array
  describe: Any  # (*int) -> str
  values: tuple[jax.Array, ...]
  kind: Any = OVERFLOW


def check_capacity(active: jax.Array, limit: int, describe) -> Check:
  """The check that ``active <= limit``."""
  return Check(active > limit, describe, (active,))


def at_least(lower_bound: bool) -> str:
  """For a count that init knows only as a lower bound."""
  return "at least " if lower_bound else ""


def capacity(size: int, density: float | None, structure) -> int:
  """The slots of compact storage: ``ceil(density * size)``, or ``size * n / m``."""
  if structure is not None:
    return size * structure[0] // structure[1]
  return min(size, max(1, math.ceil(density * size)))


def explicit_axes(x: Any) -> set[str]:
  """Mesh axes of type ``Explicit`` that shard ``x`` (empty outside such meshes)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  types = getattr(mesh, "axis_types", ())
  explicit = {
    name
    for name, kind in zip(mesh.axis_names if types else (), types, strict=True)
    if kind == jax.sharding.AxisType.Explicit
  }
  used = set()
  for entry in getattr(sharding, "spec", ()):
    used.update(entry if isinstance(entry, tuple) else (entry,))
  return explicit & used


def reject_explicit(grad: Any, mask: Any, what: str, items: str) -> None:
  """Flat (index-addressed) storages cannot follow an ``Explicit`` sharding."""
  axes = explicit_axes(grad) | explicit_axes(mask)
  if axes:
    fix = (
      " For tile storage, keep one per shard instead: give periodic_mask and"
      " sparse_state / sparse_adam the same"
      " shards=magma.sharding.tile_shards(params)."
      if items == "tiles"
      else ""
    )
    raise ValueError(
      f"sparse_state: {what} does not support leaves sharded over Explicit mesh"
      f" axes ({sorted(axes)}): it keeps one vector of the active {items} per"
      f" leaf, addressed by global indices.{fix} Or use mode='skip', or N:M"
      " compact storage (structure=(n, m)), which keeps the parameter's sharding."
      " (jax.make_mesh gives Explicit axes unless axis_types= says otherwise.)"
    )


def first(x: jax.Array) -> jax.Array:
  """The value of a uniform array as a scalar (0 for an empty one); over Explicit
  mesh axes, where a slice of a sharded axis is not allowed, its maximum."""
  if not x.size:
    return jnp.zeros((), x.dtype)
  if _sharded.explicit_spec(x) is not None:
    return jnp.max(x)
  return x.reshape(-1)[0]


class Stacked(NamedTuple):
  """What ``prepare_group`` (tile storage) found for a stack of leaves, stacked: their
  slots' tiles ``ctx``, their old ``bits`` and whether their sets ``changed``.
  A loop that refreshes some of them takes the stacks and picks its leaves inside
  (each leaf's slice taken outside would be a computation of every step)."""

  ctx: jax.Array
  bits: jax.Array
  changed: jax.Array


class AdamArgs(NamedTuple):
  """What :func:`magma_optax.sparse_adam`'s step hands every storage."""

  count: jax.Array
  learning_rate: Any
  hyper: Any  # reference.hyperparams(count, lr, 0, constants)
  constants: reference.AdamConstants  # Python floats or (injected) arrays
  implementation: Any
  interpret: Any


@dataclasses.dataclass(frozen=True)
class Storage:
  """How one leaf's base state is kept: the interface, and the unscoped case.

  ``init`` asks a storage for the stored leaf and its bookkeeping bits; the step
  calls, per leaf and in this order:

  1. ``prepare(mask, bits, grad, whole, record)``: the step's view of the mask
     (``ctx``: compact indices or N:M slots), the new bits, whether the stored
     set changed (``None``: never, for dense storage), and the leaf's
     :class:`Check` (``None``: none). ``whole``: the mask is promised to be made
     of whole tiles; ``record``: a failing mask leaves the stored set;
  2. only when the stored set changed, in a loop of zero or one step:
     ``rebuild(mask)`` for storages that cache their ``ctx`` (``rebuilds``), then
     ``remap_fresh(ctx, x, bits, fresh, kept)`` on each base-state entry;
  3. ``load(x, active)``: brings a host-resident entry to the device (offload);
  4. ``gather(ctx, x)``: leaf-shaped gradient or parameter -> stored shape;
  5. the base's update on the stored tree, with ``stored_mask(ctx, mask)``;
  6. ``freeze(ctx, mask, new, old)``: keeps frozen entries of the new base state;
  7. ``unload(new, orig, active)``: puts a host-resident entry back (offload);
  8. ``scatter(ctx, mask, u)``: stored-shaped update -> leaf-shaped, zero where
     inactive.

  Leaves whose storages have one ``batch_key`` run steps 1 and 8 together (the
  class's ``prepare_group`` and ``scatter_group``), leaves of one ``remap_key``
  step 2 (``remap_group``). This class is dense storage for a leaf outside
  ``where``: it takes no mask and every method passes its input through.
  """

  shape: tuple[int, ...]
  name: str  # the leaf's key path, for error messages

  scoped: ClassVar[bool] = False  # the leaf takes a mask
  needs_mask: ClassVar[bool] = False  # the step cannot run without one
  rebuilds: ClassVar[bool] = False  # ctx cached in the bits, rebuilt on change
  tracks_cold: ClassVar[bool] = False  # counts all-inactive steps (offload)
  compact: ClassVar[bool] = False  # stores fewer entries (init's for zeros)
  freezable: ClassVar[bool] = False  # the base's state frozen where computed
  places_state: ClassVar[bool] = False  # stored arrays keep the param's sharding
  failure_values: ClassVar[int] = 0  # the counts of its check's message

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def stored_shape(self) -> tuple[int, ...]:
    return self.shape

  def init_leaf(self, x: jax.Array) -> jax.Array:
    return x

  def init_bits(self) -> Any:
    return optax.MaskedNode()

  def place(self, stored: jax.Array, x: jax.Array) -> jax.Array:
    """``stored`` (a stored-shaped state entry or the bits) sharded as the step
    gives it, where the parameter ``x`` is sharded over ``Explicit`` mesh axes
    (``places_state``: eager ``jnp.zeros`` are replicated)."""
    del x
    return stored

  def declared_axes(self) -> tuple[tuple[str, tuple[int, ...], tuple], ...]:
    """The state's declaration of its stored arrays that index parameter axes
    other than the parameter's own (:class:`magma_optax.BlockLayout`'s sense)."""
    return ()

  def failure_message(self, *values: int) -> str:
    """The message of a failed check with these counts (:class:`Check`)."""
    raise NotImplementedError

  def no_mask_problem(self, i: int) -> str:
    return (
      f"leaf {i} ({self.name}) uses compact storage but param_mask has no mask"
      " for it; pass param_mask= (periodic_mask does) or scope the leaf out with"
      " `where`. Inside periodic_mask, a wrapper in between may have dropped the"
      " extra argument: a plain optax.GradientTransformation takes none (e.g."
      " optax.MultiSteps(...).gradient_transformation(); put MultiSteps outside"
      " periodic_mask instead)."
    )

  def prepare(self, mask, bits, grad, whole=False, record=False):
    del mask, grad, record, whole
    return None, bits, None, None

  def batch_key(self) -> Any:
    """Leaves whose storages return the same key (``None``: none) are prepared
    together, by ``prepare_group`` of the first one's class."""
    return None

  def bound_problem(self, bound: _mask_bounds.MaskBound) -> str | None:
    """At ``init``: why the masks that ``bound`` describes certainly fail this
    storage's checks, or ``None`` (also where that depends on the values)."""
    del bound
    return None

  def bound_suffices(self, bound: _mask_bounds.MaskBound) -> bool:
    """Whether every mask within ``bound`` passes this storage's checks in the
    step (a promised leaf then needs no check reported through the host)."""
    del bound
    return False

  def remap(self, ctx, x, bits):
    del ctx, bits
    return x

  def remap_key(self, ctx, bits, entries, fresh):
    """A key under which leaves are remapped together (by the class's
    ``remap_group``); ``None``: the leaf is remapped alone. Inside
    ``jax.shard_map`` the key holds the axes they vary along."""
    del ctx, bits, entries, fresh
    return None

  def remap_fresh(self, ctx, x, bits, fresh, kept):
    """``remap``, with the slots that ``kept`` marks as new set to ``fresh`` (the
    base's initial value of the entry, a scalar) instead of zero."""
    return jnp.where(kept, self.remap(ctx, x, bits), fresh.astype(x.dtype))

  def load(self, x, active):
    del active
    return x

  def gather(self, ctx, x):
    del ctx
    return x

  def stored_mask(self, ctx, mask):
    del ctx
    return optax.MaskedNode() if mask is None else mask

  def freeze(self, ctx, mask, new, old):
    del ctx, mask, old
    return new

  def unload(self, new, orig, active):
    del orig, active
    return new

  def scatter(self, ctx, mask, u):
    del ctx, mask
    return u

  def fused_adam(self, ctx, mask, g, m, v, args: AdamArgs) -> tiles.TileAdamOutput:
    """:func:`magma_optax.sparse_adam`'s step for this leaf: Adam's element-wise
    step on the stored entries, in XLA (moments, then the update)."""
    g = self.gather(ctx, g)
    m32, v32 = reference.moments(g, m, v, args.hyper, None)
    return adam_update(m32, v32, g, m, v, args)


def adam_update(m32, v32, g, m, v, args: AdamArgs) -> tiles.TileAdamOutput:
  """The stored moments and Adam's update computed from them (float32)."""
  u = reference.update(
    m32.astype(jnp.float32), v32.astype(jnp.float32), args.hyper, layout=None,
    dtype=g.dtype,
  )  # fmt: skip
  return tiles.TileAdamOutput(m32.astype(m.dtype), v32.astype(v.dtype), u)


def is_sparse_state(x: Any) -> bool:
  """Whether ``x`` is a :class:`magma_optax.SparseState` (it holds a layout)."""
  return isinstance(getattr(x, "storage", None), StorageLayout)


@dataclasses.dataclass(frozen=True)
class StorageLayout(_blocks.DeclaredAxes, _mask_bounds.Receiver):
  """The storage of every leaf of a sparse state: static (no arrays), part of the
  state's tree structure, so that a state restored from a checkpoint (into the
  structure of ``tx.init``) still describes a recorded failure in full.

  It declares the stored arrays that index parameter axes of their own (for
  :func:`magma_optax.sharding.state_shardings`), and receives the bounds that
  :func:`magma_optax.periodic_mask`'s init announces (:mod:`magma_optax._core.
  mask_bounds`).
  """

  treedef: Any = None  # the parameters' tree structure
  storages: tuple[Storage, ...] = ()

  @classmethod
  def of(cls, treedef: Any, storages: list[Storage]) -> StorageLayout:
    entries = tuple(e for s in storages for e in s.declared_axes())
    return cls(entries=entries, treedef=treedef, storages=tuple(storages))

  def bound_problem(self, i: int, bound: _mask_bounds.MaskBound) -> str | None:
    s = self.storages[i]
    if bound.shape != s.shape:  # a bound for another leaf of that path
      return None
    if bound.masked:
      return s.bound_problem(bound)
    return s.no_mask_problem(i) if s.needs_mask else None


jax.tree_util.register_static(StorageLayout)
