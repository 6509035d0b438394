"""Tests for magma_optax._trees: the parameter-shaped subtrees of a state."""

import jax
import jax.numpy as jnp
import optax

from magma_optax import _trees


def test_map_like_with_masked_subtrees_shapes_and_more_trees():
  params = {"a": jnp.ones(2), "b": {"c": jnp.ones(3), "d": jnp.ones(1)}}
  params_def = jax.tree.structure(params)
  # A group's moments: the "b" subtree masked as a whole, as optax.masked does.
  group = optax.adam(1e-3).init({"a": params["a"], "b": optax.MaskedNode()})
  entries = _trees.split_like(group[0].mu, params_def)
  assert [getattr(e, "shape", None) for e in entries] == [(2,), None, None]
  assert _trees.split_like(group[0].count, params_def) is None
  # fn sees the parameter index and the entry of every extra tree at that place.
  other = jax.tree.map(lambda x: x + 1.0, group)
  out = _trees.map_like(lambda i, x, y: x + y + i, group, params_def, other)
  assert out[0].mu["a"].tolist() == [1.0, 1.0]
  assert isinstance(out[0].mu["b"], optax.MaskedNode)
  assert int(out[0].count) == 0  # not parameter-like: unchanged
  # shapes: a tree at other shapes than the given ones is not parameter-like.
  same = _trees.map_like(lambda i, x: x + 1.0, group, params_def, shapes=[(5,)] * 3)
  assert same[0].mu["a"].tolist() == [0.0, 0.0]
  moved = _trees.map_like(lambda i, x: x + 1.0, group, params_def, shapes=[(2,)] * 3)
  assert moved[0].mu["a"].tolist() == [1.0, 1.0]
