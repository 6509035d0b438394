"""Shared by test_sharding.py and test_multihost.py: one 8-device run, one reference.

The 8-device worker (tests/_sharding_worker.py) runs once per pytest session in a
subprocess; the same optimizers run here on the test process's single CPU device.
Both are cached, so the two test modules share them.
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

WORKER = os.path.join(os.path.dirname(__file__), "_sharding_worker.py")


@functools.cache
def sharded_results() -> tuple[dict, str]:
  """Runs the worker on 8 forced CPU devices; returns (report, output dir)."""
  out_dir = tempfile.mkdtemp(prefix="magma_sharding_")
  atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
    [sys.executable, WORKER, out_dir],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  if proc.returncode != 0:
    raise RuntimeError(f"sharding worker failed:\n{proc.stdout}\n{proc.stderr}")
  with open(os.path.join(out_dir, "report.json")) as f:
    return json.load(f), out_dir


def sharded_arrays(name: str) -> dict[str, np.ndarray]:
  """The arrays the worker saved for run ``name`` ("core", "sparse", ...)."""
  _, out_dir = sharded_results()
  with np.load(os.path.join(out_dir, f"{name}.npz")) as data:
    return dict(data)


@functools.cache
def reference(name: str) -> dict[str, np.ndarray]:
  """The same run on this process's single device, flattened like the worker's."""
  if name == "explicit":  # a subset of the core cases: filter the core run
    keep = tuple(f"['{case}']" for case in worker.EXPLICIT_CASES)
    return {k: v for k, v in reference("core").items() if any(c in k for c in keep)}
  cases = {"core": worker.core_transforms, "sparse": worker.sparse_transforms}[name]()
  params, state, masks, _, _ = worker.run(cases)
  return {
    **worker.flatten(params, "params"),
    **worker.flatten(state, "state"),
    **{"masks/" + k: v for k, v in masks.items()},
  }


@functools.cache
def reference_mlp() -> dict[str, np.ndarray]:
  """The data/model-parallel MLP of the worker, on one device."""
  import jax

  params, x, y, tx, step = worker.mlp_problem()
  state = tx.init(params)
  step = jax.jit(step)
  losses = []
  for _ in range(worker.STEPS):
    params, state, loss_value = step(params, state, x, y)
    losses.append(float(loss_value))
  return {
    **worker.flatten(params, "params"),
    **worker.flatten(state, "state"),
    "losses": np.array(losses),
  }
