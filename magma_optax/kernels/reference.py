"""The fused masked-Adam step in plain ``jax.numpy``: the XLA path and the reference.

Adam's moments and update (:func:`moments`, :func:`update`), masked entries kept
frozen, the per-block scale applied, and the three per-block partial sums of Magma's
cosine (:func:`partial_sums`); :func:`masked_adam_reference` is the whole step. The
Pallas kernels compute the same per tile (:func:`tile_adam`) and are tested against
it.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from magma_optax._core import blocks as _blocks
from magma_optax._core import xla_cpu as _xla_cpu

(
  LEARNING_RATE, BIAS_CORRECTION1, BIAS_CORRECTION2, WEIGHT_DECAY,
  B1, ONE_MINUS_B1, B2, ONE_MINUS_B2, EPS, EPS_ROOT,
) = range(10)  # fmt: skip
# The vector's length, padded with zeros: Triton's blocks need a power of two, and
# Mosaic GPU copies it to shared memory with one TMA copy of whole 16 bytes.
NUM_HYPERPARAMS = 16


class AdamConstants(NamedTuple):
  """Adam's decay rates and epsilons: Python floats, or scalar arrays (traced
  values are fine, e.g. under ``optax.inject_hyperparams``). The step reads them
  from ``hyper`` (:func:`hyperparams`), so they are never compiled in."""

  b1: Any = 0.9
  b2: Any = 0.999
  eps: Any = 1e-8
  eps_root: Any = 0.0


class MaskedAdamOutput(NamedTuple):
  """What one fused step returns for one leaf.

  Attributes:
    mu: new first moment m' (the input moment's dtype).
    nu: new second moment v' (the input moment's dtype).
    update: the masked update ``scale * (-lr * u)`` (the gradient's dtype).
    mu_dot_grad: f32 per-block <m', g> (shape: the layout's block shape).
    mu_sq_norm: f32 per-block ||m'||^2.
    grad_sq_norm: f32 per-block ||g||^2.
  """

  mu: jax.Array
  nu: jax.Array
  update: jax.Array
  mu_dot_grad: jax.Array
  mu_sq_norm: jax.Array
  grad_sq_norm: jax.Array


def decay(b: Any) -> tuple[Any, Any]:
  """``(b, 1 - b)`` for a decay rate, as ``optax``'s moment update computes them.

  A Python number stays one (``1 - b`` in double precision, rounded once to float32
  where it meets an array); an array (an injected hyperparameter) is cast to
  float32 and ``1 - b`` computed there. The two may differ in the last bits of
  ``1 - b`` (the float32 ``b`` has lost them), as ``optax.adam`` with a Python
  float differs from its ``optax.inject_hyperparams`` version.
  """
  if isinstance(b, int | float):
    return b, 1 - b
  b = jnp.asarray(b, jnp.float32)
  return b, 1 - b


def hyperparams(
  count: jax.Array, learning_rate: Any, weight_decay: Any, constants: AdamConstants
) -> jax.Array:
  """The f32 vector of the step's scalars (indices ``LEARNING_RATE`` ... ``EPS_ROOT``).

  ``[lr, 1 - b1^count, 1 - b2^count, weight_decay, b1, 1 - b1, b2, 1 - b2, eps,
  eps_root]``, padded with zeros to ``NUM_HYPERPARAMS`` entries.

  Args:
    count: the step number t >= 1 (after the increment), as in ``optax.adam``.
    learning_rate: scalar learning rate (already evaluated if a schedule).
    weight_decay: scalar decoupled weight decay (0 for Adam).
    constants: :class:`AdamConstants` (Python floats or scalar arrays).
  """
  b1, one_minus_b1 = decay(constants.b1)
  b2, one_minus_b2 = decay(constants.b2)
  # Same expressions as optax.tree.bias_correction, so results agree bit for bit.
  bc1 = 1 - b1**count
  bc2 = 1 - b2**count
  values = [
    learning_rate, bc1, bc2, weight_decay, b1, one_minus_b1, b2, one_minus_b2,
    constants.eps, constants.eps_root,
  ]  # fmt: skip
  values += [0.0] * (NUM_HYPERPARAMS - len(values))
  return jnp.stack([jnp.asarray(x, jnp.float32) for x in values])


def tensor_layout(shape: tuple[int, ...]) -> _blocks.BlockLayout:
  """The layout with one block: the whole leaf."""
  return _blocks.block_layout(shape, "tensor")


def moments(
  grad: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
  hyper: jax.Array,
  param_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """New (m', v') in float32 (frozen where ``param_mask`` is False)."""
  g = grad.astype(jnp.float32)
  m = mu.astype(jnp.float32)
  v = nu.astype(jnp.float32)
  new_m = hyper[ONE_MINUS_B1] * g + hyper[B1] * m
  new_v = hyper[ONE_MINUS_B2] * (g * g) + hyper[B2] * v
  if param_mask is not None:
    new_m = _xla_cpu.kept(param_mask, new_m, m)
    new_v = _xla_cpu.kept(param_mask, new_v, v)
  return new_m, new_v


def tile_adam(g, m, v, keep, p, hyper):
  """Adam on one kernel tile, shared by every Pallas kernel: ``(m', v', u)``.

  ``g``, ``m``, ``v`` (and ``p``, or ``None``) are the tile's loaded values; ``keep``
  the existing entries (bool, or ``None``: all); ``hyper`` anything indexable by the
  ``LEARNING_RATE`` ... ``EPS_ROOT`` indices (a SMEM or GMEM ref, or an array). ``u``
  is the unscaled update ``-lr (m_hat / (sqrt(v_hat + eps_root) + eps) + wd p)`` in
  f32.
  """
  g, m, v = (x.astype(jnp.float32) for x in (g, m, v))
  new_m = hyper[ONE_MINUS_B1] * g + hyper[B1] * m
  new_v = hyper[ONE_MINUS_B2] * (g * g) + hyper[B2] * v
  if keep is not None:
    new_m = jnp.where(keep, new_m, m)
    new_v = jnp.where(keep, new_v, v)
  mu_hat = new_m / hyper[BIAS_CORRECTION1]
  nu_hat = new_v / hyper[BIAS_CORRECTION2]
  u = mu_hat / (jnp.sqrt(nu_hat + hyper[EPS_ROOT]) + hyper[EPS])
  if p is not None:
    u = u + hyper[WEIGHT_DECAY] * p.astype(jnp.float32)
  return new_m, new_v, u * -hyper[LEARNING_RATE]


def partial_sums(
  layout: _blocks.BlockLayout,
  mu: jax.Array,
  grad: jax.Array,
  param_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-block f32 ``(<mu, g>, ||mu||^2, ||g||^2)`` over the existing entries."""
  m = mu.astype(jnp.float32)
  g = grad.astype(jnp.float32)
  if param_mask is not None:  # one reduction, no masked copies of m and g
    return layout.masked_block_sums((m * g, m * m, g * g), param_mask)
  return layout.block_sum(m * g), layout.block_sum(m * m), layout.block_sum(g * g)


def update(
  new_mu: jax.Array,
  new_nu: jax.Array,
  hyper: jax.Array,
  *,
  layout: _blocks.BlockLayout,
  scale: jax.Array | None = None,
  params: jax.Array | None = None,
  param_mask: jax.Array | None = None,
  dtype: Any = jnp.float32,
) -> jax.Array:
  """The masked update from the float32 new moments (:func:`masked_adam_reference`)."""
  mu_hat = new_mu / hyper[BIAS_CORRECTION1]
  nu_hat = new_nu / hyper[BIAS_CORRECTION2]
  u = mu_hat / (jnp.sqrt(nu_hat + hyper[EPS_ROOT]) + hyper[EPS])
  if params is not None:
    u = u + hyper[WEIGHT_DECAY] * params.astype(jnp.float32)
  u = u * -hyper[LEARNING_RATE]
  if scale is not None:
    u = u * layout.to_leaf(jnp.asarray(scale, jnp.float32))
  if param_mask is not None:
    u = jnp.where(param_mask, u, 0.0)
  return u.astype(dtype)


def masked_adam_reference(
  grad: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
  hyper: jax.Array,
  *,
  scale: jax.Array | None = None,
  layout: _blocks.BlockLayout | None = None,
  param_mask: jax.Array | None = None,
  params: jax.Array | None = None,
) -> MaskedAdamOutput:
  """One fused masked-Adam step in plain jnp.

  With gradient g, moments m, v, per-block ``scale`` (Magma's s_t z_t; 1 for plain
  Adam) and the optional parameter mask M (which weights exist)::

      m'  = (1 - b1) g + b1 m                       v' = (1 - b2) g^2 + b2 v
      u   = (m' / bc1) / (sqrt(v' / bc2 + eps_root) + eps)   [+ weight_decay * p]
      out = scale_b * (-lr * u)                      bc_i = 1 - b_i^t
      sums per block: <m', g>,  ||m'||^2,  ||g||^2   (Magma's cosine)

  in optax's order, so that for float32 inputs the moments and the update equal
  ``optax.adam`` / ``optax.adamw`` composed with a block mask. Where M is False the
  entry does not exist: its moments stay frozen, its update is 0 and it is left out
  of the sums. Everything is computed in float32 and cast back (moments to their
  dtype, the update to the gradient's). ``hyper`` carries what may change every step
  as data (:func:`hyperparams`), so a kernel compiles once.

  Args:
    grad, mu, nu: the gradient and Adam's moments (same shape).
    hyper: f32[NUM_HYPERPARAMS] from :func:`hyperparams`.
    scale: f32 per-block scale of ``layout.block_shape`` (``None``: 1).
    layout: the leaf's block layout (``None``: one block).
    param_mask: optional bool array of the leaf's shape; False entries do not exist.
    params: the parameters, needed only for weight decay.

  Returns:
    A :class:`MaskedAdamOutput`.
  """
  layout = layout or tensor_layout(grad.shape)
  new_m, new_v = moments(grad, mu, nu, hyper, param_mask)
  out_m = new_m.astype(mu.dtype)
  sums = partial_sums(layout, out_m, grad, param_mask)
  u = update(
    new_m,
    new_v,
    hyper,
    layout=layout,
    scale=scale,
    params=params,
    param_mask=param_mask,
    dtype=grad.dtype,
  )
  return MaskedAdamOutput(out_m, new_v.astype(nu.dtype), u, *sums)
