"""Tests for magma_optax.flax.scaling (numpy references)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import magma_optax as magma
from magma_optax.flax import ScaledMaskedDense
from magma_optax.flax import ScaledMaskedLinear
from magma_optax.flax import assign_masks
from magma_optax.flax import knowledge_distillation_loss

IN, OUT, HEADS = 4, 6, 2


def np_scale(kind, a, head_axis="out"):
  if kind == "layer":
    return a
  if kind == "channel":
    return a[None, :]
  if head_axis == "out":
    return np.repeat(a, OUT // HEADS)[None, :]
  return np.repeat(a, IN // HEADS)[:, None]


@pytest.mark.parametrize(
    "kind, head_axis", [("layer", "out"), ("channel", "out"), ("head", "out"),
                        ("head", "in")]
)  # fmt: skip
def test_nnx_forward_matches_numpy(kind, head_axis):
  layer = ScaledMaskedLinear(
    IN, OUT, scale=kind, num_heads=HEADS, head_axis=head_axis, rngs=nnx.Rngs(0)
  )
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, IN)).astype(np.float32)
  w = np.asarray(layer.kernel[...])
  # A fresh layer is a plain dense layer.
  np.testing.assert_allclose(np.asarray(layer(x)), x @ w, rtol=1e-5, atol=1e-6)
  a = rng.uniform(0.5, 2.0, size=layer.scale[...].shape).astype(np.float32)
  m = rng.random((IN, OUT)) < 0.5
  b = rng.normal(size=OUT).astype(np.float32)
  layer.scale[...] = jnp.asarray(a)
  layer.bias[...] = jnp.asarray(b)
  layer.mask[...] = jnp.asarray(m)
  want = x @ (np_scale(kind, a, head_axis) * (w * m)) + b
  np.testing.assert_allclose(np.asarray(layer(x)), want, rtol=1e-5, atol=1e-6)
  # mask= overrides the stored mask.
  np.testing.assert_allclose(
    np.asarray(layer(x, mask=jnp.ones((IN, OUT), bool))),
    x @ (np_scale(kind, a, head_axis) * w) + b,
    rtol=1e-5,
    atol=1e-6,
  )


@pytest.mark.parametrize("straight_through", [False, True])
def test_gradients_of_pruned_weights(straight_through):
  layer = ScaledMaskedLinear(
    IN, OUT, straight_through=straight_through, rngs=nnx.Rngs(1)
  )
  m = np.add.outer(np.arange(IN), np.arange(OUT)) % 2 == 0  # no empty column
  layer.mask[...] = jnp.asarray(m)
  x = jnp.ones((2, IN))
  grads = nnx.grad(lambda mod: jnp.sum(mod(x) ** 2))(layer)
  gk = np.asarray(grads["kernel"][...])
  assert np.all(gk[m] != 0)
  assert np.all(gk[~m] != 0) if straight_through else np.all(gk[~m] == 0)
  assert np.all(np.asarray(grads["scale"][...]) != 0)


def test_mask_is_not_a_param():
  layer = ScaledMaskedLinear(IN, OUT, rngs=nnx.Rngs(0))
  names = set(nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
  assert names == {"kernel", "scale", "bias"}


def test_linen_matches_nnx():
  rng = np.random.default_rng(2)
  x = rng.normal(size=(3, IN)).astype(np.float32)
  m = jnp.asarray(rng.random((IN, OUT)) < 0.5)
  module = ScaledMaskedDense(OUT, scale="head", num_heads=HEADS)
  variables = module.init(jax.random.key(0), x)
  p = variables["params"]
  p = {**p, "scale": jnp.asarray([0.5, 2.0]), "bias": jnp.ones(OUT)}
  layer = ScaledMaskedLinear(IN, OUT, scale="head", num_heads=HEADS, rngs=nnx.Rngs(0))
  layer.kernel[...] = p["kernel"]
  layer.scale[...] = p["scale"]
  layer.bias[...] = p["bias"]
  np.testing.assert_allclose(
    np.asarray(module.apply({"params": p}, x, m)),
    np.asarray(layer(x, mask=m)),
    rtol=1e-6,
  )


def test_assign_masks_from_periodic_mask_state():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.q_proj = ScaledMaskedLinear(IN, OUT, rngs=rngs)
      self.o_proj = ScaledMaskedLinear(OUT, IN, scale="layer", rngs=rngs)

    def __call__(self, x):
      return self.o_proj(self.q_proj(x))

  model = Model(nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  tx = magma.periodic_mask(
    optax.sgd(0.1),
    sparsity=0.5,
    every=1,
    importance="magnitude",
    where=lambda path, x: str(path[-1].key) == "kernel",
  )
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, state = tx.update(grads, state, params)
  assign_masks(model, state.mask)
  for name in ("q_proj", "o_proj"):
    got = np.asarray(getattr(model, name).mask[...])
    np.testing.assert_array_equal(got, np.asarray(state.mask[name]["kernel"]))
    assert got.mean() == pytest.approx(0.5)
  # The pruned kernels make W * M == W: the forward pass is unchanged by the mask.
  new = optax.apply_updates(params, updates)
  nnx.update(model, new)
  x = jnp.ones((2, IN))
  q, o = new["q_proj"], new["o_proj"]
  hidden = x @ (q["scale"][None, :] * q["kernel"]) + q["bias"]
  ref = hidden @ (o["scale"] * o["kernel"]) + o["bias"]
  np.testing.assert_allclose(np.asarray(model(x)), np.asarray(ref), rtol=1e-5)


def np_kd(s, t, temp):
  def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))

  lt, ls = log_softmax(t / temp), log_softmax(s / temp)
  return temp**2 * (np.exp(lt) * (lt - ls)).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 2.0, 4.0])
def test_kd_loss_matches_numpy(temperature):
  rng = np.random.default_rng(3)
  s = rng.normal(size=(2, 5, 7)).astype(np.float32)
  t = rng.normal(size=(2, 5, 7)).astype(np.float32)
  where = rng.random((2, 5)) < 0.6
  kl = np_kd(s, t, temperature)
  got = knowledge_distillation_loss(s, t, temperature=temperature)
  assert float(got) == pytest.approx(kl.mean(), rel=1e-5)
  got = knowledge_distillation_loss(s, t, temperature=temperature, where=where)
  assert float(got) == pytest.approx(kl[where].mean(), rel=1e-5)
  assert float(knowledge_distillation_loss(t, t, temperature=temperature)) == (
    pytest.approx(0.0, abs=1e-6)
  )


def test_kd_loss_gradients():
  s = jnp.array([[0.0, 1.0, 2.0]])
  t = jnp.array([[2.0, 1.0, 0.0]])
  gs, gt = jax.grad(knowledge_distillation_loss, argnums=(0, 1))(s, t)
  assert np.all(np.asarray(gt) == 0)  # the teacher is not trained
  assert np.abs(np.asarray(gs)).sum() > 0
  # d/ds of T^2 KL at temperature T is T * (softmax(s/T) - softmax(t/T)).
  temp = 2.0
  want = temp * (jax.nn.softmax(s / temp) - jax.nn.softmax(t / temp))
  np.testing.assert_allclose(np.asarray(gs), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="scale"):
    ScaledMaskedLinear(IN, OUT, scale="row", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_heads"):
    ScaledMaskedLinear(IN, OUT, scale="head", num_heads=4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="head_axis"):
    ScaledMaskedLinear(IN, OUT, head_axis="both", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="temperature"):
    knowledge_distillation_loss(jnp.ones((1, 2)), jnp.ones((1, 2)), temperature=0.0)
  with pytest.raises(ValueError, match="same shape"):
    knowledge_distillation_loss(jnp.ones((1, 2)), jnp.ones((1, 3)))


def test_import_magma_optax_does_not_import_flax():
  import subprocess
  import sys

  code = "import sys, magma_optax; print('flax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert out.stdout.strip() == "False", out.stderr
