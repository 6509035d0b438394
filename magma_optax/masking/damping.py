"""Norm damping of updates per block: ``u_b <- u_b / (1 + c * ||u_b||)``.

Large block updates are shrunk, small ones pass almost unchanged; the update norm of a
block is bounded by ``1 / c``. Norms are computed in float32 after dividing the block
by its largest magnitude, so they cannot overflow for finite updates (a block of
1e20s is damped, not zeroed); a block holding an inf is zeroed except for that entry.
The output keeps the update's dtype. Stateless.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from magma_optax._core import blocks as _blocks
from magma_optax._core import schedules as _schedules
from magma_optax._core import scoping as _scoping
from magma_optax.masking import engine as _engine


def _safe_block_norm(layout: _blocks.BlockLayout, u: jax.Array) -> jax.Array:
  """||u_b||_2 per block in f32, as ``m ||u_b / m||`` with ``m = max |u_b|``."""
  a = jnp.abs(u).astype(jnp.float32)  # complex: the magnitude
  m = layout.block_max_abs(a)
  safe = jnp.where((m > 0) & jnp.isfinite(m), m, 1.0)
  norm = safe * jnp.sqrt(layout.block_sum(jnp.square(a / layout.to_leaf(safe))))
  return jnp.where(jnp.isfinite(m), norm, m)  # inf (or NaN) blocks: inf (NaN)


@dataclasses.dataclass(frozen=True, eq=False)
class DampingRule(_engine.Rule):
  """Scale ``1 / (1 + c ||u_b||)`` per block; stateless, no draw."""

  coefficient: Any

  draws = False

  def scale(self, leaf: _engine.LeafStep) -> tuple[jax.Array, dict[str, Any]]:
    norm = _safe_block_norm(leaf.plan.layout, leaf.update)
    c = self.coefficient
    # c = 0 is the identity even for an inf block (0 * inf would give NaN).
    return jnp.where(c == 0, 1.0, 1.0 / (1.0 + c * norm)), {}


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
  if _schedules.is_schedule(coefficient):
    raise ValueError(
      "damping is stateless and takes a float coefficient, not a schedule; got"
      f" {coefficient!r}. Wrap it in optax.inject_hyperparams to change it over"
      " time."
    )
  _schedules.check_range(
    "coefficient", coefficient, 0.0, float("inf"), low_open=False, high_open=True
  )
  config = _engine.MaskConfig.create(
    granularity=granularity, stack_axes=stack_axes, where=where
  )
  return _engine.BlockMask(
    config, DampingRule(coefficient), name="damping"
  ).transformation()
