"""The one entry point of the fused masked-Adam step, with ``implementation=``.

:func:`masked_adam` runs one Adam step on one leaf, masks and scales its update per
block, and returns the per-block partial sums of Magma's cosine (the math is in
:mod:`magma_optax.kernels.reference`; which kernel runs, in
:mod:`magma_optax.kernels.dispatch`). A caller that looks at every leaf's sums before
it scales any uses its two halves, :func:`start_masked_adam` and
:func:`finish_masked_adam`. How the sums are derived without a second pass, and when
they are summed directly instead: ``docs/design/internals.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from magma_optax._core import blocks as _blocks
from magma_optax._core import compat as _compat
from magma_optax._core import shard_map as _shard_map
from magma_optax._core import sharded as _sharded
from magma_optax._core import xla_cpu as _xla_cpu
from magma_optax.kernels import config as config_lib
from magma_optax.kernels import dispatch as _dispatch
from magma_optax.kernels import grouped
from magma_optax.kernels import partitioned
from magma_optax.kernels import reference

ScaleFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

# ||m_t||^2 derived from other sums (carried_sums, derived_sums) is trusted where it
# is at least 2**-CANCELLATION_BITS of the sum of its terms' magnitudes: at most that
# many bits lost to cancellation, so its relative error stays within ~2**4 float32
# roundings (and the cosine's, half of it). Below, the block is NaN: sum it directly.
CANCELLATION_BITS = 4
# Blocks of fewer entries sum ||m_t||^2 directly: their m_t cancels often (iid noise
# through Adam's EMA, 60 steps: 11% of single entries, 0.2% of blocks of 4, none of
# 16 or more), and a direct sum of so few entries costs about what the carry saves.
DIRECT_BELOW = 16


def masked_adam(
  grad: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
  *,
  count: Any,
  learning_rate: Any,
  b1: Any = 0.9,
  b2: Any = 0.999,
  eps: Any = 1e-8,
  eps_root: Any = 0.0,
  weight_decay: Any = 0.0,
  params: jax.Array | None = None,
  param_mask: jax.Array | None = None,
  scale: jax.Array | ScaleFn | None = None,
  layout: _blocks.BlockLayout | None = None,
  implementation: str | Sequence[str] | None = None,
  interpret: bool | str = False,
  block_sizes: config_lib.BlockSizes | None = None,
  mu_sq_norm_prev: jax.Array | None = None,
) -> reference.MaskedAdamOutput:
  r"""One fused Adam step on one leaf with a per-block masked, scaled update.

  Per entry (float32 inside, see :mod:`magma_optax.kernels.reference`)::

      m' = (1 - b1) g + b1 m;   v' = (1 - b2) g^2 + b2 v
      update = scale_b * (-lr) * ((m' / (1 - b1^t)) / (sqrt(v' / (1 - b2^t)
               + eps_root) + eps) + weight_decay * p)

  and per block b the sums <m', g>, ||m'||^2, ||g||^2 (Magma's cosine). Entries
  where ``param_mask`` is False keep their moments, get update 0 and are left out
  of the sums.

  Args:
    grad: the gradient g.
    mu: Adam's first moment m (any float dtype; keeps it).
    nu: Adam's second moment v.
    count: the step t >= 1 for bias correction (the incremented count).
    learning_rate: scalar (traced values are fine).
    b1, b2, eps, eps_root: Adam's decay rates and epsilons, scalars (traced
      values are fine: every implementation reads them at run time; ``1 - b``
      is computed as ``optax`` does, see :func:`reference.decay`).
    weight_decay: decoupled weight decay (AdamW); needs ``params`` when nonzero.
    params: the parameters (only read for weight decay).
    param_mask: optional bool array, ``grad``'s shape; False entries do not exist.
    scale: per-block f32 scale of ``layout.block_shape``; or a callable
      ``(mu_dot_grad, mu_sq_norm, grad_sq_norm) -> scale`` of this step's sums;
      ``None``: 1 (plain Adam).
    layout: the leaf's :class:`BlockLayout` (default: the whole leaf is one block).
    implementation: ``"xla"``, ``"pallas"``, a sequence to try in order, or
      ``None`` (``dispatch.DEFAULT_IMPLEMENTATIONS``: XLA until the Pallas kernel is
      validated on a GPU).
    interpret: ``False`` (compile for the device), ``True`` (the Triton-layout
      kernel in the generic Pallas interpreter), ``"tpu"`` (the Mosaic TPU
      kernel in the TPU interpreter) or ``"gpu"`` (the Mosaic GPU kernel in its
      interpreter; jax >= 0.11.2). For CPU tests at small sizes.
    block_sizes: Pallas tile shape (default: :meth:`BlockSizes.get_default`).
    mu_sq_norm_prev: optional per-block ||m||^2 of the incoming ``mu`` (the
      previous step's ``mu_sq_norm``); lets the XLA path skip one reduction. Only
      valid if ``mu`` was not changed since; ignored with ``param_mask``.

  Returns:
    A :class:`MaskedAdamOutput` (new moments, masked update, per-block sums).

  Raises:
    ValueError: if an explicitly requested implementation cannot run here, or
      ``interpret`` is not one of the values above (or names an interpreter this
      jax lacks).

  Example:
    >>> import jax.numpy as jnp
    >>> from magma_optax import kernels
    >>> g = jnp.ones((4, 8)); m = jnp.zeros((4, 8)); v = jnp.zeros((4, 8))
    >>> out = kernels.masked_adam(g, m, v, count=1, learning_rate=1e-3,
    ...                           scale=jnp.asarray(0.5), implementation="xla")
    >>> round(float(out.update[0, 0]), 6)  # -lr * scale * m_hat / (sqrt(v_hat) + eps)
    -0.0005

  References:
    Kingma & Ba, Adam, arXiv 1412.6980; Joo et al., On Surprising Effectiveness of
    Masking Updates in Adaptive Optimizers, arXiv 2602.15322 (2026), Algorithm 1.
  """
  pending = start_masked_adam(
    grad, mu, nu, count=count, learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
    eps_root=eps_root, weight_decay=weight_decay, params=params,
    param_mask=param_mask, layout=layout, implementation=implementation,
    interpret=interpret, block_sizes=block_sizes, with_sums=callable(scale),
    mu_sq_norm_prev=mu_sq_norm_prev,
  )  # fmt: skip
  if callable(scale):
    pending = pending._replace(sums=sums_where_lost(pending, b1))
    scale = scale(*pending.sums)
  return finish_masked_adam(pending, scale)


def next_moment(b1: Any, mu: jax.Array, grad: jax.Array) -> jax.Array:
  """``m_t = (1 - b1) g + b1 m_{t-1}`` in ``mu``'s dtype, as the step stores it."""
  b1, c = reference.decay(b1)
  m = c * grad.astype(jnp.float32) + b1 * mu.astype(jnp.float32)
  return m.astype(mu.dtype)


def sums_where_lost(pending: PendingAdam, b1: Any) -> tuple[jax.Array, ...]:
  """``pending.sums`` with the blocks whose ``||m_t||^2`` is NaN summed directly.

  Derived and carried sums mark a block NaN where their recursion cancelled or was
  lost to an overflow (:func:`carried_sums`); ``m_t`` and ``g`` are summed there
  directly (plain float32 sums: inf where those overflow): on XLA:CPU in one
  branch, taken only on steps with such a block, elsewhere on every step.
  ``adam_magma`` settles the whole tree at once instead (``_alignment.settle_sums``,
  which also rescales overflowing blocks).
  """
  p = pending
  if p.sums is None:
    return None
  lost = ~jnp.isfinite(p.sums[1])
  # The branch's inputs are operands, not closed-over values: run eagerly, those
  # would be constants, which XLA folds with roundings of its own.
  m = p.moments[0] if p.moments is not None else p.mu
  operands = (m, p.grad, p.param_mask, tuple(p.sums))

  def direct(m, grad, param_mask, sums):
    if p.moments is None:
      m = next_moment(b1, m, grad)
    # One m_t for the three sums: each reduction would recompute it and might round
    # it otherwise, which in a cancelling block gives a cosine beyond 1.
    m = jax.lax.optimization_barrier(m.astype(p.mu.dtype))
    exact = reference.partial_sums(p.layout, m, grad, param_mask)
    return tuple(jnp.where(lost, e, s) for e, s in zip(exact, sums, strict=True))

  # On XLA:CPU the direct sums only on steps that lost some (a branch); elsewhere
  # every step sums directly, branch-free (_xla_cpu.branch_on_cpu).
  return _xla_cpu.branch_on_cpu(
    lambda *ops: _shard_map.cond(jnp.any(lost), direct, lambda *o: o[-1], *ops),
    direct,
    *operands,
  )


class PendingAdam(NamedTuple):
  """:func:`masked_adam` between its halves: this step's sums known, no update yet.

  :func:`start_masked_adam` returns it and :func:`finish_masked_adam` completes the
  step with a per-block scale, so that a caller can look at every leaf's sums before
  it scales any (``adam_magma`` recomputes overflowing ones for the whole tree).

  Attributes:
    implementation: the implementation that runs (``"xla"`` or ``"pallas"``).
    grad, mu, nu, params, param_mask: the step's inputs (``mu`` may be replaced
      with ``_replace`` by the same values, e.g. passed through a loop).
    hyper: f32[NUM_HYPERPARAMS] from :func:`reference.hyperparams` (every
      scalar of the step).
    layout: the leaf's block layout.
    sums: this step's per-block ``(<m_t, g>, ||m_t||^2, ||g||^2)``, or ``None``.
    moments: the XLA path's new ``(m_t, v_t)`` in f32 when ``sums`` are given
      (their update is computed from them), else ``None``.
    interpret, block_sizes: for the Pallas kernel.
    off_device: for ``"pallas"``, what runs where no kernel can (a step lowered
      for a CPU): ``"xla"``, or ``None`` (lowering there raises):
      :func:`dispatch.off_device`.
  """

  implementation: str
  grad: jax.Array
  mu: jax.Array
  nu: jax.Array
  params: jax.Array | None
  param_mask: jax.Array | None
  hyper: jax.Array
  layout: _blocks.BlockLayout
  sums: tuple[jax.Array, jax.Array, jax.Array] | None
  moments: tuple[jax.Array, jax.Array] | None
  interpret: bool | str
  block_sizes: config_lib.BlockSizes | None
  off_device: str | None = None


def start_masked_adam(
  grad: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
  *,
  count: Any,
  learning_rate: Any,
  b1: Any = 0.9,
  b2: Any = 0.999,
  eps: Any = 1e-8,
  eps_root: Any = 0.0,
  weight_decay: Any = 0.0,
  params: jax.Array | None = None,
  param_mask: jax.Array | None = None,
  layout: _blocks.BlockLayout | None = None,
  implementation: str | Sequence[str] | None = None,
  interpret: bool | str = False,
  block_sizes: config_lib.BlockSizes | None = None,
  with_sums: bool = True,
  mu_sq_norm_prev: jax.Array | None = None,
) -> PendingAdam:
  """The first half of :func:`masked_adam`: checks, implementation, block sums.

  ``masked_adam(..., scale=f)`` is ``finish_masked_adam(p, f(*p.sums))`` with
  ``p = start_masked_adam(...)``; in between, a caller may look at (or replace)
  ``p.sums`` -- for all of a tree's leaves before it scales any.

  Takes the arguments of :func:`masked_adam` but ``scale``, and:

  Args:
    with_sums: compute this step's per-block ``(<m_t, g>, ||m_t||^2, ||g||^2)``
      (ordered for the implementation: ``docs/design/internals.md``); ``False``
      for a plain masked Adam step.

  Returns:
    A :class:`PendingAdam` for :func:`finish_masked_adam`.

  Raises:
    ValueError: as :func:`masked_adam`.

  Example:
    >>> import jax.numpy as jnp
    >>> from magma_optax import kernels
    >>> g = jnp.ones((4, 8)); m = jnp.zeros((4, 8)); v = jnp.zeros((4, 8))
    >>> pending = kernels.start_masked_adam(g, m, v, count=1, learning_rate=1e-3,
    ...                                     implementation="xla")
    >>> [round(float(x), 2) for x in pending.sums]  # <m_t, g>, ||m_t||^2, ||g||^2
    [3.2, 0.32, 32.0]
    >>> out = kernels.finish_masked_adam(pending, jnp.asarray(0.5))
    >>> round(float(out.update[0, 0]), 6)
    -0.0005
  """
  layout = layout or reference.tensor_layout(grad.shape)
  if not (grad.shape == mu.shape == nu.shape):
    raise ValueError(
      f"grad, mu and nu must have one shape; got {grad.shape}, {mu.shape}, {nu.shape}."
    )
  if tuple(layout.shape) != tuple(grad.shape):
    raise ValueError(f"layout is for shape {layout.shape}, grad has {grad.shape}.")
  interpret = _dispatch.check_interpret(interpret)
  impl = _dispatch.resolve_implementation(
    implementation, layout=layout, interpret=interpret
  )
  constants = reference.AdamConstants(b1, b2, eps, eps_root)
  hyper = reference.hyperparams(count, learning_rate, weight_decay, constants)
  sums = moments = None
  if with_sums and impl == "xla":
    moments = reference.moments(grad, mu, nu, hyper, param_mask)
    out_m = moments[0].astype(mu.dtype)
    # ||g||^2 apart from Adam's g * g (_xla_cpu.unshared).
    g = _xla_cpu.unshared(grad)
    direct = param_mask is not None or layout.block_size < DIRECT_BELOW
    if mu_sq_norm_prev is None or direct:
      sums = reference.partial_sums(layout, out_m, g, param_mask)
    else:
      sums = carried_sums(layout, out_m, g, mu_sq_norm_prev, b1)
  elif with_sums and layout.block_size < DIRECT_BELOW:
    # One m_t for the three sums (each reduction would recompute it, and may round
    # a cancelling m_t otherwise: a cosine beyond 1).
    m = jax.lax.optimization_barrier(next_moment(b1, mu, grad))
    sums = reference.partial_sums(layout, m, grad, param_mask)
  elif with_sums:
    sums = derived_sums(layout, mu, grad, b1, param_mask)
  return PendingAdam(
    impl, grad, mu, nu, params, param_mask, hyper, layout, sums, moments, interpret,
    block_sizes, _dispatch.off_device(implementation),
  )  # fmt: skip


def finish_masked_adam(
  pending: PendingAdam, scale: jax.Array | None
) -> reference.MaskedAdamOutput:
  """The second half of :func:`masked_adam`: the step with per-block ``scale``.

  Args:
    pending: what :func:`start_masked_adam` returned (``mu`` and ``sums`` may have
      been replaced by equal values, e.g. passed through a loop).
    scale: f32 per-block scale of the layout's block shape, or ``None`` (1).

  Returns:
    A :class:`MaskedAdamOutput`; its sums are ``pending.sums`` where those were
    computed (the ones a scale was derived from), else the kernel's own.
  """
  p = pending
  if p.implementation == "xla" and p.moments is not None:
    new_m, new_v = p.moments
    u = reference.update(
      new_m, new_v, p.hyper, layout=p.layout, scale=scale,
      params=p.params, param_mask=p.param_mask, dtype=p.grad.dtype,
    )  # fmt: skip
    return reference.MaskedAdamOutput(
      new_m.astype(p.mu.dtype), new_v.astype(p.nu.dtype), u, *p.sums
    )
  if p.implementation == "xla":
    return reference.masked_adam_reference(
      p.grad, p.mu, p.nu, p.hyper, scale=scale, layout=p.layout,
      param_mask=p.param_mask, params=p.params,
    )  # fmt: skip

  def step(backend, grad, mu, nu, hyper, scale, param_mask, params):
    if backend is None:  # no kernel for this platform: the XLA step
      return reference.masked_adam_reference(
        grad, mu, nu, hyper, scale=scale, layout=p.layout, param_mask=param_mask,
        params=params,
      )  # fmt: skip
    return partitioned.masked_adam_pallas_partitioned(
      grad, mu, nu, hyper, scale=scale, layout=p.layout, param_mask=param_mask,
      params=params, block_sizes=p.block_sizes, interpret=bool(p.interpret),
      backend=backend,
    )  # fmt: skip

  operands = (p.grad, p.mu, p.nu, p.hyper, scale, p.param_mask, p.params)
  if p.interpret:
    out = step(_dispatch.pallas_backend(p.interpret), *operands)
  else:
    out = _dispatch.by_platform(step, p.off_device, *operands)
  if p.sums is None:
    return out
  # Every path returns the sums that a scale was computed from (here: derived
  # before the kernel), so a caller can recompute what it saw.
  return out._replace(
    mu_dot_grad=p.sums[0], mu_sq_norm=p.sums[1], grad_sq_norm=p.sums[2]
  )


def finish_masked_adam_many(
  pendings: Sequence[PendingAdam], scales: Sequence[jax.Array | None]
) -> list[reference.MaskedAdamOutput]:
  """:func:`finish_masked_adam` for many leaves, in few kernel launches.

  The Pallas leaves share kernel calls where they can (:mod:`grouped`): lowered
  for CUDA (where Triton is the GPU kernel) or ROCm, and in the generic
  interpreter (``interpret=True``), one call per :data:`grouped.MAX_LEAVES`
  leaves, whatever their shapes and dtypes. Each other leaf runs on its own, as
  :func:`finish_masked_adam` runs it: XLA leaves, the Mosaic kernels (TPU, Mosaic
  GPU, their interpreters), leaves with explicit ``block_sizes`` (the per-leaf
  kernel's tiles), and steps that XLA may partition over several devices or that
  ``jax.vmap`` batches (the per-leaf kernel has the rules for those).

  Args:
    pendings: per leaf what :func:`start_masked_adam` returned.
    scales: per leaf its f32 per-block scale (or ``None``: 1).

  Returns:
    Per leaf a :class:`MaskedAdamOutput`, as :func:`finish_masked_adam` returns it
    (the sums of a leaf without ``pending.sums`` are summed from its outputs).
  """
  outs: list[Any] = [None] * len(pendings)
  groups: dict[Any, list[int]] = {}
  for i, (p, scale) in enumerate(zip(pendings, scales, strict=True)):
    if _groupable(p, scale):
      groups.setdefault((bool(p.interpret), p.off_device), []).append(i)
    else:
      outs[i] = finish_masked_adam(p, scale)
  for (interpret, off), members in groups.items():
    for at in range(0, len(members), grouped.MAX_LEAVES):
      chunk = members[at : at + grouped.MAX_LEAVES]
      done = _finish_group(
        [pendings[i] for i in chunk], [scales[i] for i in chunk], interpret, off
      )
      for i, out in zip(chunk, done, strict=True):
        outs[i] = out
  return outs


def _groupable(p: PendingAdam, scale: Any) -> bool:
  """Whether ``p`` can share a grouped Triton call (see
  :func:`finish_masked_adam_many`)."""
  if p.implementation != "pallas" or not isinstance(p.interpret, bool):
    return False
  arrays = [p.grad, p.mu, p.nu, p.param_mask, p.params, scale]
  return (
    p.block_sizes is None
    and math.prod(p.grad.shape) > 0
    and not _compat.batched(arrays)
    and not _sharded.partitionable()
    and partitioned.explicit_mesh([x for x in arrays if x is not None]) is None
  )


def _finish_group(
  pendings: list[PendingAdam], scales: list[Any], interpret: bool, off: str | None
) -> list[reference.MaskedAdamOutput]:
  """The grouped leaves' step: the grouped Triton kernel for CUDA and ROCm, each
  leaf's own kernel for the others (:func:`dispatch.by_platform`)."""

  def step(backend, operands):
    out = []
    if backend == "triton":
      leaves = [
        grouped.Leaf(g, m, v, hyper, scale, p.layout.block_size, pm, params)
        for p, (g, m, v, hyper, scale, pm, params) in zip(
          pendings, operands, strict=True
        )
      ]
      return grouped.masked_adam_grouped(leaves, interpret=interpret)
    for p, (g, m, v, hyper, scale, pm, params) in zip(pendings, operands, strict=True):
      if backend is None:  # no kernel for this platform: the XLA step
        res = reference.masked_adam_reference(
          g, m, v, hyper, scale=scale, layout=p.layout, param_mask=pm, params=params
        )
      else:
        res = partitioned.masked_adam_pallas_partitioned(
          g, m, v, hyper, scale=scale, layout=p.layout, param_mask=pm,
          params=params, backend=backend,
        )  # fmt: skip
      out.append(tuple(res[:3]))
    return out

  operands = [
    (p.grad, p.mu, p.nu, p.hyper, scale, p.param_mask, p.params)
    for p, scale in zip(pendings, scales, strict=True)
  ]
  if interpret:
    results = step("triton", operands)
  else:
    results = _dispatch.by_platform(step, off, operands)
  outs = []
  for p, (new_m, new_v, u) in zip(pendings, results, strict=True):
    sums = p.sums
    if sums is None:  # summed from the outputs, as the per-leaf kernels do
      sums = reference.partial_sums(p.layout, new_m, p.grad, p.param_mask)
    outs.append(reference.MaskedAdamOutput(new_m, new_v, u, *sums))
  return outs


def carried_sums(
  layout: _blocks.BlockLayout,
  mu: jax.Array,
  grad: jax.Array,
  mu_sq_norm_prev: jax.Array,
  b1: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(<m_t, g>, ||m_t||^2, ||g||^2)`` reading m_t and g once: two reductions.

  ||m_t||^2 comes from the carried ||m_{t-1}||^2 (``docs/design/internals.md``).
  Where that recursion is not finite (a float32 sum overflowed, here or in the
  carry), or cancels -- ||m_t||^2 below ``2**-CANCELLATION_BITS`` of its terms'
  magnitudes, where the difference has lost the digits a direct sum keeps -- the
  result is NaN, not a clipped ``inf - inf`` or a rounding error, so that the caller
  knows to sum such blocks directly (``adam_magma`` does, in the alignment rule's
  ``settle_sums``; :func:`masked_adam` in :func:`sums_where_lost`).
  """
  m = mu.astype(jnp.float32)
  g = grad.astype(jnp.float32)
  dot = layout.block_sum(m * g)
  gg = layout.block_sum(g * g)
  b1, c = reference.decay(b1)
  prev = b1 * b1 * jnp.asarray(mu_sq_norm_prev, jnp.float32)
  mm = prev + 2.0 * c * dot - c * c * gg
  return dot, trusted(mm, prev + 2.0 * c * jnp.abs(dot) + c * c * gg), gg


def trusted(mm: jax.Array, terms: jax.Array) -> jax.Array:
  """``max(mm, 0)`` where a derived ``||m_t||^2`` keeps its digits, else NaN.

  ``terms``: the sum of the magnitudes of the terms ``mm`` was added from; a
  non-finite ``mm``, or one below ``2**-CANCELLATION_BITS`` of them (cancellation),
  is NaN. An all-zero block (``mm == terms == 0``) is exact.
  """
  ok = jnp.isfinite(mm) & (mm >= terms * 2.0**-CANCELLATION_BITS)
  return jnp.where(ok, jnp.maximum(mm, 0.0), jnp.nan)


def derived_sums(
  layout: _blocks.BlockLayout,
  mu_prev: jax.Array,
  grad: jax.Array,
  b1: Any,
  param_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """This step's ``(<m_t, g>, ||m_t||^2, ||g||^2)`` from m_{t-1} and g (no m_t).

  One reduction pass over (m_{t-1}, g) and the algebra of
  ``docs/design/internals.md``;
  over the existing entries only when ``param_mask`` is given (there m_t follows
  the EMA; elsewhere it is not counted). ``||m_t||^2`` is NaN in blocks where the
  algebra cancels or overflows (see :func:`carried_sums`): sum those directly. The
  dot product, too, is then inexact; elsewhere its error in the cosine is a few
  float32 roundings.
  """
  dot, mm, gg = reference.partial_sums(layout, mu_prev, grad, param_mask)
  b1, c = reference.decay(b1)
  new_dot = b1 * dot + c * gg
  new_mm = b1 * b1 * mm + 2.0 * b1 * c * dot + c * c * gg
  terms = b1 * b1 * mm + 2.0 * b1 * c * jnp.abs(dot) + c * c * gg
  return new_dot, trusted(new_mm, terms), gg
