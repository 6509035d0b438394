"""Magma's alignment rule: a per-block score from the cosine of momentum and gradient.

:class:`AlignmentRule` keeps per block ``s_t = 0.9 s_{t-1} + 0.1 sigmoid(cos(mu_t,
g_t) / tau)`` (``tau`` raised to :data:`TAU_FLOOR` at every step) and scales a kept
block by it; :func:`alignment_mask` is the rule as a transformation (the cosine of
its own EMA and of what flows in). Block sums are float32 and overflow-safe: where
they are not finite for finite entries they are recomputed rescaled
(:func:`settle_sums`: one branch for the tree on XLA:CPU, every block both ways in
one pass elsewhere), so the cosine is exact for every block of finite entries.
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
from magma_optax._core import compat as _compat
from magma_optax._core import schedules as _schedules
from magma_optax._core import scoping as _scoping
from magma_optax._core import shard_map as _shard_map
from magma_optax._core import xla_cpu as _xla_cpu
from magma_optax.masking import engine as _engine

# The smallest tau a step uses: below it (0 included) a schedule or an injected
# value is raised to it at every step, as keep probabilities are clipped; at tau = 0
# a zero cosine gives cos / tau = 0 / 0, a NaN score.
TAU_FLOOR = 1e-3


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
    block_axes: static (no arrays): the parameter axes each per-block array
      indexes, read by :func:`magma_optax.sharding.state_shardings`.
  """

  count: jax.Array
  key: jax.Array
  scores: Any
  mask: Any
  momentum: Any
  active_fraction: jax.Array
  active_fraction_by_label: dict[str, jax.Array]
  block_axes: _blocks.DeclaredAxes = _blocks.DeclaredAxes()


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
    b = _xla_cpu.unshared(b)
    ar, ai, br, bi = jnp.real(a), jnp.imag(a), jnp.real(b), jnp.imag(b)
    sums = (
      layout.block_sum(ar * br + ai * bi),
      layout.block_sum(ar * ar + ai * ai),
      layout.block_sum(br * br + bi * bi),
    )
    return sums if axis_name is None else jax.lax.psum(sums, axis_name)
  a = a.astype(jnp.float32)
  # b * b apart from the base optimizer's g * g (_xla_cpu.unshared).
  b = _xla_cpu.unshared(b.astype(jnp.float32))
  sums = (layout.block_sum(a * b), layout.block_sum(a * a), layout.block_sum(b * b))
  if axis_name is not None:
    sums = jax.lax.psum(sums, axis_name)
  return sums


def block_cosine(
  layout: _blocks.BlockLayout, a: jax.Array, b: jax.Array, axis_name: Any = None
) -> jax.Array:
  """Per-block cosine of ``a`` and ``b`` in f32: exact for every block of finite
  entries however large (:func:`exact_sums`; entries below about 1e-19 are lost to
  float32 underflow, see the module docstring), 0 where either block is zero, NaN
  where the block holds an inf or NaN (then :func:`next_score` keeps the score).

  ``axis_name`` (inside ``shard_map``): the mesh axes over which blocks are split;
  the per-block partial sums are ``psum``-ed over them before the cosine is formed.
  This standalone form computes the rescaled sums unconditionally; an optimizer
  step computes them only where the plain sums overflow (:func:`settle_sums`).
  """
  sums, _ = exact_sums(layout, a, b, axis_name=axis_name)
  return cosine_from_sums(*sums)


def cosine_from_sums(dot: jax.Array, aa: jax.Array, bb: jax.Array) -> jax.Array:
  """cos = <a, b> / (||a|| ||b||) from the block sums; 0 where a norm is 0.

  NaN where a sum is not finite (an inf or NaN entry in the block, or float32 sums
  that overflowed and were not recomputed by :func:`exact_sums`). The score update
  (:func:`next_score`) then keeps the block's previous score.
  """
  finite = jnp.isfinite(dot) & jnp.isfinite(aa) & jnp.isfinite(bb)
  norm = jnp.sqrt(aa) * jnp.sqrt(bb)
  ok = finite & (norm > 0)
  cos = jnp.clip(jnp.where(ok, dot / jnp.where(ok, norm, 1.0), 0.0), -1.0, 1.0)
  return jnp.where(finite, cos, jnp.nan)


# The exponent by which exact_sums divides a vector whose float32 sums overflow.
# Finite float32 entries are below 2**128: divided by 2**80 they are below 2**48,
# their squares below 2**96, and a block of up to 2**31 of them sums below 2**127.
# A vector is divided where its squared norm reaches 2**126 (a margin that keeps
# <a, b> <= ||a|| ||b|| finite where neither is divided); an entry of such a block
# is at least 2**63 / sqrt(n) >= 2**47.5 somewhere: divided, it stays above
# 2**-32.5, its square a normal float32, and the entries that underflow instead
# are below 2**-24 of the block's norm in all.
RESCALE_EXPONENT = 80
_LARGE = 2.0**126


def _copies(x: Any, n: int) -> list[Any]:
  """``n`` values of ``x`` that XLA will not merge: ``x()`` called ``n`` times if
  ``x`` is a callable (each call must give a value of its own), else the outputs
  of one barrier (the same buffer, distinct values)."""
  if callable(x):
    return [x() for _ in range(n)]
  return list(jax.lax.optimization_barrier((x,) * n))


def _parts(x: jax.Array, complex_: bool) -> list[jax.Array]:
  """``x`` as float32 parts: ``[x]``, or ``[Re x, Im x]`` where ``complex_``."""
  if complex_:
    x = x.astype(jnp.complex64)
    return [jnp.real(x), jnp.imag(x)]
  return [x.astype(jnp.float32)]


def exact_sums(
  layout: _blocks.BlockLayout,
  a: Any,
  b: Any,
  aa: jax.Array | None = None,
  bb: jax.Array | None = None,
  param_mask: jax.Array | None = None,
  axis_name: Any = None,
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
  """Per-block sums whose cosine is exact for every block of finite entries.

  Returns ``((dot, aa, bb), plain_aa)``. In a block where ``||a||^2`` reaches
  ``2**126`` (or overflows) ``a`` is divided by ``2**RESCALE_EXPONENT`` in all three
  sums, likewise ``b``; elsewhere they are the plain float32 sums. The cosine is
  scale-invariant, so :func:`cosine_from_sums` of the result is the block's
  cosine, NaN only where an entry is inf or NaN. ``plain_aa`` is the unscaled
  ``||a||^2`` (inf where it overflows; a carried norm).

  Every reduction reads vectors and per-block factors of its own: XLA:CPU writes
  a value that two reductions share (a broadcast factor, a bfloat16 leaf's float32
  conversion, a computed vector) to memory, a leaf-sized temporary, instead of
  fusing it into each. (One variadic reduction would do with one kernel, but SPMD
  gathers its sharded operands; a stacked one materialises the stack.)

  Args:
    layout: the leaf's block layout.
    a, b: the vectors (any float or complex dtype; complex: the real inner
      product), or callables that compute one, called once per reduction (each
      call must give a value of its own, e.g. from a barrier's outputs).
    aa, bb: the plain per-block ``||a||^2``, ``||b||^2`` if the caller has them
      (summed directly, over the same entries), else ``None`` (summed here).
    param_mask: entries where it is False are left out.
    axis_name: as in :func:`block_sums`.
  """
  a_copies = _copies(a, 2 if aa is not None else 3)
  b_copies = _copies(b, 2 if bb is not None else 3)
  complex_ = any(jnp.iscomplexobj(x) for x in (a_copies[0], b_copies[0]))

  def parts(copies):
    x = copies.pop()
    if param_mask is not None:
      x = jnp.where(param_mask, x, jnp.zeros((), x.dtype))
    return _parts(x, complex_)

  def total(x):
    return x if axis_name is None else jax.lax.psum(x, axis_name)

  def block_sum(products):
    return total(layout.block_sum(sum(products)))

  if aa is None:
    aa = block_sum(jnp.square(x) for x in parts(a_copies))
  if bb is None:
    bb = block_sum(jnp.square(y) for y in parts(b_copies))
  scale = 2.0**-RESCALE_EXPONENT
  # NaN counts as large. Factors of its own for every reduction (see above).
  fa = jnp.where(~(aa < _LARGE), scale, 1.0)
  fb = jnp.where(~(bb < _LARGE), scale, 1.0)
  factors = jax.lax.optimization_barrier((fa, fb, fa, fb))
  fa1, fb1, fa2, fb2 = (layout.to_leaf(f) for f in factors)
  pairs = zip(parts(a_copies), parts(b_copies), strict=True)
  dot = block_sum((x * fa1) * (y * fb1) for x, y in pairs)
  aa_s = block_sum(jnp.square(x * fa2) for x in parts(a_copies))
  bb_s = block_sum(jnp.square(y * fb2) for y in parts(b_copies))
  return (dot, aa_s, bb_s), aa


def branch_free_sums(
  layout: _blocks.BlockLayout,
  a: jax.Array,
  b: jax.Array,
  param_mask: jax.Array | None = None,
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
  """:func:`exact_sums` in one pass, without a branch or a second read.

  Every block's sums are computed with each vector as it is and divided by
  ``2**RESCALE_EXPONENT``: ``||a||^2`` and ``||b||^2`` both ways, ``<a, b>`` the
  four ways; then each block picks the ones :func:`exact_sums` would compute (the
  same products, exactly). The eight reductions read ``a`` and ``b`` only, so XLA
  on a GPU or a TPU computes them in one multi-output fusion, reading each input
  once; on XLA:CPU each reduction is a pass of its own (:func:`settle_sums` keeps
  the branch there). Returns ``((dot, aa, bb), plain_aa)`` as :func:`exact_sums`.
  """
  complex_ = jnp.iscomplexobj(a) or jnp.iscomplexobj(b)

  def parts(x):
    if param_mask is not None:
      x = jnp.where(param_mask, x, jnp.zeros((), x.dtype))
    return _parts(x, complex_)

  xs, ys = parts(a), parts(b)
  scale = 2.0**-RESCALE_EXPONENT
  xs_s, ys_s = [x * scale for x in xs], [y * scale for y in ys]

  def block_sum(us, vs):
    return layout.block_sum(sum(u * v for u, v in zip(us, vs, strict=True)))

  aa, aa_s = block_sum(xs, xs), block_sum(xs_s, xs_s)
  bb, bb_s = block_sum(ys, ys), block_sum(ys_s, ys_s)
  dots = {
    (False, False): block_sum(xs, ys),
    (True, False): block_sum(xs_s, ys),
    (False, True): block_sum(xs, ys_s),
    (True, True): block_sum(xs_s, ys_s),
  }
  large_a, large_b = ~(aa < _LARGE), ~(bb < _LARGE)  # NaN counts as large
  dot = jnp.where(
    large_a,
    jnp.where(large_b, dots[True, True], dots[True, False]),
    jnp.where(large_b, dots[False, True], dots[False, False]),
  )
  return (dot, jnp.where(large_a, aa_s, aa), jnp.where(large_b, bb_s, bb)), aa


def settle_sums(
  layouts: list[_blocks.BlockLayout],
  sums: list[tuple[jax.Array, jax.Array, jax.Array]],
  vectors: Any,
  operand: Any = (),
  reads: Any = (),
  *,
  direct: bool = True,
) -> tuple[list[tuple[jax.Array, ...]], list[jax.Array], Any]:
  """Every leaf's block sums, made exact where any of them is not finite.

  Args:
    layouts: per leaf its block layout.
    sums: per leaf this step's float32 ``(<a, b>, ||a||^2, ||b||^2)``, ``||b||^2``
      summed directly over the entries ``vectors`` keeps.
    vectors: ``vectors(operand, reads) -> [(a, b, param_mask or None), ...]``, the
      leaves' vectors (arrays or callables, see :func:`exact_sums`), computed in
      the branch; it may read other arrays from outside only if ``operand`` is
      empty.
    operand: arrays that the step returns or overwrites later (new or donated
      moments): they pass through the branch, then a loop that updates them in
      place, and the caller goes on with the ones returned; read from outside a
      branch, XLA copies them on every step.
    reads: other arrays ``vectors`` reads (gradients, parameter masks).
    direct: whether ``||a||^2`` too was summed directly (else it was derived, e.g.
      from a carry, and may be NaN where that was lost: it is summed again).

  Returns:
    ``(sums, plain_aa, operand)``: the sums -- as given, or where any leaf's sums
    are not finite, every leaf's recomputed by :func:`exact_sums` (equal to the
    given ones up to float32 rounding where those were finite); per leaf the
    unscaled ``||a||^2`` (summed directly in that case: a carry to keep); and
    ``operand`` (use it from here on).

  Chosen per backend when the step is lowered (``jax.lax.platform_dependent``).
  On XLA:CPU one branch for the whole tree: ordinary steps pay one test of the
  small per-block sums, never a branch per leaf; reverse mode works through it
  under ``jax.jit`` and ``lax.scan`` too: where the given sums are finite their
  derivatives pass through, and recomputed blocks (non-finite sums) pass none.
  Elsewhere no branch (a GPU or a TPU waits on the host for a branch's
  predicate): every leaf's sums are taken again by :func:`branch_free_sums`, in
  one pass over its vectors, and the given sums are not read.
  """
  sums = [tuple(jnp.asarray(x, jnp.float32) for x in s) for s in sums]
  if not sums:
    return [], [], operand
  # Whether jax.vmap batches the sums, seen here: inside a branch they are traced
  # anew, unbatched.
  on_cpu = _settle_on_cpu(layouts, vectors, direct, _compat.batched(sums))
  # The one place where the step differs by backend (_xla_cpu.branch_on_cpu): on
  # XLA:CPU the rescaled sums run only on steps that need them; a GPU or a TPU
  # reads the vectors once for all the sums, with no branch.
  return _xla_cpu.branch_on_cpu(
    on_cpu, _settle_branch_free(layouts, vectors), sums, operand, reads
  )


def _settle_on_cpu(layouts, vectors, direct: bool, batched: bool) -> Any:
  """:func:`settle_sums` on XLA:CPU: ``(sums, operand, reads) -> (sums, norms,
  operand)``, one branch (or loop of zero or one step) for the whole tree."""

  def rescue(old, ops, rd):
    new, norms = [], []
    for layout, s, (a, b, pm) in zip(layouts, old, vectors(ops, rd), strict=True):
      exact, plain_aa = exact_sums(layout, a, b, s[1] if direct else None, s[2], pm)
      new.append(exact)
      norms.append(plain_aa)
    return new, norms

  def finite(s):
    return jnp.isfinite(s[0]) & jnp.isfinite(s[1]) & jnp.isfinite(s[2])

  def pred(sums):
    # One predicate for the tree (each leaf reduced to a replicated scalar: a
    # concatenation of differently sharded sums is an error on Explicit axes).
    return ~jnp.all(jnp.stack([jnp.all(finite(s)) for s in sums]))

  def on_cpu(sums, operand, reads):
    if not jax.tree.leaves(operand) and not batched:
      # A cond: what it reads is not carried. (A loop's closure is part of its
      # carry, which XLA copies where the step also returns those buffers.)
      new, norms = _shard_map.cond(
        pred(sums),
        lambda args: rescue(args[0], (), args[1]),
        lambda args: (args[0], [s[1] for s in args[0]]),
        (sums, reads),
      )
      return new, norms, operand

    # A loop, whose carry is updated in place: the operand passes through it (and
    # under jax.vmap a cond with a batched predicate runs both branches on every
    # step, a loop only while some member needs it). A loop has no reverse mode,
    # hence the rule below.
    @jax.custom_jvp
    def looped(sums, operand, reads):
      def body(carry):
        new, norms = rescue(carry[0], carry[2], reads)
        return new, norms, _xla_cpu.passed_through(carry[2])

      return _xla_cpu.run_if(pred(sums), body, (sums, [s[1] for s in sums], operand))

    @looped.defjvp
    def _(primals, tangents):
      sums, dsums, doperand = primals[0], tangents[0], tangents[1]
      dnew = [
        tuple(jnp.where(finite(s), d, 0.0) for d in ds)
        for s, ds in zip(sums, dsums, strict=True)
      ]
      dnorms = [
        jnp.where(jnp.isfinite(s[1]), ds[1], 0.0)
        for s, ds in zip(sums, dsums, strict=True)
      ]
      return looped(*primals), (dnew, dnorms, doperand)

    return looped(sums, operand, reads)

  return on_cpu


def _settle_branch_free(layouts, vectors) -> Any:
  """:func:`settle_sums` elsewhere: every leaf's sums taken again by
  :func:`branch_free_sums`, in one pass over its vectors, without a branch."""

  def branch_free(sums, operand, reads):
    del sums  # every sum is taken again, in one pass over the vectors
    new, norms = [], []
    for layout, (a, b, pm) in zip(layouts, vectors(operand, reads), strict=True):
      a, b = (x() if callable(x) else x for x in (a, b))
      exact, plain_aa = branch_free_sums(layout, a, b, pm)
      new.append(exact)
      norms.append(plain_aa)
    return new, norms, operand

  return branch_free


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
      tau=_schedules.check_range(
        "tau", tau, TAU_FLOOR, float("inf"), low_open=False, high_open=True
      ),
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
    """``s_t`` from ``s_{t-1}`` and this step's block cosines (NaN: keep ``s``),
    with ``tau`` at this step raised to :data:`TAU_FLOOR`."""
    inv_tau = 1.0 / jnp.maximum(_schedules.evaluate(self.tau, count), TAU_FLOOR)
    return next_score(prev, cos, inv_tau, self.score_decay)

  def measure(self, leaf: _engine.LeafStep) -> tuple[jax.Array, tuple]:
    """This step's momentum and the block sums ``(<mu, g>, ||mu||^2, ||g||^2)``."""
    own = leaf.state["momentum"]
    if isinstance(own, optax.MaskedNode):
      mu = leaf.momentum
    else:
      mu = optax.tree.update_moment(leaf.signal, own, self.momentum_decay, 1)
      mu = mu.astype(own.dtype)
    return mu, block_sums(leaf.plan.layout, mu, leaf.signal)

  def settle(self, leaves: list[_engine.LeafStep]) -> list[tuple[jax.Array, tuple]]:
    """Blocks whose float32 sums overflowed, made exact (:func:`settle_sums`)."""
    sums, _, _ = settle_sums(
      [leaf.plan.layout for leaf in leaves],
      [leaf.measured[1] for leaf in leaves],
      lambda _, reads: [(mu, g, None) for mu, g in reads],
      reads=[(leaf.measured[0], leaf.signal) for leaf in leaves],
    )
    return [(leaf.measured[0], s) for leaf, s in zip(leaves, sums, strict=True)]

  def scale(self, leaf: _engine.LeafStep) -> tuple[jax.Array, dict[str, Any]]:
    mu, sums = leaf.measured
    new: dict[str, Any] = {}
    if not isinstance(leaf.state["momentum"], optax.MaskedNode):
      new["momentum"] = mu
    s = new["scores"] = self.score(
      leaf.state["scores"], cosine_from_sums(*sums), leaf.count
    )
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
    tau: temperature tau >= 1e-3 of the sigmoid (float or schedule). A
      schedule is checked at step 0 and raised to 1e-3 at every step where it
      falls below (0 would make the scores NaN).
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
    _arguments.from_arguments(_engine.MaskConfig.create, arguments),
    _arguments.from_arguments(AlignmentRule.create, arguments),
    name="alignment_mask",
  ).transformation()
