"""Every docstring example of the public API runs (doctest), and examples exist."""

import doctest
import importlib
import inspect
import pkgutil

import pytest

import magma_optax

MODULES = sorted(
  m.name
  for m in pkgutil.walk_packages(magma_optax.__path__, "magma_optax.")
  if m.name not in ("magma_optax.demo.run", "magma_optax.demo.__main__")
)
# Modules with no examples of their own: internals, package __init__ files that only
# re-export, and kernel back ends whose entry point (kernels.api) has the example.
NO_EXAMPLES = {
  "magma_optax._core",
  "magma_optax._core.arguments",
  "magma_optax._core.compat",
  "magma_optax._core.geometry",
  "magma_optax._core.mask_bounds",
  "magma_optax._core.schedules",
  "magma_optax._core.scoping",
  "magma_optax._core.shard_map",
  "magma_optax._core.sharded",
  "magma_optax._core.xla_cpu",
  "magma_optax.demo",
  "magma_optax.flax",
  "magma_optax.kernels",
  "magma_optax.kernels.config",
  "magma_optax.kernels.dispatch",
  "magma_optax.kernels.mosaic_gpu",
  "magma_optax.kernels.mosaic_tpu",
  "magma_optax.kernels.partitioned",
  "magma_optax.kernels.reference",
  "magma_optax.kernels.rows",
  "magma_optax.kernels.tiles",
  "magma_optax.kernels.triton",
  "magma_optax.masking",
  "magma_optax.pruning",
  "magma_optax.sparse",
  "magma_optax.sparse.compact",
  "magma_optax.sparse.indices",
  "magma_optax.sparse.nm",
  "magma_optax.sparse.sharded_tiles",
  "magma_optax.sparse.skip",
  "magma_optax.sparse.step",
  "magma_optax.sparse.storage",
  "magma_optax.sparse.tiles",
}


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
  # A module that should have examples but lost them would pass the line above.
  assert (result.attempted == 0) == (name in NO_EXAMPLES), (name, result)


@pytest.mark.parametrize("module", [magma_optax, magma_optax.sharding])
def test_every_public_function_has_an_example(module):
  functions = [
    name for name in module.__all__ if inspect.isfunction(getattr(module, name))
  ]
  assert len(functions) >= 4
  missing = [n for n in functions if ">>>" not in (getattr(module, n).__doc__ or "")]
  assert not missing, f"public functions without a docstring example: {missing}"
