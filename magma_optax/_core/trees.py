"""Parameter-shaped subtrees of optimizer states: one helper, used everywhere.

Many things in a state are trees *like the parameters* (Adam's ``mu``, this
package's scores, masks and momenta), also with ``optax.MaskedNode`` for other
groups' leaves inside ``optax.masked``. :func:`split_like` gives a node's entries per
parameter leaf, :func:`map_like` rebuilds every such subtree of a state,
:func:`split_param_mask` restricts a full-tree extra argument to a group's tree, and
:func:`same_shape_groups` / :func:`map_stacked` run same-shaped leaves as one stack.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from magma_optax._core import shard_map as _shard_map
from magma_optax._core import sharded as _sharded


def is_masked(x: Any) -> bool:
  """``True`` for ``optax.MaskedNode`` (an empty slot in a group's tree)."""
  return isinstance(x, optax.MaskedNode)


class _NotLike(Exception):
  pass


def split_like(node: Any, params_def: Any) -> list[Any] | None:
  """``node``'s entries in the flattening order of the parameters' treedef.

  Args:
    node: any subtree of a state.
    params_def: ``jax.tree.structure(params)`` (a group's tree, with ``MaskedNode``
      subtrees, is fine too).

  Returns:
    One entry per leaf of ``params_def``: the node's leaf there, or
    ``optax.MaskedNode()`` where the node masks that leaf (or a subtree holding it);
    ``None`` if ``node`` does not have that structure or has no unmasked entry.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from magma_optax._core import trees as _trees
    >>> params = {"a": jnp.ones(2), "b": jnp.ones(3)}
    >>> state = optax.adam(1e-3).init(params)
    >>> params_def = jax.tree.structure(params)
    >>> [e.shape for e in _trees.split_like(state[0].mu, params_def)]
    [(2,), (3,)]
    >>> _trees.split_like(state[0].count, params_def) is None
    True
    >>> shifted = _trees.map_like(lambda i, x: x + i, state, params_def)
    >>> shifted[0].nu["b"].tolist()
    [1.0, 1.0, 1.0]
  """
  n = params_def.num_leaves
  if n == 0:
    return None
  try:
    entries = params_def.flatten_up_to(node)
  except (ValueError, TypeError):
    entries = None
  if entries is None:
    skeleton = params_def.unflatten(range(n))
    entries = [optax.MaskedNode()] * n

    def visit(x: Any, slot: Any) -> Any:
      if is_masked(x):
        return x  # every parameter leaf in ``slot`` stays MaskedNode
      if not isinstance(slot, int) or isinstance(x, (dict, list, tuple)):
        raise _NotLike
      entries[slot] = x
      return x

    try:
      jax.tree.map(visit, node, skeleton, is_leaf=is_masked)
    except (_NotLike, ValueError, TypeError):
      return None
  if all(is_masked(e) or isinstance(e, (dict, list, tuple)) for e in entries):
    return None
  if any(isinstance(e, (dict, list, tuple)) and not is_masked(e) for e in entries):
    return None  # a container where a parameter leaf should be
  return entries


def map_like(
  fn: Callable[..., Any],
  state: Any,
  params_def: Any,
  *more: Any,
  other: Callable[[Any], Any] | None = None,
  shapes: Sequence[tuple[int, ...]] | None = None,
) -> Any:
  """Maps ``fn(i, entry, *more_entries)`` over the entries of every parameter-like
  subtree.

  Args:
    fn: called with the parameter leaf index ``i`` and the state's entry there (and
      the entries of ``more`` at the same place), for every entry that is not
      ``MaskedNode``; returns the new entry.
    state: an optimizer state (any pytree).
    params_def: ``jax.tree.structure(params)``.
    *more: trees with ``state``'s structure (e.g. the previous state), read only.
    other: applied to every leaf of ``state`` outside the parameter-like subtrees
      except ``MaskedNode`` (default: unchanged).
    shapes: if given, a subtree counts as parameter-like only where every entry
      that is not ``MaskedNode`` is an array of shape ``shapes[i]`` (a state kept
      at other shapes than the parameters', e.g. compact storage).

  Returns:
    ``state`` with the same structure and the mapped entries.
  """

  def entries_of(x: Any) -> list[Any] | None:
    entries = split_like(x, params_def)
    if entries is None or shapes is None:
      return entries
    for e, shape in zip(entries, shapes, strict=True):
      if not is_masked(e) and tuple(getattr(e, "shape", (None,))) != tuple(shape):
        return None
    return entries

  def rebuild(node: Any, *rest: Any) -> Any:
    entries = entries_of(node)
    if entries is None:
      return node if other is None or is_masked(node) else other(node)
    rest_entries = [split_like(r, params_def) for r in rest]
    new = iter(
      fn(i, e, *(r[i] for r in rest_entries))
      for i, e in enumerate(entries)
      if not is_masked(e)
    )
    return jax.tree.map(
      lambda x: x if is_masked(x) else next(new), node, is_leaf=is_masked
    )

  return jax.tree.map(
    rebuild,
    state,
    *more,
    is_leaf=lambda x: is_masked(x) or entries_of(x) is not None,
  )


def check_shapes(
  transform: str, updates: Any, like: Any, what: str = "its parameter"
) -> None:
  """Raises ``ValueError`` where a leaf of ``updates`` is shaped unlike ``like``'s.

  Gradients whose shapes are not their parameters' would otherwise broadcast
  silently or fail deep inside a step. Shapes are static, so this runs once, when
  the step is traced. ``like`` is the params (or a parameter-shaped part of a
  state); ``None``, a tree of another structure, or ``MaskedNode`` leaves (a group
  of ``optax.masked``) are not compared.

  Raises:
    ValueError: naming the transform, the leaf's path and both shapes.
  """
  if like is None:
    return
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
  entries = split_like(like, treedef)
  if entries is None:
    return
  for (path, u), x in zip(paths_leaves, entries, strict=True):
    if x is None or is_masked(x) or not (hasattr(x, "shape") or _is_number(x)):
      continue
    if tuple(jnp.shape(u)) != tuple(jnp.shape(x)):
      raise ValueError(
        f"{transform}: the update (gradient) at {jax.tree_util.keystr(path)} has"
        f" shape {tuple(jnp.shape(u))}, but {what} has shape"
        f" {tuple(jnp.shape(x))}. Updates must have their parameters' shapes (a"
        " gradient of another shape would be broadcast or fail inside the step)."
      )


def _is_number(x: Any) -> bool:
  return isinstance(x, int | float | complex) and not isinstance(x, bool)


def split_param_mask(treedef: Any, param_mask: Any) -> list[Any]:
  """``param_mask`` (a pytree like the parameters) split up to ``treedef``.

  Inside ``optax.masked`` / ``optax.multi_transform`` a transform sees its group's
  tree, with ``optax.MaskedNode`` for whole subtrees, but extra arguments such as
  ``param_mask`` pass through unchanged: a full mask is then restricted to the
  group first.

  Raises:
    ValueError: if ``param_mask`` has neither structure.
  """
  try:
    return treedef.flatten_up_to(param_mask)
  except (ValueError, TypeError):
    pass
  is_slot = lambda x: x is None or isinstance(x, optax.MaskedNode)
  skeleton = treedef.unflatten([None] * treedef.num_leaves)
  try:
    group = jax.tree.map(
      lambda slot, m: m if slot is None else slot,
      skeleton,
      param_mask,
      is_leaf=is_slot,
    )
    return treedef.flatten_up_to(group)
  except (ValueError, TypeError) as e:
    raise ValueError(f"param_mask must be a pytree like the params; {e}") from None


def split_param_mask_like(
  treedef: Any, param_mask: Any, leaves: list[Any]
) -> list[Any]:
  """:func:`split_param_mask`, each mask checked against its leaf and made bool.

  A mask leaf (not ``None`` or ``optax.MaskedNode``) must have its parameter's
  shape: broadcasting one would silently mask other entries, or grow the update
  and the state. Masks of any dtype are read as truth values.

  Raises:
    ValueError: naming the leaf, if a mask's shape is not its parameter's.
  """
  masks = split_param_mask(treedef, param_mask)
  out = []
  for i, (m, x) in enumerate(zip(masks, leaves, strict=True)):
    if m is None or is_masked(m):
      out.append(m)
      continue
    m = jnp.asarray(m)
    if m.shape != jnp.shape(x):
      raise ValueError(
        f"param_mask leaf {i} has shape {m.shape}; its parameter has"
        f" {jnp.shape(x)} (a mask is not broadcast)."
      )
    out.append(m.astype(jnp.bool_))
  return out


def same_shape_groups(
  arrays: Sequence[Any], max_size: int, also: Sequence[Any] | None = None
) -> list[list[int]]:
  """Indices of ``arrays`` grouped by shape, dtype, explicit sharding and, inside
  ``jax.shard_map``, the manual axes they vary along (stacked with a leaf split
  along an axis, a replicated one would come back varying along it), in order,
  each group split so that it holds at most ``max_size`` entries (or one array).
  ``also``: arrays stacked alongside (one per entry of ``arrays``), whose dtype
  and varying axes join the key."""
  groups: dict[Any, list[list[int]]] = {}
  for i, x in enumerate(arrays):
    key = (
      jnp.shape(x),
      jnp.result_type(x),
      _sharded.explicit_spec(x),
      _shard_map.varying(x),
    )
    if also is not None:
      key += (jnp.result_type(also[i]), _shard_map.varying(also[i]))
    chunks = groups.setdefault(key, [[]])
    if chunks[-1] and (len(chunks[-1]) + 1) * math.prod(jnp.shape(x)) > max_size:
      chunks.append([])
    chunks[-1].append(i)
  return [c for chunks in groups.values() for c in chunks]


def map_stacked(fn: Callable[..., Any], *columns: Sequence[jax.Array]) -> list:
  """``[fn(*row) for row in zip(*columns)]`` for same-shaped rows, compiled once.

  Several rows are stacked and run through one ``lax.map``, so the program holds
  ``fn``'s computation once instead of once per row. On XLA:CPU the host-side launch
  of every step grows with the program's buffers, including those of loops that do
  not run (``python3 benchmarks/launch_cost.py``). ``fn`` returns a pytree of
  arrays.
  """
  rows = len(columns[0])
  stacked = [jnp.stack(list(c)) for c in columns]
  out = jax.lax.map(lambda xs: fn(*xs), stacked)
  return [jax.tree.map(lambda x, j=j: x[j], out) for j in range(rows)]


_CONTAINERS = tuple(jax.tree.structure(x) for x in ({}, [], (), None))


def is_placeholder(treedef: Any) -> bool:
  """Whether ``treedef`` is a leafless custom node: what ``optax.tree.map_params``
  hands ``init`` in place of the parameters. A state's static fields are then a
  leaf, so that the map keeps the real state's (a prefix of any subtree)."""
  return (
    treedef.num_leaves == 0
    and treedef.num_nodes == 1
    and treedef not in _CONTAINERS
    and treedef != jax.tree.structure(optax.MaskedNode())
  )
