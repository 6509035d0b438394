"""Exact top-k masks: which entries of a score tree to keep.

The search behind :func:`magma_optax.periodic_mask`: :func:`top_k_masks` keeps
exactly ``k`` entries of a list of score arrays (never a quantile estimate), ties
broken by the higher score, then entries active in the current mask, then the lower
flat index. The k-th score is found by counting passes only (no sort), so sharded
leaves are never gathered. :func:`n_m_mask` keeps ``n`` of every ``m`` along an
axis; :func:`tile_sum` and :func:`untile` rank whole tiles.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from magma_optax._core import shard_map as _shard_map
from magma_optax._core import sharded as _sharded


def _ordered_key(score: jax.Array) -> jax.Array:
  """uint32 keys with the float order of ``score`` (no NaN; -0.0 made +0.0 before)."""
  u = jax.lax.bitcast_convert_type(score.astype(jnp.float32), jnp.uint32)
  return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


_EXACT_F32 = 2**24  # float32 holds every integer up to here exactly


def _sum_exact(x: jax.Array, top: int) -> jax.Array:
  """Sum of the integers ``0 <= x <= top``, as int32.

  Summed in float32, which XLA:CPU vectorises (an int32 sum it does not): exact, in
  any order, while every partial sum stays <= 2**24. Larger arrays add the float32
  sums over their trailing axes (each <= 2**24) in int32. No reshape, so
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
  into uint8 (a quarter of the bytes of a float32 mask, summed 32 lanes at a time),
  then :func:`_sum_exact` adds the 1/c as many partial counts. Only
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


def count_true(masks: list[jax.Array]) -> jax.Array:
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
    below = count_true([m & (i < cand) for m, i in zip(selected, index, strict=True)])
    return jnp.where((cand <= total) & (below < r), cand, t)

  return _shard_map.cond(
    r <= nbits,
    lambda: _shard_map.fori_loop(0, r, next_selected, jnp.int32(-1)),
    lambda: _shard_map.fori_loop(0, nbits, bit, jnp.int32(0)),
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

  return _shard_map.fori_loop(0, 32, bit, jnp.zeros(q.shape, jnp.uint32))


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
    count = count_true([key >= cand for key in keys])
    return b + 1, jnp.where(count >= k, cand, t), count == k

  _, t, exact = _shard_map.while_loop(
    lambda carry: (carry[0] < 32) & ~carry[2],
    bit,
    (jnp.int32(0), jnp.uint32(0), k <= 0),
  )
  return t, exact, k - count_true([key > t for key in keys])


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
     steps (far fewer counting passes than a bisection on the 32 key bits for
     the score distributions tried: ``docs/design/internals.md``).
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
  c_lo = count_true([key >= lo for key in keys])
  c_hi = count_true([key >= hi for key in keys])
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
    return m, count_true([key >= m for key in keys])

  tied = lo_ok & ~done & (jnp.sum(sample == lo) >= 2)
  m, c_m = _shard_map.cond(tied, over_the_gap, lambda: (lo, c_lo))
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
    c = count_true([key >= cand for key in keys])
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
  _, t, _, _, c_gt, _, _, _, exact, _ = _shard_map.while_loop(
    lambda c: ~c[8] & (c[2] - c[1] > 1), step, carry
  )
  return t, exact, k - c_gt  # at the end hi = lo + 1, so #(>= hi) = #(> lo)


def top_k_masks(
  scores: list[jax.Array], actives: list[jax.Array], k: jax.Array
) -> list[jax.Array]:
  """Exact top-``k`` over all entries of ``scores`` (leaves concatenated in order).

  Ties: active entries first, then the lower (global) flat index. The cut is found
  by :func:`_threshold` on order-preserving uint32 keys (counting passes only:
  vectorised, faster than ``jnp.sort`` or ``lax.top_k`` on XLA:CPU, and free of
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
    n_active = count_true(tied_active)
    return _shard_map.cond(
      room <= n_active,
      lambda: (_first_r_cut(tied_active, index, room), jnp.int32(-1)),
      lambda: (
        jnp.int32(jnp.iinfo(jnp.int32).max),
        _first_r_cut(tied_inactive, index, room - n_active),
      ),
    )

  def keep_all_ties():
    return jnp.int32(jnp.iinfo(jnp.int32).max), jnp.int32(jnp.iinfo(jnp.int32).max)

  cut_active, cut_inactive = _shard_map.cond(exact, keep_all_ties, split_ties)
  return [
    ((key > t) | ((key == t) & (i <= jnp.where(a, cut_active, cut_inactive)))) & (k > 0)
    for key, a, i in zip(keys, actives, index, strict=True)
  ]


def top_k_mask(score: jax.Array, active: jax.Array, k: jax.Array) -> jax.Array:
  """:func:`top_k_masks` of one leaf.

  Example:
    >>> import jax.numpy as jnp
    >>> from magma_optax.pruning import topk as _topk
    >>> score = jnp.ones(4)
    >>> active = jnp.array([False, True, False, True])
    >>> _topk.top_k_mask(score, active, jnp.int32(3)).tolist()  # all tie: active first
    [True, True, False, True]
    >>> scores = jnp.array([[4.0, 1.0, 3.0, 2.0]])
    >>> _topk.n_m_mask(scores, active[None], 2, 4, -1).tolist()
    [[True, False, True, False]]
  """
  return top_k_masks([score], [active], k)[0]


def num_keep(sparsity: jax.Array, n: int) -> jax.Array:
  pruned = jnp.round(sparsity.astype(jnp.float32) * n).astype(jnp.int32)
  return jnp.int32(n) - jnp.clip(pruned, 0, n)


def num_keep_host(sparsity: float, n: int) -> int:
  """:func:`num_keep` evaluated on the host (also while ``init`` is traced), for
  checks at init."""
  with jax.ensure_compile_time_eval():
    return int(num_keep(jnp.float32(sparsity), n))


def n_m_mask(
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


def _tiled(x: jax.Array, block: tuple[int, int]) -> jax.Array:
  r, c = block
  *lead, rows, cols = x.shape
  return _sharded.reshape(x, (*lead, rows // r, r, cols // c, c))


def ranked_scores(s: jax.Array) -> jax.Array:
  """``s`` as the rankings compare it: NaN -> ``-inf`` (ranked last), and -0.0 ->
  +0.0 so that the two tie (a select: XLA folds ``s + 0.0`` into ``s``)."""
  return jnp.where(jnp.isnan(s), -jnp.inf, jnp.where(s == 0, jnp.zeros([], s.dtype), s))


def tile_sum(score: jax.Array, block: tuple[int, int]) -> jax.Array:
  """Sum of ``score`` per ``r x c`` tile of the last two axes, as
  :func:`ranked_scores` (``-inf`` for NaN, also from +inf + -inf)."""
  return ranked_scores(jnp.sum(_tiled(score, block), axis=(-3, -1)))


def tile_any(mask: jax.Array, block: tuple[int, int]) -> jax.Array:
  """Whether any entry of each ``r x c`` tile is set."""
  return jnp.any(_tiled(mask, block), axis=(-3, -1))


def untile(tile_mask: jax.Array, block: tuple[int, int]) -> jax.Array:
  """A per-tile mask spread over the entries of its tiles."""
  r, c = block
  *lead, rows, cols = tile_mask.shape
  full = jnp.broadcast_to(tile_mask[..., :, None, :, None], (*lead, rows, r, cols, c))
  return _sharded.reshape(full, (*lead, rows * r, cols * c))
