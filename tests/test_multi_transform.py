"""Every transform inside ``optax.multi_transform`` (so ``optax.masked``).

``optax.masked`` hands the inner transform a parameter tree in which the other
group's leaves are ``optax.MaskedNode`` subtrees. The per-leaf state must be split
up to that tree's structure; the updates of the group must equal the transform run
alone on the group's parameters (as ``{"body": ...}``: masks are drawn from the leaf's
path in the whole tree, so the alone run keeps the same paths).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma

FACTORIES = {
  "magma": lambda: magma.magma(optax.adam(1e-2), key=1, granularity="row"),
  "skip_update": lambda: magma.skip_update(optax.adam(1e-2), key=1),
  "adam_magma": lambda: magma.adam_magma(1e-2, key=1),
  "alignment_mask": lambda: optax.chain(magma.alignment_mask(key=1), optax.adam(1e-2)),
  "bernoulli_mask": lambda: optax.chain(
    magma.bernoulli_mask(0.5, key=1), optax.sgd(1e-2)
  ),
  "damping": lambda: optax.chain(optax.adam(1e-2), magma.damping(0.5)),
  "periodic_mask": lambda: magma.periodic_mask(optax.adam(1e-2), sparsity=0.5, every=2),
  "sparse_state_compact": lambda: magma.periodic_mask(
    magma.sparse_state(optax.adam(1e-2), mode="compact", density=0.5),
    sparsity=0.5,
    every=2,
  ),
  "sparse_state_n_m": lambda: magma.periodic_mask(
    magma.sparse_state(optax.adam(1e-2), mode="compact", structure=(2, 4)),
    structure=(2, 4),
    every=2,
  ),
}


def _params():
  """Two groups: "body" (the transform under test) and "head"."""
  return {
    "body": {"w": jax.random.normal(jax.random.key(0), (4, 8)), "b": jnp.arange(8.0)},
    "head": {"w": jnp.ones((8, 4))},
  }


MASK_STATES = {"magma", "skip_update", "adam_magma", "alignment_mask", "bernoulli_mask"}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_inside_multi_transform_equals_alone(name):
  make = FACTORIES[name]
  params = _params()
  tx = optax.multi_transform(
    {"masked": make(), "plain": optax.adam(1e-2)}, {"body": "masked", "head": "plain"}
  )
  alone = make()
  body = {"body": params["body"]}
  state, alone_state = tx.init(params), alone.init(body)
  step = jax.jit(lambda s, g, p: tx.update(g, s, p))
  alone_step = jax.jit(lambda s, g, p: alone.update(g, s, p))
  p, q = params, body
  for t in range(3):
    g = jax.tree.map(lambda x, t=t: jnp.sin(x + t), p)
    u, state = step(state, g, p)
    v, alone_state = alone_step(alone_state, {"body": g["body"]}, q)
    for k in v["body"]:
      np.testing.assert_allclose(
        np.asarray(u["body"][k]), np.asarray(v["body"][k]), 1e-6
      )  # fmt: skip
    p, q = optax.apply_updates(p, u), optax.apply_updates(q, v)
  if name in MASK_STATES:  # mask_stats finds the state inside multi_transform
    stats, want = magma.mask_stats(state), magma.mask_stats(alone_state)
    np.testing.assert_allclose(stats["active_fraction"], want["active_fraction"])
    for k in want["mask"]["body"]:
      np.testing.assert_array_equal(stats["mask"]["body"][k], want["mask"]["body"][k])


# Consumers of a ``param_mask`` extra argument. optax.masked passes extra arguments
# through unchanged, so inside a group they receive the full mask.
PARAM_MASK_CONSUMERS = {
  "sparse_state_skip": lambda: magma.sparse_state(optax.adam(1e-2), mode="skip"),
  "masked_weight_decay": lambda: optax.chain(
    magma.masked_weight_decay(0.1, ramp_steps=0), optax.adam(1e-2)
  ),
  "adam_magma": lambda: magma.adam_magma(1e-2, key=1),
}


@pytest.mark.parametrize("name", sorted(PARAM_MASK_CONSUMERS))
def test_full_param_mask_inside_a_group(name):
  make = PARAM_MASK_CONSUMERS[name]
  params = _params()
  mask = jax.tree.map(lambda x: jnp.arange(x.size).reshape(x.shape) % 3 != 0, params)
  tx = optax.masked(make(), {"body": True, "head": False})
  alone = make()
  only = lambda tree: {"body": tree["body"]}  # the group's paths, alone
  state, alone_state = tx.init(params), alone.init(only(params))
  for t in range(2):
    g = jax.tree.map(lambda x, t=t: jnp.sin(x + t), params)
    u, state = jax.jit(tx.update)(g, state, params, param_mask=mask)
    v, alone_state = jax.jit(alone.update)(
      only(g), alone_state, only(params), param_mask=only(mask)
    )
    for k in v["body"]:
      np.testing.assert_allclose(
        np.asarray(u["body"][k]), np.asarray(v["body"][k]), 1e-6
      )  # fmt: skip


def test_param_mask_of_another_structure_is_an_error():
  params = {"body": {"w": jnp.ones((2, 3))}, "head": {"w": jnp.ones(3)}}
  tx = optax.masked(magma.sparse_state(optax.adam(1e-2)), {"body": True, "head": False})
  with pytest.raises(ValueError, match="param_mask must be a pytree like the params"):
    tx.update(params, tx.init(params), params, param_mask={"w": jnp.ones(3, bool)})


def test_offload_moves_state_inside_a_group():
  if not magma.host_offload_available():
    pytest.skip("no host memory kinds here")
  params = {"a": jnp.ones(4), "b": {"c": jnp.ones(3), "d": jnp.ones(2)}}
  inner = magma.sparse_state(optax.adam(1e-2), mode="offload", offload_after=2)
  tx = optax.masked(inner, {"a": True, "b": False})
  state = tx.init(params)
  step = jax.jit(tx.update)
  kinds = []
  for t in range(4):
    mask = jax.tree.map(lambda x, t=t: jnp.full(x.shape, t == 3), params)
    _, state = step(params, state, params, param_mask=mask)
    state = magma.offload_sparse_state(state, params)
    kinds.append(state.inner_state.base_state[0].mu["a"].sharding.memory_kind)
  device = jax.devices()[0].default_memory().kind
  # "a" is inactive at steps 0..2: cold after 2 steps, back when active at step 3.
  assert kinds == [device, "pinned_host", "pinned_host", device]
