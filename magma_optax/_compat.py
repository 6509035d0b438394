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


def differentiated(tree: Any) -> bool:
  """Whether some leaf of ``tree`` carries a tangent (``jax.grad``, ``jax.vjp``,
  ``jax.jvp``, also under ``vmap``): by the tracer types' names, which jax does
  not promise (``LinearizeTracer``, ``JVPTracer``; a ``BatchTracer`` is looked
  into). For code that must pick a reverse-differentiable form."""

  def tangent(x: Any) -> bool:
    while is_tracer(x):
      if type(x).__name__ in ("LinearizeTracer", "JVPTracer"):
        return True
      x = getattr(x, "val", None)  # BatchTracer wraps the traced value
    return False

  return any(tangent(x) for x in jax.tree.leaves(tree))


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

  ``plgpu.InterpretGPUParams`` became public in jax 0.12; older lines (0.10.x)
  keep only the Triton backend usable from this package.
  """
  try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
  except ImportError:  # a jaxlib built without it
    return False
  return JAX_VERSION >= (0, 12) and hasattr(plgpu, "InterpretGPUParams")


@functools.cache
def pallas_mosaic_gpu():
  """``jax.experimental.pallas.mosaic_gpu`` (jax >= 0.12: :func:`has_mosaic_gpu`)."""
  if not has_mosaic_gpu():
    raise ValueError(
      "the Mosaic GPU kernel and its interpreter (interpret='gpu') need jax >= 0.12"
      f" (jax.experimental.pallas.mosaic_gpu.InterpretGPUParams); jax {jax.__version__}"
      " is installed. Use interpret='tpu' or True, or upgrade jax."
    )
  from jax.experimental.pallas import mosaic_gpu as plgpu

  return plgpu


def triton_compiler_params(num_warps: int) -> Any:
  """Compiler params of the Pallas Triton backend (needs a GPU-enabled jaxlib)."""
  from jax.experimental.pallas import triton as plgpu

  return plgpu.CompilerParams(num_warps=num_warps)
