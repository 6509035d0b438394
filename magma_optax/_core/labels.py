"""Labels of a transformer's parameters from their paths: attention, MLP, the rest.

The paper applies Magma to the attention and MLP matrices only.
:func:`transformer_labels` reads that from the names along each leaf's key path (the
naming of Flax Linen and NNX, Hugging Face Flax models, MaxText and Gemma, MoE
expert stacks) as ``"attention"``, ``"mlp"`` or ``"other"``, and flags matrices no
rule explains; :func:`attention_mlp_weights` is that scope as a ``where=``
predicate. The rules, in order: ``docs/design/internals.md``.
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
  *modules, leaf_name = names
  if leaf_name in _OTHER_LEAVES or any(map(_is_norm_embed_or_head, modules)):
    return "other", True
  for parent, name in zip(modules, modules[1:], strict=False):
    if name == "gate" and "moe" in parent:  # a MoE router
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


def transformer_labels(path: KeyPath, leaf: Any = None) -> str:
  """Labels a transformer parameter ``"attention"``, ``"mlp"`` or ``"other"`` by path.

  Decided by the leaf's name and the module names along its path (module
  docstring): an attention block or projection gives ``"attention"``, an MLP block
  or projection ``"mlp"``; biases, norms, embeddings, the output head, MoE routers
  and everything else ``"other"``. The leaf's value and rank are not used.

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
  base update, as in arXiv 2602.15322 (Sec. 5). See
  :func:`magma_optax.scope_report` for what it selects in your model.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax, magma_optax as magma
    >>> tx = magma.magma(optax.adam(1e-3), where=magma.attention_mlp_weights)
  """
  return jnp.ndim(leaf) >= 2 and transformer_labels(path) in ("attention", "mlp")


def warn_if_scope_misses(paths_leaves: list[tuple[Any, Any]]) -> None:
  """Warns (once per set of paths) when the default labels find no attention or no
  MLP leaf in a tree that has matrices, naming the matrices no rule recognised."""
  matrices = [(p, x) for p, x in paths_leaves if jnp.ndim(x) >= 2]
  if not matrices:
    return
  kinds = [classify(p, x) for p, x in matrices]
  found = {label for label, _ in kinds}
  missing = [k for k in ("attention", "mlp") if k not in found]
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
