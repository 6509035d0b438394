"""Which implementation of a fused kernel runs: names, interpreters, backends.

``implementation=`` is ``"xla"``, ``"pallas"`` or a sequence to try in order
(``None``: :data:`DEFAULT_IMPLEMENTATIONS`); :func:`resolve_implementation` picks the
first that can run here and explains why the others cannot. :func:`pallas_backend`
names the Pallas kernel for the device or interpreter: ``"mosaic_tpu"``,
``"mosaic_gpu"`` or ``"triton"``, each a module of this package.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

from magma_optax._core import blocks as _blocks
from magma_optax._core import compat as _compat
from magma_optax.kernels import rows as _rows

IMPLEMENTATIONS = ("xla", "pallas")


INTERPRETERS = (False, True, "tpu", "gpu")


# Tried in order when implementation=None. XLA only until benchmarks/gpu_check.py and
# benchmarks/tpu_check.py have measured the Pallas kernels on a real GPU / TPU: a
# default must never be the first place an unverified kernel compiles. Ask for
# "pallas" explicitly to use one.
DEFAULT_IMPLEMENTATIONS = ("xla",)


def check_interpret(interpret: Any) -> bool | str:
  """``interpret`` if it is one of :data:`INTERPRETERS` this jax can run.

  Raises:
    ValueError: for any other value, naming the argument and the valid ones; for
      ``"gpu"`` on a jax without Mosaic GPU's interpreter, naming the version
      needed (jax >= 0.12).
  """
  if isinstance(interpret, bool):
    return interpret
  if isinstance(interpret, str) and interpret in ("tpu", "gpu"):
    if interpret == "gpu":
      _compat.pallas_mosaic_gpu()  # raises, naming the jax version needed
    return interpret
  raise ValueError(
    f"interpret must be False, True (the generic Pallas interpreter), 'tpu'"
    f" (the TPU interpreter) or 'gpu' (the Mosaic GPU interpreter, jax >= 0.12);"
    f" got {interpret!r}."
  )


def is_hopper(device: Any) -> bool:
  """Whether ``device`` is a Hopper-class NVIDIA GPU (sm_90: H100, H200, H800)."""
  capability = getattr(device, "compute_capability", None)
  if capability is not None:
    return str(capability).startswith("9.")
  kind = str(getattr(device, "device_kind", ""))
  return any(name in kind for name in ("H100", "H200", "H800", "H20", "GH200"))


def pallas_backend(interpret: bool | str = False) -> str:
  """The kernel ``implementation="pallas"`` runs: see :data:`partitioned.BACKENDS`.

  ``"mosaic_tpu"`` on a TPU or with ``interpret="tpu"``; ``"mosaic_gpu"`` with
  ``interpret="gpu"`` or on a Hopper-class GPU with jax >= 0.12; ``"triton"``
  otherwise (other GPUs, jax < 0.12, and the generic interpreter).
  """
  interpret = check_interpret(interpret)
  if interpret == "tpu":
    return "mosaic_tpu"
  if interpret == "gpu":
    return "mosaic_gpu"
  if interpret:
    return "triton"
  backend = jax.default_backend()
  if backend == "tpu":
    return "mosaic_tpu"
  if backend == "gpu" and _compat.has_mosaic_gpu() and is_hopper(jax.devices()[0]):
    return "mosaic_gpu"
  return "triton"


def device_reason(interpret: bool | str = False) -> str | None:
  """``None`` if a Pallas kernel can run here (a GPU, a TPU, or an interpreter)."""
  if interpret or jax.default_backend() in ("gpu", "tpu"):
    return None
  return (
    f"Pallas kernels need a GPU or a TPU, and the default backend is"
    f" {jax.default_backend()!r}; pass interpret=True, 'tpu' or 'gpu' to run a"
    " kernel in an interpreter (slow; for tests) or use implementation='xla'"
  )


def check_implementation(implementation: str) -> None:
  """Raises ``ValueError`` unless ``implementation`` is one of the names."""
  if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation must be one of {IMPLEMENTATIONS}, a sequence of them, or"
      f" None; got {implementation!r}."
    )


def why_unavailable(
  implementation: str,
  *,
  layout: _blocks.BlockLayout,
  interpret: bool | str = False,
) -> str | None:
  """``None`` if ``implementation`` can run here, else the reason it cannot."""
  check_implementation(implementation)
  if implementation == "xla":
    return None
  if not _rows.is_contiguous(layout):
    return (
      "the Pallas kernel needs contiguous mask blocks (granularity 'tensor', 'row'"
      f" or 'element'), but this leaf's blocks reduce axes {layout.reduce_axes}"
      f" of {layout.expanded_shape}"
    )
  return device_reason(interpret)


def first_available(
  implementation: str | Sequence[str] | None,
  why: Callable[[str], str | None],
) -> str:
  """The first of ``implementation`` (``None``: the defaults) for which ``why``
  gives no reason; else ``ValueError`` with every reason."""
  if implementation is None:
    order = DEFAULT_IMPLEMENTATIONS
  elif isinstance(implementation, str):
    order = (implementation,)
  elif isinstance(implementation, Sequence):
    order = tuple(implementation)
    if not order:
      raise ValueError("implementation must not be an empty sequence.")
  else:
    order = (implementation,)  # not a name: check_implementation says so
  for impl in order:  # every entry is checked, not only those before a hit
    check_implementation(impl)
  reasons = []
  for impl in order:
    reason = why(impl)
    if reason is None:
      return impl
    reasons.append(f"{impl!r}: {reason}")
  raise ValueError(
    f"implementation={implementation!r} cannot run here: " + "; ".join(reasons) + "."
  )


def resolve_implementation(
  implementation: str | Sequence[str] | None,
  *,
  layout: _blocks.BlockLayout,
  interpret: bool | str = False,
) -> str:
  """The implementation that will run: the first of ``implementation`` that can.

  Raises:
    ValueError: if an explicitly requested implementation (or every one of a
      requested sequence) cannot run here, naming why; if ``interpret`` is not
      valid here (:func:`check_interpret`).
  """
  interpret = check_interpret(interpret)
  return first_available(
    implementation,
    lambda impl: why_unavailable(impl, layout=layout, interpret=interpret),
  )
