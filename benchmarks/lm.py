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
range over seeds) and the train/validation gap (validation loss minus the loss on a
fixed set of training windows); a loss-vs-LR plot (LR robustness); validation- and
training-window loss curves at each method's best LR; all of it as JSON next to the
plots, and each run's record in ``runs.jsonl`` as soon as it finishes.

Compilation: every optimizer here is linear in its peak learning rate (the base
update carries the LR; masks and scores do not depend on it), so each method is built
once with peak 1 and followed by ``optax.inject_hyperparams(optax.scale)`` holding the
LR in the optimizer state; the mask key also lives in the state. One compiled step
per method serves every LR and seed, with the same numbers as building
``optax.adam(lr)`` per run.

Presets (``--preset``): ``tiny`` (a quick check, ~1-2 min on 2 CPU cores), ``cpu``
(default; sized for ~90 min on 2 quiet CPU cores), ``gpu`` (an 11M-parameter model,
longer training, 3 seeds; for an accelerator), ``paper60m`` (the body of the paper's
60M model, see below). Any preset field can be overridden by its flag.

``paper60m``: hidden 512, 8 layers, 8 heads, SwiGLU 1376 (the paper's smallest
LLaMA). With bytes for tokens it has 25.6M parameters; the paper's "60M" counts a
32k-token embedding and output head (58.1M with them). Adam, Adam+Magma and
RMSProp+Magma at 3 learning rates each, 1 seed, bf16 matmuls, on every ``.py`` file
of the running interpreter's standard library (``--corpus stdlib``), at most 3 passes
over the training text. Sized for one H200 in 8 minutes: the script prints its
estimate from the FLOPs first, and ``--time-budget`` skips the runs that would not
finish in time (each method's middle learning rate runs first). Byte perplexities
are not comparable with the paper's C4 token perplexities: what carries over is the
ordering of the methods and their best learning rates.

Every run keeps the training text on the device and gathers its batches there; the
host enqueues steps and reads the losses back once per run (no per-step sync).

Usage::

  python3 benchmarks/lm.py --preset tiny --out benchmarks/results/lm_tiny
  python3 benchmarks/lm.py                       # the default ~90 min CPU grid
  python3 benchmarks/lm.py --preset gpu --out benchmarks/results/lm_gpu
  python3 benchmarks/lm.py --preset paper60m --out benchmarks/results/lm_paper60m
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import time
import types
from collections.abc import Mapping
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
BYTE_PPL_NOTE = (
  "Byte perplexities (exp of nats per byte, 256 symbols) are not comparable with the"
  " paper's C4 token perplexities (32k-token vocabulary): what carries over is the"
  " ordering of the methods and their best learning rates."
)

# The printed time estimate: one H200's dense bf16 matmul rate, the fraction of it
# a run is assumed to reach (optimizer steps, attention's softmax and the norms
# move memory without matmuls), and allowances for compiling and starting.
PEAK_TFLOPS = 790.0
UTILISATION = 0.25
COMPILE_SECONDS = 45.0
STARTUP_SECONDS = 20.0


@dataclasses.dataclass(frozen=True)
class Preset:
  """One benchmark configuration.

  ``lrs`` is one grid for every method or a grid per method; ``max_passes`` caps the
  steps at that many passes over the training text; ``time_budget`` (seconds from
  the start) skips the runs that would not finish within it.
  """

  model: str
  batch_size: int
  seq_len: int
  steps: int
  seeds: int
  eval_every: int
  eval_batches: int
  lrs: tuple[float, ...] | Mapping[str, tuple[float, ...]] = PAPER_LRS
  methods: tuple[str, ...] = METHODS
  corpus: str = "fixed"
  dtype: str = "float32"
  max_passes: float | None = None
  time_budget: float | None = None


PRESETS = {
  "tiny": Preset("tiny", 4, 32, 40, 2, 20, 2, (1e-3, 1e-2)),
  "cpu": Preset("small", 8, 128, 500, 2, 50, 8),
  "gpu": Preset("medium", 32, 256, 3000, 3, 250, 32),
  # Each method's grid: three points of the paper's grid around the best LRs of
  # the small-model runs in RESULTS.md (Adam 1e-3, the Magma variants higher).
  "paper60m": Preset(
    "paper60m",
    batch_size=128,
    seq_len=256,
    steps=800,
    seeds=1,
    eval_every=200,
    eval_batches=8,
    lrs={
      "adam": (5e-4, 1e-3, 5e-3),
      "adam_magma": (1e-3, 5e-3, 1e-2),
      "rmsprop_magma": (1e-3, 5e-3, 1e-2),
    },
    methods=("adam", "adam_magma", "rmsprop_magma"),
    corpus="stdlib",
    dtype="bfloat16",
    max_passes=3.0,
    time_budget=450.0,
  ),
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
  parser.add_argument(
    "--lrs", type=float, nargs="+", help="peak learning rates (every method)"
  )
  parser.add_argument("--methods", nargs="+", choices=METHODS + CONTROLS)
  parser.add_argument(
    "--corpus",
    choices=("fixed", "stdlib"),
    help="fixed: corpus.STDLIB_FILES; stdlib: every .py file of the stdlib",
  )
  parser.add_argument(
    "--dtype", choices=("float32", "bfloat16"), help="attention/MLP matmul dtype"
  )
  parser.add_argument(
    "--max-passes", type=float, help="cap on passes over the training text (0: none)"
  )
  parser.add_argument(
    "--time-budget",
    type=float,
    help="seconds; skip the runs that would end after it (0: none)",
  )
  parser.add_argument(
    "--utilisation",
    type=float,
    default=UTILISATION,
    help=f"fraction of {PEAK_TFLOPS:g} TFLOP/s assumed by the printed estimate",
  )
  parser.add_argument(
    "--scope",
    choices=("attn_mlp", "all"),
    default="attn_mlp",
    help="parameters the masks act on (paper: attention + MLP weights)",
  )
  parser.add_argument("--out", default="benchmarks/results/lm", help="output folder")
  parser.add_argument("--no-progress", action="store_true")
  parser.add_argument(
    "--replot", metavar="DIR", help="tables and plots again from DIR/results.json"
  )
  args = parser.parse_args(argv)
  preset = PRESETS[args.preset]
  for field in dataclasses.fields(Preset):
    if getattr(args, field.name, None) is None:
      setattr(args, field.name, getattr(preset, field.name))
  args.methods = tuple(args.methods)
  for name in ("batch_size", "seq_len", "steps", "seeds", "eval_every", "eval_batches"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1")
  grid = args.lrs
  args.lrs = {
    m: tuple(grid.get(m, PAPER_LRS) if isinstance(grid, Mapping) else grid)
    for m in args.methods
  }
  if any(not lr > 0 for lrs in args.lrs.values() for lr in lrs):
    parser.error("--lrs must be > 0")
  for name in ("max_passes", "time_budget"):
    value = getattr(args, name)
    if value is not None and value < 0:
      parser.error(f"--{name.replace('_', '-')} must be >= 0 (0: none)")
    setattr(args, name, value or None)
  if not 0 < args.utilisation <= 1:
    parser.error("--utilisation must be in (0, 1]")
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


def make_step(graphdef, tx: optax.GradientTransformation, seq_len: int):
  """``step(params, opt_state, text, starts)``: gathers the batch on the device.

  ``text`` is the training text (uint8, on the device) and ``starts`` one batch's
  window offsets (:func:`corpus.train_starts`), so no batch crosses from the host.
  """
  train = llama.make_train_step(graphdef, tx, donate=False)
  offsets = jnp.arange(seq_len + 1)

  def step(params, opt_state, text, starts):
    batch = text[starts[:, None] + offsets].astype(jnp.int32)
    return train(params, opt_state, batch)

  return jax.jit(step, donate_argnums=(0, 1))


def load_corpus(name: str) -> corpus.Corpus:
  """``fixed``: :data:`corpus.STDLIB_FILES`; ``stdlib``: every stdlib ``.py`` file."""
  return corpus.load(
    corpus.stdlib_sources() if name == "stdlib" else corpus.STDLIB_FILES
  )


def corpus_record(data: corpus.Corpus, name: str) -> dict[str, Any]:
  """What identifies the text: files, sizes, a digest, the CPython version."""
  digest = hashlib.sha256(data.train.tobytes())
  digest.update(data.validation.tobytes())
  return {
    "name": name,
    "files": len(data.files),
    "train_bytes": len(data.train),
    "validation_bytes": len(data.validation),
    "sha256": digest.hexdigest(),
    "python": platform.python_version(),
    "root": data.root,
  }


def capped_steps(args: argparse.Namespace, train_bytes: int) -> int:
  """``--steps``, lowered to at most ``--max-passes`` passes over the training text."""
  if args.max_passes is None:
    return args.steps
  per_step = args.batch_size * args.seq_len
  return max(1, min(args.steps, int(args.max_passes * train_bytes // per_step)))


def run_order(args: argparse.Namespace) -> list[tuple[str, float, int]]:
  """Every (method, LR, seed), each method's middle LR first, then outwards.

  The methods alternate, so a grid stopped early (``--time-budget``) has compared
  them at their likeliest best LRs before it spends time on the edges.
  """
  order = {}
  for m, lrs in args.lrs.items():
    mid = (len(lrs) - 1) / 2
    order[m] = [
      lrs[i] for i in sorted(range(len(lrs)), key=lambda i: (abs(i - mid), i))
    ]
  runs = []
  for rank in range(max(len(v) for v in order.values())):
    for seed in range(args.seeds):
      runs += [(m, order[m][rank], seed) for m in args.methods if rank < len(order[m])]
  return runs


def describe_size(config: llama.LlamaConfig, params: int) -> str:
  """The parameter count, and what it would be with the paper's 32k-token vocabulary."""
  paper = params + 2 * (32000 - config.vocab_size) * config.dim
  return (
    f"{params:,} parameters with bytes for tokens ({params / 1e6:.1f}M); the"
    f" paper's sizes count a 32k-token embedding and head: {paper / 1e6:.1f}M"
  )


def estimate(
  args: argparse.Namespace, config: llama.LlamaConfig, params: int, steps: int
) -> dict[str, float]:
  """Seconds the grid should take on one H200, from its FLOPs.

  Training: 6 * params per token (matmuls, forward and backward) plus attention's
  two seq x seq products, 12 * seq * dim * layers per token (the causal mask is
  applied to full products). Evaluation (validation and training windows, every
  ``eval_every`` steps and at the end; at step 0 once per seed): a third of that
  per token. Rate: ``--utilisation`` of :data:`PEAK_TFLOPS`; plus
  :data:`COMPILE_SECONDS` per method and :data:`STARTUP_SECONDS`.
  """
  attention = 12 * args.seq_len * config.dim * config.n_layers
  train_tokens = steps * args.batch_size * args.seq_len
  eval_tokens = 2 * args.eval_batches * args.batch_size * args.seq_len
  flops = train_tokens * (6 * params + attention)
  eval_flops = eval_tokens * (2 * params + attention / 3)
  flops += -(-steps // args.eval_every) * eval_flops
  rate = args.utilisation * PEAK_TFLOPS * 1e12
  runs = sum(len(v) for v in args.lrs.values()) * args.seeds
  run_seconds = flops / rate
  total = STARTUP_SECONDS + len(args.methods) * COMPILE_SECONDS + runs * run_seconds
  total += args.seeds * eval_flops / rate
  return {
    "train_tokens_per_run": train_tokens,
    "flops_per_run": flops,
    "seconds_per_run": run_seconds,
    "runs": runs,
    "compiles": len(args.methods),
    "total_seconds": total,
    "utilisation": args.utilisation,
    "peak_tflops": PEAK_TFLOPS,
  }


def progress_bar(total: int, disable: bool):
  """A tqdm bar, or a stand-in where tqdm is not installed."""
  try:
    from tqdm.auto import tqdm
  except ImportError:
    disable = True
  if disable:
    nothing = lambda *args, **kwargs: None
    return types.SimpleNamespace(set_description=nothing, update=nothing, close=nothing)
  return tqdm(total=total, unit="step", smoothing=0.05)


def run_grid(args: argparse.Namespace, log=print) -> dict[str, Any]:
  """Trains every (method, lr, seed); returns per-run curves and final losses."""
  start_all = time.perf_counter()
  data = load_corpus(args.corpus)
  text_info = corpus_record(data, args.corpus)
  dtype = None if args.dtype == "float32" else jnp.dtype(args.dtype)
  config = llama.LlamaConfig.preset(args.model, dtype=dtype)
  inits = {s: llama.init_params(config, seed=s) for s in range(args.seeds)}
  graphdef, n_params = inits[0][0], llama.count_params(inits[0][1])
  steps = capped_steps(args, len(data.train))
  est = estimate(args, config, n_params, steps)
  mb = lambda n: f"{n / 1e6:.1f} MB"
  log(
    f"corpus {args.corpus}: {text_info['files']} files, {mb(len(data.train))} train"
    f" / {mb(len(data.validation))} validation (CPython {text_info['python']},"
    f" sha256 {text_info['sha256'][:12]})"
  )
  if steps < args.steps:
    log(f"steps capped at {steps} (--steps {args.steps}): {args.max_passes:g} passes")
  passes = steps * args.batch_size * args.seq_len / len(data.train)
  log(f"{args.model}: {describe_size(config, n_params)}; {steps} steps,"
      f" {passes:.2f} passes")  # fmt: skip
  log(
    f"estimate on one H200 at {args.utilisation:.0%} of {PEAK_TFLOPS:g} TFLOP/s:"
    f" {est['runs']} runs x {est['flops_per_run']:.2e} FLOP"
    f" ({est['train_tokens_per_run'] / 1e6:.1f}M training tokens each)"
    f" = {est['seconds_per_run']:.0f} s each, + {est['compiles']} compiles x"
    f" {COMPILE_SECONDS:.0f} s + {STARTUP_SECONDS:.0f} s start-up ="
    f" {est['total_seconds'] / 60:.1f} min (this process: {jax.default_backend()})"
  )
  text = jax.device_put(data.train)
  val = jnp.asarray(
    corpus.validation_batches(
      data.validation,
      batch_size=args.batch_size,
      seq_len=args.seq_len,
      num_batches=args.eval_batches,
    )
  )
  train_windows = jnp.asarray(  # fixed, evenly spaced: the gap's training side
    corpus.validation_batches(
      data.train,
      batch_size=args.batch_size,
      seq_len=args.seq_len,
      num_batches=args.eval_batches,
    )
  )
  evaluate = llama.make_eval_fn(graphdef)
  # Window starts are drawn once per seed: every method and LR sees the same batches.
  starts = {
    s: jnp.asarray(
      corpus.train_starts(
        data.train,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        num_batches=steps,
        seed=s,
      ),
      jnp.int32,
    )
    for s in range(args.seeds)
  }
  order = run_order(args)
  tokens = steps * args.batch_size * args.seq_len
  compiled, compile_seconds, measured, initial, runs, skipped = {}, {}, {}, {}, [], []
  bar = progress_bar(len(order) * steps, args.no_progress)
  for i, (method, lr, seed) in enumerate(order):
    elapsed = time.perf_counter() - start_all
    expected = measured.get(method, est["seconds_per_run"])
    if method not in compiled:
      expected += COMPILE_SECONDS
    if args.time_budget is not None and elapsed + expected > args.time_budget:
      skipped.append({"method": method, "lr": lr, "seed": seed})
      log(
        f"[{i + 1}/{len(order)}] {LABELS[method]} lr {lr:g} seed {seed}: skipped"
        f" ({elapsed:.0f} s + ~{expected:.0f} s > --time-budget {args.time_budget:g})"
      )
      continue
    bar.set_description(f"{method} lr={lr:g} seed={seed}")
    tx = make_optimizer(method, steps, lr=lr, key=seed, scope=args.scope)
    params = jax.tree.map(jnp.array, inits[seed][1])  # the step donates them
    opt_state = tx.init(params)
    compiles_now = method not in compiled
    if compiles_now:
      template = make_optimizer(method, steps, scope=args.scope)
      assert jax.tree.structure(opt_state) == jax.tree.structure(template.init(params))
      t0 = time.perf_counter()
      # Compiled once per method: the LR and the mask key are state, not constants.
      step = make_step(graphdef, template, args.seq_len)
      compiled[method] = step.lower(params, opt_state, text, starts[seed][0]).compile()
      compile_seconds[method] = time.perf_counter() - t0
    step = compiled[method]
    start = time.perf_counter()
    if seed not in initial:  # the same for every method and LR of this seed
      initial[seed] = (0, evaluate(params, val), evaluate(params, train_windows))
    train_loss, evals = [], [initial[seed]]
    for t, batch_starts in enumerate(starts[seed]):
      params, opt_state, loss = step(params, opt_state, text, batch_starts)
      train_loss.append(loss)  # a device scalar: read back once, after the run
      if (t + 1) % args.eval_every == 0 or t + 1 == steps:
        evals.append((t + 1, evaluate(params, val), evaluate(params, train_windows)))
      bar.update(1)
    train_loss, evals = jax.device_get((train_loss, evals))  # the run's one wait
    seconds = time.perf_counter() - start
    measured[method] = seconds
    finite = lambda x: float(x) if math.isfinite(float(x)) else None
    val_loss = [finite(v) for _, v, _ in evals]
    window_loss = [finite(w) for _, _, w in evals]
    final, final_train = val_loss[-1], window_loss[-1]
    record = {
      "method": method,
      "lr": lr,
      "seed": seed,
      "final_val_loss": final,
      "final_val_ppl": None if final is None else math.exp(final),
      "final_train_window_loss": final_train,
      "gap": None if None in (final, final_train) else final - final_train,
      "val_steps": [t for t, _, _ in evals],
      "val_loss": val_loss,
      "train_window_loss": window_loss,
      "train_loss": [  # 4 decimals keep the JSON small
        None if finite(x) is None else round(float(x), 4) for x in train_loss
      ],
      "steps": steps,
      "tokens": tokens,
      "seconds": seconds,
      "compile_seconds": compile_seconds[method],
    }
    runs.append(record)
    with open(os.path.join(args.out, "runs.jsonl"), "a") as f:
      f.write(json.dumps(record) + "\n")
    achieved = est["flops_per_run"] / seconds / 1e12  # TFLOP/s
    compiled_note = f", after {compile_seconds[method]:.1f} s compiling" * compiles_now
    shown = "nan" if final is None else f"{final:.4f} (byte ppl {math.exp(final):.3f})"
    gap = "n/a" if record["gap"] is None else f"{record['gap']:+.4f}"
    log(
      f"[{i + 1}/{len(order)}] {LABELS[method]} lr {lr:g} seed {seed}: val {shown},"
      f" train/val gap {gap}; {seconds:.1f} s ({tokens / seconds:,.0f} tokens/s,"
      f" {achieved:.1f} TFLOP/s = {achieved / PEAK_TFLOPS:.1%} of"
      f" {PEAK_TFLOPS:g}){compiled_note}; elapsed"
      f" {(time.perf_counter() - start_all) / 60:.1f} min"
    )
  bar.close()
  return {
    "params": n_params,
    "steps": steps,
    "corpus": text_info,
    "estimate": est,
    "compile_seconds": compile_seconds,
    "skipped": skipped,
    "runs": runs,
  }


def summarize(results: dict[str, Any], methods: Sequence[str]) -> dict[str, Any]:
  """Per method and LR: mean and spread of the final validation loss over seeds."""
  summary = {}
  for method in methods:
    per_lr, gaps = {}, {}
    for r in results["runs"]:
      if r["method"] == method:
        v = r["final_val_loss"]
        per_lr.setdefault(r["lr"], []).append(math.inf if v is None else v)
        gaps.setdefault(r["lr"], []).append(math.nan if r["gap"] is None else r["gap"])
    if not per_lr:
      continue  # every run of it skipped
    table = {}
    for lr, values in sorted(per_lr.items()):
      v = np.asarray(values)
      table[lr] = {
        "mean": float(v.mean()),
        "spread": float((v.max() - v.min()) / 2),
        "values": [float(x) for x in v],
        "gap_mean": float(np.mean(gaps[lr])),
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
      "gap_mean": b["gap_mean"],
      "seeds": len(b["values"]),
      "by_lr": {str(lr): t for lr, t in table.items()},
    }
  return summary


def markdown_table(summary: dict[str, Any]) -> str:
  """The best-LR table, in markdown."""
  lines = [
    "| method | best LR | val loss (nats/byte) | byte perplexity | train/val gap |",
    "|---|---|---|---|---|",
  ]
  for method, s in summary.items():
    loss, ppl = f"{s['val_loss_mean']:.4f}", f"{s['val_ppl_mean']:.3f}"
    if s["seeds"] > 1:
      loss += f" ± {s['val_loss_spread']:.4f}"
      ppl += f" ± {s['val_ppl_spread']:.3f}"
    lines.append(
      f"| {LABELS[method]} | {s['best_lr']:g} | {loss} | {ppl} | {s['gap_mean']:+.4f} |"
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
    mean = lambda key, curves=curves: np.array(
      [[np.nan if v is None else v for v in r[key]] for r in curves]
    ).mean(0)
    ax.plot(steps, mean("val_loss"), "-", color=f"C{i}",
            label=f"{LABELS[method]} (lr {s['best_lr']:g})")  # fmt: skip
    ax.plot(steps, mean("train_window_loss"), ":", color=f"C{i}")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats / byte), mean over seeds")
  ax.set_title(
    title + "\nat each method's best learning rate; solid: validation,"
    " dotted: fixed training windows",
    fontsize=9,
  )
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  lows = [s["val_loss_mean"] for s in summary.values()]
  if all(math.isfinite(x) for x in lows):
    ax.set_ylim(min(lows) - 0.3, min(lows) + 1.5)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "loss_curves.png"), dpi=120)
  plt.close(fig)


def report(record: dict[str, Any], out: str, log=print) -> None:
  """Prints the tables of a finished grid and writes its plots into ``out``."""
  summary = record["summary"]
  log(f"\n{record['title']}; {record['seconds'] / 60:.1f} min")
  if record["skipped"]:
    log(f"skipped by --time-budget: {record['skipped']}")
  log(markdown_table(summary))
  log("")
  log(lr_table(summary))
  log(f"\n{BYTE_PPL_NOTE}")
  written = ["results.json", "runs.jsonl"]
  if summary:
    try:
      plot(record, summary, out, record["title"])
      written += ["loss_vs_lr.png", "loss_curves.png"]
    except ImportError as e:  # e.g. a device image without matplotlib
      log(f"no plots ({e}): run `python3 benchmarks/lm.py --replot {out}` elsewhere")
  log(f"written in {out}: {', '.join(written)}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  log = lambda line: print(line, flush=True)
  if args.replot:
    with open(os.path.join(args.replot, "results.json")) as f:
      record = json.load(f)
    report(record, args.replot, log)
    return record
  os.makedirs(args.out, exist_ok=True)
  open(os.path.join(args.out, "runs.jsonl"), "w").close()
  config = {
      k: getattr(args, k)
      for k in ("preset", "model", "batch_size", "seq_len", "steps", "seeds",
                "eval_every", "eval_batches", "lrs", "methods", "scope", "corpus",
                "dtype", "max_passes", "time_budget", "utilisation")
  }  # fmt: skip
  log(f"config: {config}")
  start = time.perf_counter()
  results = run_grid(args, log)
  seconds = time.perf_counter() - start
  record = {
    "title": (
      f"{args.model} byte LLaMA ({results['params']:,} params), {results['steps']}"
      f" steps of {args.batch_size}x{args.seq_len}, {args.seeds} seed(s),"
      f" masks on {args.scope}"
    ),
    "config": config,
    "params": results["params"],
    "steps": results["steps"],
    "corpus": results["corpus"],
    "estimate": results["estimate"],
    "compile_seconds": results["compile_seconds"],
    "skipped": results["skipped"],
    "seconds": seconds,
    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs,"
    f" jax {jax.__version__} {jax.default_backend()}"
    f" ({jax.devices()[0].device_kind}), Python {sys.version.split()[0]}",
    "note": BYTE_PPL_NOTE,
    "summary": summarize(results, args.methods),
    "runs": results["runs"],
  }
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(record, f, indent=1)
  report(record, args.out, log)
  return record


if __name__ == "__main__":
  main()
