"""TPU check of the fused masked-Adam kernel: correctness, overhead, bandwidth.

One short run on a machine with a TPU (a Colab TPU runtime will do; about a minute
after compilation):

1. the Mosaic TPU kernel (``kernels/mosaic_tpu.py``) against the XLA reference on
   random data -- float32 and bfloat16, odd sizes that need padding, blocks that
   span several tiles (sums accumulated over the grid), row blocks, a parameter
   mask, weight decay -- and ``adam_magma(implementation="pallas")`` against
   ``"xla"`` over a few steps (same masks, updates to rel. 1e-5);
2. the kernel alone: achieved bandwidth (28 bytes per parameter: read g, m, v, p;
   write m, v, update) against a donated device copy;
3. the step-overhead table of ``benchmarks/step_overhead.py`` (interleaved rounds,
   ratios against ``optax.adam`` in the same run) with ``adam_magma`` xla and
   pallas, at 1 M, 25 M and 100 M parameters and on a transformer-shaped tree of
   144 leaves;
4. the tile kernel of compact tile storage (``kernels/tiles/pallas.py``) against
   its XLA reference at density 0.3 with empty slots, (8, 128) tiles, and alone
   against that reference on a (2048, 2048) leaf at densities 0.1, 0.3 and 1.0.

Exit status 1 if a correctness check fails; timings are reported, not judged.

Usage::

    python3 benchmarks/tpu_check.py            # 1 M, 25 M, 100 M, transformer
    python3 benchmarks/tpu_check.py --sizes 25e6 --rounds 10
    python3 benchmarks/tpu_check.py --smoke    # any machine: every code path above
                                               # at tiny sizes, in the TPU interpreter

``--smoke`` checks the script itself (tests/repo/test_tpu_check.py runs it on CPU): the
kernel in ``pltpu.InterpretParams()``, tiny shapes, one round, and the overhead
table with XLA only. Its timings mean nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check  # noqa: E402
import step_overhead  # noqa: E402

# (shape, granularity, dtype, parameter mask); weight decay in every case.
CASES = [
  ((4096, 1024), "tensor", jnp.float32, False),  # 4 M entries: many grid steps
  ((1000, 769), "row", jnp.float32, True),
  ((3, 1001, 333), "tensor", jnp.bfloat16, True),  # padded to whole 4096-lane rows
  ((12345,), "tensor", jnp.float32, False),
  ((2048, 4096), "row", jnp.bfloat16, False),
]
SMOKE_CASES = [
  ((64, 96), "tensor", jnp.float32, False),
  ((33, 17), "row", jnp.float32, True),
  ((3, 5, 7), "tensor", jnp.bfloat16, True),
]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--sizes",
    default="1e6,25e6,100e6,transformer",
    help="parameter counts, and/or 'transformer' (144 leaves of a transformer)",
  )
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--leaves", type=int, default=8)
  parser.add_argument(
    "--smoke", action="store_true", help="tiny sizes, TPU interpreter (any machine)"
  )
  args = parser.parse_args(argv)
  dev = jax.devices()[0]
  print(f"# jax {jax.__version__}, {dev.device_kind} ({jax.default_backend()})")
  backend = "mosaic_tpu"
  if args.smoke:
    print("smoke run: TPU interpreter, tiny sizes; timings mean nothing")
    ok = gpu_check.check_kernel(SMOKE_CASES, interpret=True, backends=[backend])
    ok &= gpu_check.check_optimizer(8192, interpret="tpu")
    ok &= gpu_check.check_tiles(
      gpu_check.SMOKE_TILE_CASES, [(8, 128)], [backend], interpret=True
    )
    gpu_check.kernel_bandwidth(8192, 1, interpret=True, backend=backend)
    gpu_check.tile_bandwidth((32, 256), (8, 128), [0.3], 1, backend, interpret=True)
    sizes, rounds, implementations = [8192], 1, ["xla"]
  elif jax.default_backend() != "tpu":
    print("no TPU: this script checks the Mosaic TPU kernel; nothing to do.")
    return 0
  else:
    ok = gpu_check.check_kernel(CASES, backends=[backend])
    ok &= gpu_check.check_optimizer()
    ok &= gpu_check.check_tiles(gpu_check.TILE_CASES, [(8, 128)], [backend])
    gpu_check.kernel_bandwidth(64 * 2**20, args.rounds, backend=backend)
    gpu_check.tile_bandwidth(
      (2048, 2048), (8, 128), gpu_check.TILE_DENSITIES, args.rounds, backend
    )
    sizes = [x if x == "transformer" else int(float(x)) for x in args.sizes.split(",")]
    rounds, implementations = args.rounds, ["xla", "pallas"]
  for size in sizes:
    n, rows = step_overhead.run(size, args.leaves, rounds, implementations)
    what = "transformer tree, 144 leaves" if size == "transformer" else "params"
    print(f"\n## {n / 1e6:.1f} M {what}")
    print("| step | median ms | x optax.adam | GB/s (28 B/param) | of copy BW |")
    print("|---|---:|---:|---:|---:|")
    for name, ms, ratio, bw, frac in rows:
      print(f"| {name} | {ms:.3f} | {ratio:.2f} | {bw:.0f} | {frac:.0%} |")
  print("\nALL CHECKS OK" if ok else "\nSOME CHECKS FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
