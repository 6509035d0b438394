"""Exact top-k of many score arrays at once, in a fixed number of counting passes.

The refresh's search on GPUs and TPUs, which run a data-dependent loop or branch by
reading its predicate back to the host: here every loop has a constant trip count,
and one loop serves every array. Ranking and ties as
:func:`magma_optax.pruning.topk.top_k_masks` (higher score, then active, then lower
flat index), found by counting passes only (reductions: sharded arrays are never
gathered, their counts all-reduced).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from magma_optax._core import shard_map as _shard_map
from magma_optax._core import sharded as _sharded
from magma_optax.pruning import topk as _topk

# Bits of the cut decided per counting pass: each pass counts every entry against
# 2**_DIGIT - 1 candidates at once (one variadic reduction per array). It divides 32.
_DIGIT = 4
_ALL = np.uint32(2**32 - 1)
# The most entries one search ranks together: a tie's rank packs its activity and
# its index into 32 bits.
MAX_ENTRIES = 2**31 - 1


def _passes(bits: int) -> int:
  return -(-bits // _DIGIT)


def _kth_largest(
  values: Sequence[Callable[[], jax.Array]],
  lead: Sequence[int],
  k: Sequence[jax.Array],
  bits: int,
  joint: bool,
) -> list[jax.Array]:
  """The cut ``t`` (uint32 ``< 2**bits``, largest with ``#(values >= t) >= k``).

  ``values[i]()`` builds array ``i`` (uint32); its first ``lead[i]`` axes index
  rows. Per row, with ``k[i]`` (broadcast to the rows of array ``i``), or with
  ``joint`` one cut over every entry of every array (``k[0]``, a scalar). The cut
  is built ``_DIGIT`` bits a pass, from the top: a pass counts the entries at or
  above each of the ``2**_DIGIT - 1`` candidates ``t + j 2**shift`` (counts fall
  with ``j``), and the number of candidates whose count reaches ``k`` is the digit.
  One ``fori_loop`` of ``ceil(bits / _DIGIT)`` passes for all arrays.
  """
  steps = _passes(bits)
  candidates = 2**_DIGIT - 1

  def counts(i, prefix, shift):
    x = values[i]()
    rest = tuple(range(lead[i], x.ndim))
    shape = prefix.shape + (1,) * len(rest)
    ops = tuple(
      (x >= (prefix + (jnp.uint32(j) << shift)).reshape(shape)).astype(jnp.int32)
      for j in range(1, candidates + 1)
    )
    return jax.lax.reduce(
      ops,
      (jnp.int32(0),) * candidates,
      lambda a, b: tuple(u + v for u, v in zip(a, b, strict=True)),
      rest,
    )

  def digit(c, k):
    return sum((x >= k).astype(jnp.uint32) for x in c)

  def step(p, prefixes):
    shift = ((steps - 1 - p) * _DIGIT).astype(jnp.uint32)
    if joint:  # one cut: the counts of every array (all rows) add up
      (t,) = prefixes
      per_array = [counts(i, t, shift) for i in range(len(values))]
      c = [sum(jnp.sum(x) for x in cs) for cs in zip(*per_array, strict=True)]
      return [t + (digit(c, k[0]) << shift)]
    return [
      t + (digit(counts(i, t, shift), k[i]) << shift) for i, t in enumerate(prefixes)
    ]

  if joint:
    init = [jnp.zeros([], jnp.uint32)]
  else:
    # Over Explicit mesh axes a cut has its rows' sharding type, as the counts
    # the loop's body adds to it (a carry must keep its type).
    init = []
    for v, j in zip(values, lead, strict=True):
      x = v()
      spec = _sharded.explicit_spec(x)
      zeros = jnp.zeros(x.shape[:j], jnp.uint32)
      init.append(zeros if spec is None else _sharded.put_like(zeros, x, spec[:j]))
  return _shard_map.fori_loop(0, steps, step, init)


def top_k(
  scores: Sequence[jax.Array],
  actives: Sequence[jax.Array],
  k: Sequence[jax.Array],
  lead: Sequence[int] | None = None,
  joint: bool = False,
  row_offsets: Sequence[Sequence[int]] | None = None,
) -> list[jax.Array]:
  """Exact top-``k`` masks, per row of each array or over all entries at once.

  ``scores[i]`` (float32 as :func:`magma_optax.pruning.topk.ranked_scores` makes
  them: no NaN) and the bool ``actives[i]`` have one shape, whose first
  ``lead[i]`` axes (default none) index rows. Each row keeps its ``k[i]`` best
  entries (``k[i]`` a scalar or of the rows' shape), or with ``joint=True`` one
  top-``k[0]`` runs over the entries of all rows of all arrays, in the order of
  their rows (``row_offsets[i][r]``: where row ``r`` of array ``i``, its lead axes
  flattened, starts; default: rows and arrays one after the other). Ties: the
  higher score, then active entries, then the lower flat index in the row (joint:
  in that order). Exactly ``min(k, n)`` entries of a row of ``n`` stay.

  Two searches over a uint32 value per entry, each one ``fori_loop`` of constant
  trip count for all arrays: the k-th largest order-preserving key ``T1`` of the
  scores, then the k-th largest of ``v = where(key > T1, 2**32 - 1, where(key ==
  T1, active 2**B + 2**B - 1 - index, 0))`` (ties ranked), ``T2``; the mask is
  ``v >= T2``. With ``D = _DIGIT`` bits decided per pass and ``n`` the largest
  row (joint: all entries), the scores are read in

      1 + 32 / D + ceil((B + 1) / D) + 1   passes,   B = bit_length(n):

  the keys built once (4 bytes per entry written), ``32 / D`` counting passes over
  the keys, ``ceil((B + 1) / D)`` over keys and actives (5 bytes per entry), and
  the masks. A counting pass compares every entry with ``2**D - 1`` candidates in
  one reduction per array and adds up per row (joint: all-reduced to one count
  per candidate).

  Example:
    >>> import jax.numpy as jnp
    >>> from magma_optax.pruning import radix_select
    >>> s = jnp.array([[0.5, 2.0, 2.0, -1.0], [3.0, 0.0, 1.0, 2.0]])
    >>> a = jnp.array([[True, False, True, True], [False] * 4])
    >>> (m,) = radix_select.top_k([s], [a], [1], lead=[1])
    >>> m.astype(int).tolist()  # a tie at 2.0: the active entry wins
    [[0, 0, 1, 0], [1, 0, 0, 0]]
  """
  n = len(scores)
  lead = [0] * n if lead is None else list(lead)
  keys = [_topk._ordered_key(s) for s in scores]
  k = [jnp.asarray(x, jnp.int32) for x in k]
  rows = [x.shape[:j] for x, j in zip(keys, lead, strict=True)]
  sizes = [math.prod(x.shape[j:]) for x, j in zip(keys, lead, strict=True)]
  if joint:
    if row_offsets is None:
      starts = [0]
      for r, size in zip(rows, sizes, strict=True):
        starts.append(starts[-1] + math.prod(r) * size)
      row_offsets = [
        [start + j * size for j in range(math.prod(r))]
        for start, r, size in zip(starts[:-1], rows, sizes, strict=True)
      ]
    total = sum(math.prod(r) * size for r, size in zip(rows, sizes, strict=True))
  else:
    total = max(sizes, default=1)
  if total > MAX_ENTRIES:
    raise ValueError(
      f"top_k ranks at most MAX_ENTRIES = {MAX_ENTRIES} entries together; got {total}."
    )
  bits = max(total.bit_length(), 1)  # every index < 2**bits - 1

  t1 = _kth_largest([lambda x=x: x for x in keys], lead, k, 32, joint)
  t1 = t1 * n if joint else t1  # the one cut, for every array

  def ranked_ties(i):
    x, a, j = keys[i], actives[i], lead[i]
    rest = x.shape[j:]
    index = jnp.arange(math.prod(rest), dtype=jnp.uint32).reshape(rest)
    if joint:
      index = index + jnp.asarray(row_offsets[i], jnp.uint32).reshape(
        rows[i] + (1,) * len(rest)
      )
    t = t1[i].reshape(t1[i].shape + (1,) * len(rest))
    lo = (a.astype(jnp.uint32) << bits) | (jnp.uint32(2**bits - 1) - index)
    return jnp.where(x > t, _ALL, jnp.where(x == t, lo, jnp.uint32(0)))

  values = [functools.partial(ranked_ties, i) for i in range(n)]
  t2 = _kth_largest(values, lead, k, bits + 1, joint)
  t2 = t2 * n if joint else t2
  out = []
  for i in range(n):
    v = ranked_ties(i)
    out.append(v >= t2[i].reshape(t2[i].shape + (1,) * (v.ndim - lead[i])))
  return out
