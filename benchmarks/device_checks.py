"""Inputs and runs shared by ``gpu_check.py`` and ``tpu_check.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import magma_optax as magma


def adam_magma_runs(params, grads, interpret, steps: int = 3) -> dict:
  """``implementation -> (last update, state)`` after ``steps`` steps of
  ``adam_magma`` (row blocks, key 0) with ``"xla"`` and with ``"pallas"``."""
  out = {}
  for impl in ("xla", "pallas"):
    tx = magma.adam_magma(
      1e-3,
      key=0,
      granularity="row",
      implementation=impl,
      interpret=interpret if impl == "pallas" else False,
    )
    state, p = tx.init(params), params
    update = jax.jit(tx.update)
    for _ in range(steps):
      u, state = update(grads, state, p)
      p = optax.apply_updates(p, u)
    out[impl] = (u, state)
  return out


def tile_inputs(shape, block, density, g_dtype, m_dtype, empty=0, seed=0):
  """A leaf's gradient, random moments of ``active + empty`` sorted slots of its
  ``(r, c)`` tiles, and their tile indices (empty slots: the number of tiles)."""
  r, c = block
  g = jax.random.normal(jax.random.key(seed), shape).astype(g_dtype)
  n = int(np.prod(shape[:-1])) // r * (shape[-1] // c)
  active = max(1, round(density * n))
  rng = np.random.default_rng(seed)
  idx = np.full(active + empty, n, np.int32)
  idx[:active] = np.sort(rng.choice(n, active, replace=False))
  k = jax.random.split(jax.random.key(seed + 1))
  mu = (0.1 * jax.random.normal(k[0], (len(idx), r, c))).astype(m_dtype)
  nu = 0.01 * jax.random.uniform(k[1], (len(idx), r, c))
  return g, mu, nu, jnp.asarray(idx)
