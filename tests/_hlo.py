"""The optimized HLO of a donated step, for tests that check what XLA copies."""

from __future__ import annotations

import re

import jax


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
