"""Fast checks of benchmarks/quadratic.py: Proposition 1 and the R^9 construction.

The benchmark is imported by path (``benchmarks/`` is not a package). Proposition 1
is exact for a quadratic, so the Monte-Carlo ratio measured / predicted must be 1
within its standard error; masks come from ``magma.bernoulli_mask``, so a wrong
rescaling, a wrong block layout or correlated block draws would show up here.
"""

from __future__ import annotations

import _benchmarks
import numpy as np
import pytest

import magma_optax as magma


@pytest.fixture(scope="module")
def quadratic():
  return _benchmarks.load("quadratic.py")


@pytest.mark.parametrize(
  "granularity, keep_prob", [("row", 0.5), ("element", 0.25), ((4, 4), 0.75)]
)
def test_proposition1_ratio_is_one_on_a_quadratic(quadratic, granularity, keep_prob):
  r = quadratic.proposition1_quadratic(keep_prob, granularity, 6000, seed=3)
  # Exact identity: only Monte-Carlo error remains; 4 standard errors, and the
  # standard error itself small enough for the check to mean something.
  assert r["se"] < 0.06
  assert abs(r["ratio"] - 1.0) < 4 * r["se"], r


def test_unrescaled_mask_breaks_the_prediction(quadratic):
  # The same estimator must reject a biased mask (rescale=False): then
  # E[Delta~] = p Delta and the excess is far from the predicted term.
  a, c, theta, delta = quadratic.random_quadratic(3)
  draws = quadratic.masked_updates(delta, 0.5, "row", 4000, 0, rescale=False)
  x_masked = theta - draws.reshape(4000, -1)
  excess = quadratic.quadratic_loss(a, c, x_masked) - quadratic.quadratic_loss(
    a, c, theta - delta.reshape(-1)
  )
  ids = quadratic.block_ids(delta.shape, "row")
  predicted = quadratic.predicted_excess(a, delta, ids, 0.5)
  ratio, se = quadratic.mc_ratio(excess, predicted)
  assert abs(ratio - 1.0) > 10 * se


def test_block_ids_match_package_layouts(quadratic):
  shape = (8, 8)
  for granularity in ("tensor", "row", "column", "element", (4, 4), (2, 8)):
    ids = quadratic.block_ids(shape, granularity)
    layout = magma.block_layout(shape, granularity)
    assert ids.max() + 1 == layout.num_blocks
    # Each package block, broadcast back to the leaf, is one constant id.
    values = np.arange(layout.num_blocks, dtype=np.float32).reshape(layout.block_shape)
    spread = np.asarray(layout.to_leaf(values))
    pairs = set(zip(ids.ravel().tolist(), spread.ravel().tolist(), strict=True))
    assert len(pairs) == layout.num_blocks


@pytest.mark.parametrize("case", ["homogeneous", "heterogeneous"])
def test_r9_problem_has_the_papers_spectrum(quadratic, case):
  x, theta_star, residual, hessian = quadratic.r9_problem(case, 7, label_noise=1.0)
  n = x.shape[0]
  np.testing.assert_allclose(x.T @ x / n, hessian, atol=1e-9)
  for b, expected in enumerate(quadratic.EIGENVALUES[case]):
    block = hessian[3 * b : 3 * b + 3, 3 * b : 3 * b + 3]
    np.testing.assert_allclose(np.linalg.eigvalsh(block), expected, rtol=1e-9)
    off = np.delete(hessian[3 * b : 3 * b + 3], range(3 * b, 3 * b + 3), axis=1)
    np.testing.assert_allclose(off, 0.0, atol=1e-9)
  # theta* is the least-squares solution and the label noise has the asked size.
  np.testing.assert_allclose(x.T @ residual, 0.0, atol=1e-8)
  np.testing.assert_allclose(np.mean(residual**2), 1.0, rtol=1e-9)
  assert theta_star.shape == (3, 3)


def test_r9_training_runs_and_learns(quadratic):
  x, theta_star, residual, hessian = quadratic.r9_problem("heterogeneous", 0)
  as_batch = lambda a: np.asarray(a, np.float32)[None]
  curves = np.asarray(
    quadratic.train_r9(
      "adamw+magma",
      as_batch(x),
      as_batch(theta_star),
      as_batch(residual),
      np.asarray([0.1], np.float32),
      np.asarray([0], np.int32),
      steps=200,
      batch=8,
      weight_decay=0.0,
      schedule="cosine",
    )
  )
  assert curves.shape == (1, 1, 201)
  e = theta_star.reshape(-1)
  np.testing.assert_allclose(curves[0, 0, 0], 0.5 * e @ hessian @ e, rtol=1e-5)
  assert np.all(np.isfinite(curves))
  assert curves[0, 0, -1] < 1e-2 * curves[0, 0, 0]
