"""What the masks decided at the last step, for logging."""

from __future__ import annotations

from typing import Any

import jax
import optax

from magma_optax.masking import engine as _engine


def _stats_of(node: Any) -> dict[str, Any]:
  return {
    "mask": node.mask,
    "scores": getattr(node, "scores", None),
    "active_fraction": node.active_fraction,
    "active_fraction_by_label": node.active_fraction_by_label,
    "step": node.count,
  }


def _merge(trees: list[Any]) -> Any:
  """Per leaf, the one entry that is not ``MaskedNode`` (groups are disjoint)."""
  is_node = lambda x: isinstance(x, optax.MaskedNode)
  first = lambda *xs: next((x for x in xs if not is_node(x)), xs[0])
  return jax.tree.map(first, *trees, is_leaf=is_node)


def mask_stats(opt_state: Any) -> dict[str, Any]:
  """Returns the last step's masks, scores and active fractions from an optimizer state.

  Finds every mask state (of :func:`magma`, :func:`skip_update`,
  :func:`bernoulli_mask`, :func:`alignment_mask` or :func:`adam_magma`) anywhere in
  ``opt_state`` -- also inside ``optax.chain``, ``optax.MultiSteps``,
  ``optax.inject_hyperparams`` or the groups of ``optax.multi_transform`` /
  ``optax.masked`` -- and reads what it stored. No recomputation, jit-friendly.

  Args:
    opt_state: an optimizer state containing one or more mask states.

  Returns:
    A dict with

    * ``"mask"``: pytree like the params, per leaf the bool block mask z of the last
      step (``optax.MaskedNode`` where unscoped); with several groups, each leaf's
      entry comes from the group that masks it;
    * ``"scores"``: per leaf the f32 block scores s_t (Magma), or ``None``
      (SkipUpdate only), merged over the Magma groups in the same way;
    * ``"active_fraction"``: f32 scalar, fraction of scoped entries kept, and
      ``"active_fraction_by_label"``: dict label -> f32 scalar. With several groups
      these are ``None``: each group's fraction is over its own entries, and they
      do not combine without the groups' sizes; read them from ``"groups"``;
    * ``"step"``: int32 scalar, number of updates taken (of the first group);
    * ``"groups"``: dict ``jax.tree_util.keystr`` path of each mask state in
      ``opt_state`` -> the keys above for that state alone.

  Raises:
    ValueError: if ``opt_state`` contains no mask state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = magma.magma(optax.adam(1e-3))
    >>> params = {"w": jnp.ones((3, 4))}
    >>> _, state = tx.update({"w": jnp.ones((3, 4))}, tx.init(params), params)
    >>> float(magma.mask_stats(state)["active_fraction"]) in (0.0, 1.0)
    True
  """
  is_mask_state = _engine.is_mask_state
  found = [
    (jax.tree_util.keystr(path), node)
    for path, node in jax.tree_util.tree_flatten_with_path(
      opt_state, is_leaf=is_mask_state
    )[0]
    if is_mask_state(node)
  ]
  if not found:
    raise ValueError(
      "mask_stats found no mask state in opt_state; it reads the state of"
      " magma, skip_update, bernoulli_mask, alignment_mask or adam_magma."
    )
  groups = {path: _stats_of(node) for path, node in found}
  first = groups[found[0][0]]
  if len(found) == 1:
    return {**first, "groups": groups}
  scores = [g["scores"] for g in groups.values() if g["scores"] is not None]
  return {
    "mask": _merge([g["mask"] for g in groups.values()]),
    "scores": _merge(scores) if scores else None,
    "active_fraction": None,
    "active_fraction_by_label": None,
    "step": first["step"],
    "groups": groups,
  }
