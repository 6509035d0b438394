"""Periodic parameter masks (CAST-style pruning), kept pure: no post-step hook.

A *parameter mask* says which weights exist; an update mask (``bernoulli_mask``,
``alignment_mask``) says which updates land this step. :func:`periodic_mask` wraps an
inner optimizer and, every ``every`` steps between ``start`` and ``end``, recomputes a
boolean mask per parameter leaf from importance scores:

* ``"magnitude_grad"`` (default): ``|W| * |g|``, the saliency the seed names;
* ``"magnitude"``: ``|W|`` (gradual magnitude pruning);
* a callable ``(param, grad) -> scores`` of the leaf's shape (e.g. ``|g|`` for
  gradient-based regrowth).

Thresholding is exact top-k, never a quantile estimate: at target sparsity ``s`` a leaf
of ``n`` entries keeps ``n - round(s * n)`` of them (``ranking="global"``: the same
count over all scoped entries together). Ties are broken deterministically: higher
score first, then entries that are active in the current mask (no churn among equals),
then the lower flat index (for ``"global"``: leaves in flattening order). NaN scores
rank last. The k-th score is found with counting reductions only (no sort, no
cumulative sum): a bracket from a small grid sample, then interpolation and bisection
steps, each counting the scores above one candidate. Sharded leaves are never
gathered (only the ~4096-entry sample is).

With ``structure=(n, m)`` every group of ``m`` consecutive entries along ``axis`` keeps
exactly ``n`` (N:M semi-structured sparsity, e.g. 2:4), with the same tie-breaking
inside a group.

Purity: the wrapper emits ``u = where(mask, u_inner, -p)`` so that
``optax.apply_updates(p, u) == mask * (p + u_inner)`` *exactly* (``p + (-p)`` is an
exact zero in floating point). Pruned weights are zero after every step without a
post-step hook, unlike jaxpruner. The refresh is traced, conditional on the count (a
``lax.while_loop`` of zero or one iteration, which updates masks and moments in place
where a ``lax.cond`` would copy them every step): one compiled step serves refresh and
ordinary steps, and ordinary steps only pay for a predicate and a ``where``.

Regrowth: entries active in the new mask but not in the old one get their inner
moments reset to zero. Moments are found by name (``mu``, ``nu``, ``trace`` by default)
with ``optax.tree_utils.tree_get_all_with_path`` and accepted when their tree has the
parameters' structure and the leaf the parameter's shape; compact storage from
:func:`magma_optax.sparse_state` resets itself.

The new mask is handed to the inner transform as the extra argument ``param_mask=``
(a pytree like the params: bool arrays, ``optax.MaskedNode`` for unscoped leaves), so
:func:`magma_optax.sparse_state` and :func:`magma_optax.masked_weight_decay` inside it
see it, and it is stored in :class:`PeriodicMaskState` for the model's forward pass
(straight-through: the model computes with ``W * mask``; read it with
``optax.tree_utils.tree_get(opt_state, "PeriodicMaskState").mask``).

Decisions: the mask starts all-active, and nothing is pruned before the first refresh
at ``count == start``; the refresh uses the params and the incoming updates (the
gradients when the wrapper is outermost) of that step; the inner optimizer sees the
incoming updates unmasked (a model that multiplies by the mask already gives zero
gradients for pruned weights).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from magma_optax import _schedules
from magma_optax import _scoping

Importance = str | Callable[[jax.Array, jax.Array], jax.Array]

IMPORTANCES = ("magnitude_grad", "magnitude")
RANKINGS = ("per_leaf", "global")
RAMPS = ("constant", "linear", "cubic")
DEFAULT_MOMENT_NAMES = ("mu", "nu", "trace")


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _check_sparsity_value(name: str, value: Any) -> Any:
  return _schedules.check_range(name, value, 0.0, 1.0, low_open=False, high_open=True)


def polynomial_sparsity_schedule(
  final_sparsity: float,
  *,
  begin_step: int,
  end_step: int,
  initial_sparsity: float = 0.0,
  power: float = 3.0,
) -> optax.Schedule:
  r"""Gradual-magnitude-pruning ramp of the target sparsity (cubic by default).

  .. math::

     s_t = s_f + (s_i - s_f)\left(1 - \frac{\min(\max(t - t_0, 0), T)}{T}\right)^{p},
     \qquad T = t_1 - t_0

  so ``s_t = s_i`` before ``begin_step`` (t_0), ``s_f`` from ``end_step`` (t_1) on, and
  the sparsity grows fast early and slowly near the end (p = 3 is Zhu & Gupta's
  choice; p = 1 is a linear ramp, see :func:`linear_sparsity_schedule`).

  Args:
    final_sparsity: s_f in [0, 1).
    begin_step: t_0 >= 0, the step at which the ramp starts.
    end_step: t_1 > t_0, the step at which ``final_sparsity`` is reached.
    initial_sparsity: s_i in [0, 1) (default 0).
    power: p > 0 (default 3).

  Returns:
    An ``optax.Schedule`` ``count -> f32 sparsity``.

  Example:
    >>> import magma_optax as magma
    >>> sched = magma.polynomial_sparsity_schedule(0.8, begin_step=0, end_step=100)
    >>> round(float(sched(100)), 6), round(float(sched(0)), 6)
    (0.8, 0.0)

  References:
    Zhu & Gupta, To prune, or not to prune, arXiv 1710.01878 (2017), Eq. 1.
  """
  _check_sparsity_value("final_sparsity", final_sparsity)
  _check_sparsity_value("initial_sparsity", initial_sparsity)
  _schedules.check_positive("power", power)
  if not isinstance(begin_step, int) or begin_step < 0:
    raise ValueError(f"begin_step must be an int >= 0; got {begin_step!r}.")
  if not isinstance(end_step, int) or end_step <= begin_step:
    raise ValueError(
      f"end_step must be an int > begin_step={begin_step}; got {end_step!r}."
    )
  span = end_step - begin_step

  def schedule(count):
    t = jnp.clip(jnp.asarray(count, jnp.float32) - begin_step, 0.0, span) / span
    s = final_sparsity + (initial_sparsity - final_sparsity) * (1.0 - t) ** power
    return jnp.asarray(s, jnp.float32)

  return schedule


def linear_sparsity_schedule(
  final_sparsity: float,
  *,
  begin_step: int,
  end_step: int,
  initial_sparsity: float = 0.0,
) -> optax.Schedule:
  """Linear ramp of the target sparsity (the seed's ``dynamic_sparsity``).

  :func:`polynomial_sparsity_schedule` with ``power=1``.

  Example:
    >>> import magma_optax as magma
    >>> sched = magma.linear_sparsity_schedule(0.5, begin_step=0, end_step=10)
    >>> round(float(sched(5)), 6)
    0.25
  """
  return polynomial_sparsity_schedule(
    final_sparsity,
    begin_step=begin_step,
    end_step=end_step,
    initial_sparsity=initial_sparsity,
    power=1.0,
  )


class PeriodicMaskState(NamedTuple):
  """State of :func:`periodic_mask`.

  Attributes:
    count: int32 scalar, number of updates so far.
    mask: pytree like the params; per scoped leaf a bool array of the leaf's shape
      (True = the weight exists), ``optax.MaskedNode`` where unscoped. The mask the
      last update used; the model's forward pass multiplies by it.
    target_sparsity: f32 scalar, the target sparsity at the last refresh.
    sparsity: f32 scalar, fraction of scoped entries pruned by ``mask``.
    num_regrown: int32 scalar, entries that became active at the last refresh.
    inner_state: the inner optimizer's state.
  """

  count: jax.Array
  mask: Any
  target_sparsity: jax.Array
  sparsity: jax.Array
  num_regrown: jax.Array
  inner_state: Any


def _run_if(pred: jax.Array, fn: Callable[[Any], Any], operand: Any) -> Any:
  """``fn(operand)`` if ``pred`` else ``operand``, as a loop of zero or one step.

  A loop updates its carry in place; a ``lax.cond`` would copy ``operand`` into
  its output buffers whichever branch runs (with donated buffers: every step).
  """
  return jax.lax.while_loop(
    lambda c: c[0], lambda c: (jnp.asarray(False), fn(c[1])), (pred, operand)
  )[1]


def _ordered_key(score: jax.Array) -> jax.Array:
  """uint32 keys with the float order of ``score`` (no NaN; -0.0 made +0.0 before)."""
  u = jax.lax.bitcast_convert_type(score.astype(jnp.float32), jnp.uint32)
  return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


_EXACT_F32 = 2**24  # float32 holds every integer up to here exactly


def _sum_exact(x: jax.Array, top: int) -> jax.Array:
  """Sum of the integers ``0 <= x <= top``, as int32.

  Summed in float32, which XLA:CPU vectorises (an int32 sum runs ~2.6x slower there):
  exact, in any order, while every partial sum stays <= 2**24. Larger arrays add the
  float32 sums over their trailing axes (each <= 2**24) in int32. No reshape, so
  sharded arrays reduce locally.
  """
  split = x.ndim
  while split > 0 and math.prod(x.shape[split - 1 :]) * top <= _EXACT_F32:
    split -= 1
  if split == x.ndim:  # a last axis longer than 2**24 / top
    return jnp.sum(x, dtype=jnp.int32)
  inner = jnp.sum(x, axis=tuple(range(split, x.ndim)), dtype=jnp.float32)
  return jnp.sum(inner.astype(jnp.int32), dtype=jnp.int32)


def _count_leaf(mask: jax.Array) -> jax.Array:
  """Number of True entries of ``mask``, as int32.

  The counting passes of the top-k search are most of a mask refresh, so this is
  tuned for XLA:CPU, which writes a reduction's converted input to memory first:
  chunks of ``c`` (a power of two, 16 <= c <= 128) rows along axis -2 are counted
  into uint8 (a quarter of the bytes of a float32 mask, summed 32 lanes at a time:
  1.2-3.3x faster than a float32 sum of the mask), then :func:`_sum_exact` adds the
  ~1/c as many partial counts. Only
  axis -2 is split, at a power of two, so sharded leaves still count locally (the
  partial counts of a chunk split over devices are all-reduced: 1/c of the leaf).
  Leaves without such an axis -2 use :func:`_sum_exact` directly.
  """
  if mask.ndim >= 2:
    rows = mask.shape[-2]
    chunk = math.gcd(rows, 128)
    if chunk >= 16:
      grouped = mask.reshape(*mask.shape[:-2], rows // chunk, chunk, mask.shape[-1])
      return _sum_exact(jnp.sum(grouped, axis=-2, dtype=jnp.uint8), chunk)
  return _sum_exact(mask, 1)


def _count(masks: list[jax.Array]) -> jax.Array:
  return sum((_count_leaf(m) for m in masks), jnp.zeros([], jnp.int32))


def _flat_index(leaves: list[jax.Array]) -> list[jax.Array]:
  """Each entry's index in the leaves' concatenated flat order (an iota XLA fuses)."""
  sizes = [m.size for m in leaves]
  offsets = [sum(sizes[:i]) for i in range(len(sizes))]
  return [
    jnp.arange(n, dtype=jnp.int32).reshape(m.shape) + o
    for m, n, o in zip(leaves, sizes, offsets, strict=True)
  ]


def _first_r_cut(
  selected: list[jax.Array], index: list[jax.Array], r: jax.Array
) -> jax.Array:
  """The cut ``t``: ``selected & (index <= t)`` holds the first ``r`` True entries.

  For ``r`` up to the index's bit length, ``r`` passes each find the next selected
  index (a min-reduction); otherwise ``t`` is the largest index with fewer than
  ``r`` selected entries before it, found by bisection on the index (one count per
  bit). No cumulative sum: both are plain reductions, which stay local (plus a
  scalar all-reduce) when the leaves are sharded. Only meaningful for ``r > 0``.
  """
  total = sum(m.size for m in selected)
  nbits = max(total.bit_length(), 1)

  def next_selected(_, t):
    return functools.reduce(
      jnp.minimum,
      [
        jnp.min(jnp.where(m & (i > t), i, jnp.iinfo(jnp.int32).max))
        for m, i in zip(selected, index, strict=True)
      ],
    )

  def bit(b, t):
    cand = t | (jnp.int32(1) << (nbits - 1 - b))
    below = _count([m & (i < cand) for m, i in zip(selected, index, strict=True)])
    return jnp.where((cand <= total) & (below < r), cand, t)

  return jax.lax.cond(
    r <= nbits,
    lambda: jax.lax.fori_loop(0, r, next_selected, jnp.int32(-1)),
    lambda: jax.lax.fori_loop(0, nbits, bit, jnp.int32(0)),
  )


_SAMPLE = 4096  # sample size for the starting bracket of _threshold
_INTERPOLATED_STEPS = 24  # then bisection only: at most 24 + 32 counting steps
_NO_KEY = np.uint32(2**32 - 1)  # a NaN's key: scores never have it (NaN -> -inf)


def _grid_sample(x: jax.Array, stride: int) -> jax.Array:
  """Every ``s_i``-th entry along each axis, with powers of two ``prod(s_i) <= stride``.

  A grid rather than a flat stride: strided slices per axis stay local when ``x``
  is sharded (a flat stride needs a reshape that gathers a sharded leaf). The
  stride of the axis with the most sampled entries doubles first.
  """
  strides = [1] * x.ndim
  while True:
    sizes = [-(-d // s) for d, s in zip(x.shape, strides, strict=True)]
    axis = max(range(x.ndim), key=lambda a: (sizes[a], a))
    if sizes[axis] < 2 or 2 * math.prod(strides) > stride:
      break
    strides[axis] *= 2
  return x[tuple(slice(None, None, s) for s in strides)]


def _sample_keys(keys: jax.Array, q: jax.Array) -> jax.Array:
  """For each rank ``q[j]`` (1 = largest), the ``q[j]``-th largest entry of ``keys``.

  Bisection on the key bits (32 counting passes over the small 1-D ``keys``).
  """

  def bit(b, t):
    cand = t | (jnp.uint32(1) << (31 - b).astype(jnp.uint32))
    counts = jnp.sum(keys >= cand[:, None], axis=1, dtype=jnp.int32)
    return jnp.where(counts >= q, cand, t)

  return jax.lax.fori_loop(0, 32, bit, jnp.zeros(q.shape, jnp.uint32))


def _bisect_threshold(
  keys: list[jax.Array], k: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`_threshold` by bisection on the key bits (<= 32 + 1 counting passes).

  ``t`` is the largest key with ``#(keys >= t) >= k``; a candidate with exactly
  ``k`` keys at or above it ends the search early.
  """

  def bit(carry):
    b, t, _ = carry
    cand = t | (jnp.uint32(1) << (31 - b).astype(jnp.uint32))
    count = _count([key >= cand for key in keys])
    return b + 1, jnp.where(count >= k, cand, t), count == k

  _, t, exact = jax.lax.while_loop(
    lambda carry: (carry[0] < 32) & ~carry[2],
    bit,
    (jnp.int32(0), jnp.uint32(0), k <= 0),
  )
  return t, exact, k - _count([key > t for key in keys])


def _threshold(
  keys: list[jax.Array], k: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(t, exact, room)``: the top ``k`` keys are ``{keys > t}`` plus ties at ``t``.

  Either ``exact`` (``#(keys >= t) == k``: every tie fits, or ``k <= 0``), or
  ``#(keys >= t) > k > #(keys > t)`` and ``room = k - #(keys > t)`` ties fit. Keys
  are never ``2**32 - 1``. Each step counts the keys above one candidate (a plain
  reduction per leaf, local when leaves are sharded) and keeps a bracket
  ``lo < hi`` with ``#(>= lo) > k > #(>= hi)``:

  1. the bracket starts from a grid sample of ~4096 keys, at the sample ranks
     three standard deviations either side of ``k`` (two counts check it; a side
     that fails falls back to the whole key range); when ``lo`` ties in the
     sample, ``lo`` moves to the smallest key above it (two more passes);
  2. each step counts at a candidate inside the bracket, interpolated linearly
     between the bracket's counts (keys are ~logarithmic in the scores, so the
     counts are smooth there; Illinois weighting), and ends the search when
     exactly ``k`` keys are at or above it. A step that does not halve the number
     of keys inside the bracket is followed by a bisection step (heavy ties,
     gaps), and after 24 steps only bisection runs, so the search ends within 56
     steps. Over the score distributions we tried (products of normals, zero
     blocks, log-normal, uniform, clusters, few distinct values) it took 2-26
     counting passes, ~9 on average, where a bisection on the 32 key bits took
     ~20-32.
  """
  n = sum(key.size for key in keys)
  stride = n // _SAMPLE
  if stride < 16:  # few keys: the sample and the loop's bookkeeping would not pay
    return _bisect_threshold(keys, k)
  sample = jnp.concatenate([_grid_sample(key, stride).reshape(-1) for key in keys])
  s = sample.size
  r = k.astype(jnp.float32) * (s / n)
  d = 3.0 * jnp.sqrt(jnp.maximum(r * (1.0 - r / s), 1.0)) + 2.0
  q = jnp.stack([jnp.ceil(r + d), jnp.floor(r - d)]).astype(jnp.int32)
  lo, hi = _sample_keys(sample, jnp.clip(q, 1, s))
  hi = jnp.where(hi == _NO_KEY, hi, hi + 1)
  c_lo = _count([key >= lo for key in keys])
  c_hi = _count([key >= hi for key in keys])
  lo_ok, hi_ok = c_lo >= k, c_hi < k
  lo, c_lo = jnp.where(lo_ok, lo, jnp.uint32(0)), jnp.where(lo_ok, c_lo, n)
  hi, c_hi = jnp.where(hi_ok, hi, _NO_KEY), jnp.where(hi_ok, c_hi, 0)
  done = (c_lo == k) | (k <= 0)

  # A tie block at lo (the sample has lo twice; typically the pruned weights'
  # zero scores when a ramp cuts just above them) is followed by a gap that
  # interpolation crosses slowly: step over it to the smallest key above lo.
  def over_the_gap():
    m = functools.reduce(
      jnp.minimum, [jnp.min(jnp.where(key > lo, key, _NO_KEY)) for key in keys]
    )
    return m, _count([key >= m for key in keys])

  tied = lo_ok & ~done & (jnp.sum(sample == lo) >= 2)
  m, c_m = jax.lax.cond(tied, over_the_gap, lambda: (lo, c_lo))
  # No key lies strictly between lo and m, so #(>= lo + 1) = c_m.
  gap_ends = c_m < k
  hi, c_hi = jnp.where(gap_ends, lo + 1, hi), jnp.where(gap_ends, c_m, c_hi)
  lo, c_lo = jnp.where(gap_ends, lo, m), jnp.where(gap_ends, c_lo, c_m)
  done = done | (c_lo == k)

  def step(carry):
    i, lo, hi, c_lo, c_hi, f_lo, f_hi, side, _, interpolate = carry
    span = hi - lo
    guess = jnp.clip(
      f_lo / (f_lo - f_hi) * span.astype(jnp.float32), 1.0, 2.0**32 - 256
    )
    guess = jnp.clip(guess.astype(jnp.uint32), 1, span - 1)
    cand = lo + jnp.where(interpolate & (i < _INTERPOLATED_STEPS), guess, span // 2)
    c = _count([key >= cand for key in keys])
    above, below = c > k, c < k
    f = (c - k).astype(jnp.float32)
    # Illinois: an end kept twice in a row has its weight halved, so that the next
    # guess moves towards it (plain regula falsi creeps in from one side).
    f_lo = jnp.where(above, f, jnp.where(side < 0, 0.5, 1.0) * f_lo)
    f_hi = jnp.where(below, f, jnp.where(side > 0, 0.5, 1.0) * f_hi)
    new_lo, new_c_lo = jnp.where(above, cand, lo), jnp.where(above, c, c_lo)
    new_hi, new_c_hi = jnp.where(below, cand, hi), jnp.where(below, c, c_hi)
    halved = 2 * (new_c_lo - new_c_hi) <= c_lo - c_hi
    return (
      i + 1,
      jnp.where(c == k, cand, new_lo),
      new_hi,
      new_c_lo,
      new_c_hi,
      f_lo,
      f_hi,
      jnp.where(above, 1, -1),
      c == k,
      halved | ~interpolate,
    )

  f_lo, f_hi = (c_lo - k).astype(jnp.float32), (c_hi - k).astype(jnp.float32)
  carry = (jnp.int32(0), lo, hi, c_lo, c_hi, f_lo, f_hi, jnp.int32(0), done, True)
  _, t, _, _, c_gt, _, _, _, exact, _ = jax.lax.while_loop(
    lambda c: ~c[8] & (c[2] - c[1] > 1), step, carry
  )
  return t, exact, k - c_gt  # at the end hi = lo + 1, so #(>= hi) = #(> lo)


def _top_k_masks(
  scores: list[jax.Array], actives: list[jax.Array], k: jax.Array
) -> list[jax.Array]:
  """Exact top-``k`` over all entries of ``scores`` (leaves concatenated in order).

  Ties: active entries first, then the lower (global) flat index. The cut is found
  by :func:`_threshold` on order-preserving uint32 keys (counting passes only:
  vectorised, far faster than ``jnp.sort`` or ``lax.top_k`` on XLA:CPU, and free of
  gathers when leaves are sharded); ties at that value are split by
  :func:`_first_r_cut` only when more of them tie than fit. The branch returns
  scalars only, and the masks come from one element-wise pass.
  """
  keys = [_ordered_key(s) for s in scores]
  t, exact, room = _threshold(keys, k)
  index = _flat_index(keys)

  def split_ties():
    # Active ties first: cut among them when they fill the room, else keep them
    # all and cut among the inactive ones (one search either way).
    tied = [key == t for key in keys]
    tied_active = [m & a for m, a in zip(tied, actives, strict=True)]
    tied_inactive = [m & ~a for m, a in zip(tied, actives, strict=True)]
    n_active = _count(tied_active)
    return jax.lax.cond(
      room <= n_active,
      lambda: (_first_r_cut(tied_active, index, room), jnp.int32(-1)),
      lambda: (
        jnp.int32(jnp.iinfo(jnp.int32).max),
        _first_r_cut(tied_inactive, index, room - n_active),
      ),
    )

  def keep_all_ties():
    return jnp.int32(jnp.iinfo(jnp.int32).max), jnp.int32(jnp.iinfo(jnp.int32).max)

  cut_active, cut_inactive = jax.lax.cond(exact, keep_all_ties, split_ties)
  return [
    ((key > t) | ((key == t) & (i <= jnp.where(a, cut_active, cut_inactive)))) & (k > 0)
    for key, a, i in zip(keys, actives, index, strict=True)
  ]


def _top_k_mask(score: jax.Array, active: jax.Array, k: jax.Array) -> jax.Array:
  """:func:`_top_k_masks` of one leaf."""
  return _top_k_masks([score], [active], k)[0]


def _num_keep(sparsity: jax.Array, n: int) -> jax.Array:
  pruned = jnp.round(sparsity.astype(jnp.float32) * n).astype(jnp.int32)
  return jnp.int32(n) - jnp.clip(pruned, 0, n)


def _n_m_mask(
  score: jax.Array, active: jax.Array, n: int, m: int, axis: int
) -> jax.Array:
  """Keeps the ``n`` best of every ``m`` consecutive entries along ``axis``."""
  s = jnp.moveaxis(score, axis, -1)
  a = jnp.moveaxis(active, axis, -1)
  moved_shape = s.shape
  s = s.reshape(*moved_shape[:-1], moved_shape[-1] // m, m)
  a = a.reshape(s.shape)
  si, sj = s[..., :, None], s[..., None, :]
  ai, aj = a[..., :, None], a[..., None, :]
  j_lt_i = jnp.arange(m)[None, :] < jnp.arange(m)[:, None]
  beats = (sj > si) | ((sj == si) & (aj & ~ai)) | ((sj == si) & (aj == ai) & j_lt_i)
  keep = jnp.sum(beats, axis=-1) < n
  return jnp.moveaxis(keep.reshape(moved_shape), -1, axis)


def _scores(importance: Importance, param: jax.Array, grad: jax.Array) -> jax.Array:
  p = param.astype(jnp.float32)
  g = grad.astype(jnp.float32)
  if importance == "magnitude_grad":
    s = jnp.abs(p) * jnp.abs(g)
  elif importance == "magnitude":
    s = jnp.abs(p)
  else:
    s = jnp.asarray(importance(param, grad), jnp.float32)
    if s.shape != param.shape:
      raise ValueError(
        f"importance callable returned shape {s.shape} for a parameter of shape"
        f" {param.shape}; it must return one score per entry."
      )
  # NaN ranks last; + 0.0 turns -0.0 into +0.0 so that the two tie.
  return jnp.where(jnp.isnan(s), -jnp.inf, s) + 0.0


def reset_moments(
  inner_state: Any, reset: list[Any], treedef: Any, names: tuple[str, ...]
) -> Any:
  """Zeroes the entries ``reset[i]`` (bool, leaf-shaped, or None) of named moments.

  Fields called one of ``names`` are found with ``optax.tree_utils``; a field is
  changed only where its tree has ``treedef`` (``MaskedNode`` allowed) and a leaf
  has the shape of ``reset[i]``.
  """
  for name in names:
    for path, value in optax.tree_utils.tree_get_all_with_path(inner_state, name):
      leaves = _scoping.per_leaf(treedef, value)
      if leaves is None:
        continue
      new_leaves = []
      for m, r in zip(leaves, reset, strict=True):
        if r is None or not hasattr(m, "shape") or m.shape != r.shape:
          new_leaves.append(m)
        else:
          new_leaves.append(jnp.where(r, jnp.zeros([], m.dtype), m))
      inner_state = optax.tree_utils.tree_set(
        inner_state,
        lambda p, v, target=path: p == target,
        **{name: treedef.unflatten(new_leaves)},
      )
  return inner_state


def validate_nm_structure(structure: Any) -> tuple[int, int]:
  """Checks an N:M structure ``(n, m)``: ints with ``1 <= n <= m``."""
  ok = (
    isinstance(structure, tuple | list)
    and len(structure) == 2
    and all(isinstance(v, int) and not isinstance(v, bool) for v in structure)
  )
  if not ok or not 1 <= structure[0] <= structure[1]:
    raise ValueError(
      f"structure must be None or (n, m) ints with 1 <= n <= m (N:M keeps n of"
      f" every m); got {structure!r}."
    )
  return tuple(structure)


def periodic_mask(
  inner: optax.GradientTransformation,
  *,
  sparsity: _schedules.ScalarOrSchedule | None = None,
  every: int,
  importance: Importance = "magnitude_grad",
  structure: tuple[int, int] | None = None,
  schedule: str | None = None,
  start: int = 0,
  end: int | None = None,
  where: _scoping.Where = None,
  ranking: str = "per_leaf",
  axis: int = -1,
  moment_names: tuple[str, ...] = DEFAULT_MOMENT_NAMES,
) -> optax.GradientTransformationExtraArgs:
  r"""Prunes parameters to a target sparsity with a mask recomputed every few steps.

  At steps ``t = start, start + every, ...`` (up to ``end``, inclusive)::

      S     = importance(W_t, g_t)                 (default |W| * |g|, per entry)
      M_t   = top-k(S) per leaf                    (k = n - round(s_t n); or N:M)
      reset inner moments where M_t & ~M_{t-1}     (regrown weights start fresh)

  and at every step, with ``M`` the current mask::

      u_inner, inner_state = inner.update(g, inner_state, W, param_mask=M)
      u = where(M, u_inner, -W)        so that   W + u == M * (W + u)   exactly.

  Args:
    inner: the optimizer to wrap, e.g. ``optax.adam(1e-3)`` or
      ``magma.sparse_state(optax.adam(1e-3), mode="compact", density=0.2)``. It
      receives ``param_mask=`` as an extra argument.
    sparsity: target fraction of pruned entries in [0, 1): a float, or an
      ``optax.Schedule`` of the step count (see :func:`polynomial_sparsity_schedule`
      and :func:`linear_sparsity_schedule`). With ``structure=(n, m)`` leave it
      ``None`` (it is ``1 - n / m``).
    every: refresh period T >= 1 in steps.
    importance: ``"magnitude_grad"`` (``|W| |g|``), ``"magnitude"`` (``|W|``) or a
      callable ``(param, grad) -> scores`` of the parameter's shape (higher = keep).
    structure: ``(n, m)`` with 1 <= n <= m for N:M sparsity along ``axis``;
      ``None`` for unstructured top-k.
    schedule: ``None``/``"constant"`` (the target is ``sparsity`` from ``start``),
      ``"linear"`` or ``"cubic"``: ramp from 0 at ``start`` to ``sparsity`` at
      ``end`` (needs a float ``sparsity`` and ``end``).
    start: first refresh step (>= 0); the mask is all-active before it.
    end: last step at which the mask may change (inclusive), or ``None``.
    where: which leaves are pruned (``None``: all floating leaves; a callable
      ``(path, leaf) -> bool`` such as :func:`attention_mlp_weights`; or a pytree of
      bools). Other leaves are never masked.
    ranking: ``"per_leaf"`` (every leaf reaches the target) or ``"global"`` (one
      top-k over all scoped entries; leaves end up with different sparsities).
    axis: the axis along which N:M groups are formed (default: the last).
    moment_names: names of the inner state's per-entry moments to reset on regrowth.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a :class:`PeriodicMaskState`;
    ``params`` must be passed to ``update``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = magma.periodic_mask(optax.adam(1e-2), sparsity=0.5, every=10)
    >>> params = {"w": jnp.arange(1.0, 9.0).reshape(2, 4)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((2, 4))}, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> int((params["w"] == 0).sum())
    4

  References:
    Zhu & Gupta, To prune, or not to prune, arXiv 1710.01878 (2017);
    Lee et al., jaxpruner, arXiv 2304.14082 (2023);
    Mishra et al., Accelerating Sparse Deep Neural Networks (2:4), arXiv 2104.08378.
  """
  # Python ints: they shape the traced step. optax.inject_hyperparams turns numeric
  # arguments, defaults included, into arrays, hence the hint.
  hint = (
    " (With optax.inject_hyperparams, pass static_args=('every', 'start', 'end',"
    " 'axis').)"
  )
  if isinstance(every, bool) or not isinstance(every, int) or every < 1:
    raise ValueError(f"every must be an int >= 1; got {every!r}.{hint}")
  if isinstance(start, bool) or not isinstance(start, int) or start < 0:
    raise ValueError(f"start must be an int >= 0; got {start!r}.{hint}")
  if end is not None and (
    isinstance(end, bool) or not isinstance(end, int) or end < start
  ):
    raise ValueError(f"end must be None or an int >= start={start}; got {end!r}.{hint}")
  if not (callable(importance) or importance in IMPORTANCES):
    raise ValueError(
      f"importance must be one of {IMPORTANCES} or a callable (param, grad) ->"
      f" scores; got {importance!r}."
    )
  if ranking not in RANKINGS:
    raise ValueError(f"ranking must be one of {RANKINGS}; got {ranking!r}.")
  if schedule is None:
    schedule = "constant"
  if schedule not in RAMPS:
    raise ValueError(
      f"schedule must be None or one of {RAMPS}; got {schedule!r} (pass a custom"
      " ramp as sparsity=<optax.Schedule>)."
    )
  if isinstance(axis, bool) or not isinstance(axis, int):
    raise ValueError(f"axis must be an int; got {axis!r}.{hint}")
  if structure is not None:
    structure = validate_nm_structure(structure)
    if sparsity is not None and not _schedules.is_schedule(sparsity):
      implied = 1.0 - structure[0] / structure[1]
      if abs(float(sparsity) - implied) > 1e-6:
        raise ValueError(
          f"sparsity={sparsity} contradicts structure={structure} (which implies"
          f" sparsity {implied}); leave sparsity=None with structure."
        )
    elif sparsity is not None or schedule != "constant":
      raise ValueError(
        "structure=(n, m) fixes the sparsity at 1 - n/m; it takes no sparsity schedule."
      )
    sparsity = 1.0 - structure[0] / structure[1]
  if sparsity is None:
    raise ValueError("sparsity is required (a float in [0, 1) or a schedule).")
  sparsity = _check_sparsity_value("sparsity", sparsity)
  if schedule != "constant":
    if end is None or end <= start or _schedules.is_schedule(sparsity):
      raise ValueError(
        f"schedule={schedule!r} ramps from 0 at start to a float sparsity at end;"
        f" it needs a float sparsity and end > start (got sparsity={sparsity!r},"
        f" start={start}, end={end})."
      )
    sparsity = polynomial_sparsity_schedule(
      float(sparsity),
      begin_step=start,
      end_step=end,
      power=1.0 if schedule == "linear" else 3.0,
    )
  inner = optax.with_extra_args_support(inner)

  def plan(tree):
    plans, treedef = _scoping.plan_scope(tree, where=where)
    return plans, treedef

  def check_structure(plans, leaves):
    if structure is None:
      return
    m = structure[1]
    for p, x in zip(plans, leaves, strict=True):
      if p.layout is None:
        continue
      shape = jnp.shape(x)
      if not shape or not -len(shape) <= axis < len(shape) or shape[axis] % m:
        raise ValueError(
          f"structure={structure} needs axis {axis} of every pruned leaf to be a"
          f" multiple of {m}; leaf {p.index} has shape {shape}. Scope it out with"
          " `where` or choose another axis."
        )

  def init_fn(params):
    plans, treedef = plan(params)
    leaves = treedef.flatten_up_to(params)
    check_structure(plans, leaves)
    masks = [
      optax.MaskedNode() if p.layout is None else jnp.ones(jnp.shape(x), jnp.bool_)
      for p, x in zip(plans, leaves, strict=True)
    ]
    return PeriodicMaskState(
      count=jnp.zeros([], jnp.int32),
      mask=treedef.unflatten(masks),
      target_sparsity=jnp.zeros([], jnp.float32),
      sparsity=jnp.zeros([], jnp.float32),
      num_regrown=jnp.zeros([], jnp.int32),
      inner_state=inner.init(params),
    )

  def new_masks(plans, params, grads, old, target):
    # Zero-size leaves have nothing to rank: their (empty) masks stay as they are.
    idx = [
      i
      for i, p in enumerate(plans)
      if p.layout is not None and math.prod(p.layout.shape) > 0
    ]
    scores = {i: _scores(importance, params[i], grads[i]) for i in idx}
    out = list(old)
    if structure is not None:
      for i in idx:
        out[i] = _n_m_mask(scores[i], old[i], *structure, axis)
    elif ranking == "per_leaf":
      for i in idx:
        k = _num_keep(target, scores[i].size)
        out[i] = _top_k_mask(scores[i], old[i], k)
    elif idx:
      n = sum(scores[i].size for i in idx)
      keep = _top_k_masks(
        [scores[i] for i in idx], [old[i] for i in idx], _num_keep(target, n)
      )
      for i, m in zip(idx, keep, strict=True):
        out[i] = m
    return out

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
        "periodic_mask needs the parameters: call update(updates, state, params)."
      )
    plans, treedef = plan(updates)
    plans = _scoping.match_state(plans, state.mask, treedef)
    grads = treedef.flatten_up_to(updates)
    param_leaves = treedef.flatten_up_to(params)
    old = treedef.flatten_up_to(state.mask)
    count = state.count
    is_refresh = (count >= start) & ((count - start) % every == 0)
    if end is not None:
      is_refresh = is_refresh & (count <= end)
    target = _schedules.evaluate_fraction(sparsity, count)

    scoped = [i for i, p in enumerate(plans) if p.layout is not None]
    total = max(sum(old[i].size for i in scoped), 1)

    # The refresh runs through _run_if, not a cond: on other steps the masks and
    # the inner state pass through untouched, where a cond would copy every mask
    # on every step. The refresh also resets the moments of regrown entries, so
    # nothing after it reads the old masks.
    def refresh(carry):
      old_masks, inner_state, _, _, _ = carry
      masks = new_masks(plans, param_leaves, grads, old_masks, target)
      regrown = [
        None if p.layout is None else masks[i] & ~old_masks[i]
        for i, p in enumerate(plans)
      ]
      num = _count([regrown[i] for i in scoped])
      kept = _count([masks[i] for i in scoped]).astype(jnp.float32)
      # The reset reads and writes every moment, so it runs only when an entry
      # regrew (rare with the default |W|*|g|: pruned weights score 0).
      inner_state = _run_if(
        num > 0,
        lambda s: reset_moments(s, regrown, treedef, moment_names),
        inner_state,
      )
      return masks, inner_state, target, num, 1.0 - kept / total

    masks, inner_state, target_now, num_regrown, sparsity_now = _run_if(
      is_refresh,
      refresh,
      (
        old,
        state.inner_state,
        state.target_sparsity,
        jnp.zeros([], jnp.int32),
        state.sparsity,
      ),
    )
    mask_tree = treedef.unflatten(masks)
    inner_updates, inner_state = inner.update(
      updates, inner_state, params, param_mask=mask_tree, **extra_args
    )
    out = []
    for p, u, w, m in zip(
      plans, treedef.flatten_up_to(inner_updates), param_leaves, masks, strict=True
    ):
      if p.layout is None:
        out.append(u)
        continue
      out.append(jnp.where(m, u, -jnp.asarray(w).astype(u.dtype)))
    new_state = PeriodicMaskState(
      count=optax.safe_increment(count),
      mask=mask_tree,
      target_sparsity=jnp.asarray(target_now, jnp.float32),
      sparsity=jnp.asarray(sparsity_now, jnp.float32),
      num_regrown=num_regrown,
      inner_state=inner_state,
    )
    return treedef.unflatten(out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
