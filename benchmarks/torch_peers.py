"""The torch peers of ``benchmarks/gpu_check.py``, run in a subprocess of it.

torch Adam (fused and foreach) and magma-optimizer's ``Magma`` around each (when
importable), on the leaf shapes ``gpu_check.py`` sends. Timed as there: interleaved
rounds (seeded shuffled order), each round ``steps`` steps enqueued with one
``synchronize`` at the end (pipelined) and ``blocked`` steps synchronized one by
one; then ``profile_steps`` steps of each row under ``torch.profiler``, the i-th row
inside a ``record_function`` named by ``trace_stats.torch_annotation`` with the
id ``r<i>`` (``profiled`` in the answer lists the rows in that order).

Protocol: one JSON line out when ready (``{"ready": ...}`` or ``{"error": ...}``),
then per JSON request line in (``{"cmd": "run", "shapes": [...], ...}``; ``{"cmd":
"quit"}`` ends) one JSON answer line out. Anything else it prints goes to stderr.

Usage (by hand)::

    echo '{"cmd": "run", "shapes": [[1024, 1024]], "rounds": 3, "steps": 10,
      "blocked": 3, "profile_steps": 0}' | python3 benchmarks/torch_peers.py
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import random
import statistics
import sys
import time

import trace_stats  # beside this file

FOREACH = "torch Adam (foreach)"


def _err(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _say(obj: dict, out) -> None:
  out.write(json.dumps(obj) + "\n")
  out.flush()


def makers(torch, magma_cls, device: str, shapes: list) -> dict:
  """``name -> () -> optimizer`` with parameters and gradients of ``shapes``."""

  def params():
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for shape in shapes:
      p = torch.nn.Parameter(torch.randn(*shape, generator=gen, device=device) * 0.02)
      p.grad = torch.randn(*shape, generator=gen, device=device) * 1e-3
      out.append(p)
    return out

  def adam(kind):
    return lambda: torch.optim.Adam(params(), lr=1e-3, **{kind: True})

  out = {FOREACH: adam("foreach"), "torch Adam (fused)": adam("fused")}
  if magma_cls is not None:
    for kind in ("foreach", "fused"):
      out[f"magma-optimizer(torch Adam {kind})"] = lambda kind=kind: magma_cls(
        adam(kind)(), mask_prob=0.5, tau=2.0
      )
  return out


def run(torch, magma_cls, device: str, req: dict) -> dict:
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  opts, errors = {}, {}
  for name, make in makers(torch, magma_cls, device, req["shapes"]).items():
    try:
      opt = make()
      for _ in range(3):  # state allocation, kernel selection
        opt.step()
      sync()
      opts[name] = opt
    except Exception as e:  # noqa: BLE001 -- report the row, time the others
      errors[name] = _err(e)
  times = {name: {"pipelined": [], "blocked": []} for name in opts}
  steps, blocked, rounds = req["steps"], req["blocked"], req["rounds"]
  start = time.perf_counter()
  k = 0
  while k < rounds:
    if k == 1 and req.get("timing_s"):  # as gpu_check.py: fit the time given
      fit = int(req["timing_s"] / max(time.perf_counter() - start, 1e-9))
      rounds = max(min(rounds, 3), min(rounds, fit))
    order = list(opts)
    random.Random(k).shuffle(order)
    for name in order:
      opt = opts[name]
      sync()
      t0 = time.perf_counter()
      for _ in range(steps):
        opt.step()
      sync()
      times[name]["pipelined"].append((time.perf_counter() - t0) / steps)
      each = []
      for _ in range(blocked):
        t0 = time.perf_counter()
        opt.step()
        sync()
        each.append(time.perf_counter() - t0)
      if each:
        times[name]["blocked"].append(statistics.median(each))
    k += 1
  rows = {}
  base = times.get(FOREACH)
  for name, t in times.items():
    row = {
      "pipelined_ms": statistics.median(t["pipelined"]) * 1e3,
      "blocked_ms": statistics.median(t["blocked"]) * 1e3 if t["blocked"] else None,
      "samples": t,
    }
    if base:
      for how in ("pipelined", "blocked"):
        pairs = list(zip(t[how], base[how], strict=True))
        row[f"x_foreach_{how}"] = (
          statistics.median(a / b for a, b in pairs) if pairs else None
        )
    rows[name] = row
  profiled = []
  if req.get("profile_steps") and req.get("trace"):
    try:
      profile(torch, device, opts, req["profile_steps"], req["trace"], sync)
      profiled = list(opts)
    except Exception as e:  # noqa: BLE001
      errors["torch profile"] = _err(e)
  opts.clear()
  if device == "cuda":
    torch.cuda.empty_cache()
  return {"rows": rows, "errors": errors, "profiled": profiled}


def profile(torch, device, opts, steps, path, sync) -> None:
  from torch.profiler import ProfilerActivity
  from torch.profiler import profile as torch_profile
  from torch.profiler import record_function

  activities = [ProfilerActivity.CPU]
  if device == "cuda":
    activities.append(ProfilerActivity.CUDA)
  with torch_profile(activities=activities) as prof:
    for i, opt in enumerate(opts.values()):
      with record_function(trace_stats.torch_annotation(f"r{i}", steps)):
        for _ in range(steps):
          opt.step()
        sync()
  prof.export_chrome_trace(path)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--device", default="cuda")
  args = parser.parse_args(argv)
  out = sys.stdout
  sys.stdout = sys.stderr  # only protocol lines on the real stdout
  try:
    import torch
  except Exception as e:  # noqa: BLE001
    _say({"error": f"not importable ({_err(e)})"}, out)
    return 0
  device = args.device
  if device == "cuda" and not torch.cuda.is_available():
    _say({"error": "torch sees no CUDA device"}, out)
    return 0
  skipped = {}
  try:
    from magma import Magma
  except Exception as e:  # noqa: BLE001
    Magma = None
    skipped["magma-optimizer"] = f"not importable ({_err(e)})"
  try:
    magma_version = importlib.metadata.version("magma-optimizer")
  except importlib.metadata.PackageNotFoundError:
    magma_version = "?"
  magma_version = magma_version if Magma else None
  name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
  _say(
    {"ready": True, "torch": torch.__version__, "device": name,
     "magma_optimizer": magma_version, "skipped": skipped},
    out,
  )  # fmt: skip
  for line in sys.stdin:
    line = line.strip()
    if not line:
      continue
    req = json.loads(line)
    if req.get("cmd") == "quit":
      break
    try:
      answer = run(torch, Magma, device, req)
    except Exception as e:  # noqa: BLE001
      answer = {"error": _err(e)}
    answer["skipped"] = skipped
    with contextlib.suppress(BrokenPipeError):
      _say(answer, out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
