"""Flax integration: nnx.Optimizer and Linen TrainState with magma.magma.

Both loops of examples/flax_training.py must take exactly the steps of a plain optax
loop on the same parameters (same key: same masks), and log mask_stats that agree
with the state.
"""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import magma_optax as magma  # noqa: E402

STEPS = 5
_PATH = os.path.join(
  os.path.dirname(__file__), "..", "..", "examples", "flax_training.py"
)
_spec = importlib.util.spec_from_file_location("flax_training", _PATH)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def plain_optax_run(params, loss_fn):
  """The reference: the example's optimizer in a plain optax loop."""
  tx = example.make_tx()
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses, masks = [], []
  for _ in range(STEPS):
    params, state, loss = step(params, state)
    losses.append(float(loss))
    masks.append(jax.tree.leaves(magma.mask_stats(state)["mask"]))
  return params, losses, masks


def check_log(log, losses, masks):
  assert [int(e["step"]) for e in log] == list(range(1, STEPS + 1))
  np.testing.assert_allclose([float(e["loss"]) for e in log], losses, rtol=1e-6)
  for entry, z in zip(log, masks, strict=True):
    # Two scoped kernels (tensor blocks), in tree order mlp_down (16x2), mlp_up
    # (4x16): the logged fraction is the kept share of their entries.
    sizes = np.array([HIDDEN_OUT, IN_HIDDEN])
    kept = np.array([bool(m) for m in z])
    assert len(kept) == 2  # biases are unscoped: no mask
    want = (kept * sizes).sum() / sizes.sum()
    assert float(entry["active_fraction"]) == pytest.approx(want)
    assert set(entry["active_fraction_by_label"]) == {"mlp"}
  assert len({float(e["active_fraction"]) for e in log}) > 1  # masks vary
  assert losses[-1] < losses[0]


IN_HIDDEN = example.IN * example.HIDDEN
HIDDEN_OUT = example.HIDDEN * example.OUT


def test_nnx_optimizer_matches_plain_optax():
  x, y = example.make_data(0)
  graphdef, params0 = nnx.split(example.MLP(nnx.Rngs(0)), nnx.Param)

  def loss_fn(params):
    return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

  want_params, losses, masks = plain_optax_run(params0, loss_fn)
  model, optimizer, log = example.train_nnx(steps=STEPS)
  got = jax.tree.leaves(nnx.state(model, nnx.Param))
  for a, b in zip(got, jax.tree.leaves(want_params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  check_log(log, losses, masks)
  assert isinstance(optimizer.opt_state, magma.MaskedUpdateState)


def test_linen_train_state_matches_plain_optax():
  x, y = example.make_data(0)
  module = example.LinenMLP()
  params0 = module.init(jax.random.key(0), x)["params"]

  def loss_fn(params):
    return jnp.mean((module.apply({"params": params}, x) - y) ** 2)

  want_params, losses, masks = plain_optax_run(params0, loss_fn)
  state, log = example.train_linen(steps=STEPS)
  for a, b in zip(
    jax.tree.leaves(state.params), jax.tree.leaves(want_params), strict=True
  ):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  check_log(log, losses, masks)
