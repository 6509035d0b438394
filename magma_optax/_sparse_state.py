"""Sparse optimizer state: the base optimizer's state kept only where weights exist.

:func:`sparse_state` wraps a base optimizer and reads the parameter mask from the extra
argument ``param_mask=`` (what :func:`magma_optax.periodic_mask` passes to its inner
transform). Per scoped leaf, one of two storages is used:

* **skip** (dense storage, "masked-moment update"): the base runs on the whole leaf; for
  inactive entries the new state is discarded (their moments stay frozen) and the
  update is zero.
* **compact**: the base runs on a fixed-capacity vector holding only the active
  entries, gathered from the gradient and scattered back into the update
  (at the indices of the active entries, ``capacity`` of them, so shapes are static
  under ``jax.jit``). The capacity is ``ceil(density * size)``.
  A mask with more active entries than the capacity is an error: a ``ValueError``
  when the mask is concrete, and a runtime error whose message says "capacity
  overflow" under ``jax.jit`` (raised from a host callback that runs only then).
  Size ``density`` for the *densest* mask of the run: under a sparsity ramp the early
  masks are dense, so use skip storage until the ramp ends (or start sparse).
  When the mask changes, moments of entries that stay active move to their new slot
  and newly active entries start from zero (so, under ``periodic_mask``, ``compact``
  equals ``skip`` numerically for element-wise bases such as Adam, RMSProp, SGD with
  momentum). The stored-entry set is kept as a packed bit mask (1 bit per entry), so
  the state is ``capacity * (per-entry base state) + size / 8`` bytes.
* **compact, N:M** (``structure=(n, m)``, ``m <= 32``): the same, group by group:
  every ``m`` consecutive entries along ``axis`` keep ``n`` slots, so the stored
  leaf has the parameter's shape with ``axis`` shrunk by ``n / m``, plus ``m`` bits
  per group (an 8-, 16- or 32-bit integer). Slot ``s`` holds the group's ``s``-th
  active entry. Gathering, scattering and moving moments between slots are
  element-wise selections within a group: no flat index, no gather, which also
  makes it faster than flat compact storage. A group with more than ``n`` active
  entries is a capacity overflow (the same errors as above).

**Auto-dense.** Compact storage costs the active entries plus bookkeeping and a gather
/ scatter per step; above a density of ``density_threshold`` (default 0.6, the seed's
figure) it saves little memory and costs time, so such leaves use skip storage
automatically. Leaves outside ``where`` are plain dense (their update is the base's).

**Offload** (``mode="offload"``): skip storage plus a per-leaf counter of consecutive
steps whose mask was all-inactive. After ``offload_after`` such steps the leaf is marked
cold; :func:`offload_sparse_state` (called on the host between steps, outside
``jax.jit``) moves cold leaves' state to host memory (``memory_kind="pinned_host"``) and
leaves that became active again back to device memory. Inside the jitted update a
host-resident leaf is only touched when its mask has an active entry (a ``lax.cond``:
it is copied to the device, updated and copied back); while it stays inactive it is not
transferred at all. Placement is static in a compiled function, so the step recompiles
when the placement changes -- call the helper every few hundred steps, not every step.
Where the backend has no host memory kinds (or this JAX lacks ``jax.memory``) the
helper returns the state unchanged and offload behaves exactly like skip.

The base must be element-wise for ``compact`` to equal ``skip`` (a global-norm clip
sees only the active entries in compact storage and every entry in skip storage).

Sharding: skip, offload and N:M compact storage keep the parameters' layout
(element-wise ops, and reductions within a group; a shard must hold whole groups
along ``axis``) -- checked on 8 CPU devices with ``AxisType.Auto`` and ``Explicit``
meshes: no parameter-sized collective, results equal to one device. Unstructured
compact storage is one flat vector per leaf indexed by global flat indices, so under
a mesh XLA gathers the leaf's mask and gradient to build it (checked with
``AxisType.Auto``); a leaf sharded over ``AxisType.Explicit`` axes is an error that
says so (the gather has no unambiguous output sharding).
"""

from __future__ import annotations

import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from magma_optax import _compat
from magma_optax import _scoping
from magma_optax import _topk

MODES = ("skip", "compact", "offload")
DEFAULT_DENSITY_THRESHOLD = 0.6
HOST_MEMORY_KIND = "pinned_host"

# jax.memory.Space (jax >= 0.10) names memory spaces inside jit; absent -> no offload.
_SPACE = getattr(getattr(jax, "memory", None), "Space", None)


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _memory_space(x: Any) -> Any:
  try:
    return getattr(jax.typeof(x), "memory_space", None)
  except Exception:  # noqa: BLE001  non-array leaves have no memory space
    return None


def _on_host(x: Any) -> bool:
  return _SPACE is not None and _memory_space(x) == _SPACE.Host


class SparseState(NamedTuple):
  """State of :func:`sparse_state`.

  Attributes:
    base_state: the base optimizer's state over the *stored* tree: a compact leaf
      is stored as a ``(capacity,)`` vector (N:M: the parameter's shape with ``axis``
      shrunk by ``n / m``), other leaves at their full shape.
    stored_bits: per compact leaf a uint8 ``(ceil(size / 8),)`` packed bit mask of
      the entries held in the compact slots (in flat-index order), or for N:M
      compact storage one ``m``-bit integer per group (the parameter's shape with
      ``axis`` divided by ``m``); ``optax.MaskedNode`` for leaves with dense storage.
    inactive_steps: per scoped leaf (offload mode) an int32 scalar, consecutive
      steps with an all-inactive mask; ``optax.MaskedNode`` otherwise.
    cold: per scoped leaf (offload mode) a bool scalar, ``inactive_steps >=
      offload_after`` (read by :func:`offload_sparse_state`).
  """

  base_state: Any
  stored_bits: Any
  inactive_steps: Any
  cold: Any


class _Groups(NamedTuple):
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
    # over a tiny trailing axis 3-4x slower than these element-wise selections.
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


class _Leaf(NamedTuple):
  kind: str  # "plain" (unscoped), "skip", "compact" (flat) or "grouped" (N:M)
  size: int
  capacity: int
  groups: _Groups | None = None


def _active_indices(flat_mask: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
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


def _explicit_axes(x: Any) -> set[str]:
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


def _capacity(size: int, density: float | None, structure) -> int:
  if structure is not None:
    return size * structure[0] // structure[1]
  return min(size, max(1, math.ceil(density * size)))


def _raise_overflow(active, capacity):
  raise ValueError(
    f"sparse_state compact capacity overflow: a parameter mask has {int(active)}"
    f" active entries but the compact storage holds {int(capacity)}; raise"
    " `density` (or use mode='skip')."
  )


def _raise_group_overflow(active, n, m):
  raise ValueError(
    f"sparse_state compact capacity overflow: a group of {int(m)} entries has"
    f" {int(active)} active but structure=({int(n)}, {int(m)}) stores {int(n)};"
    " the mask is not N:M along `axis` (give periodic_mask the same structure and"
    " axis, or use mode='skip')."
  )


def _check(active, limit, raise_fn, *args):
  """``raise_fn(active, *args)`` if ``active > limit``; at run time under jit."""
  if _compat.is_tracer(active):
    jax.lax.cond(
      active > limit,
      lambda: jax.debug.callback(raise_fn, active, *args),
      lambda: None,
    )
  elif int(active) > limit:
    raise_fn(active, *args)


def _per_entry_map(fn, shapes, treedef, *trees):
  """Maps ``fn(i, *leaves)`` over per-entry subtrees of ``trees``; keeps the rest.

  A per-entry subtree has the stored tree's structure (``MaskedNode`` allowed) and
  each array leaf the stored leaf's shape. Other leaves come from ``trees[0]``.
  """

  def is_per_entry(node):
    leaves = _scoping.per_leaf(treedef, node)
    if leaves is None:
      return False
    return all(
      _is_masked(x) or (hasattr(x, "shape") and tuple(x.shape) == s)
      for x, s in zip(leaves, shapes, strict=True)
    )

  def combine(first, *rest):
    if not is_per_entry(first):
      return first
    flat = [treedef.flatten_up_to(t) for t in (first, *rest)]
    out = [
      x[0] if _is_masked(x[0]) else fn(i, *x)
      for i, x in enumerate(zip(*flat, strict=True))
    ]
    return treedef.unflatten(out)

  return jax.tree.map(combine, *trees, is_leaf=is_per_entry)


def sparse_state(
  base: optax.GradientTransformation,
  *,
  mode: str = "skip",
  density: float | None = None,
  structure: tuple[int, int] | None = None,
  axis: int = -1,
  density_threshold: float = DEFAULT_DENSITY_THRESHOLD,
  offload_after: int = 100,
  where: _scoping.Where = None,
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
    mode: ``"skip"``, ``"compact"`` or ``"offload"`` (see the module docstring).
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
    density_threshold: leaves with capacity above this fraction of their size use
      skip storage (default 0.6).
    offload_after: K >= 1, steps of an all-inactive mask after which a leaf is cold
      (offload mode).
    where: which leaves get sparse storage (``None``: all floating leaves); others
      are updated densely by ``base``.

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

  References:
    Lee et al., jaxpruner, arXiv 2304.14082 (2023) (dense state for pruned weights,
    which this avoids).
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}; got {mode!r}.")
  if structure is not None:
    structure = _topk.validate_nm_structure(structure)
    if density is not None:
      raise ValueError("give density or structure, not both.")
  if density is not None and not (
    isinstance(density, int | float) and 0.0 < density <= 1.0
  ):
    raise ValueError(f"density must be a float in (0, 1]; got {density!r}.")
  if mode == "compact" and density is None and structure is None:
    raise ValueError(
      "mode='compact' needs density= (the largest active fraction per leaf, in"
      " (0, 1]) or structure=(n, m) to size its fixed-capacity buffers."
    )
  if not isinstance(density_threshold, int | float) or not (
    0.0 <= density_threshold <= 1.0
  ):
    raise ValueError(
      f"density_threshold must lie in [0, 1]; got {density_threshold!r}."
    )
  if (
    isinstance(offload_after, bool)
    or not isinstance(offload_after, int)
    or (offload_after < 1)
  ):
    raise ValueError(
      f"offload_after must be an int >= 1; got {offload_after!r}. (With"
      " optax.inject_hyperparams, pass static_args=('axis', 'offload_after').)"
    )
  if isinstance(axis, bool) or not isinstance(axis, int):
    raise ValueError(
      f"axis must be an int; got {axis!r}. (With optax.inject_hyperparams, pass"
      " static_args=('axis', 'offload_after').)"
    )
  base = optax.with_extra_args_support(base)

  def groups_of(shape):
    ndim = len(shape)
    if not -ndim <= axis < ndim or shape[axis] % structure[1]:
      raise ValueError(
        f"structure={structure} along axis={axis} needs every scoped leaf to have"
        f" that axis with a length that is a multiple of {structure[1]}; a leaf has"
        f" shape {shape}."
      )
    return _Groups(tuple(shape), axis % ndim, *structure)

  def leaf_plans(tree):
    plans, treedef = _scoping.plan_scope(tree, where=where)
    out = []
    for p, x in zip(plans, treedef.flatten_up_to(tree), strict=True):
      size = int(math.prod(jnp.shape(x)))
      if p.layout is None:
        out.append(_Leaf("plain", size, size))
        continue
      if mode == "compact" and size > 0:
        groups = None if structure is None else groups_of(tuple(jnp.shape(x)))
        cap = _capacity(size, density, structure)
        if cap <= density_threshold * size:
          if groups is not None and groups.m <= 32:
            out.append(_Leaf("grouped", size, cap, groups))
          else:
            out.append(_Leaf("compact", size, cap))
          continue
      out.append(_Leaf("skip", size, size))
    return out, treedef

  def stored_shape(lf, x):
    if lf.kind == "compact":
      return (lf.capacity,)
    if lf.kind == "grouped":
      return lf.groups.stored_shape
    return tuple(jnp.shape(x))

  def stored_shapes(leaves, tree_leaves):
    return [stored_shape(lf, x) for lf, x in zip(leaves, tree_leaves, strict=True)]

  def init_fn(params):
    leaves, treedef = leaf_plans(params)
    flat = treedef.flatten_up_to(params)
    stored = [
      x if lf.kind in ("plain", "skip") else jnp.zeros(stored_shape(lf, x), x.dtype)
      for lf, x in zip(leaves, flat, strict=True)
    ]

    def no_bits(lf):
      if lf.kind == "compact":
        return jnp.zeros(((lf.size + 7) // 8,), jnp.uint8)
      if lf.kind == "grouped":
        return jnp.zeros(lf.groups.bits_shape, lf.groups.bits_dtype)
      return optax.MaskedNode()

    bits = [no_bits(lf) for lf in leaves]
    offload = mode == "offload"
    steps = [
      jnp.zeros([], jnp.int32) if offload and lf.kind != "plain" else None
      for lf in leaves
    ]
    return SparseState(
      base_state=base.init(treedef.unflatten(stored)),
      stored_bits=treedef.unflatten(bits),
      inactive_steps=treedef.unflatten(
        [optax.MaskedNode() if s is None else s for s in steps]
      ),
      cold=treedef.unflatten(
        [optax.MaskedNode() if s is None else s >= offload_after for s in steps]
      ),
    )

  def leaf_masks(param_mask, leaves, treedef, flat):
    if param_mask is None:
      masks = [None] * len(leaves)
    else:
      masks = _scoping.split_param_mask(treedef, param_mask)
    out = []
    for i, (lf, m, x) in enumerate(zip(leaves, masks, flat, strict=True)):
      if m is None or _is_masked(m) or lf.kind == "plain":
        if lf.kind in ("compact", "grouped"):
          raise ValueError(
            f"leaf {i} uses compact storage but param_mask has no mask for it;"
            " pass param_mask= (periodic_mask does) or scope the leaf out with"
            " `where`."
          )
        out.append(None)
        continue
      m = jnp.asarray(m)
      if m.shape != jnp.shape(x):
        raise ValueError(
          f"param_mask leaf {i} has shape {m.shape}; the parameter has {jnp.shape(x)}."
        )
      out.append(m.astype(jnp.bool_))
    return out

  def update_fn(updates, state, params=None, *, param_mask=None, **extra_args):
    leaves, treedef = leaf_plans(updates)
    flat_g = treedef.flatten_up_to(updates)
    flat_p = treedef.flatten_up_to(params) if params is not None else None
    masks = leaf_masks(param_mask, leaves, treedef, flat_g)
    shapes = stored_shapes(leaves, flat_g)
    bits = treedef.flatten_up_to(state.stored_bits)
    any_active = [None if m is None else jnp.any(m) for m in masks]

    # Compact leaves: indices of the active entries (flat) or the slot of each
    # entry in its group (grouped), and a slot remap when the mask changed.
    new_idx, slots, new_bits, remap = {}, {}, list(bits), {}
    for i, lf in enumerate(leaves):
      if lf.kind == "compact":
        axes = _explicit_axes(flat_g[i]) | _explicit_axes(masks[i])
        if axes:
          raise ValueError(
            f"sparse_state: unstructured compact storage does not support leaves"
            f" sharded over Explicit mesh axes ({sorted(axes)}): it keeps one flat"
            " vector per leaf. Use mode='skip', or N:M compact storage"
            " (structure=(n, m)), which keeps the parameter's sharding."
          )
        flat_m = masks[i].reshape(-1)
        new_idx[i], n_active = _active_indices(flat_m, lf.capacity)
        _check(n_active, lf.capacity, _raise_overflow, lf.capacity)
        new_bits[i] = jnp.packbits(flat_m)
      elif lf.kind == "grouped":
        groups = lf.groups
        slots[i] = groups.slots(masks[i])
        most = jnp.max(groups.per_group(masks[i]))
        _check(most, groups.n, _raise_group_overflow, groups.n, groups.m)
        new_bits[i] = groups.pack(masks[i])
      else:
        continue
      remap[i] = jnp.any(new_bits[i] != bits[i])

    def remap_state(base_state):
      def move(i, x):
        if i not in remap:
          return x
        if i in slots:
          groups = leaves[i].groups
          old = groups.expand(x, groups.slots(groups.unpack(bits[i])))
          return groups.compact(old, slots[i])
        old_mask = jnp.unpackbits(bits[i], count=leaves[i].size).astype(jnp.bool_)
        old_idx, _ = _active_indices(old_mask, leaves[i].capacity)
        pos = jnp.clip(jnp.searchsorted(old_idx, new_idx[i]), 0, x.shape[0] - 1)
        found = (old_idx[pos] == new_idx[i]) & (new_idx[i] < leaves[i].size)
        return jnp.where(found, x[pos], jnp.zeros([], x.dtype))

      return _per_entry_map(move, shapes, treedef, base_state)

    base_state = state.base_state
    if remap:
      changed = jnp.any(jnp.stack(list(remap.values())))
      base_state = jax.lax.cond(changed, remap_state, lambda s: s, base_state)

    # Offloaded (host-resident) leaves come to the device only when active.
    def fetch(i, x):
      if not _on_host(x):
        return x
      return jax.lax.cond(
        any_active[i],
        lambda: jax.device_put(x, _SPACE.Device),
        lambda: jnp.zeros(x.shape, x.dtype),
      )

    old_state = _per_entry_map(fetch, shapes, treedef, base_state)

    def gather(i, x):
      if i in slots:
        return leaves[i].groups.compact(x, slots[i])
      if leaves[i].kind != "compact":
        return x
      return jnp.take(
        x.reshape(-1), new_idx[i], mode="fill", fill_value=0, indices_are_sorted=True
      )

    stored_g = [gather(i, g) for i, g in enumerate(flat_g)]
    stored_p = None if flat_p is None else [gather(i, p) for i, p in enumerate(flat_p)]

    def stored_mask(i, m):
      if m is None:
        return optax.MaskedNode()
      if i in slots:
        return leaves[i].groups.filled(slots[i])
      return new_idx[i] < leaves[i].size if leaves[i].kind == "compact" else m

    base_updates, new_state = base.update(
      treedef.unflatten(stored_g),
      old_state,
      None if stored_p is None else treedef.unflatten(stored_p),
      param_mask=treedef.unflatten([stored_mask(i, m) for i, m in enumerate(masks)]),
      **extra_args,
    )

    def freeze(i, new, old):
      if leaves[i].kind == "skip" and masks[i] is not None:
        new = jnp.where(masks[i], new, old)
      return new

    new_state = _per_entry_map(freeze, shapes, treedef, new_state, old_state)

    def store(i, new, orig):
      if not _on_host(orig):
        return new
      return jax.lax.cond(
        any_active[i], lambda: jax.device_put(new, _SPACE.Host), lambda: orig
      )

    new_state = _per_entry_map(store, shapes, treedef, new_state, base_state)

    out = []
    for i, (lf, u, g) in enumerate(
      zip(leaves, treedef.flatten_up_to(base_updates), flat_g, strict=True)
    ):
      if lf.kind == "compact":
        full = (
          jnp.zeros((lf.size,), u.dtype)
          .at[new_idx[i]]
          .set(u, mode="drop", indices_are_sorted=True)
        )
        out.append(full.reshape(jnp.shape(g)))
      elif lf.kind == "grouped":
        out.append(lf.groups.expand(u, slots[i]))
      elif masks[i] is not None:
        out.append(jnp.where(masks[i], u, jnp.zeros([], u.dtype)))
      else:
        out.append(u)

    steps = treedef.flatten_up_to(state.inactive_steps)
    new_steps = [
      s
      if _is_masked(s)
      else (
        jnp.zeros([], jnp.int32)
        if any_active[i] is None
        else jnp.where(any_active[i], 0, optax.safe_increment(s))
      )
      for i, s in enumerate(steps)
    ]
    new_cold = [s if _is_masked(s) else s >= offload_after for s in new_steps]
    return treedef.unflatten(out), SparseState(
      base_state=new_state,
      stored_bits=treedef.unflatten(new_bits),
      inactive_steps=treedef.unflatten(new_steps),
      cold=treedef.unflatten(new_cold),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def host_offload_available(device: jax.Device | None = None) -> bool:
  """Whether ``device`` (default: the first) has a ``pinned_host`` memory kind.

  Example:
    >>> import magma_optax as magma
    >>> isinstance(magma.host_offload_available(), bool)
    True
  """
  if _SPACE is None:
    return False
  device = device or jax.devices()[0]
  try:
    kinds = {m.kind for m in device.addressable_memories()}
  except Exception:  # noqa: BLE001  backends without memory kinds
    return False
  return HOST_MEMORY_KIND in kinds


def offload_sparse_state(opt_state: Any, params: Any) -> Any:
  """Moves cold leaves' sparse state to host memory and active ones back to device.

  Call on the host between (jitted) steps; it reads the per-leaf ``cold`` flags of
  every offload-mode :class:`SparseState` in ``opt_state`` (a host sync) and
  ``jax.device_put``\\ s their per-entry base state to ``memory_kind="pinned_host"``
  (cold) or the device's default memory (no longer cold). Sharding is kept. Where
  host memory kinds are unavailable (see :func:`host_offload_available`) the state
  is returned unchanged.

  Args:
    opt_state: an optimizer state containing a ``sparse_state(mode="offload")``.
    params: the parameters (their structure and shapes identify per-entry state).

  Returns:
    The state with per-entry base state placed by coldness.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = magma.sparse_state(optax.adam(1e-3), mode="offload", offload_after=1)
    >>> params = {"w": jnp.ones(4)}
    >>> state = tx.init(params)
    >>> mask = {"w": jnp.zeros(4, bool)}
    >>> _, state = tx.update(params, state, params, param_mask=mask)
    >>> state = magma.offload_sparse_state(state, params)
  """
  if not host_offload_available():
    return opt_state
  is_state = lambda x: isinstance(x, SparseState)

  def own_params(cold):
    """``params`` as this state saw them at init: inside ``optax.masked`` or
    ``optax.multi_transform`` a group's tree has ``MaskedNode`` for whole
    subtrees. (A ``MaskedNode`` in place of a single leaf stays a leaf here: it
    splits the per-leaf trees the same way.)"""
    try:
      return jax.tree.map(
        lambda c, p: (
          optax.MaskedNode() if _is_masked(c) and not hasattr(p, "shape") else p
        ),
        cold,
        params,
        is_leaf=_is_masked,
      )
    except (ValueError, TypeError):
      return None

  def place(node):
    if not is_state(node):
      return node
    local = own_params(node.cold)
    if local is None:
      return node
    flat_p, treedef = jax.tree.flatten(local)
    shapes = [tuple(jnp.shape(x)) for x in flat_p]
    cold = _scoping.per_leaf(treedef, node.cold)
    if cold is None or all(_is_masked(c) for c in cold):
      return node
    cold = [None if _is_masked(c) else bool(c) for c in cold]

    def move(i, x):
      if cold[i] is None:
        return x
      sharding = x.sharding
      want = HOST_MEMORY_KIND if cold[i] else jax.devices()[0].default_memory().kind
      if sharding.memory_kind == want:
        return x
      return jax.device_put(x, sharding.with_memory_kind(want))

    return node._replace(
      base_state=_per_entry_map(move, shapes, treedef, node.base_state)
    )

  return jax.tree.map(place, opt_state, is_leaf=is_state)
