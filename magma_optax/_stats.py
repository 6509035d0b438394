"""What the masks decided at the last step, for logging."""

from __future__ import annotations

from typing import Any

import jax

from magma_optax import _alignment
from magma_optax import _masks

_MASK_STATES = (_alignment.AlignmentMaskState, _masks.BernoulliMaskState)


def mask_stats(opt_state: Any) -> dict[str, Any]:
  """Returns the last step's masks, scores and active fractions from an optimizer state.

  Finds the first mask state (of :func:`magma`, :func:`skip_update`,
  :func:`bernoulli_mask` or :func:`alignment_mask`) anywhere in ``opt_state`` -- also
  inside ``optax.chain``, ``optax.MultiSteps`` or ``optax.inject_hyperparams`` -- and
  reads what it stored. No recomputation, jit-friendly.

  Args:
    opt_state: an optimizer state containing a mask state.

  Returns:
    A dict with

    * ``"mask"``: pytree like the params, per leaf the bool block mask z of the last
      step (``optax.MaskedNode`` where unscoped);
    * ``"scores"``: per leaf the f32 block scores s_t (Magma), or ``None``
      (SkipUpdate);
    * ``"active_fraction"``: f32 scalar, fraction of scoped entries kept;
    * ``"active_fraction_by_label"``: dict label -> f32 scalar;
    * ``"step"``: int32 scalar, number of updates taken.

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
  is_mask_state = lambda x: isinstance(x, _MASK_STATES)
  for node in jax.tree.leaves(opt_state, is_leaf=is_mask_state):
    if is_mask_state(node):
      return {
        "mask": node.mask,
        "scores": getattr(node, "scores", None),
        "active_fraction": node.active_fraction,
        "active_fraction_by_label": node.active_fraction_by_label,
        "step": node.count,
      }
  raise ValueError(
    "mask_stats found no mask state in opt_state; it reads the state of"
    " magma, skip_update, bernoulli_mask or alignment_mask."
  )
