"""The demo's run: Adam vs Adam+Magma on the same byte-level LLaMA-style model.

``python3 -m magma_optax.demo`` trains :mod:`magma_optax.demo.llama` twice from one
initialisation on the same batches of :mod:`magma_optax.demo.corpus` -- with Adam
and with ``magma.magma(optax.adam(lr), where=magma.attention_mlp_weights)`` at the
paper's defaults, both at the same peak learning rate -- then prints each run's final
validation loss and perplexity and writes a PNG of the loss curves. It is a taste,
not evidence: ``benchmarks/RESULTS.md`` has the sweeps and controls.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import magma_optax as magma
from magma_optax.demo import corpus
from magma_optax.demo import llama

ADAM_LR = 3e-3
MAGMA_LR = 3e-3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The demo's command-line flags."""
  parser = argparse.ArgumentParser(
    prog="python3 -m magma_optax.demo",
    description="Adam vs Adam+Magma on a byte-level LLaMA-style model.",
  )
  parser.add_argument("--steps", type=int, default=300, help="training steps")
  parser.add_argument(
    "--size", choices=llama.PRESETS, default="small", help="model preset"
  )
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--lr", type=float, default=ADAM_LR, help="Adam's peak LR")
  parser.add_argument(
    "--magma-lr", type=float, default=MAGMA_LR, help="Adam+Magma's peak LR"
  )
  parser.add_argument("--seed", type=int, default=0, help="init, data and mask seed")
  parser.add_argument(
    "--eval-every", type=int, default=50, help="steps between validation losses"
  )
  parser.add_argument(
    "--eval-batches", type=int, default=8, help="validation batches per evaluation"
  )
  parser.add_argument(
    "--out", default="magma_demo.png", help="path of the loss-curve PNG"
  )
  parser.add_argument("--no-progress", action="store_true", help="hide the bar")
  args = parser.parse_args(argv)
  for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1")
  for name in ("lr", "magma_lr"):
    if not getattr(args, name) > 0:
      parser.error(f"--{name.replace('_', '-')} must be > 0")
  return args


def optimizers(args: argparse.Namespace) -> dict[str, optax.GradientTransformation]:
  """The two optimizers compared, by display name."""
  adam = optax.adam(llama.lr_schedule(args.lr, args.steps))
  magma_tx = magma.magma(
    optax.adam(llama.lr_schedule(args.magma_lr, args.steps)),
    key=args.seed,
    where=magma.attention_mlp_weights,
  )
  return {
    f"Adam (lr {args.lr:g})": adam,
    f"Adam+Magma (lr {args.magma_lr:g})": magma_tx,
  }


def run(args: argparse.Namespace) -> dict[str, Any]:
  """Trains both models; returns curves, final metrics and timing."""
  from tqdm.auto import tqdm

  data = corpus.load()
  config = llama.LlamaConfig.preset(args.size)
  graphdef, init = llama.init_params(config, seed=args.seed)
  val = jnp.asarray(
    corpus.validation_batches(
      data.validation,
      batch_size=args.batch_size,
      seq_len=args.seq_len,
      num_batches=args.eval_batches,
    )
  )
  evaluate = llama.make_eval_fn(graphdef)
  runs = {}
  for name, tx in optimizers(args).items():
    params = jax.tree.map(jnp.array, init)  # each run owns (and donates) a copy
    runs[name] = {
      "step": llama.make_train_step(graphdef, tx),
      "params": params,
      "opt_state": tx.init(params),
      "train_loss": [],
      "val_steps": [],
      "val_loss": [],
    }
  batches = corpus.train_batches(
    data.train, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed
  )
  start = time.perf_counter()
  bar = tqdm(range(1, args.steps + 1), disable=args.no_progress, desc="training")
  for step in bar:
    batch = jnp.asarray(next(batches))
    for r in runs.values():
      r["params"], r["opt_state"], loss = r["step"](r["params"], r["opt_state"], batch)
      r["train_loss"].append(loss)
    if step % args.eval_every == 0 or step == args.steps:
      for r in runs.values():
        r["val_steps"].append(step)
        r["val_loss"].append(float(evaluate(r["params"], val)))
      bar.set_postfix(
        {n.split(" ")[0]: f"{r['val_loss'][-1]:.3f}" for n, r in runs.items()}
      )
  seconds = time.perf_counter() - start
  results = {"seconds": seconds, "params": llama.count_params(init), "runs": {}}
  for name, r in runs.items():
    results["runs"][name] = {
      "train_loss": np.asarray(jax.device_get(r["train_loss"]), np.float64),
      "val_steps": r["val_steps"],
      "val_loss": r["val_loss"],
      "final_val_loss": r["val_loss"][-1],
      "final_val_ppl": math.exp(r["val_loss"][-1]),
      "active_fraction": (
        float(magma.mask_stats(r["opt_state"])["active_fraction"])
        if "Magma" in name
        else None
      ),
    }
  return results


def table(results: dict[str, Any]) -> str:
  """A plain-text table of final validation loss and perplexity."""
  rows = [f"{'method':<28} {'val loss':>9} {'val ppl':>9}"]
  for name, r in results["runs"].items():
    rows.append(f"{name:<28} {r['final_val_loss']:>9.4f} {r['final_val_ppl']:>9.3f}")
  return "\n".join(rows)


def plot(results: dict[str, Any], path: str, title: str) -> None:
  """Writes the training (smoothed) and validation loss curves to ``path``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for i, (name, r) in enumerate(results["runs"].items()):
    color = f"C{i}"
    loss = r["train_loss"]
    width = max(1, len(loss) // 25)
    smooth = np.convolve(loss, np.ones(width) / width, mode="valid")
    ax.plot(np.arange(width, len(loss) + 1), smooth, color=color, alpha=0.45,
            label=f"{name} train (mean of {width})")  # fmt: skip
    ax.plot(r["val_steps"], r["val_loss"], "o-", color=color, label=f"{name} val")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats / byte)")
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Entry point of ``python3 -m magma_optax.demo``; returns the results."""
  args = parse_args(argv)
  print(
    f"magma_optax demo: {args.size} LLaMA-style byte LM, {args.steps} steps of"
    f" {args.batch_size}x{args.seq_len} bytes on the Python stdlib source,"
    f" backend {jax.default_backend()}"
  )
  results = run(args)
  print(f"\n{results['params']:,} parameters, {results['seconds']:.1f} s of training")
  print(table(results))
  title = (
    f"{args.size} byte LLaMA ({results['params']:,} params), {args.steps} steps,"
    f" batch {args.batch_size}x{args.seq_len}, seed {args.seed}"
  )
  plot(results, args.out, title)
  print(f"loss curves written to {args.out}")
  return results


if __name__ == "__main__":
  main()
