"""optax.tree.map_params works on every transform's state (optax's own test battery
uses it, and so do users who cast or shard optimizer state with it)."""

import jax
import jax.numpy as jnp
import optax
import pytest

import magma_optax as magma

PARAMS = {
  "attn": {"q": jnp.ones((4, 8))},
  "mlp": {"up": jnp.ones((8, 4))},
  "b": jnp.ones(4),
}
FACTORIES = {
  "magma": lambda: magma.magma(optax.adam(1e-2)),
  "magma_per_label": lambda: magma.magma(
    optax.sgd(1e-2), keep_prob={"attention": 0.5, "mlp": 0.9}
  ),
  "skip_update": lambda: magma.skip_update(optax.adam(1e-2)),
  "bernoulli_mask": lambda: magma.bernoulli_mask(0.5),
  "alignment_mask": lambda: magma.alignment_mask(),
  "adam_magma": lambda: magma.adam_magma(1e-2),
  "damping": lambda: magma.damping(0.1),
  "periodic_mask": lambda: magma.periodic_mask(optax.adam(1e-2), sparsity=0.5, every=2),
  "sparse_state": lambda: magma.sparse_state(optax.adam(1e-2)),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_identity_map_keeps_the_state(name):
  tx = FACTORIES[name]()
  state = tx.init(PARAMS)
  state = jax.jit(tx.update)(PARAMS, state, PARAMS)[1]
  mapped = optax.tree.map_params(tx, lambda v: v, state)
  assert jax.tree.structure(mapped) == jax.tree.structure(state)
  # Still a valid state: it takes the next step.
  tx.update(PARAMS, mapped, PARAMS)


def test_the_map_reaches_the_base_optimizers_moments():
  tx = magma.magma(optax.adam(1e-2))
  state = tx.init(PARAMS)
  mapped = optax.tree.map_params(tx, lambda v: v.astype(jnp.bfloat16), state)
  mu = mapped.inner_state[0].mu
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(mu))
  assert mapped.mask_state.key.dtype == state.mask_state.key.dtype  # not a param
