"""Weight decay of masked weights (AdamS-style), ramped up over training.

:func:`masked_weight_decay` adds ``lambda_t * W`` to the gradient of the weights
that ``param_mask`` prunes, with ``lambda_t`` ramping linearly; placed before the
base optimizer, its term enters the second moment.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from magma_optax._core import schedules as _schedules
from magma_optax._core import shard_map as _shard_map
from magma_optax._core import trees as _trees


class MaskedWeightDecayState(NamedTuple):
  """State of :func:`masked_weight_decay`.

  Attributes:
    count: int32 scalar, number of updates so far.
    coefficient: f32 scalar, the coefficient lambda_t used at the last update.
  """

  count: jax.Array
  coefficient: jax.Array


def masked_weight_decay(
  strength: float, *, ramp_steps: int
) -> optax.GradientTransformationExtraArgs:
  r"""Adds ``lambda_t (1 - M) W`` to the updates: decay of the masked-out weights.

  .. math::

     g_t \leftarrow g_t + \lambda_t (1 - M) \odot W_t, \qquad
     \lambda_t = \mathrm{strength}\cdot\min(t / \mathrm{ramp\_steps}, 1)

  with ``t`` the update count (0 at the first update). Place it *before* the base
  optimizer: ``optax.chain(magma.masked_weight_decay(1e-2, ramp_steps=1000),
  optax.adam(1e-3))``.

  Args:
    strength: final coefficient >= 0.
    ramp_steps: steps of the linear ramp from 0 to ``strength`` (>= 0; 0 means the
      full strength from the first step).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a
    :class:`MaskedWeightDecayState`. ``update`` needs ``params`` and the extra arg
    ``param_mask`` (a pytree like the params of bool arrays; ``None`` /
    ``optax.MaskedNode`` leaves are not decayed).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = optax.chain(magma.masked_weight_decay(0.1, ramp_steps=0), optax.sgd(1.0))
    >>> params = {"w": jnp.ones(4)}
    >>> mask = {"w": jnp.array([True, True, False, False])}
    >>> updates, _ = tx.update({"w": jnp.zeros(4)}, tx.init(params), params,
    ...                        param_mask=mask)
    >>> updates["w"].tolist()
    [-0.0, -0.0, -0.10000000149011612, -0.10000000149011612]

  References:
    Zhou et al., Effective Sparsification of Neural Networks with Global Sparsity
    Constraint, CVPR 2021; the seed's CAST recipe (AdamS-style adaptive decay).
  """
  _schedules.check_range(
    "strength", strength, 0.0, float("inf"), low_open=False, high_open=True
  )
  if isinstance(ramp_steps, bool) or not isinstance(ramp_steps, int) or ramp_steps < 0:
    raise ValueError(f"ramp_steps must be an int >= 0; got {ramp_steps!r}.")

  def init_fn(params):
    del params
    return MaskedWeightDecayState(
      count=jnp.zeros([], jnp.int32), coefficient=jnp.zeros([], jnp.float32)
    )

  def update_fn(updates, state, params=None, *, param_mask=None, **extra_args):
    del extra_args
    if params is None or param_mask is None:
      raise ValueError(
        "masked_weight_decay needs params and the extra arg param_mask= (use it"
        " inside periodic_mask, or pass param_mask yourself)."
      )
    _trees.check_shapes("masked_weight_decay", updates, params)
    if ramp_steps == 0:
      coef = jnp.asarray(strength, jnp.float32)
    else:
      frac = jnp.minimum(state.count.astype(jnp.float32) / ramp_steps, 1.0)
      coef = jnp.asarray(strength, jnp.float32) * frac
    flat_u, treedef = jax.tree.flatten(updates)
    flat_p = treedef.flatten_up_to(params)
    flat_m = _trees.split_param_mask_like(treedef, param_mask, flat_u)
    out = []
    for u, p, m in zip(flat_u, flat_p, flat_m, strict=True):
      if m is None or isinstance(m, optax.MaskedNode):
        out.append(u)
        continue
      pruned = jnp.logical_not(m).astype(u.dtype)
      out.append(u + (coef.astype(u.dtype) * pruned) * p.astype(u.dtype))
    return treedef.unflatten(out), MaskedWeightDecayState(
      count=optax.safe_increment(state.count), coefficient=coef
    )

  return optax.GradientTransformationExtraArgs(
    *_shard_map.typed(init_fn, update_fn, param_mask=True)
  )
