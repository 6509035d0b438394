"""transformer_labels and attention_mlp_weights on common Flax / HF path names."""

import jax
import jax.numpy as jnp
import pytest

import magma_optax as magma

K = jax.tree_util.DictKey
A = jax.tree_util.GetAttrKey
S = jax.tree_util.SequenceKey


@pytest.mark.parametrize(
  "path,label",
  [
    ((K("layers_0"), K("attention"), K("query"), K("kernel")), "attention"),
    ((K("h"), S(3), K("attn"), K("c_attn"), K("kernel")), "attention"),
    ((K("blocks"), K("self_attn"), K("q_proj"), K("kernel")), "attention"),
    ((K("layer"), K("wq"), K("kernel")), "attention"),
    ((K("MultiHeadDotProductAttention_0"), K("out"), K("kernel")), "attention"),
    ((K("layers"), K("mlp"), K("gate_proj"), K("kernel")), "mlp"),
    ((K("h"), S(0), K("mlp"), K("c_proj"), K("kernel")), "mlp"),
    ((K("block"), K("feed_forward"), K("w1"), K("kernel")), "mlp"),
    ((K("block"), K("up_proj"), K("kernel")), "mlp"),
    ((K("embed"), K("embedding")), "other"),
    ((K("wte"), K("embedding")), "other"),
    ((K("lm_head"), K("kernel")), "other"),
    ((K("layers"), K("attention_norm"), K("scale")), "other"),
    ((K("layers"), K("attn"), K("q_norm"), K("scale")), "other"),
    ((A("final_norm"), A("scale")), "other"),
    ((K("conv"), K("kernel")), "other"),
  ],
)
def test_transformer_labels(path, label):
  assert magma.transformer_labels(path) == label


def test_attention_mlp_weights_is_the_papers_scope():
  params = {
    "attn": {"q_proj": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones((4,))}},
    "mlp": {"up": {"kernel": jnp.ones((4, 8))}},
    "embed": {"embedding": jnp.ones((10, 4))},
  }
  scope = jax.tree_util.tree_map_with_path(magma.attention_mlp_weights, params)
  assert scope == {
    "attn": {"q_proj": {"kernel": True, "bias": False}},
    "mlp": {"up": {"kernel": True}},
    "embed": {"embedding": False},
  }


def test_bad_where_tree_raises():
  params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  with pytest.raises(ValueError, match="where"):
    magma.bernoulli_mask(where={"a": True}).init(params)
