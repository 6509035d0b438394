"""The state and the factory of :func:`sparse_state`, and the choice of each leaf's
storage (:class:`Planner`).

:func:`sparse_state` keeps a base optimizer's state only where ``param_mask`` says
weights exist: per leaf in skip, offload, flat compact, N:M or tile storage
(``docs/sparse.md``); the step they share is :mod:`magma_optax.sparse.step`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from magma_optax._core import arguments as _arguments
from magma_optax._core import compat as _compat
from magma_optax._core import geometry as _geometry
from magma_optax._core import scoping as _scoping
from magma_optax.sparse import step as _step
from magma_optax.sparse import storage as _storage
from magma_optax.sparse.compact import Compact
from magma_optax.sparse.nm import Grouped
from magma_optax.sparse.nm import Groups
from magma_optax.sparse.offload import Offload
from magma_optax.sparse.offload import OffloadShardedTiles
from magma_optax.sparse.offload import OffloadTiles
from magma_optax.sparse.sharded_tiles import ShardedTiles
from magma_optax.sparse.skip import Skip
from magma_optax.sparse.tiles import Tiles

MODES = ("skip", "compact", "offload")
DEFAULT_DENSITY_THRESHOLD = 0.6


class SparseState(NamedTuple):
  """State of :func:`sparse_state`.

  Attributes:
    base_state: the base optimizer's state over the *stored* tree: a compact leaf
      is stored as a ``(capacity,)`` vector (N:M: the parameter's shape with ``axis``
      shrunk by ``n / m``; tiles: ``(capacity, r, c)``), other leaves at their
      full shape.
    stored_bits: per compact leaf a uint8 ``(ceil(size / 8),)`` packed bit mask of
      the entries held in the compact slots (in flat-index order; for flat
      compact storage paired with their int32 ``(capacity,)`` indices, sorted,
      ``size`` in empty slots), or for N:M compact storage one ``m``-bit integer
      per group (the parameter's shape with ``axis`` divided by ``m``);
      ``optax.MaskedNode`` for leaves with dense storage.
    inactive_steps: per scoped leaf (offload mode) an int32 scalar, consecutive
      steps with an all-inactive mask; ``optax.MaskedNode`` otherwise.
    cold: per scoped leaf (offload mode) a bool scalar, ``inactive_steps >=
      offload_after`` (read by :func:`offload_sparse_state`).
    errors: an int32 array with a row of ``1 + 8`` entries per leaf of compact
      storage (in tree order), all zero until a step's parameter mask fails a
      check of the leaf's storage; then the leaf's first such failure (its kind:
      1 a capacity overflow, 2 a mask not made of whole tiles, 3 a mask promised
      unchanged that is not the stored set; then its counts), kept until the
      state is initialised again and raised by :func:`check_sparse_state`.
    storage: static (no arrays, part of the tree structure): each leaf's storage
      (:class:`magma_optax.sparse.storage.StorageLayout`).
  """

  base_state: Any
  stored_bits: Any
  inactive_steps: Any
  cold: Any
  errors: Any = optax.MaskedNode()
  storage: _storage.StorageLayout = _storage.StorageLayout()


def sparse_state(
  base: optax.GradientTransformation,
  *,
  mode: str = "skip",
  density: float | None = None,
  structure: tuple[int, int] | None = None,
  axis: int = -1,
  block: tuple[int, int] | None = None,
  shards: Any = None,
  density_threshold: float = DEFAULT_DENSITY_THRESHOLD,
  offload_after: int = 100,
  where: _scoping.Where = None,
  cache_index: bool = True,
  on_error: str = "raise",
) -> optax.GradientTransformationExtraArgs:
  r"""Keeps ``base``'s state only for the active entries of ``param_mask``.

  With mask ``M`` (extra argument ``param_mask``, a pytree like the params of bool
  arrays; ``None`` or ``optax.MaskedNode`` leaves mean "all active")::

      skip:     u, s' = base(g, s);   s <- where(M, s', s);   u <- where(M, u, 0)
      compact:  I = nonzero(M, size=C);  u_I, s_I <- base(g[I], s_I);
                u = scatter(u_I at I)          (s_I holds only C slots)
      N:M:      the same within each group of m along axis (n slots per group)

  Args:
    base: an element-wise optimizer such as ``optax.adam(1e-3)``; it receives the
      other extra args, and ``param_mask`` restricted to what it stores.
    mode: ``"skip"``, ``"compact"`` or ``"offload"`` (``docs/sparse.md``).
      Compact storage of a base whose initial state reads the values of the
      parameters it stores (schedule-free's ``z``) is a ``ValueError`` at
      ``init``: it builds the base's state from zero parameters there.
    density: upper bound in (0, 1] on the fraction of active entries per leaf;
      sets the compact capacity ``ceil(density * size)``. Needed for ``"compact"``
      unless ``structure`` is given.
    structure: ``(n, m)`` for N:M masks (``n`` active in every ``m`` consecutive
      entries along ``axis``, as :func:`magma_optax.periodic_mask` makes them):
      compact storage then keeps ``n`` slots per group, the leaf's shape with
      ``axis`` shrunk by ``n / m``, plus ``m`` bits per group. It is local to each
      group, so it keeps the parameter's sharding (no gathers). A group with more
      than ``n`` active entries is a capacity overflow. ``m > 32``: flat storage of
      exact capacity ``size * n / m``.
    axis: the axis of the N:M groups (default: the last, as ``periodic_mask``).
      The numbers that shape compact storage -- ``density``,
      ``density_threshold`` and, with ``structure``, ``axis`` -- must be Python
      numbers: under ``optax.inject_hyperparams``, which injects every numeric
      argument as an array, list them in ``static_args`` (their error names
      them). Where the storage does not use them (skip storage, ``axis`` without
      ``structure``) the injected arrays are ignored.
    block: ``(r, c)`` for tile masks (whole ``r x c`` tiles of the last two axes
      kept or pruned, as ``periodic_mask(..., block=(r, c))`` makes them), with
      ``mode="compact"`` (or ``"offload"``: the same storage, whose buffers can move
      to host memory while a leaf has no active tile) and ``density`` (the
      largest fraction of active tiles per leaf): compact tile storage,
      ``(ceil(density * tiles), r, c)`` per leaf plus 1 bit per tile, that
      gathers and scatters whole tiles. Every scoped leaf needs >= 2 axes with
      the last two multiples of ``(r, c)`` (else a ``ValueError`` at ``init``;
      scope others out with ``where``). A mask that is not made of whole tiles,
      or has more active tiles than the capacity, is an error (raised as for
      capacity overflows).
    shards: with ``block``, ``(sr, sc)`` (or a callable ``(path, leaf) -> counts
      | None``, e.g. :func:`magma_optax.sharding.tile_shards`): per-shard tile
      storage for a parameter sharded ``sr`` ways along axis -2 and ``sc`` ways
      along axis -1. Each of the ``sr x sc`` parts of the leaf keeps
      ``ceil(density * T_p)`` slots for its ``T_p`` tiles, stored as ``(sr, sc,
      capacity, r, c)``: the indices are local to a part and the gathers and
      scatters are batched over the parts, so a device reads and writes its own
      tiles only and :func:`magma_optax.sharding.state_shardings` shards the
      storage like the parameter. Counts for the last ``k > 2`` axes, e.g.
      ``(se, sr, sc)`` for stacked experts or layers sharded ``se`` ways along
      axis -3, split those axes too (stored as ``(se, sr, sc, capacity, r, c)``).
      A part with more active tiles than its capacity is a capacity overflow
      naming the part: use the same ``shards`` in ``periodic_mask``, which then
      keeps as many tiles in every part. ``density_threshold`` compares a part's
      capacity with its tiles. ``None``: one storage per leaf.
    density_threshold: leaves with capacity above this fraction of their size use
      skip storage (default 0.6).
    offload_after: K >= 1, steps of an all-inactive mask after which a leaf is cold
      (offload mode); read at run time (an injected array is fine).
    where: which leaves get sparse storage (``None``: all floating leaves, real or
      complex, in every storage); others are updated densely by ``base``.
    cache_index: unstructured compact storage (``density`` without ``structure``
      or ``block``) keeps the int32 indices of its stored entries (4 bytes per
      slot), rebuilt only when the mask changes (default). ``False`` stores 1 bit
      per entry and rebuilds the index every step: the least memory, a slower step.
    on_error: how a step reports a parameter mask that compact storage cannot
      hold (a capacity overflow, or a mask not made of whole tiles). In both
      settings a leaf whose mask fails keeps its stored entries or tiles (its
      mask is replaced by them, and its stored moments take the step there) and
      gets a zero update, other leaves take their step, and each leaf's first
      failure is recorded in :attr:`SparseState.errors` for
      :func:`check_sparse_state` to raise, with the same message, where the loop
      reads values anyway (as ``optax.apply_if_finite`` skips and counts).
      ``"raise"`` (default) also raises a ``ValueError`` from the step where that
      costs no device round trip: outside ``jax.jit``, and under ``jax.jit``
      lowered for XLA:CPU through a host callback (reported as a
      ``JaxRuntimeError`` or ``ValueError``; it makes every CPU step synchronous).
      Lowered for a GPU or a TPU the step holds no callback: the failure is
      recorded only. Inside :func:`periodic_mask` with a constant Python number
      for ``sparsity`` ranked per leaf, or N:M ``structure``, its masks cannot
      fail the checks (it promises that of them in the extra argument
      ``mask_promises``), and ``"raise"`` compiles no callback for them.
      ``"record"``: no callback on any platform. Use it to ``jax.export`` a
      step: JAX cannot serialize ``"raise"``'s host callback, nor lower it for
      several platforms.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a :class:`SparseState`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = magma.periodic_mask(
    ...     magma.sparse_state(optax.adam(1e-3), mode="compact", density=0.25),
    ...     sparsity=0.75, every=100)
    >>> params = {"w": jnp.arange(16.0).reshape(4, 4)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((4, 4))}, state, params)
    >>> state.inner_state.base_state[0].mu["w"].shape
    (4,)

    N:M storage keeps the parameter's shape, with the group axis shrunk by n / m:

    >>> tx = magma.periodic_mask(
    ...     magma.sparse_state(optax.adam(1e-3), mode="compact", structure=(2, 4)),
    ...     structure=(2, 4), every=100)
    >>> state = tx.init(params)
    >>> state.inner_state.base_state[0].mu["w"].shape
    (4, 2)

    Tile storage keeps ``(capacity, r, c)``: here 2 of the 4 tiles of 2 x 2:

    >>> tx = magma.periodic_mask(
    ...     magma.sparse_state(
    ...         optax.adam(1e-3), mode="compact", density=0.5, block=(2, 2)),
    ...     sparsity=0.5, block=(2, 2), every=100)
    >>> state = tx.init(params)
    >>> state.inner_state.base_state[0].mu["w"].shape
    (2, 2, 2)

  References:
    Lee et al., jaxpruner, arXiv 2304.14082 (2023) (dense state for pruned weights,
    which this avoids).
  """
  planner = _arguments.from_arguments(Planner.create, locals())
  return _step.transformation(
    base, planner, offload_after, _step.base_step(base), state_type=SparseState,
    on_error=on_error,
  )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Planner:
  """The storage arguments of :func:`sparse_state` (and :func:`sparse_adam`),
  checked: called on a tree, one storage per leaf and the tree's structure."""

  mode: str
  density: float | None
  structure: tuple[int, int] | None
  axis: int
  block: tuple[int, int] | None
  shards: Any
  density_threshold: float
  where: Any
  cache_index: bool

  @classmethod
  def create(
    cls,
    *,
    mode,
    density,
    structure,
    axis,
    block,
    shards,
    density_threshold,
    offload_after,
    where,
    cache_index,
  ) -> Planner:
    """Checks every storage argument (``ValueError`` naming it)."""
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}; got {mode!r}.")
    if structure is not None:
      structure = _geometry.validate_nm_structure(structure)
      if density is not None:
        raise ValueError("give density or structure, not both.")
    # optax.inject_hyperparams injects every numeric argument, defaults included,
    # as arrays (traced under jit): the numbers that shape compact storage must be
    # static (an error naming static_args); the others accept its arrays.
    compact = density is not None or structure is not None
    static = tuple(
      name
      for name, shapes in (
        ("density", density is not None),
        ("density_threshold", compact),
        ("axis", structure is not None),
      )
      if shapes
    )
    if density is not None:
      density = float(
        _storage_number(
          "density", density, "a float in (0, 1]", lambda x: 0.0 < x <= 1.0, static
        )
      )
    if block is not None:
      block = _geometry.validate_block(block)
      if mode == "skip" or density is None or structure is not None:
        raise ValueError(
          f"block={block} (compact tile storage) needs mode='compact' (or 'offload')"
          f" and density= (the largest active fraction of tiles per leaf), without"
          f" structure; got"
          f" mode={mode!r}, density={density!r}, structure={structure!r}."
        )
    if mode == "skip" and compact:
      raise ValueError(
        f"density= and structure= size compact storage; mode='skip' keeps every"
        f" entry's state and takes neither (got density={density!r},"
        f" structure={structure!r}). Use mode='compact' to store active entries only."
      )
    shards = _geometry.validate_shards(shards, block, "sparse_state")
    if mode == "compact" and not compact:
      raise ValueError(
        "mode='compact' needs density= (the largest active fraction per leaf, in"
        " (0, 1]) or structure=(n, m) to size its fixed-capacity buffers."
      )
    density_threshold = _storage_number(
      "density_threshold", density_threshold, "a float in [0, 1]",
      lambda x: 0.0 <= x <= 1.0, static if compact else None,
    )  # fmt: skip
    # A run-time value in every mode (compared with each leaf's count of steps).
    _storage_number(
      "offload_after", offload_after, "an int >= 1",
      lambda x: isinstance(x, numbers.Integral) and x >= 1, None,
    )  # fmt: skip
    if not isinstance(cache_index, bool):
      raise ValueError(f"cache_index must be True or False; got {cache_index!r}.")
    axis = _storage_number(
      "axis", axis, "an int", lambda x: isinstance(x, numbers.Integral),
      static if structure is not None else None,
    )  # fmt: skip
    return cls(
      mode, density, structure, axis, block, shards, density_threshold, where,
      cache_index,
    )  # fmt: skip

  def __call__(self, tree: Any) -> tuple[list[_storage.Storage], Any]:
    plans, treedef = _scoping.plan_scope(tree, where=self.where, complex_ok=True)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    leaves = treedef.flatten_up_to(tree)
    storages = [
      self.storage_of(plan, path, x)
      for plan, path, x in zip(plans, paths, leaves, strict=True)
    ]
    return storages, treedef

  def storage_of(self, plan: Any, path: Any, x: Any) -> _storage.Storage:
    """The storage of leaf ``x`` at ``path``."""
    shape = tuple(jnp.shape(x))
    name = jax.tree_util.keystr(path)
    if plan.layout is None:
      return _storage.Storage(shape, name)
    size = math.prod(shape)
    if size > 0 and self.block is not None:
      tiles = self.tile_storage(shape, name, path, x)
      if tiles is not None:
        return tiles
    elif self.mode == "compact" and size > 0:
      groups = None if self.structure is None else self.groups_of(shape)
      cap = _storage.capacity(size, self.density, self.structure)
      if cap <= self.density_threshold * size:
        if groups is not None and groups.m <= 32:
          return Grouped(shape, name, groups)
        n, m = self.structure or (None, None)
        limit = (
          f"ceil(density * size) = ceil({self.density} * {size})"
          if self.structure is None
          else f"size * n / m = {size} * {n} / {m}"
        )
        return Compact(shape, name, cap, limit, self.cache_index)
    # The storage of a scoped leaf that is not compact.
    return Offload(shape, name) if self.mode == "offload" else Skip(shape, name)

  def tile_storage(self, shape, name, path, x) -> _storage.Storage | None:
    """Tile storage of the leaf (per shard part with ``shards``), or ``None``
    where its capacity would exceed ``density_threshold`` of its tiles."""
    block, density = self.block, self.density
    _geometry.check_tiles(shape, block, name)
    parts = _geometry.leaf_shards(self.shards, path, x, block, name)
    tiles = _geometry.num_tiles(shape, block) // math.prod(parts or (1,))
    cap = _storage.capacity(tiles, density, None)
    if cap > self.density_threshold * tiles:
      return None
    offload = self.mode == "offload"
    if parts is None:
      limit = f"ceil(density * tiles) = ceil({density} * {tiles})"
      return (OffloadTiles if offload else Tiles)(shape, name, block, cap, limit)
    limit = f"ceil(density * tiles per part) = ceil({density} * {tiles})"
    kind = OffloadShardedTiles if offload else ShardedTiles
    return kind(shape, name, block, parts, cap, limit)

  def groups_of(self, shape: tuple[int, ...]) -> Groups:
    axis, structure = self.axis, self.structure
    ndim = len(shape)
    if not -ndim <= axis < ndim or shape[axis] % structure[1]:
      raise ValueError(
        f"structure={structure} along axis={axis} needs every scoped leaf to have"
        f" that axis with a length that is a multiple of {structure[1]}; a leaf has"
        f" shape {shape}."
      )
    return Groups(tuple(shape), axis % ndim, *structure)


def _storage_number(
  name: str, value: Any, valid: str, ok: Any, static: tuple[str, ...] | None
) -> Any:
  """``value``, a storage argument, checked: ``ok(x)`` for a Python number ``x``.

  A JAX array -- ``optax.inject_hyperparams`` passes one for every numeric argument,
  traced under ``jit`` -- is refused where the argument shapes the storage
  (``static``: the ``static_args`` to name) and otherwise taken as given (checked
  if concrete): the chosen storage ignores it, or reads it at run time.

  Raises:
    ValueError: naming the argument, the value, what is valid and, for an array
      that must be static, the ``static_args`` to pass.
  """
  if isinstance(value, jax.Array):
    if static is not None:
      raise ValueError(
        f"{name} must be static ({valid}, a Python number): it shapes compact"
        f" storage; got {value!r}. With optax.inject_hyperparams, pass"
        f" static_args={static!r}."
      )
    if _compat.is_tracer(value):
      return value
    probe = value.item() if value.ndim == 0 else value
  else:
    probe = value
  if (
    isinstance(probe, bool)
    or not isinstance(probe, numbers.Real)  # Python or numpy scalars
    or not ok(probe)
  ):
    raise ValueError(f"{name} must be {valid}; got {value!r}.")
  return value
