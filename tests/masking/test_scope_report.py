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
  printed = capsys.readouterr().out
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
