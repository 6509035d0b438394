"""Labels of a transformer's parameters from their paths: attention, MLP, the rest.

The paper applies Magma to the attention and MLP matrices only.
:func:`transformer_labels` reads that from the names along each leaf's key path (the
naming of Flax Linen and NNX, Hugging Face Flax models, MaxText and Gemma, MoE
expert stacks) as ``"attention"``, ``"mlp"`` or ``"other"``, and flags matrices no
rule explains; :func:`attention_mlp_weights` is that scope as a ``where=``
predicate. On a whole tree, :func:`tree_classify` also reads a leaf's siblings
(an ``out`` beside ``query`` and ``key`` is attention). The rules, in order:
``docs/design/internals.md``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp

KeyPath = tuple[Any, ...]

# Leaf names that are never a weight matrix of the paper's scope.
_OTHER_LEAVES = frozenset({
  "bias", "b", "scale", "gamma", "beta", "embedding", "embeddings",
  "input_embedding", "pos_embedding", "position_embedding",
})  # fmt: skip
_NORM_OR_EMBED_SUBSTRINGS = ("norm", "embed", "lm_head", "logits", "pooler")
_OTHER_MODULES = frozenset({
  "head", "ln", "ln1", "ln2", "ln_1", "ln_2", "ln_f", "wte", "wpe", "classifier",
  "router", "score",
})  # fmt: skip
_ATTENTION_BLOCKS = ("attn", "attention", "mha")
_MLP_BLOCKS = (
  "mlp", "ffn", "ffw", "feed_forward", "feedforward", "densereludense",
  "intermediate", "moe", "experts",
)  # fmt: skip
_ATTENTION_PROJECTIONS = frozenset({
  "q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "qkv", "qkv_proj", "c_attn",
  "query", "key", "value", "wq", "wk", "wv", "q_einsum", "kv_einsum",
  "qkv_einsum", "attn_vec_einsum",
})  # fmt: skip
_WARNED: set[tuple[str, ...]] = set()
# Children of a module that make it an attention module (its other children are
# then attention too): a query and a key projection, or a fused one.
_QUERY_PROJECTIONS = frozenset({"query", "q_proj", "wq", "q", "q_einsum"})
_KEY_PROJECTIONS = frozenset({"key", "k_proj", "wk", "k", "kv_einsum"})
_FUSED_PROJECTIONS = frozenset({"qkv", "qkv_proj", "c_attn", "qkv_einsum"})
_MLP_PROJECTIONS = frozenset({
  "fc1", "fc2", "c_fc", "w1", "w2", "w3", "wi", "wi_0", "wi_1", "gate_proj",
  "up_proj", "down_proj", "dense_h_to_4h", "dense_4h_to_h", "gating_einsum",
})  # fmt: skip


def strip_variable(path: KeyPath) -> KeyPath:
  """``path`` without a trailing NNX ``.value`` (or ``.raw_value``) attribute.

  ``nnx.State`` leaves are Variables, so their paths end in that attribute (a
  ``GetAttrKey``, unlike a ``DictKey`` named "value", e.g. a value projection);
  without it the path is the one of the same leaf in the pure dict.
  """
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey):
    if path[-1].name in ("value", "raw_value"):
      return tuple(path[:-1])
  return tuple(path)


def path_names(path: KeyPath) -> tuple[str, ...]:
  """The names along a key path, lower-cased; a trailing NNX ``.value`` is dropped."""
  names = []
  for entry in strip_variable(path):
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        names.append(str(getattr(entry, attr)).lower())
        break
    else:
      names.append(str(entry).lower())
  return tuple(names)


def _is_norm_embed_or_head(name: str) -> bool:
  return (
    any(s in name for s in _NORM_OR_EMBED_SUBSTRINGS)
    or name in _OTHER_MODULES
    or name.endswith("_ln")
    or _is_head(name)
  )


def _is_head(name: str) -> bool:
  """An output head named after what it holds (``mlp_head``, ``cls_head``,
  ``head_0``): a head, not its contents; an attention head is not one."""
  head = name.endswith("_head") or name.startswith("head_")
  return head and not any(b in name for b in _ATTENTION_BLOCKS)


def _named_other(names: tuple[str, ...]) -> bool:
  """Rule 1: the leaf's name or a module on its path says "other"."""
  *modules, leaf_name = names
  if leaf_name in _OTHER_LEAVES or any(map(_is_norm_embed_or_head, modules)):
    return True
  return any(
    name == "gate" and "moe" in parent  # a MoE router
    for parent, name in zip(modules, modules[1:], strict=False)
  )


def classify(path: KeyPath, leaf: Any = None) -> tuple[str, bool]:
  """``(label, recognised)`` of a leaf by the rules in the module docstring.

  ``recognised`` is False only for matrices (rank >= 2, when ``leaf`` is given)
  that no rule explained: candidates for a ``where=`` / ``labels=`` the user
  should pass explicitly.
  """
  names = path_names(path)
  if not names:
    return "other", True
  modules = names[:-1]
  if _named_other(names):
    return "other", True
  if any(b in m for m in modules for b in _ATTENTION_BLOCKS):
    return "attention", True
  bert_mlp_output = any(
    m == "output" and nxt == "dense" for m, nxt in zip(modules, names[1:], strict=False)
  )
  if any(b in m for m in modules for b in _MLP_BLOCKS) or bert_mlp_output:
    return "mlp", True
  if any(m in _ATTENTION_PROJECTIONS for m in modules):
    return "attention", True
  if any(m in _MLP_PROJECTIONS for m in modules):
    return "mlp", True
  return "other", leaf is None or jnp.ndim(leaf) < 2


def _attention_modules(names: list[tuple[str, ...]]) -> set[tuple[str, ...]]:
  """The modules (name prefixes) whose children include a query and a key
  projection, or a fused one."""
  children: dict[tuple[str, ...], set[str]] = {}
  for n in names:
    for i in range(len(n) - 1):
      children.setdefault(n[:i], set()).add(n[i])
  return {
    prefix
    for prefix, kids in children.items()
    if (kids & _QUERY_PROJECTIONS and kids & _KEY_PROJECTIONS)
    or kids & _FUSED_PROJECTIONS
  }


def tree_classify(
  paths_leaves: list[tuple[KeyPath, Any]], context: list[KeyPath] = ()
) -> list[tuple[str, bool]]:
  """:func:`classify` of every leaf, with the whole tree's rule (module docstring):
  a leaf that rules 2-5 call ``"other"`` under an attention module (one whose
  children include a query and a key projection, or a fused one) is
  ``"attention"``. ``context``: paths of more entries of the tree, e.g. the
  ``optax.MaskedNode`` slots of a group that hold other groups' leaves, whose names
  count as siblings."""
  names = [path_names(p) for p, _ in paths_leaves]
  attention = _attention_modules(names + [path_names(p) for p in context])
  out = []
  for n, (path, leaf) in zip(names, paths_leaves, strict=True):
    label, recognised = classify(path, leaf)
    if label == "other" and n and not _named_other(n):
      if any(n[:i] in attention for i in range(len(n))):
        label, recognised = "attention", True
    out.append((label, recognised))
  return out


def attention_groups(paths_leaves: list[tuple[KeyPath, Any]]) -> list[Any]:
  """Per leaf, the attention module its matrix belongs to (a name prefix), or
  ``None``: leaves that :func:`tree_classify` labels ``"attention"`` grouped by the
  module that holds their projection (the path without the projection and leaf)."""
  labels = tree_classify(paths_leaves)
  return [
    path_names(p)[:-2] if label == "attention" and jnp.ndim(x) >= 2 else None
    for (p, x), (label, _) in zip(paths_leaves, labels, strict=True)
  ]


def warn_if_attention_split(
  paths_leaves: list[tuple[KeyPath, Any]], scoped: list[bool]
) -> None:
  """Warns (once per set of paths) when an attention module's matrices are only
  partly in scope (``scoped``: per leaf, whether the transform acts on it)."""
  groups: dict[tuple[str, ...], tuple[list[str], list[str]]] = {}
  for (path, _), group, ok in zip(
    paths_leaves, attention_groups(paths_leaves), scoped, strict=True
  ):
    if group is not None:
      groups.setdefault(group, ([], []))[0 if ok else 1].append(
        jax.tree_util.keystr(strip_variable(path))
      )
  split = [(g, inside, out) for g, (inside, out) in groups.items() if inside and out]
  if not split:
    return
  signature = ("split", *(p for _, inside, out in split for p in inside + out))
  if signature in _WARNED:
    return
  _WARNED.add(signature)
  group, inside, out = split[0]
  more = f" (and {len(split) - 1} more modules)" if len(split) > 1 else ""
  warnings.warn(
    f"The attention module {'/'.join(group) or '(root)'}{more} is only partly in"
    f" scope: {', '.join(inside)} masked, {', '.join(out)} not. The paper masks"
    " all of a block's attention projections; check where= with"
    " magma.scope_report(params, where=...), which shows each leaf's label.",
    UserWarning,
    stacklevel=_stacklevel_outside_package(),
  )


def transformer_labels(path: KeyPath, leaf: Any = None) -> str:
  """Labels a transformer parameter ``"attention"``, ``"mlp"`` or ``"other"`` by path.

  Decided by the leaf's name and the module names along its path (module
  docstring): an attention block or projection gives ``"attention"``, an MLP block
  or projection ``"mlp"``; biases, norms, embeddings, output heads (``lm_head``,
  ``mlp_head``, ...), MoE routers and everything else ``"other"``. The leaf's value
  and rank are not used. As a transform's ``labels=`` (the default) it labels the
  whole tree, where the siblings of a leaf count too (an ``out`` projection next
  to ``query`` and ``key`` is attention, module docstring).

  Args:
    path: a JAX key path, as from ``jax.tree_util.tree_flatten_with_path``.
    leaf: unused; accepted so the function works as a ``labels=`` callable.

  Returns:
    ``"attention"``, ``"mlp"`` or ``"other"``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import magma_optax as magma
    >>> params = {"layer_0": {"attn": {"q_proj": {"kernel": jnp.ones((4, 4)),
    ...                                           "bias": jnp.ones((4,))}},
    ...                       "mlp": {"up_proj": {"kernel": jnp.ones((4, 8))}}},
    ...           "embed": {"embedding": jnp.ones((10, 4))}}
    >>> jax.tree_util.tree_map_with_path(magma.transformer_labels, params)
    {'embed': {'embedding': 'other'}, 'layer_0': {'attn': {'q_proj': {'bias': 'other', 'kernel': 'attention'}}, 'mlp': {'up_proj': {'kernel': 'mlp'}}}}
  """  # noqa: E501
  del leaf
  return classify(path)[0]


def attention_mlp_weights(path: KeyPath, leaf: Any) -> bool:
  """The paper's scope: the attention and MLP matrices (rank >= 2) of a transformer.

  Use as ``where=magma.attention_mlp_weights``. Biases, norms, embeddings and the
  output head are out of scope by name, whatever their rank, and take the plain
  base update, as in arXiv 2602.15322 (Sec. 5). As a transform's ``where=`` it
  selects from the whole tree's labels (:func:`transformer_labels`). See
  :func:`magma_optax.scope_report` for what it selects in your model.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax, magma_optax as magma
    >>> tx = magma.magma(optax.adam(1e-3), where=magma.attention_mlp_weights)
  """
  return jnp.ndim(leaf) >= 2 and transformer_labels(path) in ("attention", "mlp")


def warn_if_scope_misses(
  paths_leaves: list[tuple[Any, Any]], context: list[KeyPath] = ()
) -> None:
  """Warns (once per set of paths) when the default labels find no attention or no
  MLP leaf in a tree that has matrices, naming the matrices no rule recognised
  (``context``: the paths of a group's ``MaskedNode`` slots, whose leaves are
  another group's: what they hold is not missing)."""
  matrices = [(p, x) for p, x in paths_leaves if jnp.ndim(x) >= 2]
  if not matrices:
    return
  kinds = tree_classify(matrices, [p for p, _ in paths_leaves] + list(context))
  found = {label for label, _ in kinds}
  # A group of optax.masked / multi_transform: what its MaskedNode slots hold is
  # another group's, not missing from the model.
  elsewhere = {classify(p)[0] for p in context}
  missing = [k for k in ("attention", "mlp") if k not in found | elsewhere]
  if not missing:
    return
  unknown = tuple(
    jax.tree_util.keystr(p)
    for (p, _), (_, recognised) in zip(matrices, kinds, strict=True)
    if not recognised
  )
  signature = (*missing, *unknown)
  if signature in _WARNED:
    return
  _WARNED.add(signature)
  shown = ", ".join(unknown[:8]) + (" ..." if len(unknown) > 8 else "")
  present = sorted(found & {"attention", "mlp"})
  what = f"only {' and '.join(present)} matrices" if present else "no matrix at all"
  warnings.warn(
    f"The paper's scope (attention_mlp_weights / transformer_labels) found no"
    f" {' and no '.join(missing)} matrix in these parameters, so Magma masks"
    f" {what}. Matrices that no name rule recognised: {shown or 'none'}. Check"
    " with magma.scope_report(params, where=...) and pass where= (a callable"
    " (path, leaf) -> bool, or a pytree of bools) or labels= explicitly.",
    UserWarning,
    stacklevel=_stacklevel_outside_package(),
  )


def _stacklevel_outside_package() -> int:
  """A ``stacklevel`` pointing at the first caller outside magma_optax."""
  # The package's folder (this module is in magma_optax/_core).
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
  frame, level = sys._getframe(1), 1
  while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
    package
  ):
    frame, level = frame.f_back, level + 1
  return level
