"""Sparse optimizer state: the base optimizer's state kept only where weights exist.

:func:`sparse_state` wraps a base optimizer and reads the parameter mask from the extra
argument ``param_mask=`` (what :func:`magma_optax.periodic_mask` passes to its inner
transform). Per scoped leaf, one of two storages is used:

* **skip** (dense storage, "masked-moment update"): the base runs on the whole leaf; for
  inactive entries the new state is discarded (their moments stay frozen) and the
  update is zero. The base's new state is frozen where the base computes it
  (:mod:`magma_optax._freeze`), so that its update reads the frozen state: XLA
  then writes the state in place and copies no old moment (4.7x -> 1.1-1.25x
  ``optax.adam``'s donated step at 4 M parameters on a 2-core CPU). That needs
  every use of a state entry inside the base to be elementwise; an entry whose
  update reads, e.g., a norm over the leaf (LAMB's trust ratio) is frozen after
  the step, as before, with the same results and the copy.
* **compact**: the base runs on a fixed-capacity vector holding only the active
  entries, gathered from the gradient and scattered back into the update
  (at the indices of the active entries, ``capacity`` of them, so shapes are static
  under ``jax.jit``). The capacity is ``ceil(density * size)``.
  A mask with more active entries than the capacity is an error naming the leaf,
  the counts and ``density``: a ``ValueError`` raised before the step computes
  anything when the mask is concrete (``update`` outside ``jax.jit``). Under
  ``jax.jit`` the count exists only when the compiled step runs, and such a step
  can fail only through the runtime: the same ``ValueError`` is raised from a host
  callback, and the step returns nothing, so no overflowing state reaches the
  caller. JAX reports it as a ``jax.errors.JaxRuntimeError`` ("INTERNAL:
  CpuCallback error ...", the message on its last line) -- or, on jax 0.10.2 and
  0.12 when the jitted step's first call succeeded (an overflow at a later
  refresh), as a ``ValueError`` with that text: JAX's dispatch decides, so catch
  both. (With donated buffers the donated inputs are gone too: to debug, run one
  step without jit.) **On several devices**, run the step inside ``jax.set_mesh``
  (as Explicit axes need anyway): the check then runs on every device (a
  ``shard_map`` over the mesh) and the error is raised as on one device (checked
  on 8 forced CPU devices, Auto and Explicit axes). Without a mesh context the
  callback runs on one device while the others wait for it at the step's next
  collective, and XLA:CPU aborts the process after its 40 s collective timeout,
  having printed the message (on GPUs the wait may not end).
  The host callback has a cost even on steps that never call it: XLA:CPU runs a
  computation that holds one synchronously, so every jitted step waits for its own
  end before returning (measured: dispatch 4.4 ms, the whole step, against 0.05 ms
  without it; ~0.1-0.2x of an Adam step on the tile benchmark, more where the loop
  has host work to overlap). **``on_error="record"``** compiles no callback: a leaf
  whose mask fails keeps its stored set (the mask is replaced by it, so the moments
  stay consistent and take the step there), gets a zero update, and the first
  failure is recorded in the state; :func:`check_sparse_state` raises it as the
  same ``ValueError``, outside ``jit``, where the loop reads values anyway. Nothing
  is lost (no donated buffer is consumed by a failed step), and several devices
  need no mesh context.
  **Inside** :func:`periodic_mask` ranking per leaf with a constant Python number
  for ``sparsity`` (``schedule="constant"``), or with N:M ``structure``, the
  checks need no callback with the default either: every mask it hands a leaf has
  at most the first refresh's count, made of its tiles or groups, and it promises
  that of the very mask arrays it passes. Where that mask fits the storage (its
  ``init`` checks it), the step handles the leaf's checks as ``"record"`` does
  and compiles no callback for them (``periodic_mask(sparse_adam(...,
  block=(8, 128)))`` on a 72-leaf tree: 1.61x -> 1.11x ``optax.adam``). A promised
  tile mask is not read in full either: each tile's first entry decides. Only a
  ``periodic_mask`` state edited by hand can break the promise: the leaf is then
  left on its stored set as in ``"record"`` (which records the failure; with
  ``"raise"`` it is not reported), and an entry edited inside a tile is not seen
  (its tile's first entry decides; ``periodic_mask`` still prunes the entry).
  A global top-k, a schedule or ramp for ``sparsity``, a traced target,
  another block, or a wrapper in between that makes new mask arrays: checked
  through the callback as elsewhere.
  Size ``density`` for the *densest* mask of the run: under a sparsity ramp the early
  masks are dense, so use skip storage until the ramp ends (or start sparse).
  Inside :func:`periodic_mask`, whose ``init`` announces the densest mask it will
  pass each leaf (all-active before ``start`` and where a ramp starts, the first
  refresh's top-k count, its tiles, its N:M groups), a mask that certainly cannot
  be stored -- too many entries or tiles, or a count of entries that whole tiles
  cannot make -- is the same ``ValueError`` raised by ``init``, before any step
  (with ``on_error="record"`` too, whose run would record the failure and leave
  the leaf without updates). What depends on the
  values is left to the step's check: how a ``ranking="global"`` top-k shares its
  count out beyond what each leaf must take, a traced target, whether an entry
  mask happens to be whole tiles, balance over shard parts the mask does not have.
  When the mask changes, moments of entries that stay active move to their new slot
  and newly active entries start from the base's initial state (zero for Adam's
  moments, 0.1 for Adagrad's sum of squares; as ``init`` builds it, for zero
  parameters: a base whose initial state reads the parameters' values, such as
  schedule-free's ``z``, is a ``ValueError`` at ``init``, found in the dataflow of
  its ``init``; use skip storage for it). So, under ``periodic_mask``,
  ``compact`` equals ``skip`` numerically for element-wise bases whose per-entry
  state fields are all in ``periodic_mask``'s ``moment_names`` (it restarts those in
  skip storage; the default ``("mu", "nu", "trace")`` covers Adam, RMSProp, SGD with
  momentum; give, e.g., ``("mu", "nu", "nu_max")`` for AMSGrad,
  ``("sum_of_squares",)`` for Adagrad). The stored-entry set is kept twice: as a
  packed bit mask (1 bit per entry), which shows cheaply whether the mask changed,
  and as the int32 indices of the stored entries, so that the index of the active
  entries -- a pass over every entry that costs several Adam steps on XLA:CPU -- is
  rebuilt only on the steps where the mask changes (``periodic_mask``'s refreshes).
  The state is ``capacity * (per-entry base state + 4) + size / 8`` bytes.
* **compact, N:M** (``structure=(n, m)``, ``m <= 32``): the same, group by group:
  every ``m`` consecutive entries along ``axis`` keep ``n`` slots, so the stored
  leaf has the parameter's shape with ``axis`` shrunk by ``n / m``, plus ``m`` bits
  per group (an 8-, 16- or 32-bit integer). Slot ``s`` holds the group's ``s``-th
  active entry. Gathering, scattering and moving moments between slots are
  element-wise selections within a group: no flat index, no gather, which also
  makes it faster than flat compact storage. A group with more than ``n`` active
  entries is a capacity overflow (the same errors as above).
* **compact, tiles** (``block=(r, c)`` with ``density``): the same with whole ``r x
  c`` tiles of the last two axes as the unit (the masks of
  ``periodic_mask(..., block=(r, c))``): ``ceil(density * tiles)`` tile slots of
  ``(r, c)`` per leaf plus 1 bit per tile. The active tiles' indices are built from
  one entry per tile; gathers move whole tiles (``c`` contiguous entries per tile
  row), so the cost of the base's update follows density. The update is the
  compact tiles expanded by a per-tile slot map -- a gather that XLA fuses into
  ``optax.apply_updates``, so no parameter-sized update array is written (a zero
  array with the tiles scattered into it was slower on XLA:CPU, and is a
  parameter-sized temporary on every backend). Every step also checks, in one pass
  over the mask, that it is made of whole tiles: a mask that is not is an error
  (raised as capacity overflows are), not silently rounded to tiles (except a
  mask that ``periodic_mask`` promises, above). Regrown tiles start from the
  base's initial state. Leaves with the same number of tiles and capacity find
  their tile slots and slot maps over one stack of their tiles: per leaf that is
  some 20 small computations, each a launch of its own on XLA:CPU, which on a
  transformer's many leaves cost more than the step's bytes.

Each storage is a small class behind one interface (``_Storage``: ``init_leaf``,
``stored_shape``, ``prepare``, ``remap``, ``gather``, ``freeze``, ``scatter``, and
``load`` / ``unload`` for offload); the factory picks one per leaf, and the update
runs the same sequence of calls for every leaf. The base state's per-entry subtrees
are found with :func:`magma_optax._trees.map_like` (at the stored shapes).

**sparse_adam.** :func:`sparse_adam` is ``sparse_state(optax.adam(...))`` with the
same storages and state whose Adam step is written per storage: over the active
tiles (:func:`magma_optax.kernels.tiles.tile_adam`, with a Pallas kernel behind
``implementation=``), and for skip storage from the merged moments, which lets XLA
update them in place (for a generic base, skip storage gets there by tracing its
step: :mod:`magma_optax._freeze`).

**Auto-dense.** Compact storage costs the active entries plus bookkeeping and a gather
/ scatter per step; above a density of ``density_threshold`` (default 0.6, a rule
of thumb) it saves little memory and costs time, so such leaves use skip storage
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
With ``block=(r, c)`` and ``density``, offload mode keeps compact tile storage and the
same per-leaf counter: inactive tiles hold no moments in compact storage (regrown tiles
start from the base's initial state), so what moves to host memory is the tile buffer of
a leaf that has had no active tile for ``offload_after`` steps; it is remapped and
updated on the device when tiles regrow (numerically the same as ``"compact"``).

The base must be element-wise for ``compact`` to equal ``skip`` (a global-norm clip
sees only the active entries in compact storage and every entry in skip storage).

Sharding: skip, offload and N:M compact storage keep the parameters' layout
(element-wise ops, and reductions within a group; a shard must hold whole groups
along ``axis``, a ``ValueError`` under ``Explicit`` axes otherwise) -- checked on 8
CPU devices with ``AxisType.Auto`` and ``Explicit`` meshes: no parameter-sized
collective, results equal to one device. Under ``Explicit`` axes a plain
``tx.init(params)`` already gives N:M storage's stored arrays the parameter's
partition spec (as :func:`magma_optax.sharding.init` does). Unstructured
compact storage is one flat vector per leaf indexed by global flat indices, so under
a mesh XLA gathers the leaf's mask and gradient to build it (checked with
``AxisType.Auto``); a leaf sharded over ``AxisType.Explicit`` axes is an error that
says so (the gather has no unambiguous output sharding). Compact tile storage is the
same kind of storage (one vector of tiles per leaf, global tile indices, the same
error under ``Explicit`` axes). Under ``AxisType.Auto`` (checked on 8 CPU devices:
results equal one device's) XLA keeps the compact tiles replicated and all-reduces
the active tiles of the gradient it gathers, ``density`` x the leaf, every step --
never the whole leaf -- so the state's memory is not divided across devices.
**Per-shard tile storage** (``shards=(sr, sc)``, or per leaf through a callable such
as :func:`magma_optax.sharding.tile_shards`) divides it: the leaf's last two axes are
split into ``sr x sc`` equal parts of whole tiles (a device's shard when the
parameter is sharded that way) and each part is tile storage of its own,
``ceil(density * T_p)`` slots for its ``T_p`` tiles, stored as ``(sr, sc, capacity,
r, c)`` with the bits as ``(sr, sc, bytes)``. Counts for more axes, ``(s_1, ...,
s_k)`` for the last ``k``, also split the axes before the last two (a stack of
experts or layers sharded along its stacking axis), stored as ``(s_1, ..., s_k,
capacity, r, c)``. Indices are local to a part and every
gather, scatter and remap is ``vmap``-ed over the parts, so XLA keeps each part on
its device; ``init`` declares the parts' axes, and
:func:`magma_optax.sharding.state_shardings` shards the buffers like the parameter
(checked on 8 CPU devices with ``AxisType.Auto``: only scalars and a few packed mask
bytes are all-reduced, results equal one device's). A part's capacity is its own, so
the mask must be balanced over the parts: ``periodic_mask(..., block=(r, c),
shards=...)`` with the same ``shards`` keeps as many tiles in every part; a part with
more active tiles than its capacity is a capacity overflow naming it. Axes not
counted in ``shards`` are not split (a leaf sharded along them has parts that span
devices).
Unlike the other index-addressed storages it also runs on ``Explicit`` axes (results
equal one device's, checked on 8 CPU devices): the per-part work runs with the mesh
axes as ``Auto`` (``jax.sharding.auto_axes``) and its outputs are sharded like the
parts; a leaf whose sharding would put a part on several devices (sharded along an
axis that ``shards`` does not count, or into a number of pieces that does not
divide the parts) is a
``ValueError`` that says so.
"""

from __future__ import annotations

import collections
import functools
import math
import numbers
import zlib
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from magma_optax import _compat
from magma_optax import _engine
from magma_optax import _freeze
from magma_optax import _scoping
from magma_optax import _topk
from magma_optax import _trees
from magma_optax.kernels import api
from magma_optax.kernels import reference
from magma_optax.kernels import tiles

MODES = ("skip", "compact", "offload")
DEFAULT_DENSITY_THRESHOLD = 0.6
HOST_MEMORY_KIND = "pinned_host"

# jax.memory.Space (jax >= 0.10) names memory spaces inside jit; absent -> no offload.
_SPACE = getattr(getattr(jax, "memory", None), "Space", None)


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
      the entries held in the compact slots (in flat-index order; for flat
      compact storage paired with their int32 ``(capacity,)`` indices, sorted,
      ``size`` in empty slots), or for N:M
      compact storage one ``m``-bit integer per group (the parameter's shape with
      ``axis`` divided by ``m``); ``optax.MaskedNode`` for leaves with dense storage.
    inactive_steps: per scoped leaf (offload mode) an int32 scalar, consecutive
      steps with an all-inactive mask; ``optax.MaskedNode`` otherwise.
    cold: per scoped leaf (offload mode) a bool scalar, ``inactive_steps >=
      offload_after`` (read by :func:`offload_sparse_state`).
    errors: with ``on_error="record"``, an int32 vector of ``1 + 8`` entries,
      all zero until a step's parameter mask fails a check of compact storage
      (capacity overflow, a mask not made of whole tiles); then the first such
      failure (the check's id, its counts), kept until the state is initialised
      again (or this field zeroed) and raised by :func:`check_sparse_state`.
      ``optax.MaskedNode`` with ``on_error="raise"``.
  """

  base_state: Any
  stored_bits: Any
  inactive_steps: Any
  cold: Any
  errors: Any = optax.MaskedNode()


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


def _active_or_stored(
  flat: jax.Array, packed: jax.Array, capacity: int, also: Any = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`_active_indices` of ``flat`` -- or, where it has more active items than
  ``capacity`` or ``also`` holds, of the stored set ``packed`` (packed bits) --,
  the number of active items of ``flat``, and the set whose indices these are
  (``on_error="record"``: a mask that does not fit leaves the stored set)."""
  n_active = jnp.sum(flat, dtype=jnp.int32)
  stored = jnp.unpackbits(packed, count=flat.shape[0]).astype(jnp.bool_)
  flat = jnp.where((n_active > capacity) | also, stored, flat)
  return _active_indices(flat, capacity)[0], n_active, flat


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


def _reject_explicit(grad: Any, mask: Any, what: str, items: str) -> None:
  """Flat (index-addressed) storages cannot follow an ``Explicit`` sharding."""
  axes = _explicit_axes(grad) | _explicit_axes(mask)
  if axes:
    raise ValueError(
      f"sparse_state: {what} does not support leaves sharded over Explicit mesh"
      f" axes ({sorted(axes)}): it keeps one vector of the active {items} per"
      " leaf, addressed by global indices. Use mode='skip', or N:M compact"
      " storage (structure=(n, m)), which keeps the parameter's sharding."
    )


def _slot_indices(ctx: jax.Array, num: int) -> jax.Array:
  """Inverse of the sorted active indices ``ctx`` (fill ``num``): per item its slot
  in ``ctx``, ``len(ctx)`` for items that have none."""
  k = ctx.shape[0]
  return (
    jnp.full((num,), k, jnp.int32)
    .at[ctx]
    .set(jnp.arange(k, dtype=jnp.int32), mode="drop", indices_are_sorted=True)
  )


def _computed_once(u: jax.Array, any_stored: jax.Array) -> jax.Array:
  """``u``, a stored-shaped update, computed into a buffer of its own on XLA:CPU.

  A tile expansion (a gather per parameter) is otherwise fused with the base's
  update that computes ``u``, which is then evaluated once per *parameter*, every
  square root and division of Adam's update on 4 M entries instead of the stored
  1.2 M (d = 0.3): 1.47 ms against 1.00 ms for the expansion of 4 x 1M leaves
  (``benchmarks/RESULTS.md``). XLA:CPU does not fuse into a branch, and
  ``optimization_barrier`` does not stop the fusion there (XLA:CPU removes
  barriers before fusing). ``any_stored`` false (no stored entry: the expansion is
  all zeros whatever ``u`` holds) takes the other branch. Other platforms keep
  the fusion: there the extra arithmetic is cheaper than the buffer, and a branch
  may wait on its predicate.
  """

  def on_cpu(u, any_stored):
    return _compat.cond(any_stored, lambda u: u, jnp.zeros_like, u)

  return jax.lax.platform_dependent(u, any_stored, cpu=on_cpu, default=lambda u, _: u)


def _moved(ctx: jax.Array, x: jax.Array, old_ctx: jax.Array, num: int) -> jax.Array:
  """Stored entries ``x`` (slots of ``old_ctx``) moved to the slots of ``ctx``;
  items new in ``ctx`` start from zero. Both are sorted, filled with ``num``."""
  return _from_slots(x, _old_slots(ctx, old_ctx, num))


def _old_slots(ctx: jax.Array, old_ctx: jax.Array, num: int) -> jax.Array:
  """Per slot of ``ctx``, its item's slot in ``old_ctx`` (``len(old_ctx)``: none).

  Through the old slot of every item (a scatter of ``len(old_ctx)`` slots into
  ``num`` items, then a gather): with the gather of :func:`_from_slots`, 8x faster
  on XLA:CPU than a ``searchsorted`` of ``ctx`` in ``old_ctx`` (1.4 against 11 ms
  for 0.3 M slots of a 1 M leaf).
  """
  return _slot_indices(old_ctx, num).at[ctx].get(mode="fill", fill_value=len(old_ctx))


def _from_slots(x: jax.Array, slots: jax.Array) -> jax.Array:
  """``x[slots]``, zero where a slot is out of range (:func:`_old_slots`)."""
  return x.at[slots].get(mode="fill", fill_value=0)


# Leaves remapped together hold at most this many bytes of base state (or one
# leaf): their moved entries are temporaries of the refresh all at once, part of
# the step's temporaries whether it refreshes or not (which can grow by up to about
# this much). At 8 MiB, 3 of 4 1024x1024 leaves (2.5 MB of Adam moments each)
# were grouped, and the tile step's temporaries grew from 9.5 to 12.6 MB; at 2 MiB
# none of the trees measured grew, and a 72-leaf transformer kept most of the
# grouping's gain (1917 buffers, against 1735 at 8 MiB and 2745 alone).
_REMAP_BYTES = 2**21


def _capacity(size: int, density: float | None, structure) -> int:
  if structure is not None:
    return size * structure[0] // structure[1]
  return min(size, max(1, math.ceil(density * size)))


class _Stacked(NamedTuple):
  """What ``_Tiles.prepare_group`` found for a stack of leaves, stacked: their
  slots' tiles ``ctx``, their old ``bits`` and whether their sets ``changed``.
  A loop that refreshes some of them takes the stacks and picks its leaves inside
  (each leaf's slice taken outside would be a computation of every step)."""

  ctx: jax.Array
  bits: jax.Array
  changed: jax.Array


class _Check(NamedTuple):
  """A step's error condition: ``ValueError(describe(*values))`` if ``bad``."""

  bad: jax.Array
  describe: Any  # (*int) -> str
  values: tuple[jax.Array, ...]


def _check_capacity(active: jax.Array, limit: int, describe) -> _Check:
  """The check that ``active <= limit`` (raised by :func:`_raise_any`)."""
  return _Check(active > limit, describe, (active,))


ON_ERROR = ("raise", "record")
# A recorded failure: [check id, up to _ERROR_VALUES counts].
_ERROR_VALUES = 8
# The checks of recording steps traced in this process, by id: (message, counts).
_RECORDED_CHECKS: dict[int, Any] = {}


def _check_id(check: _Check) -> int:
  """A nonzero int32 id of ``check``'s message, the same in every process: a CRC
  of its text at two sample counts, which holds everything static it says (the
  leaf, its size, the capacity and how it was set). The step compiles it as a
  constant, so it must not depend on the process (the persistent compilation
  cache and several processes compiling one program)."""
  n = len(check.values)
  text = "\n".join(check.describe(*[k] * n) for k in (0, 1))
  return zlib.crc32(text.encode()) % (2**31 - 1) + 1


def _record(checks: list[_Check], errors: jax.Array) -> jax.Array:
  """The state's ``errors`` after a step: the first failing check of this step
  (its id in :data:`_RECORDED_CHECKS` and its counts) if none was recorded before,
  else the recorded one (the first failure is kept)."""
  if not checks:
    return errors
  rows, ids = [], []
  for c in checks:
    if len(c.values) > _ERROR_VALUES:  # the storages' checks have at most 2 + ndim
      raise ValueError(f"a check with {len(c.values)} counts cannot be recorded.")
    ids.append(_check_id(c))
    _RECORDED_CHECKS[ids[-1]] = (c.describe, len(c.values))
    values = [jnp.asarray(v, jnp.int32) for v in c.values]
    rows.append(
      jnp.stack(values + [jnp.zeros([], jnp.int32)] * (_ERROR_VALUES - len(values)))
    )
  bads = jnp.stack([jnp.asarray(c.bad) for c in checks])
  first = jnp.argmax(bads)
  now = jnp.concatenate(
    [jnp.asarray(ids, jnp.int32)[first][None], jnp.stack(rows)[first]]
  )
  keep = (errors[0] != 0) | ~jnp.any(bads)
  return jnp.where(keep, errors, now)


def check_sparse_state(opt_state: Any) -> None:
  """Raises the failure that a ``sparse_state(..., on_error="record")`` step recorded.

  With ``on_error="record"``, a step whose parameter mask fails a check of compact
  storage (more active entries, groups or tiles than the capacity, or a mask not
  made of whole tiles) raises nothing: a failing leaf keeps its stored entries or
  tiles (its mask is replaced by them; its stored moments take the step there),
  gets a zero update, and the first failure is recorded in
  :attr:`SparseState.errors`. This reads those records (36 bytes per
  :class:`SparseState`, a transfer that waits for the step that wrote them) and
  raises the ``ValueError`` that ``on_error="raise"`` would have raised. Call it
  where the training loop already reads values from the device (its logging
  steps). With several :class:`SparseState` values holding records, the first in
  tree order is raised (each keeps its own first failure).

  Args:
    opt_state: an optimizer state, or any pytree holding :class:`SparseState`
      values (inside ``optax.chain``, ``periodic_mask``, ``optax.MultiSteps``,
      ``inject_hyperparams``, a batch of states from ``jax.vmap``).

  Raises:
    ValueError: the recorded failure's message: the leaf, the counts, the
      capacity and the fix. The message is known once this process has traced a
      step of the same transformation (a state restored from a checkpoint,
      before any step: its counts only). Also a ``ValueError`` when
      ``opt_state`` holds no :class:`SparseState` at all (a checkpoint restored
      without its target structure comes back as dicts: restore it with one).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = magma.sparse_state(optax.adam(1e-3), mode="compact", density=0.25,
    ...                         on_error="record")
    >>> params = {"w": jnp.ones((4, 4))}
    >>> state = tx.init(params)
    >>> step = jax.jit(lambda g, s, m: tx.update(g, s, params, param_mask=m))
    >>> too_dense = {"w": jnp.ones((4, 4), bool)}  # 16 active, capacity 4
    >>> updates, state = step(params, state, too_dense)
    >>> float(jnp.abs(updates["w"]).max())  # no update for the failing leaf
    0.0
    >>> magma.check_sparse_state(state)
    Traceback (most recent call last):
    ...
    ValueError: sparse_state compact capacity overflow: leaf ['w'] (size 16) ...
  """
  is_state = lambda x: isinstance(x, SparseState)  # noqa: E731
  states = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
  if not states:
    raise ValueError(
      "check_sparse_state: opt_state holds no SparseState (the state of"
      " sparse_state / sparse_adam); got a"
      f" {type(opt_state).__name__}. A checkpoint restored without its target"
      " structure comes back as dicts: restore it with the state of tx.init as"
      " the target."
    )
  for st in states:
    if _trees.is_masked(st.errors):
      continue
    records = np.asarray(st.errors).reshape(-1, 1 + _ERROR_VALUES)
    for check, *values in records.tolist():
      if not check:
        continue
      known = _RECORDED_CHECKS.get(check)
      if known is None:
        raise ValueError(
          "sparse_state recorded a failed check of its parameter mask (check"
          f" {check}, counts {values}): a capacity overflow or a mask not made of"
          " whole tiles. Its message is known once this process has traced a"
          " step of the same transformation: run one step, then call this again."
        )
      describe, n = known
      raise ValueError(describe(*values[:n]))


def _raise_any(checks: list[_Check]) -> jax.Array | None:
  """Raises ``ValueError`` with the message of the first failing check.

  With a concrete mask (``update`` called outside ``jax.jit``) the error is raised
  here, before the step computes anything. Under ``jax.jit`` the counts are only
  known when the step runs, and a compiled step can only fail through the runtime:
  a host callback raises the same ``ValueError``, which JAX reports as a
  ``JaxRuntimeError`` or a ``ValueError`` (with this message on the last line; see
  the module docstring); the step returns nothing, so no overflowing state reaches
  the caller.

  Returns ``None``, or under ``jax.jit`` an int32 zero that the caller must fold
  into the step's outputs: the callback is a ``jax.pure_callback`` inside one
  ``lax.cond`` for all leaves, kept alive by that data dependency; under a
  ``jax.set_mesh`` context of several devices, inside a ``shard_map`` over it, so
  that every device raises (a callback of one device would leave the others
  waiting at the next collective). (A
  ``jax.debug.callback`` is an effect: JAX then waits for every step before
  dispatching the next, which cost tile storage ~0.5x of an Adam step on XLA:CPU.)
  """
  if not checks:
    return None

  def fail(bads, *values):
    at = 0
    for check, bad in zip(checks, bads, strict=True):
      n = len(check.values)
      if bad:
        raise ValueError(check.describe(*(int(v) for v in values[at : at + n])))
      at += n
    # Reached only under jax.vmap, where the cond runs both branches (one call
    # per batch element): nothing failed in this one.
    return np.zeros((), np.int32)

  bads = jnp.stack([jnp.asarray(c.bad) for c in checks])
  values = [v for c in checks for v in c.values]
  if any(_compat.is_tracer(x) for x in (bads, *values)):
    out = jax.ShapeDtypeStruct((), jnp.int32)

    def check(bads, *values):
      return _compat.cond(
        jnp.any(bads),
        lambda: jax.pure_callback(fail, out, bads, *values, vmap_method="sequential"),
        lambda: jnp.zeros([], jnp.int32),
      )

    mesh = jax.sharding.get_abstract_mesh()
    manual = jax.sharding.AxisType.Manual
    if not mesh.empty and mesh.size > 1 and manual not in mesh.axis_types:
      # Under a mesh a callback runs on one device, and the others wait for it at
      # the step's next collective: XLA:CPU aborts the process after 40 s. In a
      # shard_map over the whole mesh every device runs the check, and all of
      # them fail together (a JaxRuntimeError, as on one device).
      check = jax.shard_map(
        check, mesh=mesh, in_specs=jax.sharding.PartitionSpec(),
        out_specs=jax.sharding.PartitionSpec(), check_vma=False,
      )  # fmt: skip
    values = [jnp.asarray(v) for v in values]
    return check(bads, *values)
  if bool(jnp.any(bads)):
    fail([bool(b) for b in bads], *values)
  return None


class _Storage:
  """How one leaf's base state is kept: the interface, and the unscoped case.

  :func:`sparse_state` picks one storage per leaf from the leaf's shape and the
  factory's arguments (the same at ``init`` and ``update``). ``init`` asks it for
  the stored leaf and its bookkeeping bits; ``update`` calls, per leaf and in this
  order:

  1. ``prepare(mask, bits, grad, whole, record)``: the step's view of the mask
     (``ctx``: compact indices or N:M slots), the new bits, whether the stored
     set changed (``None``: never, for dense storage), and the leaf's error check
     (capacity overflow, untiled mask; ``None``: none); all leaves' checks are
     raised together, before the step computes the update. ``whole``: the mask
     is promised to be made of whole tiles; ``record``: a failing mask leaves
     the stored set;
  2. only when the leaf's stored set changed, in a loop of zero or one step per
     leaf (it rewrites the leaf's state in place; a ``lax.cond`` would copy it on
     every step): ``rebuild(mask)`` for storages that cache their ``ctx``
     (``rebuilds``; it returns the new ``ctx`` and the count that
     ``rebuilt_check`` checks against the capacity; until then ``prepare``
     returned the cached one), then ``remap(ctx, x, bits)`` on each of the leaf's
     base-state entries: moves it to the new slots (``remap_fresh``: regrown
     entries start from the base's initial state);
  3. ``load(x, active)``: brings a host-resident entry to the device (offload);
  4. ``gather(ctx, x)``: leaf-shaped gradient or parameter -> stored shape;
  5. the base's update on the stored tree, with ``stored_mask(ctx, mask)``;
  6. ``freeze(ctx, mask, new, old)``: keeps frozen entries of the new base state;
  7. ``unload(new, orig, active)``: puts a host-resident entry back (offload);
  8. ``scatter(ctx, mask, u)``: stored-shaped update -> leaf-shaped, zero where
     inactive.

  Leaves whose storages have one ``batch_key`` run steps 1 and 8 together, by
  the class's ``prepare_group`` and ``scatter_group``; leaves of one
  ``remap_key`` (tile storage whose base states have one shape) run step 2 in one
  loop, by ``remap_group``.

  This base class is dense storage for a leaf outside ``where``: it takes no mask
  and every method passes its input through.
  """

  scoped = False  # the leaf takes a mask
  needs_mask = False  # the step cannot run without one
  rebuilds = False  # ctx cached in the bits, rebuilt only when the mask changed
  tracks_cold = False  # counts all-inactive steps (offload)
  compact = False  # stores fewer entries: their initial state is init's for zeros

  def __init__(self, shape: tuple[int, ...], name: str):
    self.shape = tuple(shape)
    self.size = math.prod(self.shape)
    self.name = name  # the leaf's key path, for error messages

  @property
  def stored_shape(self) -> tuple[int, ...]:
    return self.shape

  def init_leaf(self, x: jax.Array) -> jax.Array:
    return x

  def init_bits(self) -> Any:
    return optax.MaskedNode()

  def place(self, stored: jax.Array, x: jax.Array) -> jax.Array:
    """``stored`` (a stored-shaped state entry or the bits) sharded as the step
    gives it, where the parameter ``x`` is sharded over ``Explicit`` mesh axes:
    eager ``jnp.zeros`` are replicated, and a jitted step's state must keep its
    types. Storages whose stored arrays are the parameter's own pass them."""
    del x
    return stored

  def prepare(self, mask, bits, grad, whole=False, record=False):
    del mask, grad, record, whole
    return None, bits, None, None

  def batch_key(self) -> Any:
    """Leaves whose storages return the same key (``None``: none) are prepared
    together, by ``prepare_group`` of the first one's class."""
    return None

  def bound_problem(self, bound: _topk.MaskBound) -> str | None:
    """At ``init``: why the masks that ``bound`` describes (the densest one a
    wrapper such as ``periodic_mask`` will pass) certainly fail this storage's
    checks, or ``None`` (also where that depends on the values)."""
    del bound
    return None

  def bound_suffices(self, bound: _topk.MaskBound) -> bool:
    """Whether every mask within ``bound`` passes this storage's checks in the
    step (a leaf whose wrapper promises that needs no check reported through the
    host: :func:`magma_optax._topk.mask_promise`)."""
    del bound
    return False

  def remap(self, ctx, x, bits):
    del ctx, bits
    return x

  def remap_key(self, ctx, bits, entries, fresh):
    """A key under which leaves are remapped together (by the class's
    ``remap_group``), for a leaf of this ``ctx`` and ``bits``, base-state
    ``entries`` and their ``fresh`` values; ``None``: the leaf is remapped alone.
    Inside ``jax.shard_map`` the key holds the axes they vary along: stacked with
    one that varies along more, a leaf's entries would come back varying too."""
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


class _Skip(_Storage):
  """Dense storage, masked: inactive entries keep their state, their update is 0."""

  scoped = True

  def freeze(self, ctx, mask, new, old):
    del ctx
    return new if mask is None else _freeze.kept(mask, new, old)

  def scatter(self, ctx, mask, u):
    del ctx
    return u if mask is None else jnp.where(mask, u, jnp.zeros([], u.dtype))


class _Offload(_Skip):
  """Skip storage whose entries may live in host memory while the leaf is cold.

  A host-resident entry is copied to the device, updated and copied back only when
  the leaf's mask has an active entry (a ``lax.cond``); otherwise it stays put.
  """

  tracks_cold = True

  def load(self, x, active):
    if not _on_host(x):
      return x
    return _compat.cond(
      True if active is None else active,
      lambda: jax.device_put(x, _SPACE.Device),
      lambda: jnp.zeros(x.shape, x.dtype),
    )

  def unload(self, new, orig, active):
    if not _on_host(orig):
      return new
    return _compat.cond(
      True if active is None else active,
      lambda: jax.device_put(new, _SPACE.Host),
      lambda: orig,
    )


class _Compact(_Storage):
  """Flat compact storage: a ``(capacity,)`` vector of the active entries.

  Slot ``j`` holds the ``j``-th active entry in flat-index order; the stored set
  is kept as packed bits (1 bit per entry) and, with ``cache_index``, as the
  slots' int32 indices too (the step's index, rebuilt only when the mask changes).
  """

  scoped = True
  needs_mask = True
  compact = True

  def __init__(self, shape, name, capacity: int, limit: str, cache_index=True):
    super().__init__(shape, name)
    self.capacity = capacity
    self.limit = limit  # how the capacity was set, for the overflow message
    self.cache_index = cache_index

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

  def _overflow(self, active: int, at_least: bool = False) -> str:
    return (
      f"sparse_state compact capacity overflow: leaf {self.name} (size"
      f" {self.size}) has {_at_least(at_least)}{active} active entries in its"
      " parameter mask, more than"
      f" its compact storage holds: capacity {self.limit} = {self.capacity}."
      f" Raise `density` to at least {active / self.size:.4g} (the densest mask"
      " of the run: under a sparsity ramp, the early masks), or use mode='skip'."
    )

  def bound_problem(self, bound):
    if bound.entries is not None and bound.entries > self.capacity:
      return self._overflow(bound.entries, not bound.exact)
    return None

  def bound_suffices(self, bound):
    return bound.exact and bound.entries is not None and bound.entries <= self.capacity

  def prepare(self, mask, bits, grad, whole=False, record=False):
    del whole
    _reject_explicit(grad, mask, "unstructured compact storage", "entries")
    flat = mask.reshape(-1)
    if not self.cache_index:
      if record:  # a mask that does not fit: the stored entries instead
        idx, n_active, flat = _active_or_stored(flat, bits, self.capacity)
      else:
        idx, n_active = _active_indices(flat, self.capacity)
      check = _check_capacity(n_active, self.capacity, self._overflow)
      new_bits = jnp.packbits(flat)
      return idx, new_bits, jnp.any(new_bits != bits), check
    new_bits = jnp.packbits(flat)
    # The index build reads every entry (a serial scatter on XLA:CPU, ~5x an Adam
    # step per leaf): only when the mask changed (`rebuild`). Until then the stored
    # indices, whose count was checked when they were built.
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
      return _active_indices(mask.reshape(-1), self.capacity)
    return _active_or_stored(mask.reshape(-1), stored, self.capacity)[:2]

  def rebuilt_check(self, n_active):
    return _check_capacity(n_active, self.capacity, self._overflow)

  def remap(self, ctx, x, bits):
    if self.cache_index:
      return _moved(ctx, x, bits[1], self.size)
    old_mask = jnp.unpackbits(bits, count=self.size).astype(jnp.bool_)
    old_idx, _ = _active_indices(old_mask, self.capacity)
    return _moved(ctx, x, old_idx, self.size)

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


class _Tiles(_Storage):
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

  scoped = True
  needs_mask = True
  compact = True

  def __init__(self, shape, name, block: tuple[int, int], capacity: int, limit):
    super().__init__(shape, name)
    self.block = block
    self.view = tiles.tile_view(self.shape, block)
    self.num_tiles = self.view[0] * self.view[2]
    self.capacity = capacity
    self.limit = limit  # how the capacity was set, for the overflow message
    self.unit = f"leaf {name}"  # what holds the tiles, for the messages
    self.hint = ""  # appended to the overflow message

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
    return (
      f"sparse_state compact capacity overflow: {unit or self.unit} ({self.num_tiles}"
      f" tiles of {self.block[0]}x{self.block[1]}) has {_at_least(at_least)}{active}"
      " active tiles in its parameter mask, more than its compact storage holds:"
      f" capacity {self.limit} = {self.capacity}. Raise `density` to at least"
      f" {active / self.num_tiles:.4g} (the densest mask of the run: under a"
      f" sparsity ramp, the early masks), or use mode='skip'.{self.hint}"
    )

  def _problem(self, differ: int, active: int, unit: str | None = None) -> str:
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
    (:class:`_ShardedTiles`); the bound's tiles then count per part if its parts
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
    return (_Tiles, self.num_tiles, self.capacity)

  @staticmethod
  def prepare_group(storages, masks, bits, grads, whole, record):
    """``prepare`` of leaves of one ``batch_key``: their tile sets found over one
    stack of their tiles. Per leaf that is some 20 computations on a few hundred
    tiles, each a launch of its own on XLA:CPU (1.4 us on jax 0.10, 3.3 us on
    0.12): on a 72-leaf transformer, more than the step's bytes."""
    flat, differ = [], []
    for s, m, g, w in zip(storages, masks, grads, whole, strict=True):
      _reject_explicit(g, m, "compact tile storage", "tiles")
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
    stacked = _Stacked(idx, old_bits, changed)
    return [
      (
        idx[k],
        new_bits[k],
        changed[k],
        _Check(bad[k], s._problem, (differ[k], n_active[k])),
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
    # of uint8 xors: on XLA:CPU 2.5x faster than any() of a boolean comparison,
    # which it materialises before reducing.
    differ = jnp.max(m4 ^ m4[:, :1, :, :1], initial=0) > 0
    return m4[:, 0, :, 0].reshape(-1) > 0, differ

  def tile_set(self, flat, bits, fallback=None):
    """The sorted indices of the active tiles ``flat``, the new bits, whether the
    stored set changed, and the active count. Where ``fallback`` holds, the stored
    tiles instead, as where ``flat`` has more than the capacity (and the count of
    ``flat``)."""
    if fallback is None:
      idx, n_active = _active_indices(flat, self.capacity)
    else:
      idx, n_active, flat = _active_or_stored(flat, bits, self.capacity, fallback)
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
      frozenset().union(*map(_compat.varying, arrays)),
    )

  def old_slots(self, ctx, bits):
    """Per slot of ``ctx``, its tile's slot in the stored set ``bits`` were
    (``capacity``: a tile new to the set)."""
    old_tiles = jnp.unpackbits(bits, count=self.num_tiles).astype(jnp.bool_)
    old_idx, _ = _active_indices(old_tiles, self.capacity)
    return _old_slots(ctx, old_idx, self.num_tiles)

  def remap(self, ctx, x, bits):
    return _from_slots(x, self.old_slots(ctx, bits))

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
        jnp.where(kept, _from_slots(x, slots[k]), f.astype(x.dtype))
        for x, f in zip(xs, fs, strict=True)
      ])  # fmt: skip
    return out

  def gather(self, ctx, x):
    return tiles.gather_tiles(x.reshape(self.view), ctx)

  def stored_mask(self, ctx, mask):
    del mask
    return jnp.broadcast_to((ctx < self.num_tiles)[:, None, None], self.stored_shape)

  def scatter(self, ctx, mask, u, slot=None, any_stored=None):
    """``slot``: ``_slot_indices(ctx, num_tiles)``, where already known;
    ``any_stored``: whether this leaf or others stored anything (the branch that
    computes ``u`` then runs; with nothing stored, the expansion is zero anyway)."""
    del mask
    if any_stored is None:
      any_stored = ctx[0] < self.num_tiles
    return self.expand(ctx, _computed_once(u, any_stored), slot)

  @staticmethod
  def scatter_group(storages, ctx, masks, us):
    """``scatter`` of leaves of one ``batch_key``, their slot maps found over
    one stack (see ``prepare_group``)."""
    num = storages[0].num_tiles
    stacked = jnp.stack(ctx)
    slots = jax.vmap(lambda c: _slot_indices(c, num))(stacked)
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
      slot = _slot_indices(ctx, self.num_tiles)
    slot = slot.reshape(rows, cols)
    # Slot `capacity` (an inactive tile) is out of range: the gather fills zeros.
    full = jnp.take(u, slot, axis=0, mode="fill", fill_value=0)  # (rows, cols, r, c)
    return jnp.swapaxes(full, 1, 2).reshape(self.shape)


class _ShardedTiles(_Storage):
  """Compact tile storage per shard: ``(s_1, ..., s_k, capacity, r, c)``.

  The leaf's last ``k >= 2`` axes are split into ``s_1 x ... x s_k`` equal parts
  (:func:`magma_optax._topk.split_parts`: a device's shard of a parameter sharded
  ``s_i`` ways along each of them; ``(sr, sc)`` for the last two), and each part is
  a :class:`_Tiles` of its own (``part``) with ``capacity`` slots: every method is
  the part's, ``vmap``-ed over the parts. So the indices are local to a part and
  the gathers and scatters are batched over the parts: where the parameter is
  sharded that way, every device gathers, updates and scatters its own tiles --
  the state is sharded like the parameter and no tile crosses devices.
  """

  scoped = True
  needs_mask = True
  compact = True

  def __init__(self, shape, name, block, parts, capacity: int, limit):
    super().__init__(shape, name)
    k = len(parts)
    split = self.shape[len(self.shape) - k :]
    part_shape = (
      *self.shape[: len(self.shape) - k],
      *(n // p for n, p in zip(split, parts, strict=True)),
    )
    self.part = _Tiles(part_shape, name, block, capacity, limit)
    self.part.hint = (
      f" A mask with the same number of tiles in every part comes from"
      f" periodic_mask(..., block={block}, shards={tuple(parts)})."
    )
    self.parts = tuple(parts)
    self.block = block
    self.capacity = capacity

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
    spec = _compat.explicit_spec(x)
    if spec is None:
      return stored
    self._check_explicit(x)
    return _compat.put_like(stored, x, spec[len(spec) - len(self.parts) :])

  def param_axes(self, ndim: int) -> tuple[int | None, ...]:
    """The parameter axes that the stored arrays' leading axes index (the parts),
    for :func:`magma_optax.sharding.state_shardings`."""
    return tuple(range(ndim - len(self.parts), ndim))

  def _check_explicit(self, x):
    """Under ``Explicit`` mesh axes every part must lie on one device."""
    _topk.check_parts_on_devices(x, self.parts, "sparse_state", self.name)

  def per_part(self, fn, *args, in_axes=0, order=None):
    """``vmap(...(vmap(fn)))(*args)`` over the parts (the leading ``k`` axes);
    under ``Explicit`` mesh axes with them as ``Auto`` inside
    (:func:`magma_optax._compat.like_auto`), the outputs sharded like the parts
    of ``args[0]``. ``order``: ``fn`` takes ``args`` in that order."""
    if order is not None:
      inner = fn
      fn = lambda *a: inner(*(a[i] for i in order))  # noqa: E731
    batched = fn
    for _ in self.parts:
      batched = jax.vmap(batched, in_axes)
    return _compat.like_auto(batched, args[0], *args, axes=len(self.parts))

  def prepare(self, mask, bits, grad, whole=False, record=False):
    self._check_explicit(grad)
    self._check_explicit(mask)
    flat, differ = self.per_part(
      functools.partial(self.part.tiles_of, whole=whole),
      _topk.split_parts(mask, self.parts),
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

    differ, n_active, *where = _compat.like_auto(
      worst, differ, differ, n_active, axes=0
    )
    check = _Check(
      differ | (n_active > self.capacity), self._problem, (differ, n_active, *where)
    )
    if record:
      idx, new_bits, changed, _ = self.per_part(
        self.part.tile_set, flat, bits, check.bad, in_axes=(0, 0, None)
      )
    return idx, new_bits, jnp.any(changed), check

  def _problem(self, differ: int, active: int, *where: int) -> str:
    sizes = "x".join(map(str, self.parts))
    unit = f"part {tuple(where)} of the {sizes} shard parts of leaf {self.name}"
    return self.part._problem(differ, active, unit)

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
    return self.per_part(self.part.gather, ctx, _topk.split_parts(x, self.parts))

  def stored_mask(self, ctx, mask):
    del mask
    return self.per_part(lambda c: self.part.stored_mask(c, None), ctx)

  def scatter(self, ctx, mask, u):
    del mask
    # Once for all parts (under the parts' vmap a branch would be a select).
    u = _computed_once(u, jnp.any(ctx[..., 0] < self.part.num_tiles))
    part = lambda c, v: self.part.expand(c, v)  # noqa: E731
    scattered = self.per_part(part, ctx, u)
    return _topk.join_parts(scattered, len(self.parts))


class _HostTiles:
  """Tile storage whose buffers may live in host memory while the leaf is cold (no
  active tile for ``offload_after`` steps), as :class:`_Offload` (a mixin over
  :class:`_Tiles` and :class:`_ShardedTiles`).

  Inactive tiles hold no moments in compact storage (regrown tiles start from
  zero), so the unit that can go to host memory is a leaf's whole tile buffer."""

  tracks_cold = True
  load = _Offload.load
  unload = _Offload.unload

  def remap_key(self, ctx, bits, entries, fresh):
    del ctx, bits, entries, fresh
    return None  # alone: each buffer may be on the host

  def remap_fresh(self, ctx, x, bits, fresh, kept):
    # Runs before `load` (and only when some stored set changed): a host-resident
    # buffer is remapped on the device and put back.
    if not _on_host(x):
      return super().remap_fresh(ctx, x, bits, fresh, kept)
    moved = super().remap_fresh(
      ctx, jax.device_put(x, _SPACE.Device), bits, fresh, kept
    )
    return jax.device_put(moved, _SPACE.Host)


class _OffloadTiles(_HostTiles, _Tiles):
  """:class:`_Tiles` with offload (:class:`_HostTiles`)."""


class _OffloadShardedTiles(_HostTiles, _ShardedTiles):
  """:class:`_ShardedTiles` with offload (:class:`_HostTiles`)."""


class _Grouped(_Storage):
  """N:M compact storage (:class:`_Groups`): ``n`` slots per group of ``m``."""

  scoped = True
  needs_mask = True
  compact = True

  def __init__(self, shape, name, groups: _Groups):
    super().__init__(shape, name)
    self.groups = groups

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
    return _compat.put_like(stored, x)

  def _check_explicit(self, x):
    """Under ``Explicit`` mesh axes every device must hold whole groups."""
    spec = _compat.explicit_spec(x)
    if spec is None:
      return
    g = self.groups
    pieces = _compat.mesh_axis_size(jax.typeof(x).sharding.mesh, spec[g.axis])
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

  def _overflow(self, active: int, at_least: bool = False) -> str:
    g = self.groups
    return (
      f"sparse_state compact capacity overflow: a group of {g.m} entries has"
      f" {_at_least(at_least)}{active} active but structure=({g.n}, {g.m}) stores"
      f" {g.n} (leaf {self.name}, groups along axis {g.axis}); the mask is not N:M"
      " along `axis` (give periodic_mask the same structure and axis, or use"
      " mode='skip')."
    )

  def bound_problem(self, bound):
    g = self.groups
    if bound.all_active and g.n < g.m:
      return self._overflow(g.m)
    nm = bound.structure
    if nm is not None and bound.axis == g.axis and g.m % nm[1] == 0:
      per_group = nm[0] * (g.m // nm[1])  # exactly, in every group of m
      if per_group > g.n:
        return self._overflow(per_group)
    groups = self.size // g.m
    if bound.entries is not None and bound.entries > groups * g.n:
      # More than all the slots: the fullest group has at least the mean.
      return self._overflow(-(-bound.entries // groups), at_least=True)
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
    check = _check_capacity(jnp.max(g.per_group(mask)), g.n, self._overflow)
    if record:  # a mask that does not fit: the stored entries instead
      mask = jnp.where(check.bad, g.unpack(bits), mask)
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
    # evaluated m * n / n = m times per group entry stored.
    u = _computed_once(u, jnp.any(ctx < self.groups.n))
    return self.groups.expand(u, ctx)


def _first(x: jax.Array) -> jax.Array:
  """The value of a uniform array as a scalar (0 for an empty one); over Explicit
  mesh axes, where a slice of a sharded axis is not allowed, its maximum."""
  if not x.size:
    return jnp.zeros((), x.dtype)
  if _compat.explicit_spec(x) is not None:
    return jnp.max(x)
  return x.reshape(-1)[0]


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
    mode: ``"skip"``, ``"compact"`` or ``"offload"`` (see the module docstring).
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
      (offload mode).
    where: which leaves get sparse storage (``None``: all floating leaves); others
      are updated densely by ``base``.
    cache_index: unstructured compact storage (``density`` without ``structure``
      or ``block``) keeps the int32 indices of its stored entries (4 bytes per
      slot) so that their index is rebuilt only when the mask changes (default).
      ``False`` stores 1 bit per entry only and rebuilds the index every step:
      the least memory (the stored entries' moments plus ``size / 8`` bytes),
      about twice the step time on XLA:CPU (``benchmarks/RESULTS.md``).
    on_error: how a step reports a parameter mask that compact storage cannot
      hold (a capacity overflow, or a mask not made of whole tiles).
      ``"raise"`` (default): a ``ValueError`` -- under ``jax.jit`` through a host
      callback, so JAX reports it as described in the module docstring and the
      step returns nothing; the callback's presence alone makes XLA:CPU run
      every step synchronously (the call waits for the step to finish), which
      cost ~0.2x of an Adam step on the 4 M-parameter tile benchmark.
      Inside :func:`periodic_mask` with a constant Python number for
      ``sparsity`` ranked per leaf, or N:M ``structure``, its masks cannot
      fail the checks (it promises that of them), and ``"raise"`` compiles no
      callback for them either (module docstring).
      ``"record"``: no callback; a leaf whose mask fails keeps its stored
      entries or tiles (its mask is replaced by them, and its stored moments
      take the step there) and gets a zero update; other leaves take their step.
      The first failure is recorded in
      :attr:`SparseState.errors` for :func:`check_sparse_state` to raise, with
      the same message, where the loop reads values anyway (as
      ``optax.apply_if_finite`` skips and counts). Nothing is raised by the
      step itself, jitted or not. Use it to ``jax.export`` a step: JAX cannot
      serialize ``"raise"``'s host callback, nor lower it for several platforms.

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
  storages_of = _engine.from_arguments(_planner, locals())
  return _transformation(
    base, storages_of, offload_after, _base_step(base), on_error=on_error
  )


def sparse_adam(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
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
  implementation: str | Sequence[str] | None = None,
  interpret: bool | str = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Adam with sparse state, its step fused per storage.

  The same transformation as ``sparse_state(optax.adam(learning_rate, b1, b2, eps,
  eps_root=eps_root), mode=mode, ...)`` with the same storage arguments -- the same
  state (a checkpoint of one restores into the other), masks, errors and updates
  -- whose Adam step is written for each storage instead of running ``optax.adam``
  on the stored tree:

  * **tiles** (``block=(r, c)``): one step per leaf reads the gradient's active
    tiles and updates their compact moments in one pass
    (:func:`magma_optax.kernels.tiles.tile_adam`); with
    ``implementation="pallas"`` a kernel whose grid runs over the active tiles'
    slots only, so its cost follows ``density``;
  * **skip** (dense storage, element masks): the frozen moments are merged first,
    ``m <- where(M, m', m)``, and the update is computed from the merged moments
    (equal where ``M`` holds, masked to 0 elsewhere), so XLA updates them in
    place (what :func:`sparse_state` does for a generic base by tracing it, see
    :mod:`magma_optax._freeze`);
  * other storages (flat and N:M compact, dense leaves): Adam's element-wise step
    on the stored entries, in XLA.

  Everything is computed in float32 (``optax.adam`` on bfloat16 moments computes
  in bfloat16): on float32 parameters the moments equal those of
  ``sparse_state(optax.adam(...))`` and the updates agree to float32 rounding.

  Args:
    learning_rate: a float or an ``optax`` schedule, as in ``optax.adam``.
    b1, b2, eps, eps_root: Adam's constants (static floats: with
      ``optax.inject_hyperparams``, pass
      ``static_args=magma.sparse_adam.static_args`` -- these and the storage's
      numbers -- to inject the learning rate).
    mode: ``"skip"``, ``"compact"`` or ``"offload"``, as in :func:`sparse_state`.
    density, structure, axis, block, shards: the storage, as in
      :func:`sparse_state`.
    density_threshold, offload_after, where, cache_index, on_error: as in
      :func:`sparse_state`.
    implementation: for tile storage, ``"xla"`` (the default), ``"pallas"``, or a
      sequence to try in order (see :func:`magma_optax.kernels.masked_adam`). An
      explicit request that cannot run here raises ``ValueError`` saying why
      (here, or at the first step for a dtype the kernel cannot tile).
    interpret: ``False``, or a Pallas interpreter (``True``, ``"tpu"``,
      ``"gpu"``) for tests on CPU.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a :class:`SparseState`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = magma.periodic_mask(
    ...     magma.sparse_adam(1e-3, mode="compact", density=0.5, block=(2, 2)),
    ...     sparsity=0.5, block=(2, 2), every=100)
    >>> params = {"w": jnp.arange(16.0).reshape(4, 4)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((4, 4))}, state, params)
    >>> state.inner_state.base_state[0].mu["w"].shape
    (2, 2, 2)
  """
  constants = []
  for name, value in (("b1", b1), ("b2", b2), ("eps", eps), ("eps_root", eps_root)):
    if isinstance(value, bool) or not isinstance(value, int | float):
      raise ValueError(
        f"sparse_adam: {name} must be a Python float (static: it is compiled into"
        f" the step); got {value!r}. With optax.inject_hyperparams, pass"
        f" static_args=('b1', 'b2', 'eps', 'eps_root')."
      )
    constants.append(float(value))
  constants = reference.AdamConstants(*constants)
  if not callable(learning_rate) and (
    isinstance(learning_rate, bool | str | list | tuple | dict)
    or learning_rate is None
    or jnp.ndim(learning_rate) != 0
    or not jnp.issubdtype(jnp.result_type(learning_rate), jnp.number)
  ):
    raise ValueError(
      "sparse_adam: learning_rate must be a real scalar or an optax schedule;"
      f" got {learning_rate!r}."
    )
  interpret = api.check_interpret(interpret)
  if block is None and implementation not in (None, "xla"):
    raise ValueError(
      f"implementation={implementation!r} chooses the kernel of tile storage"
      " (block=(r, c)); the other storages run in XLA."
    )
  storages_of = _engine.from_arguments(_planner, locals())
  # Fails fast (here, for float32 tiles) where the request cannot run at all; the
  # step checks again with the leaves' dtypes.
  tiles.resolve_implementation(
    implementation,
    block=block or (8, 128),
    dtypes=(jnp.float32,),
    interpret=interpret,
  )
  base = optax.adam(learning_rate, *constants[:3], eps_root=constants.eps_root)

  def step(storages, ctx, treedef, flat_g, flat_p, state, stored_masks, extra_args):
    del flat_p, extra_args
    adam, lr_state = state
    count = optax.safe_increment(adam.count)
    if callable(learning_rate):
      lr = learning_rate(lr_state.count)
      lr_state = lr_state._replace(count=optax.safe_increment(lr_state.count))
    else:
      lr = learning_rate
    hyper = reference.hyperparams(count, lr, 0.0, constants)
    mus = treedef.flatten_up_to(adam.mu)
    nus = treedef.flatten_up_to(adam.nu)
    new_mu, new_nu, updates = [], [], []
    leaves = zip(storages, ctx, stored_masks, flat_g, mus, nus, strict=True)
    for s, c, mask, g, m, v in leaves:
      if isinstance(s, _Tiles | _ShardedTiles):

        def tile_step(g, m, v, c, count, lr):
          return tiles.tile_adam(
            g, m, v, c, count=count, learning_rate=lr, b1=constants.b1,
            b2=constants.b2, eps=constants.eps, eps_root=constants.eps_root,
            implementation=implementation, interpret=interpret,
          )  # fmt: skip

        if isinstance(s, _ShardedTiles):  # one step per part, batched over them
          g = _topk.split_parts(g, s.parts)
          axes = (0, 0, 0, 0, None, None)
          out = s.per_part(tile_step, g, m, v, c, count, lr, in_axes=axes)
        else:
          out = tile_step(g, m, v, c, count, lr)
      else:
        g = s.gather(c, g)
        frozen = isinstance(s, _Skip) and not _trees.is_masked(mask)
        # With a mask, reference.moments keeps the frozen entries (merged first).
        m32, v32 = reference.moments(g, m, v, hyper, mask if frozen else None)
        if frozen:
          # The update computed from the merged moments as stored (the barrier):
          # XLA then writes them in place and the update's loop reads them,
          # instead of recomputing them from the old moments (which it would
          # have to copy, since they are overwritten).
          m32, v32 = jax.lax.optimization_barrier(
            (m32.astype(m.dtype), v32.astype(v.dtype))
          )
        u = reference.update(
          m32.astype(jnp.float32), v32.astype(jnp.float32), hyper, layout=None,
          dtype=g.dtype,
        )  # fmt: skip
        out = tiles.TileAdamOutput(m32.astype(m.dtype), v32.astype(v.dtype), u)
      new_mu.append(out.mu)
      new_nu.append(out.nu)
      updates.append(out.update)
    adam = adam._replace(
      count=count, mu=treedef.unflatten(new_mu), nu=treedef.unflatten(new_nu)
    )
    return updates, (adam, lr_state)

  # The step returns frozen moments already (merged, or compact).
  return _transformation(
    base, storages_of, offload_after, step, frozen=True, on_error=on_error
  )


# What optax.inject_hyperparams must leave static (numbers that shape the step).
sparse_adam.static_args = (
  "b1", "b2", "eps", "eps_root", "density", "density_threshold", "offload_after",
  "axis", "cache_index", "shards", "where", "interpret",
)  # fmt: skip


def _planner(
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
):
  """Checks the storage arguments of :func:`sparse_state` (and :func:`sparse_adam`)
  and returns ``storages_of(tree) -> (storages, treedef)``: one storage per leaf."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}; got {mode!r}.")
  if structure is not None:
    structure = _topk.validate_nm_structure(structure)
    if density is not None:
      raise ValueError("give density or structure, not both.")
  if density is not None and not (
    isinstance(density, numbers.Real)  # Python or numpy scalars
    and not isinstance(density, bool)
    and 0.0 < float(density) <= 1.0
  ):
    hint = ""
    if isinstance(density, jax.Array):
      hint = (
        " It sizes the compact buffers, so it must be a Python number: with"
        " optax.inject_hyperparams, pass static_args=('density',)."
      )
    raise ValueError(f"density must be a float in (0, 1]; got {density!r}.{hint}")
  if density is not None:
    density = float(density)
  if block is not None:
    block = _topk.validate_block(block)
    if mode == "skip" or density is None or structure is not None:
      raise ValueError(
        f"block={block} (compact tile storage) needs mode='compact' (or 'offload')"
        f" and density= (the largest active fraction of tiles per leaf), without"
        f" structure; got"
        f" mode={mode!r}, density={density!r}, structure={structure!r}."
      )
  if mode == "skip" and (density is not None or structure is not None):
    raise ValueError(
      f"density= and structure= size compact storage; mode='skip' keeps every"
      f" entry's state and takes neither (got density={density!r},"
      f" structure={structure!r}). Use mode='compact' to store active entries only."
    )
  shards = _topk.validate_shards(shards, block, "sparse_state")
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
  if not isinstance(cache_index, bool):
    raise ValueError(f"cache_index must be True or False; got {cache_index!r}.")
  if isinstance(axis, bool) or not isinstance(axis, int):
    raise ValueError(
      f"axis must be an int; got {axis!r}. (With optax.inject_hyperparams, pass"
      " static_args=('axis', 'offload_after').)"
    )
  # Chosen once: the storage of a scoped leaf that is not compact.
  dense_storage = _Offload if mode == "offload" else _Skip

  def groups_of(shape):
    ndim = len(shape)
    if not -ndim <= axis < ndim or shape[axis] % structure[1]:
      raise ValueError(
        f"structure={structure} along axis={axis} needs every scoped leaf to have"
        f" that axis with a length that is a multiple of {structure[1]}; a leaf has"
        f" shape {shape}."
      )
    return _Groups(tuple(shape), axis % ndim, *structure)

  def storage_of(plan, path, x):
    shape = tuple(jnp.shape(x))
    name = jax.tree_util.keystr(path)
    if plan.layout is None:
      return _Storage(shape, name)
    size = math.prod(shape)
    if size > 0 and block is not None:
      _topk.check_tiles(shape, block, name)
      parts = _topk.leaf_shards(shards, path, x, block, name)
      tiles = _Tiles(shape, name, block, 1, "").num_tiles // math.prod(parts or (1,))
      cap = _capacity(tiles, density, None)
      if cap <= density_threshold * tiles:
        if parts is None:
          limit = f"ceil(density * tiles) = ceil({density} * {tiles})"
          tile_storage = _OffloadTiles if mode == "offload" else _Tiles
          return tile_storage(shape, name, block, cap, limit)
        limit = f"ceil(density * tiles per part) = ceil({density} * {tiles})"
        tile_storage = _OffloadShardedTiles if mode == "offload" else _ShardedTiles
        return tile_storage(shape, name, block, parts, cap, limit)
    elif mode == "compact" and size > 0:
      groups = None if structure is None else groups_of(shape)
      cap = _capacity(size, density, structure)
      if cap <= density_threshold * size:
        if groups is not None and groups.m <= 32:
          return _Grouped(shape, name, groups)
        limit = (
          f"ceil(density * size) = ceil({density} * {size})"
          if structure is None
          else f"size * n / m = {size} * {structure[0]} / {structure[1]}"
        )
        return _Compact(shape, name, cap, limit, cache_index)
    return dense_storage(shape, name)

  def storages_of(tree):
    plans, treedef = _scoping.plan_scope(tree, where=where)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    leaves = treedef.flatten_up_to(tree)
    storages = [
      storage_of(plan, path, x)
      for plan, path, x in zip(plans, paths, leaves, strict=True)
    ]
    return storages, treedef

  return storages_of


def _base_step(base):
  """The step of :func:`sparse_state`: ``base`` on the gathered (stored) tree.

  A step is ``step(storages, ctx, treedef, flat_g, flat_p, state, stored_masks,
  extra_args) -> (flat stored updates, new state)``; it runs between ``load`` and
  ``freeze`` (see :class:`_Storage`).
  """
  base = optax.with_extra_args_support(base)

  def step(storages, ctx, treedef, flat_g, flat_p, state, stored_masks, extra_args):
    def gathered(flat):
      return treedef.unflatten(
        [s.gather(c, x) for s, c, x in zip(storages, ctx, flat, strict=True)]
      )

    updates, new_state = base.update(
      gathered(flat_g),
      state,
      None if flat_p is None else gathered(flat_p),
      param_mask=treedef.unflatten(stored_masks),
      **extra_args,
    )
    return treedef.flatten_up_to(updates), new_state

  return step


def _at_least(lower_bound: bool) -> str:
  """For a count that init knows only as a lower bound."""
  return "at least " if lower_bound else ""


def _no_mask(i: int, storage: _Storage) -> str:
  return (
    f"leaf {i} ({storage.name}) uses compact storage but param_mask has no mask"
    " for it; pass param_mask= (periodic_mask does) or scope the leaf out with"
    " `where`. Inside periodic_mask, a wrapper in between may have dropped the"
    " extra argument: a plain optax.GradientTransformation takes none (e.g."
    " optax.MultiSteps(...).gradient_transformation(); put MultiSteps outside"
    " periodic_mask instead)."
  )


def _value_dependent_init(base, params, treedef, storages) -> str | None:
  """Why compact storage cannot hold ``base``'s state, or ``None``: a field of
  ``base.init(params)`` that reads the values of the parameters stored compactly
  (schedule-free's ``z`` is a copy of them; ``optax.flatten``'s state a vector of
  them). Compact storage builds the base's state from zero parameters there, so
  such a field would start from other values than the base's, silently."""
  flat = treedef.flatten_up_to(params)
  at = [i for i, s in enumerate(storages) if s.compact]

  def init_of(compact):  # the other leaves are constants: their values may be read
    leaves = list(flat)
    for i, x in zip(at, compact, strict=True):
      leaves[i] = x
    return base.init(treedef.unflatten(leaves))

  reads = _freeze.reads_inputs(init_of, [flat[i] for i in at])
  paths = [
    jax.tree_util.keystr(path)
    for path, r in jax.tree_util.tree_leaves_with_path(reads)
    if r
  ]
  if not paths:
    return None
  more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
  names = ", ".join(storages[i].name for i in at[:3]) + (", ..." if len(at) > 3 else "")
  return (
    "sparse_state compact storage: the base's initial state reads the values of"
    f" the parameters it stores compactly ({names}): state field {paths[0]}{more}"
    " (schedule-free's `z`, for one, is a copy of the parameters). Compact storage"
    " builds the base's state from zero parameters there, so it would start from"
    " other values. Use mode='skip' for this base (it keeps every entry's state),"
    " or scope these leaves out with `where`."
  )


def _transformation(
  base, storages_of, offload_after, step, frozen=False, on_error="raise"
):
  """The transformation over ``base``'s state at the storages' shapes; ``step``
  computes the stored updates and the new base state (:func:`_base_step`), with
  the frozen entries already kept if ``frozen``. ``on_error``: how a failed check
  of a mask is reported (:data:`ON_ERROR`)."""
  if on_error not in ON_ERROR:
    raise ValueError(
      f"on_error must be one of {ON_ERROR} (how a step reports a parameter mask"
      f" that compact storage cannot hold); got {on_error!r}."
    )
  record = on_error == "record"

  def init_fn(params):
    storages, treedef = storages_of(params)
    flat = treedef.flatten_up_to(params)
    # Masks that a wrapper's init announced (periodic_mask's densest ones): one
    # that certainly cannot be stored fails here, before any step.
    for i, s in enumerate(storages):
      bound = _topk.mask_bound(s.name, flat[i])
      if bound is None:
        continue
      if bound.masked:
        problem = s.bound_problem(bound)
      else:
        problem = _no_mask(i, s) if s.needs_mask else None
      if problem is not None:
        raise ValueError(f"{problem} Found at init, before any step: {bound.why}.")
    if any(s.compact for s in storages):
      problem = _value_dependent_init(base, params, treedef, storages)
      if problem is not None:
        raise ValueError(problem)
    stored = [s.init_leaf(x) for s, x in zip(storages, flat, strict=True)]
    for s, x in zip(storages, flat, strict=True):
      if isinstance(s, _ShardedTiles):  # the parts are the parameter's shards
        axes = s.param_axes(jnp.ndim(x))
        _engine.declare_axes(s.name, s.stored_shape, (*axes, None, None, None))
        _engine.declare_axes(s.name, s.init_bits().shape, (*axes, None))
    steps = [
      jnp.zeros([], jnp.int32) if s.tracks_cold else optax.MaskedNode()
      for s in storages
    ]
    base_state = base.init(treedef.unflatten(stored))

    if any(isinstance(s, _ShardedTiles | _Grouped) for s in storages):
      # Where the base makes new arrays (a zeros of its own, not zeros_like).
      shapes = [s.stored_shape for s in storages]
      base_state = _trees.map_like(
        lambda i, x: storages[i].place(x, flat[i]),
        base_state,
        treedef,
        shapes=shapes,
      )
    return SparseState(
      base_state=base_state,
      stored_bits=treedef.unflatten(
        [s.place(s.init_bits(), x) for s, x in zip(storages, flat, strict=True)]
      ),
      inactive_steps=treedef.unflatten(steps),
      cold=treedef.unflatten(
        [s if _trees.is_masked(s) else s >= offload_after for s in steps]
      ),
      errors=(
        jnp.zeros((1 + _ERROR_VALUES,), jnp.int32) if record else optax.MaskedNode()
      ),
    )

  def leaf_masks(param_mask, storages, treedef, flat):
    if param_mask is None:
      masks = [None] * len(storages)
    else:
      masks = _trees.split_param_mask_like(treedef, param_mask, flat)
    out = []
    for i, (s, m) in enumerate(zip(storages, masks, strict=True)):
      if m is None or _trees.is_masked(m) or not s.scoped:
        if s.needs_mask:
          raise ValueError(_no_mask(i, s))
        out.append(None)
        continue
      out.append(m)
    return out

  def promised(param_mask, storages, treedef):
    """Per leaf, whether an enclosing wrapper promises of the very mask array it
    passes that every value it takes passes the storage's checks
    (:func:`magma_optax._topk.mask_promise`: periodic_mask's exact counts)."""
    if param_mask is None:
      return [False] * len(storages)
    out = []
    for s, m in zip(
      storages, _trees.split_param_mask(treedef, param_mask), strict=True
    ):
      bound = None if m is None or _trees.is_masked(m) else _topk.mask_promise(m)
      out.append(bound is not None and s.bound_suffices(bound))
    return out

  def by_batch(method, storages, args, batched, same=None):
    """``storage.method(*args[.][i])`` for every leaf ``i``; the leaves for which
    ``batched(i)`` holds whose storages have one ``batch_key`` (and one
    ``same[i]``) together, by ``method + "_group"`` of the first one's class
    (``same``: then its last argument, one value for the group)."""
    out = [None] * len(storages)
    groups = collections.defaultdict(list)
    # Where XLA may partition the step, leaves stay apart: one computation over
    # several leaves would tie their shardings (XLA gave one leaf's updates
    # another's sharding, and all-gathered them).
    together = not _compat.partitionable()
    for i, s in enumerate(storages):
      key = s.batch_key() if together and batched(i) else None
      if key is not None:
        # Inside shard_map, leaves that vary along other mesh axes stay apart
        # (stacked, each would vary along the other's).
        arrays = [a[i] for a in args if isinstance(a[i], jax.Array)]
        key = (key, frozenset().union(*map(_compat.varying, arrays)))
      extra = () if same is None else (same[i],)
      groups[("alone", i) if key is None else (key, *extra)].append(i)
    for key, idx in groups.items():
      if key[0] == "alone" or len(idx) == 1:
        for i in idx:
          extra = () if same is None else (same[i],)
          out[i] = getattr(storages[i], method)(*(a[i] for a in args), *extra)
        continue
      picked = [[a[i] for i in idx] for a in (storages, *args)]
      group = getattr(type(storages[idx[0]]), method + "_group")
      for i, x in zip(idx, group(*picked, *key[1:]), strict=True):
        out[i] = x
    return out

  def check_state(state, updates):
    """A state whose stored shapes are not this storage's (built with other
    arguments, e.g. restored after ``shards`` or ``density`` changed) is a
    ``ValueError`` that says where, not a shape error deep in the step."""
    want = jax.eval_shape(init_fn, updates)
    got = jax.tree_util.tree_flatten_with_path(state)[0]
    if len(got) == len(jax.tree.leaves(want)):
      for (path, x), w in zip(got, jax.tree.leaves(want), strict=True):  # noqa: B007
        if tuple(jnp.shape(x)) != tuple(w.shape):
          break
      else:
        return
      where = f"at {jax.tree_util.keystr(path)} shape {tuple(jnp.shape(x))}, this"
      where += f" storage keeps {tuple(w.shape)}"
    else:
      where = "its structure differs"
    raise ValueError(
      f"sparse_state: the state was not built by this transform's init ({where})."
      " Was it built with other storage arguments (mode, density, structure,"
      " block, shards, where, density_threshold, on_error)? Use the same ones,"
      " or call init again."
    )

  def update_fn(updates, state, params=None, *, param_mask=None, **extra_args):
    check_state(state, updates)
    storages, treedef = storages_of(updates)
    flat_g = treedef.flatten_up_to(updates)
    flat_p = treedef.flatten_up_to(params) if params is not None else None
    masks = leaf_masks(param_mask, storages, treedef, flat_g)
    shapes = [s.stored_shape for s in storages]
    bits = treedef.flatten_up_to(state.stored_bits)
    active = [None if m is None else jnp.any(m) for m in masks]
    # Per leaf, whether its checks are handled in the step, as on_error="record"
    # does (a mask that fails leaves the leaf as it was): every leaf when
    # recording; else those whose masks the wrapper promises cannot fail (the
    # promise may only be broken by a state edited by hand), so that the step
    # compiles no host callback for them.
    sure = promised(param_mask, storages, treedef)
    held = [record or p for p in sure]
    ctx, new_bits, changed, checks, checked = [], [], [], [], []
    # Per leaf, whether its mask failed a check (on_error="record": such a leaf is
    # left as it was); None where nothing is checked.
    bad = [None] * len(storages)
    # A promised mask is made of whole tiles: their first entries are read, not
    # every entry (the full read cost 0.17x of an Adam step on a 72-leaf tree).
    prepared = by_batch(
      "prepare",
      storages,
      [masks, bits, flat_g, sure],
      lambda i: masks[i] is not None,
      same=held,
    )
    # Per leaf prepared with others: their stacks and its place in them.
    stacked = [None] * len(storages)
    for i, (c, nb, ch, check, *stack) in enumerate(prepared):
      stacked[i] = stack[0] if stack else None
      ctx.append(c)
      new_bits.append(nb)
      changed.append(ch)
      if check is not None:
        checks.append(check)
        checked.append(i)
        bad[i] = jnp.asarray(check.bad)

    def per_entry(fn, tree, *more):
      return _trees.map_like(fn, tree, treedef, *more, shapes=shapes)

    base_state = state.base_state
    # Per leaf whose stored set changed, one loop of zero or one step (it rewrites
    # the state in place; a `lax.cond` would copy it on every step, and one loop
    # for all leaves keeps every leaf's temporaries at once): the cached ctx is
    # rebuilt (`rebuild`), then every entry of the base state is remapped.
    entries = [[] for _ in storages]
    per_entry(lambda i, x: entries[i].append(x), base_state)
    # What a newly stored entry starts from: the base's initial state, as `init`
    # built it (zero for Adam's moments, 0.1 for Adagrad's sum of squares).
    # One value per entry: `init` builds it from zero parameters, so an element-
    # wise base's initial state is uniform; a scalar keeps the zero-step loops
    # below from carrying (and ordinary steps from writing) stored-sized arrays.
    fresh = [[] for _ in storages]
    if any(c is not None for c in changed):
      stored0 = [s.init_leaf(x) for s, x in zip(storages, flat_g, strict=True)]
      per_entry(
        lambda i, x: fresh[i].append(None if changed[i] is None else _first(x)),
        base.init(treedef.unflatten(stored0)),
      )

    def remapped(i, now, xs, old_bits):
      # Entries stored before move to their new slots; new ones take `fresh`.
      s = storages[i]
      if not xs:
        return []
      # Sharded like the state (a loop's carry and a select's cases must be).
      ones = s.place(jnp.ones(s.stored_shape, jnp.int8), flat_g[i])
      kept = s.remap(now, _compat.put_like(ones, xs[0]), old_bits) != 0
      return [
        s.remap_fresh(now, x, old_bits, f, kept)
        for x, f in zip(xs, fresh[i], strict=True)
      ]

    loops = []  # per leaf whose stored set may change: (i, refresh, carry)
    # Leaves whose remaps run as one computation (``remap_key``; not where XLA
    # may partition the step, as in by_batch), by key.
    remap_groups = collections.defaultdict(list)
    if not _compat.partitionable():
      for i, s in enumerate(storages):
        key = None
        if changed[i] is not None:
          key = s.remap_key(ctx[i], bits[i], entries[i], fresh[i])
        if key is not None:
          remap_groups[key].append(i)
    # Chunks of at most _REMAP_BYTES of entries (or one leaf): a chunk's moved
    # entries are temporaries of the loop's body all at once.
    chunks = []
    for idx in remap_groups.values():
      chunks.append([])
      for i in idx:
        size = sum(x.size * x.dtype.itemsize for x in entries[i])
        if chunks[-1] and (len(chunks[-1]) + 1) * size > _REMAP_BYTES:
          chunks.append([])
        chunks[-1].append(i)
    remap_groups = [idx for idx in chunks if len(idx) > 1]
    grouped = {i for idx in remap_groups for i in idx}
    for i, s in enumerate(storages):
      if changed[i] is None or i in grouped:
        continue

      def refresh(carry, i=i, s=s):
        # The cached ctx's old value is the carry's (not `bits`'): the loop then
        # rewrites it in place instead of copying it first.
        old, n, xs, packed = carry
        if not s.rebuilds:
          return old, n, remapped(i, ctx[i], xs, bits[i]), packed
        if not held[i]:
          now, n = s.rebuild(masks[i])
        else:
          # A mask that does not fit leaves the stored entries and their bits as
          # they were (the remap then moves every entry to its own slot).
          now, n = s.rebuild(masks[i], bits[i][0])
          packed = jnp.where(s.rebuilt_check(n).bad, packed, new_bits[i][0])
        return now, n, remapped(i, now, xs, (bits[i][0], old)), packed

      # Unchanged: the cached ctx (its count was checked when it was built).
      packed = bits[i][0] if held[i] and s.rebuilds else None
      loops.append((i, refresh, (ctx[i], jnp.zeros([], jnp.int32), entries[i], packed)))
    # A group's leaves find their old slots by one computation over their stack
    # (per leaf some 20 computations, every one buffers of the program, whose
    # launch grows with them on XLA:CPU, run or not): a leaf of the group whose
    # stored set did not change keeps its entries as they were.
    # Where its leaves were prepared together, a group's loop takes their stacks
    # and picks its leaves inside: a slice of each leaf's taken outside is a
    # computation of every step (4 per leaf, a launch each on XLA:CPU).
    group_stacks = {}  # a group: its leaves' stacks and their rows in them
    for idx in remap_groups:
      first = stacked[idx[0]]
      if all(stacked[i] is not None and stacked[i][0] is first[0] for i in idx):
        group_stacks[tuple(idx)] = (first[0], tuple(stacked[i][1] for i in idx))

    def group_stack(idx):
      """The stacks of group ``idx`` (stacked here where it was not prepared
      together), and its rows in them (``None``: all)."""
      if idx in group_stacks:
        return group_stacks[idx]
      return _Stacked(
        *(jnp.stack([a[i] for i in idx]) for a in (ctx, bits, changed))
      ), None

    def picked(x, at):
      """The rows ``at`` (static; ``None``: all) of a stack ``x``."""
      if at is None or at == tuple(range(len(x))):
        return x
      if at == tuple(range(at[0], at[0] + len(at))):
        return jax.lax.slice_in_dim(x, at[0], at[0] + len(at))
      return x[jnp.asarray(at)]

    for idx in remap_groups:

      def refresh_group(carry, idx=tuple(idx)):
        stack, at = group_stack(idx)
        changes = picked(stack.changed, at)
        moved = type(storages[idx[0]]).remap_group(
          [storages[i] for i in idx],
          picked(stack.ctx, at),
          picked(stack.bits, at),
          carry,
          [fresh[i] for i in idx],
        )
        return [
          [jnp.where(changes[k], m, x) for m, x in zip(ms, xs, strict=True)]
          for k, (ms, xs) in enumerate(zip(moved, carry, strict=True))
        ]

      loops.append((tuple(idx), refresh_group, [entries[i] for i in idx]))

    def pred_of(i):
      if isinstance(i, tuple) and i in group_stacks:
        stack, at = group_stacks[i]
        return jnp.any(picked(stack.changed, at))
      if isinstance(i, tuple):
        return functools.reduce(jnp.logical_or, [changed[j] for j in i])
      return changed[i]

    def refresh_each(carries):
      return [
        _trees.run_if(pred_of(i), refresh, carry)
        for (i, refresh, _), carry in zip(loops, carries, strict=True)
      ]

    carries = [carry for _, _, carry in loops]
    if len(loops) > 1:
      # One loop around the leaves' loops: on ordinary steps one predicate to wait
      # for, not one per leaf (XLA:CPU waits at each loop's condition).
      carries = _trees.run_if(
        functools.reduce(jnp.logical_or, [pred_of(i) for i, _, _ in loops]),
        refresh_each,
        carries,
      )
    else:
      carries = refresh_each(carries)
    for (i, _, _), carry in zip(loops, carries, strict=True):
      if isinstance(i, tuple):  # a group: its leaves' entries (none rebuilds)
        for j, e in zip(i, carry, strict=True):
          entries[j] = e
        continue
      c, n, e, packed = carry
      s = storages[i]
      ctx[i], entries[i] = c, e
      if s.rebuilds:
        new_bits[i] = (new_bits[i][0] if packed is None else packed, ctx[i])
        checks.append(s.rebuilt_check(n))
        checked.append(i)
        bad[i] = jnp.asarray(checks[-1].bad)
    queues = [iter(e) for e in entries]
    base_state = per_entry(lambda i, x: next(queues[i]), base_state)
    # Recording: no host callback (one in the compiled step makes XLA:CPU run
    # every step synchronously, the dispatch waiting for it: ~0.2x of an Adam step
    # on the tile benchmark).
    raised = [k for k, i in enumerate(checked) if not held[i]]
    zero = _raise_any([checks[k] for k in raised])
    if zero is not None:  # keeps the check in the compiled step (an exact + 0)
      i = checked[raised[0]]
      leaves, bits_def = jax.tree.flatten(new_bits[i])  # on the smallest: 1 bit/item
      leaves[0] = leaves[0] + zero.astype(leaves[0].dtype)
      new_bits[i] = bits_def.unflatten(leaves)
    old_state = per_entry(lambda i, x: storages[i].load(x, active[i]), base_state)

    stored_masks = [
      s.stored_mask(c, m) for s, c, m in zip(storages, ctx, masks, strict=True)
    ]

    def run_step():
      return step(
        storages, ctx, treedef, flat_g, flat_p, old_state, stored_masks, extra_args
      )

    skip = [
      not frozen and isinstance(s, _Skip) and m is not None
      for s, m in zip(storages, masks, strict=True)
    ]
    if not any(skip):
      base_updates, new_state = run_step()
      done = set()
    else:
      # The frozen state computed where the base computes it, so that the base's
      # update reads it (no copy of the old state; see _freeze).
      index = []  # the flat output index of each state entry, if traced

      def targets_of(shapes):
        flat = jax.tree.unflatten(
          jax.tree.structure(shapes), range(len(jax.tree.leaves(shapes)))
        )
        groups = [{k} if isinstance(k, int) else set() for k in flat[0]]
        entries = []
        index.append(
          per_entry(
            lambda i, shape, k, old: entries.append((i, k, old)) or k,
            shapes[1],
            flat[1],
            old_state,
          )
        )
        for i, k, _ in entries:
          groups[i].add(k)
        return {
          k: _freeze.Target(masks[i], old, groups[i])
          for i, k, old in entries
          if skip[i]
        }

      inputs = (flat_g, flat_p, old_state, masks, extra_args)
      tracing = any(map(_compat.is_tracer, jax.tree.leaves(inputs)))
      (base_updates, new_state), done = _freeze.evaluate(run_step, targets_of, tracing)
    if not frozen:  # what the base did not freeze inside (k: the entry's index)
      new_state = per_entry(
        lambda i, new, old, *k: (
          new if k and k[0] in done else storages[i].freeze(ctx[i], masks[i], new, old)
        ),
        new_state,
        old_state,
        *(index[:1] if done else ()),
      )
    # A leaf whose mask failed (where the step handles it) gets no update.
    base_updates = [
      u if b is None or not h else jnp.where(b, jnp.zeros_like(u), u)
      for u, b, h in zip(base_updates, bad, held, strict=True)
    ]
    new_state = per_entry(
      lambda i, new, orig: storages[i].unload(new, orig, active[i]),
      new_state,
      base_state,
    )
    out = by_batch(
      "scatter", storages, [ctx, masks, base_updates], lambda i: masks[i] is not None
    )

    steps = treedef.flatten_up_to(state.inactive_steps)
    new_steps = [
      s
      if _trees.is_masked(s)
      else (
        jnp.zeros([], jnp.int32)
        if active[i] is None
        else jnp.where(active[i], 0, optax.safe_increment(s))
      )
      for i, s in enumerate(steps)
    ]
    new_cold = [s if _trees.is_masked(s) else s >= offload_after for s in new_steps]
    return treedef.unflatten(out), SparseState(
      base_state=new_state,
      stored_bits=treedef.unflatten(new_bits),
      inactive_steps=treedef.unflatten(new_steps),
      cold=treedef.unflatten(new_cold),
      errors=_record(checks, state.errors) if record else state.errors,
    )

  return optax.GradientTransformationExtraArgs(
    *_compat.typed(init_fn, update_fn, param_mask=True)
  )


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
  params_def = jax.tree.structure(params)
  shapes = [tuple(jnp.shape(x)) for x in params_def.flatten_up_to(params)]
  bare = params_def.num_nodes == 1

  def place(node):
    # Inside optax.masked / multi_transform a group's state holds MaskedNode for
    # the other groups' leaves and subtrees; split_like reads it against the
    # whole parameter tree.
    cold = _trees.split_like(node.cold, params_def)
    if cold is None:
      if any(not _trees.is_masked(c) for c in jax.tree.leaves(node.cold)):
        raise ValueError(
          "offload_sparse_state: params do not have the tree structure of the"
          " parameters this SparseState keeps (its per-leaf flags are"
          f" {jax.tree.structure(node.cold)}, params are {params_def}); pass the"
          " params the optimizer updates."
        )
      return node
    cold = [None if _trees.is_masked(c) else bool(c) for c in cold]

    def move(i, x):
      if cold[i] is None or (bare and jnp.ndim(x) == 0):
        return x
      sharding = x.sharding
      want = HOST_MEMORY_KIND if cold[i] else jax.devices()[0].default_memory().kind
      if sharding.memory_kind == want:
        return x
      return jax.device_put(x, sharding.with_memory_kind(want))

    # Without shapes: compact tile buffers have their stored shapes; base_state
    # holds only per-entry state of the stored tree, and a scalar such as a count
    # is never like a parameter tree that has more than a bare leaf. With a bare
    # leaf every leaf of the state is "like" it: `move` skips scalars (counts)
    # unless the parameter is a scalar itself, where only its shape tells.
    return node._replace(
      base_state=_trees.map_like(
        move,
        node.base_state,
        params_def,
        shapes=shapes if bare and shapes[0] == () else None,
      )
    )

  return jax.tree.map(
    lambda x: place(x) if is_state(x) else x, opt_state, is_leaf=is_state
  )
