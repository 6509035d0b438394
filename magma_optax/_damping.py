"""Norm damping of updates per block: ``u_b <- u_b / (1 + c * ||u_b||)``.

Large block updates are shrunk, small ones pass almost unchanged; the update norm of a
block is bounded by ``1 / c``. Norms are computed in float32; the output keeps the
update's dtype. Stateless.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from magma_optax import _blocks
from magma_optax import _masks
from magma_optax import _schedules
from magma_optax import _scoping


def damping(
  coefficient: float,
  *,
  granularity: _blocks.Granularity = "tensor",
  stack_axes: int | None = None,
  where: _scoping.Where = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Divides each block of the updates by ``1 + coefficient * ||block||_2``.

  Args:
    coefficient: c >= 0; 0 leaves the updates unchanged.
    granularity: block granularity (``"tensor"``, ``"row"``, ``"column"``,
      ``"element"`` or a tile shape).
    stack_axes: number of leading axes that index stacked layers (``None``: 0).
    where: which leaves are damped (``None``: all floating leaves).

  Returns:
    A stateless ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = optax.chain(optax.adam(1e-3), magma.damping(0.1))
    >>> params = {"w": jnp.ones((3, 4))}
    >>> updates, _ = tx.update({"w": jnp.ones((3, 4))}, tx.init(params), params)
  """
  _schedules.check_range(
    "coefficient", coefficient, 0.0, float("inf"), low_open=False, high_open=True
  )
  granularity = _blocks.validate_granularity(granularity)
  stack_axes = _blocks.validate_stack_axes(stack_axes)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    plans, treedef = _scoping.plan_scope(
      updates, where=where, granularity=granularity, stack_axes=stack_axes
    )
    out = []
    for plan, u in zip(plans, treedef.flatten_up_to(updates), strict=True):
      if plan.layout is None:
        out.append(u)
        continue
      u32 = u.astype(jnp.float32)
      norm = jnp.sqrt(plan.layout.block_sum(u32 * u32))
      out.append(_masks.scale_blocks(u, plan.layout, 1.0 / (1.0 + coefficient * norm)))
    return treedef.unflatten(out), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
