"""benchmarks/gpu_check.py must work the first time a GPU is lent (a short device
budget leaves no room for a crash): ``--smoke`` runs every code path of it on CPU,
the Pallas kernel interpreted at tiny sizes, and must pass its own correctness checks.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


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
  checks = [
    x for x in lines if x.startswith(("kernel (", "adam_magma pallas", "top-k "))
  ]
  assert len(checks) == len(module.SMOKE_CASES) + 1 + 3  # kernels, optimizer, top-k
  assert all(x.endswith("OK") for x in checks), checks
  assert "ALL CHECKS OK" in out
  assert "| adam_magma[xla] |" in out
  assert "| sparse_state compact, density 0.5 |" in out
  assert "| ramp 0.1 -> 0.5 |" in out
