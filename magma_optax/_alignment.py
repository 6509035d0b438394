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

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from magma_optax import _blocks
from magma_optax import _engine
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


def block_sums(
  layout: _blocks.BlockLayout, a: jax.Array, b: jax.Array, axis_name: Any = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-block ``(<a, b>, ||a||^2, ||b||^2)`` in f32 (``psum``-ed over ``axis_name``).

  ``axis_name`` (inside ``shard_map``): the mesh axes over which blocks are split.
  """
  if jnp.iscomplexobj(a) or jnp.iscomplexobj(b):
    # Complex leaves: the real inner product Re<a, b> = sum(Re a Re b + Im a Im b)
    # (the cosine of the leaves seen as real vectors of twice the length).
    a, b = a.astype(jnp.complex64), b.astype(jnp.complex64)
    b = jax.lax.optimization_barrier(b)
    ar, ai, br, bi = jnp.real(a), jnp.imag(a), jnp.real(b), jnp.imag(b)
    sums = (
      layout.block_sum(ar * br + ai * bi),
      layout.block_sum(ar * ar + ai * ai),
      layout.block_sum(br * br + bi * bi),
    )
    return sums if axis_name is None else jax.lax.psum(sums, axis_name)
  a = a.astype(jnp.float32)
  # The barrier stops XLA from merging b * b with the base optimizer's g * g, which
  # on CPU writes the product to memory (a step of magma(adam) ran 3.6x adam, 1.6x
  # with it; benchmarks/step_overhead.py). Values are unchanged.
  b = jax.lax.optimization_barrier(b.astype(jnp.float32))
  sums = (layout.block_sum(a * b), layout.block_sum(a * a), layout.block_sum(b * b))
  if axis_name is not None:
    sums = jax.lax.psum(sums, axis_name)
  return sums


def block_cosine(
  layout: _blocks.BlockLayout, a: jax.Array, b: jax.Array, axis_name: Any = None
) -> jax.Array:
  """Per-block cosine of ``a`` and ``b`` in f32; 0 where either block is zero, NaN
  where the block holds a non-finite value or its float32 sums overflow (then
  :func:`next_score` keeps the block's score).

  ``axis_name`` (inside ``shard_map``): the mesh axes over which blocks are split;
  the per-block partial sums are ``psum``-ed over them before the cosine is formed.
  """
  return cosine_from_sums(*block_sums(layout, a, b, axis_name))


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


def _check_momentum_dtype(momentum_dtype: Any) -> Any:
  if momentum_dtype is None:
    return None
  try:
    momentum_dtype = jnp.dtype(momentum_dtype)
  except TypeError as e:
    raise ValueError(f"momentum_dtype must be a float dtype; {e}") from None
  if not jnp.issubdtype(momentum_dtype, jnp.floating):
    raise ValueError(
      f"momentum_dtype must be a floating dtype (e.g. jnp.float32 or"
      f" jnp.bfloat16); got {momentum_dtype}."
    )
  return momentum_dtype


@dataclasses.dataclass(frozen=True, eq=False)
class AlignmentRule(_engine.Rule):
  """Magma's rule: scale ``s_t z_t`` per block, ``s_t`` from cos(momentum, signal).

  Per leaf it keeps the block scores (``scores``, per block) and, where the base
  optimizer has no usable first moment, its own EMA of the signal (``momentum``,
  per parameter). :meth:`score` is the score update alone, shared with the fused
  :func:`magma_optax.adam_magma`.
  """

  tau: Any = 2.0
  score_decay: Any = 0.9
  init_score: Any = 0.5
  momentum_decay: Any = 0.9
  momentum_dtype: Any = None

  state_type = AlignmentMaskState
  block_fields = ("scores",)
  param_fields = ("momentum",)

  @classmethod
  def create(
    cls,
    *,
    tau: Any = 2.0,
    score_decay: Any = 0.9,
    init_score: Any = 0.5,
    momentum_decay: Any = 0.9,
    momentum_dtype: Any = None,
  ) -> AlignmentRule:
    """Checks every hyperparameter (``ValueError`` naming it)."""
    return cls(
      tau=_schedules.check_positive("tau", tau),
      score_decay=_schedules.check_decay("score_decay", score_decay),
      init_score=_schedules.check_range(
        "init_score", init_score, 0.0, 1.0, low_open=False, high_open=False
      ),
      momentum_decay=_schedules.check_decay("momentum_decay", momentum_decay),
      momentum_dtype=_check_momentum_dtype(momentum_dtype),
    )

  def init_leaf(self, plan, param, momentum) -> dict[str, Any]:
    # zeros + s_0, not jnp.full: a full of a scalar array can return that very
    # array (an inject_hyperparams value), and a donated state must own its buffers.
    out = {"scores": jnp.zeros(plan.layout.block_shape, jnp.float32) + self.init_score}
    if momentum is None:
      out["momentum"] = jnp.zeros(param.shape, self.momentum_dtype or param.dtype)
    return out

  def score(self, prev: jax.Array, cos: jax.Array, count: jax.Array) -> jax.Array:
    """``s_t`` from ``s_{t-1}`` and this step's block cosines (NaN: keep ``s``)."""
    inv_tau = 1.0 / _schedules.evaluate(self.tau, count)
    return next_score(prev, cos, inv_tau, self.score_decay)

  def scale(self, leaf: _engine.LeafStep) -> tuple[jax.Array, dict[str, Any]]:
    own = leaf.state["momentum"]
    new: dict[str, Any] = {}
    if isinstance(own, optax.MaskedNode):
      mu = leaf.momentum
    else:
      mu = optax.tree.update_moment(leaf.signal, own, self.momentum_decay, 1)
      mu = new["momentum"] = mu.astype(own.dtype)
    cos = block_cosine(leaf.plan.layout, mu, leaf.signal)
    s = new["scores"] = self.score(leaf.state["scores"], cos, leaf.count)
    return s * leaf.mask, new


def alignment_mask(
  tau: _schedules.ScalarOrSchedule = 2.0,
  *,
  keep_prob: _schedules.ScalarOrSchedule | dict = 0.5,
  key: _engine.KeyLike = 0,
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
  arguments = dict(locals())  # the arguments, for from_arguments below
  return _engine.BlockMask(
    _engine.from_arguments(_engine.MaskConfig.create, arguments),
    _engine.from_arguments(AlignmentRule.create, arguments),
  ).transformation()
