"""The one place that touches JAX APIs outside its compatibility policy.

JAX promises stability for ``jax.*`` public APIs, not for ``jax.core``, for
``jax.experimental`` or for Pallas (jax's own docs call all of them experimental).
Everything the package needs from them is reached through this module, so a move
between jax versions (we support 0.10.2, the last release for Python 3.11, to the
newest) is fixed here once. Imports of Pallas are lazy: ``import magma_optax`` does
not load Pallas, which only the kernels' Pallas path needs.
"""

from __future__ import annotations

import contextvars
import functools
import math
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp

JAX_VERSION: tuple[int, ...] = tuple(
  int(part) for part in jax.__version__.split(".")[:3] if part.isdigit()
)

# jax 0.11 deprecated the Pallas Triton backend: lowering a Triton kernel warns
# ("migrate to the Mosaic GPU backend"). Only an explicit
# ``implementation="pallas"`` on a GPU lowers one; the default XLA path never does.
TRITON_DEPRECATED = JAX_VERSION >= (0, 11)


def is_tracer(value: Any) -> bool:
  """Whether ``value`` is a traced value (inside ``jit``, ``grad``, ...)."""
  return isinstance(value, jax.core.Tracer)


def hoist_closure(
  fn: Any, operand: Any, traced: tuple[Any, Any] | None = None
) -> tuple[Any, list[Any]]:
  """``fn`` as a function of ``operand`` and of every value it closes over,
  passed explicitly: ``fn(operand) == converted(operand, *consts)``.

  Unlike ``jax.closure_convert``, which keeps the values that it cannot
  differentiate closed over, every value is hoisted, so the converted function
  holds no tracer of the trace it was built in (a custom rule may call it later,
  from another trace). ``fn`` is traced once, on ``operand``'s types (``traced``:
  that trace, ``jax.make_jaxpr(fn, return_shape=True)(operand)``, already made);
  the jaxpr runs through ``jax.extend.core``.
  """
  closed, out_shape = traced or jax.make_jaxpr(fn, return_shape=True)(operand)
  jaxpr, out_tree = closed.jaxpr, jax.tree.structure(out_shape)

  def converted(x: Any, *consts: Any) -> Any:
    run = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(jaxpr, consts))
    return out_tree.unflatten(run(*jax.tree.leaves(x)))

  return converted, list(closed.consts)


def replay(traced: tuple[Any, Any]) -> Any:
  """The function that ``jax.make_jaxpr(fn, return_shape=True)(*args)`` traced,
  as its jaxpr: called on arguments of the same types, it gives ``fn``'s outputs
  without tracing ``fn`` again (nested loops and branches would each trace their
  bodies once more)."""
  closed, out_shape = traced
  run = jax.extend.core.jaxpr_as_fun(closed)
  out_tree = jax.tree.structure(out_shape)
  return lambda *args: out_tree.unflatten(run(*jax.tree.leaves(args)))


def batched(tree: Any) -> bool:
  """Whether some leaf of ``tree`` is traced by ``jax.vmap`` (a ``BatchTracer``,
  by the type's name, which jax does not promise; also under a tangent). For code
  whose best form differs under ``vmap``."""

  def batch(x: Any) -> bool:
    while is_tracer(x):
      if type(x).__name__ == "BatchTracer":
        return True
      x = getattr(x, "primal", getattr(x, "val", None))
    return False

  return any(batch(x) for x in jax.tree.leaves(tree))


@functools.cache
def custom_partitioning():
  """``jax.experimental.custom_partitioning.custom_partitioning``."""
  from jax.experimental import custom_partitioning as cp_lib

  return cp_lib.custom_partitioning


@functools.cache
def pallas():
  """The ``jax.experimental.pallas`` module (imported on first use)."""
  from jax.experimental import pallas as pl

  return pl


@functools.cache
def pallas_tpu():
  """``jax.experimental.pallas.tpu`` (Mosaic TPU; its interpreter runs on CPU)."""
  from jax.experimental.pallas import tpu as pltpu

  return pltpu


def has_mosaic_gpu() -> bool:
  """Whether this jax has Mosaic GPU's public Pallas API and its interpreter.

  The API the kernels use and ``plgpu.InterpretGPUParams`` are public in jax
  0.11.2 (the line of the GPU image measured) and 0.12; 0.10.x keeps only the
  Triton backend usable from this package.
  """
  try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
  except ImportError:  # a jaxlib built without it
    return False
  return JAX_VERSION >= (0, 11, 2) and hasattr(plgpu, "InterpretGPUParams")


@functools.cache
def pallas_mosaic_gpu():
  """``jax.experimental.pallas.mosaic_gpu`` (jax >= 0.11.2: :func:`has_mosaic_gpu`)."""
  if not has_mosaic_gpu():
    raise ValueError(
      "the Mosaic GPU kernel and its interpreter (interpret='gpu') need jax >= 0.11.2"
      f" (jax.experimental.pallas.mosaic_gpu.InterpretGPUParams); jax {jax.__version__}"
      " is installed. Use interpret='tpu' or True, or upgrade jax."
    )
  from jax.experimental.pallas import mosaic_gpu as plgpu

  return plgpu


@functools.cache
def pallas_triton():
  """``jax.experimental.pallas.triton`` (Triton's masked loads and stores)."""
  from jax.experimental.pallas import triton as plt

  return plt


def triton_compiler_params(num_warps: int) -> Any:
  """Compiler params of the Pallas Triton backend (needs a GPU-enabled jaxlib)."""
  from jax.experimental.pallas import triton as plgpu

  return plgpu.CompilerParams(num_warps=num_warps)


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
  if not is_tracer(x) and not is_tracer(y) and hasattr(x, "sharding"):
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


def _manual_axes() -> tuple[str, ...]:
  """The mesh axes of the enclosing ``jax.shard_map`` (empty outside one)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  manual = jax.sharding.AxisType.Manual
  return tuple(
    n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == manual
  )


def _varying_aval(aval: Any) -> frozenset:
  """The manual mesh axes along which a value varies (its type inside shard_map):
  ``aval.mat.varying`` in JAX 0.10 and 0.12, ``aval.vma`` before."""
  mat = getattr(aval, "mat", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def varying(x: jax.Array) -> frozenset:
  """The manual mesh axes along which ``x`` varies (empty outside ``shard_map``)."""
  return _varying_aval(jax.typeof(x))


def vary_along(x: jax.Array, axes: Any) -> jax.Array:
  """``x`` cast to vary along those of the manual mesh ``axes`` (inside
  ``jax.shard_map``) along which it does not vary yet; elsewhere ``x``."""
  missing = tuple(a for a in _manual_axes() if a in axes and a not in varying(x))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def varying_like_body(body: Any, carry: Any) -> Any:
  """``carry`` cast to vary along every manual mesh axis along which ``body(carry)``
  varies, so that a loop over ``body`` keeps its carry's type.

  Inside ``jax.shard_map`` a loop's carry must have the same type before and after
  its body, and a carry that starts as a constant (a zero count, ``False``) becomes
  varying once the body mixes in the local shard's values. Outside ``shard_map``
  ``carry`` is returned as it is, and nothing is traced.
  """
  return typed_carry(body, carry)[0]


def typed_carry(body: Any, carry: Any) -> tuple[Any, tuple[Any, Any] | None]:
  """``(carry, traced)``: the carry of :func:`varying_like_body`, and inside
  ``jax.shard_map`` the trace of ``body`` on it that found its types
  (``jax.make_jaxpr(body, return_shape=True)(carry)``, for :func:`replay` and
  :func:`hoist_closure`), else None."""
  if not _manual_axes():
    return carry, None
  for _ in range(len(jax.tree.leaves(carry)) + 1):  # each pass adds an axis or stops
    traced = jax.make_jaxpr(body, return_shape=True)(carry)
    out = traced[0].out_avals
    leaves, treedef = jax.tree.flatten(carry)
    if len(out) != len(leaves):
      return carry, traced
    cast = [vary_along(x, _varying_aval(y)) for x, y in zip(leaves, out, strict=True)]
    if all(c is x for c, x in zip(cast, leaves, strict=True)):
      return carry, traced
    carry = treedef.unflatten(cast)
  return carry, None


# Set while a typed transform's init types its state, and while a typed update
# runs: an init called there (an inner transform's, or a reset's initial values)
# is not typed again. Each typing traces an update, and nested typings multiply.
_UNTYPED = contextvars.ContextVar("magma_optax_untyped", default=False)


def typed(init_fn: Any, update_fn: Any, *, param_mask: bool = False) -> tuple[Any, Any]:
  """``(init, update)``: ``init_fn`` whose state, inside ``jax.shard_map``, has
  the types that ``update_fn`` gives it back, and ``update_fn``.

  Inside ``shard_map`` a state leaf built from constants (a zero count, a score,
  ``False``) is typed as the same on every shard, and an update that mixes in the
  shard's gradient returns it typed as varying along the manual mesh axes; a loop
  over steps (``lax.scan``), ``optax.MultiSteps`` and ``optax.apply_if_finite`` then
  fail, since their carry or branches must keep one type. Here the initial state
  is cast to the types of one traced update (gradients typed like the parameters,
  with ``param_mask`` a mask typed like them), as ``optax.adam``'s ``zeros_like``
  moments are. Values do not change. Only the outermost transform types its state
  (which holds its inner ones'). Outside ``shard_map`` this is ``init_fn`` and
  nothing more is traced; an update that cannot be traced from ``params`` alone
  (it needs other extra args) leaves the state as ``init_fn`` built it.
  """

  def untyped(fn: Any, *args: Any, **kwargs: Any) -> Any:
    token = _UNTYPED.set(True)
    try:
      return fn(*args, **kwargs)
    finally:
      _UNTYPED.reset(token)

  def typed_init(params: Any) -> Any:
    state = init_fn(params)
    extra = {}
    if param_mask:
      extra["param_mask"] = jax.tree.map(lambda p: p == p, params)

    def step(s: Any) -> Any:
      return update_fn(params, s, params, **extra)[1]

    try:
      return varying_like_body(step, state)
    except Exception:  # noqa: BLE001 - only the types are sought; see above
      return state

  def init(params: Any) -> Any:
    if _UNTYPED.get() or not _manual_axes():
      return init_fn(params)
    return untyped(typed_init, params)

  def update(*args: Any, **kwargs: Any) -> Any:
    if _UNTYPED.get() or not _manual_axes():
      return update_fn(*args, **kwargs)
    return untyped(update_fn, *args, **kwargs)

  return init, update


def while_loop(cond_fun: Any, body_fun: Any, init: Any) -> Any:
  """``jax.lax.while_loop``, also inside ``jax.shard_map`` where the body makes a
  constant initial carry vary (:func:`varying_like_body`)."""
  init, traced = typed_carry(body_fun, init)
  if traced is not None:  # the body as traced for its types, not traced again
    body_fun = replay(traced)
  return jax.lax.while_loop(cond_fun, body_fun, init)


def fori_loop(lower: int, upper: Any, body_fun: Any, init: Any) -> Any:
  """``jax.lax.fori_loop``, also inside ``jax.shard_map`` (as :func:`while_loop`)."""
  init = varying_like_body(lambda c: body_fun(jnp.int32(lower), c), init)
  return jax.lax.fori_loop(lower, upper, body_fun, init)


def _same_types(funs: list[Any], operands: tuple[Any, ...]) -> list[Any]:
  """``funs`` (each called on ``operands``), inside ``jax.shard_map`` each cast to
  vary along the manual mesh axes along which any of them varies, output by output,
  and traced once (for the types, then replayed); elsewhere ``funs``."""
  if not _manual_axes():
    return funs
  traced = [jax.make_jaxpr(f, return_shape=True)(*operands) for f in funs]
  outs = [closed.out_avals for closed, _ in traced]
  union = [
    frozenset().union(*map(_varying_aval, avals)) for avals in zip(*outs, strict=True)
  ]

  def cast(fun):
    def branch(*args):
      leaves, treedef = jax.tree.flatten(fun(*args))
      return treedef.unflatten(
        [vary_along(x, u) for x, u in zip(leaves, union, strict=True)]
      )

    return branch

  return [cast(replay(t)) for t in traced]


def cond(pred: Any, true_fun: Any, false_fun: Any, *operands: Any) -> Any:
  """``jax.lax.cond``, also inside ``jax.shard_map`` where one branch's output varies
  along a manual mesh axis and the other's does not (a constant): both are then
  cast to vary along the axes of either. Outside ``shard_map``, ``lax.cond``."""
  true_fun, false_fun = _same_types([true_fun, false_fun], operands)
  return jax.lax.cond(pred, true_fun, false_fun, *operands)


def platform_dependent(*operands: Any, default: Any, **per_platform: Any) -> Any:
  """``per_platform[p](*operands)`` for the platform ``p`` the step is lowered for
  (``cpu``, ``cuda``, ``rocm``, ``tpu``), else ``default(*operands)``:
  ``jax.lax.platform_dependent``, chosen at lowering time (the program holds the
  one branch, in a ``case`` on a constant that XLA folds: no branch on the
  device), also inside ``jax.shard_map`` (as :func:`cond`)."""
  names = list(per_platform)
  funs = _same_types([per_platform[n] for n in names] + [default], operands)
  chosen = dict(zip(names, funs[:-1], strict=True))
  return jax.lax.platform_dependent(*operands, default=funs[-1], **chosen)


@functools.cache
def _unavailable_p() -> Any:
  """The primitive of :func:`unavailable`: the identity for every transformation,
  but its lowering and its eager evaluation raise ``ValueError(message)``. Linear
  (its tangents and cotangents go through it too, so no derivative skips the
  error) and batched as the identity."""
  from jax.interpreters import ad
  from jax.interpreters import batching
  from jax.interpreters import mlir

  p = jax.extend.core.Primitive("magma_optax_unavailable")
  p.multiple_results = True
  p.def_abstract_eval(lambda *avals, message: avals)

  def fail(*args, message):
    del args
    raise ValueError(message)

  p.def_impl(fail)  # run eagerly (platform_dependent picks its branch at once)

  def jvp(primals, tangents, message):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return p.bind(*primals, message=message), p.bind(*tangents, message=message)

  def transpose(cts, *args, message):
    del args
    return p.bind(*[ad.instantiate_zeros(t) for t in cts], message=message)

  mlir.register_lowering(p, fail)
  batching.primitive_batchers[p] = lambda args, dims, message: (
    p.bind(*args, message=message),
    dims,
  )
  ad.primitive_jvps[p] = jvp
  ad.primitive_transposes[p] = transpose
  return p


def unavailable(tree: Any, message: str) -> Any:
  """``tree`` (arrays), in a program that cannot be lowered: lowering it raises
  ``ValueError(message)``. For the branch of :func:`platform_dependent` of a
  platform where what was asked for cannot run: the request fails when the step
  is lowered for that platform, and only then."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef.unflatten(_unavailable_p().bind(*leaves, message=message))
