"""benchmarks/gpu_check.py must work the first time a GPU is lent (a short device
budget leaves no room for a crash): ``--smoke`` runs every code path of it on CPU,
the Pallas kernels interpreted at tiny sizes (Triton in the generic interpreter,
Mosaic GPU in its own on jax >= 0.12), and must pass its own correctness checks.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from magma_optax._core import compat as _compat

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"

# The device machines (GPU included) run the newest jax, so the script is checked
# on that line (CI line 2); on the older line its smoke run would cost ~30 s of the
# suite's 2-core budget for a configuration no device runs.
pytestmark = pytest.mark.skipif(
  _compat.JAX_VERSION < (0, 11),
  reason="the device check runs on the newest jax line, as on the device machines",
)


def test_gpu_check_smoke_run_passes(capsys, monkeypatch):
  monkeypatch.syspath_prepend(str(_BENCH))  # gpu_check imports step_overhead
  spec = importlib.util.spec_from_file_location("gpu_check", _BENCH / "gpu_check.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  try:
    assert module.main(["--smoke"]) == 0
  finally:
    sys.modules.pop("step_overhead", None)
  out = capsys.readouterr().out
  lines = out.splitlines()
  backends = module.gpu_backends()  # Triton; Mosaic GPU on jax >= 0.12
  assert ("mosaic_gpu" in backends) == module._compat.has_mosaic_gpu()
  checks = [
    x for x in lines if x.startswith(("kernel[", "adam_magma pallas", "top-k "))
  ]
  want = len(module.SMOKE_CASES) * len(backends) + len(backends) + 3
  assert len(checks) == want, checks  # kernels, optimizer per backend, top-k
  for backend in backends:
    assert any(x.startswith(f"bandwidth[{backend}] ") for x in lines), backend
  assert all(x.endswith("OK") for x in checks), checks
  assert "ALL CHECKS OK" in out
  assert "| adam_magma[xla] |" in out
  assert "| sparse_state compact, density 0.5 |" in out
  assert "| ramp 0.1 -> 0.5 |" in out
