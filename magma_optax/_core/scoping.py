"""Which leaves a transform masks, with which label and keep probability.

:func:`plan_leaves` gives each leaf a :class:`LeafPlan`: in scope or not (``where``:
a predicate on ``(path, leaf)``, a pytree of bools, or all floating leaves), its label
(``labels``), keep probability, block layout and the id of its key path (the draws'
key). :func:`match_state` checks a step's plans against the state's.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from magma_optax._core import blocks as _blocks
from magma_optax._core import compat as _compat
from magma_optax._core import labels as _labels
from magma_optax._core import schedules as _schedules
from magma_optax._core import trees as _trees

KeyPath = tuple[Any, ...]
Where = Callable[[KeyPath, Any], bool] | Any | None
Labels = Callable[[KeyPath, Any], str] | Any | None


def path_id(path: KeyPath) -> int:
  """A stable 32-bit id of a key path: CRC-32 of ``jax.tree_util.keystr(path)``.

  It enters every mask draw (not the leaf's position, which restarts inside each
  ``optax.masked`` / ``optax.multi_transform`` group and shifts when a leaf is
  added). CRC-32 is the same on every host and Python process (``hash`` is not).
  An NNX Variable's trailing ``.value`` is not part of it, so an ``nnx.State`` and
  the pure dict of the same model draw the same masks.
  """
  path = _labels.strip_variable(path)
  return zlib.crc32(jax.tree_util.keystr(path).encode("utf-8"))


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """What a mask does to one leaf (static, rebuilt identically at init and update).

  Attributes:
    index: position of the leaf in the flattened tree (to match state leaves).
    label: the leaf's label (for per-label keep probabilities and statistics).
    layout: the leaf's block layout, or ``None`` when the leaf is not masked.
    keep_prob: the leaf's keep probability (float, array or schedule).
    path_id: :func:`path_id` of the leaf's key path (enters the mask's PRNG key).
    path: ``jax.tree_util.keystr`` of the leaf's key path (for messages and the
      layouts a state declares, see :class:`magma_optax._core.blocks.DeclaredAxes`).
  """

  index: int
  label: str
  layout: _blocks.BlockLayout | None
  keep_prob: Any = None
  path_id: int = 0
  path: str = ""


def _per_leaf(spec: Any, paths_leaves, treedef, name: str) -> list[Any]:
  """Expands ``spec`` (callable(path, leaf) or a pytree like the params) per leaf."""
  if callable(spec):
    return [spec(p, x) for p, x in paths_leaves]
  try:
    values = treedef.flatten_up_to(spec)
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"{name} must be a callable (path, leaf) -> value or a pytree with the"
      f" parameters' structure; {e}"
    ) from None
  return list(values)


def _as_bool(value: Any, path: KeyPath) -> bool:
  """A ``where`` entry as a bool; anything but a boolean is an error, so that a
  string such as ``"no"`` or a number cannot silently count as True."""
  if isinstance(value, bool):
    return value
  is_bool_array = jnp.dtype(getattr(value, "dtype", "f4")) == jnp.bool_
  if is_bool_array and jnp.size(value) == 1 and not _compat.is_tracer(value):
    return bool(value)
  raise ValueError(
    f"where must give a bool per leaf (True: masked, False: not); got {value!r} at"
    f" {jax.tree_util.keystr(path)}."
  )


def validate_keep_prob(keep_prob: Any) -> Any:
  """Checks a keep probability, or a mapping label -> keep probability."""
  if isinstance(keep_prob, Mapping):
    if not keep_prob:
      raise ValueError("keep_prob mapping must name at least one label.")
    for label, value in keep_prob.items():
      _schedules.check_probability(f"keep_prob[{label!r}]", value)
    return dict(keep_prob)
  return _schedules.check_probability("keep_prob", keep_prob)


def plan_leaves(
  tree: Any,
  *,
  where: Where,
  labels: Labels,
  keep_prob: Any,
  granularity: _blocks.Granularity,
  stack_axes: int,
  complex_ok: bool = False,
) -> tuple[list[LeafPlan], Any]:
  """Builds the per-leaf plan of a mask for ``tree`` (params or updates).

  Floating-point leaves can be in scope, and complex ones with ``complex_ok`` (the
  block-mask transforms, whose cosines use the real inner product).

  Returns:
    The list of :class:`LeafPlan` (one per leaf, in flattening order) and the treedef.
  """
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves = [x for _, x in paths_leaves]
  # The default labels, and the paper's scope, from the whole tree: a leaf's
  # siblings may say what its own name does not (``_labels.tree_classify``).
  default_labels = labels is None or labels is _labels.transformer_labels
  tree_labels, context = None, []
  if default_labels or where is _labels.attention_mlp_weights:
    slots = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_trees.is_masked)[0]
    context = [p for p, x in slots if _trees.is_masked(x)]
    tree_labels = [label for label, _ in _labels.tree_classify(paths_leaves, context)]
  if where is None:
    scoped = [True] * len(leaves)
  elif where is _labels.attention_mlp_weights:
    scoped = [
      jnp.ndim(x) >= 2 and label in ("attention", "mlp")
      for x, label in zip(leaves, tree_labels, strict=True)
    ]
  else:
    scoped = [
      _as_bool(s, path)
      for s, (path, _) in zip(
        _per_leaf(where, paths_leaves, treedef, "where"), paths_leaves, strict=True
      )
    ]
  if default_labels:
    label_list = tree_labels
  else:
    label_list = _per_leaf(labels, paths_leaves, treedef, "labels")
  by_label = isinstance(keep_prob, Mapping)
  if leaves and (
    where is _labels.attention_mlp_weights or (labels is None and by_label)
  ):
    _labels.warn_if_scope_misses(paths_leaves, context)
  if by_label:
    unknown = set(keep_prob) - set(label_list)
    if unknown and leaves:  # no leaves: optax.tree.map_params' placeholder
      raise ValueError(
        f"keep_prob names labels {sorted(unknown)} that match no parameter; the"
        f" labels present are {sorted(set(label_list))}."
      )
  plans = []
  in_scope = []
  for i, ((path, x), ok, label) in enumerate(
    zip(paths_leaves, scoped, label_list, strict=True)
  ):
    dtype = getattr(x, "dtype", None)
    floating = dtype is not None and (
      jnp.issubdtype(dtype, jnp.floating)
      or (complex_ok and jnp.issubdtype(dtype, jnp.complexfloating))
    )
    if by_label:
      ok = ok and label in keep_prob
      p = keep_prob.get(label)
    else:
      p = keep_prob
    in_scope.append(bool(ok and floating))
    if ok and floating:
      layout = _blocks.block_layout(jnp.shape(x), granularity, stack_axes)
      plans.append(
        LeafPlan(i, str(label), layout, p, path_id(path), jax.tree_util.keystr(path))
      )
    else:
      plans.append(
        LeafPlan(i, str(label), None, None, path_id(path), jax.tree_util.keystr(path))
      )
  if where is not None:
    _labels.warn_if_attention_split(paths_leaves, in_scope)
  return plans, treedef


def plan_scope(
  tree: Any,
  *,
  where: Where,
  granularity: _blocks.Granularity = "tensor",
  stack_axes: int = 0,
  complex_ok: bool = False,
) -> tuple[list[LeafPlan], Any]:
  """:func:`plan_leaves` for transforms that only need the scope (no labels or p)."""
  return plan_leaves(
    tree,
    where=where,
    labels=lambda path, leaf: "",
    keep_prob=1.0,
    granularity=granularity,
    stack_axes=stack_axes,
    complex_ok=complex_ok,
  )


def per_leaf(treedef: Any, state_tree: Any) -> list[Any] | None:
  """The entries of a per-leaf state tree, one per leaf of ``treedef``.

  Per-leaf state is ``treedef.unflatten(values)``, a value being an array or an
  ``optax.MaskedNode`` marking a leaf without state. Splitting it up to
  ``treedef`` (not by flattening with ``MaskedNode`` as a leaf) keeps the
  ``MaskedNode`` *subtrees* that ``optax.masked`` and ``optax.multi_transform``
  put into the parameter tree itself part of the structure. ``None`` if
  ``state_tree`` does not have that structure.
  """
  try:
    return treedef.flatten_up_to(state_tree)
  except (ValueError, TypeError):
    return None


def match_state(plans: list[LeafPlan], state_tree: Any, treedef: Any) -> list[LeafPlan]:
  """Restricts ``plans`` to the leaves that have per-block state.

  The state decided at ``init`` which leaves are masked (from the parameters); at
  ``update`` the incoming tree may differ in dtype (a base optimizer may turn an
  integer parameter's update into floats), so the state is the authority.
  """
  is_masked = lambda x: isinstance(x, optax.MaskedNode)
  state_leaves = per_leaf(treedef, state_tree)
  if state_leaves is None:
    raise ValueError(
      f"the updates have {len(plans)} leaves, in a tree unlike the one the mask"
      " state was built for; init the optimizer with the same parameter tree."
    )
  out = []
  for plan, leaf in zip(plans, state_leaves, strict=True):
    if is_masked(leaf):
      out.append(dataclasses.replace(plan, layout=None, keep_prob=None))
    elif plan.layout is None:
      raise ValueError(
        f"leaf {plan.path or plan.index} had a mask at init but is unscoped now;"
        " `where` and"
        " `labels` must depend only on the path, shape and dtype of a leaf."
      )
    else:
      out.append(plan)
  return out
