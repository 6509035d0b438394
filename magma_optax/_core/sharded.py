"""Arrays sharded over a mesh: partition specs under ``Explicit`` axes, reshapes and
placements that keep them, work run with the axes as ``Auto``.

Under ``AxisType.Explicit`` mesh axes JAX puts the sharding in the array's type and
asks for it where a reshape or a new array would change it; these helpers give it.
Outside such meshes each returns what plain JAX would.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from magma_optax._core import compat as _compat


def mesh_axis_size(mesh: Any, entry: Any) -> int:
  """How many pieces a partition-spec entry (``None``, a mesh axis name or a tuple of
  names) cuts an axis into on ``mesh``."""
  if entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[n] for n in names)


def explicit_spec(x: Any) -> tuple[Any, ...] | None:
  """``x``'s partition spec (one entry per axis) if it is sharded over ``Explicit``
  mesh axes (sharding in types), else ``None``."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  types = getattr(mesh, "axis_types", ())
  if not any(t == jax.sharding.AxisType.Explicit for t in types):
    return None
  spec = tuple(sharding.spec) + (None,) * (jnp.ndim(x) - len(sharding.spec))
  return spec if any(e is not None for e in spec) else None


def put_like(y: jax.Array, x: Any, spec: Any = None) -> jax.Array:
  """``y`` sharded over ``x``'s ``Explicit`` mesh axes as ``spec`` (default: ``x``'s
  partition spec), where ``x`` is sharded over them; elsewhere ``y`` unchanged.

  Eager ``jnp.zeros`` / ``jnp.ones`` make replicated arrays, where a jitted step
  gives the state the parameters' sharding types (a ``while_loop`` carry must keep
  its type). Works outside a ``jax.set_mesh`` context too: an eager array is put on
  ``x``'s concrete mesh, a traced one resharded in its abstract mesh.
  """
  x_spec = explicit_spec(x)
  if x_spec is None:
    return y
  spec = jax.sharding.PartitionSpec(*(x_spec if spec is None else spec))
  if not _compat.is_tracer(x) and not _compat.is_tracer(y) and hasattr(x, "sharding"):
    return jax.device_put(y, x.sharding.update(spec=spec))
  sharding = jax.typeof(x).sharding
  with jax.sharding.use_abstract_mesh(sharding.mesh):
    return jax.sharding.reshard(y, sharding.update(spec=spec))


def reshape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """``x.reshape(shape)``, also where ``x`` is sharded over ``Explicit`` mesh axes.

  There JAX asks for the output sharding of a reshape that splits or merges a
  sharded axis. For reshapes made of splits and merges of neighbouring axes: a split
  axis's mesh axes go to its major piece (the first of size > 1; the first for a
  mesh axis of size 1; it must hold them evenly), and merged
  axes keep their major axis's, when the axes after it are unsharded -- the same
  blocks of entries on every device, no data moves. Anything else is left to JAX
  (which then raises its error).
  """
  shape = tuple(shape)
  spec = explicit_spec(x)
  if spec is None or 0 in x.shape or math.prod(x.shape) != math.prod(shape):
    return x.reshape(shape)  # (zero-size or invalid: JAX's own result or error)
  out: list[Any] = []
  i = j = 0
  src, dst = tuple(x.shape), shape
  while i < len(src) or j < len(dst):
    i0, j0 = i, j
    p_in = src[i] if i < len(src) else 1
    p_out = dst[j] if j < len(dst) else 1
    i, j = i + 1, j + 1
    while p_in != p_out:
      if p_in < p_out:
        p_in, i = p_in * src[i], i + 1
      else:
        p_out, j = p_out * dst[j], j + 1
    sharded = [k for k in range(i0, min(i, len(src))) if spec[k] is not None]
    group = [None] * (min(j, len(dst)) - j0)
    if sharded:
      k = sharded[0]
      # The major piece: the first of size > 1 -- or the first, for a mesh axis of
      # size 1, which any piece holds (a split into (1, n) keeps it on the 1, as
      # split_parts' part axes need).
      one = mesh_axis_size(jax.typeof(x).sharding.mesh, spec[k]) == 1
      majors = [d for d in range(j0, min(j, len(dst))) if dst[d] > 1 or one]
      if len(sharded) > 1 or any(src[m] > 1 for m in range(i0, k)) or not majors:
        return x.reshape(shape)  # not a plain split or merge: JAX decides
      group[majors[0] - j0] = spec[k]
    out.extend(group)
  # The input's sharding with the new spec: the same (abstract) mesh, also outside
  # a `jax.set_mesh` context.
  sharding = jax.typeof(x).sharding.update(spec=jax.sharding.PartitionSpec(*out))
  return jax.lax.reshape(x, shape, out_sharding=sharding)


def like_auto(fn: Any, like: jax.Array, *args: Any, axes: int | None = None) -> Any:
  """``fn(*args)``; where ``like`` is sharded over ``Explicit`` mesh axes, with those
  axes treated as ``Auto`` inside ``fn`` (``jax.sharding.auto_axes``) and every
  output sharded like the first ``axes`` axes of ``like`` (``None``: all of them).

  Under ``Explicit`` axes, a ``vmap`` over axes sharded that way fails in JAX 0.10
  and 0.12 for a function with a ``lax.while_loop`` ("Resource axis ... is not found
  in mesh: ()") or with a reshape of the other axes; with the axes as ``Auto``, XLA
  partitions the batch as it does on ``Auto`` meshes. Arrays that ``fn`` uses must
  come in through ``args`` (a captured array keeps its ``Explicit`` type, which JAX
  refuses to mix).
  """
  spec = explicit_spec(like)
  if spec is None:
    return fn(*args)
  out = jax.sharding.PartitionSpec(*spec[:axes])
  # In the mesh of `like` (also outside a `jax.set_mesh` context).
  with jax.sharding.use_abstract_mesh(jax.typeof(like).sharding.mesh):
    return jax.sharding.auto_axes(fn, out_sharding=out)(*args)


def partitionable() -> bool:
  """Whether XLA may partition the step being traced over several devices: its
  sharding propagation then runs across the step, and one computation over
  several leaves ties their shardings together (it may pick one leaf's for
  another's output). ``False`` in a one-device process, in a mesh of one device
  (also an abstract one) and inside a ``jax.shard_map`` whose mesh axes are all
  manual (each device runs its own)."""
  if jax.device_count() == 1:
    return False
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return True
  manual = jax.sharding.AxisType.Manual
  return mesh.size > 1 and any(t != manual for t in mesh.axis_types)
