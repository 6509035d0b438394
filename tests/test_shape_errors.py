"""Gradients whose shapes are not their parameters': a ValueError naming the
transform, the leaf's path and both shapes, from every transform (never a broadcast
or an error from deep inside the step)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma

LR = 1e-2
PARAMS = {"a": {"w": jnp.ones((4, 3))}, "b": jnp.ones((5,))}
GOOD = {"a": {"w": jnp.full((4, 3), 0.5)}, "b": jnp.full((5,), 0.5)}
BAD = {"a": {"w": jnp.full((3,), 0.5)}, "b": jnp.full((5,), 0.5)}
PATH = re.escape("['a']['w']")


def _transforms():
  adam = lambda: optax.adam(LR)
  return {
    "magma": magma.magma(adam()),
    "alignment_mask": magma.alignment_mask(),
    "skip_update": magma.skip_update(adam()),
    "bernoulli_mask": magma.bernoulli_mask(0.5),
    "damping": magma.damping(0.1),
    "periodic_mask": magma.periodic_mask(adam(), sparsity=0.5, every=1),
    "adam_magma": magma.adam_magma(LR),
    "sparse_state": magma.sparse_state(adam()),
    "sparse_adam": magma.sparse_adam(LR),
  }


NAMES = list(_transforms())


def _shapes_named(name):
  return rf"{name}: the update \(gradient\) at {PATH} has shape \(3,\).*\(4, 3\)"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("jit", [False, True])
def test_a_gradient_of_another_shape_names_the_leaf_and_both_shapes(name, jit):
  tx = _transforms()[name]
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(PARAMS)
  # Control: gradients of the parameters' shapes take the step.
  updates, _ = update(GOOD, state, PARAMS)
  assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, PARAMS)
  with pytest.raises(ValueError, match=_shapes_named(name)):
    update(BAD, state, PARAMS)


@pytest.mark.parametrize(
  "name, state_part",
  [
    ("magma", "the base optimizer's update"),
    ("skip_update", "the base optimizer's update"),
    ("alignment_mask", "the state's 'momentum' there"),
    ("adam_magma", "Adam's first moment there"),
  ],
)
def test_without_params_the_state_gives_the_parameters_shape(name, state_part):
  tx = _transforms()[name]
  state = tx.init(PARAMS)
  tx.update(GOOD, state)  # control
  want = rf"{name}: the update \(gradient\) at {PATH} has shape \(3,\), but"
  want += rf" {re.escape(state_part)} has shape \(4, 3\)"
  with pytest.raises(ValueError, match=want):
    tx.update(BAD, state)


@pytest.mark.parametrize("granularity", ["row", "column"])
def test_without_params_block_masks_compare_their_blocks(granularity):
  tx = magma.bernoulli_mask(0.5, granularity=granularity)
  state = tx.init(PARAMS)
  tx.update(GOOD, state)  # control
  with pytest.raises(ValueError, match=rf"bernoulli_mask: .* at {PATH} has shape"):
    tx.update(BAD, state)


@pytest.mark.parametrize("name", ["sparse_state", "sparse_adam"])
@pytest.mark.parametrize(
  "storage",
  [{}, {"mode": "compact", "density": 0.5}, {"mode": "compact", "structure": (1, 3)}],
)
def test_sparse_state_without_params_names_the_gradient(name, storage):
  factory = magma.sparse_state if name == "sparse_state" else magma.sparse_adam
  where = {"a": {"w": True}, "b": False}
  tx = factory(optax.adam(LR) if name == "sparse_state" else LR, where=where, **storage)
  mask = {"a": {"w": jnp.eye(4, 3, dtype=bool)}, "b": None}
  state = tx.init(PARAMS)
  tx.update(GOOD, state, param_mask=mask)  # control
  with pytest.raises(ValueError, match=rf"{name}: .*gradient"):
    tx.update(BAD, state, param_mask=mask)


@pytest.mark.parametrize("name", ["sparse_state", "sparse_adam"])
def test_sparse_state_names_a_gradient_tree_that_does_not_match(name):
  tx = _transforms()[name]
  state = tx.init(PARAMS)
  other = {"a": {"v": GOOD["a"]["w"]}, "b": GOOD["b"]}
  with pytest.raises(ValueError, match=rf"{name}: the gradients' tree is not") as e:
    tx.update(other, state)
  assert "['a']['v']" in str(e.value) and "['a']['w']" in str(e.value)
  assert "not built by this" not in str(e.value)


def test_masked_groups_are_compared_leaf_by_leaf():
  # Inside optax.masked the inner transform sees MaskedNode where the group has no
  # leaf; those are not compared, and the group's own leaves are.
  for name in NAMES:
    tx = optax.masked(_transforms()[name], {"a": {"w": True}, "b": False})
    state = tx.init(PARAMS)
    updates, _ = tx.update(GOOD, state, PARAMS)
    np.testing.assert_array_equal(updates["b"], GOOD["b"])
    with pytest.raises(ValueError, match=_shapes_named(name)):
      tx.update(BAD, state, PARAMS)
