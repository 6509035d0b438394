"""The Bernoulli rule: keep each block with probability ``p`` (SkipUpdate's mask).

:func:`bernoulli_mask` draws ``z ~ Bernoulli(p)`` per block and scales a kept block
by ``1 / p`` (``rescale=True``, unbiased) or by 1; placed after a base optimizer it
is ``skip_update(base)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from magma_optax._core import arguments as _arguments
from magma_optax._core import blocks as _blocks
from magma_optax._core import schedules as _schedules
from magma_optax._core import scoping as _scoping
from magma_optax.masking import engine as _engine

KeyLike = _engine.KeyLike
as_key = _engine.as_key  # re-exported: the engine owns key handling


class BernoulliMaskState(NamedTuple):
  """State of :func:`bernoulli_mask`.

  Attributes:
    count: int32 scalar, number of updates so far (the step that enters the draw).
    key: typed PRNG key the masks are derived from.
    mask: pytree like the params; per leaf a bool array of the leaf's block shape,
      the mask ``z`` drawn at the last step (``optax.MaskedNode`` where unscoped).
    active_fraction: f32 scalar, fraction of scoped entries kept at the last step.
    active_fraction_by_label: dict label -> f32 scalar, the same per label.
    block_axes: static (no arrays): the parameter axes each per-block array
      indexes, read by :func:`magma_optax.sharding.state_shardings`.
  """

  count: jax.Array
  key: jax.Array
  mask: Any
  active_fraction: jax.Array
  active_fraction_by_label: dict[str, jax.Array]
  block_axes: _blocks.DeclaredAxes = _blocks.DeclaredAxes()


@dataclasses.dataclass(frozen=True)
class BernoulliRule(_engine.Rule):
  """SkipUpdate's rule: scale ``z / p`` per block (``z`` with ``rescale=False``)."""

  rescale: bool = True

  state_type = BernoulliMaskState

  @classmethod
  def create(cls, *, rescale: bool = True) -> BernoulliRule:
    if not isinstance(rescale, bool):
      raise ValueError(f"rescale must be a bool; got {rescale!r}.")
    return cls(rescale)

  def scale(self, leaf: _engine.LeafStep) -> tuple[jax.Array, dict[str, Any]]:
    z = leaf.mask.astype(jnp.float32)
    if not self.rescale:
      return z, {}
    p = leaf.keep_prob
    return jnp.where(p > 0, z / jnp.where(p > 0, p, 1.0), 0.0), {}  # p=0: none kept


def bernoulli_mask(
  keep_prob: _schedules.ScalarOrSchedule | dict = 0.5,
  *,
  key: KeyLike = 0,
  rescale: bool = True,
  granularity: _blocks.Granularity = "tensor",
  stack_axes: int | None = None,
  where: _scoping.Where = None,
  labels: _scoping.Labels = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Keeps each block of the incoming updates with probability ``keep_prob``.

  Per block b, at every step::

      z_b ~ Bernoulli(p);   u_b <- (z_b / p) u_b    (rescale=True, unbiased)
                            u_b <- z_b u_b          (rescale=False)

  Placed *after* a base optimizer this is SkipUpdate (paper Sec. 3):
  ``optax.chain(optax.adam(1e-3), magma.bernoulli_mask(0.5))`` equals
  ``magma.skip_update(optax.adam(1e-3), keep_prob=0.5)`` -- the base optimizer's
  moments stay dense, only the parameter update is masked.

  Args:
    keep_prob: probability p in (0, 1] of keeping a block; a float, an
      ``optax.Schedule`` of the step count, or a mapping label -> float/schedule
      (labels from ``labels``; leaves whose label is absent are not masked). A
      schedule is checked at step 0 and clipped to [0, 1] at every step; at p = 0
      no block is kept (the update is 0, not 0/0).
    key: PRNG key (int or ``jax.random.key``); keyword-only, default 0. Pass your
      own for independent runs. Draws depend only on (key, step, leaf path,
      block).
    rescale: divide kept blocks by p (unbiased SkipUpdate); ``False`` keeps them
      unscaled.
    granularity: ``"tensor"``, ``"row"``, ``"column"``, ``"element"`` or a tile
      shape such as ``(3, 3)``; see :mod:`magma_optax._core.blocks`.
    stack_axes: number of leading axes that index stacked (scanned) layers
      (``None``: 0); each slice is blocked separately.
    where: which leaves to mask: ``None`` (all floating leaves), a callable
      ``(path, leaf) -> bool`` such as :func:`attention_mlp_weights`, or a pytree
      of bools. Other leaves pass through unchanged.
    labels: callable ``(path, leaf) -> str`` or pytree of labels, for per-label
      keep probabilities and statistics; default :func:`transformer_labels`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`BernoulliMaskState`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = optax.chain(optax.adam(1e-3), magma.bernoulli_mask(0.5, key=0))
    >>> params = {"w": jnp.ones((3, 4))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((3, 4))}, state, params)

  References:
    Joo et al., On Surprising Effectiveness of Masking Updates in Adaptive
    Optimizers, arXiv 2602.15322 (2026), Sec. 3 (SkipUpdate).
  """
  arguments = dict(locals())  # the arguments, for from_arguments below
  return _engine.BlockMask(
    _arguments.from_arguments(_engine.MaskConfig.create, arguments),
    BernoulliRule.create(rescale=rescale),
    name="bernoulli_mask",
  ).transformation()
