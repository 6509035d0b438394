"""The confidence interval that benchmarks/sparse_state.py prints for median ratios.

Imported by path (``benchmarks/`` is not a package). Checked against what it claims:
coverage of a known median over many simulated benchmarks, whatever the
distribution, and no interval at all where too few rounds cannot give one.
"""

from __future__ import annotations

import math

import _benchmarks
import numpy as np
import optax
import pytest


@pytest.fixture(scope="module")
def bench():
  return _benchmarks.load("sparse_state.py")


@pytest.mark.parametrize("n", [6, 9, 15, 25])
@pytest.mark.parametrize("dist", ["exponential", "lognormal_skewed"])
def test_median_ci_covers_the_true_median(bench, n, dist):
  rng = np.random.default_rng(n)
  trials = 4000
  if dist == "exponential":  # median ln 2
    draws, median = rng.exponential(1.0, (trials, n)), math.log(2.0)
  else:  # median exp(0) = 1
    draws, median = rng.lognormal(0.0, 1.5, (trials, n)), 1.0
  hits, widths = 0, []
  for xs in draws:
    lo, hi = bench.median_ci(xs.tolist())
    hits += lo <= median <= hi
    widths.append(hi - lo)
  coverage = hits / trials
  # The exact coverage is >= 0.95 (0.969 at n=6, 0.961 at 9, 0.965 at 15, 0.957
  # at 25); 4000 trials: standard error <= 0.0035, so 0.95 - 3 se.
  assert coverage >= 0.94, coverage
  # Not trivially wide: from 15 rounds on, narrower than the range on average.
  if n >= 15:
    ranges = draws.max(axis=1) - draws.min(axis=1)
    assert np.mean(widths) < 0.8 * np.mean(ranges)


def test_median_ci_is_the_range_at_six_and_nothing_below(bench):
  assert bench.median_ci([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)
  lo, hi = bench.median_ci([1.0, 2.0, 3.0, 4.0, 5.0])
  assert math.isnan(lo) and math.isnan(hi)
  # 25 rounds: x_(8) and x_(18), coverage 1 - 2 P(B(25, 1/2) <= 7) = 0.957, while
  # x_(9), x_(17) would cover 0.892.
  assert bench.median_ci(list(range(25))) == (7, 17)
  # 90%: 5 rounds suffice (coverage 1 - 2/32 = 0.9375).
  assert bench.median_ci([5.0, 1.0, 4.0, 2.0, 3.0], level=0.9) == (1.0, 5.0)


def test_launch_cost_script_runs_both_parts():
  # A smoke test at tiny sizes: what it prints are timings, never asserted here.
  out = _benchmarks.load("launch_cost.py").main(
    ["--width", "128", "--layers", "1", "--leaves", "2", "--size", "256"]
    + ["--steps", "2", "--rounds", "1", "--calls", "2", "--allocations"]
    + ["--compile"]
  )
  ((plain, looped),) = out["toy"].values()
  assert plain > 0 and looped > 0
  tree = out["tree"]
  assert set(tree) == {"optax.adam", "periodic_mask(sparse_adam tiles 8x128)"}
  assert tree["optax.adam"][2] == 1 + 2 * 6  # count, mu and nu of 6 matrices
  assert all(launch > 0 and total >= launch for launch, total, _ in tree.values())
  counts = out["allocations"]
  assert set(counts) == set(tree)
  adam, tiles = counts["optax.adam"], counts["periodic_mask(sparse_adam tiles 8x128)"]
  # Adam's 6 parameters, 13 state arrays and 6 gradients; the tile step's refresh
  # and reductions bring constants and reducer scalars.
  assert adam["parameter"] == 6 + 13 + 6
  assert tiles["constant"] > 0 and tiles["thread-local"] > 0
  assert tiles["total"] > adam["total"]
  assert set(out["compile"]) == set(tree)
  assert all(lower > 0 and comp > 0 for lower, comp in out["compile"].values())


def test_launch_cost_counts_allocations_by_kind():
  text = """BufferAssignment:
allocation 0: size 16, parameter 0, shape |f32[2,2]| at ShapeIndex {}:
 value: <0 p @0> (size=16,offset=0): f32[2,2]{1,0}
allocation 1: size 16, parameter 1, shape |f32[2,2]| at ShapeIndex {}, maybe-live-out:
 value: <1 s @0> (size=16,offset=0): f32[2,2]{1,0}
allocation 2: size 4, constant:
 value: <2 constant.3 @0> (size=4,offset=0): f32[]
allocation 3: size 1, thread-local:
 value: <3 reduce_sum.1 @0> (size=1,offset=0): u8[]
allocation 4: size 16, output shape is |(f32[2,2], f32[])|, maybe-live-out:
 value: <4 tuple @{}> (size=16,offset=0): (f32[2,2]{1,0}, f32[])
allocation 5: size 64, preallocated-temp:
 value: <5 fusion @0> (size=64,offset=0): f32[16]{0}
"""
  counts = _benchmarks.load("launch_cost.py").count_allocations(text)
  assert counts == {
    "total": 6,
    "constant": 1,
    "thread-local": 1,
    "parameter": 2,
    "maybe-live-out": 2,
    "preallocated-temp": 1,
  }


def test_launch_cost_counts_the_programs_buffer_allocations():
  # One more compile per case: the counts are read from XLA's buffer assignment.
  script = _benchmarks.load("launch_cost.py")
  params = script.transformer_params(128, 1)
  adam = script.allocations(optax.adam(1e-3), params)
  # Adam's program holds its 6 parameters, 13 state arrays and 6 gradients; its
  # outputs are the donated parameters and state: no constant, no reducer scalar.
  assert adam["parameter"] == 6 + 13 + 6
  assert adam["maybe-live-out"] >= 6 + 13
  assert adam["constant"] == adam["thread-local"] == 0
  # A clipped Adam reduces the gradients' norm: thread-local reducer scalars.
  clipped = script.allocations(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), params
  )
  assert clipped["thread-local"] > 0
  assert clipped["total"] > adam["total"]
