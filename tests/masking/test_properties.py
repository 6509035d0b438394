"""Property tests (hypothesis): random pytrees, shapes, granularities and
hyperparameters, each run for a few steps against the plain-numpy Algorithm 1
(tests/algorithm1.py) with the masks the package drew. Tolerance: rtol 2e-5 and
atol 2e-6 on parameters of order 1 (float32 against float64: a parameter that nearly
cancels keeps the absolute float32 rounding of its O(1) start)."""

import algorithm1 as ref
import jax
import numpy as np
import optax
import pytest

import magma_optax as magma

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
STEPS = 3


@st.composite
def problems(draw):
  """(params dict, granularity, stack_axes, tau, keep_prob, seed)."""
  granularity = draw(st.sampled_from(["tensor", "row", "column", "element", "tile"]))
  stack_axes = draw(st.sampled_from([0, 1])) if granularity != "tile" else 0
  n = draw(st.integers(1, 3))
  params = {}
  for i in range(n):
    rank = draw(st.integers(stack_axes + 1, 3))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(rank))
    params[f"p{i}"] = shape
  if granularity == "tile":  # a tile must divide the last axes of every leaf
    shape = tuple(draw(st.sampled_from([2, 4])) for _ in range(2))
    params = {k: (*v[:-2], *(2 * d for d in shape)) if len(v) >= 2 else (2,)
              for k, v in params.items()}  # fmt: skip
    granularity = shape
  tau = draw(st.floats(0.5, 4.0))
  keep_prob = draw(st.sampled_from([0.3, 0.5, 1.0]))
  seed = draw(st.integers(0, 2**16))
  return params, granularity, stack_axes, tau, keep_prob, seed


def _trajectory(tx, shapes, seed):
  key = jax.random.key(seed)
  params = {
    k: jax.random.normal(jax.random.fold_in(key, i), s)
    for i, (k, s) in enumerate(sorted(shapes.items()))
  }
  state, step = tx.init(params), jax.jit(tx.update)
  p0, grads, masks, traj = params, [], [], []
  for t in range(STEPS):
    g = {
      k: jax.random.normal(jax.random.fold_in(key, 100 * (t + 1) + i), x.shape)
      for i, (k, x) in enumerate(sorted(params.items()))
    }
    u, state = step(g, state, params)
    params = optax.apply_updates(params, u)
    grads.append(g)
    masks.append(magma.mask_stats(state)["mask"])
    traj.append(params)
  return p0, grads, masks, traj


def _assert_matches_numpy(tx, shapes, seed, **reference_kwargs):
  """Runs ``tx`` and the numpy Algorithm 1 with the masks it drew; compares."""
  p0, grads, masks, traj = _trajectory(tx, shapes, seed)
  for k in shapes:
    want = ref.magma_run(
      ref.NumpyAdam(1e-2), np.asarray(p0[k]), [np.asarray(g[k]) for g in grads],
      [np.asarray(m[k]) for m in masks], **reference_kwargs,
    )  # fmt: skip
    for got, w in zip((t[k] for t in traj), want, strict=True):
      np.testing.assert_allclose(got, w, rtol=2e-5, atol=2e-6)


@hypothesis.settings(max_examples=8, deadline=None, derandomize=True)
@hypothesis.given(problems())
def test_magma_matches_numpy_algorithm1(problem):
  shapes, granularity, stack_axes, tau, keep_prob, seed = problem
  tx = magma.magma(
    optax.adam(1e-2), tau=tau, keep_prob=keep_prob, key=seed,
    granularity=granularity, stack_axes=stack_axes or None,
  )  # fmt: skip
  _assert_matches_numpy(
    tx, shapes, seed, granularity=granularity, stack_axes=stack_axes, tau=tau
  )


@hypothesis.settings(max_examples=5, deadline=None, derandomize=True)
@hypothesis.given(problems())
def test_skip_update_matches_numpy(problem):
  shapes, granularity, stack_axes, _, keep_prob, seed = problem
  tx = magma.skip_update(
    optax.adam(1e-2), keep_prob=keep_prob, key=seed, granularity=granularity,
    stack_axes=stack_axes or None,
  )  # fmt: skip
  _assert_matches_numpy(
    tx, shapes, seed, granularity=granularity, stack_axes=stack_axes,
    keep_prob=keep_prob, rescale=True,
  )  # fmt: skip
