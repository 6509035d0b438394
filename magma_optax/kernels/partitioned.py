"""The Pallas kernels on sharded leaves: one kernel per shard, no leaf gathered.

A ``pallas_call`` is opaque to XLA's partitioner, which would gather a sharded leaf
to run it. :func:`masked_adam_pallas_partitioned` wraps the backend's kernel
(:func:`kernel_for`: ``"triton"``, ``"mosaic_tpu"`` or ``"mosaic_gpu"``) in
``custom_partitioning``: each device runs it on its own shard with that shard's
block layout, and the per-block partial sums are ``psum``-ed over the mesh axes
that split a block. Where it cannot partition (vmap, interpreted Mosaic kernels,
mixed axis types): ``docs/design/internals.md``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from magma_optax._core import blocks as _blocks
from magma_optax._core import compat as _compat
from magma_optax._core import sharded as _sharded
from magma_optax.kernels import config as config_lib
from magma_optax.kernels import mosaic_gpu
from magma_optax.kernels import mosaic_tpu
from magma_optax.kernels import reference
from magma_optax.kernels import rows as _rows
from magma_optax.kernels import triton

BACKENDS = ("triton", "mosaic_tpu", "mosaic_gpu")


def kernel_for(backend: str):
  """The per-leaf kernel function of ``backend`` (looked up at call time)."""
  if backend == "triton":
    return triton.masked_adam_pallas
  if backend == "mosaic_tpu":
    return mosaic_tpu.masked_adam_pallas_tpu
  if backend == "mosaic_gpu":
    return mosaic_gpu.masked_adam_pallas_mgpu
  raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}.")


def _splits_last_axis(layout: _blocks.BlockLayout) -> bool:
  """Whether the layout cuts the leaf's last axis into (blocks, tile)."""
  return tuple(layout.expanded_shape) != tuple(layout.shape)


def _block_axes(layout: _blocks.BlockLayout) -> list[int]:
  """The leaf axes that index blocks (a split last axis counts as one)."""
  n = len(layout.shape)
  if _splits_last_axis(layout):
    return list(range(n))  # lead axes, then the split axis (blocks of the tile)
  return [i for i in range(n) if i not in layout.reduce_axes]


def _local_layout(layout: _blocks.BlockLayout, shape) -> _blocks.BlockLayout:
  """The layout of one shard of shape ``shape`` (same blocks, fewer of them)."""
  shape = tuple(shape)
  if _splits_last_axis(layout):  # (..., C) -> (..., C / tile, tile)
    tile = layout.expanded_shape[-1]
    expanded = shape[:-1] + (shape[-1] // tile, tile)
    return _blocks.BlockLayout(shape, expanded, layout.reduce_axes)
  return _blocks.BlockLayout(shape, shape, layout.reduce_axes)


def _sharding_rule(layout: _blocks.BlockLayout, num_leaf_args: int, mesh):
  """Shardy rule: leaf arrays share factors; block arrays use the block factors."""
  n = len(layout.shape)
  leaf = [f"d{i}" for i in range(n)]
  extra = {"need_replication_factors": ("h",)}
  if _splits_last_axis(layout):  # the last axis is (blocks q, tile t)
    block = leaf[:-1] + ["q"]
    blocks, tile = layout.expanded_shape[-2:]
    if blocks % math.prod(mesh.shape.values()) == 0:
      leaf[-1] = "(q t)"
      extra = {"need_replication_factors": ("h", "t"), "t": tile}
    else:  # Shardy would shard q over sub-axes, which a NamedSharding cannot say
      leaf[-1] = "c"
  else:
    block = [leaf[i] for i in _block_axes(layout)]
  leaf_s, block_s = " ".join(leaf), " ".join(block)
  operands = ", ".join(["h", block_s] + [leaf_s] * num_leaf_args)
  results = ", ".join([leaf_s] * 3 + [block_s] * 3)
  return f"{operands} -> {results}", extra


def _mesh_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _specs(
  layout: _blocks.BlockLayout, spec, mesh_shape
) -> tuple[tuple, tuple, tuple[str, ...]]:
  """(leaf spec, block spec, mesh axes to all-reduce the sums over) from a leaf spec.

  A split last axis stays sharded only if every shard holds whole tiles; the sums
  are partial over every mesh axis that shards an axis within the blocks.
  """
  n = len(layout.shape)
  spec = tuple(spec) + (None,) * (n - len(tuple(spec)))
  if _splits_last_axis(layout):
    ways = math.prod(mesh_shape[a] for a in _mesh_axes(spec[-1]))
    if layout.shape[-1] % (ways * layout.expanded_shape[-1]):
      spec = spec[:-1] + (None,)
  block_axes = _block_axes(layout)
  psum_axes = tuple(
    a for i in range(n) if i not in block_axes for a in _mesh_axes(spec[i])
  )
  return spec, tuple(spec[i] for i in block_axes), psum_axes


@functools.cache
def _kernel_fns(
  layout: _blocks.BlockLayout,
  block_sizes: config_lib.BlockSizes | None,
  interpret: bool,
  has_mask: bool,
  has_params: bool,
  backend: str = "triton",
):
  """(per-shard function maker, partitioned kernel) for one static configuration."""

  def run(layout_, hyper, scale, g, m, v, *rest):
    it = iter(rest)
    mask = next(it) if has_mask else None
    params = next(it) if has_params else None
    return tuple(
      kernel_for(backend)(
        g, m, v, hyper, scale=scale, layout=layout_,
        param_mask=mask, params=params, block_sizes=block_sizes,
        interpret=interpret,
      )
    )  # fmt: skip

  def per_shard(psum_axes, split_last=()):
    """The per-device function; ``split_last``: mesh axes the caller wants the
    leaf outputs' last axis split over although the kernel saw it whole."""

    def lower_fn(hyper, scale, g, m, v, *rest):
      out = run(_local_layout(layout, g.shape), hyper, scale, g, m, v, *rest)
      if psum_axes:
        out = out[:3] + tuple(jax.lax.psum(s, psum_axes) for s in out[3:])
      if split_last:  # each device keeps its own part of the whole last axis
        ways = math.prod(jax.lax.axis_size(a) for a in split_last)
        size = -(-g.shape[-1] // ways)  # uneven shards are padded at the end
        pad = [(0, 0)] * (g.ndim - 1) + [(0, size * ways - g.shape[-1])]
        start = jax.lax.axis_index(split_last) * size
        cut = [
          jax.lax.dynamic_slice_in_dim(jnp.pad(x, pad), start, size, -1)
          for x in out[:3]
        ]
        out = tuple(cut) + out[3:]
      return out

    return lower_fn

  @_compat.custom_partitioning()
  def kernel(hyper, scale, g, m, v, *rest):
    return run(layout, hyper, scale, g, m, v, *rest)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    shardings = [a.sharding for a in arg_shapes[2:]]  # g, m, v[, mask][, params]
    for sharding in shardings:
      if not isinstance(sharding, NamedSharding):
        raise ValueError(
          "implementation='pallas' on a sharded leaf needs the leaf's sharding as"
          f" a NamedSharding on a Mesh; got {sharding!r}. Use"
          " jax.sharding.NamedSharding (or implementation='xla')."
        )
    asked = _first_sharded_spec(shardings)
    spec, block_spec, psum_axes = _specs(layout, asked, mesh.shape)
    asked = tuple(asked) + (None,) * (len(spec) - len(tuple(asked)))
    split_last = _mesh_axes(asked[-1]) if asked[-1] != spec[-1] else ()
    leaf_sh = NamedSharding(mesh, PartitionSpec(*spec))
    out_sh = NamedSharding(mesh, PartitionSpec(*asked))  # the leaf keeps its spec
    block_sh = NamedSharding(mesh, PartitionSpec(*block_spec))
    replicated = NamedSharding(mesh, PartitionSpec())
    arg_shardings = (replicated, block_sh) + (leaf_sh,) * (len(arg_shapes) - 2)
    results = (out_sh,) * 3 + (block_sh,) * 3
    return mesh, per_shard(psum_axes, split_last), results, arg_shardings

  kernel.def_partition(
    partition=partition,
    sharding_rule=lambda mesh, operands, results: _sharding_rule(
      layout, len(operands) - 2, mesh
    ),
  )

  def batched(fn):
    """``fn`` with a vmap rule that maps the unpartitioned kernel over the batch."""
    fn = jax.custom_batching.custom_vmap(fn)

    @fn.def_vmap
    def _vmap_rule(axis_size, in_batched, *args):
      one = functools.partial(run, layout)
      if backend == "triton":  # pallas_call's batching rule adds a grid axis
        axes = [0 if b else None for b in in_batched]
        return jax.vmap(one, in_axes=axes)(*args), (True,) * 6
      # Mosaic kernels: their grid's dimension semantics (TPU) and kernel
      # arguments (Mosaic GPU) do not survive that rule; one call per example.
      args = [
        x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
        for x, b in zip(args, in_batched, strict=True)
      ]
      return jax.lax.map(lambda xs: one(*xs), args), (True,) * 6

    return fn

  return per_shard, batched(kernel), batched(per_shard(()))


def _first_sharded_spec(shardings) -> PartitionSpec:
  """The spec the kernel's leaf arrays take: the first one that splits the leaf.

  g first, then m, v, the mask and the params: a ZeRO-style step with a replicated
  gradient and sharded moments keeps the moments' layout instead of gathering them.
  """
  for sharding in shardings:
    if isinstance(sharding, NamedSharding) and any(
      e is not None for e in sharding.spec
    ):
      return sharding.spec
  return PartitionSpec()


def explicit_mesh(arrays):
  """The mesh whose ``Explicit`` axes shard one of ``arrays``, else ``None``."""
  return _explicit_mesh_and_spec(arrays)[0]


def _explicit_mesh_and_spec(arrays):
  """(mesh, spec) if the arrays' types carry a sharding (Explicit axes), else None."""
  shardings = [getattr(jax.typeof(x), "sharding", None) for x in arrays]
  spec = _first_sharded_spec(shardings)
  if not any(e is not None for e in spec):
    return None, None
  mesh = next(
    s.mesh for s in shardings if isinstance(s, NamedSharding) and s.spec == spec
  )
  return mesh, spec


def masked_adam_pallas_partitioned(
  grad: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
  hyper: jax.Array,
  *,
  scale: jax.Array | None = None,
  layout: _blocks.BlockLayout | None = None,
  param_mask: jax.Array | None = None,
  params: jax.Array | None = None,
  block_sizes: config_lib.BlockSizes | None = None,
  interpret: bool = False,
  backend: str = "triton",
) -> reference.MaskedAdamOutput:
  """The kernel of ``backend`` run per shard on sharded leaves.

  Same arguments and result as :func:`triton.masked_adam_pallas` (see the
  ``docs/design/internals.md`` for what happens under ``shard_map`` and ``vmap``);
  ``interpret`` runs that kernel in its backend's interpreter (the generic one for
  ``"triton"``).

  Raises:
    ValueError: if the layout's blocks are not contiguous.
  """
  layout = layout or reference.tensor_layout(grad.shape)
  _rows.check_contiguous(layout)
  if scale is None:
    scale = jnp.ones(layout.block_shape, jnp.float32)
  scale = jnp.asarray(scale, jnp.float32).reshape(layout.block_shape)
  kernel_for(backend)  # a bad name fails here, not inside the partitioner
  per_shard, kernel, unpartitioned = _kernel_fns(
    layout, block_sizes, bool(interpret), param_mask is not None,
    params is not None, backend,
  )  # fmt: skip
  args = [hyper.astype(jnp.float32), scale, grad, mu, nu]
  args += [x for x in (param_mask, params) if x is not None]
  mesh, spec = _explicit_mesh_and_spec(args[2:])
  if mesh is None and (
    not _sharded.partitionable() or (interpret and backend != "triton")
  ):
    # Nothing to partition (one device, a mesh of one, inside shard_map): the
    # kernel as it is, also under an abstract mesh, where custom_partitioning
    # cannot lower. And the TPU and Mosaic GPU interpreters order their steps
    # with ordered callbacks, an effect custom_partitioning cannot lower either.
    return reference.MaskedAdamOutput(*unpartitioned(*args))
  if mesh is None:  # Auto axes: the partitioner calls back
    return reference.MaskedAdamOutput(*kernel(*args))
  # Explicit axes: the shardings are known now, so map over the shards directly.
  leaf, block, psum_axes = _specs(layout, spec, mesh.shape)
  leaf, block = PartitionSpec(*leaf), PartitionSpec(*block)
  in_specs = (PartitionSpec(), block) + (leaf,) * (len(args) - 2)
  args = [
    jax.sharding.reshard(a, NamedSharding(mesh, s))
    for a, s in zip(args, in_specs, strict=True)
  ]
  out = jax.shard_map(
    per_shard(psum_axes),
    mesh=mesh,
    in_specs=in_specs,
    out_specs=(leaf,) * 3 + (block,) * 3,
    check_vma=False,
  )(*args)
  keep = NamedSharding(mesh, PartitionSpec(*spec))  # the leaf keeps its spec
  out = [jax.sharding.reshard(x, keep) for x in out[:3]] + list(out[3:])
  return reference.MaskedAdamOutput(*out)
