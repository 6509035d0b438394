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


def test_mask_stats_reports_every_group():
  params = {"a": jnp.ones((4, 4)), "m": jnp.ones((6,)), "h": jnp.ones(3)}
  groups = {
    "a": magma.magma(optax.adam(1e-2), granularity="row", keep_prob=0.5),
    "m": magma.skip_update(optax.adam(1e-2), granularity="element"),
    "h": optax.adam(1e-2),
  }
  tx = optax.multi_transform(groups, {"a": "a", "m": "m", "h": "h"})
  state = tx.init(params)
  for _ in range(2):
    _, state = tx.update(params, state, params)
  stats = magma.mask_stats(state)
  by_group = {path.split("'")[1]: g for path, g in stats["groups"].items()}
  assert sorted(by_group) == ["a", "m"]
  for name in ("a", "m"):
    own = magma.mask_stats(state.inner_states[name])  # that group alone
    np.testing.assert_array_equal(stats["mask"][name], own["mask"][name])
    np.testing.assert_allclose(
      by_group[name]["active_fraction"], own["active_fraction"]
    )  # fmt: skip
  assert stats["mask"]["a"].shape == (4,) and stats["mask"]["m"].shape == (6,)
  assert isinstance(stats["mask"]["h"], optax.MaskedNode)
  assert stats["scores"]["a"].shape == (4,)  # from the Magma group
  assert stats["active_fraction"] is None  # not silently one group's
