"""Adam + Magma as one fused optimizer: the same updates as ``magma(optax.adam(...))``.

:func:`adam_magma` computes Adam's moments, Magma's alignment sums and the masked,
scaled update in one fused step (:mod:`magma_optax.kernels`; with the Pallas kernel,
one call for many leaves). The planning, draws and mask state are the engine's and
the alignment rule's (:mod:`magma_optax.masking.engine`), so the updates equal the
wrapper's for the same key. Each step runs in two halves, with the blocks whose
float32 sums are not finite recomputed exactly in between (one branch for the whole
tree on XLA:CPU, none elsewhere).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from magma_optax import kernels
from magma_optax._core import arguments as _arguments
from magma_optax._core import blocks as _blocks
from magma_optax._core import compat as _compat
from magma_optax._core import schedules as _schedules
from magma_optax._core import scoping as _scoping
from magma_optax._core import shard_map as _shard_map
from magma_optax._core import trees as _trees
from magma_optax._core import xla_cpu as _xla_cpu
from magma_optax.masking import alignment as _alignment
from magma_optax.masking import engine as _engine


class AdamMagmaState(NamedTuple):
  """State of :func:`adam_magma`.

  Attributes:
    count: int32 scalar, number of updates so far (Adam's bias-correction step).
    mu: pytree like the params, Adam's first moment (``mu_dtype`` or the params').
    nu: pytree like the params, Adam's second moment.
    mu_sq_norm: per leaf an f32 array of the leaf's block shape, ||mu||^2 per block
      (``optax.MaskedNode`` where unscoped): carried so that the next step's
      ||mu_t||^2 needs no extra pass (see :mod:`magma_optax.kernels.api`).
    mask_state: :class:`AlignmentMaskState`: per-block scores s_t, the last masks
      z_t, active fractions (``momentum`` is all ``MaskedNode``: ``mu`` serves).
  """

  count: jax.Array
  mu: Any
  nu: Any
  mu_sq_norm: Any
  mask_state: _alignment.AlignmentMaskState


def _check_real(tree: Any) -> None:
  """The fused kernel is real-valued: complex leaves are an error, not a real update."""
  paths = [
    jax.tree_util.keystr(path)
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    if jnp.iscomplexobj(x)
  ]
  if paths:
    raise ValueError(
      f"adam_magma does not support complex parameters (at {paths}); use"
      " magma.magma(optax.adam(...)), whose base Adam handles complex leaves."
    )


def _check_nonnegative(name: str, value: Any) -> Any:
  return _schedules.check_range(
    name, value, 0.0, float("inf"), low_open=False, high_open=True
  )


def adam_magma(
  learning_rate: _schedules.ScalarOrSchedule,
  *,
  b1: jax.typing.ArrayLike = 0.9,
  b2: jax.typing.ArrayLike = 0.999,
  eps: jax.typing.ArrayLike = 1e-8,
  eps_root: jax.typing.ArrayLike = 0.0,
  weight_decay: _schedules.ScalarOrSchedule = 0.0,
  mu_dtype: Any = None,
  tau: _schedules.ScalarOrSchedule = 2.0,
  keep_prob: _schedules.ScalarOrSchedule | dict = 0.5,
  key: _engine.KeyLike = 0,
  score_decay: float = 0.9,
  init_score: float = 0.5,
  granularity: _blocks.Granularity = "tensor",
  stack_axes: int | None = None,
  where: _scoping.Where = None,
  labels: _scoping.Labels = None,
  implementation: str | Sequence[str] | None = None,
  interpret: bool | str = False,
  block_sizes: kernels.BlockSizes | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Adam (or AdamW) with Magma masking, fused into one step.

  Per block b, with gradient g_t (Algorithm 1 of the paper, dense moments)::

      m_t = b1 m_{t-1} + (1 - b1) g_t;      v_t = b2 v_{t-1} + (1 - b2) g_t^2
      Delta_t = -lr (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t) + eps_root) + eps)
                - lr weight_decay theta_{t-1}
      s_t = score_decay s_{t-1} + (1 - score_decay) sigmoid(cos(m_t, g_t) / tau)
      z_t ~ Bernoulli(keep_prob);           u_t = s_t z_t Delta_t

  Same updates as ``magma.magma(optax.adam(lr, b1, b2, eps, eps_root), tau=tau,
  keep_prob=keep_prob, key=key, ...)`` (``optax.adamw(..., weight_decay=wd)`` when
  ``weight_decay`` is nonzero) for the same key, without ``param_mask`` (the
  wrapper passes no ``param_mask`` to ``optax.adam``: it updates every entry).
  Cost: Adam's passes plus two block reductions (<m_t, g>, ||g||^2); ||m_t||^2 is
  carried (summed directly in blocks of fewer than 16 entries, or where the carry
  cancels). Leaves out of ``where`` take the plain Adam(W) update.

  Args:
    learning_rate: float or ``optax.Schedule`` of the step count.
    b1, b2: Adam's decay rates, in [0, 1).
    eps, eps_root: Adam's epsilons, >= 0. These four are Python floats or scalar
      arrays, read at run time: ``optax.inject_hyperparams`` injects them as it
      does ``optax.adam``'s, with the same moments (``1 - b`` of a float32 ``b``
      may differ in its last bits: :func:`magma_optax.kernels.reference.decay`).
    weight_decay: decoupled weight decay >= 0 (AdamW), float or schedule; applied to
      every leaf, like ``optax.adamw(mask=None)``. Needs ``params`` in ``update``.
    mu_dtype: dtype of the first moment (default: the parameter's).
    tau: temperature tau >= 1e-3 of Magma's sigmoid (paper: 2.0); float or
      schedule. A schedule is checked at step 0 and raised to 1e-3 at every step
      where it falls below (0 would make the scores NaN).
    keep_prob: probability in (0, 1] of keeping a block (paper: 0.5); float,
      schedule or mapping label -> probability.
    key: PRNG key (int or ``jax.random.key``), keyword-only, default 0.
    score_decay: EMA decay of the score, in [0, 1) (paper: 0.9).
    init_score: s_0 in [0, 1] (default 0.5).
    granularity: block granularity (``"tensor"``, ``"row"``, ``"column"``,
      ``"element"`` or a tile shape). The Pallas kernel needs contiguous blocks
      (not ``"column"`` or tiles); the default falls back to XLA for those.
    stack_axes: number of leading axes that index stacked (scanned) layers
      (``None``: 0, which keeps it out of ``optax.inject_hyperparams``).
    where: which leaves get Magma (``None``: all floating leaves; e.g.
      :func:`attention_mlp_weights`, the paper's scope).
    labels: labels for per-label keep probabilities and statistics.
    implementation: kernel choice, see :func:`magma_optax.kernels.masked_adam`:
      ``"xla"``, ``"pallas"`` (the kernel of the platform the step is lowered for;
      lowered for a CPU it raises ``ValueError``), a sequence (``("pallas",
      "xla")``: the kernel on a GPU or a TPU, XLA elsewhere), or ``None``
      (``kernels.DEFAULT_IMPLEMENTATIONS``, XLA for now).
    interpret: run the Pallas kernel on CPU in an interpreter (tests only, small
      sizes; slow). ``False`` (default) compiles for the device; ``True`` runs the
      Triton-layout kernel in the generic Pallas interpreter; ``"tpu"`` the Mosaic
      TPU kernel in the TPU interpreter (``pltpu.InterpretParams``); ``"gpu"`` the
      Mosaic GPU kernel in its interpreter (``plgpu.InterpretGPUParams``, jax >=
      0.11.2). Used with ``implementation="pallas"``. Any other value, or an
      interpreter the installed jax lacks, raises ``ValueError`` at the first
      update (see :func:`magma_optax.kernels.masked_adam`).
    block_sizes: Pallas tile shape (default: the heuristic).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with an :class:`AdamMagmaState`;
    ``update`` accepts the extra arg ``param_mask``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = magma.adam_magma(1e-3, key=0)
    >>> params = {"w": jnp.ones((3, 4))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((3, 4))}, state, params)
    >>> params = optax.apply_updates(params, updates)

  References:
    Joo et al., On Surprising Effectiveness of Masking Updates in Adaptive
    Optimizers, arXiv 2602.15322 (2026), Algorithm 1; Kingma & Ba, Adam,
    arXiv 1412.6980; Loshchilov & Hutter, AdamW, arXiv 1711.05101.
  """
  arguments = dict(locals())  # the arguments, for from_arguments below
  adam = _AdamConfig.create(arguments)
  # The same engine (config, rule, draws, state) as magma(optax.adam(...)).
  rule = _arguments.from_arguments(_alignment.AlignmentRule.create, arguments)
  engine = _engine.BlockMask(
    _arguments.from_arguments(_engine.MaskConfig.create, arguments),
    rule,
    name="adam_magma",
  )

  def init_fn(params):
    _check_real(params)
    mu = optax.tree.zeros_like(params, dtype=adam.mu_dtype)
    # mu serves as Magma's momentum: no own EMA is allocated.
    mask_state = engine.init(params, momentum=jax.tree.leaves(mu))
    return AdamMagmaState(
      count=jnp.zeros([], jnp.int32),
      mu=mu,
      nu=optax.tree.zeros_like(params),
      mu_sq_norm=jax.tree.map(jnp.zeros_like, mask_state.scores),
      mask_state=mask_state,
    )

  def update_fn(updates, state, params=None, *, param_mask=None, **extra_args):
    del extra_args
    _check_update(adam, updates, state, params)
    plans, treedef, masks, _ = engine.prepare(updates, state.mask_state)
    leaves = _leaves(plans, treedef, updates, state, params, param_mask, adam)
    count = optax.safe_increment(state.count)
    # First half for every leaf: the step's block sums (scoped leaves) ...
    pending = [_start(leaf, adam, state.count, count) for leaf in leaves]
    # ... the blocks whose float32 sums are not finite (an overflow, or a carry
    # lost to one or to cancellation) recomputed exactly, for the whole tree at
    # once (on XLA:CPU in one branch) ...
    pending, sums, norms = _settle(pending, adam.b1)
    # ... then the scores, and the second half: the scaled updates (Pallas leaves
    # in as few kernel calls as they can share).
    scored = [
      _score(leaf, s, z, rule, state.mask_state.count)
      for leaf, s, z in zip(leaves, sums, masks, strict=True)
    ]
    results = kernels.finish_masked_adam_many(pending, [sc[1] for sc in scored])
    done = [
      _done(leaf, res, sc[0], n)
      for leaf, res, sc, n in zip(leaves, results, scored, norms, strict=True)
    ]
    return treedef.unflatten([d.update for d in done]), _new_state(
      engine, treedef, plans, state, masks, count, done
    )

  return optax.GradientTransformationExtraArgs(*_shard_map.typed(init_fn, update_fn))


def _check_update(adam, updates, state, params) -> None:
  """The update's arguments checked (``ValueError`` naming what is wrong)."""
  _check_real(updates)
  _trees.check_shapes("adam_magma", updates, params)
  _trees.check_shapes("adam_magma", updates, state.mu, "Adam's first moment there")
  if adam.has_decay and params is None:
    hint = ""
    if _compat.is_tracer(adam.weight_decay):
      hint = (
        " weight_decay is traced (optax.inject_hyperparams injects it, its"
        " default 0.0 included), so the step cannot know it is 0: pass the"
        " params, or static_args=('weight_decay',)."
      )
    raise ValueError(
      "adam_magma with weight_decay needs the params: call update(grads,"
      f" state, params).{hint}"
    )


class _AdamConfig(NamedTuple):
  """adam_magma's validated Adam hyperparameters."""

  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  learning_rate: Any
  weight_decay: Any
  has_decay: bool
  mu_dtype: Any
  implementation: Any
  interpret: Any
  block_sizes: Any

  @classmethod
  def create(cls, arguments: dict[str, Any]) -> _AdamConfig:
    """Checks adam_magma's Adam arguments (``ValueError`` naming the argument)."""
    a = arguments
    _schedules.check_adam(a["b1"], a["b2"], a["eps"], a["eps_root"])
    implementation = a["implementation"]
    if isinstance(implementation, str) or implementation is None:
      impls = () if implementation is None else (implementation,)
    else:
      impls = tuple(implementation)
    for impl in impls:
      if impl not in kernels.IMPLEMENTATIONS:
        raise ValueError(
          f"implementation must be one of {kernels.IMPLEMENTATIONS}, a sequence of"
          f" them, or None; got {implementation!r}."
        )
    weight_decay = _check_nonnegative("weight_decay", a["weight_decay"])
    has_decay = (
      _schedules.is_schedule(weight_decay)
      or _compat.is_tracer(weight_decay)  # optax.inject_hyperparams
      or weight_decay != 0.0
    )
    mu_dtype = a["mu_dtype"]
    return cls(
      b1=a["b1"],
      b2=a["b2"],
      eps=a["eps"],
      eps_root=a["eps_root"],
      learning_rate=_check_nonnegative("learning_rate", a["learning_rate"]),
      weight_decay=weight_decay,
      has_decay=has_decay,
      mu_dtype=None if mu_dtype is None else jnp.dtype(mu_dtype),
      implementation=implementation,
      interpret=a["interpret"],
      block_sizes=a["block_sizes"],
    )


class _Leaf(NamedTuple):
  """One leaf of an adam_magma step: its plan and its entries of every tree."""

  plan: Any
  grad: jax.Array
  mu: jax.Array
  nu: jax.Array
  param: Any  # with weight decay, else None
  param_mask: Any  # None where every entry exists
  score: Any  # the block scores s_{t-1} (MaskedNode where unscoped)
  norm: Any  # the carried ||m_{t-1}||^2 per block (MaskedNode where unscoped)


def _leaves(plans, treedef, updates, state, params, param_mask, adam) -> list[_Leaf]:
  """The step's per-leaf records."""
  grads = treedef.flatten_up_to(updates)
  n = len(grads)
  blank = [optax.MaskedNode()] * n
  if param_mask is None:
    masks = [None] * n
  else:
    masks = _trees.split_param_mask_like(treedef, param_mask, grads)
  scores = treedef.flatten_up_to(state.mask_state.scores) if plans else blank
  return [
    _Leaf(*fields)
    for fields in zip(
      plans,
      grads,
      treedef.flatten_up_to(state.mu),
      treedef.flatten_up_to(state.nu),
      treedef.flatten_up_to(params) if adam.has_decay else [None] * n,
      masks,
      scores,
      treedef.flatten_up_to(state.mu_sq_norm) if plans else blank,
      strict=True,
    )
  ]


def _start(leaf: _Leaf, adam: _AdamConfig, count: Any, count_inc: Any) -> Any:
  """The first half of a leaf's step (:func:`kernels.start_masked_adam`)."""
  scoped = leaf.plan.layout is not None
  wd = _schedules.evaluate(adam.weight_decay, count) if adam.has_decay else 0.0
  return kernels.start_masked_adam(
    leaf.grad,
    leaf.mu,
    leaf.nu,
    count=count_inc,
    learning_rate=_schedules.evaluate(adam.learning_rate, count),
    b1=adam.b1,
    b2=adam.b2,
    eps=adam.eps,
    eps_root=adam.eps_root,
    weight_decay=wd,
    params=leaf.param,
    param_mask=leaf.param_mask,
    layout=leaf.plan.layout,
    implementation=adam.implementation,
    interpret=adam.interpret,
    block_sizes=adam.block_sizes,
    with_sums=scoped,
    mu_sq_norm_prev=leaf.norm if scoped else None,
  )


class _Done(NamedTuple):
  """A leaf's step: its update, moments, new score and carried norm."""

  update: jax.Array
  mu: jax.Array
  nu: jax.Array
  score: Any
  norm: Any


def _score(leaf, sums, mask, rule, mask_count) -> tuple[Any, Any]:
  """A leaf's new block score and the scale of its update (``None`` unscoped)."""
  if leaf.plan.layout is None:
    return optax.MaskedNode(), None
  cos = _alignment.cosine_from_sums(*sums)
  score = rule.score(leaf.score, cos, mask_count)
  return score, score * mask


def _done(leaf, res, score, norm) -> _Done:
  """A leaf's step from its kernel's output: update, moments, score, carry."""
  if leaf.plan.layout is None:
    return _Done(res.update, res.mu, res.nu, score, optax.MaskedNode())
  if leaf.param_mask is not None:  # the sums covered existing entries only
    norm = leaf.plan.layout.block_sum(jnp.square(res.mu.astype(jnp.float32)))
  return _Done(res.update, res.mu, res.nu, score, norm)


def _new_state(engine, treedef, plans, state, masks, count, done) -> AdamMagmaState:
  """The state after a step: Adam's, and the engine's mask state."""
  mask_state = state.mask_state
  n = len(done)
  mask_state = engine.state(
    treedef,
    plans,
    count=optax.safe_increment(mask_state.count),
    key=mask_state.key,
    masks=masks,
    fields={
      "scores": [d.score for d in done],
      # mu serves as the momentum: the rule's own field stays unused.
      "momentum": [optax.MaskedNode()] * n,
    },
  )
  return AdamMagmaState(
    count=count,
    mu=treedef.unflatten([d.mu for d in done]),
    nu=treedef.unflatten([d.nu for d in done]),
    mu_sq_norm=_engine.block_tree(treedef, [d.norm for d in done], False, jnp.float32),
    mask_state=mask_state,
  )


def _settle(pending: list[Any], b1: Any) -> tuple[list[Any], list[Any], list[Any]]:
  """The scoped leaves' sums with non-finite blocks made exact; the carries.

  Returns ``(pending, sums, norms)`` per leaf (``None`` for unscoped leaves):
  ``pending`` to finish the step with, the sums for the cosine
  (:func:`_alignment.settle_sums`: exact wherever the block's entries are finite)
  and ``||m_t||^2`` to carry (summed directly where the carried one was lost).

  A float32 sum that overflows (entries beyond about ``1e19 / sqrt(block size)``)
  also leaves the carry ``||m||^2`` inf or NaN, and ``kernels.carried_sums`` (or
  ``derived_sums``, from ``||m_{t-1}||^2``) NaN from then on: those blocks are
  recomputed from ``m_t`` and ``g`` too, as ``magma(adam)`` sums them; so are
  blocks whose derived ``||m_t||^2`` cancelled (NaN as well). The XLA
  path has ``m_t`` already, and passes it through the branch (the step returns
  it); the Pallas path computes it there from ``m_{t-1}``, once per reduction, and
  passes ``m_{t-1}`` through (the kernel overwrites its donated buffer later).
  """
  scoped = [i for i, p in enumerate(pending) if p.sums is not None]
  sums, norms = [None] * len(pending), [None] * len(pending)
  if not scoped:
    return pending, sums, norms
  # Through the branch: the XLA leaves' new f32 moments (the step returns them) and
  # the Pallas leaves' m_{t-1} (the kernel overwrites it), read by the others.
  ops = [
    p.mu if p.moments is None else p.moments[0] for p in (pending[i] for i in scoped)
  ]
  reads = [(pending[i].grad, pending[i].param_mask) for i in scoped]

  def vectors(ops, reads):
    out = []
    for i, op, (grad, pm) in zip(scoped, ops, reads, strict=True):
      p = pending[i]
      if p.moments is not None:  # XLA: m_t as the state will hold it
        m = op.astype(p.mu.dtype)
      else:  # Pallas: m_t from m_{t-1}, computed again in each reduction
        m = functools.partial(_moment, b1, op, grad)
      out.append((m, grad, pm))
    return out

  settled, plain, ops = _alignment.settle_sums(
    [pending[i].layout for i in scoped],
    [pending[i].sums for i in scoped],
    vectors,
    ops,
    reads,
    direct=False,  # ||m_t||^2 comes from a carry (or m_{t-1}): sum it again
  )
  pending = list(pending)
  for j, i in enumerate(scoped):
    p = pending[i]
    if p.moments is None:
      p = p._replace(mu=ops[j])
    else:
      p = p._replace(moments=(ops[j], p.moments[1]))
    pending[i] = p._replace(sums=settled[j])
    sums[i], norms[i] = settled[j], plain[j]
  return pending, sums, norms


def _moment(b1: Any, mu: jax.Array, grad: jax.Array) -> jax.Array:
  """``m_t = (1 - b1) g + b1 m_{t-1}`` in ``mu``'s dtype, from inputs of its own
  (a barrier's outputs), so that each reduction computes it in its own pass."""
  return kernels.api.next_moment(b1, *_xla_cpu.unshared((mu, grad)))
