"""Sparse optimizer state: memory and step time against dense Adam; mask-refresh cost.

Prints two tables:

1. For densities 0.1 / 0.3 / 0.5 / 1.0: optimizer-state bytes and the step time of
   ``sparse_state(adam, mode="compact")`` and ``mode="skip"`` as ratios to dense
   ``optax.adam`` on the same parameters, and N:M compact storage for a random 2:4
   mask (``structure=(2, 4)``) (the mask is an input here: its storage is
   reported separately). Target: compact state bytes <= density + 0.05 of dense.
2. The amortised cost of ``periodic_mask``'s refresh at ``every`` = 1, 10, 100: mean
   step time of ``periodic_mask(adam, sparsity=s, every=E)`` over a window of steps
   (``s`` a constant 0.5, and a linear ramp 0.1 -> 0.5 over the window),
   as a ratio to the same wrapper whose refresh never fires (``start`` beyond the
   window) and to plain ``optax.adam``. Target: <= 1.05 at ``every=100``. The last
   column is the cost of one refresh in wrapper steps, ``(ratio - 1) * every``.
   On a noisy machine the every=100 ratio is within the noise, so the refresh cost
   at ``every=100`` is also measured step by step: over a window of 1000 steps
   (the ramp 0.1 -> 0.5 then raises the target by 0.04 per refresh, as gradual
   pruning does), each step is timed on its own, and a refresh costs its step's
   time minus the median step of its block of 100. Its share of the mean step time
   at every=100 is that cost over 100 mean wrapper steps (the no-refresh
   wrapper's, from the interleaved rounds).

``--tiles`` prints only table 0: every storage at ``--density`` (element, N:M 2:4
and ``--blocks`` tile masks) against dense ``optax.adam`` on ``--layers`` square
``--width`` leaves: state bytes, the median over rounds of the per-round step-time
ratio with a 95% confidence interval for it (order statistics, see
:func:`median_ci`) and the range, the step's temporary bytes (``memory_analysis``),
and a model of the bytes each step moves per parameter (float32, donated, density
d): dense Adam 28 (read p, g, mu, nu; write p, mu, nu); skip 29 (+ the mask); flat
compact 17 + 24 d (mask, index build, gather of g, moments of the active entries, a
zero update with the entries scattered into it, ``p + u``), + 4 d with the cached
index (read instead of built, ``cache_index=True``, the default); N:M 29; tiles 9 +
24 d (the mask, read once for the tile check, g and the moments of the active tiles,
the compact update, ``p + u`` with the expansion fused; ``sparse_adam``, the same
storage with its Adam step fused over the active tiles, the same model); and,
outside optax's update/apply split, the tile step that scatter-adds into the donated
parameters, 1 + 28 d. The model ratio is the model over 28. Rows marked
``on_error='record'`` compile no host callback for the mask checks (the default
``"raise"`` does, and XLA:CPU then runs every step synchronously); nor do the
``periodic_mask`` rows, whose masks (a float sparsity ranked per leaf) are promised
to fit.

Within a round every configuration is measured once, interleaved (in a seeded
shuffled order), so the ratios compare runs under the same machine load. Table 1
shows the best (minimum) time of ``--repeats`` rounds; table 2 the median over rounds
of the ratios within each round (paired, which is steadier when the ratios are close
to 1). ``--refresh-only`` skips table 1.

``--transformer`` replaces the square leaves by a transformer's matrices (6 per layer:
q, k, v, o of ``width x width``, an MLP of ``width x 4 width`` and back), many
smaller leaves, where per-leaf costs show.

``--host-ms 3`` makes the timed loop sleep 3 ms before each step (``--tiles``): host
work that a step dispatched asynchronously overlaps, and a step with a host callback
(sparse storage's default ``on_error="raise"``), which XLA:CPU runs synchronously,
does not.

``--donate`` donates params and state to every step (as training loops usually do);
on XLA:CPU that makes dense Adam about 2x faster, and the ratios larger.

Usage::

    python3 benchmarks/sparse_state.py --width 512 --layers 4 --steps 200 --repeats 3
    python3 benchmarks/sparse_state.py --refresh-only --repeats 11 --donate
    python3 benchmarks/sparse_state.py --tiles --donate --width 1024 --layers 4 \
      --steps 50 --repeats 9
    python3 benchmarks/sparse_state.py --tiles --transformer --donate --width 256 \
      --layers 12 --steps 20 --repeats 11
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import magma_optax as magma
from magma_optax.sparse.indices import active_indices


def make_params(width: int, layers: int) -> dict:
  keys = jax.random.split(jax.random.key(0), layers)
  return {
    f"layer{i}": {
      "kernel": jax.random.normal(k, (width, width)) / width**0.5,
      "bias": jnp.zeros((width,)),
    }
    for i, k in enumerate(keys)
  }


def random_mask(params: dict, density: float) -> dict:
  """Exactly round(density * size) active entries per leaf, at random positions."""

  def one(i, x):
    n = x.size
    keep = int(round(density * n))
    order = jax.random.permutation(jax.random.key(100 + i), n)
    flat = jnp.zeros(n, bool).at[order[:keep]].set(True)
    return flat.reshape(x.shape)

  leaves, treedef = jax.tree.flatten(params)
  return treedef.unflatten([one(i, x) for i, x in enumerate(leaves)])


def random_n_m_mask(params: dict, n: int, m: int) -> dict:
  """``n`` active entries at random in every ``m`` consecutive ones (last axis)."""

  def one(i, x):
    groups = x.size // m
    order = jax.random.uniform(jax.random.key(200 + i), (groups, m)).argsort(axis=1)
    return (order < n).reshape(x.shape)

  leaves, treedef = jax.tree.flatten(params)
  return treedef.unflatten([one(i, x) for i, x in enumerate(leaves)])


def state_bytes(state) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))


def timer(
  tx, params, grads, steps, mask=None, *, donate=False, host_ms=0.0, warm=False
):
  """Returns a function timing ``steps`` jitted updates, and the initial state.

  Gradients and mask are jit arguments (closed-over constants would be folded).
  With ``donate`` the step donates params and state, as training loops usually do;
  every timed run then starts from fresh copies (made before the clock starts).
  ``host_ms``: the loop waits that long before each step (``time.sleep``: host work
  that does not use the CPU, such as waiting for the next batch), which an
  asynchronously dispatched step overlaps. ``warm``: every timed run starts from the
  state after one step (for ``periodic_mask``: after its first refresh, so the
  timed steps are ordinary ones).
  """

  @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
  def step(p, s, g, m):
    extra = {} if m is None else {"param_mask": m}
    u, s = tx.update(g, s, p, **extra)
    return optax.apply_updates(p, u), s

  state = tx.init(params)
  if warm:
    params, state = jax.jit(step.__wrapped__)(params, state, grads, mask)
  fresh = lambda: jax.tree.map(jnp.copy, (params, state)) if donate else (params, state)
  compiled = step.lower(params, state, grads, mask).compile()
  jax.block_until_ready(step(*fresh(), grads, mask))  # compile

  def run():
    p, s = fresh()
    jax.block_until_ready((p, s))
    t0 = time.perf_counter()
    for _ in range(steps):
      if host_ms:
        time.sleep(host_ms / 1e3)
      p, s = step(p, s, grads, mask)
    jax.block_until_ready((p, s))
    return (time.perf_counter() - t0) / steps

  run.temp_bytes = compiled.memory_analysis().temp_size_in_bytes
  return run, state


def refresh_step_costs(tx, params, grads, steps, every, *, donate=False) -> list:
  """Seconds each refresh adds: its step's time minus the median of its block.

  Every step is timed on its own (dispatch and a wait for the result), which adds
  the same overhead to every step, so the difference is the refresh's own cost.
  """

  @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = tx.init(params)
  fresh = lambda: jax.tree.map(jnp.copy, (params, state)) if donate else (params, state)
  jax.block_until_ready(step(*fresh(), grads))  # compile
  p, s = fresh()
  jax.block_until_ready((p, s))
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    p, s = step(p, s, grads)
    jax.block_until_ready((p, s))
    times.append(time.perf_counter() - t0)
  return [
    times[b] - statistics.median(times[b + 1 : b + every])
    for b in range(0, steps - every + 1, every)
  ]


def interleaved(runners: dict, repeats: int) -> dict:
  """Times per configuration, one per round; every round runs each once, in a
  shuffled order (seeded), so the i-th times of two configurations saw the same
  machine load and no configuration always follows the same one."""
  keys = list(runners)
  times = {k: [] for k in keys}
  for r in range(repeats):
    order = keys[:]
    random.Random(r).shuffle(order)
    for k in order:
      times[k].append(runners[k]())
  return times


def median_ci(xs, level: float = 0.95) -> tuple[float, float]:
  """A distribution-free confidence interval for the median of ``xs``.

  The order statistics ``x_(j) <= x_(n+1-j)`` with the largest ``j`` whose coverage
  ``1 - 2 P(Binomial(n, 1/2) < j)`` is still ``>= level``: the interval holds the
  median of the distribution the rounds are drawn from with at least that
  probability, whatever its shape (rounds independent). Needs ``n >= 6`` for 95%
  (then it is the range); ``(nan, nan)`` below that.

  >>> median_ci([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
  (1.0, 6.0)
  >>> median_ci(range(25))  # x_(8), x_(18) of 25: coverage 0.957
  (7, 17)
  """
  xs = sorted(xs)
  n = len(xs)
  below = lambda j: sum(math.comb(n, i) for i in range(j)) / 2**n  # P(B < j)
  j = 0
  while j + 1 <= n // 2 and 1 - 2 * below(j + 1) >= level:
    j += 1
  if j == 0:
    return math.nan, math.nan
  return xs[j - 1], xs[n - j]


def paired_ratio(times: dict, a, b) -> float:
  """Median over rounds of ``times[a][i] / times[b][i]``."""
  return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def table_sizes(params, grads, adam, n, args):
  """Table 1: state bytes and step time of compact and skip storage."""
  densities = (0.1, 0.3, 0.5, 1.0)
  runners, bytes_ = {}, {}
  runners["dense"], st = timer(adam, params, grads, args.steps, donate=args.donate)
  bytes_["dense"] = state_bytes(st)
  for d in densities:
    mask = random_mask(params, d)
    for mode in ("compact", "skip"):
      tx = magma.sparse_state(adam, mode=mode, density=d if mode == "compact" else None)
      runners[mode, d], st = timer(
        tx, params, grads, args.steps, mask, donate=args.donate
      )
      bytes_[mode, d] = state_bytes(st)

  nm_mask = random_n_m_mask(params, 2, 4)
  tx = magma.sparse_state(adam, mode="compact", structure=(2, 4))
  runners["2:4"], st = timer(tx, params, grads, args.steps, nm_mask, donate=args.donate)
  bytes_["2:4"] = state_bytes(st)

  med = {k: min(v) for k, v in interleaved(runners, args.repeats).items()}

  print(
    f"\ndense optax.adam: state {bytes_['dense']:,} B, step {med['dense'] * 1e3:.3f} ms"
  )
  print("\n| density | compact bytes | skip bytes | compact time | skip time |")
  print("|---|---|---|---|---|")
  for d in densities:
    print(
      f"| {d:.1f} | {bytes_['compact', d] / bytes_['dense']:.3f}"
      f" | {bytes_['skip', d] / bytes_['dense']:.3f}"
      f" | {med['compact', d] / med['dense']:.2f}"
      f" | {med['skip', d] / med['dense']:.2f} |"
    )
  print(
    f"| 0.5 (2:4) | {bytes_['2:4'] / bytes_['dense']:.3f} | |"
    f" {med['2:4'] / med['dense']:.2f} | |"
  )
  print(
    f"\n(bytes and times are ratios to dense Adam; the bool mask itself is"
    f" {n:,} B = {n / bytes_['dense']:.3f} of dense Adam's state; density 1.0"
    " compact falls back to skip storage above density_threshold=0.6)"
  )


def random_tile_mask(params: dict, density: float, block, parts=(1, 1)) -> dict:
  """Exactly round(density * tiles) active r x c tiles per 2-D leaf, at random (with
  ``parts=(sr, sc)``: in each of the leaf's sr x sc parts, for per-shard storage);
  other leaves all active."""
  r, c = block
  sr, sc = parts

  def one(i, x):
    if x.ndim != 2:
      return None
    rows, cols = x.shape[0] // (r * sr), x.shape[1] // (c * sc)
    keys = jax.random.split(jax.random.key(300 + i), sr * sc)
    order = jax.vmap(lambda k: jax.random.permutation(k, rows * cols))(keys)
    keep = order < round(density * rows * cols)  # (parts, tiles of a part)
    tiles = keep.reshape(sr, sc, rows, cols).transpose(0, 2, 1, 3)
    tiles = tiles.reshape(sr * rows, 1, sc * cols, 1)
    return jnp.broadcast_to(tiles, (sr * rows, r, sc * cols, c)).reshape(x.shape)

  leaves, treedef = jax.tree.flatten(params)
  return treedef.unflatten([one(i, x) for i, x in enumerate(leaves)])


def direct_tile_step(params, density, block):
  """Outside optax's contract, for comparison: the tile step that scatter-adds the
  compact update straight into the (donated) parameters instead of returning an
  update for ``optax.apply_updates`` (the same gather and Adam on the tiles)."""
  adam = optax.adam(1e-3)
  r, c = block
  views = {k: (x.shape[0] // r, r, x.shape[1] // c, c) for k, x in params.items()}
  caps = {k: math.ceil(density * v[0] * v[2]) for k, v in views.items()}

  def tiles(mask, k):  # the same index build as the storage's
    t = mask.reshape(views[k])[:, 0, :, 0].reshape(-1)
    return active_indices(t, caps[k])[0]

  def update(p, s, g, m):
    idx = {k: tiles(m[k], k) for k in p}
    cols = {k: views[k][2] for k in p}
    g_t = {
      k: g[k].reshape(views[k]).at[i // cols[k], :, i % cols[k], :].get(mode="fill")
      for k, i in idx.items()
    }
    u, s = adam.update(g_t, s)
    new_p = {
      k: p[k]
      .reshape(views[k])
      .at[i // cols[k], :, i % cols[k], :]
      .add(u[k], mode="drop")
      .reshape(p[k].shape)
      for k, i in idx.items()
    }
    return new_p, s

  init = lambda p: adam.init({k: jnp.zeros((caps[k], r, c)) for k in p})
  return init, update


def direct_timer(params, grads, mask, density, block, steps, host_ms=0.0):
  init, update = direct_tile_step(params, density, block)
  step = jax.jit(update, donate_argnums=(0, 1))
  state = init(params)
  fresh = lambda: jax.tree.map(jnp.copy, (params, state))
  compiled = step.lower(params, state, grads, mask).compile()
  p, s = step(*fresh(), grads, mask)
  jax.block_until_ready((p, s))

  def run():
    p, s = fresh()
    jax.block_until_ready((p, s))
    t0 = time.perf_counter()
    for _ in range(steps):
      if host_ms:
        time.sleep(host_ms / 1e3)
      p, s = step(p, s, grads, mask)
    jax.block_until_ready((p, s))
    return (time.perf_counter() - t0) / steps

  run.temp_bytes = compiled.memory_analysis().temp_size_in_bytes
  return run


def shape_of(args) -> str:
  if args.transformer:
    return f"{args.layers} transformer layers of width {args.width}, 6 matrices each"
  return f"{args.layers} x {args.width}x{args.width}"


def transformer_params(width: int, layers: int) -> dict:
  """A transformer's matrices: per layer q, k, v, o (``width x width``) and an MLP
  (``width x 4 width``, ``4 width x width``): 6 leaves per layer."""
  shapes = {"q": (1, 1), "k": (1, 1), "v": (1, 1), "o": (1, 1), "up": (1, 4)}
  shapes["down"] = (4, 1)
  keys = iter(jax.random.split(jax.random.key(0), 6 * layers))
  return {
    f"l{i}_{name}": jax.random.normal(next(keys), (width * a, width * b)) / width**0.5
    for i in range(layers)
    for name, (a, b) in shapes.items()
  }


def table_tiles(args):
  """Table 0 (``--tiles``): every storage at one density against dense Adam, with
  the bytes-per-parameter model of each step (float32, see the module docstring)."""
  d = args.density
  if args.transformer:
    params = transformer_params(args.width, args.layers)
  else:
    params = {
      f"layer{i}": jax.random.normal(k, (args.width, args.width)) / args.width**0.5
      for i, k in enumerate(jax.random.split(jax.random.key(0), args.layers))
    }
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), params)
  n = sum(x.size for x in jax.tree.leaves(params))
  adam = optax.adam(1e-3)
  masks = {"element": random_mask(params, d), "2:4": random_n_m_mask(params, 2, 4)}
  # name: (transform, mask, bytes per parameter per step in the model)
  configs = {
    "dense optax.adam": (adam, None, 28),
    f"skip, element mask {d}": (magma.sparse_state(adam), masks["element"], 29),
    f"sparse_adam skip, element mask {d}": (
      magma.sparse_adam(1e-3),
      masks["element"],
      29,
    ),
    f"compact, element mask {d}": (
      magma.sparse_state(adam, mode="compact", density=d),
      masks["element"],
      17 + 28 * d,
    ),
    f"compact, element mask {d}, on_error='record'": (
      magma.sparse_state(adam, mode="compact", density=d, on_error="record"),
      masks["element"],
      17 + 28 * d,
    ),
    f"compact, element mask {d}, cache_index=False": (
      magma.sparse_state(adam, mode="compact", density=d, cache_index=False),
      masks["element"],
      17 + 24 * d,
    ),
    "compact N:M 2:4": (
      magma.sparse_state(adam, mode="compact", structure=(2, 4)),
      masks["2:4"],
      29,
    ),
  }
  for block in args.blocks:
    mask = random_tile_mask(params, d, block)
    masks[block] = mask
    configs[f"compact tiles {block[0]}x{block[1]} {d}"] = (
      magma.sparse_state(adam, mode="compact", density=d, block=block),
      mask,
      9 + 24 * d,
    )
    configs[f"sparse_adam tiles {block[0]}x{block[1]} {d} (xla)"] = (
      magma.sparse_adam(1e-3, mode="compact", density=d, block=block),
      mask,
      9 + 24 * d,
    )
    configs[f"sparse_adam tiles {block[0]}x{block[1]} {d} (xla), on_error='record'"] = (
      magma.sparse_adam(
        1e-3, mode="compact", density=d, block=block, on_error="record"
      ),
      mask,
      9 + 24 * d,
    )
  # What a user runs: periodic_mask's tile masks (70 % of the tiles pruned, one
  # refresh before the timed steps), its inner optimizer dense or tile-stored.
  # The model adds the mask's read by the wrapper's where(mask, u, -p) (1 B).
  block = args.blocks[-1]
  wrapped = functools.partial(
    magma.periodic_mask, sparsity=1 - d, block=block, start=0, every=10**9
  )
  tiles = f"{block[0]}x{block[1]}"
  configs[f"periodic_mask(optax.adam), tiles {tiles}"] = (wrapped(adam), "warm", 29)
  configs[f"periodic_mask(sparse_adam tiles {tiles} {d})"] = (
    wrapped(magma.sparse_adam(1e-3, mode="compact", density=d, block=block)),
    "warm",
    10 + 24 * d,
  )
  if args.shards:  # per-shard tile storage (on one device: the cost of the parts)
    block, parts = args.blocks[0], args.shards
    name = f"sparse_adam tiles {block[0]}x{block[1]} {d}, shards={parts}"
    configs[name] = (
      magma.sparse_adam(1e-3, mode="compact", density=d, block=block, shards=parts),
      random_tile_mask(params, d, block, parts),
      9 + 24 * d,
    )
  runners, bytes_, model = {}, {}, {}
  for name, (tx, mask, bpp) in configs.items():
    warm = isinstance(mask, str)  # periodic_mask's own masks, after its refresh
    runners[name], st = timer(
      tx,
      params,
      grads,
      args.steps,
      None if warm else mask,
      donate=args.donate,
      host_ms=args.host_ms,
      warm=warm,
    )
    bytes_[name], model[name] = state_bytes(st), bpp
  block = args.blocks[0]
  direct = f"tiles {block[0]}x{block[1]} {d}, scatter-add into params (no optax split)"
  runners[direct] = direct_timer(
    params, grads, masks[block], d, block, args.steps, args.host_ms
  )
  bytes_[direct] = bytes_[f"compact tiles {block[0]}x{block[1]} {d}"]
  model[direct] = 1 + 28 * d
  times = interleaved(runners, args.repeats)
  ref = "dense optax.adam"
  print(
    f"\nAll storages at density {d}: {n:,} parameters ({shape_of(args)}),"
    f" {args.steps} steps x {args.repeats} rounds,"
    f"{' donated,' if args.donate else ''}"
    f"{f' {args.host_ms:g} ms of host wait per step,' if args.host_ms else ''}"
    " dense Adam"
    f" {statistics.median(times[ref]) * 1e3:.2f} ms per step (median)"
  )
  print(
    "\n| storage | state bytes | step time: median [95% CI] (range) | model"
    " B/param | model ratio | temp MB |"
  )
  print("|---|---|---|---|---|---|")
  for name in runners:
    ratios = [x / y for x, y in zip(times[name], times[ref], strict=True)]
    lo, hi = median_ci(ratios)
    print(
      f"| {name} | {bytes_[name] / bytes_[ref]:.3f}"
      f" | {statistics.median(ratios):.2f} [{lo:.2f}, {hi:.2f}]"
      f" ({min(ratios):.2f}-{max(ratios):.2f})"
      f" | {model[name]:.1f} | {model[name] / 28:.2f}"
      f" | {runners[name].temp_bytes / 2**20:.1f} |"
    )


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--width", type=int, default=512)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--refresh-only", action="store_true", help="skip table 1")
  ap.add_argument(
    "--tiles", action="store_true", help="only the table of all storages at --density"
  )
  ap.add_argument("--density", type=float, default=0.3)
  ap.add_argument(
    "--transformer",
    action="store_true",
    help="with --tiles, a transformer's matrices: 6 per layer (--width, --layers)",
  )
  ap.add_argument(
    "--blocks",
    type=lambda v: [tuple(int(x) for x in b.split("x")) for b in v.split(",")],
    default=[(1, 128), (8, 128)],
    help="tile shapes for --tiles, e.g. 1x128,8x128",
  )
  ap.add_argument(
    "--donate", action="store_true", help="donate params and state to each step"
  )
  ap.add_argument(
    "--shards",
    type=lambda v: tuple(int(x) for x in v.split("x")),
    default=None,
    help="with --tiles, also per-shard tile storage of the first block, e.g. 2x4",
  )
  ap.add_argument(
    "--host-ms",
    type=float,
    default=0.0,
    help="with --tiles, the loop sleeps this long before each step (host work)",
  )
  args = ap.parse_args()

  params = make_params(args.width, args.layers)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), params)
  n = sum(x.size for x in jax.tree.leaves(params))
  # The tile table (--tiles) builds its own tree and names it in its header.
  tree = "" if args.tiles else f" {n:,} parameters ({args.layers} x"
  tree += "" if args.tiles else f" [{args.width}x{args.width} + bias]);"
  print(
    f"# jax {jax.__version__} on {jax.devices()[0].platform};{tree}"
    f" {args.steps} steps x {args.repeats} rounds"
    f"{'; params and state donated' if args.donate else ''}"
  )

  adam = optax.adam(1e-3)
  if args.tiles:
    table_tiles(args)
    return
  if not args.refresh_only:
    table_sizes(params, grads, adam, n, args)

  # Refresh cost of periodic_mask. Two targets: a constant 0.5 (after the first
  # refresh the pruned weights are 0, so the cut falls between 0 and the smallest
  # kept score: the bisection stops early) and a linear ramp 0.1 -> 0.5 over the
  # window (every refresh cuts among nonzero scores: the full bisection).
  window = max(args.steps, 100)
  targets = {
    "constant": 0.5,
    "ramp": magma.linear_sparsity_schedule(
      0.5, begin_step=0, end_step=window, initial_sparsity=0.1
    ),
  }
  refresh = {}
  refresh["adam"], _ = timer(adam, params, grads, window, donate=args.donate)
  # Two identical no-refresh wrappers: the second one's ratio is the noise floor.
  for name in ("never", "never (copy)"):
    refresh[name], _ = timer(
      magma.periodic_mask(adam, sparsity=0.5, every=1, start=10**9),
      params,
      grads,
      window,
      donate=args.donate,
    )
  for target, sparsity in targets.items():
    for every in (1, 10, 100):
      refresh[target, every], _ = timer(
        magma.periodic_mask(adam, sparsity=sparsity, every=every),
        params,
        grads,
        window,
        donate=args.donate,
      )
  times = interleaved(refresh, args.repeats)
  print(
    f"\nperiodic_mask refresh, mean over {window} steps (adam step"
    f" {statistics.median(times['adam']) * 1e3:.3f} ms; median of"
    f" {args.repeats} paired rounds):"
  )
  print(
    "\n| target | every | vs no-refresh wrapper | vs optax.adam | one refresh (steps) |"
  )
  print("|---|---|---|---|---|")
  print(f"| | never | 1.00 | {paired_ratio(times, 'never', 'adam'):.2f} | |")
  noise = [x / y for x, y in zip(times["never (copy)"], times["never"], strict=True)]
  print(
    f"| | never (copy) | {statistics.median(noise):.3f}"
    f" | {paired_ratio(times, 'never (copy)', 'adam'):.2f} | |"
  )
  cost = {}
  for target in targets:
    for every in (1, 10, 100):
      r = paired_ratio(times, (target, every), "never")
      cost[target, every] = (r - 1) * every
      print(
        f"| {target} | {every} | {r:.3f}"
        f" | {paired_ratio(times, (target, every), 'adam'):.2f}"
        f" | {cost[target, every]:.1f} |"
      )
  print(
    f"\nNoise floor: the identical copy's per-round ratios span"
    f" {min(noise):.3f}-{max(noise):.3f}. One refresh costs"
    f" {cost['constant', 1]:.1f} (constant) and {cost['ramp', 1]:.1f} (ramp)"
    f" wrapper steps at every=1."
  )

  # The every=100 refresh, step by step (see the module docstring).
  long_window, every = 1000, 100
  ramp = magma.linear_sparsity_schedule(
    0.5, begin_step=0, end_step=long_window, initial_sparsity=0.1
  )
  step_ms = statistics.median(times["never"]) * 1e3
  print(
    f"\nRefresh at every={every}, timed step by step over {long_window} steps"
    f" x {args.repeats} rounds (wrapper step {step_ms:.3f} ms, from the rounds"
    " above):\n"
  )
  print(
    "| target | refreshes | one refresh: median ms (IQR) | in wrapper steps |"
    " adds at every=100 |"
  )
  print("|---|---|---|---|---|")
  for target, sparsity in (("constant", 0.5), ("ramp", ramp)):
    costs = []
    for _ in range(args.repeats):
      costs += refresh_step_costs(
        magma.periodic_mask(adam, sparsity=sparsity, every=every),
        params,
        grads,
        long_window,
        every,
        donate=args.donate,
      )
    q1, med, q3 = statistics.quantiles([c * 1e3 for c in costs], n=4)
    print(
      f"| {target} | {len(costs)} | {med:.2f} ({q1:.2f}-{q3:.2f})"
      f" | {med / step_ms:.1f} | {med / step_ms / every:.1%} |"
    )


if __name__ == "__main__":
  main()
