"""The step every storage shares: the base optimizer run on the stored tree.

:func:`transformation` builds the ``optax`` transformation of
:func:`magma_optax.sparse_state` and :func:`magma_optax.sparse_adam`. Its update
runs in phases over a per-leaf record (:class:`_Leaf`): the masks are prepared
(compact indices, new bits, checks), the stored entries of leaves whose sets
changed are moved (in one loop of zero or one step), failed checks are reported, the
base runs on the gathered tree, and the updates are scattered back.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from magma_optax._core import compat as _compat
from magma_optax._core import shard_map as _shard_map
from magma_optax._core import sharded as _sharded
from magma_optax._core import trees as _trees
from magma_optax._core import xla_cpu as _xla_cpu
from magma_optax.sparse import errors as _errors
from magma_optax.sparse import freeze as _freeze
from magma_optax.sparse import storage as _storage

# Leaves remapped together hold at most this many bytes of base state (or one
# leaf): their moved entries are temporaries of the refresh all at once, part of
# the step's temporaries whether it refreshes or not.
REMAP_BYTES = 2**21


def transformation(
  base,
  planner,
  offload_after,
  step,
  *,
  state_type,
  frozen=False,
  on_error="raise",
  name="sparse_state",
) -> optax.GradientTransformationExtraArgs:
  """The transformation over ``base``'s state at the storages' shapes.

  ``planner(tree) -> (storages, treedef)``; ``step`` computes the stored updates
  and the new base state (:func:`base_step`), with the frozen entries already kept
  if ``frozen``; ``state_type``: the state (:class:`magma_optax.SparseState`);
  ``on_error``: how a failed check of a mask is reported (:data:`errors.ON_ERROR`);
  ``name``: the public factory, for error messages.
  """
  if on_error not in _errors.ON_ERROR:
    raise ValueError(
      f"on_error must be one of {_errors.ON_ERROR} (how a step reports a parameter"
      f" mask that compact storage cannot hold); got {on_error!r}."
    )
  t = _Transform(
    base, planner, offload_after, step, state_type, frozen, on_error == "record", name
  )
  return optax.GradientTransformationExtraArgs(
    *_shard_map.typed(t.init, t.update, param_mask=True)
  )


def base_step(base):
  """The step of :func:`magma_optax.sparse_state`: ``base`` on the gathered tree.

  A step is ``step(storages, ctx, treedef, flat_g, flat_p, state, stored_masks,
  extra_args) -> (flat stored updates, new state)``; it runs between ``load`` and
  ``freeze`` (see :class:`magma_optax.sparse.storage.Storage`).
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


@dataclasses.dataclass(eq=False)
class _Leaf:
  """One leaf of a step, filled in phase by phase."""

  storage: _storage.Storage
  grad: Any
  mask: Any  # the leaf's bool parameter mask, or None (no mask, or unscoped)
  bits: Any  # the stored set before the step
  whole: bool  # the wrapper promises every mask passes the storage's checks
  held: bool  # a failed check is handled in the step (record mode, or promised)
  active: Any = None  # whether the mask has an active entry
  ctx: Any = None  # the step's view of the mask (compact indices, N:M slots)
  new_bits: Any = None
  changed: Any = None  # whether the stored set changed (None: it never does)
  check: Any = None  # the leaf's Check, or None
  stacked: Any = None  # (the stacks it was prepared in, its row), or None
  entries: list = dataclasses.field(default_factory=list)  # base-state entries
  fresh: list = dataclasses.field(default_factory=list)  # their initial values

  @property
  def bad(self) -> Any:
    """Whether the mask failed a check (``None``: nothing is checked)."""
    return None if self.check is None else jnp.asarray(self.check.bad)


@dataclasses.dataclass(frozen=True, eq=False)
class _Transform:
  base: Any
  planner: Any
  offload_after: int
  step: Any
  state_type: Any
  frozen: bool
  record: bool
  name: str = "sparse_state"  # the public factory, for error messages

  # --- init ------------------------------------------------------------------------

  def init(self, params: Any) -> Any:
    storages, treedef = self.planner(params)
    flat = treedef.flatten_up_to(params)
    if any(s.compact for s in storages):
      problem = _value_dependent_init(self.base, params, treedef, storages)
      if problem is not None:
        raise ValueError(problem)
    stored = [s.init_leaf(x) for s, x in zip(storages, flat, strict=True)]
    steps = [
      jnp.zeros([], jnp.int32) if s.tracks_cold else optax.MaskedNode()
      for s in storages
    ]
    base_state = self.base.init(treedef.unflatten(stored))
    if any(s.places_state for s in storages):
      # Where the base makes new arrays (a zeros of its own, not zeros_like).
      base_state = _trees.map_like(
        lambda i, x: storages[i].place(x, flat[i]),
        base_state,
        treedef,
        shapes=[s.stored_shape for s in storages],
      )
    return self.state_type(
      base_state=base_state,
      stored_bits=treedef.unflatten(
        [s.place(s.init_bits(), x) for s, x in zip(storages, flat, strict=True)]
      ),
      inactive_steps=treedef.unflatten(steps),
      cold=treedef.unflatten(
        [s if _trees.is_masked(s) else s >= self.offload_after for s in steps]
      ),
      errors=self.no_errors(storages, treedef),
      storage=_layout(treedef, storages),
    )

  def no_errors(self, storages, treedef) -> Any:
    del treedef
    if not self.record:
      return optax.MaskedNode()
    return _errors.no_records(sum(s.compact for s in storages))

  def check_state(self, state: Any, updates: Any) -> None:
    """Gradients whose tree is not the one the state was built for, and a state
    whose stored shapes are not what these gradients need (gradients of other
    shapes than the parameters', or a state built with other arguments, e.g.
    restored after ``shards`` or ``density`` changed), raise a ``ValueError``
    that says where, not a shape error deep in the step."""
    want = jax.eval_shape(self.init, updates)
    _check_tree(self.name, state, want, updates)
    got = jax.tree_util.tree_flatten_with_path(state)[0]
    if len(got) == len(jax.tree.leaves(want)):
      for (path, x), w in zip(got, jax.tree.leaves(want), strict=True):  # noqa: B007
        if tuple(jnp.shape(x)) != tuple(w.shape):
          break
      else:
        return
      where = f"at {jax.tree_util.keystr(path)} shape {tuple(jnp.shape(x))}, where"
      where += f" these gradients need {tuple(w.shape)}"
      state_path = jax.tree_util.keystr(path)
      for grad_path, g in jax.tree_util.tree_flatten_with_path(updates)[0]:
        if state_path.endswith(jax.tree_util.keystr(grad_path)):
          where += (
            f"; the gradient at {jax.tree_util.keystr(grad_path)} has shape"
            f" {tuple(jnp.shape(g))}"
          )
          break
    else:
      where = "its structure differs"
    raise ValueError(
      f"{self.name}: the state does not fit these gradients ({where}). Do the"
      " gradients have their parameters' shapes? Else the state was not built by"
      " this transform's init: was it built with other storage arguments (mode,"
      " density, structure, block, shards, where, density_threshold, on_error)?"
      " Use the same ones, or call init again."
    )

  # --- update ----------------------------------------------------------------------

  def update(
    self,
    updates,
    state,
    params=None,
    *,
    param_mask=None,
    mask_promises=None,
    **extra_args,
  ):
    _trees.check_shapes(self.name, updates, params)
    self.check_state(state, updates)
    storages, treedef = self.planner(updates)
    shapes = [s.stored_shape for s in storages]

    def per_entry(fn, tree, *more):
      return _trees.map_like(fn, tree, treedef, *more, shapes=shapes)

    leaves = self.leaves(storages, treedef, updates, state, param_mask, mask_promises)
    checked = _prepare(leaves)
    per_entry(lambda i, x: leaves[i].entries.append(x), state.base_state)
    if any(leaf.changed is not None for leaf in leaves):
      self.fresh_values(leaves, treedef, per_entry)
    checked += _refresh(leaves)
    queues = [iter(leaf.entries) for leaf in leaves]
    base_state = per_entry(lambda i, x: next(queues[i]), state.base_state)
    _report([i for i in checked if not leaves[i].held], leaves)
    flat_p = None if params is None else treedef.flatten_up_to(params)
    out, new_state = self.run_base(
      leaves, treedef, base_state, flat_p, per_entry, extra_args
    )
    return treedef.unflatten(out), self.new_state(
      leaves, treedef, state, new_state, storages
    )

  def leaves(self, storages, treedef, updates, state, param_mask, promises):
    """The step's per-leaf records: the masks checked against their leaves, and
    per leaf whether its checks are handled in the step, as ``on_error="record"``
    does (a mask that fails leaves the leaf as it was): every leaf when recording;
    else those whose masks the wrapper promises cannot fail (the promise may only
    be broken by a state edited by hand), so that the step compiles no host
    callback for them."""
    flat_g = treedef.flatten_up_to(updates)
    if param_mask is None:
      masks = raw = [None] * len(storages)
    else:
      masks = _trees.split_param_mask_like(treedef, param_mask, flat_g)
      raw = _trees.split_param_mask(treedef, param_mask)
    out = []
    for i, (s, g, m, r, b) in enumerate(
      zip(
        storages, flat_g, masks, raw, treedef.flatten_up_to(state.stored_bits),
        strict=True,
      )
    ):  # fmt: skip
      if m is None or _trees.is_masked(m) or not s.scoped:
        if s.needs_mask:
          raise ValueError(s.no_mask_problem(i))
        m = None
      bound = None
      if promises is not None and m is not None:
        bound = promises.bound_of(r)
      whole = bound is not None and s.bound_suffices(bound)
      leaf = _Leaf(s, g, m, b, whole, self.record or whole)
      leaf.active = None if m is None else jnp.any(m)
      out.append(leaf)
    return out

  def fresh_values(self, leaves, treedef, per_entry) -> None:
    """What a newly stored entry starts from: the base's initial state, as
    ``init`` built it (zero for Adam's moments, 0.1 for Adagrad's sum of squares).
    One value per entry: ``init`` builds it from zero parameters, so an element-
    wise base's initial state is uniform; a scalar keeps the zero-step loops from
    carrying (and ordinary steps from writing) stored-sized arrays."""
    stored0 = [leaf.storage.init_leaf(leaf.grad) for leaf in leaves]

    def add(i, x):
      leaf = leaves[i]
      leaf.fresh.append(None if leaf.changed is None else _storage.first(x))

    per_entry(add, self.base.init(treedef.unflatten(stored0)))

  def run_base(self, leaves, treedef, base_state, flat_p, per_entry, extra_args):
    """The base's step on the stored tree (loaded, frozen where the mask is off,
    unloaded), and the leaf-shaped updates."""
    old_state = per_entry(
      lambda i, x: leaves[i].storage.load(x, leaves[i].active), base_state
    )
    stored_masks = [leaf.storage.stored_mask(leaf.ctx, leaf.mask) for leaf in leaves]
    storages = [leaf.storage for leaf in leaves]
    ctx = [leaf.ctx for leaf in leaves]

    def run_step():
      flat_g = [leaf.grad for leaf in leaves]
      return self.step(
        storages, ctx, treedef, flat_g, flat_p, old_state, stored_masks, extra_args
      )

    freezable = [
      not self.frozen and leaf.storage.freezable and leaf.mask is not None
      for leaf in leaves
    ]
    if not any(freezable):
      base_updates, new_state = run_step()
      done, index = set(), None
    else:
      (base_updates, new_state), done, index = _frozen_in_step(
        run_step, leaves, freezable, old_state, per_entry, flat_p, extra_args
      )
    if not self.frozen:  # what the base did not freeze inside (k: the index)
      new_state = per_entry(
        lambda i, new, old, *k: (
          new
          if k and k[0] in done
          else leaves[i].storage.freeze(leaves[i].ctx, leaves[i].mask, new, old)
        ),
        new_state,
        old_state,
        *(() if not done else (index,)),
      )
    # A leaf whose mask failed (where the step handles it) gets no update.
    base_updates = [
      u
      if leaf.bad is None or not leaf.held
      else jnp.where(leaf.bad, jnp.zeros_like(u), u)
      for u, leaf in zip(base_updates, leaves, strict=True)
    ]
    new_state = per_entry(
      lambda i, new, orig: leaves[i].storage.unload(new, orig, leaves[i].active),
      new_state,
      base_state,
    )
    out = _by_batch(
      "scatter",
      leaves,
      lambda leaf, u: (leaf.ctx, leaf.mask, u),
      base_updates,
      lambda leaf: leaf.mask is not None,
    )
    return out, new_state

  def new_state(self, leaves, treedef, state, base_state, storages) -> Any:
    steps = treedef.flatten_up_to(state.inactive_steps)
    new_steps = [
      s
      if _trees.is_masked(s)
      else (
        jnp.zeros([], jnp.int32)
        if leaf.active is None
        else jnp.where(leaf.active, 0, optax.safe_increment(s))
      )
      for s, leaf in zip(steps, leaves, strict=True)
    ]
    errors = state.errors
    if self.record:
      checks = [leaf.check for leaf in leaves if leaf.storage.compact]
      errors = _errors.recorded(errors, checks)
    return self.state_type(
      base_state=base_state,
      stored_bits=treedef.unflatten([leaf.new_bits for leaf in leaves]),
      inactive_steps=treedef.unflatten(new_steps),
      cold=treedef.unflatten(
        [s if _trees.is_masked(s) else s >= self.offload_after for s in new_steps]
      ),
      errors=errors,
      storage=_layout(treedef, storages),
    )


def _layout(treedef: Any, storages: list[_storage.Storage]) -> Any:
  """The state's static storage field (a leaf under ``optax.tree.map_params``'
  placeholder, which then keeps the real state's)."""
  if _trees.is_placeholder(treedef):
    return jnp.zeros([], jnp.int32)
  return _storage.StorageLayout.of(treedef, storages)


# --- phases -----------------------------------------------------------------------


def _prepare(leaves: list[_Leaf]) -> list[int]:
  """Each leaf's ``prepare``: its ``ctx``, new bits, whether its set changed and its
  check (leaves of one ``batch_key`` together). Returns the leaves checked.

  A promised mask is made of whole tiles: their first entries are read, not every
  entry."""
  prepared = _by_batch(
    "prepare",
    leaves,
    lambda leaf: (leaf.mask, leaf.bits, leaf.grad, leaf.whole),
    None,
    lambda leaf: leaf.mask is not None,
    same=lambda leaf: leaf.held,
  )
  checked = []
  for i, (leaf, (ctx, new_bits, changed, check, *stack)) in enumerate(
    zip(leaves, prepared, strict=True)
  ):
    leaf.ctx, leaf.new_bits, leaf.changed, leaf.check = ctx, new_bits, changed, check
    leaf.stacked = stack[0] if stack else None
    if check is not None:
      checked.append(i)
  return checked


def _by_batch(method, leaves, args_of, more, batched, same=None):
  """``storage.method(*args_of(leaf[, more[i]]))`` for every leaf; the leaves for
  which ``batched(leaf)`` holds whose storages have one ``batch_key`` (and one
  ``same(leaf)``, then the method's last argument) together, by ``method +
  "_group"`` of the first one's class."""

  def args(i):
    return args_of(leaves[i]) if more is None else args_of(leaves[i], more[i])

  out = [None] * len(leaves)
  groups = collections.defaultdict(list)
  # Where XLA may partition the step, leaves stay apart: one computation over
  # several leaves would tie their shardings (XLA gave one leaf's updates
  # another's sharding, and all-gathered them).
  together = not _sharded.partitionable()
  for i, leaf in enumerate(leaves):
    key = leaf.storage.batch_key() if together and batched(leaf) else None
    if key is not None:
      # Inside shard_map, leaves that vary along other mesh axes stay apart
      # (stacked, each would vary along the other's).
      arrays = [a for a in args(i) if isinstance(a, jax.Array)]
      key = (key, frozenset().union(*map(_shard_map.varying, arrays)))
    extra = () if same is None else (same(leaf),)
    groups[("alone", i) if key is None else (key, *extra)].append(i)
  for key, idx in groups.items():
    if key[0] == "alone" or len(idx) == 1:
      for i in idx:
        extra = () if same is None else (same(leaves[i]),)
        out[i] = getattr(leaves[i].storage, method)(*args(i), *extra)
      continue
    columns = [list(c) for c in zip(*(args(i) for i in idx), strict=True)]
    group = getattr(type(leaves[idx[0]].storage), method + "_group")
    storages = [leaves[i].storage for i in idx]
    for i, x in zip(idx, group(storages, *columns, *key[1:]), strict=True):
      out[i] = x
  return out


def _refresh(leaves: list[_Leaf]) -> list[int]:
  """Moves the stored entries of every leaf whose stored set changed to their new
  slots, in one loop of zero or one step (it rewrites the state in place; a
  ``lax.cond`` would copy it on every step); the cached ``ctx`` of a leaf that
  caches it is rebuilt first. Returns the leaves checked by a rebuild."""
  loops = [_leaf_loop(i, leaf) for i, leaf in enumerate(leaves)]
  groups = _remap_groups(leaves)
  grouped = {i for idx in groups for i in idx}
  loops = [loop for loop in loops if loop is not None and loop[0] not in grouped]
  stacks = _group_stacks(leaves, groups)
  for idx in groups:
    loops.append(
      (idx, _group_refresh(leaves, idx, stacks), [leaves[i].entries for i in idx])
    )

  def pred_of(i):
    if isinstance(i, tuple) and i in stacks:
      stack, at = stacks[i]
      return jnp.any(_picked(stack.changed, at))
    if isinstance(i, tuple):
      return functools.reduce(jnp.logical_or, [leaves[j].changed for j in i])
    return leaves[i].changed

  def refresh_each(carries):
    return [
      _xla_cpu.run_if(pred_of(i), refresh, carry)
      for (i, refresh, _), carry in zip(loops, carries, strict=True)
    ]

  carries = [carry for _, _, carry in loops]
  if len(loops) > 1:
    # One loop around the leaves' loops: on ordinary steps one predicate to wait
    # for, not one per leaf (XLA:CPU waits at each loop's condition).
    carries = _xla_cpu.run_if(
      functools.reduce(jnp.logical_or, [pred_of(i) for i, _, _ in loops]),
      refresh_each,
      carries,
    )
  else:
    carries = refresh_each(carries)
  checked = []
  for (i, _, _), carry in zip(loops, carries, strict=True):
    if isinstance(i, tuple):  # a group: its leaves' entries (none rebuilds)
      for j, e in zip(i, carry, strict=True):
        leaves[j].entries = e
      continue
    leaf = leaves[i]
    leaf.ctx, n, leaf.entries, packed = carry
    if leaf.storage.rebuilds:
      leaf.new_bits = (leaf.new_bits[0] if packed is None else packed, leaf.ctx)
      leaf.check = leaf.storage.rebuilt_check(n)
      checked.append(i)
  return checked


def _remapped(leaf: _Leaf, now, xs, old_bits) -> list:
  """The entries ``xs`` stored before moved to their new slots (``now``); new
  ones take their ``fresh`` values."""
  s = leaf.storage
  if not xs:
    return []
  # Sharded like the state (a loop's carry and a select's cases must be).
  ones = s.place(jnp.ones(s.stored_shape, jnp.int8), leaf.grad)
  kept = s.remap(now, _sharded.put_like(ones, xs[0]), old_bits) != 0
  return [
    s.remap_fresh(now, x, old_bits, f, kept)
    for x, f in zip(xs, leaf.fresh, strict=True)
  ]


def _leaf_loop(i: int, leaf: _Leaf):
  """``(i, refresh, carry)``: the zero-or-one-step loop of a leaf whose stored set
  may change, or ``None``."""
  if leaf.changed is None:
    return None
  s, bits = leaf.storage, leaf.bits

  def refresh(carry):
    # The cached ctx's old value is the carry's (not `bits`'): the loop then
    # rewrites it in place instead of copying it first.
    old, n, xs, packed = carry
    if not s.rebuilds:
      return old, n, _remapped(leaf, leaf.ctx, xs, bits), packed
    if not leaf.held:
      now, n = s.rebuild(leaf.mask)
    else:
      # A mask that does not fit leaves the stored entries and their bits as
      # they were (the remap then moves every entry to its own slot).
      now, n = s.rebuild(leaf.mask, bits[0])
      packed = jnp.where(s.rebuilt_check(n).bad, packed, leaf.new_bits[0])
    return now, n, _remapped(leaf, now, xs, (bits[0], old)), packed

  # Unchanged: the cached ctx (its count was checked when it was built).
  packed = bits[0] if leaf.held and s.rebuilds else None
  return i, refresh, (leaf.ctx, jnp.zeros([], jnp.int32), leaf.entries, packed)


def _remap_groups(leaves: list[_Leaf]) -> list[tuple[int, ...]]:
  """Leaves whose remaps run as one computation (``remap_key``; not where XLA may
  partition the step, as in :func:`_by_batch`), in chunks of at most
  :data:`REMAP_BYTES` of entries (or one leaf): a chunk's moved entries are
  temporaries of the loop's body all at once."""
  keyed = collections.defaultdict(list)
  if not _sharded.partitionable():
    for i, leaf in enumerate(leaves):
      key = None
      if leaf.changed is not None:
        key = leaf.storage.remap_key(leaf.ctx, leaf.bits, leaf.entries, leaf.fresh)
      if key is not None:
        keyed[key].append(i)
  chunks = []
  for idx in keyed.values():
    chunks.append([])
    for i in idx:
      size = sum(x.size * x.dtype.itemsize for x in leaves[i].entries)
      if chunks[-1] and (len(chunks[-1]) + 1) * size > REMAP_BYTES:
        chunks.append([])
      chunks[-1].append(i)
  return [tuple(idx) for idx in chunks if len(idx) > 1]


def _group_stacks(leaves, groups) -> dict:
  """A group's leaves find their old slots by one computation over their stack;
  where they were prepared together, the group's loop takes their stacks and
  picks its leaves inside (a slice of each leaf's taken outside is a computation
  of every step). Per such group: the stacks and its rows in them."""
  stacks = {}
  for idx in groups:
    first = leaves[idx[0]].stacked
    if all(
      leaves[i].stacked is not None and leaves[i].stacked[0] is first[0] for i in idx
    ):
      stacks[idx] = (first[0], tuple(leaves[i].stacked[1] for i in idx))
  return stacks


def _picked(x: jax.Array, at: tuple[int, ...] | None) -> jax.Array:
  """The rows ``at`` (static; ``None``: all) of a stack ``x``."""
  if at is None or at == tuple(range(len(x))):
    return x
  if at == tuple(range(at[0], at[0] + len(at))):
    return jax.lax.slice_in_dim(x, at[0], at[0] + len(at))
  return x[jnp.asarray(at)]


def _group_refresh(leaves, idx, stacks):
  """The loop body of a group of leaves remapped together: a leaf of the group
  whose stored set did not change keeps its entries as they were."""
  storages = [leaves[i].storage for i in idx]

  def refresh_group(carry):
    if idx in stacks:
      stack, at = stacks[idx]
    else:  # stacked here where it was not prepared together
      stack, at = (
        _storage.Stacked(
          *(jnp.stack([getattr(leaves[i], a) for i in idx]) for a in _STACKED)
        ),
        None,
      )
    changes = _picked(stack.changed, at)
    moved = type(storages[0]).remap_group(
      storages,
      _picked(stack.ctx, at),
      _picked(stack.bits, at),
      carry,
      [leaves[i].fresh for i in idx],
    )
    return [
      [jnp.where(changes[k], m, x) for m, x in zip(ms, xs, strict=True)]
      for k, (ms, xs) in enumerate(zip(moved, carry, strict=True))
    ]

  return refresh_group


# The fields of a stack of leaves prepared apart (storage.Stacked's).
_STACKED = ("ctx", "bits", "changed")


def _report(raised: list[int], leaves: list[_Leaf]) -> None:
  """Raises the failed checks that the step does not handle (:func:`errors.
  raise_any`); under ``jax.jit`` its zero is folded into the first such leaf's
  bits, which keeps the host callback in the compiled step (an exact + 0)."""
  zero = _errors.raise_any([leaves[i].check for i in raised])
  if zero is None:
    return
  leaf = leaves[raised[0]]
  flat, bits_def = jax.tree.flatten(leaf.new_bits)  # on the smallest: 1 bit/item
  flat[0] = flat[0] + zero.astype(flat[0].dtype)
  leaf.new_bits = bits_def.unflatten(flat)


def _frozen_in_step(run_step, leaves, freezable, old_state, per_entry, flat_p, extra):
  """``run_step()`` with the frozen state computed where the base computes it, so
  that the base's update reads it (no copy of the old state; see
  :mod:`magma_optax.sparse.freeze`). Returns its outputs, the flat output indices
  of the entries frozen inside, and per entry its flat output index."""
  index = []  # per entry its flat output index, if traced

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
      k: _freeze.Target(leaves[i].mask, old, groups[i])
      for i, k, old in entries
      if freezable[i]
    }

  inputs = ([leaf.grad for leaf in leaves], flat_p, old_state, extra)
  inputs = (*inputs, [leaf.mask for leaf in leaves])
  tracing = any(map(_compat.is_tracer, jax.tree.leaves(inputs)))
  outputs, done = _freeze.evaluate(run_step, targets_of, tracing)
  return outputs, done, index[0] if index else None


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


def _check_tree(name: str, state: Any, want: Any, updates: Any) -> None:
  """Raises ``ValueError`` where the gradients' tree is not the one ``state`` was
  built for (one entry per leaf, whatever its storage: the parameters' tree)."""

  def tree_of(s):
    return jax.tree.structure(s.inactive_steps, is_leaf=_trees.is_masked)

  if tree_of(state) == tree_of(want):
    return
  got = jax.tree_util.tree_flatten_with_path(state.inactive_steps, _trees.is_masked)
  paths = {jax.tree_util.keystr(p) for p, _ in got[0]}
  grads = jax.tree_util.tree_flatten_with_path(updates)[0]
  extra = sorted({jax.tree_util.keystr(p) for p, _ in grads} - paths)
  missing = sorted(paths - {jax.tree_util.keystr(p) for p, _ in grads})
  raise ValueError(
    f"{name}: the gradients' tree is not the parameter tree this state was"
    f" built for (by init). Leaves of the gradients that the state has not:"
    f" {extra[:3] or 'none'}{' ...' if len(extra) > 3 else ''}; leaves of"
    f" the state that the gradients have not: {missing[:3] or 'none'}"
    f"{' ...' if len(missing) > 3 else ''}. Pass gradients with the"
    " parameters' tree (the same containers, e.g. both nnx.State or both"
    " dicts), or call init with the tree the gradients have."
  )
