"""Tests for magma_optax.demo.llama: shapes, labels, RoPE, causality, training."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma
from magma_optax.demo import corpus
from magma_optax.demo import llama

CONFIG = llama.LlamaConfig.tiny(dim=32, n_layers=2, n_heads=2, mlp_dim=48)


@pytest.fixture(scope="module")
def model():
  return llama.init_params(CONFIG, seed=0)


@pytest.fixture(scope="module")
def forward(model):
  graphdef, _ = model
  return jax.jit(lambda params, tokens: llama.apply(graphdef, params, tokens))


@pytest.fixture(scope="module")
def batch():
  data = corpus.load(max_bytes=2000)
  return next(corpus.train_batches(data.train, batch_size=4, seq_len=24, seed=0))


def _expected_count(c: llama.LlamaConfig) -> int:
  per_layer = 4 * c.dim * c.dim + 3 * c.dim * c.mlp_dim + 2 * c.dim
  head = 0 if c.tie_embeddings else c.dim * c.vocab_size
  return c.vocab_size * c.dim + c.n_layers * per_layer + c.dim + head


def test_shapes_and_parameter_count(model, forward):
  _, params = model
  logits = forward(params, jnp.zeros((1, 12), jnp.int32))
  assert logits.shape == (1, 12, 256) and logits.dtype == jnp.float32
  assert llama.count_params(params) == _expected_count(CONFIG)
  assert params["layers"][1]["mlp"]["gate_proj"]["kernel"].shape == (32, 48)


def test_presets_sizes():
  for name in llama.PRESETS:
    c = llama.LlamaConfig.preset(name)
    assert isinstance(c, llama.LlamaConfig)
  assert (
    _expected_count(llama.LlamaConfig.tiny())
    < _expected_count(llama.LlamaConfig.small())
    < _expected_count(llama.LlamaConfig.medium())
  )


def test_transformer_labels_and_paper_scope(model):
  _, params = model
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  got = {
    "/".join(str(k.key) for k in path): (
      magma.transformer_labels(path, x),
      magma.attention_mlp_weights(path, x),
    )
    for path, x in flat
  }
  expected = {"embed/embedding": ("other", False)}
  expected["final_norm/scale"] = ("other", False)
  expected["lm_head/kernel"] = ("other", False)
  for i in range(CONFIG.n_layers):
    expected[f"layers/{i}/attn_norm/scale"] = ("other", False)
    expected[f"layers/{i}/mlp_norm/scale"] = ("other", False)
    for n in ("q", "k", "v", "o"):
      expected[f"layers/{i}/attn/{n}_proj/kernel"] = ("attention", True)
    for n in ("gate", "up", "down"):
      expected[f"layers/{i}/mlp/{n}_proj/kernel"] = ("mlp", True)
  assert got == expected


def test_labels_also_hold_on_the_nnx_state_tree():
  from flax import nnx

  _, state = nnx.split(llama.Llama(CONFIG, rngs=nnx.Rngs(0)))
  labels = [
    magma.transformer_labels(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]
  ]
  assert labels.count("attention") == 4 * CONFIG.n_layers
  assert labels.count("mlp") == 3 * CONFIG.n_layers


def test_tied_embeddings():
  c = llama.LlamaConfig.tiny(
    dim=16, n_layers=1, n_heads=2, mlp_dim=32, tie_embeddings=True
  )
  graphdef, params = llama.init_params(c)
  assert "lm_head" not in params
  assert llama.count_params(params) == _expected_count(c)
  x = jnp.arange(5, dtype=jnp.int32)[None]
  fwd = jax.jit(lambda p: llama.apply(graphdef, p, x))
  h = fwd(params)
  assert h.shape == (1, 5, 256)
  # The head is the embedding: changing row 200 (a byte not in the input) changes
  # exactly logit 200.
  bumped = {
    **params,
    "embed": {"embedding": params["embed"]["embedding"].at[200].add(1.0)},
  }
  diff = np.abs(np.asarray(fwd(bumped) - h)).max(axis=(0, 1))
  assert diff[200] > 1e-3
  np.testing.assert_array_equal(np.delete(diff, 200), 0.0)


def _rope_numpy(x, theta):
  _, t, _, d = x.shape
  half = d // 2
  out = np.empty_like(x, dtype=np.float64)
  for pos in range(t):
    for i in range(half):
      a = pos * theta ** (-i / half)
      x1, x2 = x[:, pos, :, i], x[:, pos, :, i + half]
      out[:, pos, :, i] = x1 * np.cos(a) - x2 * np.sin(a)
      out[:, pos, :, i + half] = x1 * np.sin(a) + x2 * np.cos(a)
  return out


def test_rope_matches_numpy_and_is_relative():
  x = np.random.default_rng(0).normal(size=(2, 6, 3, 8)).astype(np.float32)
  got = np.asarray(llama.rope(jnp.asarray(x), 100.0))
  np.testing.assert_allclose(got, _rope_numpy(x, 100.0), rtol=1e-5, atol=1e-5)
  # <rope(q)_m, rope(k)_n> depends only on m - n for fixed q, k vectors.
  q = np.broadcast_to(x[:1, :1, :1], (1, 6, 1, 8))
  k = np.broadcast_to(x[1:, :1, :1], (1, 6, 1, 8))
  rq = np.asarray(llama.rope(jnp.asarray(q), 100.0))[0, :, 0]
  rk = np.asarray(llama.rope(jnp.asarray(k), 100.0))[0, :, 0]
  np.testing.assert_allclose(rq[3] @ rk[1], rq[5] @ rk[3], rtol=1e-4)


def test_attention_is_causal(model, forward):
  _, params = model
  x = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, 12)), jnp.int32)
  y = x.at[0, 8].set((x[0, 8] + 1) % 256)
  a, b = forward(params, x), forward(params, y)
  np.testing.assert_allclose(a[0, :8], b[0, :8], atol=1e-6)
  assert np.abs(np.asarray(a[0, 8:] - b[0, 8:])).max() > 1e-4


def test_initial_loss_is_near_uniform(model, batch):
  graphdef, params = model
  loss = float(llama.make_eval_fn(graphdef)(params, jnp.asarray(batch)[None]))
  assert abs(loss - np.log(256)) < 0.05


@pytest.mark.parametrize("method", ["adam", "magma"])
def test_a_few_train_steps_reduce_loss(model, batch, method):
  graphdef, params = model
  params = jax.tree.map(jnp.array, params)  # the step donates its inputs
  if method == "adam":
    tx = optax.adam(1e-2)
  else:
    tx = magma.magma(optax.adam(3e-2), key=0, where=magma.attention_mlp_weights)
  opt_state = tx.init(params)
  step = llama.make_train_step(graphdef, tx)
  batch = jnp.asarray(batch)
  losses = []
  for _ in range(15):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  assert losses[-1] < losses[0] - 1.0, losses
  assert step._cache_size() == 1  # no recompilation after the first step
  evaluate = llama.make_eval_fn(graphdef)
  val = float(evaluate(params, batch[None]))
  np.testing.assert_allclose(
    val, float(llama.loss_fn(graphdef, params, batch)), rtol=1e-5
  )


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"dim": 30, "n_heads": 4}, "n_heads"),
    ({"dim": 12, "n_heads": 4}, "n_heads"),  # odd head size: no RoPE pairs
    ({"n_layers": 0}, "n_layers"),
    ({"mlp_dim": 1.5}, "mlp_dim"),
    ({"rope_theta": 0.0}, "rope_theta"),
  ],
)
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    llama.LlamaConfig(**kwargs)
  with pytest.raises(ValueError, match="preset"):
    llama.LlamaConfig.preset("huge")


def test_causal_attention_matches_jax_reference():
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 9, 3, 4)), jnp.float32) for _ in "qkv")
  ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(llama.causal_attention(q, k, v), ref, rtol=1e-5, atol=1e-6)


def test_paper60m_is_the_papers_body_with_a_byte_vocabulary():
  from flax import nnx

  c = llama.LlamaConfig.preset("paper60m")
  assert (c.dim, c.n_layers, c.n_heads, c.mlp_dim) == (512, 8, 8, 1376)
  shapes = nnx.state(nnx.eval_shape(lambda: llama.Llama(c, rngs=nnx.Rngs(0))))
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  assert count == _expected_count(c) == 25_567_744
  # The paper's "60M" counts a 32k-token embedding and head.
  assert _expected_count(llama.LlamaConfig.paper60m(vocab_size=32000)) == 58_073_600


def _dot_operand_types(config, batch):
  graphdef, params = llama.init_params(config, seed=0)
  text = jax.jit(lambda p: llama.loss_fn(graphdef, p, batch)).lower(params).as_text()
  return re.findall(r"stablehlo\.dot_general.*:\s*\(tensor<[^>]*x(\w+)>", text)


def test_bf16_matmuls_in_attention_and_mlp(batch):
  f32 = CONFIG
  bf16 = llama.LlamaConfig.tiny(dim=32, n_layers=2, n_heads=2, mlp_dim=48,
                                dtype=jnp.bfloat16)  # fmt: skip
  batch = jnp.asarray(batch)
  # Per layer: q, k, v, o, gate, up, down and attention's two products; the
  # head stays float32. Positive control: the float32 model has no bf16 dot.
  assert _dot_operand_types(f32, batch) == ["f32"] * 19
  types = _dot_operand_types(bf16, batch)
  assert sorted(types) == ["bf16"] * 18 + ["f32"]
  graphdef, params = llama.init_params(bf16, seed=0)
  _, params32 = llama.init_params(f32, seed=0)
  loss, grads = jax.value_and_grad(lambda p: llama.loss_fn(graphdef, p, batch))(params)
  reference = llama.loss_fn(llama.init_params(f32, seed=0)[0], params32, batch)
  np.testing.assert_allclose(float(loss), float(reference), rtol=1e-2)
  assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("dtype", [jnp.int32, "nonsense", bool])
def test_bad_dtype(dtype):
  with pytest.raises(ValueError, match="dtype"):
    llama.LlamaConfig(dtype=dtype)
