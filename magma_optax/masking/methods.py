"""The paper's two methods as wrappers of a base optimizer: Magma and SkipUpdate.

:func:`magma` runs the base densely and masks its update per block, scaled by the
alignment score (reading the base's first moment where it is an EMA of the raw
gradient); :func:`skip_update` keeps each block with probability ``p``, rescaled by
``1/p``. Both keep the base's state in :class:`MaskedUpdateState`.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from magma_optax._core import arguments as _arguments
from magma_optax._core import blocks as _blocks
from magma_optax._core import schedules as _schedules
from magma_optax._core import scoping as _scoping
from magma_optax._core import shard_map as _shard_map
from magma_optax._core import trees as _trees
from magma_optax.masking import alignment as _alignment
from magma_optax.masking import bernoulli as _masks
from magma_optax.masking import engine as _engine


class MaskedUpdateState(NamedTuple):
  """State of :func:`magma` and :func:`skip_update`.

  Attributes:
    inner_state: the base optimizer's state, updated densely every step.
    mask_state: the mask's state: an :class:`AlignmentMaskState` (Magma) or a
      :class:`BernoulliMaskState` (SkipUpdate).
  """

  inner_state: Any
  mask_state: Any


def _gradient_emas(state: Any, first_in_chain: bool = True) -> list[Any]:
  """The buffers of ``state`` that the contract above accepts, outermost first."""
  found: list[Any] = []
  if isinstance(state, optax.TraceState):
    if first_in_chain:
      found.append(state.trace)
    return found
  if isinstance(state, tuple) and hasattr(state, "_fields"):  # a NamedTuple state
    if "mu" in state._fields:
      found.append(state.mu)
    for field in state._fields:
      found += _gradient_emas(getattr(state, field))
  elif isinstance(state, (tuple, list)):  # optax.chain: one state per element
    for i, child in enumerate(state):
      found += _gradient_emas(child, first_in_chain=i == 0)
  elif isinstance(state, dict):  # multi_transform groups, hyperparameters
    for child in state.values():
      found += _gradient_emas(child)
  return found


def base_momentum(inner_state: Any, like: Any, momentum: Any = "auto") -> list[Any]:
  """Per leaf of ``like``, the base optimizer's first moment, or ``None``.

  ``momentum="auto"``: the buffers the module docstring's contract accepts whose tree
  has the parameters' structure (``optax.MaskedNode`` allowed, as ``optax.masked``
  and ``optax.multi_transform`` leave them); a leaf is taken when its shape matches.
  A callable: the tree it returns for ``inner_state``. ``"own"``: none.
  """
  like_leaves, treedef = jax.tree.flatten(like)
  found: list[Any] = [None] * len(like_leaves)
  if momentum == "own":
    return found
  if callable(momentum):
    candidates = [momentum(inner_state)]
  else:
    candidates = _gradient_emas(inner_state)
  for value in candidates:
    leaves = _trees.split_like(value, treedef)
    if leaves is None:
      if callable(momentum):
        raise ValueError(
          "momentum= returned a tree unlike the parameters; it must map the base"
          " optimizer's state to a pytree like the params (MaskedNode or None where"
          " there is no buffer)."
        )
      continue
    for i, (m, x) in enumerate(zip(leaves, like_leaves, strict=True)):
      if found[i] is None and hasattr(m, "shape") and m.shape == jnp.shape(x):
        found[i] = m
  return found


def magma(
  base: optax.GradientTransformation,
  *,
  tau: _schedules.ScalarOrSchedule = 2.0,
  keep_prob: _schedules.ScalarOrSchedule | dict = 0.5,
  key: _engine.KeyLike = 0,
  score_decay: float = 0.9,
  init_score: float = 0.5,
  momentum_decay: float = 0.9,
  momentum: Any = "auto",
  granularity: _blocks.Granularity = "tensor",
  stack_axes: int | None = None,
  where: _scoping.Where = None,
  labels: _scoping.Labels = None,
  momentum_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Magma (momentum-aligned gradient masking) around a base optimizer.

  Algorithm 1 of the paper, per block b, with the base update Delta_t (learning rate
  inside), gradient g_t and first moment mu_t (post-update)::

      Delta_t, base_state <- base.update(g_t, base_state)        (dense moments)
      s_t = score_decay s_{t-1} + (1 - score_decay) sigmoid(cos(mu_t, g_t) / tau)
      z_t ~ Bernoulli(keep_prob)
      u_t = s_t z_t Delta_t                   (biased on purpose: no 1/keep_prob)

  Use ``optax.apply_updates(params, u_t)`` as usual (optax's sign convention: the
  base's update already points downhill).

  Args:
    base: the base optimizer, e.g. ``optax.adam(1e-3)``.
    tau: temperature tau >= 1e-3 (paper: 2.0); float or schedule. A schedule is
      checked at step 0 and raised to 1e-3 at every step where it falls below
      (0 would make the scores NaN).
    keep_prob: probability p in (0, 1] of keeping a block (paper: 0.5); float,
      schedule, or a mapping label -> probability.
    key: PRNG key (int or ``jax.random.key``); keyword-only, default 0. Masks depend
      only on (key, step, leaf path, block), so they agree on every device and host.
    score_decay: EMA decay of the score, in [0, 1) (paper: 0.9).
    init_score: s_0 in [0, 1] (default 0.5).
    momentum_decay: decay in [0, 1) of the wrapper's own gradient EMA, used only
      for leaves where the base keeps no momentum (or with ``momentum="own"``).
    momentum: ``"auto"`` (the base's first moment where the module docstring's
      contract accepts it, else an own EMA), ``"own"`` (always keep a separate
      EMA), or a callable ``inner_state -> pytree like the params`` naming the
      buffer (an own EMA where it gives ``None`` / ``MaskedNode``).
    granularity: block granularity (``"tensor"``, ``"row"``, ``"column"``,
      ``"element"`` or a tile shape such as ``(3, 3)``).
    stack_axes: number of leading axes that index stacked (scanned) layers
      (``None``: 0); a static Python int.
    where: which leaves get Magma; others take the plain base update. The paper
      uses :func:`attention_mlp_weights`. Default ``None``: all floating leaves.
    labels: labels for per-label keep probabilities and statistics (default
      :func:`transformer_labels`).
    momentum_dtype: dtype of the wrapper's own momentum buffers (default: the
      parameter's).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a :class:`MaskedUpdateState`;
    extra args are passed on to ``base``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = magma.magma(optax.adam(1e-3), key=0)
    >>> params = {"w": jnp.ones((3, 4))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((3, 4))}, state, params)
    >>> params = optax.apply_updates(params, updates)

  References:
    Joo et al., On Surprising Effectiveness of Masking Updates in Adaptive
    Optimizers, arXiv 2602.15322 (2026), Algorithm 1.
  """
  arguments = dict(locals())  # the arguments, for from_arguments below
  if not callable(momentum) and momentum not in ("auto", "own"):
    raise ValueError(
      f"momentum must be 'auto', 'own' or a callable inner_state -> pytree like the"
      f" params; got {momentum!r}."
    )
  base = optax.with_extra_args_support(base)
  mask = _engine.BlockMask(
    _arguments.from_arguments(_engine.MaskConfig.create, arguments),
    _arguments.from_arguments(_alignment.AlignmentRule.create, arguments),
    name="magma",
  )

  def init_fn(params):
    inner = base.init(params)
    return MaskedUpdateState(
      inner, mask.init(params, base_momentum(inner, params, momentum))
    )

  def update_fn(updates, state, params=None, **extra_args):
    _trees.check_shapes("magma", updates, params)
    deltas, inner = base.update(updates, state.inner_state, params, **extra_args)
    _trees.check_shapes("magma", updates, deltas, "the base optimizer's update")
    found = base_momentum(inner, updates, momentum)
    masked, mask_state = mask.step(
      deltas, state.mask_state, signal=updates, momentum=found
    )
    return masked, MaskedUpdateState(inner, mask_state)

  return optax.GradientTransformationExtraArgs(*_shard_map.typed(init_fn, update_fn))


def skip_update(
  base: optax.GradientTransformation,
  *,
  keep_prob: _schedules.ScalarOrSchedule | dict = 0.5,
  key: _engine.KeyLike = 0,
  rescale: bool = True,
  granularity: _blocks.Granularity = "tensor",
  stack_axes: int | None = None,
  where: _scoping.Where = None,
  labels: _scoping.Labels = None,
) -> optax.GradientTransformationExtraArgs:
  r"""SkipUpdate: the base optimizer runs densely; each block's update is kept w.p. p.

  Per block b::

      Delta_t, base_state <- base.update(g_t, base_state)        (dense moments)
      z_t ~ Bernoulli(p);   u_t = (z_t / p) Delta_t                (unbiased)

  ``skip_update(base, keep_prob=1.0)`` is exactly ``base``. The same draws as
  ``optax.chain(base, magma.bernoulli_mask(p, key=key))``.

  Args:
    base: the base optimizer, e.g. ``optax.rmsprop(1e-3)``.
    keep_prob: probability p in (0, 1] (float, schedule or mapping label -> p).
    key: PRNG key (int or ``jax.random.key``); keyword-only, default 0.
    rescale: divide kept updates by p (unbiased, the paper's SkipUpdate).
    granularity: block granularity.
    stack_axes: number of leading axes that index stacked layers (``None``: 0).
    where: which leaves are masked; others take the plain base update.
    labels: labels for per-label keep probabilities and statistics.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a :class:`MaskedUpdateState`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = magma.skip_update(optax.rmsprop(1e-3), keep_prob=0.5, key=0)
    >>> params = {"w": jnp.ones((3, 4))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((3, 4))}, state, params)

  References:
    Joo et al., On Surprising Effectiveness of Masking Updates in Adaptive
    Optimizers, arXiv 2602.15322 (2026), Sec. 3.
  """
  arguments = dict(locals())  # the arguments, for from_arguments below
  base = optax.with_extra_args_support(base)
  mask = _arguments.from_arguments(_masks.bernoulli_mask, arguments)

  def init_fn(params):
    return MaskedUpdateState(base.init(params), mask.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    _trees.check_shapes("skip_update", updates, params)
    deltas, inner = base.update(updates, state.inner_state, params, **extra_args)
    _trees.check_shapes("skip_update", updates, deltas, "the base optimizer's update")
    masked, mask_state = mask.update(deltas, state.mask_state, params)
    return masked, MaskedUpdateState(inner, mask_state)

  return optax.GradientTransformationExtraArgs(*_shard_map.typed(init_fn, update_fn))
