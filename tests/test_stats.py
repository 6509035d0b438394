"""mask_stats finds the mask state wherever it sits and reports what it decided."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma


@pytest.mark.parametrize(
  "make",
  [
    lambda: magma.magma(optax.adam(1e-3)),
    lambda: magma.skip_update(optax.adam(1e-3)),
    lambda: optax.chain(optax.clip(1.0), optax.adam(1e-3), magma.bernoulli_mask()),
    lambda: optax.MultiSteps(magma.magma(optax.adam(1e-3)), 1),
    lambda: optax.inject_hyperparams(magma.alignment_mask)(tau=2.0),
  ],
)
def test_mask_stats_reads_every_container(make):
  params = {
    "attn": {"q": jnp.ones((4, 4))},
    "mlp": {"up": jnp.ones((4, 2))},
    "norm": jnp.ones((4,)),
  }
  tx = make()
  _, state = jax.jit(tx.update)(params, tx.init(params), params)
  stats = jax.jit(magma.mask_stats)(state)
  z = [np.asarray(x, np.float64) for x in jax.tree.leaves(stats["mask"])]
  sizes = [16, 8, 4]  # attn, mlp, norm in flattening order ('attn' < 'mlp' < 'norm')
  expected = sum(zi.mean() * n for zi, n in zip(z, sizes, strict=True)) / sum(sizes)
  np.testing.assert_allclose(stats["active_fraction"], expected, rtol=1e-6)
  assert set(stats["active_fraction_by_label"]) == {"attention", "mlp", "other"}
  np.testing.assert_allclose(
    stats["active_fraction_by_label"]["attention"], z[0].mean()
  )
  assert int(stats["step"]) == 1


def test_mask_stats_without_mask_state_raises():
  with pytest.raises(ValueError, match="no mask state"):
    magma.mask_stats(optax.adam(1e-3).init({"w": jnp.ones(2)}))
