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
