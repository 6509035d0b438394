"""Kernels and device time per step, read offline from a profiler trace (stdlib only).

``benchmarks/gpu_check.py`` runs a few steps of each configuration inside a host
annotation that names the row and the step count, blocks at its end, and parses the
trace afterwards with :func:`row_stats`. Two trace formats are read:

* jax's (``jax.profiler.trace(dir, create_perfetto_trace=True)`` writes
  ``plugins/profile/<run>/perfetto_trace.json.gz``): host annotations are events
  named ``gpucheck`` with args ``row`` and ``steps`` (:func:`jax_annotation`);
  device work is every event on a stream line (thread named ``Stream ...``) of a
  process named ``/device:...``; the other lines of a device (``XLA Ops``,
  ``XLA Modules``, ``Steps``, ...) are derived from the streams and not counted;
* torch's (``torch.profiler`` ``export_chrome_trace``): annotations are events
  named ``gpucheck/<steps>/<row>`` (:func:`torch_annotation`); device work is the
  events of category ``kernel``, ``gpu_memcpy`` and ``gpu_memset``.

A device event belongs to the annotation window that holds its midpoint (host and
device clocks are aligned by the profiler; a window ends after the block on the
last step, so all its device work lies inside). Copies and memsets are counted
apart from kernels; a device-to-host copy inside a step is a host round trip (an
XLA:GPU ``while`` or ``case`` reads its predicate back that way).

Usage::

    python3 benchmarks/trace_stats.py TRACE.json.gz   # or a jax log directory
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import gzip
import json
import pathlib
import re
import sys

ANNOTATION = "gpucheck"
_DEVICE_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "copy", "gpu_memset": "copy"}
_COPY = re.compile(r"memcpy|memset", re.IGNORECASE)
_D2H = re.compile(r"d2h|dtoh|device.?to.?host", re.IGNORECASE)


def jax_annotation(row: str, steps: int) -> tuple[str, dict]:
  """``(name, kwargs)`` for ``jax.profiler.TraceAnnotation(name, **kwargs)``.

  ``row`` is a short id: the profiler cuts argument values at ``,``, ``#`` and
  ``=`` (seen on jax 0.12: ``"a(b), c"`` came back as ``"a(b)"``)."""
  return ANNOTATION, {"row": row, "steps": str(steps)}


def torch_annotation(row: str, steps: int) -> str:
  """The name for ``torch.profiler.record_function``."""
  return f"{ANNOTATION}/{steps}/{row}"


@dataclasses.dataclass
class RowStats:
  """Device work of one row's annotated steps (totals; ``per_step`` divides).

  Attributes:
    steps: steps run inside the row's annotations.
    kernels: kernel launches seen on the device.
    kernel_us: their summed durations (microseconds).
    copies: memcpy and memset operations on the device.
    copy_us: their summed durations.
    d2h: device-to-host copies among ``copies`` (host round trips).
    busy_us: the union of all device intervals (overlaps counted once).
    span_us: first device start to last device end, per window, summed: busy plus
      the gaps in which the device waited (launch latency, host syncs).
    top: ``(name, count, us)`` of the kernels of most total time, at most 8.
  """

  steps: int = 0
  kernels: int = 0
  kernel_us: float = 0.0
  copies: int = 0
  copy_us: float = 0.0
  d2h: int = 0
  busy_us: float = 0.0
  span_us: float = 0.0
  top: list = dataclasses.field(default_factory=list)

  def per_step(self) -> dict:
    """Each count and time divided by ``steps`` (times in milliseconds)."""
    n = max(self.steps, 1)
    return {
      "steps": self.steps,
      "kernels": self.kernels / n,
      "kernel_ms": self.kernel_us / n / 1e3,
      "copies": self.copies / n,
      "copy_ms": self.copy_us / n / 1e3,
      "d2h": self.d2h / n,
      "busy_ms": self.busy_us / n / 1e3,
      "span_ms": self.span_us / n / 1e3,
      "top": [(name, c / n, us / n / 1e3) for name, c, us in self.top],
    }


def find_trace(path) -> pathlib.Path | None:
  """A trace file: ``path`` itself, or under a jax log directory the newest
  ``perfetto_trace.json.gz`` (else ``*.trace.json.gz``, else any ``*.json[.gz]``)."""
  path = pathlib.Path(path)
  if path.is_file():
    return path
  for pattern in ("perfetto_trace.json.gz", "*.trace.json.gz", "*.json.gz", "*.json"):
    found = sorted(path.rglob(pattern), key=lambda p: p.stat().st_mtime)
    if found:
      return found[-1]
  return None


def load_events(path) -> list[dict]:
  """The ``traceEvents`` of a JSON trace (gzipped if the name ends in ``.gz``)."""
  path = pathlib.Path(path)
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "rt", encoding="utf-8") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def _names(events, kind):
  out = {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == kind:
      key = e.get("pid") if kind == "process_name" else (e.get("pid"), e.get("tid"))
      out[key] = str(e.get("args", {}).get("name", ""))
  return out


def device_kind(event: dict, processes: dict, threads: dict) -> str | None:
  """``"kernel"``, ``"copy"`` or ``None`` (not device work) for a complete event."""
  if event.get("ph") != "X":
    return None
  if "cat" in event:  # torch's categories
    return _DEVICE_CATEGORIES.get(event["cat"])
  process = processes.get(event.get("pid"), "")
  if not process.startswith("/device:"):
    return None
  thread = threads.get((event.get("pid"), event.get("tid")))
  if thread is None or not thread.lower().startswith("stream"):
    return None  # a derived line (XLA Ops, XLA Modules, Steps, ...)
  return "copy" if _COPY.search(str(event.get("name", ""))) else "kernel"


def _is_d2h(event: dict) -> bool:
  return bool(_D2H.search(f"{event.get('name', '')} {event.get('args', '')}"))


def _window(event: dict) -> tuple[str, int] | None:
  """``(row, steps)`` of a host annotation event, else ``None``."""
  name = str(event.get("name", ""))
  if name == ANNOTATION and "row" in event.get("args", {}):
    args = event["args"]
    return str(args["row"]), int(args.get("steps", 1))
  if name.startswith(ANNOTATION + "/") and event.get("cat") != "gpu_user_annotation":
    parts = name.split("/", 2)
    if len(parts) == 3 and parts[1].isdigit():
      return parts[2], int(parts[1])
  return None


def _union(intervals) -> float:
  total, end = 0.0, -float("inf")
  for a, b in sorted(intervals):
    if b > end:
      total += b - max(a, end)
      end = b
  return total


def row_stats(events: list[dict]) -> tuple[dict[str, RowStats], dict]:
  """Per annotated row its :class:`RowStats`; and what was not counted, to check
  the format was understood: ``outside`` (device events outside every window),
  ``derived`` (events on a device's other lines), ``lines`` (the stream lines)."""
  processes, threads = _names(events, "process_name"), _names(events, "thread_name")
  windows, device, derived, lines = [], [], 0, set()
  for e in events:
    if e.get("ph") != "X" or "ts" not in e:
      continue
    kind = device_kind(e, processes, threads)
    if kind is not None:
      device.append((kind, e))
      lines.add(threads.get((e.get("pid"), e.get("tid")), str(e.get("cat"))))
      continue
    if str(processes.get(e.get("pid"), "")).startswith("/device:"):
      derived += 1
      continue
    w = _window(e)
    if w is not None:
      start = float(e["ts"])
      windows.append((start, start + float(e.get("dur", 0.0)), w[0], w[1]))
  windows.sort()
  starts = [w[0] for w in windows]
  stats: dict[str, RowStats] = {}
  per_window = collections.defaultdict(list)
  names = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
  for _, _, row, steps in windows:
    stats.setdefault(row, RowStats()).steps += steps
  outside = 0
  for kind, e in device:
    a = float(e["ts"])
    b = a + float(e.get("dur", 0.0))
    i = bisect.bisect_right(starts, (a + b) / 2) - 1
    if i < 0 or (a + b) / 2 > windows[i][1]:
      outside += 1
      continue
    row = windows[i][2]
    s = stats[row]
    per_window[i].append((a, b))
    if kind == "kernel":
      s.kernels += 1
      s.kernel_us += b - a
      entry = names[row][str(e.get("name", ""))]
      entry[0] += 1
      entry[1] += b - a
    else:
      s.copies += 1
      s.copy_us += b - a
      s.d2h += _is_d2h(e)
  for i, intervals in per_window.items():
    s = stats[windows[i][2]]
    s.busy_us += _union(intervals)
    s.span_us += max(b for _, b in intervals) - min(a for a, _ in intervals)
  for row, by_name in names.items():
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:8]
    stats[row].top = [(name, c, us) for name, (c, us) in ranked]
  return stats, {"outside": outside, "derived": derived, "lines": sorted(lines)}


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1:
    print(__doc__)
    return 2
  path = find_trace(argv[0])
  if path is None:
    print(f"no trace under {argv[0]}")
    return 1
  stats, seen = row_stats(load_events(path))
  print(f"{path}: {len(stats)} rows; not counted: {seen}")
  print("| row | steps | kernels/step | kernel ms/step | copies/step | D2H/step |"
        " busy ms/step | span ms/step |")  # fmt: skip
  print("|---|---:|---:|---:|---:|---:|---:|---:|")
  for row, s in stats.items():
    p = s.per_step()
    print(
      f"| {row} | {p['steps']} | {p['kernels']:.1f} | {p['kernel_ms']:.3f} |"
      f" {p['copies']:.1f} | {p['d2h']:.1f} | {p['busy_ms']:.3f} | {p['span_ms']:.3f} |"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
