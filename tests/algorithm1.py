"""An independent plain-numpy Algorithm 1 (arXiv 2602.15322), for the tests.

Written from the paper's equations, sharing no code with the package: blocks are
described by an explicit block-id per entry (computed with index arithmetic, not with
reshapes), Adam / RMSProp / SGD-momentum are written out, and masks ``z`` are inputs
(the tests feed either all-ones or the draws the package recorded in its state).
"""

from __future__ import annotations

import numpy as np


def block_ids(shape, granularity, stack_axes=0):
  """Integer block id of every entry of an array of ``shape``, and the block count."""
  shape = tuple(shape)
  idx = np.indices(shape) if shape else np.zeros((0,), int)
  lead = shape[:stack_axes]
  body = shape[stack_axes:]

  def flat(coords, dims):
    out = np.zeros(shape, dtype=np.int64)
    for c, d in zip(coords, dims, strict=True):
      out = out * d + c
    return out

  lead_coords = [idx[i] for i in range(stack_axes)]
  body_coords = [idx[i] for i in range(stack_axes, len(shape))]
  if granularity == "element":
    ids = flat(list(idx), shape) if shape else np.zeros((), np.int64)
    return ids, int(np.prod(shape))
  if granularity == "row" and len(body) >= 2:
    coords = lead_coords + body_coords[:-1]
    dims = lead + body[:-1]
  elif granularity == "column" and len(body) >= 2:
    coords = lead_coords + body_coords[-1:]
    dims = lead + body[-1:]
  elif isinstance(granularity, tuple) and len(body) >= len(granularity):
    r = len(granularity)
    coords = lead_coords + body_coords[: len(body) - r]
    dims = lead + body[: len(body) - r]
    for c, d, t in zip(
      body_coords[len(body) - r :], body[len(body) - r :], granularity, strict=True
    ):
      coords.append(c // t)
      dims += (d // t,)
  else:  # tensor
    coords, dims = lead_coords, lead
  if not coords:
    return np.zeros(shape, np.int64), 1
  return flat(coords, dims), int(np.prod(dims))


def block_sums(x, ids, n):
  return np.bincount(ids.ravel(), weights=x.ravel().astype(np.float64), minlength=n)


def block_cosine(a, b, ids, n):
  dot = block_sums(a * b, ids, n)
  na = np.sqrt(block_sums(a * a, ids, n))
  nb = np.sqrt(block_sums(b * b, ids, n))
  den = na * nb
  return np.where(den > 0, dot / np.where(den > 0, den, 1.0), 0.0)


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


class NumpyAdam:
  """Adam with the bias-corrected update ``-lr * m_hat / (sqrt(v_hat) + eps)``."""

  def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8):
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps

  def init(self, p):
    return {"mu": np.zeros_like(p), "nu": np.zeros_like(p), "t": 0}

  def update(self, g, s):
    t = s["t"] + 1
    mu = self.b1 * s["mu"] + (1 - self.b1) * g
    nu = self.b2 * s["nu"] + (1 - self.b2) * g * g
    m_hat = mu / (1 - self.b1**t)
    v_hat = nu / (1 - self.b2**t)
    return -self.lr * m_hat / (np.sqrt(v_hat) + self.eps), {"mu": mu, "nu": nu, "t": t}


class NumpyRMSProp:
  """optax.rmsprop: ``nu = d nu + (1-d) g^2; u = -lr g / sqrt(nu + eps)``."""

  def __init__(self, lr, decay=0.9, eps=1e-8):
    self.lr, self.decay, self.eps = lr, decay, eps

  def init(self, p):
    return {"nu": np.zeros_like(p)}

  def update(self, g, s):
    nu = self.decay * s["nu"] + (1 - self.decay) * g * g
    return -self.lr * g / np.sqrt(nu + self.eps), {"nu": nu}


class NumpySGDMomentum:
  """optax.sgd(lr, momentum): ``trace = g + m trace; u = -lr trace``."""

  def __init__(self, lr, momentum):
    self.lr, self.momentum = lr, momentum

  def init(self, p):
    return {"trace": np.zeros_like(p)}

  def update(self, g, s):
    trace = g + self.momentum * s["trace"]
    return -self.lr * trace, {"trace": trace}


def magma_run(
  base,
  params,
  grads_seq,
  masks_seq,
  *,
  granularity="tensor",
  stack_axes=0,
  tau=2.0,
  score_decay=0.9,
  init_score=0.5,
  momentum_decay=0.9,
  momentum_key="mu",
  keep_prob=1.0,
  rescale=None,
):
  """Runs Algorithm 1 on one parameter array; returns the parameter trajectory.

  ``momentum_key`` names the base state's first moment (``None``: the wrapper's own
  EMA of the gradient with ``momentum_decay``). ``masks_seq[t]`` is z_t per block.
  ``tau`` may be a function of the step ``t`` (from 0).
  With ``rescale`` set, runs SkipUpdate instead (z / p, no scores).
  """
  p = np.array(params, np.float64)
  ids, n = block_ids(p.shape, granularity, stack_axes)
  state = base.init(p)
  own = np.zeros_like(p)
  s = np.full(n, init_score)
  traj = []
  for t, (g, z) in enumerate(zip(grads_seq, masks_seq, strict=True)):
    g = np.asarray(g, np.float64)
    z = np.asarray(z, np.float64).ravel()
    delta, state = base.update(g, state)
    tau_t = tau(t) if callable(tau) else tau
    if rescale is not None:
      scale = z / keep_prob if rescale else z
    else:
      if momentum_key is None:
        own = momentum_decay * own + (1 - momentum_decay) * g
        mu = own
      else:
        mu = state[momentum_key]
      c = block_cosine(mu, g, ids, n)
      s = score_decay * s + (1 - score_decay) * sigmoid(c / tau_t)
      scale = s * z
    p = p + scale[ids] * delta
    traj.append(p.copy())
  return traj


def alignment_chain_run(
  base,
  params,
  grads_seq,
  masks_seq,
  *,
  granularity="tensor",
  tau=2.0,
  score_decay=0.9,
  init_score=0.5,
  momentum_decay=0.9,
):
  """``chain(alignment_mask, base)``: the gradient is masked *before* the base."""
  p = np.array(params, np.float64)
  ids, n = block_ids(p.shape, granularity)
  state = base.init(p)
  m = np.zeros_like(p)
  s = np.full(n, init_score)
  traj = []
  for g, z in zip(grads_seq, masks_seq, strict=True):
    g = np.asarray(g, np.float64)
    z = np.asarray(z, np.float64).ravel()
    m = momentum_decay * m + (1 - momentum_decay) * g
    c = block_cosine(m, g, ids, n)
    s = score_decay * s + (1 - score_decay) * sigmoid(c / tau)
    delta, state = base.update((s * z)[ids] * g, state)
    p = p + delta
    traj.append(p.copy())
  return traj


def shard_parts(x, parts):
  """A parameter's shard parts (what ``shards=`` splits): the last ``k =
  len(parts)`` axes ``A_i`` -> ``(s_1, ..., s_k, ..., A_1 / s_1, ..., A_k / s_k)``."""
  k = len(parts)
  lead, split = x.shape[: x.ndim - k], x.shape[x.ndim - k :]
  pieces = [d for s, a in zip(parts, split, strict=True) for d in (s, a // s)]
  y = x.reshape(*lead, *pieces)
  return np.moveaxis(y, [len(lead) + 2 * i for i in range(k)], list(range(k)))


def join_shard_parts(x, k):
  """The inverse of :func:`shard_parts` with ``k`` part axes."""
  lead = x.shape[k : x.ndim - k]
  y = np.moveaxis(x, list(range(k)), [len(lead) + 2 * i for i in range(k)])
  pieces = y.shape[len(lead) :]
  return y.reshape(*lead, *(pieces[2 * i] * pieces[2 * i + 1] for i in range(k)))
