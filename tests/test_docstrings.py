"""Every docstring example of the public API runs (doctest)."""

import doctest
import importlib
import pkgutil

import pytest

import magma_optax

MODULES = sorted(
  m.name
  for m in pkgutil.walk_packages(magma_optax.__path__, "magma_optax.")
  if m.name != "magma_optax.demo"
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  try:
    module = importlib.import_module(name)
  except ImportError as e:  # an optional backend (e.g. Pallas on an old jax)
    pytest.skip(f"{name} not importable here: {e}")
  result = doctest.testmod(
    module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  )
  assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
