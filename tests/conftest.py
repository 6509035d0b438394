"""The suite compiles with LLVM at -O0 (XLA's HLO passes run as usual).

Most of a test's time on a CPU is XLA compiling small programs, and LLVM's
optimisation passes are a large part of that: at -O0 the suite took 711 s instead
of 918 s on jax 0.10.2 (2-core AMD EPYC, 2026-12-03). What the tests check -- values
against references, the optimized HLO (copies, fusions, buffers), sharding --
does not depend on LLVM's level. A test whose subject is the machine code LLVM
makes (a fused multiply-add breaking a tie, a masked store) is marked
``@pytest.mark.machine_code``: it runs in a subprocess at the default level (one
subprocess for a module's marked tests, started by the first of them). A
user's own ``XLA_FLAGS`` are kept; ``MAGMA_TEST_LLVM_O0=0`` runs everything at the
default level.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from xml.etree import ElementTree

import pytest

_O0 = "--xla_backend_optimization_level=0"
_IN_SUBPROCESS = "MAGMA_TEST_MACHINE_CODE"

if os.environ.get("MAGMA_TEST_LLVM_O0", "1") != "0" and not os.environ.get(
  _IN_SUBPROCESS
):
  # Set before any test imports jax (it reads XLA_FLAGS when its CPU backend starts).
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_O0}".strip()


_CACHE = "MAGMA_TEST_COMPILATION_CACHE"


def _share_compilations(config):
  """One persistent compilation cache (jax's own) for the processes of one pytest
  run: both pytest-xdist workers and the machine-code subprocesses compile many of
  the same small programs (the eager ops of ``init``, the same steps in several
  modules). The controller makes the folder, the workers inherit its name, and it
  is removed when the run ends; ``MAGMA_TEST_COMPILATION_CACHE=0`` switches it off.
  Every compile is stored (no minimum time or size). What a compile produces does
  not change, only where it comes from; a test that counts compiles counts the
  cache's hits as compiles too."""
  folder = os.environ.get(_CACHE)
  if folder == "0":
    return
  if not folder:  # the controller (or a run without xdist)
    folder = tempfile.mkdtemp(prefix="magma_test_compilations_")
    os.environ[_CACHE] = folder
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
  import jax

  jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_configure(config):
  _share_compilations(config)
  config.addinivalue_line(
    "markers",
    "machine_code: checks the machine code LLVM makes; runs in a subprocess at the"
    " default optimisation level (tests/conftest.py)",
  )


_MACHINE_CODE_RUNS: dict[str, dict[str, tuple[str, str]]] = {}


def _run_at_default_level(items) -> dict[str, tuple[str, str]]:
  """Runs ``items`` (one module's machine-code tests) in one pytest subprocess at
  LLVM's default level: per test name, its outcome and message (from a JUnit XML
  report), so that the module's tests share one interpreter start."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = env["XLA_FLAGS"].replace(_O0, "").strip()
  env[_IN_SUBPROCESS] = "1"
  with tempfile.TemporaryDirectory() as tmp:
    report = os.path.join(tmp, "report.xml")
    done = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
       f"--junitxml={report}", *(item.nodeid for item in items)],
      cwd=str(items[0].config.rootpath), env=env, capture_output=True, text=True,
      timeout=600,
    )  # fmt: skip
    cases = (
      ElementTree.parse(report).getroot().iter("testcase")
      if os.path.exists(report)
      else ()
    )
    results = {}
    for case in cases:
      outcome, text = "passed", ""
      for child in case:
        if child.tag in ("failure", "error", "skipped"):
          outcome = child.tag
          text = f"{child.get('message', '')}\n{child.text or ''}"
      results[case.get("name")] = (outcome, text)
  log = f"{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
  return {item.name: results.get(item.name, ("missing", log)) for item in items}


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  if pyfuncitem.get_closest_marker("machine_code") is None:
    return None
  if _O0 not in os.environ.get("XLA_FLAGS", ""):
    return None  # already at the default level: run here
  module = pyfuncitem.nodeid.split("::")[0]
  if pyfuncitem.name not in _MACHINE_CODE_RUNS.get(module, {}):
    same = [
      item
      for item in pyfuncitem.session.items
      if item.nodeid.split("::")[0] == module
      and item.get_closest_marker("machine_code") is not None
    ]
    if len({item.name for item in same}) != len(same):  # names not unique: alone
      same = [pyfuncitem]
    _MACHINE_CODE_RUNS.setdefault(module, {}).update(_run_at_default_level(same))
  outcome, text = _MACHINE_CODE_RUNS[module].pop(pyfuncitem.name)
  if outcome == "skipped":
    pytest.skip(f"at LLVM's default level (subprocess): {text}")
  if outcome != "passed":
    pytest.fail(
      f"{pyfuncitem.nodeid} at LLVM's default level (subprocess), {outcome}:\n{text}",
      pytrace=False,
    )
  return True
