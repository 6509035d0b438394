"""Many leaves, one kernel call: the masked-Adam step of a list of leaves in Triton.

:func:`masked_adam_grouped` runs one ``pallas_call`` over up to :data:`MAX_LEAVES`
leaves of any shapes and dtypes, each through refs of its own (no concatenation, no
padding): a 1-D grid of :data:`TILE`-entry tiles over all leaves, each program
finding its leaf in a static table and updating one tile of it with masked loads and
stores, its update scaled by its block's entry of the per-block scale. It computes
no block sums (the caller has them). ``implementation="pallas"`` lowers it for CUDA
and ROCm; ``interpret=True`` runs it in the generic Pallas interpreter. Bytes per
parameter and design notes: ``docs/design/internals.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from magma_optax._core import compat as _compat
from magma_optax.kernels import reference

TILE = 2048  # entries per program: 8 KB per float32 stream
NUM_WARPS = 4
MAX_LEAVES = 64  # leaves per call: each is one branch of the kernel's code


class Leaf(NamedTuple):
  """One leaf of a grouped call.

  Attributes:
    grad, mu, nu: the gradient and Adam's moments (one shape, any float dtypes).
    hyper: f32[NUM_HYPERPARAMS] from :func:`reference.hyperparams`.
    scale: f32 per-block scale, ``num_blocks`` entries in the leaf's block order
      (any shape), or ``None`` (1).
    block_size: entries per block; blocks are contiguous runs of the flat leaf.
    param_mask: bool array of the leaf's shape (False: the entry does not exist),
      or ``None``.
    params: the parameters, read for weight decay, or ``None``.
  """

  grad: jax.Array
  mu: jax.Array
  nu: jax.Array
  hyper: jax.Array
  scale: jax.Array | None
  block_size: int
  param_mask: jax.Array | None = None
  params: jax.Array | None = None


class _Plan(NamedTuple):
  """A leaf's static part of the kernel: where its tiles start in the grid."""

  first_tile: int
  tiles: int
  size: int
  block_size: int
  num_blocks: int
  has_mask: bool
  has_params: bool

  @property
  def num_inputs(self) -> int:
    return 5 + self.has_mask + self.has_params  # hyper, scale, g, m, v, ...


def _kernel(*refs, plans: tuple[_Plan, ...]):
  """Program ``i`` updates the tile ``i`` falls in (see the module docstring)."""
  pl = _compat.pallas()
  plt = _compat.pallas_triton()
  n_in = sum(plan.num_inputs for plan in plans)
  ins, outs = iter(refs[:n_in]), iter(refs[n_in:])
  pid = pl.program_id(0)
  for plan in plans:
    hyper_ref, scale_ref, g_ref, m_ref, v_ref = (next(ins) for _ in range(5))
    mask_ref = next(ins) if plan.has_mask else None
    p_ref = next(ins) if plan.has_params else None
    m_out, v_out, u_out = next(outs), next(outs), next(outs)

    @pl.when((pid >= plan.first_tile) & (pid < plan.first_tile + plan.tiles))
    def _tile(
      plan=plan, hyper_ref=hyper_ref, scale_ref=scale_ref, g_ref=g_ref,
      m_ref=m_ref, v_ref=v_ref, mask_ref=mask_ref, p_ref=p_ref, m_out=m_out,
      v_out=v_out, u_out=u_out,
    ):  # fmt: skip
      start = (pid - plan.first_tile) * TILE
      index = start + jnp.arange(TILE, dtype=jnp.int32)
      inside = index < plan.size
      tile = pl.ds(start, TILE)

      def load(ref, at=tile):
        return plt.load(ref.at[at], mask=inside, other=0)

      keep = load(mask_ref) != 0 if plan.has_mask else None
      p = load(p_ref) if plan.has_params else None
      new_m, new_v, u = reference.tile_adam(
        load(g_ref), load(m_ref), load(v_ref), keep, p, hyper_ref
      )
      if plan.num_blocks == 1:
        u = u * scale_ref[0]
      else:
        u = u * load(scale_ref, index // plan.block_size)
      if plan.has_mask:
        u = jnp.where(keep, u, 0.0)
      for ref, x in ((m_out, new_m), (v_out, new_v), (u_out, u)):
        plt.store(ref.at[tile], x.astype(ref.dtype), mask=inside)


def masked_adam_grouped(
  leaves: Sequence[Leaf], *, interpret: bool = False
) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
  """One fused masked-Adam step on each of ``leaves``, in one kernel call.

  Same per-entry math as :func:`reference.masked_adam_reference` (see the module
  docstring for the kernel and its bytes per parameter).

  Args:
    leaves: at most :data:`MAX_LEAVES` :class:`Leaf` of at least one entry each.
    interpret: run in the generic Pallas interpreter (on CPU; slow, for tests).

  Returns:
    Per leaf ``(mu, nu, update)``: the new moments (their input dtypes) and the
    masked, scaled update (the gradient's dtype), of the leaf's shape.

  Raises:
    ValueError: for more than :data:`MAX_LEAVES` leaves or an empty leaf.

  Example:
    >>> import jax.numpy as jnp
    >>> from magma_optax.kernels import grouped, reference
    >>> hyper = reference.hyperparams(1, 1e-3, 0.0, reference.AdamConstants())
    >>> g, zeros = jnp.ones((4, 8)), jnp.zeros((4, 8))
    >>> leaves = [grouped.Leaf(g, zeros, zeros, hyper, jnp.asarray([0.5]), 32),
    ...           grouped.Leaf(g[0], zeros[0], zeros[0], hyper, None, 8)]
    >>> (m, v, u), (m0, v0, u0) = grouped.masked_adam_grouped(leaves, interpret=True)
    >>> round(float(u[0, 0]), 6), round(float(u0[0]), 6)  # scaled by 0.5, and 1
    (-0.0005, -0.001)
  """
  pl = _compat.pallas()
  if not 0 < len(leaves) <= MAX_LEAVES:
    raise ValueError(
      f"a grouped call takes 1 to {MAX_LEAVES} leaves; got {len(leaves)}."
    )
  plans, inputs, out_shape, aliases = [], [], [], {}
  first = 0
  for leaf in leaves:
    size = math.prod(leaf.grad.shape)
    if size == 0 or size % leaf.block_size:
      raise ValueError(
        f"a grouped leaf needs entries, in whole blocks; got shape"
        f" {leaf.grad.shape} with blocks of {leaf.block_size}."
      )
    plan = _Plan(
      first_tile=first,
      tiles=-(-size // TILE),
      size=size,
      block_size=leaf.block_size,
      num_blocks=size // leaf.block_size,
      has_mask=leaf.param_mask is not None,
      has_params=leaf.params is not None,
    )
    first += plan.tiles
    scale = leaf.scale
    if scale is None:
      scale = jnp.ones(plan.num_blocks, jnp.float32)
    flat = functools.partial(jnp.reshape, shape=(size,))  # a free view of the leaf
    inputs += [leaf.hyper.astype(jnp.float32), scale.astype(jnp.float32).reshape(-1)]
    aliases[len(inputs) + 1] = len(out_shape)  # m -> m'
    aliases[len(inputs) + 2] = len(out_shape) + 1  # v -> v'
    inputs += [flat(leaf.grad), flat(leaf.mu), flat(leaf.nu)]
    if plan.has_mask:
      inputs.append(flat(leaf.param_mask).astype(jnp.int8))  # Triton loads bytes
    if plan.has_params:
      inputs.append(flat(leaf.params))
    out_shape += [
      jax.ShapeDtypeStruct((size,), x.dtype) for x in (leaf.mu, leaf.nu, leaf.grad)
    ]
    plans.append(plan)
  compiler_params = None
  if not interpret:
    compiler_params = _compat.triton_compiler_params(NUM_WARPS)
  out = pl.pallas_call(
    functools.partial(_kernel, plans=tuple(plans)),
    out_shape=out_shape,
    grid=(first,),
    input_output_aliases=aliases,
    compiler_params=compiler_params,
    interpret=interpret,
    name="masked_adam_grouped",
  )(*inputs)
  return [
    tuple(x.reshape(leaf.grad.shape) for x in out[3 * k : 3 * k + 3])
    for k, leaf in enumerate(leaves)
  ]
