"""``optax.inject_hyperparams(factory)(...)`` over ``adam_magma``, ``sparse_adam`` and
``sparse_state``, checked against what optax expects of a factory it wraps.

optax's test battery for contributed optimizers (``optax/contrib/_common_test.py`` of
optax 0.2.8) wraps a factory in ``inject_hyperparams`` listing only the arguments it
knows cannot be injected, runs ``init`` and ``update`` under ``jax.jit``, and expects
the updates and the new inner state of the plain factory (rtol 1e-5; atol 1e-5 for
the state); elsewhere: extra args accepted, no recompilation on the second call,
``optax.tree.map_params``. Here the same, for optax's common idiom -- every numeric
argument injected, defaults included -- on XLA and on each Pallas kernel in its
interpreter, plus:

* what ``inject_hyperparams`` injects (an optax release that injects another set
  fails here first);
* values exact in float32 give the plain factory's updates and states bit for bit,
  also after the injected values are changed in the state, with no recompilation
  (the kernels read them at run time);
* Adam's moments with the default values equal those of
  ``inject_hyperparams(optax.adam)`` bit for bit on XLA (``1 - b2`` of a float32
  ``b2`` differs from that of a Python float, so against the plain factory
  optax's own tolerances apply);
* numbers that shape compact storage (``density``, ``density_threshold``, ``axis``
  with ``structure``) must be static, and their error names ``static_args``; the
  others (skip storage's ``density_threshold``, ``axis``, ``offload_after``) take
  the injected arrays.
"""

import functools
import inspect
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compiles import count_compiles

import magma_optax as magma
from magma_optax._core import compat as _compat

BLOCK = (8, 128)
STORAGE = ("density", "density_threshold")  # what compact tile storage keeps static


class Case(NamedTuple):
  factory: Any
  kwargs: dict
  static_args: tuple = ()
  tiles: bool = False  # params and param_mask of whole BLOCK tiles


def _interpreted(factory, static_args=(), **kwargs):
  """A case per Pallas interpreter (Mosaic GPU's on jax >= 0.12)."""
  interpreters = [("triton", True), ("tpu", "tpu")]
  if _compat.has_mosaic_gpu():
    interpreters.append(("mosaic_gpu", "gpu"))
  tiles = "block" in kwargs
  return {
    name: Case(
      factory,
      dict(kwargs, implementation="pallas", interpret=interpret),
      static_args,
      tiles,
    )
    for name, interpret in interpreters
  }


TILES = dict(mode="compact", density=0.5, block=BLOCK)
CASES = {
  "adam_magma": Case(magma.adam_magma, dict(key=3)),
  **{f"adam_magma_{k}": v for k, v in _interpreted(magma.adam_magma, key=3).items()},
  "sparse_adam": Case(magma.sparse_adam, {}),
  "sparse_adam_tiles": Case(magma.sparse_adam, TILES, STORAGE, tiles=True),
  **{
    f"sparse_adam_tiles_{k}": v
    for k, v in _interpreted(magma.sparse_adam, STORAGE, **TILES).items()
  },
  "sparse_state": Case(functools.partial(magma.sparse_state, optax.adam(2.0**-7)), {}),
}
NAMES = sorted(CASES)
# Values exact in float32, their 1 - b too (a Python float and its float32 array give
# the same step), and a second set that a test writes into the injected state.
EXACT = dict(
  learning_rate=2.0**-7, b1=0.75, b2=0.9375, eps=2.0**-20, eps_root=2.0**-30,
  weight_decay=0.125, score_decay=0.875,
)  # fmt: skip
CHANGED = dict(learning_rate=2.0**-6, b1=0.5, b2=0.875, eps=2.0**-16, weight_decay=0.25)


def _values(case, values):
  """The entries of ``values`` that the case's factory takes."""
  takes = inspect.signature(case.factory).parameters
  return {k: v for k, v in values.items() if k in takes}


def _learning_rate(case):
  """``learning_rate=1e-2`` for a factory that takes one (not sparse_state)."""
  return _values(case, dict(learning_rate=1e-2))


def _problem(case, random=True):
  """(params, grads per step, extra args): BLOCK tiles with a mask of two of them
  for tile storage, else the params of optax's battery; random gradients, or
  optax's (ones, of the sign opposite to the params)."""
  if case.tiles:
    params = {"w": jnp.linspace(-1.0, 1.0, 16 * 256).reshape(16, 256)}
    mask = jnp.zeros((2, 8, 2, 128), bool).at[0, :, 1].set(True).at[1, :, 0].set(True)
    extra = {"param_mask": {"w": mask.reshape(16, 256)}}
  else:
    params = [-jnp.ones((2, 3)), jnp.ones((2, 5, 2))]
    extra = {}
  if not random:
    return params, [jax.tree.map(lambda p: -jnp.sign(p), params)] * 3, extra
  keys = jax.random.split(jax.random.key(7), 3)
  grads = [
    jax.tree.map(lambda p, k=k: jax.random.normal(k, p.shape), params) for k in keys
  ]
  return params, grads, extra


def _key_data(tree):
  """Typed PRNG keys (in Magma's state) as their data, for comparisons."""
  return jax.tree.map(
    lambda x: (
      jax.random.key_data(x)
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
      else x
    ),
    tree,
  )


def _assert_trees_equal(a, b, what):
  a, b = _key_data(a), _key_data(b)
  assert jax.tree.structure(a) == jax.tree.structure(b), what
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y, err_msg=what)


def _injected(case, **values):
  return optax.inject_hyperparams(case.factory, static_args=case.static_args)(
    **case.kwargs, **values
  )


def _plain(case, **values):
  return case.factory(**case.kwargs, **values)


EXPECTED_INJECTED = {
  magma.adam_magma: {
    "learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay", "tau",
    "keep_prob", "key", "score_decay", "init_score",
  },
  magma.sparse_adam: {
    "learning_rate", "b1", "b2", "eps", "eps_root", "axis", "density_threshold",
    "offload_after",
  },
  "sparse_state": {"axis", "density_threshold", "offload_after"},
}  # fmt: skip


@pytest.mark.parametrize("name", ["adam_magma", "sparse_adam", "sparse_state"])
def test_optax_injects_every_numeric_argument(name):
  case = CASES[name]
  params, _, _ = _problem(case)
  state = jax.jit(_injected(case, **_learning_rate(case)).init)(params)
  key = name if name == "sparse_state" else case.factory
  assert set(state.hyperparams) == EXPECTED_INJECTED[key]
  for k, x in state.hyperparams.items():  # floats as the params, ints as int32
    assert x.dtype in (jnp.float32, jnp.int32), (k, x.dtype)


@pytest.mark.parametrize("name", NAMES)
def test_exact_values_give_the_plain_step_bit_for_bit(name):
  """Three jitted steps, the injected values changed in the state before the last
  (no recompilation): updates and states bit-equal to the plain factory's."""
  case = CASES[name]
  params, grads, extra = _problem(case)
  first, then = _values(case, EXACT), _values(case, dict(EXACT, **CHANGED))
  injected = _injected(case, **first)
  plain = [_plain(case, **first), _plain(case, **then)]

  @jax.jit
  def inject_step(g, state):
    return injected.update(g, state, params, **extra)

  steps = [jax.jit(functools.partial(p.update, params=params, **extra)) for p in plain]
  state, want_state = jax.jit(injected.init)(params), jax.jit(plain[0].init)(params)
  for i, g in enumerate(grads):
    if i == 2:  # the new values reach the compiled step as data
      hyper = state.hyperparams
      new = {k: jnp.asarray(v, hyper[k].dtype) for k, v in then.items()}
      state = state._replace(hyperparams=dict(hyper, **new))
      assert count_compiles(inject_step, g, state) == 0
    u, state = inject_step(g, state)
    want_u, want_state = steps[i == 2](g, want_state)
    _assert_trees_equal(u, want_u, f"updates of step {i + 1}")
    _assert_trees_equal(state.inner_state, want_state, f"state after step {i + 1}")


@pytest.mark.parametrize("name", NAMES)
def test_defaults_within_optax_tolerances_and_no_recompilation(name):
  """optax's expectations on its gradients: jitted init and update, extra args, no
  recompilation, map_params, and the plain factory's updates (rtol 1e-5) and state
  (rtol 1e-5, atol 1e-5)."""
  case = CASES[name]
  params, grads, extra = _problem(case, random=False)
  injected, plain = (
    _injected(case, **_learning_rate(case)),
    _plain(case, **_learning_rate(case)),
  )

  def stepper(tx):
    return jax.jit(
      lambda g, state: tx.update(g, state, params, unexpected_extra_arg=1, **extra)
    )

  inject_step, plain_step = stepper(injected), stepper(plain)
  state, want_state = jax.jit(injected.init)(params), jax.jit(plain.init)(params)
  mapped = optax.tree.map_params(injected, lambda x: x, state)
  assert jax.tree.structure(mapped) == jax.tree.structure(state)
  for i, g in enumerate(grads):
    if i == 1:
      assert count_compiles(inject_step, g, state) == 0
    u, state = inject_step(g, state)
    want_u, want_state = plain_step(g, want_state)
    assert jax.tree.structure(state.inner_state) == jax.tree.structure(want_state)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5), u, want_u)
    jax.tree.map(
      lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5),
      _key_data(state.inner_state),
      _key_data(want_state),
    )


def _adam_moments(name, state):
  if name == "adam_magma":
    return state.mu, state.nu
  adam = state.base_state[0]
  return adam.mu, adam.nu


@pytest.mark.parametrize("name", ["adam_magma", "sparse_adam"])
def test_default_moments_equal_injected_optax_adam_bit_for_bit(name):
  case = CASES[name]
  params, grads, _ = _problem(case)
  txs = [_injected(case, learning_rate=1e-2)]
  txs.append(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2))
  states = [jax.jit(tx.init)(params) for tx in txs]
  for g in grads:
    states = [
      jax.jit(tx.update)(g, s, params)[1] for tx, s in zip(txs, states, strict=True)
    ]
  got = _adam_moments(name, states[0].inner_state)
  want = states[1].inner_state[0]
  _assert_trees_equal(got, (want.mu, want.nu), "Adam's moments")
  # The control: the plain optax.adam's moments differ (1 - b2 in double).
  plain = optax.adam(1e-2)
  s = plain.init(params)
  for g in grads:
    s = jax.jit(plain.update)(g, s, params)[1]
  assert any(
    np.any(np.asarray(a) != np.asarray(b))
    for a, b in zip(jax.tree.leaves(s[0].nu), jax.tree.leaves(want.nu), strict=True)
  )


@pytest.mark.parametrize(
  ("factory", "kwargs", "static_args", "match"),
  [
    (magma.sparse_adam, TILES, (), "density must be static"),
    (magma.sparse_adam, TILES, ("density",), "density_threshold must be static"),
    (
      functools.partial(magma.sparse_state, optax.adam(1e-2)),
      dict(mode="compact", structure=(2, 4)),
      (),
      "density_threshold must be static.*'density_threshold', 'axis'",
    ),
    (
      functools.partial(magma.sparse_state, optax.adam(1e-2)),
      dict(mode="compact", structure=(2, 4)),
      ("density_threshold",),
      "axis must be static.*static_args=\\('density_threshold', 'axis'\\)",
    ),
  ],
)
def test_numbers_that_shape_compact_storage_must_be_static(
  factory, kwargs, static_args, match
):
  if factory is magma.sparse_adam:
    kwargs = dict(kwargs, learning_rate=1e-2)
  tx = optax.inject_hyperparams(factory, static_args=static_args)(**kwargs)
  params = [jnp.ones((16, 256))]
  with pytest.raises(ValueError, match=match):
    jax.jit(tx.init)(params)
  # Positive control: with what the error names static, it builds.
  named = ("density", "density_threshold")
  if "structure" in kwargs:
    named = ("density_threshold", "axis")
  tx = optax.inject_hyperparams(factory, static_args=named)(**kwargs)
  jax.jit(tx.init)(params)


def test_injected_weight_decay_needs_the_params_or_static_args():
  params = [jnp.ones((2, 3))]
  tx = optax.inject_hyperparams(magma.adam_magma)(learning_rate=1e-2)
  with pytest.raises(ValueError, match="static_args=\\('weight_decay',\\)"):
    jax.jit(tx.update)(params, tx.init(params))
  tx = optax.inject_hyperparams(magma.adam_magma, static_args=("weight_decay",))(
    learning_rate=1e-2
  )
  jax.jit(tx.update)(params, tx.init(params))
