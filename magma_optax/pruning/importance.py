"""Importance scores: how much each weight matters, for the pruning masks.

``"magnitude_grad"`` (default, ``|W| * |g|``), ``"magnitude"`` (``|W|``) or a
callable ``(param, grad) -> scores``. A complex weight or gradient counts by its
magnitude. Scores are float32; NaN becomes ``-inf`` (it ranks last) and ``-0.0``
becomes ``+0.0`` (the two tie).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from magma_optax.pruning import topk as _topk

Importance = str | Callable[[jax.Array, jax.Array], jax.Array]

IMPORTANCES = ("magnitude_grad", "magnitude")


def validate(importance: Any) -> Importance:
  """Checks an importance: one of :data:`IMPORTANCES` or a callable."""
  if not (callable(importance) or importance in IMPORTANCES):
    raise ValueError(
      f"importance must be one of {IMPORTANCES} or a callable (param, grad) ->"
      f" scores; got {importance!r}."
    )
  return importance


def _real(x: jax.Array) -> jax.Array:
  """``x`` as float32; a complex ``x`` as its magnitude (whose abs is itself)."""
  if jnp.iscomplexobj(x):
    return jnp.abs(x).astype(jnp.float32)
  return x.astype(jnp.float32)


def scores(
  importance: Importance, param: jax.Array, grad: jax.Array, nan_last: bool = True
) -> jax.Array:
  """Per-entry f32 importance of ``param`` (higher = keep); NaN -> ``-inf``.

  ``nan_last=False`` leaves NaN (and -0.0) as they are, for a caller that sums the
  scores and handles NaN in the sums (:func:`magma_optax.pruning.topk.tile_sum`): a
  select before the sum makes XLA:CPU write every score to memory first.

  Example:
    >>> import jax.numpy as jnp
    >>> from magma_optax.pruning import importance as _importance
    >>> w, g = jnp.array([1.0, -2.0, jnp.nan]), jnp.array([3.0, 0.5, 1.0])
    >>> _importance.scores("magnitude_grad", w, g).tolist()
    [3.0, 1.0, -inf]
  """
  p, g = (_real(x) for x in (param, grad))
  if importance == "magnitude_grad":
    s = jnp.abs(p) * jnp.abs(g)
  elif importance == "magnitude":
    s = jnp.abs(p)
  else:
    s = importance(param, grad)
    if jnp.iscomplexobj(s):
      raise ValueError(
        f"importance callable returned complex scores ({jnp.result_type(s)}) for"
        f" a parameter of dtype {param.dtype}; return real scores, e.g."
        " jnp.abs(param) * jnp.abs(grad)."
      )
    s = jnp.asarray(s, jnp.float32)
    if s.shape != param.shape:
      raise ValueError(
        f"importance callable returned shape {s.shape} for a parameter of shape"
        f" {param.shape}; it must return one score per entry."
      )
  if not nan_last:
    return s
  return _topk.ranked_scores(s)
