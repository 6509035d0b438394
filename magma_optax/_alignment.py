"""Momentum-gradient alignment masks: the Magma step of arXiv 2602.15322 (Algorithm 1).

Per block b, with momentum mu_t (post-update: it already contains g_t), gradient g_t and
the update Delta_t to be masked::

    c_t   = cos(mu_t, g_t)                         (0 when either is a zero vector)
    s^_t  = sigmoid(c_t / tau)
    s_t   = score_decay * s_{t-1} + (1 - score_decay) * s^_t,   s_0 = init_score
    z_t   ~ Bernoulli(keep_prob)
    out   = s_t * z_t * Delta_t                    (no 1/p: biased on purpose)

Cosines and scores are computed in float32 whatever the parameter dtype; the output
keeps the update's dtype. :func:`alignment_mask` applies this to whatever flows through
it (its own EMA of the incoming updates is the momentum); :func:`magma_optax.magma`
applies it to a base optimizer's update with the base's own first moment.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from magma_optax import _blocks
from magma_optax import _masks
from magma_optax import _schedules
from magma_optax import _scoping


class AlignmentMaskState(NamedTuple):
  """State of :func:`alignment_mask` (and of the mask inside :func:`magma`).

  Attributes:
    count: int32 scalar, number of updates so far.
    key: typed PRNG key the masks are derived from.
    scores: pytree like the params; per leaf an f32 array of the leaf's block shape,
      the smoothed alignment score s_t (``optax.MaskedNode`` where unscoped).
    mask: per leaf a bool array of block shape, the Bernoulli draw z_t of the last
      step.
    momentum: per leaf the EMA of the signal used as momentum, where this transform
      keeps its own (``optax.MaskedNode`` where unscoped or where the base
      optimizer's first moment is used instead).
    active_fraction: f32 scalar, fraction of scoped entries kept at the last step.
    active_fraction_by_label: dict label -> f32 scalar, the same per label.
  """

  count: jax.Array
  key: jax.Array
  scores: Any
  mask: Any
  momentum: Any
  active_fraction: jax.Array
  active_fraction_by_label: dict[str, jax.Array]


def block_cosine(
  layout: _blocks.BlockLayout, a: jax.Array, b: jax.Array, axis_name: Any = None
) -> jax.Array:
  """Per-block cosine of ``a`` and ``b`` in f32; 0 where either block is zero, NaN
  where the block holds a non-finite value or its float32 sums overflow.

  ``axis_name`` (inside ``shard_map``): the mesh axes over which blocks are split;
  the per-block partial sums are ``psum``-ed over them before the cosine is formed.
  """
  a = a.astype(jnp.float32)
  # The barrier stops XLA from merging b * b with the base optimizer's g * g, which
  # on CPU writes the product to memory (a step of magma(adam) ran 3.6x adam, 1.6x
  # with it; benchmarks/step_overhead.py). Values are unchanged.
  b = jax.lax.optimization_barrier(b.astype(jnp.float32))
  sums = (layout.block_sum(a * b), layout.block_sum(a * a), layout.block_sum(b * b))
  if axis_name is not None:
    sums = jax.lax.psum(sums, axis_name)
  return cosine_from_sums(*sums)


def cosine_from_sums(dot: jax.Array, aa: jax.Array, bb: jax.Array) -> jax.Array:
  """cos = <a, b> / (||a|| ||b||) from the block sums; 0 where a norm is 0.

  NaN where a sum is not finite: an inf or NaN entry in the block, or float32 sums
  that overflowed (entries beyond about ``1e19 / sqrt(block size)``). The score
  update (:func:`next_score`) then keeps the block's previous score.
  """
  finite = jnp.isfinite(dot) & jnp.isfinite(aa) & jnp.isfinite(bb)
  norm = jnp.sqrt(aa) * jnp.sqrt(bb)
  ok = finite & (norm > 0)
  cos = jnp.clip(jnp.where(ok, dot / jnp.where(ok, norm, 1.0), 0.0), -1.0, 1.0)
  return jnp.where(finite, cos, jnp.nan)


def next_score(
  prev: jax.Array, cos: jax.Array, inv_tau: jax.Array, score_decay: Any
) -> jax.Array:
  """``s_t = d s_{t-1} + (1 - d) sigmoid(cos / tau)`` in f32, per block.

  A block whose cosine is NaN (see :func:`cosine_from_sums`) keeps ``s_{t-1}``: a
  non-finite gradient or momentum never reaches the score, so the update stays
  non-finite only where the base optimizer's own update is.
  """
  ok = ~jnp.isnan(cos)
  target = jax.nn.sigmoid(jnp.where(ok, cos, 0.0) * inv_tau)
  # prev + ok (1 - d)(target - prev): arithmetic, not a select of prev, whose
  # sharding may differ from the cosine's on Explicit mesh axes.
  step = (1.0 - score_decay) * (target - prev)
  return (prev + ok.astype(step.dtype) * step).astype(jnp.float32)


class _Alignment(NamedTuple):
  """The validated hyperparameters and the two pure functions both users share."""

  init: Any
  step: Any


def make_alignment(
  *,
  tau,
  keep_prob,
  key,
  score_decay,
  init_score,
  momentum_decay,
  granularity,
  stack_axes,
  where,
  labels,
  momentum_dtype,
) -> _Alignment:
  """Validates the hyperparameters and returns ``init`` / ``step`` functions.

  ``init(params, own_momentum)`` builds the state; ``own_momentum(plan)`` says
  whether a scoped leaf keeps its own momentum EMA.
  ``step(deltas, signal, base_momentum, state)`` masks ``deltas`` using the cosine
  of (momentum, signal) per block; ``base_momentum`` is a per-leaf list (``None``
  where the state's own EMA is used).
  """
  tau = _schedules.check_positive("tau", tau)
  keep_prob = _scoping.validate_keep_prob(keep_prob)
  key = _masks.as_key(key)
  score_decay = _schedules.check_decay("score_decay", score_decay)
  momentum_decay = _schedules.check_decay("momentum_decay", momentum_decay)
  init_score = _schedules.check_range(
    "init_score", init_score, 0.0, 1.0, low_open=False, high_open=False
  )
  granularity = _blocks.validate_granularity(granularity)
  stack_axes = _blocks.validate_stack_axes(stack_axes)
  if momentum_dtype is not None:
    try:
      momentum_dtype = jnp.dtype(momentum_dtype)
    except TypeError as e:
      raise ValueError(f"momentum_dtype must be a float dtype; {e}") from None
    if not jnp.issubdtype(momentum_dtype, jnp.floating):
      raise ValueError(
        f"momentum_dtype must be a floating dtype (e.g. jnp.float32 or"
        f" jnp.bfloat16); got {momentum_dtype}."
      )

  plan = functools.partial(
    _scoping.plan_leaves,
    where=where,
    labels=labels,
    keep_prob=keep_prob,
    granularity=granularity,
    stack_axes=stack_axes,
  )

  def init(params, own_momentum):
    plans, treedef = plan(params)
    leaves = treedef.flatten_up_to(params)
    scores, momentum = [], []
    for p, x in zip(plans, leaves, strict=True):
      if p.layout is None:
        scores.append(optax.MaskedNode())
        momentum.append(optax.MaskedNode())
        continue
      # zeros + s_0, not jnp.full: a full of a scalar array can return that very
      # array (an inject_hyperparams value), and a donated state must own its buffers.
      scores.append(jnp.zeros(p.layout.block_shape, jnp.float32) + init_score)
      if own_momentum(p):
        momentum.append(jnp.zeros(x.shape, momentum_dtype or x.dtype))
      else:
        momentum.append(optax.MaskedNode())
    masks = _masks.init_block_masks(plans)
    overall, by_label = _masks.active_fractions(plans, masks)
    return AlignmentMaskState(
      count=jnp.zeros([], jnp.int32),
      # A fresh buffer per state: a donated state must not delete the key that
      # the next init() would hand out.
      key=jnp.copy(key),
      scores=treedef.unflatten(scores),
      mask=treedef.unflatten(masks),
      momentum=treedef.unflatten(momentum),
      active_fraction=overall,
      active_fraction_by_label=by_label,
    )

  def step(deltas, signal, base_momentum, state):
    plans, treedef = plan(deltas)
    plans = _scoping.match_state(plans, state.scores, treedef)
    delta_leaves = treedef.flatten_up_to(deltas)
    signal_leaves = treedef.flatten_up_to(signal)
    score_leaves = treedef.flatten_up_to(state.scores)
    momentum_leaves = treedef.flatten_up_to(state.momentum)
    masks = _masks.draw_block_masks(state.key, state.count, plans)
    inv_tau = 1.0 / _schedules.evaluate(tau, state.count)
    out, new_scores, new_momentum = [], [], []
    for i, p in enumerate(plans):
      delta = delta_leaves[i]
      if p.layout is None:
        out.append(delta)
        new_scores.append(optax.MaskedNode())
        new_momentum.append(optax.MaskedNode())
        continue
      own = momentum_leaves[i]
      if isinstance(own, optax.MaskedNode):
        mu = base_momentum[i]
        new_momentum.append(own)
      else:
        mu = optax.tree.update_moment(signal_leaves[i], own, momentum_decay, 1)
        mu = mu.astype(own.dtype)
        new_momentum.append(mu)
      cos = block_cosine(p.layout, mu, signal_leaves[i])
      s = next_score(score_leaves[i], cos, inv_tau, score_decay)
      new_scores.append(s)
      out.append(_masks.scale_blocks(delta, p.layout, s * masks[i]))
    overall, by_label = _masks.active_fractions(plans, masks)
    new_state = AlignmentMaskState(
      count=optax.safe_increment(state.count),
      key=state.key,
      scores=treedef.unflatten(new_scores),
      mask=treedef.unflatten(masks),
      momentum=treedef.unflatten(new_momentum),
      active_fraction=overall,
      active_fraction_by_label=by_label,
    )
    return treedef.unflatten(out), new_state

  return _Alignment(init, step)


def alignment_mask(
  tau: _schedules.ScalarOrSchedule = 2.0,
  *,
  keep_prob: _schedules.ScalarOrSchedule | dict = 0.5,
  key: _masks.KeyLike = 0,
  score_decay: float = 0.9,
  init_score: float = 0.5,
  momentum_decay: float = 0.9,
  granularity: _blocks.Granularity = "tensor",
  stack_axes: int | None = None,
  where: _scoping.Where = None,
  labels: _scoping.Labels = None,
  momentum_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Magma's alignment-scaled Bernoulli mask, applied to what flows through it.

  Keeps its own momentum ``m_t = momentum_decay * m_{t-1} + (1 - momentum_decay) u_t``
  of the incoming updates ``u_t`` and, per block b::

      s_t = score_decay s_{t-1} + (1 - score_decay) sigmoid(cos(m_t, u_t) / tau)
      u_t <- s_t z_t u_t,     z_t ~ Bernoulli(keep_prob)

  **Where you place it matters.** ``optax.chain(magma.alignment_mask(),
  optax.adam(1e-3))`` masks the *gradient* before Adam sees it, so Adam's moments
  become sparse: the "sparse moments" variant of the paper's App. C.4, a different
  and weaker method. The paper's Magma runs the base optimizer densely and masks its
  update: use :func:`magma_optax.magma` for that.

  Args:
    tau: temperature tau > 0 of the sigmoid (float or schedule).
    keep_prob: probability in (0, 1] of keeping a block (float, schedule, or a
      mapping label -> probability).
    key: PRNG key (int or ``jax.random.key``); keyword-only, default 0.
    score_decay: EMA decay of the score in [0, 1) (paper: 0.9).
    init_score: s_0 in [0, 1] (default 0.5).
    momentum_decay: decay of the momentum EMA in [0, 1) (default 0.9).
    granularity: block granularity (``"tensor"``, ``"row"``, ``"column"``,
      ``"element"`` or a tile shape).
    stack_axes: number of leading axes that index stacked layers (``None``: 0).
    where: which leaves to mask (``None``: all floating leaves; a callable
      ``(path, leaf) -> bool``; or a pytree of bools).
    labels: labels for per-label keep probabilities and statistics (default
      :func:`transformer_labels`).
    momentum_dtype: dtype of the momentum buffer (default: the parameter's).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with an :class:`AlignmentMaskState`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = optax.chain(magma.alignment_mask(tau=2.0), optax.adam(1e-3))
    >>> params = {"w": jnp.ones((3, 4))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((3, 4))}, state, params)

  References:
    Joo et al., On Surprising Effectiveness of Masking Updates in Adaptive
    Optimizers, arXiv 2602.15322 (2026), Algorithm 1 and App. C.4.
  """
  align = make_alignment(
    tau=tau,
    keep_prob=keep_prob,
    key=key,
    score_decay=score_decay,
    init_score=init_score,
    momentum_decay=momentum_decay,
    granularity=granularity,
    stack_axes=stack_axes,
    where=where,
    labels=labels,
    momentum_dtype=momentum_dtype,
  )

  def init_fn(params):
    return align.init(params, lambda plan: True)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return align.step(updates, updates, None, state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
