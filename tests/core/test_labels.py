"""transformer_labels / attention_mlp_weights on the parameter paths of real model code.

Each row is a path as the library writes it (``/``-separated; no downloads), the
leaf's shape, the expected label and whether the paper's scope
(``attention_mlp_weights``) includes it. NNX paths end in a ``.value`` attribute;
every Linen row is also checked with that suffix (the same model in NNX).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.tree_util import DictKey
from jax.tree_util import GetAttrKey
from jax.tree_util import SequenceKey

import magma_optax as magma
from magma_optax._core import labels as _labels

ATT, MLP, OTH = "attention", "mlp", "other"
TABLE = {
  "flax linen MultiHeadDotProductAttention + Dense MLP (flax examples' MlpBlock)": [
    ("params/MultiHeadDotProductAttention_0/query/kernel", (8, 2, 4), ATT, True),
    ("params/MultiHeadDotProductAttention_0/query/bias", (2, 4), OTH, False),
    ("params/MultiHeadDotProductAttention_0/key/bias", (2, 4), OTH, False),
    ("params/MultiHeadDotProductAttention_0/value/kernel", (8, 2, 4), ATT, True),
    ("params/MultiHeadDotProductAttention_0/out/kernel", (2, 4, 8), ATT, True),
    ("params/MultiHeadDotProductAttention_0/out/bias", (8,), OTH, False),
    ("params/encoderblock_0/MlpBlock_0/Dense_0/kernel", (8, 32), MLP, True),
    ("params/encoderblock_0/MlpBlock_0/Dense_1/bias", (8,), OTH, False),
    ("params/encoderblock_0/LayerNorm_0/scale", (8,), OTH, False),
    ("params/SelfAttention_0/query/kernel", (8, 2, 4), ATT, True),
    ("params/Embed_0/embedding", (100, 8), OTH, False),
  ],
  "flax nnx MultiHeadAttention (normalize_qk)": [
    ("attention/query/kernel", (8, 2, 4), ATT, True),
    ("attention/query/bias", (2, 4), OTH, False),
    ("attention/query_ln/scale", (4,), OTH, False),
    ("attention/key_ln/scale", (4,), OTH, False),
    ("attention/out/kernel", (2, 4, 8), ATT, True),
    ("mha/value/kernel", (8, 2, 4), ATT, True),
    ("embed/embedding", (10, 8), OTH, False),
    ("norm/scale", (8,), OTH, False),
  ],
  "Hugging Face Flax GPT-2": [
    ("transformer/h/0/attn/c_attn/kernel", (8, 24), ATT, True),
    ("transformer/h/0/attn/c_attn/bias", (24,), OTH, False),
    ("transformer/h/0/attn/c_proj/kernel", (8, 8), ATT, True),
    ("transformer/h/0/mlp/c_fc/kernel", (8, 32), MLP, True),
    ("transformer/h/0/mlp/c_proj/kernel", (32, 8), MLP, True),
    ("transformer/h/0/ln_1/scale", (8,), OTH, False),
    ("transformer/h/0/ln_2/bias", (8,), OTH, False),
    ("transformer/wte/embedding", (100, 8), OTH, False),
    ("transformer/wpe/embedding", (16, 8), OTH, False),
    ("transformer/ln_f/scale", (8,), OTH, False),
  ],
  "Hugging Face Flax LLaMA": [
    ("model/layers/0/self_attn/q_proj/kernel", (8, 8), ATT, True),
    ("model/layers/0/self_attn/o_proj/kernel", (8, 8), ATT, True),
    ("model/layers/0/mlp/gate_proj/kernel", (8, 32), MLP, True),
    ("model/layers/0/mlp/down_proj/kernel", (32, 8), MLP, True),
    ("model/layers/0/input_layernorm/weight", (8,), OTH, False),
    ("model/layers/0/post_attention_layernorm/weight", (8,), OTH, False),
    ("model/embed_tokens/embedding", (100, 8), OTH, False),
    ("model/norm/weight", (8,), OTH, False),
    ("lm_head/kernel", (8, 100), OTH, False),
  ],
  "Hugging Face Flax BERT": [
    ("bert/encoder/layer/0/attention/self/query/kernel", (8, 8), ATT, True),
    ("bert/encoder/layer/0/attention/self/query/bias", (8,), OTH, False),
    ("bert/encoder/layer/0/attention/output/dense/kernel", (8, 8), ATT, True),
    ("bert/encoder/layer/0/attention/output/LayerNorm/scale", (8,), OTH, False),
    ("bert/encoder/layer/0/intermediate/dense/kernel", (8, 32), MLP, True),
    ("bert/encoder/layer/0/output/dense/kernel", (32, 8), MLP, True),
    ("bert/encoder/layer/0/output/LayerNorm/bias", (8,), OTH, False),
    ("bert/embeddings/word_embeddings/embedding", (100, 8), OTH, False),
    ("bert/pooler/dense/kernel", (8, 8), OTH, False),
  ],
  "Hugging Face Flax T5": [
    ("encoder/block/0/layer/0/SelfAttention/q/kernel", (8, 8), ATT, True),
    ("encoder/block/0/layer/0/SelfAttention/o/kernel", (8, 8), ATT, True),
    ("decoder/block/0/layer/1/EncDecAttention/k/kernel", (8, 8), ATT, True),
    ("encoder/block/0/layer/1/DenseReluDense/wi/kernel", (8, 32), MLP, True),
    ("encoder/block/0/layer/1/DenseReluDense/wo/kernel", (32, 8), MLP, True),
    ("decoder/block/0/layer/2/DenseReluDense/wi_0/kernel", (8, 32), MLP, True),
    ("encoder/block/0/layer/0/layer_norm/weight", (8,), OTH, False),
    ("shared/embedding", (100, 8), OTH, False),
    ("encoder/final_layer_norm/weight", (8,), OTH, False),
  ],
  "MaxText (scanned layers)": [
    ("params/decoder/layers/self_attention/query/kernel", (8, 2, 2, 4), ATT, True),
    ("params/decoder/layers/self_attention/out/kernel", (2, 2, 4, 8), ATT, True),
    ("params/decoder/layers/mlp/wi_0/kernel", (8, 2, 32), MLP, True),
    ("params/decoder/layers/mlp/wo/kernel", (32, 2, 8), MLP, True),
    ("params/decoder/layers/pre_self_attention_layer_norm/scale", (8, 2), OTH, False),
    ("params/decoder/decoder_norm/scale", (8,), OTH, False),
    ("params/decoder/logits_dense/kernel", (8, 100), OTH, False),
    ("params/token_embedder/embedding", (100, 8), OTH, False),
  ],
  "Gemma": [
    ("transformer/layer_0/attn/q_einsum/w", (2, 8, 4), ATT, True),
    ("transformer/layer_0/attn/kv_einsum/w", (2, 2, 8, 4), ATT, True),
    ("transformer/layer_0/attn/attn_vec_einsum/w", (2, 4, 8), ATT, True),
    ("transformer/layer_0/mlp/gating_einsum", (2, 8, 32), MLP, True),
    ("transformer/layer_0/mlp/linear", (32, 8), MLP, True),
    ("transformer/layer_0/pre_attention_norm/scale", (8,), OTH, False),
    ("transformer/layer_0/pre_ffw_norm/scale", (8,), OTH, False),
    ("transformer/embedder/input_embedding", (100, 8), OTH, False),
    ("transformer/final_norm/scale", (8,), OTH, False),
  ],
  "MoE expert stacks and routers": [
    ("params/decoder/layers/MoeBlock_0/wi_0", (4, 8, 32), MLP, True),
    ("params/decoder/layers/MoeBlock_0/wo", (4, 32, 8), MLP, True),
    ("params/decoder/layers/MoeBlock_0/gate/kernel", (8, 4), OTH, False),
    ("model/layers/0/block_sparse_moe/experts/0/w1/kernel", (8, 32), MLP, True),
    ("model/layers/0/block_sparse_moe/gate/kernel", (8, 4), OTH, False),
    ("layers/0/mlp/router/kernel", (8, 4), OTH, False),
    ("layers/0/mlp/experts/up_proj", (4, 8, 32), MLP, True),
  ],
}
ROWS = [(model, *row) for model, rows in TABLE.items() for row in rows]


def _key_path(path, nnx=False):
  keys = [SequenceKey(int(p)) if p.isdigit() else DictKey(p) for p in path.split("/")]
  return tuple(keys) + ((GetAttrKey("value"),) if nnx else ())


@pytest.mark.parametrize("nnx", [False, True], ids=["linen", "nnx"])
@pytest.mark.parametrize("model, path, shape, label, in_scope", ROWS)
def test_labels_of_real_model_paths(model, path, shape, label, in_scope, nnx):
  key_path, leaf = _key_path(path, nnx), jnp.zeros(shape)
  assert magma.transformer_labels(key_path, leaf) == label, (model, path)
  assert magma.attention_mlp_weights(key_path, leaf) == in_scope, (model, path)
  assert _labels.classify(key_path, leaf)[1], f"{path} is not recognised"


def test_a_dict_key_named_value_is_the_value_projection():
  """Only NNX's trailing ``.value`` attribute is dropped, not a module "value"."""
  path = (DictKey("block"), DictKey("value"), DictKey("kernel"))
  assert magma.transformer_labels(path) == ATT


def test_unexplained_matrices_are_unrecognised():
  # Auto-named Dense layers directly inside a block: no name says "MLP".
  path = _key_path("params/TransformerBlock_0/Dense_0/kernel")
  assert _labels.classify(path, jnp.zeros((8, 32))) == (OTH, False)
  assert _labels.classify(path, jnp.zeros((8,))) == (OTH, True)  # not a matrix


def test_linen_and_nnx_models_get_the_same_labels():
  nn = pytest.importorskip("flax.linen")
  nnx = pytest.importorskip("flax.nnx")

  class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.MultiHeadDotProductAttention(num_heads=2, name="attention")(x)

  class Nnx(nnx.Module):
    def __init__(self, rngs):
      self.attention = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=rngs
      )

  linen = Linen().init(jax.random.key(0), jnp.ones((1, 3, 8)))["params"]
  state = nnx.state(Nnx(nnx.Rngs(0)), nnx.Param)
  label = lambda tree: {
    jax.tree_util.keystr(p).removesuffix(".value"): (
      magma.transformer_labels(p, x), magma.attention_mlp_weights(p, x)
    )
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
  }  # fmt: skip
  got_linen, got_nnx = label(linen), label(state)
  assert got_linen == got_nnx
  assert got_linen["['attention']['query']['bias']"] == (OTH, False)
  assert got_linen["['attention']['query']['kernel']"] == (ATT, True)
