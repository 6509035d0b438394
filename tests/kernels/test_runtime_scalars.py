"""Adam's scalars reach every implementation at run time, traced values included.

``optax.inject_hyperparams`` passes ``b1``, ``b2``, ``eps``, ``eps_root``, the
learning rate and the weight decay as arrays (traced under ``jit``). Here they are
``jit`` arguments, for :func:`kernels.masked_adam` (with a scale computed from the
step's sums, so the derived sums run too) and :func:`tiles.tile_adam`, on XLA and on
each Pallas kernel in its interpreter (Triton layout in the generic one, Mosaic TPU,
Mosaic GPU on jax >= 0.12).

Values whose ``1 - b`` is exact in float32 make the traced step bit-equal to the
step with Python floats: the same numbers reach the same code. (The step count is
an argument too, as it comes from a state: a constant count lets XLA fold the bias
correction of Python floats into the interpreted kernels, which rounds otherwise.)
The traced step is also checked against float64 numpy: rtol 1e-6 (1e-5 for the
update, and for the tile step, whose moments cancel in a few entries: there an atol
of 1e-6 of the array's largest magnitude; f32 rounding). For other values
``1 - b`` of a float32 ``b`` differs in its last bits from ``1 - b`` of a Python
float, as in ``optax.adam`` and its injected version
(tests/test_inject_hyperparams.py compares those).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magma_optax import kernels
from magma_optax._core import blocks as _blocks
from magma_optax._core import compat as _compat
from magma_optax.kernels.tiles import api as tiles

# 1 - b1, 1 - b2 and every value exact in float32.
SCALARS = dict(
  b1=0.75, b2=0.9375, eps=2.0**-20, eps_root=2.0**-30, learning_rate=2.0**-8,
  weight_decay=0.125,
)  # fmt: skip
IMPLEMENTATIONS = [
  ("xla", False),
  ("pallas", True),
  ("pallas", "tpu"),
  pytest.param(
    "pallas",
    "gpu",
    marks=pytest.mark.skipif(
      not _compat.has_mosaic_gpu(),
      reason=f"jax {jax.__version__} has no Mosaic GPU interpreter (jax >= 0.12)",
    ),
  ),
]


def _numpy_adam(g, m, v, p, count, s):
  """One AdamW step in float64 numpy with the scalars ``s``."""
  g, m, v, p = (np.asarray(x, np.float64) for x in (g, m, v, p))
  new_m = s["b1"] * m + (1 - s["b1"]) * g
  new_v = s["b2"] * v + (1 - s["b2"]) * g * g
  m_hat = new_m / (1 - s["b1"] ** count)
  v_hat = new_v / (1 - s["b2"] ** count)
  u = m_hat / (np.sqrt(v_hat + s["eps_root"]) + s["eps"]) + s["weight_decay"] * p
  return new_m, new_v, -s["learning_rate"] * u


def _scale(dot, mm, gg):
  """A per-block scale of the step's sums (so that the sums are computed)."""
  return 0.5 + 0.25 * dot / jnp.sqrt(mm * gg + 1.0)


@pytest.mark.parametrize(("implementation", "interpret"), IMPLEMENTATIONS)
def test_masked_adam_traced_scalars_equal_python_floats(implementation, interpret):
  shape = (16, 128)
  k = jax.random.split(jax.random.key(0), 4)
  g = jax.random.normal(k[0], shape)
  m = 0.1 * jax.random.normal(k[1], shape)
  v = 0.01 * jax.random.uniform(k[2], shape)
  p = jax.random.normal(k[3], shape)
  layout = _blocks.block_layout(shape, "row")
  count = jnp.asarray(3, jnp.int32)  # an argument, as the count in a state

  def step(g, m, v, p, count, **scalars):
    return kernels.masked_adam(
      g, m, v, count=count, params=p, scale=_scale, layout=layout,
      implementation=implementation, interpret=interpret, **scalars,
    )  # fmt: skip

  static = jax.jit(lambda *a: step(*a, **SCALARS))(g, m, v, p, count)
  traced_scalars = {n: jnp.asarray(x, jnp.float32) for n, x in SCALARS.items()}
  traced = jax.jit(step)(g, m, v, p, count, **traced_scalars)
  for name, a, b in zip(static._fields, traced, static, strict=True):
    np.testing.assert_array_equal(a, b, err_msg=name)
  want_m, want_v, want_u = _numpy_adam(g, m, v, p, 3, SCALARS)
  np.testing.assert_allclose(traced.mu, want_m, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(traced.nu, want_v, rtol=1e-6, atol=1e-9)
  scale = np.asarray(layout.to_leaf(_scale(*traced[3:])))
  np.testing.assert_allclose(traced.update, scale * want_u, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(("implementation", "interpret"), IMPLEMENTATIONS)
def test_tile_adam_traced_scalars_equal_python_floats(implementation, interpret):
  rows, r, cols, c = 4, 8, 2, 128
  k = jax.random.split(jax.random.key(1), 3)
  g = jax.random.normal(k[0], (rows * r, cols * c))
  m = 0.1 * jax.random.normal(k[1], (5, r, c))
  v = 0.01 * jax.random.uniform(k[2], (5, r, c))
  tile_index = jnp.array([1, 4, 6, 8, 8], jnp.int32)  # two empty slots
  count = jnp.asarray(3, jnp.int32)
  scalars = {n: x for n, x in SCALARS.items() if n != "weight_decay"}

  def step(g, m, v, count, **scalars):
    return tiles.tile_adam(
      g, m, v, tile_index, count=count, implementation=implementation,
      interpret=interpret, **scalars,
    )  # fmt: skip

  static = jax.jit(lambda *a: step(*a, **scalars))(g, m, v, count)
  traced_scalars = {n: jnp.asarray(x, jnp.float32) for n, x in scalars.items()}
  traced = jax.jit(step)(g, m, v, count, **traced_scalars)
  for name, a, b in zip(static._fields, traced, static, strict=True):
    np.testing.assert_array_equal(a, b, err_msg=name)
  g4 = np.asarray(g).reshape(rows, r, cols, c)
  idx = np.asarray(tile_index)
  stored = idx < rows * cols
  gt = np.where(
    stored[:, None, None], g4[np.minimum(idx, 7) // cols, :, idx % cols, :], 0.0
  )
  want = _numpy_adam(gt, m, v, np.zeros_like(gt), 3, dict(scalars, weight_decay=0.0))
  for name, a, b in zip(traced._fields, traced, want, strict=True):
    atol = 1e-6 * np.max(np.abs(b))  # where m' = b1 m + (1 - b1) g cancels
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol, err_msg=name)
