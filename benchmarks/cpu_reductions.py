"""How fast XLA:CPU reduces: the cost floor of Magma's cosine sums on a CPU.

``adam_magma`` on CPU pays for two reductions per leaf (<m_t, g> and ||g||^2) on top
of Adam's elementwise passes. This script times ``sum(m * g)`` over 8 float32 leaves
of shape (3051, 1024) (200 MB, more than the cache) written in several ways, one
cache-resident leaf, two independent reductions in one program, and a donated copy
``p <- p + 1`` of the same 8 leaves as the bandwidth yardstick. GB/s count the bytes
read (8 per entry; the copy's 8 are 4 read and 4 written).

Usage::

    python3 benchmarks/cpu_reductions.py            # 15 rounds
    python3 benchmarks/cpu_reductions.py --rounds 5
"""

from __future__ import annotations

import argparse
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SHAPE = (3051, 1024)
LEAVES = 8

VARIANTS = {
  "sum(m * g)": lambda m, g, z: jnp.sum(m * g),
  "per-row sums, then sum": lambda m, g, z: jnp.sum(jnp.sum(m * g, axis=1)),
  "per-column sums, then sum": lambda m, g, z: jnp.sum(jnp.sum(m * g, axis=0)),
  "einsum('rc,rc->r')": lambda m, g, z: jnp.sum(jnp.einsum("rc,rc->r", m, g)),
  "vdot": lambda m, g, z: jnp.vdot(m, g),
  "lax.reduce, runtime init": lambda m, g, z: lax.reduce(m * g, z, lax.add, (0, 1)),
  # A reducer YNN does not match: XLA's own loop, split over both cores.
  "per-row lax.reduce, a - (-b)": lambda m, g, z: jnp.sum(
    lax.reduce(m * g, z, lambda a, b: a - (-b), (1,))
  ),
}


def _median_seconds(fn, args, rounds):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=15)
  args = parser.parse_args()
  keys = jax.random.split(jax.random.key(0), 2 * LEAVES)
  leaves = [jax.random.normal(k, SHAPE, jnp.float32) for k in keys]
  zero = jnp.float32(0.0)
  entry_bytes = 4 * SHAPE[0] * SHAPE[1]
  kind = jax.devices()[0].device_kind
  print(f"# jax {jax.__version__}, {kind}, {args.rounds} rounds")
  print("| what | ms | GB/s | compiled to a YNN fusion |")
  print("|---|---:|---:|---|")
  for name, f in VARIANTS.items():

    def program(z, *xs, f=f):
      return [f(xs[2 * i], xs[2 * i + 1], z) for i in range(LEAVES)]

    fn = jax.jit(program)
    ynn = "ynn" in fn.lower(zero, *leaves).compile().as_text()
    t = _median_seconds(fn, (zero, *leaves), args.rounds)
    gbs = 2 * LEAVES * entry_bytes / t / 1e9
    print(f"| 8 leaves: {name} | {t * 1e3:.2f} | {gbs:.1f} | {ynn} |")
  one = jax.jit(lambda m, g: jnp.sum(m * g))
  t = _median_seconds(one, leaves[:2], args.rounds)
  gbs = 2 * entry_bytes / t / 1e9
  print(f"| 1 leaf, cache-resident | {t * 1e3:.2f} | {gbs:.1f} | |")
  two = jax.jit(lambda a, b, c, d: (jnp.sum(a * b), jnp.sum(c * d)))
  t = _median_seconds(two, leaves[:4], args.rounds)
  gbs = 4 * entry_bytes / t / 1e9
  print(f"| 2 independent sums (4 leaves) | {t * 1e3:.2f} | {gbs:.1f} | |")

  @functools.partial(jax.jit, donate_argnums=0)
  def copy(xs):
    return [x + 1.0 for x in xs]

  xs = [jnp.copy(x) for x in leaves[:LEAVES]]
  xs = copy(xs)
  jax.block_until_ready(xs)
  times = []
  for _ in range(args.rounds):
    t0 = time.perf_counter()
    xs = copy(xs)
    jax.block_until_ready(xs)
    times.append(time.perf_counter() - t0)
  t = float(np.median(times))
  gbs = 2 * LEAVES * entry_bytes / t / 1e9
  print(f"| donated copy p <- p + 1, 8 leaves | {t * 1e3:.2f} | {gbs:.1f} | |")
  for name in ("sum(m * g)", "per-row lax.reduce, a - (-b)"):
    f = jax.jit(functools.partial(VARIANTS[name], z=zero))
    hlo = f.lower(*leaves[:2]).compile().as_text()
    parts = set(re.findall(r'outer_dimension_partitions":\["(\d+)"', hlo))
    print(f"\n{name}: parallel partitions in the HLO: {sorted(parts) or 'none'}")


if __name__ == "__main__":
  main()
