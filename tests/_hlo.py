"""What XLA makes of a step: the optimized HLO of a donated step (what XLA copies),
and the program lowered for a device that is not attached (its control flow and
kernel calls)."""

from __future__ import annotations

import contextlib
import re

import jax
import pytest

from magma_optax._core import compat as _compat


def entry_ops(fn, args, pattern: str, op: str = "copy") -> list[str]:
  """``op`` instructions (``copy``, ``fusion``, ...) of the compiled ``fn(*args)``
  (first two arguments donated) whose result type matches ``pattern`` (a regex
  such as ``r"f32\\[64,48\\]"``), in the entry computation: what every step does
  (a loop body's run only sometimes).
  """
  lowered = jax.jit(fn, donate_argnums=(0, 1)).lower(*args)
  hlo = lowered.compile().as_text()
  entry = hlo[hlo.index("\nENTRY") :]
  entry = entry[: entry.index("\n}")]
  return re.findall(rf"(?:{pattern})\S* {op}\(", entry)


def entry_copies(fn, args, pattern: str) -> list[str]:
  """The ``copy`` ops of :func:`entry_ops`: the copies every step makes."""
  return entry_ops(fn, args, pattern, "copy")


def fusions_computing(fn, args, pattern: str, inner: str) -> list[str]:
  """The ``fusion`` instructions of :func:`entry_ops` (result type matching
  ``pattern``) whose fused computation contains an ``inner`` instruction (such as
  ``sqrt``): what XLA evaluates once per element of that result."""
  lowered = jax.jit(fn, donate_argnums=(0, 1)).lower(*args)
  hlo = lowered.compile().as_text()
  bodies = {}
  for block in hlo.split("\n\n"):
    head = re.match(r"\s*(?:ENTRY )?(%\S+)", block)
    if head:
      bodies[head.group(1)] = block
  entry = hlo[hlo.index("\nENTRY") :]
  entry = entry[: entry.index("\n}")]
  found = re.findall(rf"(?:{pattern})\S* fusion\(.*?calls=(%[\w.\-]+)", entry)
  return [c for c in found if re.search(rf" {inner}\(", bodies.get(c, ""))]


_SSA = r"%[A-Za-z0-9_.$-]+"


def _uses(expr: str) -> list[str]:
  """The SSA values ``expr`` reads (``%x#3`` read as ``%x``)."""
  return re.findall(_SSA, expr)


def _defined(lhs: str) -> list[str]:
  """The SSA values a left-hand side ``%a, %b`` or ``%x:3`` defines."""
  return [re.sub(r":\d+$", "", n.strip()) for n in lhs.split(",")]


def _depth_change(line: str) -> int:
  # Attribute dictionaries ({jax.result_info = ...}) open and close on one line.
  return line.count("{") - line.count("}")


def data_dependent_control_flow(text: str) -> dict[str, int]:
  """Counts of the data-dependent ``while``, ``case`` and ``if`` ops of a
  StableHLO module (``jax.jit(f).trace(...).lower(...).as_text()``).

  What XLA:GPU (and TPU) runs by reading a predicate back to the host. Not
  counted: a ``case``/``if`` whose index is computed from constants alone (what
  ``jax.lax.platform_dependent`` emits; XLA folds it), and a ``while`` with a
  known trip count -- its ``cond`` compares a counter that starts at a constant
  and grows by a constant (``lax.fori_loop``) with a constant. A value is data
  where it is computed (transitively) from a function argument (every function's,
  conservatively: a private function's arguments count as data), a loop's carry,
  or a region that reads data.
  """
  counts = {"while": 0, "case": 0, "if": 0}
  for kind, _, _, _ in _control_flow_ops(text):
    if kind in counts:
      counts[kind] += 1
  return counts


def top_level_control_flow(text: str) -> dict[str, int]:
  """The ops of :func:`data_dependent_control_flow` that every run of the program
  reaches: those not nested inside another one (a gate), following calls.

  An op inside a private function counts once per call of that function from
  outside every gate (``main``'s own ops, and the functions those call). What a
  gate holds runs only when its predicate lets it: on the steps it opens.
  """
  ops = _control_flow_ops(text)
  own: dict[str, dict[str, int]] = {}
  calls: dict[str, list[str]] = {}
  for kind, func, gated, callee in ops:
    if gated:
      continue
    if kind == "call":
      calls.setdefault(func, []).append(callee)
    else:
      own.setdefault(func, {"while": 0, "case": 0, "if": 0})[kind] += 1

  def total(func, seen=()):
    out = dict(own.get(func, {"while": 0, "case": 0, "if": 0}))
    for callee in calls.get(func, []):
      if callee in seen:  # no recursion in StableHLO; guard anyway
        continue
      for k, v in total(callee, (*seen, func)).items():
        out[k] += v
    return out

  return total("main")


def _control_flow_ops(text: str) -> list[tuple[str, str, bool, str | None]]:
  """``(kind, function, gated, callee)`` per data-dependent ``while`` / ``case`` /
  ``if`` (``callee`` ``None``) and per ``call`` (kind ``"call"``) of ``text``, in
  order: ``gated`` where it sits inside a data-dependent op of its function."""
  found = []
  data: set[str] = set()
  # Open ops with regions: [defined names, depth before, reads data, while info,
  # opens a gate].
  stack: list[list] = []
  depth = 0
  func = None
  lines = text.splitlines()
  for n, line in enumerate(lines):
    head = re.match(r"\s*func\.func .*?@([\w.$-]+)\((.*)", line)
    if head:
      func = head.group(1)
      for arg, attrs in re.findall(r"(%arg\d+): [^,{)]+(\{[^}]*\})?", head.group(2)):
        if "jax.global_constant" not in attrs:
          data.add(arg)
      depth += _depth_change(line)
      continue
    gated = any(op[4] for op in stack)
    m = re.match(rf"\s*((?:{_SSA}(?::\d+)?)(?:, {_SSA}(?::\d+)?)*) = (.*)", line)
    names, rhs = (_defined(m.group(1)), m.group(2)) if m else ([], line)
    callee = re.search(r"\bcall @([\w.$-]+)\(", rhs)
    if callee:
      found.append(("call", func, gated, callee.group(1)))
    reads = any(u in data for u in _uses(rhs))
    if reads:
      for op in stack:
        op[2] = True
    opens_while = bool(m) and rhs.startswith("stablehlo.while(")
    if opens_while:
      inits = re.findall(rf"({_SSA}) = ({_SSA})", rhs)
      data.update(a for a, _ in inits)  # carries are data inside the loop
      known = _known_trip_count(lines, n, data)
      info = {"inits": dict(inits), "known": known, "gated": gated}
      stack.append([names, depth, reads, info, not known])
      depth += _depth_change(line)
      continue
    gate = False
    if m and ("stablehlo.case" in rhs or rhs.startswith("stablehlo.if")):
      index = _uses(rhs)[0]
      if index in data:
        found.append(("case" if "case" in rhs else "if", func, gated, None))
        gate = True
    before = depth
    depth += _depth_change(line)
    if m and depth > before:  # an op with regions opens here
      stack.append([names, before, reads, None, gate])
      continue
    if reads:
      data.update(names)
    while (
      stack and depth <= stack[-1][1] and (stack[-1][3] is None or line.strip() == "}")
    ):
      op_names, _, op_reads, info, _ = stack.pop()
      if info is not None and not info["known"]:
        found.append(("while", func, info["gated"], None))
      if op_reads:
        data.update(op_names)
        if stack:
          stack[-1][2] = True
  return found


def _known_trip_count(lines: list[str], start: int, data: set[str]) -> bool:
  """Whether the ``while`` opened at ``lines[start]`` is a counted loop: its
  ``cond`` compares a counter with a constant, the counter starts at a value that
  is no data (``data``: the values computed from data so far) and its body adds
  a constant to it. (A constant may come through ops of constants alone, such as
  sharding constraints.)"""
  inits = dict(re.findall(rf"({_SSA}) = ({_SSA})", lines[start]))
  order = list(inits)

  def region(i):
    """The lines of the region that opens after ``lines[i]``, and its end."""
    body, depth = [], 1
    i += 1
    while True:
      depth += _depth_change(lines[i])
      # Its own `} do {` only: a loop nested in the region has one too.
      if depth == 0 or (depth == 1 and lines[i].strip() == "} do {"):
        return body, i
      body.append(lines[i])
      i += 1

  def constants(body):
    """The values of ``body`` computed from constants alone."""
    found = set()
    for ln in body:
      m = re.match(rf"\s*({_SSA}) = (.*)", ln)
      if m and all(u in found for u in _uses(m.group(2))):
        found.add(m.group(1))
    return found

  def aliases(body):
    """Per value of ``body`` that only constrains another's sharding, that one."""
    found = {}
    for ln in body:
      m = re.match(rf"\s*({_SSA}) = sdy\.sharding_constraint ({_SSA})", ln)
      if m:
        found[m.group(1)] = found.get(m.group(2), m.group(2))
    return found

  assert lines[start + 1].strip() == "cond {", lines[start + 1]
  cond, end = region(start + 1)
  known = constants(cond)
  alias = aliases(cond)
  defs = {
    m.group(1): m.group(2)
    for m in (re.match(rf"\s*({_SSA}) = (.*)", ln) for ln in cond)
    if m
  }
  ret = re.match(rf"\s*stablehlo\.return ({_SSA})", cond[-1])
  compare = defs.get(ret.group(1), "") if ret else ""
  if not compare.startswith("stablehlo.compare"):
    return False
  x, y = (alias.get(u, u) for u in _uses(compare)[:2])
  counter = x if y in known else y if x in known else None
  if counter not in inits or inits[counter] in data:
    return False
  body, _ = region(end)
  known, alias = constants(body), aliases(body)
  step = _uses(body[-1].split("stablehlo.return", 1)[1])[order.index(counter)]
  step = alias.get(step, step)
  for ln in body:
    m = re.match(rf"\s*{re.escape(step)} = stablehlo\.add (.*)", ln)
    if m:
      a, b = (alias.get(u, u) for u in _uses(m.group(1))[:2])
      return counter in (a, b) and (a in known or b in known)
  return False


def abstract_gpu():
  """A context in which jax lowers for an H100 though none is attached.

  jax >= 0.11 asks Pallas' Triton lowering for the target GPU (a real one, or an
  abstract device on an abstract mesh); older versions lower without asking.
  """
  if not _compat.TRITON_DEPRECATED:
    return contextlib.nullcontext()
  if not hasattr(jax.sharding, "AbstractDevice"):
    pytest.skip(f"jax {jax.__version__} has no jax.sharding.AbstractDevice")
  device = jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"
  )
  mesh = jax.sharding.AbstractMesh(
    (1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device
  )
  return jax.sharding.use_abstract_mesh(mesh)


def lowered(fn, *args, platform: str = "cuda") -> str:
  """The StableHLO text of ``jax.jit(fn)`` on ``args``, lowered for ``platform``
  (``"cuda"`` under :func:`abstract_gpu`, as Pallas' Triton lowering needs)."""
  context = abstract_gpu() if platform == "cuda" else contextlib.nullcontext()
  with context:
    traced = jax.jit(fn).trace(*args)
    return traced.lower(lowering_platforms=(platform,)).as_text()


def pallas_calls(text: str) -> int:
  """The Pallas kernel calls of a lowered program: Triton (``xla.gpu.triton``),
  Mosaic GPU (``mosaic_gpu``) and Mosaic TPU (``tpu_custom_call``) custom calls."""
  return len(
    re.findall(
      r"stablehlo\.custom_call @(?:__gpu\$xla\.gpu\.triton|mosaic_gpu\w*|"
      r"tpu_custom_call)\b",
      text,
    )
  )
