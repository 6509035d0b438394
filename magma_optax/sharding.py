"""Sharding: optimizer states laid out like the parameters, and cosines across shards.

Every transform runs under ``jax.jit`` on sharded parameters and gives the unsharded
result. This module gives the *layout of the state*: :func:`state_shardings` (a
state leaf shaped like a parameter gets its sharding, a per-block array the
parameter's spec on the axes its state declares, anything else is replicated),
:func:`init` (``tx.init`` with those shardings), :func:`abstract_state` (a checkpoint
restore target), :func:`tile_shards` (``shards=`` from the parameters' shardings)
and :func:`block_cosine` (Magma's cosine inside ``shard_map``). Public as
``magma_optax.sharding``; what holds on several devices and hosts: ``docs/scale.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from magma_optax._core import blocks as _blocks
from magma_optax._core import sharded as _sharded
from magma_optax._core import trees as _trees
from magma_optax.masking import alignment as _alignment

__all__ = ("abstract_state", "block_cosine", "init", "state_shardings", "tile_shards")


def _find_mesh(shardings: list[Any]) -> jax.sharding.Mesh | None:
  for s in shardings:
    if isinstance(s, NamedSharding):
      return s.mesh
  return None


def _block_spec(
  leaf_shape: tuple[int, ...],
  param_shape: tuple[int, ...],
  spec: tuple[Any, ...],
  declared: set[tuple[int, ...]] | None,
) -> tuple[Any, ...] | None:
  """Partition spec of a per-block array of a parameter, or ``None`` (replicate).

  ``declared``: the parameter axes that the array's axes index, as the transforms
  declared them in the state (:attr:`BlockLayout.param_axes`); several different
  declarations for one shape (two transforms with different granularities whose
  block shapes coincide) are ambiguous. An undeclared array of the parameter's rank
  (N:M compact storage of :func:`sparse_state`: axis i is the parameter's, shrunk by
  n/m) keeps the parameter's spec.
  """
  if declared is not None and len(declared) == 1:
    (axes,) = declared
    return tuple(None if a is None else spec[a] for a in axes)
  if declared is None and len(leaf_shape) == len(param_shape):
    return spec
  return None


def _leaf_sharding(
  leaf: Any, param: Any, sharding: Any, replicated: Any, declared: Any
) -> Any:
  """The sharding of one state leaf that belongs to ``param``'s position."""
  shape = tuple(leaf.shape)
  param_shape = tuple(param.shape)
  if shape == param_shape:
    return sharding
  if not shape or not isinstance(sharding, NamedSharding):
    return replicated
  spec = tuple(sharding.spec) + (None,) * (len(param_shape) - len(sharding.spec))
  block_spec = _block_spec(shape, param_shape, spec, declared)
  if block_spec is None:
    return replicated
  # An axis split unevenly is legal but pads; keep only exact splits.
  mesh = sharding.mesh
  block_spec = tuple(
    e if d % _sharded.mesh_axis_size(mesh, e) == 0 else None
    for d, e in zip(shape, block_spec, strict=True)
  )
  return NamedSharding(
    mesh, PartitionSpec(*block_spec), memory_kind=sharding.memory_kind
  )


def _param_shardings(params: Any) -> list[Any]:
  out = []
  for x in jax.tree.leaves(params):
    sharding = getattr(x, "sharding", None)
    if sharding is None:
      raise ValueError(
        "state_shardings needs parameters that carry a sharding (jax.Array, or"
        f" jax.ShapeDtypeStruct with sharding=...); got a leaf {x!r}."
      )
    out.append(sharding)
  return out


def state_shardings(
  tx: optax.GradientTransformation,
  params: Any,
  *,
  mesh: jax.sharding.Mesh | None = None,
) -> Any:
  """Shardings for ``tx.init(params)`` that follow the parameters' shardings.

  The state is computed abstractly (``jax.eval_shape``, nothing is allocated).
  Every subtree of the state with the parameters' tree structure (``optax``'s
  ``mu``/``nu``/``trace``, this package's ``scores``/``mask``/``momentum``; trees
  with ``optax.MaskedNode`` in place of leaves or whole subtrees included, as
  ``optax.masked`` and ``optax.multi_transform`` leave their groups' trees) is
  matched leaf by leaf to the parameters:

  * same shape as the parameter: the parameter's sharding;
  * a per-block array: the parameter's ``PartitionSpec`` on the axes that index
    blocks, as the state declares them (``BlockLayout.param_axes``:
    ``"row"`` keeps all but the last axis, ``"column"`` and ``"tensor"`` with
    ``stack_axes`` keep the stacked axes and the last / only the stacked axes, tiles
    keep every axis, counting tiles), where the block count divides evenly; nothing
    is guessed from shapes (``"row"`` and ``"column"`` of a square matrix are told
    apart). Two transforms declaring different layouts of one shape for the same
    parameter, and undeclared arrays of another rank, are replicated -- per-block
    arrays are small;
  * anything else (step counts, PRNG keys, active fractions): replicated on the
    mesh.

  Any choice is correct (shardings never change values); these keep state memory
  per device proportional to the parameters' and avoid resharding in the step.

  Args:
    tx: the optimizer, e.g. ``magma.magma(optax.adam(1e-3))``.
    params: the parameters: ``jax.Array`` s or ``jax.ShapeDtypeStruct`` s, each with
      a ``sharding`` (typically ``NamedSharding`` on one mesh).
    mesh: the mesh for replicated leaves; default: the mesh of the first
      ``NamedSharding`` among the parameters.

  Returns:
    A pytree of ``jax.sharding.Sharding`` with the structure of ``tx.init(params)``,
    usable as ``out_shardings`` of ``jax.jit``.

  Raises:
    ValueError: if a parameter carries no sharding, or no mesh can be found and the
      parameters are not all on one device.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> mesh = jax.make_mesh((1,), ("x",))
    >>> sharding = jax.sharding.NamedSharding(mesh, jax.P("x"))
    >>> params = {"w": jax.device_put(jnp.ones((4, 3)), sharding)}
    >>> tx = magma.magma(optax.adam(1e-3))
    >>> shardings = magma.sharding.state_shardings(tx, params)
    >>> shardings.inner_state[0].mu["w"].spec == jax.P("x")
    True
  """
  param_leaves, param_def = jax.tree.flatten(params)
  shardings = _param_shardings(params)
  mesh = mesh or _find_mesh(shardings)
  if mesh is not None:
    replicated = NamedSharding(mesh, PartitionSpec())
  else:
    devices = {d for s in shardings for d in s.device_set}
    if len(devices) > 1:
      raise ValueError(
        "state_shardings found no NamedSharding among the parameters and they"
        f" span {len(devices)} devices; pass mesh=."
      )
    device = devices.pop() if devices else jax.devices()[0]
    replicated = jax.sharding.SingleDeviceSharding(device)

  paths = [
    jax.tree_util.keystr(path)
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  abstract = jax.eval_shape(tx.init, params)
  declared = _blocks.declarations(abstract)

  def entry(i, leaf):
    key = (paths[i], tuple(leaf.shape))
    return _leaf_sharding(
      leaf, param_leaves[i], shardings[i], replicated, declared.get(key)
    )

  return _trees.map_like(entry, abstract, param_def, other=lambda x: replicated)


def init(
  tx: optax.GradientTransformation,
  params: Any,
  *,
  mesh: jax.sharding.Mesh | None = None,
) -> Any:
  """``tx.init(params)`` under ``jax.jit`` with :func:`state_shardings` as output.

  Args:
    tx: the optimizer.
    params: sharded parameters (``jax.Array`` s).
    mesh: see :func:`state_shardings`.

  Returns:
    The optimizer state, each leaf placed as :func:`state_shardings` says.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> mesh = jax.make_mesh((1,), ("x",))
    >>> sharding = jax.sharding.NamedSharding(mesh, jax.P("x"))
    >>> params = {"w": jax.device_put(jnp.ones((4, 3)), sharding)}
    >>> state = magma.sharding.init(magma.magma(optax.adam(1e-3)), params)
    >>> state.inner_state[0].mu["w"].sharding.spec == jax.P("x")
    True
  """
  shardings = state_shardings(tx, params, mesh=mesh)
  return jax.jit(tx.init, out_shardings=shardings)(params)


def abstract_state(
  tx: optax.GradientTransformation,
  params: Any,
  *,
  mesh: jax.sharding.Mesh | None = None,
) -> Any:
  """``jax.ShapeDtypeStruct`` s of ``tx.init(params)`` carrying its shardings.

  The restore target for a checkpoint, e.g. with orbax-checkpoint
  ``ocp.StandardCheckpointer().restore(path, magma.sharding.abstract_state(tx,
  params))``: every leaf (typed PRNG keys included) comes back with the right
  dtype and sharding. ``params`` may itself be abstract.

  Args:
    tx: the optimizer.
    params: parameters or ``jax.ShapeDtypeStruct`` s, each with a ``sharding``.
    mesh: see :func:`state_shardings`.

  Returns:
    A pytree like ``tx.init(params)`` of ``jax.ShapeDtypeStruct`` with shardings.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = magma.magma(optax.adam(1e-3))
    >>> target = magma.sharding.abstract_state(tx, {"w": jnp.ones((4, 4))})
    >>> target.inner_state[0].mu["w"].shape
    (4, 4)
  """
  shardings = state_shardings(tx, params, mesh=mesh)
  abstract = jax.eval_shape(tx.init, params)
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    abstract,
    shardings,
  )


def tile_shards(params: Any) -> Callable[[Any, Any], tuple[int, ...] | None]:
  """The ``shards=`` that follows the parameters' shardings, for tile masks and
  per-shard tile storage.

  For :func:`magma_optax.periodic_mask`, :func:`magma_optax.sparse_state` and
  :func:`magma_optax.sparse_adam` with ``block=(r, c)``: a leaf whose
  ``NamedSharding`` splits axis -2 ``sr`` ways and axis -1 ``sc`` ways gets ``(sr,
  sc)``, so its mask keeps as many tiles in every shard and its tile storage is
  kept per shard, sharded like the parameter. A leaf also sharded along an axis
  before the last two (a stack of experts or layers) gets the counts of every axis
  from the first one its spec names on, e.g. ``(4, 1, 2)`` for ``P("e", None,
  "x")`` with ``e`` of size 4 and ``x`` of size 2. Leaves of fewer than two axes
  get ``None`` (one part).

  Args:
    params: the parameter tree the optimizer is applied to (the same paths):
      ``jax.Array`` s or ``jax.ShapeDtypeStruct`` s with a ``sharding``, or the
      shardings themselves.

  Returns:
    A function ``(path, leaf) -> counts | None`` that looks the leaf up by its
    key path (a ``ValueError`` for a path that ``params`` does not have).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import magma_optax as magma
    >>> mesh = jax.make_mesh((1,), ("x",))
    >>> sharding = jax.sharding.NamedSharding(mesh, jax.P(None, "x"))
    >>> params = {"w": jax.device_put(jnp.ones((8, 8)), sharding)}
    >>> shards = magma.sharding.tile_shards(params)
    >>> shards(jax.tree_util.tree_flatten_with_path(params)[0][0][0], None)
    (1, 1)
  """
  table = {}
  for path, x in jax.tree_util.tree_flatten_with_path(
    params, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
  )[0]:
    is_sharding = isinstance(x, jax.sharding.Sharding)
    sharding = x if is_sharding else getattr(x, "sharding", None)
    if sharding is None:
      raise ValueError(
        "tile_shards needs parameters that carry a sharding (jax.Array, or"
        f" jax.ShapeDtypeStruct with sharding=...), or shardings; got a leaf {x!r}."
      )
    # A sharding alone does not know the leaf's rank: the leaf passed in does.
    table[jax.tree_util.keystr(path)] = (sharding, None if is_sharding else x.ndim)

  def shards(path: Any, leaf: Any) -> tuple[int, ...] | None:
    name = jax.tree_util.keystr(path)
    if name not in table:
      raise ValueError(
        f"tile_shards has no parameter at path {name}; build it from the tree the"
        f" optimizer is applied to (it has {sorted(table)[:8]})."
      )
    sharding, ndim = table[name]
    if ndim is None:
      if leaf is None:
        raise ValueError(
          f"tile_shards was built from shardings, which do not say the rank of"
          f" leaf {name}: pass the leaf, or build it from the parameters."
        )
      ndim = len(jnp.shape(leaf))
    if ndim < 2 or not isinstance(sharding, NamedSharding):
      return None
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    counts = [_sharded.mesh_axis_size(sharding.mesh, e) for e in spec]
    # From the first axis the spec names (a size-1 mesh axis too: the parts keep
    # the parameter's sharding type).
    first = next((i for i, e in enumerate(spec) if e is not None), ndim)
    return tuple(counts[min(first, ndim - 2) :])

  return shards


def block_cosine(
  a: jax.Array,
  b: jax.Array,
  *,
  granularity: _blocks.Granularity = "tensor",
  stack_axes: int = 0,
  axis_name: Any = None,
) -> jax.Array:
  r"""Per-block cosine of ``a`` and ``b``, summed across shards inside ``shard_map``.

  For each block b: :math:`\cos_b = \langle a_b, b_b\rangle / (\|a_b\| \|b_b\|)`
  in float32, 0 where either block is zero -- the cosine Magma scores. Inside
  ``jax.shard_map`` the arrays are local shards: the partial sums
  :math:`\langle a, b\rangle, \|a\|^2, \|b\|^2` of each block are combined with
  ``jax.lax.psum`` over ``axis_name`` before the cosine is formed, so every shard
  gets the global cosine of the blocks it holds.

  ``axis_name`` must name exactly the mesh axes that split a block: for
  ``"tensor"`` every axis that shards the array; for ``"row"`` the axes that shard
  the last dimension; for ``"column"`` those that shard the other dimensions. An
  axis that shards *between* blocks (rows sharded with ``"row"``) must not be named:
  its shards hold different blocks.

  Args:
    a: array (or local shard).
    b: array of the same shape.
    granularity: block granularity (``"tensor"``, ``"row"``, ``"column"``,
      ``"element"`` or a tile shape), applied to the local shape.
    stack_axes: number of leading axes that index stacked layers.
    axis_name: mesh axis name or tuple of names to sum over; ``None`` outside
      ``shard_map``.

  Returns:
    f32 array of the (local) block shape, values in [-1, 1]: exact to float32
    rounding for every block of finite entries, also where its float32 sums
    overflow (they are recomputed rescaled by a power of two); entries below
    about 1e-19, whose squares underflow float32, count as 0; NaN for a block
    that holds an inf or NaN (Magma keeps such a block's score).

  Example:
    >>> import jax.numpy as jnp
    >>> import magma_optax as magma
    >>> a = jnp.array([[1.0, 0.0], [1.0, 1.0]])
    >>> cos = magma.sharding.block_cosine(a, jnp.ones((2, 2)), granularity="row")
    >>> [round(float(c), 4) for c in cos]
    [0.7071, 1.0]

  References:
    Joo et al., On Surprising Effectiveness of Masking Updates in Adaptive
    Optimizers, arXiv 2602.15322 (2026), Algorithm 1.
  """
  granularity = _blocks.validate_granularity(granularity)
  stack_axes = _blocks.validate_stack_axes(stack_axes)
  if a.shape != b.shape:
    raise ValueError(
      f"block_cosine needs arrays of one shape; got {a.shape} and {b.shape}."
    )
  layout = _blocks.block_layout(a.shape, granularity, stack_axes)
  return _alignment.block_cosine(layout, a, b, axis_name=axis_name)
