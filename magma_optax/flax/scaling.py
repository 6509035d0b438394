"""Learnable weight scaling over a parameter mask, as Flax NNX layers.

``W_eff = A * (W * M)`` with ``A`` per layer, output channel or head
(:class:`ScaledMaskedLinear`, :class:`ScaledMaskedDense`); the mask ``M`` is a
:class:`SparsityMask` variable that :func:`assign_masks` fills from
``periodic_mask``'s state. :func:`knowledge_distillation_loss` is the teacher-student
loss of sparse fine-tuning.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

SCALES = ("layer", "channel", "head")
_LECUN_NORMAL = nnx.initializers.lecun_normal()
HEAD_AXES = ("out", "in")


class SparsityMask(nnx.Variable):
  """A parameter mask held by a module (not trained: not an ``nnx.Param``)."""


def _check(scale: str, num_heads: int | None, head_axis: str, in_f: int, out_f: int):
  if scale not in SCALES:
    raise ValueError(f"scale must be one of {SCALES}; got {scale!r}.")
  if head_axis not in HEAD_AXES:
    raise ValueError(f"head_axis must be one of {HEAD_AXES}; got {head_axis!r}.")
  if scale == "head":
    split = out_f if head_axis == "out" else in_f
    if not isinstance(num_heads, int) or num_heads < 1 or split % num_heads:
      raise ValueError(
        f"scale='head' needs num_heads, an int >= 1 dividing the {head_axis!r}"
        f" features ({split}); got num_heads={num_heads!r}."
      )


def scale_shape(
  scale: str, in_features: int, out_features: int, num_heads: int | None
) -> tuple[int, ...]:
  """Shape of the learnable scale ``A`` for a kernel ``(in_features, out_features)``."""
  if scale == "layer":
    return ()
  if scale == "channel":
    return (out_features,)
  return (num_heads,)


def effective_kernel(
  kernel: jax.Array,
  scale_value: jax.Array,
  mask: jax.Array | None,
  *,
  scale: str,
  head_axis: str = "out",
  straight_through: bool = False,
) -> jax.Array:
  """``A * (W * M)`` with ``A`` broadcast over the kernel (see the module docstring)."""
  w = kernel
  if mask is not None:
    masked = w * mask.astype(w.dtype)
    w = w + jax.lax.stop_gradient(masked - w) if straight_through else masked
  a = scale_value.astype(w.dtype)
  if scale == "head":
    heads = a.shape[0]
    if head_axis == "out":
      a = jnp.repeat(a, w.shape[1] // heads)[None, :]
    else:
      a = jnp.repeat(a, w.shape[0] // heads)[:, None]
  return a * w


class ScaledMaskedLinear(nnx.Module):
  """A dense layer ``y = x @ (A * (W * M)) + b`` with a learnable scale ``A``.

  Args:
    in_features: input features.
    out_features: output features.
    scale: ``"layer"``, ``"channel"`` (default) or ``"head"``.
    num_heads: number of heads (``scale="head"``).
    head_axis: ``"out"`` (heads split the outputs: Q/K/V) or ``"in"`` (the inputs:
      the attention output projection).
    use_bias: add a bias (default True).
    straight_through: gradients reach pruned weights (see the module docstring).
    kernel_init: initializer of ``W`` (default LeCun normal).
    rngs: ``nnx.Rngs``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from magma_optax.flax import ScaledMaskedLinear
    >>> layer = ScaledMaskedLinear(4, 6, scale="head", num_heads=2, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((3, 4))).shape
    (3, 6)
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    scale: str = "channel",
    num_heads: int | None = None,
    head_axis: str = "out",
    use_bias: bool = True,
    straight_through: bool = False,
    kernel_init: Any = _LECUN_NORMAL,
    rngs: nnx.Rngs,
  ):
    _check(scale, num_heads, head_axis, in_features, out_features)
    self.scale_kind = scale
    self.head_axis = head_axis
    self.straight_through = straight_through
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features)))
    self.scale = nnx.Param(
      jnp.ones(scale_shape(scale, in_features, out_features, num_heads))
    )
    self.bias = nnx.Param(jnp.zeros((out_features,))) if use_bias else None
    self.mask = SparsityMask(jnp.ones((in_features, out_features), jnp.bool_))

  def effective_kernel(self, mask: jax.Array | None = None) -> jax.Array:
    """``A * (W * M)`` (``mask`` overrides the stored mask)."""
    return effective_kernel(
      self.kernel[...],
      self.scale[...],
      self.mask[...] if mask is None else mask,
      scale=self.scale_kind,
      head_axis=self.head_axis,
      straight_through=self.straight_through,
    )

  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    y = x @ self.effective_kernel(mask)
    if self.bias is not None:
      y = y + self.bias[...]
    return y


class ScaledMaskedDense(nn.Module):
  """Linen version of :class:`ScaledMaskedLinear`; the mask is a call argument.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from magma_optax.flax import ScaledMaskedDense
    >>> layer = ScaledMaskedDense(6, scale="layer")
    >>> variables = layer.init(jax.random.key(0), jnp.ones((3, 4)))
    >>> layer.apply(variables, jnp.ones((3, 4))).shape
    (3, 6)
  """

  features: int
  scale: str = "channel"
  num_heads: int | None = None
  head_axis: str = "out"
  use_bias: bool = True
  straight_through: bool = False
  kernel_init: Any = _LECUN_NORMAL

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    in_features = x.shape[-1]
    _check(self.scale, self.num_heads, self.head_axis, in_features, self.features)
    kernel = self.param("kernel", self.kernel_init, (in_features, self.features))
    a = self.param(
      "scale",
      nn.initializers.ones,
      scale_shape(self.scale, in_features, self.features, self.num_heads),
    )
    y = x @ effective_kernel(
      kernel,
      a,
      mask,
      scale=self.scale,
      head_axis=self.head_axis,
      straight_through=self.straight_through,
    )
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, (self.features,))
    return y


def assign_masks(model: nnx.Module, param_mask: Any) -> None:
  """Copies kernel masks from a parameter-mask tree into the model's layers.

  Every :class:`ScaledMaskedLinear` at module path ``P`` takes its mask from
  ``param_mask`` at ``P + ("kernel",)``. ``param_mask`` is the ``mask`` of a
  :class:`magma_optax.PeriodicMaskState` built over the model's parameters (a nested
  dict or ``nnx.State``); missing or ``optax.MaskedNode`` entries leave a layer as is.
  Stateful: call it outside ``jax.jit`` or inside an ``nnx.jit``-ed function.

  Args:
    model: an NNX module tree.
    param_mask: mask tree with the structure of the model's parameters.
  """
  # nnx.iter_modules (flax >= 0.12) replaces the deprecated method.
  iter_modules = getattr(nnx, "iter_modules", None) or type(model).iter_modules
  for path, module in iter_modules(model):
    if not isinstance(module, ScaledMaskedLinear):
      continue
    node = param_mask
    try:
      for key in (*path, "kernel"):
        node = node[key]
    except (KeyError, IndexError, TypeError):
      continue
    if hasattr(node, "shape"):
      module.mask[...] = jnp.asarray(node, jnp.bool_)


def knowledge_distillation_loss(
  student_logits: jax.Array,
  teacher_logits: jax.Array,
  *,
  temperature: float = 2.0,
  where: jax.Array | None = None,
) -> jax.Array:
  r"""KL(teacher || student) at a temperature, scaled by ``T^2`` (Hinton et al.).

  .. math::

     L = T^2 \cdot \mathrm{mean}_i \sum_c p^T_{ic}
         (\log p^T_{ic} - \log p^S_{ic}),\qquad
     p^T = \mathrm{softmax}(z^T / T),\ p^S = \mathrm{softmax}(z^S / T)

  The teacher is not differentiated (``stop_gradient``). ``T^2`` keeps the gradient
  scale comparable across temperatures.

  Args:
    student_logits: ``(..., classes)``.
    teacher_logits: same shape.
    temperature: T > 0 (default 2).
    where: optional bool array of the leading shape; the mean runs over True
      positions (e.g. non-padding tokens).

  Returns:
    An f32 scalar.

  Example:
    >>> import jax.numpy as jnp
    >>> from magma_optax.flax import knowledge_distillation_loss
    >>> z = jnp.array([[1.0, 2.0, 3.0]])
    >>> float(knowledge_distillation_loss(z, z))
    0.0

  References:
    Hinton, Vinyals & Dean, Distilling the Knowledge in a Neural Network,
    arXiv 1503.02531 (2015).
  """
  if not isinstance(temperature, int | float) or not temperature > 0:
    raise ValueError(f"temperature must be a float > 0; got {temperature!r}.")
  if student_logits.shape != teacher_logits.shape:
    raise ValueError(
      f"student_logits {student_logits.shape} and teacher_logits"
      f" {teacher_logits.shape} must have the same shape."
    )
  t = jax.lax.stop_gradient(teacher_logits).astype(jnp.float32) / temperature
  s = student_logits.astype(jnp.float32) / temperature
  log_pt = jax.nn.log_softmax(t, axis=-1)
  log_ps = jax.nn.log_softmax(s, axis=-1)
  kl = jnp.sum(jnp.exp(log_pt) * (log_pt - log_ps), axis=-1)
  if where is None:
    mean = jnp.mean(kl)
  else:
    w = jnp.asarray(where, jnp.float32)
    mean = jnp.sum(kl * w) / jnp.maximum(jnp.sum(w), 1.0)
  return (temperature**2) * mean
