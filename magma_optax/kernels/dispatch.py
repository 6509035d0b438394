"""Which implementation of a fused kernel runs: names, interpreters, backends.

``implementation=`` is ``"xla"``, ``"pallas"`` or a sequence to try in order
(``None``: :data:`DEFAULT_IMPLEMENTATIONS`); :func:`resolve_implementation` picks the
first that can run here and explains why the others cannot. :func:`pallas_backend`
names the Pallas kernel for a platform or interpreter: ``"mosaic_tpu"``,
``"mosaic_gpu"`` or ``"triton"``, each a module of this package; :func:`by_platform`
picks it when the step is lowered (``jax.lax.platform_dependent``), so a Pallas step
traced on any machine lowers for a GPU or a TPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

from magma_optax._core import blocks as _blocks
from magma_optax._core import compat as _compat
from magma_optax._core import shard_map as _shard_map
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
      needed (jax >= 0.11.2).
  """
  if isinstance(interpret, bool):
    return interpret
  if isinstance(interpret, str) and interpret in ("tpu", "gpu"):
    if interpret == "gpu":
      _compat.pallas_mosaic_gpu()  # raises, naming the jax version needed
    return interpret
  raise ValueError(
    f"interpret must be False, True (the generic Pallas interpreter), 'tpu'"
    f" (the TPU interpreter) or 'gpu' (the Mosaic GPU interpreter, jax >= 0.11.2);"
    f" got {interpret!r}."
  )


def is_hopper(device: Any) -> bool:
  """Whether ``device`` is a Hopper-class NVIDIA GPU (sm_90: H100, H200, H800)."""
  capability = getattr(device, "compute_capability", None)
  if capability is not None:
    return str(capability).startswith("9.")
  kind = str(getattr(device, "device_kind", ""))
  return any(name in kind for name in ("H100", "H200", "H800", "H20", "GH200"))


def pallas_backend(interpret: bool | str = False, platform: str | None = None) -> str:
  """The kernel ``implementation="pallas"`` runs: see :data:`partitioned.BACKENDS`.

  ``"mosaic_tpu"`` with ``interpret="tpu"`` or for a TPU; ``"mosaic_gpu"`` with
  ``interpret="gpu"`` or for CUDA where a Hopper-class GPU is attached and jax >=
  :data:`MOSAIC_GPU_FROM`; ``"triton"`` otherwise (other GPUs, ROCm, older jax,
  the generic interpreter, and CUDA lowered on a machine without a GPU: Mosaic
  GPU's lowering is registered only where jax's CUDA plugin is installed).

  Args:
    interpret: as in :func:`magma_optax.kernels.masked_adam`.
    platform: the platform the step is lowered for (``"cuda"``, ``"rocm"``,
      ``"tpu"``); ``None``: the default backend's.
  """
  interpret = check_interpret(interpret)
  if interpret == "tpu":
    return "mosaic_tpu"
  if interpret == "gpu":
    return "mosaic_gpu"
  if interpret:
    return "triton"
  mosaic_gpu = _compat.has_mosaic_gpu() and _compat.JAX_VERSION >= MOSAIC_GPU_FROM
  if platform is None:
    backend = jax.default_backend()
    if backend == "tpu":
      return "mosaic_tpu"
    hopper = backend == "gpu" and is_hopper(jax.devices()[0])
    return "mosaic_gpu" if hopper and mosaic_gpu else "triton"
  if platform == "tpu":
    return "mosaic_tpu"
  if platform == "cuda" and mosaic_gpu and _hopper_attached():
    return "mosaic_gpu"
  return "triton"


# The jax line from which implementation="pallas" compiles the Mosaic GPU kernel
# for a Hopper GPU instead of Triton. Its Pallas API and interpreter are there from
# jax 0.11.2 (_compat.has_mosaic_gpu; benchmarks/gpu_check.py checks the kernel on
# a device from then on), but the compiled kernel has not run on a GPU yet: until
# it has, Triton stays the GPU kernel on jax 0.11.2.
MOSAIC_GPU_FROM = (0, 12)


def _hopper_attached() -> bool:
  """Whether this process has a CUDA backend whose first GPU is Hopper-class."""
  try:
    devices = jax.devices("cuda")
  except RuntimeError:  # no CUDA backend (no plugin, or no GPU)
    return False
  return bool(devices) and is_hopper(devices[0])


# The platforms with a Pallas kernel (jax.lax.platform_dependent's names).
KERNEL_PLATFORMS = ("cuda", "rocm", "tpu")


def by_platform(kernel: Callable[..., Any], off_device: Any, *operands: Any) -> Any:
  """``kernel(backend, *operands)`` with the backend of the platform the step is
  lowered for (:func:`pallas_backend`), chosen at lowering time: a Pallas step
  traced on any machine lowers for a GPU or a TPU. Every platform's branch is
  traced; a ``ValueError`` that one raises (tiles its kernel cannot take) is
  raised when the step is lowered for that platform.

  Args:
    kernel: ``kernel(backend, *operands)``, the step with that backend's kernel.
    off_device: ``"xla"`` (``off_device(*operands)`` is then computed by
      ``kernel(None, *operands)``: XLA where no kernel runs) or ``None`` (lowering
      for any other platform raises ``ValueError``, saying why).
    *operands: the arrays (pytrees) the step reads.
  """

  def on(platform, *args):
    try:
      return kernel(pallas_backend(platform=platform), *args)
    except ValueError as e:  # e.g. tiles this platform's kernel cannot take
      # Every branch is traced, whichever is lowered: the error is raised where
      # the step is lowered for this platform, and only there.
      return _compat.unavailable(kernel(None, *args), f"{platform}: {e}")

  branches = {
    platform: functools.partial(on, platform) for platform in KERNEL_PLATFORMS
  }

  def elsewhere(platform, *args):
    out = kernel(None, *args)  # XLA: the shapes, and the fallback's values
    if off_device == "xla":
      return out
    return _compat.unavailable(
      out,
      f"implementation='pallas' needs a GPU or a TPU, and this step is lowered for"
      f" {platform}; pass interpret=True, 'tpu' or 'gpu' to run a kernel in an"
      " interpreter (slow; for tests), implementation='xla', or"
      " implementation=('pallas', 'xla') for the kernel where one runs and XLA"
      " elsewhere",
    )

  return _shard_map.platform_dependent(
    *operands,
    cpu=functools.partial(elsewhere, "'cpu'"),
    default=functools.partial(elsewhere, "a platform without Pallas kernels"),
    **branches,
  )


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
  del interpret  # any: the kernel follows the platform the step is lowered for
  if not _rows.is_contiguous(layout):
    return (
      "the Pallas kernel needs contiguous mask blocks (granularity 'tensor', 'row'"
      f" or 'element'), but this leaf's blocks reduce axes {layout.reduce_axes}"
      f" of {layout.expanded_shape}"
    )
  return None


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


def off_device(implementation: str | Sequence[str] | None) -> str | None:
  """What runs instead of the Pallas kernel where none can (a step lowered for a
  CPU): ``"xla"`` where the request names it after ``"pallas"``, else ``None``
  (lowering there raises ``ValueError``)."""
  if implementation is None:
    order = DEFAULT_IMPLEMENTATIONS
  elif isinstance(implementation, str):
    order = (implementation,)
  else:
    order = tuple(implementation)
  rest = order[order.index("pallas") + 1 :] if "pallas" in order else ()
  return "xla" if "xla" in rest else None


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
