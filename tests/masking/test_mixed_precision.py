"""Mixed precision: bf16 parameters and gradients, f32 optimizer state where asked.

* The wrappers return updates in the dtype the base optimizer produced, leaf by leaf:
  bf16 for a bf16 base; ``optax.adam(mu_dtype=jnp.float32)`` itself returns f32
  updates for bf16 parameters, and ``optax.apply_updates`` casts them back to bf16.
  Masking never upcasts a tree.
* The wrappers' own per-parameter buffers (the momentum EMA for bases without one)
  take the parameter dtype unless ``momentum_dtype=`` says otherwise; per-block
  scores are f32 (a few numbers per leaf).
* Cosines are computed in f32, so bf16 results agree with an f32 computation on the
  same (bf16-representable) inputs to bf16 precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma

BF16, F32 = jnp.bfloat16, jnp.float32


def _params(dtype):
  key = jax.random.key(0)
  return {
    "w": jax.random.normal(key, (16, 8)).astype(dtype),
    "b": jax.random.normal(jax.random.fold_in(key, 1), (8,)).astype(dtype),
  }


def _grads(step, dtype):
  key = jax.random.fold_in(jax.random.key(1), step)
  return {
    "w": jax.random.normal(key, (16, 8)).astype(dtype),
    "b": jax.random.normal(jax.random.fold_in(key, 1), (8,)).astype(dtype),
  }


def dtypes(tree):
  return jax.tree.map(lambda x: jnp.dtype(x.dtype), tree)


CASES = {
  "magma_adam": lambda **kw: magma.magma(optax.adam(1e-2, **kw), key=0),
  "skip_update_adam": lambda **kw: magma.skip_update(optax.adam(1e-2, **kw), key=0),
  "chain_bernoulli": lambda **kw: optax.chain(
    optax.adam(1e-2, **kw), magma.bernoulli_mask(0.5, key=0)
  ),
  "chain_alignment": lambda **kw: optax.chain(
    magma.alignment_mask(key=0), optax.adam(1e-2, **kw)
  ),
  "chain_damping": lambda **kw: optax.chain(optax.adam(1e-2, **kw), magma.damping(0.1)),
}


def _base_of(name, **kw):
  return optax.adam(1e-2, **kw)


def _abstract_train(tx, params, steps=2):
  """Dtypes of (updates, state, params) after ``steps`` steps, traced abstractly
  (``jax.eval_shape``: the dtype rules without compiling)."""

  def train(params):
    state = tx.init(params)
    for t in range(steps):
      updates, state = tx.update(_grads(t, BF16), state, params)
      params = optax.apply_updates(params, updates)
    return updates, state, params

  return jax.eval_shape(train, params)


@pytest.mark.parametrize(
  "name, mu_dtype", [(n, F32) for n in sorted(CASES)] + [("magma_adam", None)]
)
def test_updates_keep_the_base_dtype_and_params_stay_bf16(name, mu_dtype):
  params = _params(BF16)
  updates, state, params = _abstract_train(CASES[name](mu_dtype=mu_dtype), params)
  base_updates, _, _ = _abstract_train(_base_of(name, mu_dtype=mu_dtype), _params(BF16))
  assert dtypes(updates) == dtypes(base_updates)
  assert dtypes(params) == {"w": BF16, "b": BF16}
  want_mu = F32 if mu_dtype is not None else BF16
  mus = optax.tree_utils.tree_get_all_with_path(state, "mu")
  assert mus and all(dtypes(mu) == {"w": want_mu, "b": want_mu} for _, mu in mus)


def test_without_mu_dtype_everything_param_sized_stays_bf16():
  updates, state, _ = _abstract_train(magma.magma(optax.adam(1e-2)), _params(BF16))
  assert dtypes(updates) == {"w": BF16, "b": BF16}
  for leaf in jax.tree.leaves(state):
    if leaf.shape in ((16, 8), (8,)) and jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == BF16
  scores = magma.mask_stats(state)["scores"]
  assert dtypes(scores) == {"w": F32, "b": F32}


@pytest.mark.parametrize(
  "momentum_dtype, want", [(None, BF16), (F32, F32), (BF16, BF16)]
)
def test_momentum_dtype_sets_the_wrappers_own_buffer(momentum_dtype, want):
  params = _params(BF16)
  tx = magma.magma(optax.rmsprop(1e-2), momentum_dtype=momentum_dtype)
  updates, state, _ = _abstract_train(tx, params)
  assert dtypes(state.mask_state.momentum) == {"w": want, "b": want}
  assert dtypes(updates) == {"w": BF16, "b": BF16}
  aligned = magma.alignment_mask(momentum_dtype=momentum_dtype)
  assert dtypes(aligned.init(params).momentum) == {"w": want, "b": want}


def test_bf16_magma_matches_f32_to_bf16_precision():
  # Same inputs (bf16-representable), same key: masks identical, updates close.
  params16, grads16 = _params(BF16), _grads(0, BF16)
  params32 = jax.tree.map(lambda x: x.astype(F32), params16)
  grads32 = jax.tree.map(lambda x: x.astype(F32), grads16)
  tx16 = magma.magma(optax.adam(1e-2, mu_dtype=F32), keep_prob=1.0)
  tx32 = magma.magma(optax.adam(1e-2), keep_prob=1.0)
  u16, s16 = tx16.update(grads16, tx16.init(params16), params16)
  u32, s32 = tx32.update(grads32, tx32.init(params32), params32)
  for k in ("w", "b"):
    np.testing.assert_allclose(
      np.asarray(u16[k], np.float32), np.asarray(u32[k]), rtol=1e-2, atol=1e-5
    )
    np.testing.assert_allclose(
      s16.mask_state.scores[k], s32.mask_state.scores[k], rtol=1e-3
    )


def test_recipe_updates_in_param_dtype_with_f32_moments():
  # optax.adam(mu_dtype=f32) returns f32 updates for bf16 params; to hand bf16
  # updates on (e.g. to a gradient all-reduce or a custom apply), cast like params.
  cast_like_params = optax.stateless(
    lambda updates, params: optax.tree_utils.tree_cast_like(updates, params)
  )
  tx = optax.chain(magma.magma(optax.adam(1e-2, mu_dtype=F32)), cast_like_params)
  params = _params(BF16)
  updates, state, _ = _abstract_train(tx, params, steps=1)
  assert dtypes(updates) == {"w": BF16, "b": BF16}
  assert dtypes(state[0].inner_state[0].mu) == {"w": F32, "b": F32}
