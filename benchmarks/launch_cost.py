"""What launching a compiled step costs on the host, per jax line (a CPU question).

XLA:CPU's host-side launch of a program grows with the number of buffers in it,
including those of loops and branches that do not run; on a 2-core machine that
thread competes with the step itself. This script measures it two ways, as ratios
to a peer measured in the same rounds:

1. A toy: ``n`` leaves updated elementwise, with and without a loop of zero steps
   that would sort each leaf. The loop never runs; what it adds is launch cost.
2. The transformer-shaped tree of ``sparse_state.py --transformer`` (6 matrices per
   layer), donated: how long a call of the jitted step takes to return (the launch)
   and to finish, for ``periodic_mask(sparse_adam(..., block=(8, 128)))`` against
   ``optax.adam``.

Run it on each jax line to compare them::

    python3 benchmarks/launch_cost.py --width 256 --layers 12

``--allocations`` also counts each tree program's buffer allocations by kind, from
the buffer assignment XLA writes when asked to dump (one more compile per case).
On XLA:CPU every call builds a table entry for each of them on the calling thread,
a new object for every constant and thread-local one (see ``benchmarks/RESULTS.md``
on how much of the launch that is). ``--compile`` times each tree program's trace
and compile (a program of its own name, which no compilation cache serves).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import sys
import tempfile
import time
import uuid

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sparse_state import transformer_params  # noqa: E402

import magma_optax as magma  # noqa: E402


def toy_step(n: int, size: int, loop: bool):
  """A donated step over ``n`` leaves; with ``loop``, a never-run loop of sorts."""

  def f(xs, pred):
    out = [x * 0.999 + 1e-3 for x in xs]
    if loop:
      body = lambda c: (False, [jnp.sort(y) for y in c[1]])  # noqa: E731
      out = jax.lax.while_loop(lambda c: c[0], body, (pred, out))[1]
    return out

  xs = [jnp.full((size,), float(i)) for i in range(n)]
  return jax.jit(f, donate_argnums=(0,)), xs


def per_step_ms(step, args, steps: int, rounds: int) -> float:
  """The fastest of ``rounds`` rounds of ``steps`` pipelined steps, ms per step;
  ``step(*args)`` returns the first argument's next value."""
  first, rest = args[0], args[1:]
  first = step(first, *rest)
  jax.block_until_ready(first)
  best = float("inf")
  for _ in range(rounds):
    t = time.perf_counter()
    for _ in range(steps):
      first = step(first, *rest)
    jax.block_until_ready(first)
    best = min(best, (time.perf_counter() - t) / steps * 1e3)
  return best


def tree_step(tx, params, name: str = "step"):
  """The donated step ``(p, s, g) -> (p + u, s)`` of ``tx``, jitted as ``name``."""

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step.__name__ = step.__qualname__ = name
  return jax.jit(jax.jit(step), donate_argnums=(0, 1))


_KINDS = (
  "constant",
  "thread-local",
  "parameter",
  "maybe-live-out",
  "preallocated-temp",
)


def count_allocations(text: str) -> dict[str, int]:
  """``total`` and per kind, from the text of XLA's buffer assignment: one line
  ``allocation N: size S, kind[, kind ...]:`` per allocation, where a parameter
  also carries its number and shape and can be live-out as well."""
  heads = re.findall(r"^allocation \d+: size \d+(.*):$", text, re.M)
  fields = [{f.split(" ")[0] for f in h.split(", ")} for h in heads]
  return {"total": len(heads), **{k: sum(k in f for f in fields) for k in _KINDS}}


def allocations(tx, params) -> dict[str, int]:
  """The donated tree step's buffer allocations (:func:`count_allocations`), from
  XLA's dump of its buffer assignment."""
  # A name of its own: a program served by a persistent compilation cache (whose
  # key leaves the dump directory out) would not be compiled, nor dumped.
  name = f"counted_{uuid.uuid4().hex}"
  step = tree_step(tx, params, name)
  state = jax.eval_shape(tx.init, params)
  with tempfile.TemporaryDirectory() as d:
    step.lower(params, state, params).compile({"xla_dump_to": d})
    pattern = f"*jit_{name}*buffer-assignment.txt"
    found = list(pathlib.Path(d).glob(pattern))
    if len(found) != 1:
      raise RuntimeError(f"expected one {pattern} in XLA's dump, found {found}")
    return count_allocations(found[0].read_text())


def compile_seconds(tx, params) -> tuple[float, float]:
  """Seconds to trace and lower the donated tree step, and to compile it (a
  program of its own name: no compilation cache can serve it)."""
  step = tree_step(tx, params, f"timed_{uuid.uuid4().hex}")
  state = jax.eval_shape(tx.init, params)
  t0 = time.perf_counter()
  lowered = step.lower(params, state, params)
  t1 = time.perf_counter()
  lowered.compile()
  return t1 - t0, time.perf_counter() - t1


def launch_and_total(tx, params, calls: int) -> tuple[float, float, int]:
  """Median ms for a call to return and for it to finish, and the program's
  argument count."""
  step = tree_step(tx, params)
  p = jax.tree.map(jnp.copy, params)
  s = tx.init(p)
  g = jax.tree.map(lambda x: 0.01 * jnp.ones_like(x), params)
  for _ in range(3):
    p, s = step(p, s, g)
  jax.block_until_ready((p, s))
  launch, total = [], []
  for _ in range(calls):
    t0 = time.perf_counter()
    p, s = step(p, s, g)
    t1 = time.perf_counter()
    jax.block_until_ready((p, s))
    launch.append((t1 - t0) * 1e3)
    total.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(launch), statistics.median(total), len(jax.tree.leaves(s))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--leaves", type=int, nargs="+", default=[4, 72, 288])
  parser.add_argument("--size", type=int, default=4096, help="entries per toy leaf")
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--calls", type=int, default=60)
  parser.add_argument(
    "--allocations", action="store_true", help="count each tree program's buffers"
  )
  parser.add_argument(
    "--compile", action="store_true", help="time each tree program's compile"
  )
  args = parser.parse_args(argv)
  out = {"toy": {}, "tree": {}, "allocations": {}, "compile": {}}
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
  print("toy: a never-run loop of sorts over n leaves (ms per donated step)")
  for n in args.leaves:
    plain, looped = (
      per_step_ms(*_args(n, args.size, loop), args.steps, args.rounds)
      for loop in (False, True)
    )
    out["toy"][n] = (plain, looped)
    print(
      f"  {n:4d} leaves: without {plain:7.3f}, with {looped:7.3f},"
      f" the loop's launch {looped - plain:7.3f} ms ({looped / plain:5.2f}x)"
    )
  params = transformer_params(args.width, args.layers)
  block = (8, 128)
  cases = {
    "optax.adam": optax.adam(1e-3),
    "periodic_mask(sparse_adam tiles 8x128)": magma.periodic_mask(
      magma.sparse_adam(1e-3, mode="compact", density=0.3, block=block),
      sparsity=0.7,
      every=100,
      block=block,
    ),
  }
  leaves = len(jax.tree.leaves(params))
  print(f"tree: {leaves} leaves (width {args.width}, {args.layers} layers), donated")
  for name, tx in cases.items():
    out["tree"][name] = launch_and_total(tx, params, args.calls)
  adam_launch, adam_total, _ = out["tree"]["optax.adam"]
  for name, (launch, total, n_state) in out["tree"].items():
    print(
      f"  {name:40s} returns after {launch:6.2f} ms ({launch / adam_launch:4.2f}x"
      f" adam), done after {total:6.2f} ms ({total / adam_total:4.2f}x),"
      f" {n_state} state arrays"
    )
  if args.allocations:
    print("buffer allocations of each tree program (a table entry each per call)")
    for name, tx in cases.items():
      a = out["allocations"][name] = allocations(tx, params)
      kinds = ", ".join(f"{a[k]} {k}" for k in _KINDS)
      print(f"  {name:40s} {a['total']:5d} ({kinds})")
  if args.compile:
    print("seconds to trace and lower, and to compile, each tree program")
    for name, tx in cases.items():
      lower, comp = out["compile"][name] = compile_seconds(tx, params)
      print(f"  {name:40s} trace and lower {lower:6.2f} s, compile {comp:6.2f} s")
  return out


def _args(n: int, size: int, loop: bool):
  step, xs = toy_step(n, size, loop)
  return step, (xs, jnp.asarray(False))


if __name__ == "__main__":
  main()
