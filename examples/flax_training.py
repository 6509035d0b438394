"""Training with Magma in Flax: ``nnx.Optimizer`` and Linen ``TrainState``.

Run ``python3 examples/flax_training.py``. Both loops train the same small MLP
regression with ``magma.magma(optax.adam(...))`` scoped to the MLP weights
(``where=magma.attention_mlp_weights``: biases take plain Adam updates, as in the
paper) and log ``magma.mask_stats`` -- what the masks decided -- from inside the
jitted step.

* NNX (flax >= 0.11): ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and
  ``optimizer.update(model, grads)``. Its state wraps arrays in ``OptVariable`` s;
  ``nnx.as_pure`` turns them back into arrays before logging.
* Linen: ``TrainState.create(apply_fn=..., params=..., tx=tx)`` and
  ``state.apply_gradients(grads=grads)``; ``state.opt_state`` is the optax state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import magma_optax as magma

IN, HIDDEN, OUT = 4, 16, 2


def make_tx(learning_rate: float = 3e-2, key: int = 0) -> optax.GradientTransformation:
  # The paper's scope: attention / MLP matrices only. Magma's effective step is
  # about 0.25x Adam's, hence a larger learning rate than plain Adam would use.
  return magma.magma(
    optax.adam(learning_rate), key=key, where=magma.attention_mlp_weights
  )


def make_data(seed: int = 0) -> tuple[jax.Array, jax.Array]:
  x = jax.random.normal(jax.random.key(seed), (32, IN))
  return x, jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1)


def log_entry(loss: jax.Array, opt_state) -> dict:
  """What a training loop logs each step (arrays; convert outside jit)."""
  stats = magma.mask_stats(opt_state)
  return {
    "loss": loss,
    "step": stats["step"],
    "active_fraction": stats["active_fraction"],
    "active_fraction_by_label": stats["active_fraction_by_label"],
    "scores": stats["scores"],
  }


# --- NNX --------------------------------------------------------------------------


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.mlp_up = nnx.Linear(IN, HIDDEN, rngs=rngs)
    self.mlp_down = nnx.Linear(HIDDEN, OUT, rngs=rngs)

  def __call__(self, x):
    return self.mlp_down(jax.nn.gelu(self.mlp_up(x)))


# flax 0.12 renamed nnx.pure to nnx.as_pure.
_as_pure = getattr(nnx, "as_pure", None) or nnx.pure


@nnx.jit
def nnx_train_step(model: MLP, optimizer: nnx.Optimizer, x, y):
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return log_entry(loss, _as_pure(optimizer.opt_state))


def train_nnx(steps: int = 20, seed: int = 0):
  """Returns (model, optimizer, log) after ``steps`` steps."""
  model = MLP(nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
  x, y = make_data(seed)
  log = [nnx_train_step(model, optimizer, x, y) for _ in range(steps)]
  return model, optimizer, log


# --- Linen ------------------------------------------------------------------------


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(HIDDEN, name="mlp_up")(x))
    return nn.Dense(OUT, name="mlp_down")(x)


@jax.jit
def linen_train_step(state: train_state.TrainState, x, y):
  def loss_fn(params):
    return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  state = state.apply_gradients(grads=grads)
  return state, log_entry(loss, state.opt_state)


def train_linen(steps: int = 20, seed: int = 0):
  """Returns (train state, log) after ``steps`` steps."""
  x, y = make_data(seed)
  module = LinenMLP()
  params = module.init(jax.random.key(seed), x)["params"]
  state = train_state.TrainState.create(
    apply_fn=module.apply, params=params, tx=make_tx()
  )
  log = []
  for _ in range(steps):
    state, entry = linen_train_step(state, x, y)
    log.append(entry)
  return state, log


def main():
  for name, log in (("nnx", train_nnx()[2]), ("linen", train_linen()[1])):
    for entry in log[:: max(1, len(log) // 5)]:
      by_label = {
        k: round(float(v), 2) for k, v in entry["active_fraction_by_label"].items()
      }
      print(
        f"{name} step {int(entry['step']):3d}  loss {float(entry['loss']):.4f}"
        f"  active {float(entry['active_fraction']):.2f}  by label {by_label}"
      )


if __name__ == "__main__":
  main()
