"""Stacked (scanned) layers: ``stack_axes=1`` gives one block per layer slice.

A model whose layers live in one leaf of shape (L, ...) and run with ``jax.lax.scan``
must see Magma exactly as the same model with L separate leaves: per-slice cosines
and scores equal the unstacked model's per-leaf ones for the same gradients, and
every mask decision covers one whole slice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma

LAYERS, WIDTH, STEPS = 3, 4, 3


def _data():
  key = jax.random.key(0)
  w = jax.random.normal(key, (LAYERS, WIDTH, WIDTH)) / 2
  x = jax.random.normal(jax.random.fold_in(key, 1), (8, WIDTH))
  y = jnp.cos(x)
  return w, x, y


def stacked_loss(params, x, y):
  def layer(h, w):
    return jnp.tanh(h @ w), None

  h, _ = jax.lax.scan(layer, x, params["layers"])
  return jnp.mean((h - y) ** 2)


def unstacked_loss(params, x, y):
  h = x
  for i in range(LAYERS):
    h = jnp.tanh(h @ params[f"layer{i}"])
  return jnp.mean((h - y) ** 2)


def unstack(tree_leaf):
  return {f"layer{i}": tree_leaf[i] for i in range(LAYERS)}


def train(tx, loss, params, x, y):
  """STEPS steps; returns final params and the mask stats of every step."""
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    grads = jax.grad(loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  stats = []
  for _ in range(STEPS):
    params, state = step(params, state)
    stats.append(jax.tree.map(np.asarray, magma.mask_stats(state)))
  return params, stats


@pytest.fixture(scope="module")
def runs():
  w, x, y = _data()
  out = {}
  for granularity in ("tensor", "row"):
    # keep_prob=1: masks are all ones, so trajectories must agree exactly.
    stacked = magma.magma(
      optax.adam(0.05), keep_prob=1.0, stack_axes=1, granularity=granularity
    )
    flat = magma.magma(optax.adam(0.05), keep_prob=1.0, granularity=granularity)
    out[granularity] = (
      train(stacked, stacked_loss, {"layers": w}, x, y),
      train(flat, unstacked_loss, unstack(w), x, y),
    )
  return out


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_per_slice_scores_equal_unstacked_per_leaf_scores(runs, granularity):
  (_, s_stats), (_, u_stats) = runs[granularity]
  for t in range(STEPS):
    stacked_scores = s_stats[t]["scores"]["layers"]
    assert stacked_scores.shape == (
      (LAYERS,) if granularity == "tensor" else (LAYERS, WIDTH)
    )
    want = np.stack([u_stats[t]["scores"][f"layer{i}"] for i in range(LAYERS)])
    np.testing.assert_allclose(stacked_scores, want, rtol=1e-6, atol=1e-7)
  # The scores moved away from s_0 = 0.5 differently per layer: a real check.
  final = s_stats[-1]["scores"]["layers"]
  assert np.ptp(final) > 1e-4


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_stacked_trajectory_equals_unstacked(runs, granularity):
  (s_params, _), (u_params, _) = runs[granularity]
  got = np.asarray(s_params["layers"])
  want = np.stack([np.asarray(u_params[f"layer{i}"]) for i in range(LAYERS)])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_per_slice_cosine_matches_numpy():
  rng = np.random.default_rng(0)
  a = rng.normal(size=(LAYERS, WIDTH, 5)).astype(np.float32)
  b = rng.normal(size=(LAYERS, WIDTH, 5)).astype(np.float32)
  got = np.asarray(
    magma.sharding.block_cosine(jnp.asarray(a), jnp.asarray(b), stack_axes=1)
  )
  want = [
    (a[i] * b[i]).sum() / np.linalg.norm(a[i]) / np.linalg.norm(b[i])
    for i in range(LAYERS)
  ]
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_masks_are_per_slice():
  w, x, y = _data()
  tx = magma.skip_update(optax.sgd(0.1), keep_prob=0.5, key=3, stack_axes=1)
  state = tx.init({"layers": w})
  update = jax.jit(tx.update)
  grads = jax.grad(stacked_loss)({"layers": w}, x, y)
  decisions = []
  for _ in range(6):
    updates, state = update(grads, state, {"layers": w})
    z = np.asarray(magma.mask_stats(state)["mask"]["layers"])
    assert z.shape == (LAYERS,)
    u = np.asarray(updates["layers"])
    for i in range(LAYERS):
      if z[i]:
        np.testing.assert_allclose(
          u[i], -0.1 * np.asarray(grads["layers"][i]) / 0.5, rtol=1e-6
        )
      else:
        assert not u[i].any()
    decisions.append(z)
  decisions = np.array(decisions)
  # Slices are decided independently: some step keeps some slices and drops others.
  assert any(0 < d.sum() < LAYERS for d in decisions)


def test_without_stack_axes_a_stacked_leaf_is_one_block():
  w, _, _ = _data()
  tx = magma.magma(optax.adam(0.1))
  assert magma.mask_stats(tx.init({"layers": w}))["scores"]["layers"].shape == ()
  with pytest.raises(ValueError, match="stack_axes"):
    magma.magma(optax.adam(0.1), stack_axes=-1)
