"""The block-mask engine: a rule in one small piece of code gets planning, draws,
state, stats, map_params and sharding without edits elsewhere."""

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import magma_optax as magma
from magma_optax._core import blocks as _blocks
from magma_optax.masking import engine as _engine


class CountingState(NamedTuple):
  count: jax.Array
  key: jax.Array
  mask: Any
  kept_steps: Any  # per block: how often the block was kept
  active_fraction: jax.Array
  active_fraction_by_label: Any
  block_axes: Any = _blocks.DeclaredAxes()  # what the state declares for sharding


@dataclasses.dataclass(frozen=True)
class CountingRule(_engine.Rule):
  """Keeps a block with probability p and counts how often it was kept."""

  state_type = CountingState
  block_fields = ("kept_steps",)

  def init_leaf(self, plan, param, momentum):
    return {"kept_steps": jnp.zeros(plan.layout.block_shape, jnp.float32)}

  def scale(self, leaf):
    z = leaf.mask.astype(jnp.float32)
    return z, {"kept_steps": leaf.state["kept_steps"] + z}


def counting_mask(keep_prob=0.5, *, key=0, granularity="row", where=None):
  config = _engine.MaskConfig.create(
    keep_prob=keep_prob, key=key, granularity=granularity, where=where
  )
  return _engine.BlockMask(config, CountingRule()).transformation()


PARAMS = {"attn": {"q": jnp.ones((8, 4))}, "b": jnp.ones(4)}


def test_a_new_rule_plugs_in():
  tx = counting_mask(0.5, key=3)
  state = tx.init(PARAMS)
  step = jax.jit(tx.update)
  kept = np.zeros(8)
  for _ in range(6):
    u, state = step(PARAMS, state)
    z = np.asarray(state.mask["attn"]["q"])
    kept += z
    # The update is the incoming one with the drawn rows zeroed.
    np.testing.assert_array_equal(
      np.asarray(u["attn"]["q"]), np.repeat(z[:, None], 4, 1)
    )
  np.testing.assert_array_equal(np.asarray(state.kept_steps["attn"]["q"]), kept)
  assert 0 < kept.sum() < 48  # some rows kept, some not (p = 0.5, 48 draws)
  # The same draws as bernoulli_mask with the same key and granularity.
  ref = magma.bernoulli_mask(0.5, key=3, granularity="row", rescale=False)
  ref_state = ref.init(PARAMS)
  for _ in range(6):
    _, ref_state = ref.update(PARAMS, ref_state)
  np.testing.assert_array_equal(ref_state.mask["attn"]["q"], state.mask["attn"]["q"])
  # mask_stats finds the new state type; map_params leaves its block field alone.
  stats = magma.mask_stats(state)
  assert stats["mask"]["attn"]["q"].shape == (8,)
  mapped = optax.tree.map_params(tx, lambda v: v.astype(jnp.bfloat16), state)
  assert mapped.kept_steps["attn"]["q"].dtype == jnp.float32


@dataclasses.dataclass(frozen=True)
class ShareOfLargestRule(_engine.Rule):
  """A rule that looks at the whole tree: each block's update is divided by the
  largest block norm of any leaf (measure per leaf, settle over the tree)."""

  draws = False

  def measure(self, leaf):
    return jnp.sqrt(leaf.plan.layout.block_sum(jnp.square(leaf.update)))

  def settle(self, leaves):
    largest = jnp.max(jnp.stack([jnp.max(leaf.measured) for leaf in leaves]))
    return [jnp.broadcast_to(largest, leaf.measured.shape) for leaf in leaves]

  def scale(self, leaf):
    return 1.0 / leaf.measured, {}


def test_a_rule_can_settle_over_the_whole_tree():
  config = _engine.MaskConfig.create(granularity="row")
  tx = _engine.BlockMask(config, ShareOfLargestRule()).transformation()
  rng = np.random.default_rng(0)
  u = {"attn": {"q": rng.normal(size=(8, 4))}, "b": rng.normal(size=4)}
  got, _ = jax.jit(tx.update)(u, tx.init(u))
  largest = max(np.linalg.norm(u["attn"]["q"], axis=1).max(), np.linalg.norm(u["b"]))
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(u), strict=True):
    np.testing.assert_allclose(x, y / largest, rtol=1e-6)


def test_map_params_does_not_touch_block_fields():
  # Regression: optax's placeholder made scores and masks look like parameters,
  # so a cast (or a resharding) hit them too.
  tx = magma.magma(optax.adam(1e-2), granularity="row")
  state = tx.init(PARAMS)
  mapped = optax.tree.map_params(tx, lambda v: v.astype(jnp.bfloat16), state)
  assert mapped.inner_state[0].mu["attn"]["q"].dtype == jnp.bfloat16
  assert mapped.mask_state.scores["attn"]["q"].dtype == jnp.float32
  assert mapped.mask_state.mask["attn"]["q"].dtype == jnp.bool_
  fused = magma.adam_magma(1e-2, granularity="row")
  state = fused.init(PARAMS)
  mapped = optax.tree.map_params(fused, lambda v: v.astype(jnp.bfloat16), state)
  assert mapped.mu["attn"]["q"].dtype == jnp.bfloat16
  assert mapped.mu_sq_norm["attn"]["q"].dtype == jnp.float32


def test_the_new_rule_declares_its_layout_for_sharding():
  mesh = jax.make_mesh((1, 1), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  params = {
    "w": jax.ShapeDtypeStruct(
      (8, 8), jnp.float32, sharding=NamedSharding(mesh, P("x", "y"))
    )
  }
  for granularity, want in (("row", P("x")), ("column", P("y"))):
    shardings = magma.sharding.state_shardings(
      counting_mask(granularity=granularity), params
    )
    assert shardings.kept_steps["w"].spec == want
    assert shardings.mask["w"].spec == want


def test_one_config_validates_once():
  import pytest

  for kwargs, name in (
    ({"keep_prob": "0.5"}, "keep_prob"),
    ({"keep_prob": True}, "keep_prob"),
    ({"granularity": "rows"}, "granularity"),
    ({"stack_axes": 1.5}, "stack_axes"),
    ({"key": "seed"}, "key"),
  ):
    with pytest.raises(ValueError, match=name):
      _engine.MaskConfig.create(**kwargs)
