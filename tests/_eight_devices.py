"""Runs a test script on 8 forced CPU devices, in a subprocess.

The device count is fixed when jax starts, so multi-device tests run their script in
a fresh interpreter with ``--xla_force_host_platform_device_count=8``; the script
prints one JSON line last, which is returned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run(script: str) -> dict:
  """The JSON object the last output line of ``script`` prints (8 CPU devices)."""
  # The run's own flags are kept (the suite's LLVM -O0, see tests/conftest.py).
  flags = os.environ.get("XLA_FLAGS", "")
  env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8")
  env["JAX_PLATFORMS"] = "cpu"
  res = subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True,
    timeout=600,
  )  # fmt: skip
  assert res.returncode == 0, res.stderr[-3000:]
  return json.loads(res.stdout.strip().splitlines()[-1])
