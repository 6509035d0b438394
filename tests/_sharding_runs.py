"""Shared by test_sharding.py and test_multihost.py: one 8-device run, one reference.

The worker (tests/_sharding_worker.py) runs once per pytest session in two
subprocesses side by side: on 8 forced CPU devices (sharded) and on one device (the
reference). Cached here, so the two test modules share them.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile

import _sharding_worker as worker
import numpy as np

try:
  import fcntl  # POSIX: the lock that lets xdist workers share one run
except ImportError:  # elsewhere each worker process runs its own
  fcntl = None

WORKER = os.path.join(os.path.dirname(__file__), "_sharding_worker.py")


@functools.cache
def sharded_results() -> tuple[dict, str]:
  """Runs the worker on 8 forced CPU devices and, side by side, on one device.

  Once per pytest run: under pytest-xdist the test modules that use it may run in
  different worker processes, which share one output directory (named by the run's
  ``PYTEST_XDIST_TESTRUNUID``); the first to take its lock runs the worker, the
  others wait and read its results.

  Returns (the 8-device report, output dir).
  """
  run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
  if run_id is None or fcntl is None:
    out_dir = tempfile.mkdtemp(prefix="magma_sharding_")
  else:
    out_dir = os.path.join(tempfile.gettempdir(), f"magma_sharding_{run_id}")
    os.makedirs(out_dir, exist_ok=True)
  # xdist workers live until the whole run ends, so no reader is left behind.
  atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
  report = os.path.join(out_dir, "report.json")
  with open(os.path.join(out_dir, ".lock"), "w") as lock:
    if fcntl is not None:
      fcntl.flock(lock, fcntl.LOCK_EX)
    if not os.path.exists(report):
      _run_worker(out_dir)
  with open(report) as f:
    return json.load(f), out_dir


def _run_worker(out_dir: str) -> None:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  procs = [
    subprocess.Popen(
      [sys.executable, WORKER, out_dir, str(devices)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for devices in (8, 1)
  ]
  for proc in procs:
    stdout, stderr = proc.communicate(timeout=600)
    if proc.returncode != 0:
      raise RuntimeError(f"sharding worker failed:\n{stdout}\n{stderr[-5000:]}")


def sharded_arrays(name: str) -> dict[str, np.ndarray]:
  """The arrays the worker saved for run ``name`` ("core", "sparse", ...)."""
  _, out_dir = sharded_results()
  with np.load(os.path.join(out_dir, f"{name}.npz")) as data:
    return dict(data)


@functools.cache
def reference(name: str) -> dict[str, np.ndarray]:
  """The same run on one device ("core", "sparse", "explicit" or "mlp")."""
  if name == "explicit":  # a subset of the core and sparse cases: filter those runs
    keep = tuple(f"['{case}']" for case in worker.EXPLICIT_CASES)
    sparse = reference("sparse") if worker.sparse_transforms() else {}
    tiles = reference("tiles") if worker.tile_transforms() else {}
    both = {**reference("core"), **sparse, **tiles}
    return {k: v for k, v in both.items() if any(c in k for c in keep)}
  _, out_dir = sharded_results()
  with np.load(os.path.join(out_dir, f"ref_{name}.npz")) as data:
    return dict(data)
