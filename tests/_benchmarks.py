"""Imports a script of ``benchmarks/`` by path (the folder is not a package)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(filename: str) -> ModuleType:
  """``benchmarks/<filename>`` as a module named after it (``_benchmark`` added)."""
  name = filename.removesuffix(".py") + "_benchmark"
  spec = importlib.util.spec_from_file_location(name, BENCHMARKS / filename)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses look their module up while it runs
  spec.loader.exec_module(module)
  return module
