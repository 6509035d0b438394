"""magma's momentum contract, over every optax optimizer that takes a learning rate.

For a constant gradient every honest first moment points along the gradient, so the
cosine is 1 and the score must rise from ``init_score`` (0.5) to
``0.5 + (sigmoid(1/2) - 0.5)(1 - 0.9^10) = 0.580`` after 10 steps; a buffer that
points against the gradient (a ``trace`` kept after the learning-rate scaling, as in
``optax.rmsprop(momentum=)`` and ``optax.lars``) drives it to ~0.42 instead. The
threshold 0.55 separates the two with room for the optimizers whose moment starts at
zero (ADOPT) or is normalised.
"""

import inspect

import jax
import jax.numpy as jnp
import optax
import pytest

import magma_optax as magma

STEPS, THRESHOLD = 10, 0.55
# Factories that cannot run on a plain (gradient, state, params) update: they need
# the loss value, a loss function or privacy arguments.
NEEDS_MORE = {"lbfgs", "dpsgd", "momo", "momo_adam", "sophia"}


def _factories():
  out = {}
  for module in (optax, optax.contrib):
    for name in sorted(dir(module)):
      f = getattr(module, name)
      if name.startswith("_") or name in NEEDS_MORE or not inspect.isfunction(f):
        continue
      params = list(inspect.signature(f).parameters)
      if params and params[0] == "learning_rate":
        out[f"{module.__name__}.{name}"] = lambda f=f: f(learning_rate=1e-2)
  out |= {
    "rmsprop(momentum)": lambda: optax.rmsprop(1e-2, momentum=0.9),
    "rmsprop(momentum, nesterov)": lambda: optax.rmsprop(
      1e-2, momentum=0.9, nesterov=True
    ),
    "sgd(momentum)": lambda: optax.sgd(1e-2, momentum=0.9),
    "sgd(nesterov)": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "chain(clip, sgd(momentum))": lambda: optax.chain(
      optax.clip(1.0), optax.sgd(1e-2, momentum=0.9)
    ),
    "chain(trace, scale)": lambda: optax.chain(optax.trace(0.9), optax.scale(-1e-2)),
    "chain(adam, scale, trace)": lambda: optax.chain(
      optax.scale_by_adam(), optax.scale(-1e-2), optax.trace(0.9)
    ),
    "chain(rms, scale, trace)": lambda: optax.chain(
      optax.scale_by_rms(), optax.scale(-1e-2), optax.trace(0.9)
    ),
    "inject_hyperparams(sgd)": lambda: optax.inject_hyperparams(optax.sgd)(
      learning_rate=1e-2, momentum=0.9
    ),
  }
  return out


FACTORIES = _factories()
PARAMS = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
GRAD = {"w": jnp.linspace(-1.0, 2.0, 32).reshape(4, 8), "b": jnp.linspace(1, 2, 8)}


def _score_after_constant_gradient(tx):
  state, step = tx.init(PARAMS), jax.jit(tx.update)
  for _ in range(STEPS):
    _, state = step(GRAD, state, PARAMS)
  return state


def test_the_list_covers_optax():
  assert len(FACTORIES) > 40
  for name in ("optax.adam", "optax.rmsprop", "optax.lars", "optax.contrib.muon"):
    assert name in FACTORIES


@pytest.mark.filterwarnings("ignore:Specifying a key")  # optax.noisy_sgd
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_score_rises_for_a_constant_gradient(name):
  tx = magma.magma(FACTORIES[name](), keep_prob=1.0)
  state = _score_after_constant_gradient(tx)
  for leaf, score in state.mask_state.scores.items():
    assert float(score) > THRESHOLD, (name, leaf, float(score))


def test_traces_after_the_learning_rate_get_an_own_ema():
  for name in ("rmsprop(momentum)", "optax.lars", "chain(rms, scale, trace)"):
    state = magma.magma(FACTORIES[name]()).init(PARAMS)
    assert not isinstance(state.mask_state.momentum["w"], optax.MaskedNode), name
  # Adam's mu is an EMA of the raw gradient wherever the chain puts the scaling.
  for name in ("sgd(momentum)", "optax.adam", "chain(trace, scale)",
               "chain(adam, scale, trace)"):  # fmt: skip
    state = magma.magma(FACTORIES[name]()).init(PARAMS)
    assert isinstance(state.mask_state.momentum["w"], optax.MaskedNode), name


def test_the_buffer_can_be_named():
  base = optax.chain(optax.clip(1.0), optax.trace(0.9), optax.scale(-1e-2))
  auto = magma.magma(base).init(PARAMS)  # a trace that is not first: own EMA
  assert not isinstance(auto.mask_state.momentum["w"], optax.MaskedNode)
  named = magma.magma(base, keep_prob=1.0, momentum=lambda s: s[1].trace)
  state = _score_after_constant_gradient(named)
  assert isinstance(state.mask_state.momentum["w"], optax.MaskedNode)  # no own EMA
  assert float(state.mask_state.scores["w"]) > THRESHOLD
  # Naming the inverted trace is allowed, and does what it says.
  inverted = magma.magma(
    optax.rmsprop(1e-2, momentum=0.9), keep_prob=1.0, momentum=lambda s: s[2].trace
  )
  state = _score_after_constant_gradient(inverted)
  assert float(state.mask_state.scores["w"]) < 0.45
  with pytest.raises(ValueError, match="momentum= returned a tree unlike"):
    magma.magma(base, momentum=lambda s: [1, 2, 3]).init(PARAMS)
  with pytest.raises(ValueError, match="momentum must be"):
    magma.magma(base, momentum="mine")
