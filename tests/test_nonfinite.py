"""Extreme and non-finite values: the masks poison nothing the base optimizer does not.

Block sums are float32; where they overflow or meet an inf/NaN entry the cosine is
undefined and the block keeps its previous score (``_alignment.next_score``), so the
score stays finite and the update is non-finite exactly where the base's is.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma

PARAMS = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
WRAPPERS = {
  "magma(adam)": lambda: magma.magma(optax.adam(1e-2), keep_prob=1.0),
  "adam_magma": lambda: magma.adam_magma(1e-2, keep_prob=1.0),
  "alignment_mask": lambda: optax.chain(
    magma.alignment_mask(keep_prob=1.0), optax.adam(1e-2)
  ),
  "skip_update": lambda: magma.skip_update(optax.adam(1e-2), keep_prob=1.0),
}


def _run(tx, grads):
  state, step = tx.init(PARAMS), jax.jit(tx.update)
  out = []
  for g in grads:
    u, state = step(g, state, PARAMS)
    out.append(u)
  return out, state


@pytest.mark.parametrize("name", sorted(WRAPPERS))
@pytest.mark.parametrize("magnitude", [1e17, 1e30])
def test_huge_finite_gradients_give_finite_updates_and_scores(name, magnitude):
  g = jax.tree.map(lambda x: jnp.full(x.shape, magnitude), PARAMS)
  ones = jax.tree.map(jnp.ones_like, PARAMS)
  updates, state = _run(WRAPPERS[name](), [g, g, ones])
  for u in updates:
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u)), name
  scores = magma.mask_stats(state)["scores"]
  if scores is not None:
    assert all(bool(jnp.all(jnp.isfinite(s))) for s in jax.tree.leaves(scores))


def test_wrapper_and_fused_agree_on_extreme_inputs():
  g = {"w": jnp.full((4, 8), 1e30), "b": jnp.linspace(-1e20, 1e20, 8)}
  ones = jax.tree.map(jnp.ones_like, PARAMS)
  a, sa = _run(WRAPPERS["magma(adam)"](), [g, ones, g])
  b, sb = _run(WRAPPERS["adam_magma"](), [g, ones, g])
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5)
  for x, y in zip(
    jax.tree.leaves(magma.mask_stats(sa)["scores"]),
    jax.tree.leaves(magma.mask_stats(sb)["scores"]),
    strict=True,
  ):
    np.testing.assert_allclose(x, y, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(WRAPPERS))
@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_one_bad_entry_poisons_what_adam_poisons(name, bad):
  g_bad = jax.tree.map(lambda x: jnp.ones(x.shape), PARAMS)
  g_bad["w"] = g_bad["w"].at[1, 2].set(bad)
  ones = jax.tree.map(jnp.ones_like, PARAMS)
  grads = [ones, g_bad, ones, ones]
  got, state = _run(WRAPPERS[name](), grads)
  want, _ = _run(optax.adam(1e-2), grads)
  for u, v in zip(got, want, strict=True):
    for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(v), strict=True):
      np.testing.assert_array_equal(np.isfinite(x), np.isfinite(y))
  scores = magma.mask_stats(state)["scores"]
  if scores is not None:
    assert all(bool(jnp.all(jnp.isfinite(s))) for s in jax.tree.leaves(scores))
    # The clean leaf's score follows cos = 1 for all four steps.
    sigmoid = 1 / (1 + np.exp(-0.5))
    np.testing.assert_allclose(scores["b"], 0.5 + (sigmoid - 0.5) * (1 - 0.9**4), 1e-6)


def test_apply_if_finite_skips_the_bad_step_and_keeps_the_scores():
  tx = optax.apply_if_finite(magma.magma(optax.adam(1e-2)), max_consecutive_errors=3)
  ones = jax.tree.map(jnp.ones_like, PARAMS)
  bad = {**ones, "w": ones["w"].at[0, 0].set(jnp.inf)}
  state, step = tx.init(PARAMS), jax.jit(tx.update)
  _, state = step(ones, state, PARAMS)
  before = magma.mask_stats(state)
  u, state = step(bad, state, PARAMS)
  after = magma.mask_stats(state)
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))  # step skipped
  assert int(state.notfinite_count) == 1
  for x, y in zip(
    jax.tree.leaves(before["scores"]), jax.tree.leaves(after["scores"]), strict=True
  ):
    np.testing.assert_array_equal(x, y)
  assert int(after["step"]) == int(before["step"])
