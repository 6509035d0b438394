"""Small-LM reproduction of arXiv 2602.15322: methods x learning rates x seeds.

Trains the LLaMA-style byte model of :mod:`magma_optax.demo.llama` on the Python
standard library's source (:mod:`magma_optax.demo.corpus`) with

* ``adam``            Adam
* ``adam_skip``       Adam+SkipUpdate   ``magma.skip_update(optax.adam(lr))``, p = 0.5
* ``adam_magma``      Adam+Magma        ``magma.magma(optax.adam(lr))`` (paper defaults)
* ``rmsprop``         RMSProp           ``optax.rmsprop(lr, decay=0.99, eps=1e-8)``
* ``rmsprop_magma``   RMSProp+Magma     ``magma.magma(optax.rmsprop(...))``
* ``adam_gradmask``   gradient masking  ``optax.chain(magma.alignment_mask(),
                      optax.adam(lr))``: sparse moments, paper App. C.4 (a
                      different, weaker method)

Control (``--methods adam_scaled``): Adam with the masked leaves' updates scaled by
0.25, Magma's average multiplier (score ~0.5 times keep probability 0.5) without the
randomness or the alignment score. It separates "Magma helps" from "a smaller step on
attention/MLP than on embeddings, norms and head helps".

Masks act on attention and MLP weights (``magma.attention_mlp_weights``, the paper's
scope); ``--scope all`` masks every parameter. Schedule: linear warm-up over 10 % of
the steps, cosine decay to 10 % of the peak (:func:`llama.lr_schedule`). Learning-rate
grid: the paper's {1e-4, 5e-4, 1e-3, 5e-3, 1e-2}. Every (method, LR, seed) starts from
the same initialisation (per seed) and sees the same batches (per seed).

Reported per method: the best learning rate (lowest mean final validation loss over
seeds) and, at it, the validation loss and perplexity as mean +- spread (half the
range over seeds); a loss-vs-LR plot (LR robustness); validation-loss curves at each
method's best LR; all of it as JSON next to the plots.

Compilation: every optimizer here is linear in its peak learning rate (the base
update carries the LR; masks and scores do not depend on it), so each method is built
once with peak 1 and followed by ``optax.inject_hyperparams(optax.scale)`` holding the
LR in the optimizer state; the mask key also lives in the state. One compiled step
per method serves every LR and seed, with the same numbers as building
``optax.adam(lr)`` per run.

Presets (``--preset``): ``tiny`` (a quick check, ~1-2 min on 2 CPU cores), ``cpu``
(default; sized for ~90 min on 2 quiet CPU cores), ``gpu`` (an 11M-parameter model,
longer training, 3 seeds; for an accelerator). Any preset field can be overridden by
its flag.

Usage::

  python3 benchmarks/lm.py --preset tiny --out benchmarks/results/lm_tiny
  python3 benchmarks/lm.py                       # the default ~90 min CPU grid
  python3 benchmarks/lm.py --preset gpu --out benchmarks/results/lm_gpu
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
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

PAPER_LRS = (1e-4, 5e-4, 1e-3, 5e-3, 1e-2)
METHODS = (
  "adam",
  "adam_skip",
  "adam_magma",
  "rmsprop",
  "rmsprop_magma",
  "adam_gradmask",
)
# Controls, run on request (--methods): not part of the default grid.
CONTROLS = ("adam_scaled",)
LABELS = {
  "adam": "Adam",
  "adam_skip": "Adam+SkipUpdate",
  "adam_magma": "Adam+Magma",
  "rmsprop": "RMSProp",
  "rmsprop_magma": "RMSProp+Magma",
  "adam_gradmask": "alignment_mask -> Adam",
  "adam_scaled": "Adam, masked leaves x0.25",
}


@dataclasses.dataclass(frozen=True)
class Preset:
  """One benchmark configuration."""

  model: str
  batch_size: int
  seq_len: int
  steps: int
  seeds: int
  eval_every: int
  eval_batches: int
  lrs: tuple[float, ...] = PAPER_LRS


PRESETS = {
  "tiny": Preset("tiny", 4, 32, 40, 2, 20, 2, (1e-3, 1e-2)),
  "cpu": Preset("small", 8, 128, 500, 2, 50, 8),
  "gpu": Preset("medium", 32, 256, 3000, 3, 250, 32),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  parser.add_argument("--model", choices=llama.PRESETS, help="model size")
  parser.add_argument("--batch-size", type=int)
  parser.add_argument("--seq-len", type=int)
  parser.add_argument("--steps", type=int)
  parser.add_argument("--seeds", type=int, help="number of seeds (0, 1, ...)")
  parser.add_argument("--eval-every", type=int)
  parser.add_argument("--eval-batches", type=int)
  parser.add_argument("--lrs", type=float, nargs="+", help="peak learning rates")
  parser.add_argument(
    "--methods", nargs="+", choices=METHODS + CONTROLS, default=list(METHODS)
  )
  parser.add_argument(
    "--scope",
    choices=("attn_mlp", "all"),
    default="attn_mlp",
    help="parameters the masks act on (paper: attention + MLP weights)",
  )
  parser.add_argument("--out", default="benchmarks/results/lm", help="output folder")
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  preset = PRESETS[args.preset]
  for field in dataclasses.fields(Preset):
    if getattr(args, field.name, None) is None:
      setattr(args, field.name, getattr(preset, field.name))
  args.lrs = tuple(args.lrs)
  for name in ("batch_size", "seq_len", "steps", "seeds", "eval_every", "eval_batches"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1")
  if any(not lr > 0 for lr in args.lrs):
    parser.error("--lrs must be > 0")
  return args


def make_optimizer(
  method: str, steps: int, *, lr: float = 1.0, key: int = 0, scope: str = "attn_mlp"
) -> optax.GradientTransformation:
  """``method`` with peak learning rate ``lr`` (a unit-peak schedule, then x ``lr``)."""
  unit = llama.lr_schedule(1.0, steps)
  where = magma.attention_mlp_weights if scope == "attn_mlp" else None
  rmsprop = lambda: optax.rmsprop(unit, decay=0.99, eps=1e-8)
  if method == "adam":
    tx = optax.adam(unit)
  elif method == "adam_skip":
    tx = magma.skip_update(optax.adam(unit), keep_prob=0.5, key=key, where=where)
  elif method == "adam_magma":
    tx = magma.magma(optax.adam(unit), key=key, where=where)
  elif method == "rmsprop":
    tx = rmsprop()
  elif method == "rmsprop_magma":
    tx = magma.magma(rmsprop(), key=key, where=where)
  elif method == "adam_gradmask":
    tx = optax.chain(magma.alignment_mask(key=key, where=where), optax.adam(unit))
  elif method == "adam_scaled":
    # Magma's mean multiplier without its randomness or alignment: E[s z] ~ 0.5 * 0.5.
    scoped = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, x: True if where is None else bool(where(path, x)), params
    )
    tx = optax.chain(optax.adam(unit), optax.masked(optax.scale(0.25), scoped))
  else:
    raise ValueError(f"method must be one of {METHODS}; got {method!r}.")
  return optax.chain(tx, optax.inject_hyperparams(optax.scale)(step_size=lr))


def run_grid(args: argparse.Namespace) -> dict[str, Any]:
  """Trains every (method, lr, seed); returns per-run curves and final losses."""
  from tqdm.auto import tqdm

  data = corpus.load()
  config = llama.LlamaConfig.preset(args.model)
  val = jnp.asarray(
    corpus.validation_batches(
      data.validation,
      batch_size=args.batch_size,
      seq_len=args.seq_len,
      num_batches=args.eval_batches,
    )
  )
  inits = {s: llama.init_params(config, seed=s) for s in range(args.seeds)}
  graphdef = inits[0][0]
  evaluate = llama.make_eval_fn(graphdef)
  # Batches are drawn once per seed and reused by every method and learning rate.
  batches = {}
  for s in range(args.seeds):
    it = corpus.train_batches(
      data.train, batch_size=args.batch_size, seq_len=args.seq_len, seed=s
    )
    batches[s] = np.stack([next(it) for _ in range(args.steps)])
  runs = []
  total = len(args.methods) * len(args.lrs) * args.seeds * args.steps
  bar = tqdm(total=total, disable=args.no_progress, unit="step", smoothing=0.05)
  for method in args.methods:
    template = make_optimizer(method, args.steps, scope=args.scope)
    step = llama.make_train_step(graphdef, template)
    compile_start = time.perf_counter()
    for lr in args.lrs:
      for seed in range(args.seeds):
        bar.set_description(f"{method} lr={lr:g} seed={seed}")
        tx = make_optimizer(method, args.steps, lr=lr, key=seed, scope=args.scope)
        params = jax.tree.map(jnp.array, inits[seed][1])
        opt_state = tx.init(params)
        assert jax.tree.structure(opt_state) == jax.tree.structure(
          template.init(params)
        )
        train_loss, val_steps, val_loss = [], [0], [float(evaluate(params, val))]
        start = time.perf_counter()
        for t in range(args.steps):
          params, opt_state, loss = step(params, opt_state, batches[seed][t])
          train_loss.append(loss)
          if (t + 1) % args.eval_every == 0 or t + 1 == args.steps:
            val_steps.append(t + 1)
            val_loss.append(float(evaluate(params, val)))
          bar.update(1)
        seconds = time.perf_counter() - start
        final = val_loss[-1]
        runs.append(
          {
            "method": method,
            "lr": lr,
            "seed": seed,
            "final_val_loss": final if math.isfinite(final) else None,
            "final_val_ppl": math.exp(final) if math.isfinite(final) else None,
            "val_steps": val_steps,
            "val_loss": [v if math.isfinite(v) else None for v in val_loss],
            "train_loss": [  # 4 decimals keep the JSON small
              round(float(x), 4) if math.isfinite(float(x)) else None
              for x in jax.device_get(train_loss)
            ],
            "seconds": seconds,
          }
        )
    runs[-1]["method_seconds_incl_compile"] = time.perf_counter() - compile_start
  bar.close()
  return {"params": llama.count_params(inits[0][1]), "runs": runs}


def summarize(results: dict[str, Any], methods: Sequence[str]) -> dict[str, Any]:
  """Per method and LR: mean and spread of the final validation loss over seeds."""
  summary = {}
  for method in methods:
    per_lr = {}
    for r in results["runs"]:
      if r["method"] == method:
        v = r["final_val_loss"]
        per_lr.setdefault(r["lr"], []).append(math.inf if v is None else v)
    table = {}
    for lr, values in sorted(per_lr.items()):
      v = np.asarray(values)
      table[lr] = {
        "mean": float(v.mean()),
        "spread": float((v.max() - v.min()) / 2),
        "values": [float(x) for x in v],
      }
    best = min(table, key=lambda lr: table[lr]["mean"])
    b = table[best]
    ppl = [math.exp(x) if math.isfinite(x) else math.inf for x in b["values"]]
    summary[method] = {
      "best_lr": best,
      "val_loss_mean": b["mean"],
      "val_loss_spread": b["spread"],
      "val_ppl_mean": float(np.mean(ppl)),
      "val_ppl_spread": float((max(ppl) - min(ppl)) / 2),
      "by_lr": {str(lr): t for lr, t in table.items()},
    }
  return summary


def markdown_table(summary: dict[str, Any]) -> str:
  """The best-LR table, in markdown."""
  lines = [
    "| method | best LR | val loss (nats/byte) | val perplexity |",
    "|---|---|---|---|",
  ]
  for method, s in summary.items():
    lines.append(
      f"| {LABELS[method]} | {s['best_lr']:g} | {s['val_loss_mean']:.4f} ±"
      f" {s['val_loss_spread']:.4f} | {s['val_ppl_mean']:.3f} ±"
      f" {s['val_ppl_spread']:.3f} |"
    )
  return "\n".join(lines)


def lr_table(summary: dict[str, Any]) -> str:
  """Mean final validation loss for every (method, LR), in markdown."""
  lrs = sorted({float(lr) for s in summary.values() for lr in s["by_lr"]})
  lines = ["| method | " + " | ".join(f"{lr:g}" for lr in lrs) + " |"]
  lines.append("|---" * (len(lrs) + 1) + "|")
  for method, s in summary.items():
    cells = []
    for lr in lrs:
      t = s["by_lr"].get(str(lr))
      mean = None if t is None else t["mean"]
      cells.append("–" if mean is None or not math.isfinite(mean) else f"{mean:.3f}")
    lines.append(f"| {LABELS[method]} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(results: dict[str, Any], summary: dict[str, Any], out: str, title: str):
  """Writes ``loss_vs_lr.png`` and ``loss_curves.png`` into ``out``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for i, (method, s) in enumerate(summary.items()):
    lrs = [float(lr) for lr in s["by_lr"]]
    means = np.array([t["mean"] for t in s["by_lr"].values()])
    lo = np.array([min(t["values"]) for t in s["by_lr"].values()])
    hi = np.array([max(t["values"]) for t in s["by_lr"].values()])
    ok = np.isfinite(means)
    style = "--" if "magma" not in method else "-"
    ax.plot(np.array(lrs)[ok], means[ok], "o" + style, color=f"C{i}",
            label=LABELS[method])  # fmt: skip
    ax.fill_between(np.array(lrs)[ok], lo[ok], hi[ok], color=f"C{i}", alpha=0.15)
  ax.set_xscale("log")
  ax.set_xlabel("peak learning rate")
  ax.set_ylabel("final validation loss (nats / byte)")
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "loss_vs_lr.png"), dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for i, (method, s) in enumerate(summary.items()):
    curves = [
      r for r in results["runs"] if r["method"] == method and r["lr"] == s["best_lr"]
    ]
    steps = curves[0]["val_steps"]
    vals = np.array(
      [[np.nan if v is None else v for v in r["val_loss"]] for r in curves]
    )
    style = "--" if "magma" not in method else "-"
    ax.plot(steps, vals.mean(0), style, color=f"C{i}",
            label=f"{LABELS[method]} (lr {s['best_lr']:g})")  # fmt: skip
  ax.set_xlabel("step")
  ax.set_ylabel("validation loss (nats / byte), mean over seeds")
  ax.set_title(title + "\nat each method's best learning rate", fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  lows = [s["val_loss_mean"] for s in summary.values()]
  ax.set_ylim(min(lows) - 0.1, min(lows) + 1.5)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "loss_curves.png"), dpi=120)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  config = {
      k: getattr(args, k)
      for k in ("preset", "model", "batch_size", "seq_len", "steps", "seeds",
                "eval_every", "eval_batches", "lrs", "methods", "scope")
  }  # fmt: skip
  print(f"config: {config}")
  start = time.perf_counter()
  results = run_grid(args)
  seconds = time.perf_counter() - start
  summary = summarize(results, args.methods)
  title = (
    f"{args.model} byte LLaMA ({results['params']:,} params), {args.steps} steps of"
    f" {args.batch_size}x{args.seq_len}, {args.seeds} seeds, masks on {args.scope}"
  )
  plot(results, summary, args.out, title)
  record = {
    "config": config,
    "params": results["params"],
    "seconds": seconds,
    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs,"
    f" jax {jax.__version__} {jax.default_backend()}",
    "summary": summary,
    "runs": results["runs"],
  }
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(record, f, indent=1)
  print(f"\n{title}; {seconds / 60:.1f} min")
  print(markdown_table(summary))
  print()
  print(lr_table(summary))
  print(f"\nwritten: {args.out}/results.json, loss_vs_lr.png, loss_curves.png")
  return record


if __name__ == "__main__":
  main()
