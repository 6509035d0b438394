"""Tests for ``python3 -m magma_optax.demo`` at a tiny size."""

import math

import numpy as np
import pytest

from magma_optax.demo import run as demo


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  out = tmp_path_factory.mktemp("demo") / "sub" / "curves.png"
  argv = ["--size", "tiny", "--steps", "12", "--batch-size", "4", "--seq-len", "32",
          "--eval-every", "6", "--eval-batches", "2", "--out", str(out),
          "--no-progress"]  # fmt: skip
  return demo.main(argv), out


def test_demo_writes_png_and_table(results, capsys):
  res, out = results
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert set(res["runs"]) == {"Adam (lr 0.003)", "Adam+Magma (lr 0.003)"}
  text = demo.table(res)
  for name, r in res["runs"].items():
    assert name in text
    assert r["val_steps"] == [6, 12]
    assert len(r["train_loss"]) == 12 and np.all(np.isfinite(r["train_loss"]))
    assert math.isclose(r["final_val_ppl"], math.exp(r["final_val_loss"]))
    # Both runs learn something in 12 steps from the uniform ln(256) = 5.55.
    assert r["final_val_loss"] < math.log(256) - 0.5


def test_demo_runs_share_init_and_data_but_differ(results):
  res, _ = results
  adam, mag = res["runs"].values()
  # Step 1 has learning rate 0 (warm-up starts at 0): identical losses on step 1
  # and 2 prove the same initialisation and batches; then the optimizers diverge.
  np.testing.assert_allclose(adam["train_loss"][:2], mag["train_loss"][:2], rtol=1e-6)
  assert not np.allclose(adam["train_loss"][2:], mag["train_loss"][2:])
  assert 0.0 <= mag["active_fraction"] <= 1.0 and adam["active_fraction"] is None


@pytest.mark.parametrize(
  "argv", [["--steps", "0"], ["--lr", "-1"], ["--size", "huge"], ["--seq-len", "0"]]
)
def test_demo_rejects_bad_flags(argv):
  with pytest.raises(SystemExit):
    demo.parse_args(argv)
