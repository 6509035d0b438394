"""Tests for ``benchmarks/lm.py``: the ``paper60m`` grid end to end at a tiny size."""

import contextlib
import io
import json
import math
import re

import _benchmarks
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from magma_optax.demo import corpus
from magma_optax.demo import llama


@pytest.fixture(scope="module")
def lm():
  return _benchmarks.load("lm.py")


# The CI command is `--preset paper60m --model tiny --steps 5`; the preset's
# 128 x 256 batches cost a tiny model about 2.5 CPU-seconds a step (attention over
# 256 bytes), so the test also shrinks the batch and the evaluation set.
CI_ARGV = ["--preset", "paper60m", "--model", "tiny", "--steps", "5",
           "--batch-size", "8", "--eval-batches", "2", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def paper60m_run(lm, tmp_path_factory):
  out = tmp_path_factory.mktemp("lm_paper60m")
  text = io.StringIO()
  with contextlib.redirect_stdout(text):
    record = lm.main(CI_ARGV + ["--out", str(out)])
  return record, out, text.getvalue()


def test_paper60m_grid_runs_and_reports(lm, paper60m_run):
  record, out, text = paper60m_run
  preset = lm.PRESETS["paper60m"]
  runs = record["runs"]
  assert [(r["method"], r["lr"]) for r in runs] == [
    (m, lr) for m, lr, _ in lm.run_order(lm.parse_args(CI_ARGV))
  ]
  assert {(r["method"], r["lr"]) for r in runs} == {
    (m, lr) for m in preset.methods for lr in preset.lrs[m]
  }
  assert record["skipped"] == [] and set(record["compile_seconds"]) == set(
    preset.methods
  )
  assert record["config"]["dtype"] == "bfloat16"
  assert record["corpus"]["files"] == len(corpus.stdlib_sources())
  for r in runs:
    assert r["steps"] == 5 and r["val_steps"] == [0, 5]
    assert len(r["train_loss"]) == 5 and all(math.isfinite(x) for x in r["train_loss"])
    assert r["gap"] == pytest.approx(r["final_val_loss"] - r["final_train_window_loss"])
    assert r["final_val_ppl"] == pytest.approx(math.exp(r["final_val_loss"]))
  # One initialisation and one batch stream: the step-0 losses agree across runs.
  for key in ("val_loss", "train_window_loss", "train_loss"):
    np.testing.assert_allclose([r[key][0] for r in runs], runs[0][key][0], rtol=1e-6)
  assert len({r["final_val_loss"] for r in runs}) == len(runs)  # but they train
  # A line per finished run, the estimate first, the caveat at the end.
  assert len(re.findall(r"^\[\d/9\] .* lr .*: val ", text, re.M)) == 9
  assert text.index("estimate on one H200") < text.index("[1/9]")
  assert "133,440 parameters with bytes for tokens" in text
  assert lm.BYTE_PPL_NOTE in text
  table = lm.markdown_table(record["summary"])
  assert table in text and "byte perplexity | train/val gap" in table
  for m, s in record["summary"].items():
    by_lr = {float(lr): t["mean"] for lr, t in s["by_lr"].items()}
    assert s["best_lr"] == min(by_lr, key=by_lr.get)
    assert f"| {lm.LABELS[m]} | {s['best_lr']:g} |" in table
  saved = json.loads((out / "results.json").read_text())
  assert saved["summary"] == json.loads(json.dumps(record["summary"]))
  lines = (out / "runs.jsonl").read_text().splitlines()
  assert [json.loads(line) for line in lines] == json.loads(json.dumps(runs))
  for name in ("loss_vs_lr.png", "loss_curves.png"):
    assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (out / name).unlink()
  # The report again from the JSON alone (for a device without matplotlib).
  again = io.StringIO()
  with contextlib.redirect_stdout(again):
    lm.main(["--replot", str(out)])
  assert table in again.getvalue()
  assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_time_budget_skips_runs_and_still_reports(lm, tmp_path, capsys):
  record = lm.main(CI_ARGV + ["--time-budget", "1", "--out", str(tmp_path)])
  text = capsys.readouterr().out
  assert record["runs"] == [] and len(record["skipped"]) == 9
  assert len(re.findall(r"^\[\d/9\] .*: skipped", text, re.M)) == 9
  assert json.loads((tmp_path / "results.json").read_text())["skipped"]


def test_paper60m_estimate_fits_eight_minutes(lm):
  args = lm.parse_args(["--preset", "paper60m"])
  config = llama.LlamaConfig.preset("paper60m")
  params = 25_567_744
  steps = lm.capped_steps(args, 28_000_000)
  assert steps == args.steps  # 3 passes over the stdlib's text would be more
  est = lm.estimate(args, config, params, steps)
  tokens = 800 * 128 * 256
  per_token = 6 * params + 12 * 256 * 512 * 8
  eval_flops = 2 * 8 * 128 * 256 * (2 * params + 4 * 256 * 512 * 8)
  assert est["flops_per_run"] == pytest.approx(tokens * per_token + 4 * eval_flops)
  rate = 0.25 * 790e12
  assert est["seconds_per_run"] == pytest.approx(est["flops_per_run"] / rate)
  assert est["runs"] == 9 and est["compiles"] == 3
  assert est["total_seconds"] == pytest.approx(
    20 + 3 * 45 + 9 * est["seconds_per_run"] + eval_flops / rate
  )
  assert est["total_seconds"] < 0.8 * 480  # margin under the 8 minutes
  assert args.time_budget < 480


def test_paper60m_size_is_stated_against_the_papers_count(lm):
  config = llama.LlamaConfig.preset("paper60m")
  line = lm.describe_size(config, 25_567_744)
  assert "25,567,744 parameters with bytes for tokens (25.6M)" in line
  assert "32k-token embedding and head: 58.1M" in line


def test_steps_capped_at_passes_over_the_text(lm):
  args = lm.parse_args(["--preset", "paper60m"])
  per_step = 128 * 256
  assert lm.capped_steps(args, 100 * per_step) == 300  # 3 passes
  assert lm.capped_steps(args, 10**9) == 800
  args = lm.parse_args(["--preset", "paper60m", "--max-passes", "0"])
  assert lm.capped_steps(args, 100 * per_step) == 800


def test_learning_rate_grids(lm):
  args = lm.parse_args(["--preset", "paper60m"])
  assert args.lrs == dict(lm.PRESETS["paper60m"].lrs)
  order = lm.run_order(args)
  assert order[:3] == [("adam", 1e-3, 0), ("adam_magma", 5e-3, 0),
                       ("rmsprop_magma", 5e-3, 0)]  # fmt: skip
  args = lm.parse_args(["--preset", "paper60m", "--lrs", "0.002", "0.02"])
  assert set(args.lrs.values()) == {(0.002, 0.02)}
  args = lm.parse_args(["--preset", "tiny", "--seeds", "2"])
  assert args.methods == lm.METHODS and set(args.lrs.values()) == {(1e-3, 1e-2)}
  assert len(lm.run_order(args)) == len(lm.METHODS) * 2 * 2
  for argv in (["--lrs", "-1"], ["--max-passes", "-1"], ["--utilisation", "2"]):
    with pytest.raises(SystemExit):
      lm.parse_args(argv)


def test_step_gathers_the_batch_on_the_device(lm):
  config = llama.LlamaConfig.tiny(dim=32, n_layers=1, n_heads=2, mlp_dim=48)
  graphdef, params = llama.init_params(config, seed=0)
  text = np.random.default_rng(0).integers(0, 256, 500).astype(np.uint8)
  starts = corpus.train_starts(text, batch_size=3, seq_len=16, num_batches=2, seed=1)
  batches = corpus.train_batches(text, batch_size=3, seq_len=16, seed=1)
  tx = optax.adam(1e-2)
  step = lm.make_step(graphdef, tx, 16)
  reference = llama.make_train_step(graphdef, tx, donate=False)
  p, s = jax.tree.map(jnp.array, params), tx.init(params)
  q, r = params, tx.init(params)
  for row in starts:
    p, s, loss = step(p, s, jnp.asarray(text), jnp.asarray(row, jnp.int32))
    q, r, expected = reference(q, r, jnp.asarray(next(batches)))
    assert float(loss) == float(expected)
  jax.tree.map(np.testing.assert_array_equal, p, q)


@pytest.mark.parametrize("method", ["adam", "adam_magma", "rmsprop_magma"])
def test_step_adds_no_control_flow_on_cuda(lm, method):
  """The step's CUDA program branches only where the optimizer's own update does.

  A ``while`` or ``case`` on a traced value makes a GPU read its predicate back;
  the batch gather and the loss add none. (Magma's update has one, for the whole
  tree: the rescue of non-finite block sums.)
  """
  config = llama.LlamaConfig.tiny(dim=32, n_layers=1, n_heads=2, dtype=jnp.bfloat16)
  graphdef, params = llama.init_params(config, seed=0)
  flow = re.compile(r"stablehlo\.(while|case)|callback")

  def count(tx):
    state, text = tx.init(params), jnp.zeros(100, jnp.uint8)
    step = lm.make_step(graphdef, tx, 8).trace(
      params, state, text, jnp.zeros(2, jnp.int32)
    )
    update = jax.jit(tx.update).trace(params, state, params)
    return [
      len(flow.findall(t.lower(lowering_platforms=("cuda",)).as_text()))
      for t in (step, update)
    ]

  in_step, in_update = count(lm.make_optimizer(method, 10))
  assert in_step == in_update
  if method == "adam":
    assert in_step == 0
    # Positive control: the same pattern finds a branch on a traced value.
    assert count(optax.apply_if_finite(lm.make_optimizer(method, 10), 3))[0] > 0
