"""benchmarks/gpu_check.py must work the first time a GPU is lent (a short device
budget leaves no room for a crash): ``--smoke`` runs every section of it on CPU, the
Pallas kernels interpreted at tiny sizes, the torch peers' subprocess against a
stand-in ``torch`` (numpy inside, written here: CI has no torch); the trace parser
(``benchmarks/trace_stats.py``, stdlib only) is checked on small synthetic traces of
both formats it reads, with known counts.
"""

from __future__ import annotations

import gzip
import importlib
import json
import os
import pathlib
import sys
import textwrap

import pytest

from magma_optax._core import compat as _compat

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"

# The device machines run jax 0.11 or newer, so the smoke run is checked on that
# line (CI line 2); on the older line it would cost ~30 s of the 2-core budget for
# a configuration no device runs. The parser tests run on both.
newest_jax = pytest.mark.skipif(
  _compat.JAX_VERSION < (0, 11),
  reason="the device check runs on the newest jax line, as on the device machines",
)


@pytest.fixture
def bench(monkeypatch):
  """Imports a script of benchmarks/ (they import each other) and forgets them."""
  monkeypatch.syspath_prepend(str(_BENCH))
  names = ("gpu_check", "step_overhead", "trace_stats")
  try:
    yield importlib.import_module
  finally:
    for name in names:
      sys.modules.pop(name, None)


# ---------------------------------------------------------------- trace parser


def _x(pid, tid, ts, dur, name, **extra):
  return {
    "ph": "X",
    "pid": pid,
    "tid": tid,
    "ts": ts,
    "dur": dur,
    "name": name,
    **extra,
  }


def _meta(kind, pid, name, tid=None):
  e = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
  if tid is not None:
    e["tid"] = tid
  return e


def _jax_trace():
  """jax's layout: a GPU process with stream lines and derived lines, a host
  process with the annotations. Row r0 runs 2 steps in [0, 100]: kernels of 10,
  10 (overlapping the first by 5) and 25 us, a device-to-host copy of 4 us, and an
  event on the derived "XLA Ops" line; row r1 one step in [200, 300] with one
  kernel; one kernel at 150 lies outside both."""
  gpu, host = 1, 701
  return [
    _meta("process_name", gpu, "/device:GPU:0"),
    _meta("process_name", host, "/host:CPU"),
    _meta("thread_name", gpu, "Stream #13(Compute)", 13),
    _meta("thread_name", gpu, "Stream #14(MemcpyD2H)", 14),
    _meta("thread_name", gpu, "XLA Ops", 10001),
    _meta("thread_name", host, "python", 5),
    _x(host, 5, 0.0, 100.0, "gpucheck", args={"row": "r0", "steps": "2"}),
    _x(host, 5, 200.0, 100.0, "gpucheck", args={"row": "r1", "steps": "1"}),
    _x(host, 5, 10.0, 5.0, "PjitFunction(step)"),  # host work: not device
    _x(gpu, 13, 10.0, 10.0, "loop_add_fusion"),
    _x(gpu, 13, 15.0, 10.0, "loop_add_fusion"),
    _x(gpu, 13, 40.0, 25.0, "input_reduce_fusion"),
    _x(gpu, 14, 70.0, 4.0, "MemcpyD2H", args={"memcpy_details": "kind:DtoH"}),
    _x(gpu, 10001, 10.0, 50.0, "fusion.3"),  # derived: not counted
    _x(gpu, 13, 150.0, 1.0, "stray_kernel"),  # outside the windows
    _x(gpu, 13, 250.0, 8.0, "loop_multiply_fusion"),
  ]


def test_trace_stats_counts_jax_trace(bench, tmp_path):
  ts = bench("trace_stats")
  folder = tmp_path / "plugins" / "profile" / "run1"
  folder.mkdir(parents=True)
  with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"displayTimeUnit": "ns", "traceEvents": _jax_trace()}, f)
  path = ts.find_trace(tmp_path)
  assert path == folder / "perfetto_trace.json.gz"
  stats, seen = ts.row_stats(ts.load_events(path))
  assert set(stats) == {"r0", "r1"}
  r0 = stats["r0"]
  assert (r0.steps, r0.kernels, r0.copies, r0.d2h) == (2, 3, 1, 1)
  assert r0.kernel_us == pytest.approx(45.0)
  assert r0.copy_us == pytest.approx(4.0)
  assert r0.busy_us == pytest.approx(15.0 + 25.0 + 4.0)  # overlap counted once
  assert r0.span_us == pytest.approx(74.0 - 10.0)
  assert r0.top == [("input_reduce_fusion", 1, 25.0), ("loop_add_fusion", 2, 20.0)]
  p0 = r0.per_step()
  assert p0["kernels"] == 1.5 and p0["d2h"] == 0.5
  assert p0["kernel_ms"] == pytest.approx(0.0225)
  r1 = stats["r1"]
  assert (r1.steps, r1.kernels, r1.copies, r1.kernel_us) == (1, 1, 0, 8.0)
  assert seen["outside"] == 1 and seen["derived"] == 1
  assert seen["lines"] == ["Stream #13(Compute)", "Stream #14(MemcpyD2H)"]
  # Positive control for the line rule: name the derived line a stream and its
  # event is counted as a kernel of r0.
  events = _jax_trace()
  events[4] = _meta("thread_name", 1, "Stream #99", 10001)
  stats, seen = ts.row_stats(events)
  assert stats["r0"].kernels == 4 and seen["derived"] == 0
  # The annotation helper writes what the parser reads.
  name, kw = ts.jax_annotation("r7", 3)
  assert ts._window(_x(701, 5, 0, 1, name, args=kw)) == ("r7", 3)


def test_trace_stats_counts_torch_trace(bench, tmp_path):
  ts = bench("trace_stats")
  name = ts.torch_annotation("r0", 3)
  events = [
    _x(100, 1, 0.0, 90.0, name, cat="user_annotation"),
    _x(0, 7, 0.0, 90.0, name, cat="gpu_user_annotation"),  # neither window nor work
    _x(100, 1, 1.0, 2.0, "cudaLaunchKernel", cat="cuda_runtime"),
    _x(0, 7, 10.0, 5.0, "multi_tensor_apply_kernel", cat="kernel"),
    _x(0, 7, 20.0, 5.0, "multi_tensor_apply_kernel", cat="kernel"),
    _x(0, 7, 30.0, 3.0, "Memcpy DtoH (Device -> Pageable)", cat="gpu_memcpy"),
    _x(0, 7, 40.0, 1.0, "Memset (Device)", cat="gpu_memset"),
  ]
  path = tmp_path / "torch.json"
  path.write_text(json.dumps({"traceEvents": events}))
  assert ts.find_trace(path) == path
  stats, seen = ts.row_stats(ts.load_events(path))
  assert set(stats) == {"r0"}
  r0 = stats["r0"]
  assert (r0.steps, r0.kernels, r0.copies, r0.d2h) == (3, 2, 2, 1)
  assert r0.kernel_us == pytest.approx(10.0)
  assert seen["outside"] == 0


# ---------------------------------------------------------------- the smoke run

_FAKE_TORCH = {
  "torch/__init__.py": """
    import types
    import numpy as np
    from torch import profiler
    __version__ = "0.0+stand-in"

    class Tensor:
      def __init__(self, a):
        self.a = np.asarray(a, np.float32)
      def __mul__(self, x):
        return Tensor(self.a * x)

    class Generator:
      def __init__(self, device="cpu"):
        self.rng = np.random.default_rng(0)
      def manual_seed(self, seed):
        self.rng = np.random.default_rng(seed)
        return self

    def randn(*shape, generator, device):
      return Tensor(generator.rng.standard_normal(shape))

    class Parameter(Tensor):
      def __init__(self, t):
        super().__init__(t.a)
        self.grad = None

    class Adam:
      def __init__(self, params, lr, foreach=False, fused=False):
        self.params, self.lr = list(params), lr
        self.m = [np.zeros_like(p.a) for p in self.params]
      def step(self):
        for p, m in zip(self.params, self.m):
          m *= 0.9
          m += 0.1 * p.grad.a
          p.a -= self.lr * m

    nn = types.SimpleNamespace(Parameter=Parameter)
    optim = types.SimpleNamespace(Adam=Adam)
    cuda = types.SimpleNamespace(
      is_available=lambda: False, synchronize=lambda: None,
      get_device_name=lambda: "none", empty_cache=lambda: None)
  """,
  "torch/profiler.py": """
    import contextlib, json, time
    _events = []

    class ProfilerActivity:
      CPU, CUDA = "cpu", "cuda"

    @contextlib.contextmanager
    def record_function(name):
      t0 = time.perf_counter() * 1e6
      yield
      t1 = time.perf_counter() * 1e6
      _events.append({"ph": "X", "cat": "user_annotation", "name": name,
                      "ts": t0, "dur": t1 - t0, "pid": 1, "tid": 1})
      _events.append({"ph": "X", "cat": "kernel", "name": "stand_in_kernel",
                      "ts": (t0 + t1) / 2, "dur": 0.0, "pid": 0, "tid": 7})

    class profile:
      def __init__(self, activities):
        pass
      def __enter__(self):
        _events.clear()
        return self
      def __exit__(self, *exc):
        return False
      def export_chrome_trace(self, path):
        with open(path, "w") as f:
          json.dump({"traceEvents": list(_events)}, f)
  """,
  "magma/__init__.py": """
    class Magma:
      def __init__(self, optimizer, mask_prob, tau):
        self.optimizer = optimizer
      def step(self):
        self.optimizer.step()
  """,
}


@pytest.fixture
def fake_torch(tmp_path, monkeypatch):
  """A stand-in ``torch`` (and ``magma``) for the peers' subprocess only."""
  root = tmp_path / "fake_torch"
  for rel, text in _FAKE_TORCH.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(textwrap.dedent(text))
  monkeypatch.setenv(
    "PYTHONPATH", f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
  )
  return root


@pytest.fixture
def gpu_check(bench):
  return bench("gpu_check")


@newest_jax
def test_gpu_check_smoke_run_passes(gpu_check, fake_torch, tmp_path, capsys):
  out_dir = tmp_path / "out"
  assert gpu_check.main(["--smoke", "--out", str(out_dir)]) == 0
  out = capsys.readouterr().out
  lines = out.splitlines()
  assert "ALL CHECKS OK" in out
  checks = [
    x
    for x in lines
    if x.startswith(("kernel[", "adam_magma pallas", "top-k ", "tile kernel["))
  ]
  assert len(checks) >= len(gpu_check.SMOKE_CASES) + 3, checks
  assert all(x.endswith("OK") for x in checks), checks
  data = json.loads((out_dir / "gpu_check.json").read_text())
  assert (out_dir / "gpu_check.log").read_text().splitlines() == lines
  assert data["ok"] is True
  for name in gpu_check.SECTIONS:
    assert data["sections"][name]["status"] == "done", name
  # Each timed row has pipelined and blocked numbers and a profile entry: the
  # annotations the CPU run wrote were found by the parser.
  peers = data["sections"]["dense-peers"]
  for name in gpu_check.SMOKE_ROWS["dense-peers"]:
    if name.startswith("rollfast") and name not in peers["rows"]:
      assert "rollfast: skipped: not importable" in out
      continue
    row = peers["rows"][name]
    assert row["pipelined_ms"] > 0 and row["blocked_ms"] > 0, name
    assert peers["profile"][name]["steps"] == 1, name
  # The torch peers came back from the subprocess, with their profile.
  for name in ("torch Adam (foreach)", "torch Adam (fused)",
               "magma-optimizer(torch Adam fused)"):  # fmt: skip
    row = peers["rows"][name]
    assert row["unpaired"] and row["pipelined_ms"] > 0, name
    assert peers["profile"][name]["kernels"] == 1.0, name
  assert "| torch Adam (fused) |" in out
  sparse = data["sections"]["sparse-8m"]
  assert set(gpu_check.SMOKE_ROWS["sparse-8m"][:-1]) <= set(sparse["rows"])
  assert sparse["refresh"]["refresh, constant 0.5"]["adam_steps"] is not None
  whats = {t["what"] for t in data["targets"]}
  assert "magma(optax.adam), dense-peers, x optax.adam" in whats
  assert any(
    w.startswith("refresh, constant 0.5 at every=100, sparse-8m") for w in whats
  )
  assert "the Pallas kernel at 100 M, of the copy roofline" in whats
  assert all(t["verdict"] in ("met", "NOT met", "unmeasured") for t in data["targets"])


@newest_jax
def test_gpu_check_budget_skips_sections(gpu_check, tmp_path, capsys):
  assert gpu_check.main(["--smoke", "--budget-s", "0", "--no-torch"]) == 0
  out = capsys.readouterr().out
  for name in gpu_check.SECTIONS:
    assert f"# {name}: skipped: " in out, name
  assert "CHECKS NOT RUN" in out and "ALL CHECKS OK" not in out
