"""How a step reports a parameter mask that compact storage cannot hold.

Every step records it: each leaf keeps its first failure in the state
(:attr:`magma_optax.SparseState.errors`: a kind and its counts per leaf), and
:func:`check_sparse_state` raises it, also from a state restored from a
checkpoint. ``on_error="raise"`` also raises it from the step where that costs no
device round trip (eagerly, or from a host callback on XLA:CPU).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from magma_optax._core import compat as _compat
from magma_optax._core import shard_map as _shard_map
from magma_optax._core import trees as _trees
from magma_optax.sparse import storage as _storage

ON_ERROR = ("raise", "record")
# A leaf's record: [kind (0: none), up to ERROR_VALUES counts].
ERROR_VALUES = 8


def no_records(num_leaves: int) -> jax.Array:
  """The records before any failure: one row per checked leaf."""
  return jnp.zeros((num_leaves, 1 + ERROR_VALUES), jnp.int32)


def recorded(records: jax.Array, checks: list[Any]) -> jax.Array:
  """The records after a step, one row per checked leaf (its :class:`Check`, or
  ``None``): each leaf keeps its first failure. One array for all leaves: a step
  computes it in one pass, whatever the number of leaves."""
  if not checks:
    return records
  rows, bads = [], []
  for row, check in zip(records, checks, strict=True):
    if check is None:
      rows.append(row)
      bads.append(jnp.zeros([], jnp.bool_))
      continue
    if len(check.values) > ERROR_VALUES:  # the storages' have at most 2 + ndim
      raise ValueError(f"a check with {len(check.values)} counts cannot be recorded.")
    values = [jnp.asarray(v, jnp.int32) for v in check.values]
    zeros = [jnp.zeros([], jnp.int32)] * (ERROR_VALUES - len(values))
    rows.append(jnp.stack([jnp.asarray(check.kind, jnp.int32), *values, *zeros]))
    bads.append(jnp.asarray(check.bad))
  keep = (records[:, 0] != 0) | ~jnp.stack(bads)
  return jnp.where(keep[:, None], records, jnp.stack(rows))


def check_sparse_state(opt_state: Any) -> None:
  """Raises the failure that a ``sparse_state`` step recorded.

  A step whose parameter mask fails a check of compact storage (more active
  entries, groups or tiles than the capacity, or a mask not made of whole tiles)
  raises nothing on a GPU or a TPU, nor with ``on_error="record"`` anywhere: a
  failing leaf keeps its stored entries or tiles (its mask is replaced by them;
  its stored moments take the step there), gets a zero update, and its first
  failure is recorded in :attr:`SparseState.errors`. This reads those records (a
  transfer that waits for the step that wrote them) and raises the
  ``ValueError`` that ``on_error="raise"`` raises on XLA:CPU. Call it where the
  training loop already reads values from the device (its logging steps) and
  before a checkpoint is saved. Where several leaves hold records, the first in
  tree order is raised (each keeps its own first failure).

  Args:
    opt_state: an optimizer state, or any pytree holding :class:`SparseState`
      values (inside ``optax.chain``, ``periodic_mask``, ``optax.MultiSteps``,
      ``inject_hyperparams``, a batch of states from ``jax.vmap``), also one
      restored from a checkpoint into the structure of ``tx.init``.

  Raises:
    ValueError: the recorded failure's message: the leaf, the counts, the
      capacity and the fix. Also a ``ValueError`` when ``opt_state`` holds no
      :class:`SparseState` at all (a checkpoint restored without its target
      structure comes back as dicts: restore it with one).

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
  is_state = _storage.is_sparse_state
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
    checked = [s for s in st.storage.storages if s.compact]
    if not checked:
      continue
    records = np.asarray(st.errors).reshape(-1, len(checked), 1 + ERROR_VALUES)
    for j, s in enumerate(checked):
      for record in records[:, j].tolist():
        if record[0]:
          raise ValueError(message_of(s, record))


def message_of(storage: _storage.Storage, record: list[int]) -> str:
  """The message of a leaf's record ``[kind, *counts]`` (its kind not 0)."""
  kind, *values = record
  return storage.message(kind, *values[: storage.failure_values])


def raise_recorded(
  records: jax.Array, rows: list[int], storages: list[_storage.Storage]
) -> jax.Array | None:
  """Raises ``ValueError`` with the message of the first of ``rows`` that holds a
  failure, where the step can: ``on_error="raise"``.

  With concrete records (``update`` called outside ``jax.jit``) the error is raised
  here. Under ``jax.jit`` the records exist only when the step runs, and a compiled
  step can only fail through the runtime: lowered for XLA:CPU, a host callback
  raises the same ``ValueError``, which JAX reports as a ``JaxRuntimeError`` or a
  ``ValueError`` (with this message on the last line), and the step returns
  nothing. Lowered for a GPU or a TPU the step holds no callback (nor the branch
  that guards it: a host round trip in every step): the failure stays recorded in
  the state for :func:`check_sparse_state`, and the step loses nothing (the
  failing leaf keeps its stored set and takes no update).

  Returns ``None``, or under ``jax.jit`` an int32 zero that the caller must fold
  into the step's outputs: the callback is a ``jax.pure_callback`` inside one
  ``lax.cond`` for all leaves, kept alive by that data dependency; under a
  ``jax.set_mesh`` context of several devices, inside a ``shard_map`` over it, so
  that every device raises (a callback of one device would leave the others
  waiting at the next collective). (A ``jax.debug.callback`` is an effect: JAX
  would then wait for every step before dispatching the next.)

  Args:
    records: the step's records (:func:`recorded`), one row per compact leaf.
    rows: the rows to raise from, in order.
    storages: per row of ``records`` its leaf's storage.
  """
  if not rows:
    return None

  def fail(picked):
    for k, record in zip(rows, np.asarray(picked).tolist(), strict=True):
      if record[0]:
        raise ValueError(message_of(storages[k], record))
    # Reached only under jax.vmap, where the cond runs both branches (one call
    # per batch element): nothing failed in this one.
    return np.zeros((), np.int32)

  picked = records[np.asarray(rows)]
  if not _compat.is_tracer(picked):
    fail(picked)
    return None
  out = jax.ShapeDtypeStruct((), jnp.int32)

  def check(picked):
    return _shard_map.cond(
      jnp.any(picked[..., 0] != 0),
      lambda: jax.pure_callback(fail, out, picked, vmap_method="sequential"),
      lambda: jnp.zeros([], jnp.int32),
    )

  mesh = jax.sharding.get_abstract_mesh()
  manual = jax.sharding.AxisType.Manual
  if not mesh.empty and mesh.size > 1 and manual not in mesh.axis_types:
    # Under a mesh a callback runs on one device, and the others wait for it at
    # the step's next collective (XLA:CPU aborts the process after a timeout).
    # In a shard_map over the whole mesh every device runs the check, and all
    # of them fail together (a JaxRuntimeError, as on one device).
    check = jax.shard_map(
      check, mesh=mesh, in_specs=jax.sharding.PartitionSpec(),
      out_specs=jax.sharding.PartitionSpec(), check_vma=False,
    )  # fmt: skip
  return _shard_map.platform_dependent(
    picked, cpu=check, default=lambda picked: jnp.zeros([], jnp.int32)
  )
