"""GPU check: correctness of the kernels, and step times as a training loop sees them.

One run on a machine with a GPU, inside a wall-clock budget (``--budget-s``). The
sections, in order of importance (a section that no longer fits the budget is
skipped with a message; ``--sections`` picks and orders them):

1. ``roofline``: one large donated copy (>= 1 GB), pipelined: the bandwidth
   ceiling (bytes read plus bytes written) every GB/s below is compared with.
2. ``checks``: the Pallas kernels against their XLA reference through the public
   API -- ``kernels.masked_adam`` (float32 and bfloat16, odd sizes that need
   padding, row blocks, a parameter mask, weight decay), ``adam_magma`` pallas
   against xla over 3 steps, ``periodic_mask``'s exact top-k against numpy, and
   ``kernels.tile_adam`` (tiles (8, 128) and (1, 128)). Exit status 1 if one fails.
3. ``dense-peers``, ``dense-transformer``, ``dense-100m``: one jitted training step
   (update + apply, params and state donated) of ``optax.adam``,
   ``magma(optax.adam)``, ``skip_update(optax.adam)``, ``adam_magma`` with
   implementation "xla", "pallas" and the default, and the peers when importable
   (rollfast ``adamw`` and ``adamw(use_magma=True)``; torch Adam fused and foreach
   and magma-optimizer around them, in a subprocess: ``torch_peers.py``), on 23.1 M
   parameters in the peers' 8 shapes, the 144-leaf transformer-shaped tree of
   ``step_overhead.py`` and 100 M parameters in 8 leaves (with the Pallas kernel
   alone there, against the roofline).
4. ``sparse-8m``, ``sparse-transformer`` (issue 46): ``periodic_mask(optax.adam)``'s
   ordinary step (gated, and gate-free: ``refresh=False``), ``sparse_state`` skip
   storage, unstructured compact storage, ``sparse_adam`` tiles (8, 128) at density
   0.3, and one refresh at ``every=100``
   (constant and ramped sparsity) as a share of the run and in Adam steps; on 8.4 M
   parameters (8 square 1024 leaves and their biases) and on the 144-leaf tree.
5. ``tile-bandwidth``: the tile kernel alone against its XLA reference.

Every step row is timed two ways, in interleaved rounds (each round runs every row
once, in a seeded shuffled order): pipelined (``--steps`` steps enqueued, one block
at the end: what a training loop sees) and blocked (a block after every step:
latency). Ratios are medians over rounds of the ratio to ``optax.adam`` in the same
round; torch rows, timed in their own process, are compared by medians (unpaired,
marked ``*``). Kernels and device time per step come from a profiler trace of
``--profile-steps`` steps per row, parsed by ``trace_stats.py``. The targets of
issue 44 (deliverable 5) and issue 46 (deliverable 4) are printed as met / NOT met
with the measured ratio, as they are measured and again at the end. Every line is
flushed; with ``--out`` (default ``$OUT``) the log, a JSON of all numbers
(rewritten after each section) and a few traces are written there.

Usage::

    python3 benchmarks/gpu_check.py                    # a GPU: about 6 minutes
    python3 benchmarks/gpu_check.py --budget-s 200 --sections roofline,dense-peers
    python3 benchmarks/gpu_check.py --smoke            # any machine, tiny sizes

On the lent device machine, from the repository root, with the peers' wheels in
``.whl/`` (carried; ``device_run.sh`` holds the ``pip download`` command)::

    bash benchmarks/device_run.sh      # device tool: carry [".whl"], timeout_s 560

``--smoke`` checks the script itself (``tests/test_gpu_check.py`` runs it on CPU):
every section at tiny sizes with a few of its rows (``SMOKE_ROWS``), the Pallas
kernels interpreted, one round, the torch peers on the CPU if torch imports, the
profile parsed from the trace the CPU run wrote (it holds no device events). Its
timings and targets mean nothing. ``benchmarks/tpu_check.py`` is the check for a TPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gzip
import importlib.metadata
import inspect
import json
import os
import pathlib
import queue
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# Leave GPU memory to the torch peers' process (read when jax's backend starts).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import magma_optax as magma  # noqa: E402
from magma_optax import kernels  # noqa: E402

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
import device_checks  # noqa: E402
import step_overhead  # noqa: E402
import trace_stats  # noqa: E402

_START = time.perf_counter()  # the budget counts from here (after the imports)

ADAM_BYTES = 28  # per parameter: read p, g, m, v; write p, m, v (float32)
BASE = "optax.adam"
# The peers' 8 leaves (23.1 M parameters), as timed on the first GPU run.
PEER_SHAPES = [
  (4096, 1024),
  (1024, 4096),
  (4096, 1024),
  (1024, 4096),
  (2048, 1024),
  (1024, 2048),
  (2048, 512),
  (512, 2048),
]
SECTIONS = [
  "roofline",
  "checks",
  "dense-peers",
  "sparse-8m",
  "dense-transformer",
  "dense-100m",
  "sparse-transformer",
  "tile-bandwidth",
]
# Seconds a section needs at least on a GPU: it is skipped below that.
NEEDS = {
  "roofline": 5,
  "checks": 30,
  "dense-peers": 40,
  "sparse-8m": 35,
  "dense-transformer": 45,
  "dense-100m": 35,
  "sparse-transformer": 40,
  "tile-bandwidth": 10,
}
CASES = [
  ((4096, 1024), "tensor", jnp.float32, False),
  ((1000, 769), "row", jnp.float32, True),
  ((3, 1001, 333), "tensor", jnp.bfloat16, True),
  ((12345,), "tensor", jnp.float32, False),
  ((2048, 4096), "row", jnp.bfloat16, False),
]
SMOKE_CASES = [
  ((64, 96), "tensor", jnp.float32, False),
  ((33, 17), "row", jnp.float32, True),
  ((3, 5, 7), "tensor", jnp.bfloat16, True),
]
# The tile kernel: (leaf shape, gradient dtype, moments' dtype).
TILE_CASES = [
  ((256, 512), jnp.float32, jnp.float32),
  ((4, 512, 1024), jnp.bfloat16, jnp.float32),
  ((2048, 2048), jnp.float32, jnp.bfloat16),
]
SMOKE_TILE_CASES = [((2, 16, 256), jnp.float32, jnp.float32)]
ROLLFAST_MAGMA = "rollfast adamw(use_magma=True)"
ORDINARY = "periodic_mask(optax.adam), ordinary step"
GATE_FREE = "periodic_mask(optax.adam), refresh=False"
# Issue 44 deliverable 5 and issue 46 deliverable 4: (tree kind, row, op, limit).
DENSE_TARGETS = [
  ("dense-peers", "adam_magma[default]", "<=", 1.10),
  ("dense-100m", "adam_magma[default]", "<=", 1.10),
  ("dense-transformer", "adam_magma[default]", "<=", 1.30),
  ("*", "magma(optax.adam)", "<=", 1.35),
  ("*", "skip_update(optax.adam)", "<=", 1.05),
]
SPARSE_TARGETS = [
  (ORDINARY, "<=", 1.10),
  ("sparse_state skip, density 0.5", "<=", 1.05),
  ("sparse_adam tiles (8, 128), density 0.3", "<=", 0.80),
  ("sparse_state compact, density 0.5", "<=", 2.0),
]
# --smoke compiles only these rows (every path of the script, few compilations).
SMOKE_ROWS = {
  "dense-peers": [BASE, "magma(optax.adam)", ROLLFAST_MAGMA],
  "dense-transformer": [BASE, "skip_update(optax.adam)"],
  "dense-100m": [BASE, "masked_adam[xla]"],
  "sparse-8m": [BASE, ORDINARY, GATE_FREE, "sparse_state skip, density 0.5",
                "sparse_adam tiles (8, 128), density 0.3", "refresh, constant 0.5"],
  "sparse-transformer": [BASE, "sparse_state skip, density 0.5"],
  "tile-bandwidth": ["tile_adam[pallas]", "tile_adam[xla]"],
}  # fmt: skip


# ---------------------------------------------------------------- output, budget


class Report:
  """Lines to stdout (flushed) and the log; numbers to a JSON, rewritten often."""

  def __init__(self, out: str | None):
    self.out = pathlib.Path(out) if out else None
    self.data = {"meta": {}, "sections": {}, "targets": [], "checks": []}
    self._log = None
    if self.out is not None:
      self.out.mkdir(parents=True, exist_ok=True)
      self._log = open(self.out / "gpu_check.log", "w", encoding="utf-8")

  def say(self, *parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    if self._log is not None:
      self._log.write(line + "\n")
      self._log.flush()

  def save(self) -> None:
    if self.out is None:
      return
    tmp = self.out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable))
    tmp.replace(self.out / "gpu_check.json")

  def close(self) -> None:
    self.save()
    if self._log is not None:
      self._log.close()


def _jsonable(x):
  if isinstance(x, np.generic):
    return x.item()
  return str(x)


def _err(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:300] if text else ''}"


@dataclasses.dataclass
class Context:
  """What every section gets: the options, the report, the budget, the peers."""

  args: argparse.Namespace
  rep: Report
  deadline: float
  roofline_gbps: float | None = None
  torch: TorchPeers | None = None
  traces_kept: int = 0

  def left(self) -> float:
    return self.deadline - time.perf_counter()

  @property
  def smoke(self) -> bool:
    return self.args.smoke

  @property
  def interpret(self) -> bool:
    return self.args.smoke  # Pallas in the interpreter off the GPU


# ---------------------------------------------------------------- trees


def tree_of(shapes: dict, seed: int = 0):
  """Random float32 params (scale 0.02) and gradients (scale 1e-3) of ``shapes``."""
  keys = iter(jax.random.split(jax.random.key(seed), 2 * len(shapes)))
  params, grads = {}, {}
  for name, shape in shapes.items():
    params[name] = jax.random.normal(next(keys), shape, jnp.float32) * 0.02
    grads[name] = jax.random.normal(next(keys), shape, jnp.float32) * 1e-3
  return params, grads


def sparse_tree(width: int, layers: int):
  """``layers`` square ``width`` kernels and their biases (8.4 M at 1024 x 8)."""
  shapes = {}
  for i in range(layers):
    shapes[f"layer{i}_kernel"] = (width, width)
    shapes[f"layer{i}_bias"] = (width,)
  return tree_of(shapes, seed=1)


def make_tree(kind: str, smoke: bool):
  """``(label, params, grads)`` of a section's tree."""
  if kind == "dense-peers":
    div = 64 if smoke else 1
    shapes = {f"w{i}": (a // div, b // div) for i, (a, b) in enumerate(PEER_SHAPES)}
    params, grads = tree_of(shapes)
    label = "the peers' 8 leaves"
  elif kind == "dense-100m":
    params, grads = step_overhead.make_params(65536 if smoke else 100_000_000, 8)
    label = "8 leaves"
  elif kind in ("dense-transformer", "sparse-transformer"):
    # Tiles of (8, 128) need a width that 128 divides.
    layers, width = (
      (1, 32 if kind == "dense-transformer" else 128) if smoke else (12, 256)
    )
    params, grads = step_overhead.make_transformer_params(layers=layers, width=width)
    label = f"transformer-shaped, {len(params)} leaves"
  elif kind == "sparse-8m":
    params, grads = sparse_tree(128 if smoke else 1024, 2 if smoke else 8)
    label = f"{len(params)} leaves (square kernels and biases)"
  else:
    raise ValueError(kind)
  return label, params, grads


def num_params(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


def random_mask(params, density: float, seed: int = 100):
  """Exactly ``round(density * size)`` active entries per leaf, at random."""

  def one(i, x):
    keep = round(density * x.size)
    order = jax.random.permutation(jax.random.key(seed + i), x.size)
    return jnp.zeros(x.size, bool).at[order[:keep]].set(True).reshape(x.shape)

  leaves, treedef = jax.tree.flatten(params)
  return treedef.unflatten([one(i, x) for i, x in enumerate(leaves)])


def random_tile_mask(params, density: float, block, seed: int = 300):
  """Per 2-D leaf exactly ``round(density * tiles)`` active ``block`` tiles at
  random; ``None`` for the other leaves (they are not scoped)."""
  r, c = block

  def one(i, x):
    if x.ndim != 2:
      return None
    rows, cols = x.shape[0] // r, x.shape[1] // c
    order = jax.random.permutation(jax.random.key(seed + i), rows * cols)
    keep = (order < round(density * rows * cols)).reshape(rows, 1, cols, 1)
    return jnp.broadcast_to(keep, (rows, r, cols, c)).reshape(x.shape)

  return {k: one(i, x) for i, (k, x) in enumerate(params.items())}


# ---------------------------------------------------------------- rows and timing


class JaxRow:
  """A jitted donated training step and its carried params and state."""

  def __init__(self, name, tx, params, grads, mask=None):
    self.name = name

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, g, m):
      extra = {} if m is None else {"param_mask": m}
      u, s = tx.update(g, s, p, **extra)
      return optax.apply_updates(p, u), s

    self.step = step
    self.args = (grads, mask)
    p = jax.tree.map(jnp.copy, params)
    s = tx.init(p)
    self.p, self.s = step(p, s, *self.args)  # compiles; the first step
    self._block()

  def _block(self):
    # All outputs of one execution are ready together: one leaf is enough.
    jax.block_until_ready(jax.tree.leaves(self.p)[0])

  def run(self, n: int) -> None:
    p, s = self.p, self.s
    for _ in range(n):
      p, s = self.step(p, s, *self.args)
    self.p, self.s = p, s
    self._block()

  def pipelined(self, n: int) -> float:
    """Seconds per step over ``n`` steps enqueued, one block at the end."""
    t0 = time.perf_counter()
    self.run(n)
    return (time.perf_counter() - t0) / n

  def blocked(self, n: int) -> list[float]:
    """Seconds of each of ``n`` steps, each blocked on."""
    out = []
    for _ in range(n):
      t0 = time.perf_counter()
      self.run(1)
      out.append(time.perf_counter() - t0)
    return out


class FnRow(JaxRow):
  """A jitted function ``(carry, *args) -> carry`` (the carry donated; large inputs
  go in ``args``: closed over, they would be compiled in as constants)."""

  def __init__(self, name, fn, carry, args=()):
    self.name = name
    self.fn = fn
    self.args = args
    self.p = fn(carry, *args)
    self._block()

  def run(self, n: int) -> None:
    x = self.p
    for _ in range(n):
      x = self.fn(x, *self.args)
    self.p = x
    self._block()


def build_rows(ctx: Context, makers: dict, section: str, reserve: float = 0) -> list:
  """Compiles each row (``name -> () -> row``); a failure is printed and skipped,
  and so is every row once the budget left falls under ``reserve`` seconds."""
  rows, seconds = [], {}
  for name, make in makers.items():
    if ctx.smoke and name not in SMOKE_ROWS[section]:
      continue
    if ctx.left() < reserve:
      ctx.rep.say(f"{name}: skipped: budget spent")
      continue
    t0 = time.perf_counter()
    try:
      rows.append(make())
    except Exception as e:  # noqa: BLE001 -- report the row, time the others
      ctx.rep.say(f"{name}: FAILED {_err(e)}")
      ctx.rep.data.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
    seconds[name] = round(time.perf_counter() - t0, 2)
  ctx.rep.data.setdefault("compile_s", {}).setdefault(section, {}).update(seconds)
  if seconds:
    ctx.rep.say(f"compile + first step, s: {seconds}")
  return rows


def interleaved(ctx: Context, rows: list, steps: int, blocked: int, rounds: int):
  """Per row the pipelined seconds per step of each round and the median blocked
  step of each round; a row that raises is dropped (printed). After the first
  round, the rounds are cut (to no fewer than 3) to fit ``--timing-s``, and end
  when the budget is spent."""
  times = {r.name: {"pipelined": [], "blocked": []} for r in rows}
  live = list(rows)
  t0 = time.perf_counter()
  k = 0
  while k < rounds:
    if k == 1:
      fit = int(ctx.args.timing_s / max(time.perf_counter() - t0, 1e-9))
      if fit < rounds:
        rounds = max(min(rounds, 3), fit)
        ctx.rep.say(f"(rounds cut to {rounds} to fit --timing-s {ctx.args.timing_s})")
    if k and ctx.left() < 0:
      ctx.rep.say(f"(rounds stopped at {k}: budget spent)")
      break
    order = live[:]
    random.Random(k).shuffle(order)
    for row in order:
      try:
        times[row.name]["pipelined"].append(row.pipelined(steps))
        if blocked:
          times[row.name]["blocked"].append(statistics.median(row.blocked(blocked)))
      except Exception as e:  # noqa: BLE001
        ctx.rep.say(f"{row.name}: FAILED while timing: {_err(e)}")
        live.remove(row)
        times.pop(row.name)
    k += 1
  return times


def paired(a: list, b: list) -> float | None:
  """Median over rounds of ``a[i] / b[i]``."""
  if not a or len(a) != len(b):
    return None
  return statistics.median(x / y for x, y in zip(a, b, strict=True))


def summarize(times: dict, n: int | None, roofline: float | None) -> dict:
  """Medians, ratios to ``optax.adam`` and bandwidth per row."""
  base = times.get(BASE)
  out = {}
  for name, t in times.items():
    pipe = statistics.median(t["pipelined"])
    row = {
      "pipelined_ms": pipe * 1e3,
      "blocked_ms": statistics.median(t["blocked"]) * 1e3 if t["blocked"] else None,
      "x_adam_pipelined": paired(t["pipelined"], base["pipelined"]) if base else None,
      "x_adam_blocked": paired(t["blocked"], base["blocked"]) if base else None,
      "samples": t,
    }
    if n:
      row["gbps"] = ADAM_BYTES * n / pipe / 1e9
      row["of_roofline"] = row["gbps"] / roofline if roofline else None
    out[name] = row
  return out


def profile(ctx: Context, rows: list, tag: str) -> dict:
  """Kernels and device time per step of each row, from one profiler trace."""
  k = ctx.args.profile_steps
  if k <= 0 or not rows:
    return {}
  if ctx.left() < 5:
    ctx.rep.say(f"profile {tag}: skipped: budget spent")
    return {}
  log_dir = tempfile.mkdtemp(prefix=f"gpu_check_{tag}_")
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0  # host annotations and device work only
  try:
    with jax.profiler.trace(
      log_dir, create_perfetto_trace=True, profiler_options=options
    ):
      for i, row in enumerate(rows):
        name, kw = trace_stats.jax_annotation(f"r{i}", k)
        with jax.profiler.TraceAnnotation(name, **kw):
          row.run(k)
    return read_trace(ctx, log_dir, tag, [row.name for row in rows])
  except Exception as e:  # noqa: BLE001
    ctx.rep.say(f"profile {tag}: FAILED {_err(e)}")
    return {}
  finally:
    shutil.rmtree(log_dir, ignore_errors=True)


def read_trace(ctx: Context, where, tag: str, names: list[str]) -> dict:
  """Parses a trace file (or a jax log directory) whose rows were annotated
  ``r0, r1, ...`` (the ``names``); keeps a few under ``--out``."""
  path = trace_stats.find_trace(where)
  if path is None:
    ctx.rep.say(f"profile {tag}: no trace file under {where}")
    return {}
  stats, seen = trace_stats.row_stats(trace_stats.load_events(path))
  size = path.stat().st_size
  kept = None
  if ctx.rep.out is not None and ctx.traces_kept < ctx.args.keep_traces:
    if size < 15 * 2**20:
      kept = ctx.rep.out / f"trace_{tag}.json.gz"
      if path.suffix == ".gz":
        shutil.copyfile(path, kept)
      else:
        with open(path, "rb") as f, gzip.open(kept, "wb") as g:
          shutil.copyfileobj(f, g)
      ctx.traces_kept += 1
  ctx.rep.say(
    f"profile {tag}: {len(stats)} rows from {path.name} ({size / 1e6:.1f} MB);"
    f" not counted: {seen['derived']} events on derived device lines,"
    f" {seen['outside']} device events outside the rows; stream lines:"
    f" {seen['lines'][:6]}" + (f"; kept as {kept.name}" if kept else "")
  )
  out = {
    names[int(i[1:])]: s.per_step()
    for i, s in stats.items()
    if i[1:].isdigit() and int(i[1:]) < len(names)
  }
  out["_seen"] = seen
  return out


# ---------------------------------------------------------------- torch peers


class TorchPeers:
  """``torch_peers.py`` in a subprocess (a crash there cannot end this run): one
  JSON request per line in, one JSON answer per line out."""

  def __init__(self, device: str):
    self.stderr = tempfile.TemporaryFile()
    self.proc = subprocess.Popen(
      [sys.executable, str(_HERE / "torch_peers.py"), "--device", device],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=self.stderr,
      text=True,
      bufsize=1,
    )
    self.lines = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()
    self.info = None

  def _read(self):
    for line in self.proc.stdout:
      self.lines.put(line)
    self.lines.put(None)

  def _answer(self, timeout: float) -> dict:
    end = time.perf_counter() + max(timeout, 1.0)
    while True:
      try:
        line = self.lines.get(timeout=max(end - time.perf_counter(), 0.01))
      except queue.Empty:
        # Still running, it would share the GPU with the next timings: end it.
        self.proc.kill()
        self.info = {"error": f"torch_peers.py gave no answer in {timeout:.0f} s"}
        return self.info
      if line is None:
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace")[-1500:]
        return {"error": f"torch_peers.py exited ({self.proc.poll()}): {tail}"}
      if line.startswith("{"):
        return json.loads(line)

  def ready(self, timeout: float) -> dict:
    if self.info is None:
      self.info = self._answer(timeout)
    return self.info

  def run(self, request: dict, timeout: float) -> dict:
    if "error" in self.ready(timeout):
      return self.info
    try:
      self.proc.stdin.write(json.dumps(request) + "\n")
      self.proc.stdin.flush()
    except OSError as e:
      return {"error": _err(e)}
    return self._answer(timeout)

  def close(self):
    with contextlib.suppress(Exception):
      self.proc.stdin.write('{"cmd": "quit"}\n')
      self.proc.stdin.close()
      self.proc.wait(timeout=10)
    if self.proc.poll() is None:
      self.proc.kill()


def rollfast_makers(ctx: Context) -> dict:
  """rollfast's ``adamw`` and ``adamw(use_magma=True)``, when importable."""
  try:
    import rollfast.optim.adam as rfa
  except Exception as e:  # noqa: BLE001
    ctx.rep.say(f"rollfast: skipped: not importable ({_err(e)})")
    return {}
  version = _version("rollfast")
  ctx.rep.data["meta"]["rollfast"] = version
  kw = (
    {"key": jax.random.key(0)}
    if "key" in inspect.signature(rfa.adamw).parameters
    else {}
  )
  return {
    "rollfast adamw": lambda: rfa.adamw(1e-3, weight_decay=0.0, **kw),
    ROLLFAST_MAGMA: lambda: rfa.adamw(1e-3, weight_decay=0.0, use_magma=True, **kw),
  }


def _version(name: str) -> str:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return "?"


def torch_rows(ctx: Context, params, tag: str) -> dict:
  """The torch peers on ``params``' shapes: their rows (medians of their own
  interleaved rounds) and their profile, or ``{}`` with a printed reason."""
  if ctx.torch is None:
    return {}
  first = ctx.torch.info is None
  info = ctx.torch.ready(min(ctx.left(), 120))
  if "error" in info:
    ctx.rep.say(f"torch peers (torch Adam, magma-optimizer): skipped: {info['error']}")
    return {}
  if first:
    ctx.rep.data["meta"]["torch"] = info
    ctx.rep.say(
      f"torch peers: torch {info.get('torch')} on {info.get('device')},"
      f" magma-optimizer {info.get('magma_optimizer') or 'not importable'}"
    )
  if ctx.left() < 15:
    ctx.rep.say("torch peers: skipped: budget spent")
    return {}
  folder = tempfile.mkdtemp(prefix=f"gpu_check_torch_{tag}_")
  trace = os.path.join(folder, "trace.json") if ctx.args.profile_steps > 0 else None
  request = {
    "cmd": "run",
    "shapes": [list(x.shape) for x in jax.tree.leaves(params)],
    "rounds": ctx.args.rounds,
    "steps": ctx.args.steps,
    "blocked": ctx.args.blocked,
    "profile_steps": ctx.args.profile_steps,
    "timing_s": ctx.args.timing_s,
    "trace": trace,
  }
  answer = ctx.torch.run(request, timeout=min(max(ctx.left() - 5, 10), 600))
  for name, msg in answer.get("skipped", {}).items():
    ctx.rep.say(f"{name}: skipped: {msg}")
  for name, msg in answer.get("errors", {}).items():
    ctx.rep.say(f"{name}: FAILED {msg}")
  if "error" in answer:
    ctx.rep.say(f"torch peers: FAILED {answer['error']}")
    return {}
  prof = {}
  if trace and os.path.exists(trace):
    try:
      prof = read_trace(ctx, trace, f"{tag}_torch", answer.get("profiled", []))
    except Exception as e:  # noqa: BLE001
      ctx.rep.say(f"profile {tag}_torch: FAILED {_err(e)}")
  shutil.rmtree(folder, ignore_errors=True)
  return {"rows": answer.get("rows", {}), "profile": prof}


# ---------------------------------------------------------------- tables, targets


def fmt(x, spec=".3f", none="-"):
  return none if x is None else format(x, spec)


def table(ctx: Context, title: str, rows: dict, prof: dict) -> None:
  ctx.rep.say(f"\n## {title}")
  ctx.rep.say(
    "| step | pipelined ms | x adam | blocked ms | x adam | GB/s (28 B/param) |"
    " of roofline | kernels/step | device ms/step | D2H/step |"
  )
  ctx.rep.say("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for name, r in rows.items():
    p = prof.get(name, {})
    star = "*" if r.get("unpaired") else ""
    ctx.rep.say(
      f"| {name} | {fmt(r['pipelined_ms'])} | {fmt(r['x_adam_pipelined'], '.2f')}{star}"
      f" | {fmt(r['blocked_ms'])} | {fmt(r['x_adam_blocked'], '.2f')}{star}"
      f" | {fmt(r.get('gbps'), '.0f')} | {fmt(r.get('of_roofline'), '.0%')}"
      f" | {fmt(p.get('kernels'), '.1f')} | {fmt(p.get('busy_ms'))}"
      f" | {fmt(p.get('d2h'), '.1f')} |"
    )
  if any(r.get("unpaired") for r in rows.values()):
    ctx.rep.say(
      "* torch, timed in its own process: median over median of optax.adam"
      " (unpaired); x torch Adam (foreach) is in the JSON"
    )


_OPS = {"<": float.__lt__, "<=": float.__le__, ">=": float.__ge__, ">": float.__gt__}


def target(
  ctx: Context,
  issue: str,
  what: str,
  value: float | None,
  op: str,
  limit: float,
  unit: str = "x",
  blocked: float | None = None,
) -> None:
  """Records and prints one target as met / NOT met (or unmeasured); ``value`` is
  the pipelined measure, ``blocked`` the same from blocked steps (shown only)."""
  if value is None:
    verdict = "unmeasured"
  else:
    verdict = "met" if _OPS[op](float(value), float(limit)) else "NOT met"
  show = lambda x: "-" if x is None else (f"{x:.1%}" if unit == "%" else f"{x:.2f}x")
  line = f"target [issue {issue}] {what}: {show(value)} pipelined ({op} {show(limit)})"
  line += f": {verdict}"
  if blocked is not None:
    line += f" (blocked: {show(blocked)})"
  if ctx.smoke:
    line += " (smoke: meaningless)"
  ctx.rep.data["targets"].append(
    {"issue": issue, "what": what, "value": value, "blocked": blocked, "op": op,
     "limit": limit, "verdict": verdict}
  )  # fmt: skip
  ctx.rep.say(line)


# ---------------------------------------------------------------- sections


def section_roofline(ctx: Context) -> dict:
  """One large donated copy ``x + 1`` (reads and writes every byte), pipelined."""
  nbytes = 2**20 if ctx.smoke else 2**30
  x = jax.random.normal(jax.random.key(7), (nbytes // 4,), jnp.float32)
  row = FnRow("copy", jax.jit(lambda x: x + 1.0, donate_argnums=0), x)
  times = interleaved(
    ctx, [row], 10 if not ctx.smoke else 2, 0, max(ctx.args.rounds, 3)
  )
  t = statistics.median(times["copy"]["pipelined"])
  gbps = 2 * nbytes / t / 1e9
  ctx.roofline_gbps = gbps
  ctx.rep.say(
    f"copy roofline: {nbytes / 2**30:.2f} GiB donated x + 1, pipelined:"
    f" {t * 1e3:.3f} ms, {gbps:.0f} GB/s (read + write)"
  )
  return {"bytes": nbytes, "ms": t * 1e3, "gbps": gbps, "samples": times["copy"]}


def _interprets(ctx: Context) -> list:
  """The Pallas modes to check: the device's kernel; in the smoke run the
  interpreters this jax has (True: the Triton layout; "gpu": Mosaic GPU's)."""
  if not ctx.smoke:
    return [False]
  out = [True]
  try:
    layout = magma.block_layout((8, 128), "tensor")
    kernels.resolve_implementation("pallas", layout=layout, interpret="gpu")
    out.append("gpu")
  except ValueError as e:
    ctx.rep.say(f"Mosaic GPU interpreter: skipped: {_err(e)}")
  return out


def _rel_err(a, b) -> float:
  a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a32 - b32)) / (np.max(np.abs(b32)) + 1e-30))


def check(ctx: Context, what: str, ok: bool, detail: str = "") -> bool:
  ctx.rep.say(f"{what}: {detail}{' ' if detail else ''}{'OK' if ok else 'FAIL'}")
  ctx.rep.data["checks"].append({"what": what, "ok": ok, "detail": detail})
  return ok


def check_kernels(ctx: Context, cases, interprets) -> bool:
  """``kernels.masked_adam`` pallas vs xla on random data, one line per case."""
  ok = True
  for interpret in interprets:
    for i, (shape, gran, dtype, use_mask) in enumerate(cases):
      what = (
        f"kernel[pallas, interpret={interpret}] {shape} {gran}"
        f" {jnp.dtype(dtype).name} mask={use_mask}"
      )
      if interpret == "gpu" and i > 0:
        continue  # the Mosaic GPU interpreter is slow: one case
      k = jax.random.split(jax.random.key(i), 6)
      g = jax.random.normal(k[0], shape).astype(dtype)
      m = (0.1 * jax.random.normal(k[1], shape)).astype(dtype)
      v = (0.01 * jax.random.uniform(k[2], shape)).astype(dtype)
      p = jax.random.normal(k[3], shape).astype(dtype)
      layout = magma.block_layout(shape, gran)
      scale = jax.random.uniform(k[4], layout.block_shape)
      mask = jax.random.bernoulli(k[5], 0.8, shape) if use_mask else None

      def run(impl, g, m, v, p, scale, mask, layout=layout, interpret=interpret):
        return kernels.masked_adam(
          g,
          m,
          v,
          count=7,
          learning_rate=1e-3,
          params=p,
          weight_decay=0.1,
          param_mask=mask,
          scale=scale,
          layout=layout,
          implementation=impl,
          interpret=interpret if impl == "pallas" else False,
        )

      try:
        want = jax.jit(functools.partial(run, "xla"))(g, m, v, p, scale, mask)
        got = jax.jit(functools.partial(run, "pallas"))(g, m, v, p, scale, mask)
        errs = {
          f: _rel_err(a, b) for f, a, b in zip(want._fields, got, want, strict=True)
        }
      except Exception as e:  # noqa: BLE001
        ok &= check(ctx, what, False, _err(e))
        continue
      tol = 1e-5 if dtype == jnp.float32 else 1e-2
      worst = max(errs, key=lambda f: (np.nan_to_num(errs[f], nan=np.inf), f))
      good = all(e <= tol for e in errs.values())
      ok &= check(
        ctx, what, good, f"worst {worst} rel err {errs[worst]:.1e} (tol {tol:.0e})"
      )
  return ok


def check_optimizer(ctx: Context, n: int, interprets) -> bool:
  """``adam_magma`` pallas vs xla over 3 steps: updates and masks."""
  params, grads = step_overhead.make_params(n, 4)
  ok = True
  for interpret in interprets:
    out = {}
    try:
      runs = device_checks.adam_magma_runs(params, grads, interpret)
      for impl, (u, state) in runs.items():
        out[impl] = (u, magma.mask_stats(state)["mask"])
    except Exception as e:  # noqa: BLE001
      ok &= check(
        ctx, f"adam_magma pallas[interpret={interpret}] vs xla", False, _err(e)
      )
      continue
    pairs = zip(
      jax.tree.leaves(out["pallas"][0]), jax.tree.leaves(out["xla"][0]), strict=True
    )
    err = max(_rel_err(a, b) for a, b in pairs)
    masks = zip(
      jax.tree.leaves(out["pallas"][1]), jax.tree.leaves(out["xla"][1]), strict=True
    )
    same = all(bool(jnp.all(a == b)) for a, b in masks)
    ok &= check(
      ctx,
      f"adam_magma pallas[interpret={interpret}] vs xla, 3 steps",
      err <= 1e-5 and same,
      f"rel err {err:.1e}, masks equal {same}:",
    )
  return ok


def check_top_k(ctx: Context, shape, smoke: bool = False) -> bool:
  """``periodic_mask``'s exact top-k on this device against numpy: two refreshes
  (every step) with the gradient as the importance; the second's scores have
  pruned zeros and ties, so its order uses the first's mask (active first, then
  the lower index). Checked for each count k the mask keeps."""
  rng = np.random.default_rng(0)
  n = int(np.prod(shape))
  first = rng.random(n).astype(np.float32) + 0.1
  score = np.abs(rng.standard_normal(n) * rng.standard_normal(n)).astype(np.float32)
  score[rng.permutation(n)[: n // 3]] = 0.0  # a block of pruned weights
  score[rng.permutation(n)[:50]] = np.float32(0.5)  # ties
  ok = True
  nnz = int(np.sum(score > 0))
  for k in (nnz - 40,) if smoke else (n // 10, nnz - 40, n // 2):
    what = f"top-k {shape} k={k}"
    try:
      tx = magma.periodic_mask(
        optax.sgd(0.0), sparsity=(n - k) / n, every=1, importance=lambda p, g: g
      )
      params = {"w": jnp.ones(shape)}
      update = jax.jit(tx.update)
      state = tx.init(params)
      _, state = update({"w": jnp.asarray(first.reshape(shape))}, state, params)
      active = np.asarray(state.mask["w"]).ravel()
      _, state = update({"w": jnp.asarray(score.reshape(shape))}, state, params)
      got = np.asarray(state.mask["w"]).ravel()
    except Exception as e:  # noqa: BLE001
      ok &= check(ctx, what, False, _err(e))
      continue
    kept = int(got.sum())
    order = np.lexsort((np.arange(n), ~active, -score))
    want = np.zeros(n, bool)
    want[order[:kept]] = True
    good = kept == k and bool(np.array_equal(got, want))
    ok &= check(ctx, what, good, f"kept {kept}, as numpy {np.array_equal(got, want)}:")
  return ok


def _tile_fn(impl, interpret=False):
  def fn(g, m, v, i):
    out = kernels.tile_adam(
      g,
      m,
      v,
      i,
      count=5,
      learning_rate=1e-3,
      implementation=impl,
      interpret=interpret if impl == "pallas" else False,
    )
    return tuple(out)

  return fn


def check_tiles(ctx: Context, cases, blocks, interprets) -> bool:
  """``kernels.tile_adam`` pallas vs xla at density 0.3 with 3 empty slots."""
  ok = True
  for interpret in interprets:
    for (shape, g_dtype, m_dtype), block in zip(
      cases * len(blocks), [b for b in blocks for _ in cases], strict=True
    ):
      args = device_checks.tile_inputs(shape, block, 0.3, g_dtype, m_dtype, empty=3)
      what = (
        f"tile kernel[pallas, interpret={interpret}] {shape} block {block}"
        f" K={len(args[3])} {jnp.dtype(g_dtype).name}/{jnp.dtype(m_dtype).name}"
      )
      try:
        got = jax.jit(_tile_fn("pallas", interpret))(*args)
        want = jax.jit(_tile_fn("xla"))(*args)
      except Exception as e:  # noqa: BLE001
        ok &= check(ctx, what, False, _err(e))
        continue
      err = max(_rel_err(a, b) for a, b in zip(got, want, strict=True))
      tol = 1e-5 if jnp.float32 == g_dtype == m_dtype else 1e-2
      ok &= check(ctx, what, err <= tol, f"worst rel err {err:.1e} (tol {tol:.0e})")
  return ok


def check_donated_copies(ctx: Context, smoke: bool) -> bool:
  """The donated step, compiled for this device, copies no moment: a copy of each
  moment before the step overwrites it (as the generic Pallas interpreter's program
  on a CPU makes for the grouped kernel) would cost a read and a write per entry.
  A positive control keeps the old state alive, which must copy them."""
  shapes = (
    {"w": (48, 40), "v": (40, 24)} if smoke else {"w": (1024, 768), "v": (768, 512)}
  )
  params = {k: jnp.ones(s, jnp.float32) for k, s in shapes.items()}
  pattern = "|".join(rf"f32\[{a},{b}\]" for a, b in shapes.values())
  interp = ctx.interpret
  makers = {
    "adam_magma[pallas]": lambda: magma.adam_magma(
      1e-3, granularity="row", implementation="pallas", interpret=interp
    ),
    "adam_magma[xla]": lambda: magma.adam_magma(1e-3, granularity="row"),
    "magma(optax.adam)": lambda: magma.magma(optax.adam(1e-3), granularity="row"),
  }

  def copies(fn, tx):
    args = (params, tx.init(params), params)
    hlo = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    return re.findall(rf"(?:{pattern})\S* copy(?:-start)?\(", entry)

  if smoke:  # the generic interpreter's program is not the device's
    del makers["adam_magma[pallas]"]
  ok = True
  for name, make in makers.items():
    try:
      tx = make()

      def step(p, s, g, tx=tx):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

      def keep_old(p, s, g, tx=tx):  # positive control: must copy the moments
        u, new = tx.update(g, s, p)
        return optax.apply_updates(p, u), new, s

      n, control = len(copies(step, tx)), len(copies(keep_old, tx))
    except Exception as e:  # noqa: BLE001
      ok &= check(ctx, f"donated {name} copies no moment", False, _err(e))
      continue
    ok &= check(
      ctx,
      f"donated {name} copies no moment",
      n == 0 and control >= 4,
      f"{n} moment copies (control {control}):",
    )
  return ok


def section_checks(ctx: Context) -> dict:
  interprets = _interprets(ctx)
  if ctx.smoke:
    ok = check_kernels(ctx, SMOKE_CASES, interprets)
    ok &= check_optimizer(ctx, 8192, [True])  # Mosaic GPU's interpreter is slow
    ok &= check_top_k(ctx, (256, 512), smoke=True)
    ok &= check_tiles(ctx, SMOKE_TILE_CASES, [(8, 128)], interprets)
    ok &= check_donated_copies(ctx, smoke=True)
  else:
    ok = check_kernels(ctx, CASES, interprets)
    ok &= check_optimizer(ctx, 2_000_000, interprets)
    ok &= check_top_k(ctx, (1024, 1024))
    ok &= check_tiles(ctx, TILE_CASES, [(8, 128), (1, 128)], interprets)
    ok &= check_donated_copies(ctx, smoke=False)
  return {"ok": ok}


def dense_makers(ctx: Context) -> dict:
  lr, interp = 1e-3, ctx.interpret
  makers = {
    BASE: lambda: optax.adam(lr),
    "magma(optax.adam)": lambda: magma.magma(optax.adam(lr), key=0),
    "skip_update(optax.adam)": lambda: magma.skip_update(optax.adam(lr), key=0),
    "adam_magma[xla]": lambda: magma.adam_magma(lr, key=0, implementation="xla"),
    "adam_magma[pallas]": lambda: magma.adam_magma(
      lr, key=0, implementation="pallas", interpret=interp
    ),
    "adam_magma[default]": lambda: magma.adam_magma(lr, key=0, interpret=interp),
  }
  makers.update(rollfast_makers(ctx))
  return makers


def section_dense(ctx: Context, kind: str) -> dict:
  label, params, grads = make_tree(kind, ctx.smoke)
  n = num_params(params)
  title = f"{kind}: {n / 1e6:.1f} M params, {label}, donated"
  ctx.rep.say(f"\n# {title}")
  makers = {
    name: functools.partial(_jax_row, name, make, params, grads)
    for name, make in dense_makers(ctx).items()
  }
  rows = build_rows(ctx, makers, kind, reserve=10)
  a = ctx.args
  times = interleaved(ctx, rows, a.steps, a.blocked, a.rounds)
  summary = summarize(times, n, ctx.roofline_gbps)
  prof = profile(ctx, rows, kind)
  del rows
  torch = torch_rows(ctx, params, kind)
  base_ms = summary.get(BASE, {}).get("pipelined_ms")
  base_blk = summary.get(BASE, {}).get("blocked_ms")
  for name, t in torch.get("rows", {}).items():
    pipe, blk = t["pipelined_ms"], t["blocked_ms"]
    summary[name] = {
      "pipelined_ms": pipe,
      "blocked_ms": blk,
      "x_adam_pipelined": pipe / base_ms if base_ms else None,
      "x_adam_blocked": blk / base_blk if base_blk and blk else None,
      "x_torch_foreach_pipelined": t.get("x_foreach_pipelined"),
      "x_torch_foreach_blocked": t.get("x_foreach_blocked"),
      "gbps": ADAM_BYTES * n / pipe * 1e-6,
      "of_roofline": ADAM_BYTES * n / pipe * 1e-6 / ctx.roofline_gbps
      if ctx.roofline_gbps
      else None,
      "unpaired": True,
      "samples": t.get("samples"),
    }
  prof.update(torch.get("profile", {}))
  table(ctx, title, summary, prof)
  for tree, row, op, limit in DENSE_TARGETS:
    if tree in ("*", kind):
      r = summary.get(row, {})
      value, blocked = r.get("x_adam_pipelined"), r.get("x_adam_blocked")
      what = f"{row}, {kind}, x optax.adam"
      target(ctx, "44", what, value, op, limit, blocked=blocked)
  theirs = summary.get(ROLLFAST_MAGMA, {})
  for row in ("adam_magma[default]", "magma(optax.adam)"):
    ours = summary.get(row, {})
    ratio = {
      how: ours[f"{how}_ms"] / theirs[f"{how}_ms"]
      if ours.get(f"{how}_ms") and theirs.get(f"{how}_ms")
      else None
      for how in ("pipelined", "blocked")
    }
    what = f"{row}, {kind}, x {ROLLFAST_MAGMA} (medians)"
    target(ctx, "44", what, ratio["pipelined"], "<", 1.0, blocked=ratio["blocked"])
  out = {
    "tree": {"label": label, "params": n, "leaves": len(params)},
    "rows": summary,
    "profile": prof,
  }
  if kind == "dense-100m":
    out["kernel_alone"] = kernel_alone(ctx, n)
  return out


def kernel_alone(ctx: Context, n: int) -> dict:
  """``kernels.masked_adam`` alone, pipelined, xla and pallas, against the copy
  roofline (28 bytes per parameter: read g, m, v, p; write m, v and the update).
  Its whole output is the donated carry: nothing it computes goes unused."""
  if ctx.left() < 10:
    ctx.rep.say("kernel alone: skipped: budget spent")
    return {}
  shape = (max(n // 4096, 1), 4096)
  g, m, v, p = (jax.random.normal(jax.random.key(20 + i), shape) for i in range(4))

  def adam(impl, g, m, v, p):
    return kernels.masked_adam(
      g, m, v, count=3, learning_rate=1e-3, params=p, weight_decay=0.1,
      scale=jnp.float32(0.5), implementation=impl,
      interpret=ctx.interpret if impl == "pallas" else False,
    )  # fmt: skip

  def make(impl):
    step = jax.jit(lambda out, g, p: adam(impl, g, out.mu, out.nu, p), donate_argnums=0)
    first = lambda: jax.jit(functools.partial(adam, impl))(g, m, v, p)
    return lambda: FnRow(f"masked_adam[{impl}]", step, first(), (g, p))

  makers = {f"masked_adam[{i}]": make(i) for i in ("xla", "pallas")}
  rows = build_rows(ctx, makers, "dense-100m")
  a = ctx.args
  times = interleaved(ctx, rows, a.steps, 0, a.rounds)
  out = {}
  ctx.rep.say(f"\nkernel alone, {shape[0] * shape[1] / 1e6:.0f} M params, pipelined:")
  for name, t in times.items():
    ms = statistics.median(t["pipelined"]) * 1e3
    gbps = ADAM_BYTES * shape[0] * shape[1] / ms * 1e-6
    frac = gbps / ctx.roofline_gbps if ctx.roofline_gbps else None
    out[name] = {"ms": ms, "gbps": gbps, "of_roofline": frac, "samples": t}
    ctx.rep.say(
      f"  {name}: {ms:.3f} ms, {gbps:.0f} GB/s (28 B/param),"
      f" {fmt(frac, '.0%')} of the roofline"
    )
  frac = out.get("masked_adam[pallas]", {}).get("of_roofline")
  target(
    ctx, "44", "the Pallas kernel at 100 M, of the copy roofline", frac, ">=", 0.80, "%"
  )
  return out


def gate_free(tx):
  """``tx`` whose updates pass ``refresh=False`` (periodic_mask's gate-free step)."""

  def update(updates, state, params=None, **extra_args):
    return tx.update(updates, state, params, refresh=False, **extra_args)

  return optax.GradientTransformationExtraArgs(tx.init, update)


def sparse_makers(ctx: Context, params) -> dict:
  """``name -> (make tx, mask)`` of issue 46's rows."""
  adam = optax.adam(1e-3)
  block = (8, 128)
  tiles = random_tile_mask(params, 0.3, block)
  half = random_mask(params, 0.5)
  matrices = lambda path, x: x.ndim == 2

  def tile_adam(impl):
    return lambda: magma.sparse_adam(
      1e-3,
      mode="compact",
      density=0.3,
      block=block,
      where=matrices,
      implementation=impl,
      interpret=ctx.interpret if impl == "pallas" else False,
    )

  makers = {
    BASE: (lambda: adam, None),
    ORDINARY: (
      lambda: magma.periodic_mask(adam, sparsity=0.5, every=10**6),
      None,
    ),
    # The ordinary step of a loop that passes refresh= itself: no gate at all.
    GATE_FREE: (
      lambda: gate_free(magma.periodic_mask(adam, sparsity=0.5, every=10**6)),
      None,
    ),
    "sparse_state skip, density 0.5": (
      lambda: magma.sparse_state(adam, mode="skip"),
      half,
    ),
    "sparse_state compact, density 0.5": (
      lambda: magma.sparse_state(adam, mode="compact", density=0.5),
      half,
    ),
    "sparse_adam tiles (8, 128), density 0.3": (tile_adam(None), tiles),
  }
  makers["sparse_adam tiles (8, 128), density 0.3 [pallas]"] = (
    tile_adam("pallas"),
    tiles,
  )
  return makers


def section_sparse(ctx: Context, kind: str) -> dict:
  label, params, grads = make_tree(kind, ctx.smoke)
  n = num_params(params)
  title = f"{kind}: {n / 1e6:.1f} M params, {label}, donated"
  ctx.rep.say(f"\n# {title}")
  makers = {
    name: functools.partial(_jax_row, name, make, params, grads, mask)
    for name, (make, mask) in sparse_makers(ctx, params).items()
  }
  rows = build_rows(ctx, makers, kind, reserve=10)
  a = ctx.args
  times = interleaved(ctx, rows, a.steps, a.blocked, a.rounds)
  summary = summarize(times, n, ctx.roofline_gbps)
  prof = profile(ctx, rows, kind)
  table(ctx, title, summary, prof)
  for row, op, limit in SPARSE_TARGETS:
    r = summary.get(row, {})
    value, blocked = r.get("x_adam_pipelined"), r.get("x_adam_blocked")
    target(ctx, "46", f"{row}, {kind}, x optax.adam", value, op, limit, blocked=blocked)
  refresh = refresh_cost(ctx, kind, params, grads, rows)
  return {
    "tree": {"label": label, "params": n, "leaves": len(params)},
    "rows": summary,
    "profile": prof,
    "refresh": refresh,
  }


def _jax_row(name, make, params, grads, mask=None) -> JaxRow:
  return JaxRow(name, make(), params, grads, mask)


def refresh_cost(ctx: Context, kind: str, params, grads, rows: list) -> dict:
  """One refresh at ``every=100``: chunks of 100 steps (one refresh each) against
  chunks of the ordinary step, interleaved, pipelined and blocked."""
  every = 100
  ordinary = ORDINARY
  by_name = {r.name: r for r in rows}
  if BASE not in by_name or ordinary not in by_name:
    ctx.rep.say("refresh: skipped: optax.adam or the ordinary step did not run")
    return {}
  rounds = min(ctx.args.rounds, 4)
  ramp = magma.linear_sparsity_schedule(
    0.5, begin_step=0, end_step=10 * every, initial_sparsity=0.1
  )
  adam = optax.adam(1e-3)
  makers = {
    "refresh, constant 0.5": lambda: JaxRow(
      "refresh, constant 0.5",
      magma.periodic_mask(adam, sparsity=0.5, every=every),
      params,
      grads,
    ),
    "refresh, ramp 0.1 -> 0.5": lambda: JaxRow(
      "refresh, ramp 0.1 -> 0.5",
      magma.periodic_mask(adam, sparsity=ramp, every=every),
      params,
      grads,
    ),
  }
  new = build_rows(ctx, makers, kind, reserve=8)
  if not new:
    ctx.rep.say("refresh: no row ran")
    return {}
  base, plain = by_name[BASE], by_name[ordinary]
  times = interleaved(ctx, [base, plain, *new], every, 0, rounds)
  blocked = {}
  for row in (plain, *new):
    blocked[row.name] = row.blocked(every)
  out = {}
  ctx.rep.say(
    f"\n| {kind}: one refresh at every={every} | adds to the run (pipelined) |"
    " in Adam steps | adds (blocked) |"
  )
  ctx.rep.say("|---|---:|---:|---:|")
  for row in new:
    t, o, b = (times[x]["pipelined"] for x in (row.name, ordinary, BASE))
    share = statistics.median(x / y - 1 for x, y in zip(t, o, strict=True))
    steps = statistics.median(
      (x - y) * every / z for x, y, z in zip(t, o, b, strict=True)
    )
    ts = blocked[row.name]
    cost = max(ts) - statistics.median(ts)
    share_blocked = cost / (every * statistics.median(blocked[ordinary]))
    out[row.name] = {
      "share_pipelined": share,
      "adam_steps": steps,
      "share_blocked": share_blocked,
      "refresh_ms_blocked": cost * 1e3,
      "samples": times[row.name],
      "blocked": ts,
    }
    ctx.rep.say(f"| {row.name} | {share:.1%} | {steps:.1f} | {share_blocked:.1%} |")
  for name, r in out.items():
    what = f"{name} at every={every}, {kind}, share of the run"
    value, blk = r["share_pipelined"], r["share_blocked"]
    target(ctx, "46", what, value, "<=", 0.03, "%", blocked=blk)
    if kind == "sparse-8m":  # issue 46 deliverable 3
      what = f"{name}, {kind}, one refresh in ordinary Adam steps"
      target(ctx, "46", what, r["adam_steps"], "<=", 3.0)
  return out


def section_tile_bandwidth(ctx: Context) -> dict:
  """The tile kernel alone vs its XLA reference, moments donated, pipelined; bytes
  = 24 per active entry (read g, read and write m and v, write the update)."""
  shape = (32, 256) if ctx.smoke else (2048, 2048)
  out = {}
  for block in [(8, 128)] if ctx.smoke else [(8, 128), (1, 128)]:
    for density in [0.3] if ctx.smoke else [0.1, 0.3, 1.0]:
      g, mu, nu, idx = device_checks.tile_inputs(
        shape, block, density, jnp.float32, jnp.float32
      )

      def make(impl, g=g, idx=idx, mu=mu, nu=nu):
        fn = _tile_fn(impl, ctx.interpret)
        step = jax.jit(lambda c, g, j: fn(g, c[0], c[1], j)[:2], donate_argnums=0)
        carry = (jnp.copy(mu), jnp.copy(nu))
        return lambda: FnRow(f"tile_adam[{impl}]", step, carry, (g, idx))

      makers = {f"tile_adam[{i}]": make(i) for i in ("pallas", "xla")}
      rows = build_rows(ctx, makers, "tile-bandwidth")
      times = interleaved(ctx, rows, ctx.args.steps, 0, ctx.args.rounds)
      nbytes = mu.size * 24
      line = f"tile bandwidth {shape} block {block} density {density} K={len(idx)}:"
      for name, t in times.items():
        ms = statistics.median(t["pipelined"]) * 1e3
        out[f"{name} {block} {density}"] = {"ms": ms, "gbps": nbytes / ms * 1e-6}
        line += f" {name} {ms:.3f} ms ({nbytes / ms * 1e-6:.0f} GB/s)"
      ctx.rep.say(line)
  return out


# ---------------------------------------------------------------- main


def header(ctx: Context) -> None:
  dev = jax.devices()[0]
  meta = ctx.rep.data["meta"]
  meta.update(
    jax=jax.__version__,
    optax=optax.__version__,
    device=dev.device_kind,
    backend=jax.default_backend(),
    args=vars(ctx.args),
    default_implementations=list(kernels.DEFAULT_IMPLEMENTATIONS),
    python=sys.version.split()[0],
  )
  ctx.rep.say(
    f"# jax {jax.__version__}, optax {optax.__version__}, {dev.device_kind}"
    f" ({jax.default_backend()}), python {meta['python']}"
  )
  ctx.rep.say(
    f"adam_magma's default implementation: {kernels.DEFAULT_IMPLEMENTATIONS};"
    f" budget {ctx.args.budget_s:.0f} s, {ctx.args.rounds} rounds of"
    f" {ctx.args.steps} pipelined + {ctx.args.blocked} blocked steps"
  )
  if ctx.smoke:
    ctx.rep.say("smoke run: Pallas interpreted, tiny sizes; timings mean nothing")


def run_sections(ctx: Context, names: list[str]) -> bool:
  ok = True
  funcs = {
    "roofline": section_roofline,
    "checks": section_checks,
    "tile-bandwidth": section_tile_bandwidth,
  }
  for name in names:
    need = 0 if ctx.smoke else NEEDS[name]
    record = ctx.rep.data["sections"].setdefault(name, {})
    if ctx.left() < need:
      ctx.rep.say(
        f"\n# {name}: skipped: {ctx.left():.0f} s left of the budget, needs ~{need} s"
      )
      record["status"] = "skipped: budget"
      continue
    t0, c0 = time.perf_counter(), time.process_time()
    try:
      if name in funcs:
        result = funcs[name](ctx)
      elif name.startswith("dense-"):
        result = section_dense(ctx, name)
      else:
        result = section_sparse(ctx, name)
      record.update(result or {})
      record["status"] = "done"
      if name == "checks":
        ok &= bool(result["ok"])
    except Exception as e:  # noqa: BLE001 -- report, go on with the next section
      ctx.rep.say(f"{name}: FAILED {_err(e)}")
      record["status"] = f"failed: {_err(e)}"
      record["traceback"] = traceback.format_exc()[-4000:]
      if name == "checks":
        ok = False
    record["wall_s"] = time.perf_counter() - t0
    record["cpu_s"] = time.process_time() - c0
    ctx.rep.say(
      f"[{name}: {record['wall_s']:.1f} s ({record['cpu_s']:.1f} s CPU);"
      f" {ctx.left():.0f} s of the budget left]"
    )
    ctx.rep.save()
  return ok


def final_summary(ctx: Context, names: list[str]) -> None:
  ctx.rep.say("\n## targets (issue 44 deliverable 5, issue 46 deliverable 4)")
  for t in ctx.rep.data["targets"]:
    shown = "-" if t["value"] is None else f"{t['value']:.3g}"
    ctx.rep.say(
      f"- [{t['issue']}] {t['what']}: {shown} {t['op']} {t['limit']}: {t['verdict']}"
    )
  missing = [
    n for n in names if ctx.rep.data["sections"].get(n, {}).get("status") != "done"
  ]
  not_run = [n for n in SECTIONS if n not in names]
  if missing or not_run:
    ctx.rep.say(f"unmeasured: sections not done {missing}, not asked for {not_run}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--smoke", action="store_true", help="tiny sizes, Pallas interpreted (any machine)"
  )
  parser.add_argument(
    "--budget-s",
    type=float,
    default=None,
    help="wall-clock seconds for the run after the imports (default 330; smoke: none)",
  )
  parser.add_argument(
    "--out",
    default=os.environ.get("OUT"),
    help="folder for the log, the JSON and traces (default $OUT)",
  )
  parser.add_argument(
    "--sections",
    default=",".join(SECTIONS),
    help=f"comma-separated, run in this order: {SECTIONS}",
  )
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--steps", type=int, default=20, help="pipelined steps a round")
  parser.add_argument("--blocked", type=int, default=5, help="blocked steps a round")
  parser.add_argument(
    "--timing-s",
    type=float,
    default=15.0,
    help="seconds of timing rounds per table at most (never fewer than 3 rounds)",
  )
  parser.add_argument(
    "--profile-steps",
    type=int,
    default=3,
    help="steps per row in the profiler trace (0: no profile)",
  )
  parser.add_argument(
    "--keep-traces", type=int, default=3, help="traces copied to --out (each < 15 MB)"
  )
  parser.add_argument("--no-torch", action="store_true", help="skip the torch peers")
  args = parser.parse_args(argv)
  names = [s for s in args.sections.split(",") if s]
  unknown = set(names) - set(SECTIONS)
  if unknown:
    parser.error(f"unknown sections {sorted(unknown)}; known: {SECTIONS}")
  if args.smoke:
    args.rounds, args.steps, args.blocked = 1, 2, 1
    args.profile_steps = min(args.profile_steps, 1)
  rep = Report(args.out)
  if args.budget_s is None:
    args.budget_s = float("inf") if args.smoke else 330.0
  ctx = Context(args, rep, _START + args.budget_s)
  try:
    header(ctx)
    if not args.smoke and jax.default_backend() != "gpu":
      rep.say(
        "no GPU: this script measures a GPU; nothing to do (--smoke runs anywhere)."
      )
      return 0
    if not args.no_torch:
      ctx.torch = TorchPeers("cpu" if args.smoke else "cuda")
    ok = run_sections(ctx, names)
    final_summary(ctx, names)
    rep.say(f"\ntotal {time.perf_counter() - _START:.0f} s")
    if not ok:
      rep.say("SOME CHECKS FAILED")
    elif rep.data["sections"].get("checks", {}).get("status") != "done":
      rep.say("CHECKS NOT RUN (see above)")
    else:
      rep.say("ALL CHECKS OK")
    rep.data["ok"] = ok
    return 0 if ok else 1
  finally:
    if ctx.torch is not None:
      ctx.torch.close()
    rep.close()


if __name__ == "__main__":
  sys.exit(main())
