"""optax's contrib test battery (``optax/contrib/_common_test.py``), over every
public transform: extra args, no recompilation, ``optax.tree.map_params``, dtype
preservation, ``optax.MultiSteps``, a state stable under ``lax.cond``, and
``optax.inject_hyperparams`` giving the same updates and states."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compiles import count_compiles

import magma_optax as magma

TRANSFORMS = {
  "magma": lambda: magma.magma(optax.adam(1e-2), key=3),
  "magma_row_sgd": lambda: magma.magma(
    optax.sgd(1e-2, momentum=0.9), granularity="row", key=3
  ),
  "skip_update": lambda: magma.skip_update(optax.adam(1e-2), key=3),
  "adam_magma": lambda: magma.adam_magma(1e-2, key=3),
  "alignment_mask": lambda: optax.chain(magma.alignment_mask(key=3), optax.adam(1e-2)),
  "bernoulli_mask": lambda: optax.chain(
    optax.adam(1e-2), magma.bernoulli_mask(0.5, key=3)
  ),
  "damping": lambda: optax.chain(optax.adam(1e-2), magma.damping(0.5)),
  "periodic_mask": lambda: magma.periodic_mask(optax.adam(1e-2), sparsity=0.5, every=2),
  "sparse_compact": lambda: magma.periodic_mask(
    magma.sparse_state(optax.adam(1e-2), mode="compact", density=0.5),
    sparsity=0.5,
    every=2,
  ),
  "masked_weight_decay": lambda: magma.periodic_mask(  # it needs param_mask=
    optax.chain(magma.masked_weight_decay(0.1, ramp_steps=2), optax.adam(1e-2)),
    sparsity=0.5,
    every=2,
  ),
}
NAMES = sorted(TRANSFORMS)


def _params(dtype=jnp.float32):
  return {
    "w": jnp.linspace(-1.0, 1.0, 24, dtype=dtype).reshape(4, 6),
    "b": jnp.linspace(0.5, 1.5, 6, dtype=dtype),
  }


def _loss(p):
  return sum(jnp.sum(jnp.square(x.astype(jnp.float32) - 0.3)) for x in p.values())


@pytest.mark.parametrize("name", NAMES)
def test_extra_args_and_no_recompilation(name):
  tx = TRANSFORMS[name]()

  @jax.jit
  def step(params, state):
    grads = jax.grad(_loss)(params)
    updates, state = tx.update(grads, state, params, unexpected_extra_arg=1)
    return optax.apply_updates(params, updates), state

  params = _params()
  state = tx.init(params)
  params, state = step(params, state)
  assert count_compiles(step, params, state) == 0


def test_the_compile_counter_counts():  # positive control of the check above
  step = jax.jit(lambda x: 3 * x + 1)
  x = jnp.arange(5.0)
  assert count_compiles(step, x) == 1
  assert count_compiles(step, x) == 0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_updates_keep_the_params_dtype(name, dtype):
  tx = TRANSFORMS[name]()
  params = _params(dtype)
  grads = jax.grad(_loss)(params)
  updates, _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)
  for x in jax.tree.leaves(updates):
    assert x.dtype == dtype, name


@pytest.mark.parametrize("name", NAMES)
def test_inside_multisteps_the_first_updates_are_zero(name):
  tx = optax.MultiSteps(TRANSFORMS[name](), every_k_schedule=4)
  params = _params()
  grads = jax.grad(_loss)(params)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  for x in jax.tree.leaves(updates):
    np.testing.assert_array_equal(x, 0.0)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_state_is_stable_under_cond(name, dtype):
  tx = TRANSFORMS[name]()

  @jax.jit
  def step(params, state):
    grads = jax.grad(_loss)(params)
    pick = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
    updates, state = jax.lax.cond(
      pick, lambda: tx.update(grads, state, params), lambda: (params, state)
    )
    return optax.apply_updates(params, updates), state

  params = _params(dtype)
  state = tx.init(params)
  for _ in range(2):
    params, new_state = step(params, state)
    assert all(x.dtype == dtype for x in jax.tree.leaves(params))
    pick = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
    state = jax.lax.cond(pick, lambda s=state: s, lambda n=new_state: n)


def test_map_params_over_the_battery():
  for name in NAMES:
    tx = TRANSFORMS[name]()
    state = tx.init(_params())
    mapped = optax.tree.map_params(tx, lambda v: v, state)
    assert jax.tree.structure(mapped) == jax.tree.structure(state), name


INJECTED = {
  "magma": (functools.partial(magma.magma, optax.adam(1e-2)),
            dict(tau=2.0, keep_prob=0.5, key=3), ()),
  "skip_update": (functools.partial(magma.skip_update, optax.adam(1e-2)),
                  dict(keep_prob=0.5, key=3), ()),
  "bernoulli_mask": (magma.bernoulli_mask, dict(keep_prob=0.5, key=3), ()),
  "alignment_mask": (magma.alignment_mask, dict(tau=2.0, keep_prob=0.5, key=3), ()),
  "adam_magma": (magma.adam_magma, dict(learning_rate=1e-2, tau=2.0, key=3), ()),
  "damping": (magma.damping, dict(coefficient=0.5), ()),
  "periodic_mask": (functools.partial(magma.periodic_mask, optax.adam(1e-2)),
                    dict(sparsity=0.5, every=2), ("every", "start", "end", "axis")),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(INJECTED))
def test_inject_hyperparams_gives_the_same_updates_and_state(name):
  factory, hparams, static = INJECTED[name]
  plain = factory(**hparams)
  injected = optax.inject_hyperparams(factory, static_args=static)(**hparams)
  params = [-jnp.ones((2, 3)), jnp.ones((2, 5, 2))]
  grads = [jnp.ones((2, 3)), -jnp.ones((2, 5, 2))]
  u, s = jax.jit(plain.update)(grads, jax.jit(plain.init)(params), params)
  ui, si = jax.jit(injected.update)(grads, jax.jit(injected.init)(params), params)
  for a, b in zip(jax.tree.leaves(ui), jax.tree.leaves(u), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5)
  keys = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
    x.dtype, jax.dtypes.prng_key) else x  # fmt: skip
  assert jax.tree.structure(si.inner_state) == jax.tree.structure(s)
  for a, b in zip(jax.tree.leaves(si.inner_state), jax.tree.leaves(s), strict=True):
    np.testing.assert_allclose(keys(a), keys(b), rtol=1e-5, atol=1e-5)
