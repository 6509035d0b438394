"""Quadratic experiments of arXiv 2602.15322: Proposition 1, and Magma in R^9.

Part (a) -- Proposition 1 (Monte Carlo)
---------------------------------------
For SkipUpdate with keep probability p, per block b the applied update is
Delta~_b = (z_b / p) Delta_b with z_b ~ Bernoulli(p) independent across blocks, and the
paper's Proposition 1 states::

    E[l(theta - Delta~)] = l(theta - Delta) + sum_b (1-p)/(2p) Delta_b^T H_bb Delta_b
                           + O(||Delta||^3),

with H the Hessian at theta - Delta. For an exact quadratic l(x) = x^T A x / 2 + c^T x
the third-order term is zero and the identity is exact: with e = Delta~ - Delta,
l(theta - Delta~) - l(theta - Delta) = -grad l(theta - Delta)^T e + e^T A e / 2,
E[e] = 0 and E[e_b e_b'^T] = 0 for b != b', E[e_b e_b^T] = (1-p)/p Delta_b Delta_b^T.

Setup: the parameter is an (8, 8) matrix (d = 64 coordinates, row-major),
A = Q diag(lam) Q^T with a random rotation Q and eigenvalues log-uniform in
[1e-2, 1e2] (a dense, badly conditioned PSD matrix, so off-diagonal blocks are
non-zero and must cancel), a random c, theta and Delta. The masked updates Delta~
are drawn with the package's own ``magma.bernoulli_mask(p, granularity=g, key=k)``
(one key per sample, vmapped), so the check exercises the package's block layouts
and rescaling; the loss, the prediction and the block structure (explicit block ids
per coordinate) are plain float64 numpy.
We report the ratio  measured excess / predicted term  with its Monte-Carlo standard
error, for p in {0.25, 0.5, 0.75} and granularities "tensor" (1 block), "row"
(8 blocks of 8), tile (4, 4) (4 blocks of 16) and "element" (64 blocks of 1). As a
control, the last column divides the same measurement by the prediction with H_bb
replaced by its diagonal: it must differ from 1 for blocks larger than one entry.
The prediction is exact here, so every ratio should be 1 within a few standard errors
(each cell uses fresh mask keys, so the cells' errors are independent).

A second table (``--nonquadratic``) uses a smooth non-quadratic loss, the logistic
loss l(x) = mean_i log(1 + exp(-y_i a_i^T x)), with H its Hessian at theta - Delta and
Delta scaled by eps: the ratio should approach 1 as eps -> 0 (relative error O(eps)).

Part (b) -- the heterogeneous-curvature quadratic in R^9
--------------------------------------------------------
l(theta) = (theta - theta*)^T H (theta - theta*) / 2 with H block diagonal, three 3x3
blocks H_b = R_b diag(lam_b) R_b^T, R_b a random rotation per block, eigenvalues
{1, 2, 3, 99, 100, 101, 4998, 4999, 5000} (condition number 5000 in both cases):

* ``homogeneous``: every block holds one small, one medium and one large eigenvalue,
  {1, 99, 4998}, {2, 100, 4999}, {3, 101, 5000}: the blocks look alike;
* ``heterogeneous``: {1, 2, 3}, {99, 100, 101}, {4998, 4999, 5000}: curvature differs
  by ~3 orders of magnitude *between* blocks and little within one.

(The naming follows Zhang et al., "Why Transformers Need Adam: A Hessian
Perspective", arXiv 2402.16788, whose construction the paper reuses: heterogeneity
is *across* blocks.)

Noise comes from row subsampling: l is the least-squares loss |X theta - y|^2 / (2n)
(up to a constant) for a data matrix X (n = 512 rows, 9 columns) whose column groups
are orthogonal, X = sqrt(n) U blockdiag(diag(sqrt lam_b) R_b^T) with U an n x 9
matrix with orthonormal columns, so X^T X / n = H; targets y = X theta* + r with the
residual r orthogonal to the columns of X and |r|^2 / n = sigma^2 (``--label-noise``),
so theta* stays the minimiser. Each step's gradient uses a minibatch S of m = 8 rows
drawn with replacement, g = X_S^T (X_S theta - y_S) / m, which is unbiased. With
sigma = 0 the noise vanishes at theta* (interpolation) and losses can reach the
float32 floor; with sigma = 1 minibatch noise persists at the optimum and sets a
learning-rate-dependent floor. Both are run by default. The learning rate is
constant, or (``--schedule cosine``) cosine-decayed to 10% of the peak.

Blocks: the parameter is stored as a (3, 3) array whose row b holds the 3 coordinates
of Hessian block b, so ``granularity="row"`` gives exactly the paper's blocks (one mask
draw, one cosine and one score per 3-coordinate block). Methods: AdamW
(``optax.adamw(lr, b1=0.9, b2=0.999, weight_decay=0)``), AdamW + SkipUpdate
(``magma.skip_update(adamw, granularity="row")``, p = 0.5) and AdamW + Magma
(``magma.magma(adamw, granularity="row")``, tau = 2, p = 0.5), each over a learning
rate grid; theta_0 = 0 and theta* ~ N(0, I). Runs are vmapped over (learning rate,
seed) and jitted once per method and case. A seed fixes the rotations, the data
matrix, theta*, the minibatches and the mask key. The reported loss is
l(theta_T) - l(theta*) = l(theta_T), averaged over the last 10% of steps; the best
learning rate per method is the one with the lowest median loss over seeds (robust to
one diverging seed; tables also give the min and max over seeds).
Weight decay is 0 by default so that the optimum is theta* for every method.

Run::

    python3 benchmarks/quadratic.py                  # both parts, default sizes
    python3 benchmarks/quadratic.py --part prop1 --samples 200000
    python3 benchmarks/quadratic.py --part r9 --schedule cosine

Outputs, in ``benchmarks/results/``: tables on stdout;
``quadratic_curves_<schedule>.png`` (loss curves at each method's best learning rate,
means over windows of steps/200 steps), ``quadratic_lr_sweep_<schedule>.png`` (final
loss vs learning rate) and ``quadratic_results_<schedule>.json``
(``quadratic_prop1.json`` with ``--part prop1``).

References:
  Joo et al., On Surprising Effectiveness of Masking Updates in Adaptive Optimizers,
  arXiv 2602.15322 (2026), Proposition 1 and the quadratic experiment.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import magma_optax as magma

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"

# --------------------------------------------------------------------------------------
# Part (a): Proposition 1.
# --------------------------------------------------------------------------------------

PROP1_SHAPE = (8, 8)
PROP1_KEEP_PROBS = (0.25, 0.5, 0.75)
PROP1_GRANULARITIES: tuple[Any, ...] = ("tensor", "row", (4, 4), "element")


def block_ids(shape: tuple[int, int], granularity: Any) -> np.ndarray:
  """Block id of every entry of a 2-D array.

  Index arithmetic, independent of the package's reshape-based layouts.
  """
  rows, cols = np.indices(shape)
  if granularity == "tensor":
    return np.zeros(shape, np.int64)
  if granularity == "row":
    return rows
  if granularity == "column":
    return cols
  if granularity == "element":
    return rows * shape[1] + cols
  tr, tc = granularity
  return (rows // tr) * (shape[1] // tc) + cols // tc


def predicted_excess(
  hessian: np.ndarray, delta: np.ndarray, ids: np.ndarray, keep_prob: float
) -> float:
  """Proposition 1's term sum_b (1-p)/(2p) Delta_b^T H_bb Delta_b (float64)."""
  flat_ids = ids.reshape(-1)
  d = delta.reshape(-1)
  same_block = flat_ids[:, None] == flat_ids[None, :]
  return float((1 - keep_prob) / (2 * keep_prob) * d @ (hessian * same_block) @ d)


def masked_updates(
  delta: np.ndarray,
  keep_prob: float,
  granularity: Any,
  num_samples: int,
  seed: int,
  rescale: bool = True,
) -> np.ndarray:
  """``num_samples`` draws of Delta~ from ``magma.bernoulli_mask`` (one key each)."""

  def one(key):
    tx = magma.bernoulli_mask(
      keep_prob, key=key, granularity=granularity, rescale=rescale
    )
    update = jnp.asarray(delta, jnp.float32)
    out, _ = tx.update(update, tx.init(update))
    return out

  keys = jax.random.split(jax.random.key(seed), num_samples)
  draws = jax.jit(jax.vmap(one))(keys)
  return np.asarray(draws, np.float64)


def mc_ratio(excess: np.ndarray, predicted: float) -> tuple[float, float]:
  """Ratio mean(excess) / predicted and its Monte-Carlo standard error."""
  n = excess.shape[0]
  return (
    float(np.mean(excess) / predicted),
    float(np.std(excess, ddof=1) / math.sqrt(n) / abs(predicted)),
  )


def random_quadratic(seed: int, shape=PROP1_SHAPE):
  """A dense PSD quadratic x^T A x / 2 + c^T x, and theta, Delta (float64)."""
  rng = np.random.default_rng(seed)
  d = math.prod(shape)
  q, _ = np.linalg.qr(rng.standard_normal((d, d)))
  lam = np.exp(rng.uniform(math.log(1e-2), math.log(1e2), d))
  a = (q * lam) @ q.T
  c = rng.standard_normal(d)
  theta = rng.standard_normal(d)
  delta = 0.5 * rng.standard_normal(shape)
  return a, c, theta, delta


def quadratic_loss(a: np.ndarray, c: np.ndarray, x: np.ndarray) -> np.ndarray:
  """x^T A x / 2 + c^T x for x of shape (..., d)."""
  return 0.5 * np.einsum("...i,ij,...j->...", x, a, x) + x @ c


def proposition1_quadratic(
  keep_prob: float,
  granularity: Any,
  num_samples: int,
  seed: int = 0,
  mask_seed: int | None = None,
) -> dict[str, float]:
  """Measured vs predicted excess loss of SkipUpdate on an exact quadratic.

  ``seed`` fixes the quadratic, theta and Delta; ``mask_seed`` (default seed + 1)
  the mask keys.
  """
  a, c, theta, delta = random_quadratic(seed)
  mask_seed = seed + 1 if mask_seed is None else mask_seed
  draws = masked_updates(delta, keep_prob, granularity, num_samples, mask_seed)
  x_masked = theta - draws.reshape(num_samples, -1)
  x_dense = theta - delta.reshape(-1)
  excess = quadratic_loss(a, c, x_masked) - quadratic_loss(a, c, x_dense)
  predicted = predicted_excess(a, delta, block_ids(delta.shape, granularity), keep_prob)
  ratio, se = mc_ratio(excess, predicted)
  # The same measurement against a prediction that ignores the block structure
  # (diagonal of H only): it must *not* match unless the blocks are elements.
  diag_only = predicted_excess(a, delta, block_ids(delta.shape, "element"), keep_prob)
  return {
    "keep_prob": keep_prob,
    "granularity": str(granularity),
    "num_blocks": int(block_ids(delta.shape, granularity).max() + 1),
    "predicted": predicted,
    "measured": float(np.mean(excess)),
    "ratio": ratio,
    "se": se,
    "z": (ratio - 1.0) / se,
    "ratio_vs_diagonal_prediction": float(np.mean(excess)) / diag_only,
  }


def logistic_problem(seed: int, shape=PROP1_SHAPE, n: int = 256):
  """Logistic regression data (a_i, y_i) and a point theta (float64)."""
  rng = np.random.default_rng(seed)
  d = math.prod(shape)
  features = rng.standard_normal((n, d)) / math.sqrt(d)
  labels = np.where(rng.standard_normal(n) > 0, 1.0, -1.0)
  theta = rng.standard_normal(d)
  direction = rng.standard_normal(shape)
  return features, labels, theta, direction


def logistic_loss(features, labels, x):
  """mean_i log(1 + exp(-y_i a_i^T x)) for x of shape (..., d)."""
  margins = -(x @ features.T) * labels
  return np.mean(np.logaddexp(0.0, margins), axis=-1)


def logistic_hessian(features, labels, x):
  """Hessian of :func:`logistic_loss` at x (shape (d,))."""
  sig = 1.0 / (1.0 + np.exp(-(features @ x) * labels))
  w = sig * (1 - sig)
  return (features.T * w) @ features / features.shape[0]


def proposition1_nonquadratic(
  keep_prob: float, granularity: Any, eps: float, num_samples: int, seed: int = 0
) -> dict[str, float]:
  """Measured vs predicted excess on the logistic loss with Delta of scale eps."""
  features, labels, theta, direction = logistic_problem(seed)
  delta = eps * direction
  draws = masked_updates(delta, keep_prob, granularity, num_samples, seed + 1)
  x_dense = theta - delta.reshape(-1)
  excess = logistic_loss(
    features, labels, theta - draws.reshape(num_samples, -1)
  ) - logistic_loss(features, labels, x_dense)
  hess = logistic_hessian(features, labels, x_dense)
  predicted = predicted_excess(
    hess, delta, block_ids(delta.shape, granularity), keep_prob
  )
  ratio, se = mc_ratio(excess, predicted)
  return {
    "keep_prob": keep_prob,
    "granularity": str(granularity),
    "eps": eps,
    "predicted": predicted,
    "ratio": ratio,
    "se": se,
  }


def run_prop1(args) -> dict[str, Any]:
  """Part (a): prints the Proposition 1 tables and returns their rows."""
  rows = []
  print(
    f"\nProposition 1, exact quadratic (d=64 as {PROP1_SHAPE}, dense PSD A,"
    f" {args.samples} Monte-Carlo draws of magma.bernoulli_mask per cell)"
  )
  print(f"{'granularity':>12} {'blocks':>6} {'p':>5} {'predicted':>11}"
        f" {'measured':>11} {'ratio':>7} {'s.e.':>6} {'z':>6}"
        f" {'vs diag(H)':>10}")  # fmt: skip
  for g in PROP1_GRANULARITIES:
    for p in PROP1_KEEP_PROBS:
      # Fresh mask keys per cell, so the cells' errors are independent.
      mask_seed = 1000 * (args.seed + 1) + len(rows)
      r = proposition1_quadratic(p, g, args.samples, args.seed, mask_seed)
      rows.append(r)
      print(
        f"{r['granularity']:>12} {r['num_blocks']:>6} {p:>5.2f}"
        f" {r['predicted']:>11.4f} {r['measured']:>11.4f} {r['ratio']:>7.4f}"
        f" {r['se']:>6.4f} {r['z']:>+6.2f}"
        f" {r['ratio_vs_diagonal_prediction']:>10.4f}"
      )
  out: dict[str, Any] = {"quadratic": rows}
  if args.nonquadratic:
    nq = []
    print(
      "\nProposition 1, logistic loss (H at theta - Delta; ratio -> 1 as eps -> 0),"
      f" {args.samples} draws"
    )
    print(f"{'granularity':>12} {'p':>5} {'eps':>6} {'ratio':>7} {'s.e.':>6}")
    for g in ("row", "element"):
      for p in PROP1_KEEP_PROBS:
        for eps in (3.0, 1.0, 0.3):
          r = proposition1_nonquadratic(p, g, eps, args.samples, seed=args.seed)
          nq.append(r)
          print(
            f"{r['granularity']:>12} {p:>5.2f} {eps:>6.2f} {r['ratio']:>7.4f}"
            f" {r['se']:>6.4f}"
          )
    out["logistic"] = nq
  return out


# --------------------------------------------------------------------------------------
# Part (b): the heterogeneous-curvature quadratic in R^9.
# --------------------------------------------------------------------------------------

EIGENVALUES = {
  "homogeneous": ((1.0, 99.0, 4998.0), (2.0, 100.0, 4999.0), (3.0, 101.0, 5000.0)),
  "heterogeneous": ((1.0, 2.0, 3.0), (99.0, 100.0, 101.0), (4998.0, 4999.0, 5000.0)),
}
DEFAULT_LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0)
METHODS = ("adamw", "adamw+skip_update", "adamw+magma")


def r9_problem(case: str, seed: int, label_noise: float = 0.0, num_rows: int = 512):
  """Data of one case and seed: X (n, 9), theta* (3, 3), residuals r (n,), H (9, 9).

  The targets are y = X theta* + r with r orthogonal to the columns of X and
  ||r||^2 / n = label_noise^2, so theta* is still the least-squares solution and the
  full-batch gradient is H (theta - theta*), while minibatch gradients stay noisy at
  theta* when ``label_noise > 0``.
  """
  rng = np.random.default_rng(seed)
  blocks = []
  for lam in EIGENVALUES[case]:
    rot, _ = np.linalg.qr(rng.standard_normal((3, 3)))
    blocks.append(np.diag(np.sqrt(lam)) @ rot.T)
  root = np.zeros((9, 9))
  for b, block in enumerate(blocks):
    root[3 * b : 3 * b + 3, 3 * b : 3 * b + 3] = block
  basis, _ = np.linalg.qr(rng.standard_normal((num_rows, 9)))
  x = math.sqrt(num_rows) * basis @ root
  theta_star = rng.standard_normal((3, 3))
  noise = rng.standard_normal(num_rows)
  noise -= basis @ (basis.T @ noise)
  noise *= label_noise * math.sqrt(num_rows) / np.linalg.norm(noise)
  return x, theta_star, noise, x.T @ x / num_rows


def make_optimizer(method: str, lr, seed, weight_decay: float):
  """AdamW, AdamW + SkipUpdate or AdamW + Magma with one block per matrix row."""
  base = optax.adamw(lr, b1=0.9, b2=0.999, weight_decay=weight_decay)
  if method == "adamw":
    return base
  if method == "adamw+skip_update":
    return magma.skip_update(base, keep_prob=0.5, key=seed, granularity="row")
  if method == "adamw+magma":
    return magma.magma(base, key=seed, granularity="row")
  raise ValueError(f"method must be one of {METHODS}; got {method!r}.")


def train_r9(
  method: str,
  xs: jax.Array,
  theta_stars: jax.Array,
  residuals: jax.Array,
  lrs: jax.Array,
  seeds: jax.Array,
  *,
  steps: int,
  batch: int,
  weight_decay: float,
  schedule: str = "constant",
) -> jax.Array:
  """Loss curves, shape (len(lrs), len(seeds), steps + 1), one jit for the grid."""
  hessians = jnp.einsum("sni,snj->sij", xs, xs) / xs.shape[1]

  def run_one(lr, seed, x, theta_star, residual, hessian):
    if schedule == "cosine":
      lr = optax.cosine_decay_schedule(lr, steps, alpha=0.1)
    tx = make_optimizer(method, lr, seed, weight_decay)

    def loss(theta):
      e = (theta - theta_star).reshape(-1)
      return 0.5 * e @ hessian @ e

    def step(carry, key):
      theta, state = carry
      idx = jax.random.randint(key, (batch,), 0, x.shape[0])
      rows = x[idx]
      e = (theta - theta_star).reshape(-1)
      grad = (rows.T @ (rows @ e - residual[idx]) / batch).reshape(3, 3)
      updates, state = tx.update(grad, state, theta)
      theta = optax.apply_updates(theta, updates)
      return (theta, state), loss(theta)

    theta0 = jnp.zeros((3, 3), jnp.float32)
    keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), 1), steps)
    _, curve = jax.lax.scan(step, (theta0, tx.init(theta0)), keys)
    return jnp.concatenate([loss(theta0)[None], curve])

  over_seeds = jax.vmap(run_one, in_axes=(None, 0, 0, 0, 0, 0))
  over_grid = jax.vmap(over_seeds, in_axes=(0, None, None, None, None, None))
  return jax.jit(over_grid)(lrs, seeds, xs, theta_stars, residuals, hessians)


def final_loss(curves: np.ndarray, tail: float = 0.1) -> np.ndarray:
  """Mean of the last ``tail`` fraction of each curve (last axis = steps)."""
  k = max(1, int(round(curves.shape[-1] * tail)))
  return curves[..., -k:].mean(axis=-1)


def run_r9(args) -> dict[str, Any]:
  """Part (b): trains every method, case and noise level; prints and returns."""
  lrs = np.asarray(args.lrs, np.float32)
  seeds = np.arange(args.seeds, dtype=np.int32) + args.seed
  window = max(1, args.steps // 200)  # curves are stored as means over windows
  out: dict[str, Any] = {
    "lrs": lrs.tolist(),
    "seeds": seeds.tolist(),
    "steps": args.steps,
    "batch": args.batch,
    "weight_decay": args.weight_decay,
    "schedule": args.schedule,
    "curve_steps": [0] + list(range(window, args.steps + 1, window)),
    "settings": {},
  }
  for noise in args.label_noise:
    for case in args.cases:
      problems = [r9_problem(case, int(s), noise) for s in seeds]
      data = [
        jnp.asarray(np.stack([p[i] for p in problems]), jnp.float32) for i in range(3)
      ]
      setting: dict[str, Any] = {"case": case, "label_noise": noise, "methods": {}}
      for method in args.methods:
        t0 = time.perf_counter()
        curves = train_r9(
          method,
          *data,
          jnp.asarray(lrs),
          jnp.asarray(seeds),
          steps=args.steps,
          batch=args.batch,
          weight_decay=args.weight_decay,
          schedule=args.schedule,
        )
        curves = np.asarray(curves, np.float64)
        finals = final_loss(curves)  # (lrs, seeds)
        medians = np.median(finals, axis=1)
        best = int(np.argmin(np.where(np.isfinite(medians), medians, np.inf)))
        kept = window_means(curves[best], window)
        setting["methods"][method] = {
          "final_loss": finals.tolist(),
          "best_lr": float(lrs[best]),
          "best_final_loss": finals[best].tolist(),
          "best_curve_median": np.median(kept, axis=0).tolist(),
          "best_curve_min": kept.min(axis=0).tolist(),
          "best_curve_max": kept.max(axis=0).tolist(),
          "seconds": time.perf_counter() - t0,
        }
      out["settings"][f"{case}, label noise {noise:g}"] = setting
  print_r9_tables(out)
  return out


def window_means(curves: np.ndarray, window: int) -> np.ndarray:
  """The initial loss, then means over consecutive windows of ``window`` steps."""
  steps = (curves.shape[-1] - 1) // window * window
  body = curves[..., 1 : steps + 1].reshape(*curves.shape[:-1], -1, window)
  return np.concatenate([curves[..., :1], body.mean(axis=-1)], axis=-1)


def print_r9_tables(out: dict[str, Any]) -> None:
  print(
    f"\nR^9 quadratic: {out['steps']} steps, {out['schedule']} learning rate,"
    f" batch {out['batch']} rows,"
    f" {len(out['seeds'])} seeds; loss l(theta) - l(theta*) averaged over the last"
    " 10% of steps; median over seeds"
  )
  for name, setting in out["settings"].items():
    print(f"\n  {name}")
    print(
      f"    {'method':<20}"
      + "".join(f"{'lr=' + format(lr, 'g'):>10}" for lr in out["lrs"])
    )
    for method, r in setting["methods"].items():
      cells = "".join(f"{np.median(f):>10.2e}" for f in r["final_loss"])
      print(f"    {method:<20}{cells}")
    print("    at each method's best learning rate: median [min, max] over seeds")
    for method, r in setting["methods"].items():
      v = np.asarray(r["best_final_loss"])
      print(
        f"      {method:<20} lr={r['best_lr']:<6g} {np.median(v):9.2e}"
        f" [{v.min():.1e}, {v.max():.1e}]"
      )


COLORS = {"adamw": "C0", "adamw+skip_update": "C2", "adamw+magma": "C3"}


def _settings_grid(out: dict[str, Any]):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  noises = sorted({s["label_noise"] for s in out["settings"].values()})
  cases = list(dict.fromkeys(s["case"] for s in out["settings"].values()))
  fig, axes = plt.subplots(
    len(noises),
    len(cases),
    figsize=(5.5 * len(cases), 3.8 * len(noises)),
    squeeze=False,
  )
  cells = []
  for setting in out["settings"].values():
    ax = axes[noises.index(setting["label_noise"])][cases.index(setting["case"])]
    cells.append((ax, setting))
  return plt, fig, cells


def plot_r9(
  out: dict[str, Any], directory: pathlib.Path, suffix: str = ""
) -> list[pathlib.Path]:
  """Writes the loss-curve and learning-rate-sweep PNGs; returns their paths."""
  plt, fig, cells = _settings_grid(out)
  steps = np.asarray(out["curve_steps"])
  window = steps[1] - steps[0] if len(steps) > 1 else 1
  for ax, setting in cells:
    for method, r in setting["methods"].items():
      color = COLORS.get(method)
      label = f"{method} (lr={r['best_lr']:g})"
      ax.plot(steps, r["best_curve_median"], color=color, label=label)
      lo, hi = r["best_curve_min"], r["best_curve_max"]
      ax.fill_between(steps, lo, hi, color=color, alpha=0.15)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(f"l(theta) - l(theta*), mean over {window} steps")
    ax.set_title(
      f"{setting['case']}, label noise {setting['label_noise']:g}"
      f" (median, min-max of {len(out['seeds'])} seeds)",
      fontsize=9,
    )
    ax.legend(fontsize=8)
  fig.tight_layout()
  curves_path = directory / f"quadratic_curves{suffix}.png"
  fig.savefig(curves_path, dpi=100)
  plt.close(fig)

  plt, fig, cells = _settings_grid(out)
  for ax, setting in cells:
    for method, r in setting["methods"].items():
      med = np.median(r["final_loss"], axis=1)
      ax.plot(out["lrs"], med, "o-", color=COLORS.get(method), label=method)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final loss (median over seeds)")
    ax.set_title(
      f"{setting['case']}, label noise {setting['label_noise']:g}", fontsize=9
    )
    ax.legend(fontsize=8)
  fig.tight_layout()
  sweep_path = directory / f"quadratic_lr_sweep{suffix}.png"
  fig.savefig(sweep_path, dpi=100)
  plt.close(fig)
  return [curves_path, sweep_path]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--part", choices=("all", "prop1", "r9"), default="all")
  parser.add_argument(
    "--samples", type=int, default=100_000, help="Monte-Carlo draws per cell"
  )
  parser.add_argument(
    "--nonquadratic",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="also check Prop. 1 on a logistic loss at shrinking Delta",
  )
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--batch", type=int, default=8, help="rows per minibatch")
  parser.add_argument("--seeds", type=int, default=5)
  parser.add_argument("--seed", type=int, default=0, help="first seed")
  parser.add_argument("--lrs", type=float, nargs="+", default=list(DEFAULT_LRS))
  parser.add_argument("--weight-decay", type=float, default=0.0)
  parser.add_argument(
    "--schedule",
    choices=("constant", "cosine"),
    default="constant",
    help="learning rate: constant, or cosine decay to 10%% of the peak",
  )
  parser.add_argument(
    "--label-noise",
    type=float,
    nargs="+",
    default=[0.0, 1.0],
    help="target noise levels (0: interpolation, noise vanishes at theta*)",
  )
  parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
  parser.add_argument(
    "--cases", nargs="+", choices=tuple(EIGENVALUES), default=list(EIGENVALUES)
  )
  parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR)
  parser.add_argument("--no-plots", action="store_true")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  print(f"jax {jax.__version__}, optax {optax.__version__}, devices {jax.devices()}")
  results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
  if args.part in ("all", "prop1"):
    results["proposition1"] = run_prop1(args)
  if args.part in ("all", "r9"):
    results["r9"] = run_r9(args)
    if not args.no_plots:
      args.out.mkdir(parents=True, exist_ok=True)
      for path in plot_r9(results["r9"], args.out, f"_{args.schedule}"):
        print(f"wrote {path}")
  if not args.no_plots:
    args.out.mkdir(parents=True, exist_ok=True)
    name = "prop1" if args.part == "prop1" else f"results_{args.schedule}"
    path = args.out / f"quadratic_{name}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
  return results


if __name__ == "__main__":
  main()
