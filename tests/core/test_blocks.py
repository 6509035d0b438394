"""Block layouts against the independent numpy block ids of tests/algorithm1.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from algorithm1 import block_ids

import magma_optax as magma
from magma_optax._core.blocks import SUM_RUN

CASES = [
  ((), "tensor", 0),
  ((5,), "tensor", 0),
  ((5,), "row", 0),
  ((5,), "column", 0),
  ((5,), "element", 0),
  ((4, 6), "tensor", 0),
  ((4, 6), "row", 0),
  ((4, 6), "column", 0),
  ((4, 6), "element", 0),
  ((4, 6), (2, 3), 0),
  ((4, 6), (2,), 0),
  ((6, 6), (3, 3), 0),
  ((2, 9, 1), "row", 0),
  ((2, 9, 1), "column", 0),
  ((2, 2, 4, 4), (2, 2), 0),
  ((3, 4, 6), "tensor", 1),
  ((3, 4, 6), "row", 1),
  ((3, 4, 6), "column", 1),
  ((3, 4, 6), (2, 3), 1),
  ((2, 3, 4, 6), "tensor", 2),
  ((3, 5), (2, 2), 1),  # the body (5,) has too few axes for a 2-D tile: one block
]


@pytest.mark.parametrize("shape,granularity,stack_axes", CASES)
def test_layout_matches_numpy_block_ids(shape, granularity, stack_axes):
  layout = magma.block_layout(shape, granularity, stack_axes)
  ids, n = block_ids(shape, granularity, stack_axes)
  assert layout.num_blocks == n
  assert layout.block_size * n == int(np.prod(shape))
  x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
  expected = np.bincount(ids.ravel(), weights=x.ravel(), minlength=n)
  np.testing.assert_allclose(
    np.asarray(layout.block_sum(x)).ravel(), expected, rtol=1e-5, atol=1e-5
  )
  values = np.arange(n, dtype=np.float32).reshape(layout.block_shape)
  np.testing.assert_array_equal(np.asarray(layout.to_leaf(values)), ids)


def test_stack_axes_tensor_is_one_block_per_layer():
  layout = magma.block_layout((4, 3, 5), "tensor", stack_axes=1)
  assert layout.block_shape == (4,)


@pytest.mark.parametrize("bad", ["rows", "", (), (0, 2), (2.0, 2), [True], None, 3])
def test_bad_granularity_raises(bad):
  with pytest.raises(ValueError, match="granularity"):
    magma.bernoulli_mask(0.5, granularity=bad)


def test_tile_not_dividing_raises_at_init():
  tx = magma.bernoulli_mask(0.5, granularity=(4, 4))
  with pytest.raises(ValueError, match="does not divide"):
    tx.init({"w": np.zeros((6, 8), np.float32)})


def test_stack_axes_beyond_rank_raises():
  tx = magma.bernoulli_mask(0.5, stack_axes=2)
  with pytest.raises(ValueError, match="stack_axes"):
    tx.init({"w": np.zeros((6,), np.float32)})
  with pytest.raises(ValueError, match="stack_axes"):
    magma.bernoulli_mask(0.5, stack_axes=-1)


# The runs path needs a last axis that is a multiple of SUM_RUN above it.
MASKED_CASES = CASES + [
  ((3, 2 * SUM_RUN), "row", 0),
  ((3, 2 * SUM_RUN), "tensor", 0),
  ((2, 3, 4 * SUM_RUN), "tensor", 1),
  ((4, 2 * SUM_RUN), (2, 2 * SUM_RUN), 0),
  ((4, 3 * SUM_RUN), "column", 0),
]


@pytest.mark.parametrize("shape,granularity,stack_axes", MASKED_CASES)
def test_masked_block_sums_match_numpy(shape, granularity, stack_axes):
  # Against float64 bincounts over the kept entries; the dropped entries hold inf
  # and NaN, which must not reach any sum.
  layout = magma.block_layout(shape, granularity, stack_axes)
  ids, n = block_ids(shape, granularity, stack_axes)
  rng = np.random.default_rng(1)
  xs = [rng.normal(size=shape).astype(np.float32) for _ in range(3)]
  keep = rng.uniform(size=shape) < 0.4
  for x, bad in zip(xs, (np.inf, np.nan, -np.inf), strict=False):
    x[~keep] = bad
  sums = layout.masked_block_sums([jnp.asarray(x) for x in xs], jnp.asarray(keep))
  assert len(sums) == 3
  for x, s in zip(xs, sums, strict=True):
    assert s.shape == layout.block_shape and s.dtype == jnp.float32
    kept = np.where(keep, x, 0).astype(np.float64)
    expected = np.bincount(ids.ravel(), weights=kept.ravel(), minlength=n)
    # float32 sums of at most a few thousand entries of size ~1
    np.testing.assert_allclose(np.asarray(s).ravel(), expected, rtol=1e-5, atol=1e-4)


def test_masked_block_sums_under_jit_vmap_and_grad():
  layout = magma.block_layout((4, 2 * SUM_RUN), "row")
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(3, 4, 2 * SUM_RUN)), jnp.float32)
  keep = jnp.asarray(rng.uniform(size=(3, 4, 2 * SUM_RUN)) < 0.5)

  def f(x, keep):
    dot, sq = layout.masked_block_sums([x * 2.0, x * x], keep)
    return dot.sum() + sq.sum()

  got = jax.jit(jax.vmap(f))(x, keep)
  np.testing.assert_allclose(
    got, jnp.sum(jnp.where(keep, 2 * x + x * x, 0), axis=(1, 2)), rtol=1e-5
  )
  grad = jax.grad(lambda x: jax.vmap(f)(x, keep).sum())(x)
  np.testing.assert_allclose(grad, jnp.where(keep, 2 + 2 * x, 0), rtol=1e-6)


def test_masked_block_sums_bad_input_is_a_clear_error():
  layout = magma.block_layout((2, 8), "row")
  keep = jnp.ones((2, 8), bool)
  x = jnp.ones((2, 8))
  with pytest.raises(ValueError, match="at least one array"):
    layout.masked_block_sums([], keep)
  # Mixed dtypes: a raw lax error one way round, a silent upcast the other.
  for xs in ([x.astype(jnp.bfloat16), x], [x, x.astype(jnp.bfloat16)]):
    with pytest.raises(ValueError, match="one dtype"):
      layout.masked_block_sums(xs, keep)
  with pytest.raises(ValueError, match=r"layout's shape \(2, 8\)"):
    layout.masked_block_sums([jnp.ones((8,))], keep)
