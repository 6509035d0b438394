"""benchmarks/tpu_check.py must work the first time a TPU is lent (a short device
budget leaves no room for a crash): ``--smoke`` runs every code path of it on CPU,
the Mosaic TPU kernel in the TPU interpreter at tiny sizes, and must pass its own
correctness checks.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from magma_optax._core import compat as _compat

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"

# The device machines (TPU included) run the newest jax, so the script is checked
# on that line (CI line 2); on the older line its smoke run would cost ~30 s of the
# suite's 2-core budget for a configuration no device runs.
pytestmark = pytest.mark.skipif(
  _compat.JAX_VERSION < (0, 11),
  reason="the device check runs on the newest jax line, as on the device machines",
)


def test_tpu_check_smoke_run_passes(capsys, monkeypatch):
  monkeypatch.syspath_prepend(str(_BENCH))  # tpu_check imports gpu_check
  spec = importlib.util.spec_from_file_location("tpu_check", _BENCH / "tpu_check.py")
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    assert module.main(["--smoke"]) == 0
  finally:
    for name in ("gpu_check", "step_overhead", "sparse_state"):
      sys.modules.pop(name, None)
  out = capsys.readouterr().out
  lines = out.splitlines()
  checks = [x for x in lines if x.startswith(("kernel[", "adam_magma pallas"))]
  assert len(checks) == len(module.SMOKE_CASES) + 1, checks  # kernels, optimizer
  assert all(x.endswith("OK") for x in checks), checks
  assert all("mosaic_tpu" in x for x in checks), checks  # the TPU kernel ran
  assert any(x.startswith("bandwidth[mosaic_tpu] ") for x in lines)
  assert "ALL CHECKS OK" in out
  assert "| adam_magma[xla] |" in out
