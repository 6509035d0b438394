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
import functools
import itertools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import magma_optax as magma
from magma_optax import kernels
from magma_optax._core import blocks as _blocks
from magma_optax.kernels import dispatch
from magma_optax.kernels import partitioned
from magma_optax.kernels import reference
from magma_optax.kernels.tiles import api as tiles
from magma_optax.kernels.tiles import pallas as pallas_tiles

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import device_checks  # noqa: E402
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
# The tile kernel: (leaf shape, gradient dtype, moments' dtype).
TILE_CASES = [
  ((256, 512), jnp.float32, jnp.float32),
  ((4, 512, 1024), jnp.bfloat16, jnp.float32),
  ((2048, 2048), jnp.float32, jnp.bfloat16),
]
SMOKE_TILE_CASES = [((2, 16, 256), jnp.float32, jnp.float32)]
TILE_DENSITIES = [0.1, 0.3, 1.0]


def _run_kernel(backend, gmv, kw, interpret=False):
  """``backend``: "xla", or a Pallas kernel of ``partitioned.BACKENDS``."""
  if backend == "xla":
    fn = lambda g, m, v: kernels.masked_adam(g, m, v, implementation="xla", **kw)
    return jax.jit(fn)(*gmv)
  kw = dict(kw)
  constants = reference.AdamConstants()
  count, lr, wd = kw.pop("count"), kw.pop("learning_rate"), kw.pop("weight_decay")

  def fn(g, m, v):
    hyper = reference.hyperparams(count, lr, wd, constants)
    return partitioned.masked_adam_pallas_partitioned(
      g, m, v, hyper, interpret=interpret, backend=backend, **kw
    )

  return jax.jit(fn)(*gmv)


def check_kernel(cases=CASES, interpret=False, backends=("triton",)) -> bool:
  """Each kernel of ``backends`` vs XLA on random data; one line per case."""
  ok = True
  for backend in backends:
    ok &= _check_backend(cases, interpret, backend)
  return ok


def _check_backend(cases, interpret, backend) -> bool:
  ok = True
  for i, (shape, gran, dtype, use_mask) in enumerate(cases):
    k = jax.random.split(jax.random.key(i), 6)
    g = jax.random.normal(k[0], shape).astype(dtype)
    m = (0.1 * jax.random.normal(k[1], shape)).astype(dtype)
    v = (0.01 * jax.random.uniform(k[2], shape)).astype(dtype)
    p = jax.random.normal(k[3], shape).astype(dtype)
    layout = _blocks.block_layout(shape, gran)
    scale = jax.random.uniform(k[4], layout.block_shape)
    kw = dict(
      count=7, learning_rate=1e-3, scale=scale, layout=layout, params=p,
      weight_decay=0.1,
      param_mask=jax.random.bernoulli(k[5], 0.8, shape) if use_mask else None,
    )  # fmt: skip
    want, got = (_run_kernel(b, (g, m, v), kw, interpret) for b in ("xla", backend))
    errs = []
    for name, a, b in zip(want._fields, got, want, strict=True):
      a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
      scale_ = np.max(np.abs(b32)) + 1e-30
      errs.append((name, float(np.max(np.abs(a32 - b32)) / scale_)))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    case_ok = all(e <= tol for _, e in errs)
    ok &= case_ok
    worst = max(errs, key=lambda x: x[1])
    print(
      f"kernel[{backend}] {shape} {gran} {jnp.dtype(dtype).name} mask={use_mask}: worst"
      f" {worst[0]} rel err {worst[1]:.1e} (tol {tol:.0e})"
      f" {'OK' if case_ok else 'FAIL'}"
    )
  return ok


def check_optimizer(num_params=2_000_000, interpret=False) -> bool:
  """``adam_magma(implementation="pallas", interpret=interpret)`` vs ``"xla"``."""
  params, grads = step_overhead.make_params(num_params, 4)
  out = device_checks.adam_magma_runs(params, grads, interpret)
  err = max(
    float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
    for a, b in zip(
      jax.tree.leaves(out["pallas"][0]), jax.tree.leaves(out["xla"][0]), strict=True
    )
  )
  same_masks = all(
    bool(jnp.all(a == b))
    for a, b in zip(
      jax.tree.leaves(magma.mask_stats(out["pallas"][1])["mask"]),
      jax.tree.leaves(magma.mask_stats(out["xla"][1])["mask"]),
      strict=True,
    )
  )
  ok = err <= 1e-5 and same_masks
  print(
    f"adam_magma pallas[{dispatch.pallas_backend(interpret)}] vs xla, 3 steps: rel err"
    f" {err:.1e}, masks equal"
    f" {same_masks}: {'OK' if ok else 'FAIL'}"
  )
  return ok


def kernel_bandwidth(
  num_params: int, rounds: int, interpret=False, backend="triton"
) -> None:
  """The kernel of ``backend`` alone (tensor blocks) vs a donated copy, interleaved."""
  shape = (max(num_params // 4096, 1), 4096)
  g, m, v, p = (jax.random.normal(jax.random.key(i), shape) for i in range(4))
  constants = reference.AdamConstants()

  @functools.partial(jax.jit, donate_argnums=(1, 2))
  def fused(g, m, v, p):
    hyper = reference.hyperparams(3, 1e-3, 0.1, constants)
    out = partitioned.masked_adam_pallas_partitioned(
      g, m, v, hyper, params=p, scale=jnp.asarray(0.5),
      interpret=interpret, backend=backend,
    )  # fmt: skip
    return out.mu, out.nu, out.update

  @functools.partial(jax.jit, donate_argnums=(0,))
  def copy(x):
    return x + 1.0

  m, v, _ = fused(g, m, v, p)
  x = copy(jnp.copy(p))  # the copy donates its input: never p itself
  jax.block_until_ready((m, v, x))
  t_fused, t_copy = [], []
  for _ in range(rounds):
    t0 = time.perf_counter()
    m, v, _ = fused(g, m, v, p)
    jax.block_until_ready((m, v))
    t_fused.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    x = copy(x)
    jax.block_until_ready(x)
    t_copy.append(time.perf_counter() - t0)
  n = shape[0] * shape[1]
  bw = 28 * n / np.median(t_fused) / 1e9
  copy_bw = 8 * n / np.median(t_copy) / 1e9
  print(
    f"bandwidth[{backend}] kernel alone, {n / 1e6:.0f} M params: {bw:.0f} GB/s"
    f" (28 B/param), copy"
    f" {copy_bw:.0f} GB/s -> {bw / copy_bw:.0%} of copy (target >= 80%)"
  )


# The XLA reference of the tile kernel: gather the slots' tiles, then Adam.
tile_adam_xla = tiles.tile_adam_reference


def _tile_inputs(shape, block, density, g_dtype, m_dtype, empty=0, seed=0):
  """g as (rows, r, cols, c), random moments of K = active + ``empty`` slots."""
  r, c = block
  g, mu, nu, idx = device_checks.tile_inputs(
    shape, block, density, g_dtype, m_dtype, empty, seed
  )
  return g.reshape(-1, r, shape[-1] // c, c), mu, nu, idx


def check_tiles(cases, blocks, backends, interpret=False) -> bool:
  """``pallas_tiles.tile_adam_pallas`` vs :func:`tile_adam_xla`, density 0.3 and 3
  empty slots; a failure to compile is reported as a FAIL, not raised."""
  constants = reference.AdamConstants()
  hyper = reference.hyperparams(5, 1e-3, 0.0, constants)
  ok = True
  for backend in backends:
    for (shape, g_dtype, m_dtype), block in itertools.product(cases, blocks):
      args = _tile_inputs(shape, block, 0.3, g_dtype, m_dtype, empty=3)
      what = f"tile kernel[{backend}] {shape} block {block} K={len(args[3])}"
      try:
        got = jax.jit(
          functools.partial(
            pallas_tiles.tile_adam_pallas,
            hyper=hyper,
            backend=backend,
            interpret=interpret,
          )  # fmt: skip
        )(*args)
      except Exception as e:  # noqa: BLE001 -- report, check the other cases
        print(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:200]} FAIL")
        ok = False
        continue
      want = tile_adam_xla(*args, hyper)
      errs = []
      for a, b in zip(got, want, strict=True):
        b32 = np.asarray(b, np.float32)
        err = np.max(np.abs(np.asarray(a, np.float32) - b32))
        errs.append(float(err / (np.max(np.abs(b32)) + 1e-30)))
      tol = 1e-5 if jnp.float32 == g_dtype == m_dtype else 1e-2
      good = max(errs) <= tol
      ok &= good
      print(
        f"{what} {jnp.dtype(g_dtype).name}/{jnp.dtype(m_dtype).name}: worst rel err"
        f" {max(errs):.1e} (tol {tol:.0e}) {'OK' if good else 'FAIL'}"
      )
  return ok


def tile_bandwidth(shape, block, densities, rounds, backend, interpret=False) -> None:
  """The tile kernel alone vs the XLA reference (donated moments), per density;
  bytes = K r c (read g, read and write m and v, write the update)."""
  constants = reference.AdamConstants()
  hyper = reference.hyperparams(5, 1e-3, 0.0, constants)
  kernel = functools.partial(
    pallas_tiles.tile_adam_pallas, backend=backend, interpret=interpret
  )
  donated = functools.partial(jax.jit, donate_argnums=(1, 2))
  runs = {
    "kernel": donated(lambda g, m, v, i: kernel(g, m, v, i, hyper)),
    "xla": donated(lambda g, m, v, i: tile_adam_xla(g, m, v, i, hyper)),
  }
  for density in densities:
    g4, mu, nu, idx = _tile_inputs(shape, block, density, jnp.float32, jnp.float32)
    state = {name: (jnp.copy(mu), jnp.copy(nu)) for name in runs}
    times = {name: [] for name in runs}
    for _ in range(rounds + 1):  # round 0 compiles
      for name, fn in runs.items():
        t0 = time.perf_counter()
        m, v, u = fn(g4, *state[name], idx)
        jax.block_until_ready((m, v, u))
        times[name].append(time.perf_counter() - t0)
        state[name] = (m, v)
    nbytes = mu.size * (4 + 2 * (4 + 4) + 4)
    ms = {name: float(np.median(t[1:])) * 1e3 for name, t in times.items()}
    print(
      f"tile bandwidth[{backend}] {shape} block {block} density {density}"
      f" K={len(idx)}: kernel {ms['kernel']:.3f} ms"
      f" ({nbytes / ms['kernel'] / 1e6:.0f} GB/s), xla reference {ms['xla']:.3f} ms"
      f" ({nbytes / ms['xla'] / 1e6:.0f} GB/s)"
    )


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
    ok = check_kernel(SMOKE_CASES, interpret=True, backends=[backend])
    ok &= check_optimizer(8192, interpret="tpu")
    ok &= check_tiles(SMOKE_TILE_CASES, [(8, 128)], [backend], interpret=True)
    kernel_bandwidth(8192, 1, interpret=True, backend=backend)
    tile_bandwidth((32, 256), (8, 128), [0.3], 1, backend, interpret=True)
    sizes, rounds, implementations = [8192], 1, ["xla"]
  elif jax.default_backend() != "tpu":
    print("no TPU: this script checks the Mosaic TPU kernel; nothing to do.")
    return 0
  else:
    ok = check_kernel(CASES, backends=[backend])
    ok &= check_optimizer()
    ok &= check_tiles(TILE_CASES, [(8, 128)], [backend])
    kernel_bandwidth(64 * 2**20, args.rounds, backend=backend)
    tile_bandwidth((2048, 2048), (8, 128), TILE_DENSITIES, args.rounds, backend)
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
