"""Many leaves in one kernel call: the grouped Triton kernel against the XLA step,
and the number of Pallas kernels the step of a transformer-shaped tree calls.

The kernel runs in the generic Pallas interpreter on CPU, so leaves are small; one
leaf spans several tiles, and sizes are not multiples of a tile.
"""

import _hlo
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma
from magma_optax import kernels
from magma_optax._core import blocks as _blocks
from magma_optax.kernels import grouped
from magma_optax.kernels import reference

# (shape, granularity, stack_axes, dtype of g/m/v, param mask, weight decay, scale)
LEAVES = [
  ((3, 700), "row", 0, jnp.float32, False, False, True),
  ((2 * grouped.TILE + 5,), "tensor", 0, jnp.float32, True, False, True),  # 3 tiles
  ((5, 7, 11), "element", 0, jnp.bfloat16, False, True, True),
  ((4, 6, 10), "tensor", 1, jnp.float32, True, True, True),  # stacked layers
  ((33,), "tensor", 0, jnp.float32, False, False, False),  # no scale: 1
]


def _leaf(case, seed):
  shape, granularity, stack_axes, dtype, masked, decay, scaled = case
  k = jax.random.split(jax.random.key(seed), 6)
  layout = _blocks.block_layout(shape, granularity, stack_axes)
  g = jax.random.normal(k[0], shape).astype(dtype)
  m = (0.1 * jax.random.normal(k[1], shape)).astype(dtype)
  v = (0.01 * jax.random.uniform(k[2], shape)).astype(dtype)
  p = jax.random.normal(k[3], shape).astype(dtype) if decay else None
  pm = jax.random.bernoulli(k[4], 0.7, shape) if masked else None
  scale = jax.random.uniform(k[5], layout.block_shape) if scaled else None
  hyper = reference.hyperparams(
    jnp.asarray(3 + seed), 1e-2, 0.1 if decay else 0.0, reference.AdamConstants()
  )
  return layout, g, m, v, hyper, scale, pm, p


def test_grouped_kernel_matches_the_xla_step():
  leaves = [_leaf(case, seed) for seed, case in enumerate(LEAVES)]
  got = jax.jit(
    lambda ls: grouped.masked_adam_grouped(
      [
        grouped.Leaf(g, m, v, h, s, layout.block_size, pm, p)
        for layout, (g, m, v, h, s, pm, p) in zip(
          [leaf[0] for leaf in leaves], ls, strict=True
        )
      ],
      interpret=True,
    )
  )([leaf[1:] for leaf in leaves])
  for case, leaf, out in zip(LEAVES, leaves, got, strict=True):
    layout, g, m, v, hyper, scale, pm, p = leaf
    want = reference.masked_adam_reference(
      g, m, v, hyper, scale=scale, layout=layout, param_mask=pm, params=p
    )
    bf16 = case[3] == jnp.bfloat16
    tol = dict(rtol=1e-2, atol=1e-6) if bf16 else dict(rtol=1e-6, atol=1e-9)
    # Random nonzero inputs: a tile left unwritten or written from another leaf
    # differs from the reference.
    for name, a, b in zip(("mu", "nu", "update"), out, want[:3], strict=True):
      assert a.shape == b.shape and a.dtype == b.dtype, name
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      np.testing.assert_allclose(a, b, err_msg=f"{case} {name}", **tol)
    if pm is not None:  # entries that do not exist: moments frozen, no update
      off = ~np.asarray(pm)
      np.testing.assert_array_equal(np.asarray(out[0])[off], np.asarray(m)[off])
      np.testing.assert_array_equal(np.asarray(out[2])[off], 0)


def test_grouped_kernel_refuses_what_it_cannot_take():
  g = jnp.ones((4, 4))
  h = reference.hyperparams(jnp.asarray(1), 1e-3, 0.0, reference.AdamConstants())
  with pytest.raises(ValueError, match="1 to"):
    grouped.masked_adam_grouped([], interpret=True)
  with pytest.raises(ValueError, match="whole blocks"):
    grouped.masked_adam_grouped([grouped.Leaf(g, g, g, h, None, 3)], interpret=True)


def transformer_params(layers=3, width=32):
  """A transformer-shaped tree: 16 leaves per layer (attention q, k, v, o and
  MLP up, down kernels with biases, two norms with scale and bias)."""

  def layer(i):
    w = lambda *s: jnp.full(s, 0.01 * (i + 1), jnp.float32)  # noqa: E731
    return {
      "attn": {
        n: {"kernel": w(width, width), "bias": w(width)} for n in ("q", "k", "v", "o")
      },
      "mlp": {
        "up": {"kernel": w(width, 4 * width), "bias": w(4 * width)},
        "down": {"kernel": w(4 * width, width), "bias": w(width)},
      },
      "ln_1": {"scale": w(width), "bias": w(width)},
      "ln_2": {"scale": w(width), "bias": w(width)},
    }

  return {f"layer_{i}": layer(i) for i in range(layers)}


def _step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_adam_magma_pallas_on_48_leaves_calls_few_kernels(granularity):
  params = transformer_params()
  assert len(jax.tree.leaves(params)) == 48

  def kernel_calls(platform="cuda", **kw):
    tx = magma.adam_magma(1e-3, implementation="pallas", granularity=granularity, **kw)
    text = _hlo.lowered(_step(tx), params, tx.init(params), params, platform=platform)
    return _hlo.pallas_calls(text)

  assert kernel_calls() == 1  # 48 leaves: one grouped call
  # Positive control: the per-leaf kernel (explicit tiles) is one call per leaf,
  # and the count sees every one; so does it on a TPU, whose kernel is per leaf.
  assert kernel_calls(block_sizes=kernels.BlockSizes(4, 32)) == 48
  if granularity != "tensor":
    return  # the TPU lowerings below do not depend on the granularity
  assert kernel_calls("tpu") == 48
  # Tiles the TPU kernel cannot take fail where the step is lowered for a TPU
  # (every platform's kernel is traced), not where it is lowered for CUDA.
  with pytest.raises(ValueError, match=r"tpu: block_\w+=\d+ must be a multiple"):
    kernel_calls("tpu", block_sizes=kernels.BlockSizes(4, 32))


def test_more_leaves_than_a_call_takes_make_several_calls():
  params = {f"w{i}": jnp.ones((8, 16)) for i in range(grouped.MAX_LEAVES + 3)}
  tx = magma.adam_magma(1e-3, implementation="pallas")
  text = _hlo.lowered(_step(tx), params, tx.init(params), params)
  assert _hlo.pallas_calls(text) == 2


def test_adam_magma_pallas_grouped_equals_xla_on_mixed_leaves():
  # Leaves of several shapes and dtypes in one interpreted call, with weight
  # decay, a parameter mask and an unscoped leaf, three steps, against XLA.
  params = {
    "attn": {"q_proj": {"kernel": jnp.linspace(-1, 1, 60).reshape(6, 10)}},
    "mlp": {"up_proj": {"kernel": jnp.linspace(1, 2, 60).reshape(3, 4, 5)}},
    "norm": {"scale": jnp.linspace(0.5, 1.5, 33).astype(jnp.bfloat16)},
  }
  masks = jax.tree.map(lambda x: jnp.arange(x.size).reshape(x.shape) % 3 != 0, params)
  kw = dict(weight_decay=0.1, granularity="row", where=magma.attention_mlp_weights)
  runs = {}
  for impl in ("xla", "pallas"):
    tx = magma.adam_magma(1e-2, implementation=impl, interpret=impl == "pallas", **kw)
    p, state, step = params, tx.init(params), jax.jit(tx.update)
    for t in range(3):
      grads = jax.tree.map(lambda x, t=t: jnp.sin(x * (t + 2.0)), p)
      u, state = step(grads, state, p, param_mask=masks)
      p = optax.apply_updates(p, u)
    runs[impl] = (p, state)
  (p_x, s_x), (p_p, s_p) = runs["xla"], runs["pallas"]
  for a, b in zip(jax.tree.leaves(p_p), jax.tree.leaves(p_x), strict=True):
    np.testing.assert_allclose(
      np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-7
    )
  for a, b in zip(jax.tree.leaves(s_p.mu), jax.tree.leaves(s_x.mu), strict=True):
    np.testing.assert_allclose(
      np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-7
    )
