"""Step-time overhead of masked optimizers against ``optax.adam``, measured interleaved.

For each model size (float32 parameters split into ``--leaves`` equal 2-D leaves)
this times one jitted training step ``params, state <- apply(update(grads))`` with
the parameters and optimizer state donated (in place), for

* ``optax.adam`` (the peer every ratio is against),
* ``magma(adam)`` and ``skip_update(adam)`` (the wrappers),
* ``adam_magma`` with ``implementation="xla"`` (and ``"pallas"`` on a GPU),
* a donated in-place copy ``p <- p + 1`` (the bandwidth yardstick),

round-robin: every round runs each candidate once, so a slow moment of a shared
machine hits all of them. Reported per candidate: the median step time, the median
over rounds of (time / adam's time in the same round), and the achieved bandwidth
counting Adam's minimum traffic of 28 bytes per parameter (read p, g, m, v; write p,
m, v) -- for the copy its real 8 bytes -- and that bandwidth as a fraction of the
copy's.

Usage::

    python3 benchmarks/step_overhead.py                  # 1 M and 25 M, 15 rounds
    python3 benchmarks/step_overhead.py --sizes 1e6 --rounds 5 --leaves 8
    python3 benchmarks/step_overhead.py --sizes transformer   # 144 leaves
    python3 benchmarks/step_overhead.py --baseline /tmp/old   # old vs new, interleaved

``--baseline DIR`` also times the masked candidates of the package in ``DIR`` (a
checkout or ``git archive`` of another commit; its ``magma_optax`` is imported under
another name), in the same rounds, marked ``(base)``: a change's cost on the CPU
without the drift between two runs of a shared machine.
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import magma_optax as magma

ADAM_BYTES_PER_PARAM = 28  # read p, g, m, v; write p, m, v (float32)
COPY_BYTES_PER_PARAM = 8  # read p, write p


def make_params(num_params: int, num_leaves: int, key: int = 0):
  """``num_leaves`` float32 leaves of shape (rows, 1024), about ``num_params``."""
  cols = 1024
  rows = max(num_params // (num_leaves * cols), 1)
  keys = jax.random.split(jax.random.key(key), 2 * num_leaves)
  params = {
    f"layer_{i}": jax.random.normal(keys[i], (rows, cols), jnp.float32) * 0.02
    for i in range(num_leaves)
  }
  grads = {
    f"layer_{i}": jax.random.normal(keys[num_leaves + i], (rows, cols)) * 1e-3
    for i in range(num_leaves)
  }
  return params, grads


def make_transformer_params(layers: int = 12, width: int = 256, key: int = 0):
  """A transformer-shaped tree: per layer 4 attention matrices, 2 MLP matrices and
  6 vectors (biases, norm scales) -- 12 leaves a layer, 144 for 12 layers."""
  shapes = {
    "q": (width, width),
    "k": (width, width),
    "v": (width, width),
    "o": (width, width),
    "up": (width, 4 * width),
    "down": (4 * width, width),
    "ln1": (width,),
    "ln2": (width,),
    "b_up": (4 * width,),
    "b_down": (width,),
    "b_q": (width,),
    "b_o": (width,),
  }
  keys = iter(jax.random.split(jax.random.key(key), 2 * layers * len(shapes)))
  params, grads = {}, {}
  for layer in range(layers):
    for name, shape in shapes.items():
      leaf = f"layer_{layer:02d}_{name}"
      params[leaf] = jax.random.normal(next(keys), shape, jnp.float32) * 0.02
      grads[leaf] = jax.random.normal(next(keys), shape, jnp.float32) * 1e-3
  return params, grads


def optimizer_step(tx):
  """A jitted step with params and state donated."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


@functools.partial(jax.jit, donate_argnums=(0, 1))
def copy_step(params, state, grads):
  del grads
  return jax.tree.map(lambda p: p + 1.0, params), state


def candidates(lr: float, implementations: list[str], baseline=None):
  out = {"optax.adam": optax.adam(lr)}
  for package, mark in [(magma, "")] + ([(baseline, " (base)")] if baseline else []):
    out[f"magma(adam){mark}"] = package.magma(optax.adam(lr), key=0)
    out[f"skip_update(adam){mark}"] = package.skip_update(optax.adam(lr), key=0)
    for impl in implementations:
      out[f"adam_magma[{impl}]{mark}"] = package.adam_magma(
        lr, key=0, implementation=impl
      )
  return out


def import_baseline(folder: str):
  """The ``magma_optax`` package in ``folder``, imported beside this one: its
  modules are moved to other names in ``sys.modules`` once loaded (they keep
  their references to each other)."""
  import sys

  ours = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "magma_optax"}
  for k in ours:
    del sys.modules[k]
  sys.path.insert(0, folder)
  try:
    import magma_optax as base  # noqa: PLC0415
  finally:
    sys.path.remove(folder)
    theirs = [k for k in sys.modules if k.split(".")[0] == "magma_optax"]
    for k in theirs:
      sys.modules["baseline_" + k] = sys.modules.pop(k)
    sys.modules.update(ours)
  return base


def run(
  num_params, num_leaves: int, rounds: int, implementations: list[str], baseline=None
):
  if num_params == "transformer":
    params, grads = make_transformer_params()
  else:
    params, grads = make_params(num_params, num_leaves)
  n = sum(x.size for x in jax.tree.leaves(params))
  txs = candidates(1e-3, implementations, baseline)
  steps = {name: optimizer_step(tx) for name, tx in txs.items()}
  steps["copy p+1 (donated)"] = copy_step
  carry = {}
  for name in steps:
    p = jax.tree.map(jnp.copy, params)
    s = txs[name].init(p) if name in txs else ()
    p, s = steps[name](p, s, grads)  # compile + first step
    jax.block_until_ready((p, s))
    carry[name] = (p, s)
  times = {name: [] for name in steps}
  for _ in range(rounds):
    for name, step in steps.items():
      p, s = carry[name]
      t0 = time.perf_counter()
      p, s = step(p, s, grads)
      jax.block_until_ready((p, s))
      times[name].append(time.perf_counter() - t0)
      carry[name] = (p, s)
  base = np.asarray(times["optax.adam"])
  copy_t = np.median(times["copy p+1 (donated)"])
  copy_bw = COPY_BYTES_PER_PARAM * n / copy_t / 1e9
  rows = []
  for name, ts in times.items():
    ts = np.asarray(ts)
    med = float(np.median(ts))
    ratio = float(np.median(ts / base))
    per_param = (
      COPY_BYTES_PER_PARAM if name.startswith("copy") else (ADAM_BYTES_PER_PARAM)
    )
    bw = per_param * n / med / 1e9
    rows.append((name, med * 1e3, ratio, bw, bw / copy_bw))
  return n, rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--sizes",
    default="1e6,25e6",
    help="parameter counts, and/or 'transformer' (144 leaves, 9.5 M params)",
  )
  parser.add_argument("--leaves", type=int, default=8)
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument(
    "--implementations",
    default=None,
    help="adam_magma implementations (default: xla, plus pallas on GPU)",
  )
  parser.add_argument(
    "--baseline",
    default=None,
    help="a folder with another commit's magma_optax to time beside this one",
  )
  args = parser.parse_args()
  baseline = import_baseline(args.baseline) if args.baseline else None
  if args.implementations is None:
    impls = ["xla"] + (["pallas"] if jax.default_backend() == "gpu" else [])
  else:
    impls = [s for s in args.implementations.split(",") if s]
  dev = jax.devices()[0]
  print(
    f"# jax {jax.__version__}, optax {optax.__version__}, device {dev.device_kind}"
    f" ({jax.default_backend()}), {platform.processor() or platform.machine()},"
    f" {args.rounds} interleaved rounds, {args.leaves} leaves, donated buffers"
  )
  for size in args.sizes.split(","):
    tree = size if size == "transformer" else int(float(size))
    n, rows = run(tree, args.leaves, args.rounds, impls, baseline)
    if size == "transformer":
      print(f"\n## transformer tree: 144 leaves, {n / 1e6:.1f} M params")
    else:
      print(f"\n## {n / 1e6:.1f} M params")
    print("| step | median ms | x optax.adam | GB/s (28 B/param) | of copy BW |")
    print("|---|---:|---:|---:|---:|")
    for name, ms, ratio, bw, frac in rows:
      print(f"| {name} | {ms:.2f} | {ratio:.2f} | {bw:.1f} | {frac:.0%} |")


if __name__ == "__main__":
  main()
