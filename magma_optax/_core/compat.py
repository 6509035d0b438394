"""The one place that touches JAX APIs outside its compatibility policy.

JAX promises stability for ``jax.*`` public APIs, not for ``jax.core``, for
``jax.experimental`` or for Pallas (jax's own docs call all of them experimental).
Everything the package needs from them is reached through this module, so a move
between jax versions (we support 0.10.2, the last release for Python 3.11, to the
newest) is fixed here once. Imports of Pallas are lazy: ``import magma_optax`` does
not load Pallas, which only the kernels' Pallas path needs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.extend

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
  0.11.2 and 0.12; 0.10.x keeps only the Triton backend usable from this package.
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
  ``ValueError(message)``. For the branch of ``jax.lax.platform_dependent`` of a
  platform where what was asked for cannot run: the request fails when the step
  is lowered for that platform, and only then."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef.unflatten(_unavailable_p().bind(*leaves, message=message))
