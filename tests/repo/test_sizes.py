"""Sizes a reader can hold: no library module over 900 lines, no function over 150."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "magma_optax"
MAX_MODULE_LINES = 900
MAX_FUNCTION_LINES = 150


def too_long(source: str, where: str) -> list[str]:
  """``where: name (lines)`` of each function in ``source`` over the limit, and of
  the module itself."""
  found = []
  lines = len(source.splitlines())
  if lines > MAX_MODULE_LINES:
    found.append(f"{where} ({lines} lines)")
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
      n = node.end_lineno - node.lineno + 1
      if n > MAX_FUNCTION_LINES:
        found.append(f"{where}: {node.name} ({n} lines)")
  return found


def test_modules_and_functions_stay_short():
  files = sorted(PACKAGE.rglob("*.py"))
  assert len(files) > 40, "the package was not found"
  found = [
    x for f in files for x in too_long(f.read_text(), str(f.relative_to(PACKAGE)))
  ]
  assert not found, found
  # Positive control: a long function and a long module are seen.
  body = "\n".join(f"  x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
  assert too_long(f"def f():\n{body}\n", "f.py") == [
    f"f.py: f ({MAX_FUNCTION_LINES + 1} lines)"
  ]
  assert too_long("x = 1\n" * (MAX_MODULE_LINES + 1), "m.py") == ["m.py (901 lines)"]
