"""scope_report shows what the transforms will mask; init warns when the paper's
scope misses attention or MLP."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma

PARAMS = {
  "layers": {
    "0": {
      "attn": {"q_proj": {"kernel": jnp.ones((8, 8)), "bias": jnp.ones(8)}},
      "mlp": {"up_proj": {"kernel": jnp.ones((8, 16))}},
      "norm": {"scale": jnp.ones(8)},
    }
  },
  "embed": {"embedding": jnp.ones((32, 8))},
  "step": jnp.zeros([], jnp.int32),
}


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(where=magma.attention_mlp_weights, granularity="row"),
    dict(keep_prob={"attention": 0.25, "mlp": 0.75}, granularity="column"),
    dict(granularity="element"),
  ],
  ids=["paper-scope", "per-label", "everything"],
)
def test_the_report_matches_what_magma_masks(kwargs, capsys):
  report = magma.scope_report(PARAMS, **kwargs)
  assert capsys.readouterr().out == ""  # printing is the caller's: once
  print(report)
  printed = capsys.readouterr().out
  assert printed == str(report) + "\n" and repr(report) == str(report)
  assert printed.splitlines()[0].split() == [
    "path", "shape", "dtype", "label", "masked", "keep_prob", "blocks"
  ]  # fmt: skip
  assert f"{len(report.masked)} of {len(report)} leaves masked" in printed
  tx = magma.magma(optax.sgd(0.1), **kwargs)
  mask = magma.mask_stats(tx.init(PARAMS))["mask"]
  masked = {
    jax.tree_util.keystr(p): z
    for p, z in jax.tree_util.tree_flatten_with_path(
      mask, is_leaf=lambda x: isinstance(x, optax.MaskedNode)
    )[0]
    if not isinstance(z, optax.MaskedNode)
  }
  assert {r.path for r in report.masked} == set(masked)
  for row in report.masked:
    assert row.num_blocks == np.size(masked[row.path]), row
  by_path = {r.path: r for r in report}
  assert by_path["['layers']['0']['attn']['q_proj']['bias']"].label == "other"
  assert not by_path["['step']"].masked  # integer leaves never are
  if "keep_prob" in kwargs:
    assert by_path["['layers']['0']['mlp']['up_proj']['kernel']"].keep_prob == 0.75


def test_report_of_abstract_params_and_schedules():
  abstract = jax.eval_shape(lambda: PARAMS)
  report = magma.scope_report(
    abstract, keep_prob=optax.linear_schedule(0.5, 1.0, 10), print_table=False
  )
  assert {r.keep_prob for r in report.masked} == {"schedule"}
  assert "schedule" in str(report)


def _init_warnings(params, **kwargs):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tx = magma.magma(optax.adam(1e-3), **kwargs)
    state = tx.init(params)
    tx.init(params)  # a second init of the same tree: no second warning
    tx.update(params, state, params)
  return [w for w in caught if "paper's scope" in str(w.message)]


def test_init_warns_once_when_the_paper_scope_misses_the_mlp():
  block = {
    "MultiHeadDotProductAttention_0": {"query": {"kernel": jnp.ones((8, 2, 4))}},
    "Dense_0": {"kernel": jnp.ones((8, 32))},
    "Dense_1": {"kernel": jnp.ones((32, 8))},
  }
  params = {"TransformerBlock_0": block}
  found = _init_warnings(params, where=magma.attention_mlp_weights)
  assert len(found) == 1
  message = str(found[0].message)
  assert "no mlp matrix" in message and "['TransformerBlock_0']['Dense_0']" in message
  assert "where=" in message and "scope_report" in message
  assert found[0].filename == __file__  # points at the caller, not the package
  # A model whose attention and MLP are both found does not warn, nor does a
  # where= the user wrote (they chose the scope).
  assert not _init_warnings(PARAMS, where=magma.attention_mlp_weights)
  assert not _init_warnings(params, where=lambda path, leaf: leaf.ndim >= 2)
  # Per-label keep probabilities on the default labels decide the scope too.
  renamed = {"Block_1": block}
  assert len(_init_warnings(renamed, keep_prob={"attention": 0.5})) == 1


def test_llama_has_both_and_does_not_warn():
  llama = pytest.importorskip("magma_optax.demo.llama")
  _, params = llama.init_params(llama.LlamaConfig.tiny(), seed=0)
  assert not _init_warnings(params, where=magma.attention_mlp_weights)
  report = magma.scope_report(
    params, where=magma.attention_mlp_weights, print_table=False
  )
  assert {r.label for r in report.masked} == {"attention", "mlp"}
  assert all(len(r.shape) >= 2 for r in report.masked)


# --- labels from the whole tree -------------------------------------------------------


def _nanogpt_params():
  """A nanoGPT-style block built from flax.nnx (``self.sa = MultiHeadAttention``,
  no "attention" in the module's name) and a classifier head named ``mlp_head``."""
  nnx = pytest.importorskip("flax.nnx")

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.ln1 = nnx.LayerNorm(8, rngs=rngs)
      self.sa = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=rngs
      )
      self.ln2 = nnx.LayerNorm(8, rngs=rngs)
      self.mlp = nnx.Sequential(
        nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 8, rngs=rngs)
      )

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.block = Block(rngs)
      self.mlp_head = nnx.Linear(8, 4, rngs=rngs)

  return nnx.state(Model(nnx.Rngs(0)), nnx.Param)


SA = "['block']['sa']"
WANT_MASKED = {f"{SA}['{p}']['kernel']" for p in ("query", "key", "value", "out")} | {
  f"['block']['mlp']['layers'][{i}]['kernel']" for i in (0, 1)
}


def _masked_paths(tx, params):
  return _masked_in(tx.init(params))


def _masked_in(state):
  mask = magma.mask_stats(state)["mask"]
  return {
    jax.tree_util.keystr(p).removesuffix(".value")
    for p, z in jax.tree_util.tree_flatten_with_path(
      mask, is_leaf=lambda x: isinstance(x, optax.MaskedNode)
    )[0]
    if not isinstance(z, optax.MaskedNode)
  }


def test_an_out_projection_beside_query_and_key_is_attention():
  params = _nanogpt_params()
  report = magma.scope_report(params, where=magma.attention_mlp_weights)
  by_path = {r.path: r for r in report}
  assert by_path[f"{SA}['out']['kernel']"].label == "attention"
  assert by_path[f"{SA}['out']['bias']"].label == "other"  # a bias stays one
  assert by_path["['mlp_head']['kernel']"].label == "other"
  assert {r.path for r in report.masked} == WANT_MASKED
  # What the transforms mask is what the report shows.
  for tx in (
    magma.magma(optax.adam(1e-3), where=magma.attention_mlp_weights),
    magma.skip_update(optax.adam(1e-3), keep_prob={"attention": 0.5, "mlp": 0.5}),
    magma.adam_magma(1e-3, where=magma.attention_mlp_weights),
  ):
    assert _masked_paths(tx, params) == WANT_MASKED
  pruned = magma.periodic_mask(
    optax.adam(1e-3), sparsity=0.5, every=1, where=magma.attention_mlp_weights
  ).init(params)
  got = {
    jax.tree_util.keystr(p).removesuffix(".value")
    for p, m in jax.tree_util.tree_flatten_with_path(
      pruned.mask, is_leaf=lambda x: isinstance(x, optax.MaskedNode)
    )[0]
    if not isinstance(m, optax.MaskedNode)
  }
  assert got == WANT_MASKED


def test_a_head_named_after_its_contents_is_a_head():
  paths = {
    "mlp_head/kernel": "other",
    "cls_head/dense/kernel": "other",
    "head_0/kernel": "other",
    "attn_head/q_proj/kernel": "attention",  # a head of attention is attention
    "mlp/fc1/kernel": "mlp",  # control
  }
  for path, label in paths.items():
    key_path = tuple(jax.tree_util.DictKey(k) for k in path.split("/"))
    assert magma.transformer_labels(key_path) == label, path


def test_siblings_in_other_groups_of_multi_transform_still_count():
  # Inside optax.multi_transform a group's tree holds MaskedNode where the other
  # groups' leaves are: their names still say that "out" sits beside query/key.
  params = _nanogpt_params()
  groups = jax.tree_util.tree_map_with_path(
    lambda p, _: "o" if "['out']" in jax.tree_util.keystr(p) else "rest", params
  )
  tx = optax.multi_transform(
    {
      "o": magma.magma(optax.adam(1e-3), where=magma.attention_mlp_weights),
      "rest": optax.adam(1e-3),
    },
    groups,
  )
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # nor does it warn that no attention is found
    state = tx.init(params)
  masked = _masked_in(state.inner_states["o"].inner_state)
  assert masked == {f"{SA}['out']['kernel']"}


def test_attention_projections_partly_in_scope_warn_once():
  params = _nanogpt_params()
  only_qkv = lambda p, x: x.ndim >= 2 and "['out']" not in jax.tree_util.keystr(p)
  with pytest.warns(UserWarning, match=r"block/sa is only partly in scope") as rec:
    magma.magma(optax.adam(1e-3), where=only_qkv).init(params)
  assert any("['out']['kernel'] not" in str(w.message) for w in rec)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    magma.magma(optax.adam(1e-3), where=only_qkv).init(params)  # once
    # Control: the whole module in scope, or none of it: no warning.
    magma.magma(optax.adam(1e-3), where=magma.attention_mlp_weights).init(params)
    no_sa = lambda p, x: x.ndim >= 2 and "['sa']" not in jax.tree_util.keystr(p)
    magma.magma(optax.adam(1e-3), where=no_sa).init(params)
