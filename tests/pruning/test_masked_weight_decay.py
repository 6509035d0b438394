"""Tests for magma_optax.masked_weight_decay."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma


def test_matches_numpy_with_linear_ramp():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(3, 4)).astype(np.float32)
  m = rng.random((3, 4)) < 0.5
  tx = magma.masked_weight_decay(0.2, ramp_steps=4)
  state = tx.init({"w": w})
  step = jax.jit(tx.update)
  for t in range(7):
    g = rng.normal(size=(3, 4)).astype(np.float32)
    u, state = step({"w": g}, state, {"w": w}, param_mask={"w": m})
    coef = 0.2 * min(t / 4, 1.0)
    np.testing.assert_allclose(
      np.asarray(u["w"]), g + coef * (~m) * w, rtol=1e-6, atol=1e-7
    )
    assert float(state.coefficient) == pytest.approx(coef)
  assert step._cache_size() == 1


def test_enters_second_moment_before_adam():
  """chain(decay, adam) is adam fed the decayed gradient (AdamS placement)."""
  params = {"w": jnp.array([1.0, -2.0, 3.0, 0.5])}
  mask = {"w": jnp.array([True, False, True, False])}
  g = {"w": jnp.array([0.1, 0.2, -0.3, 0.0])}
  tx = optax.chain(magma.masked_weight_decay(0.5, ramp_steps=0), optax.adam(1e-2))
  u, state = tx.update(g, tx.init(params), params, param_mask=mask)
  decayed = {"w": g["w"] + 0.5 * jnp.array([0.0, 1.0, 0.0, 1.0]) * params["w"]}
  v, ref = optax.adam(1e-2).update(decayed, optax.adam(1e-2).init(params), params)
  np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(v["w"]))
  np.testing.assert_array_equal(
    np.asarray(state[1][0].nu["w"]), np.asarray(ref[0].nu["w"])
  )


def test_unmasked_leaves_are_untouched():
  params = {"w": jnp.ones(3), "b": jnp.ones(2)}
  tx = magma.masked_weight_decay(1.0, ramp_steps=0)
  mask = {"w": jnp.array([True, False, False]), "b": optax.MaskedNode()}
  u, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params,
                   param_mask=mask)  # fmt: skip
  np.testing.assert_array_equal(np.asarray(u["w"]), [0.0, 1.0, 1.0])
  np.testing.assert_array_equal(np.asarray(u["b"]), [0.0, 0.0])


def test_composes_inside_periodic_mask():
  params = {"w": jnp.arange(1.0, 9.0)}
  tx = magma.periodic_mask(
    optax.chain(magma.masked_weight_decay(0.1, ramp_steps=0), optax.sgd(1.0)),
    sparsity=0.5,
    every=1,
    importance="magnitude",
  )
  state = tx.init(params)
  u, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
  assert float(state.inner_state[0].coefficient) == pytest.approx(0.1)
  new = np.asarray(optax.apply_updates(params, u)["w"])
  np.testing.assert_array_equal(new, [0, 0, 0, 0, 5, 6, 7, 8])


@pytest.mark.parametrize(
  "strength, ramp_steps, match",
  [(-0.1, 0, "strength"), (0.1, -1, "ramp_steps"), (0.1, 2.5, "ramp_steps")],
)
def test_bad_arguments_raise(strength, ramp_steps, match):
  with pytest.raises(ValueError, match=match):
    magma.masked_weight_decay(strength, ramp_steps=ramp_steps)


def test_missing_mask_raises():
  params = {"w": jnp.ones(3)}
  tx = magma.masked_weight_decay(0.1, ramp_steps=0)
  with pytest.raises(ValueError, match="param_mask"):
    tx.update(params, tx.init(params), params)


@pytest.mark.parametrize("mask_shape", [(1, 3), (3, 1), (1,)])
def test_mask_of_another_shape_raises_not_broadcast(mask_shape):
  params = {"w": jnp.ones((3,))} if mask_shape != (3, 1) else {"w": jnp.ones((3, 3))}
  tx = magma.masked_weight_decay(0.1, ramp_steps=0)
  mask = {"w": jnp.ones(mask_shape, bool)}
  with pytest.raises(ValueError, match="param_mask leaf 0 has shape"):
    tx.update(params, tx.init(params), params, param_mask=mask)
