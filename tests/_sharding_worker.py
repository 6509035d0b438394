"""Sharded training runs on 8 forced CPU devices, for test_sharding / test_multihost.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX starts,
so the tests run ``python3 tests/_sharding_worker.py OUT_DIR 8`` in a subprocess. It
trains a few steps of every transform with parameters sharded by rows, by columns,
by both (and a data+model-parallel MLP), on ``AxisType.Auto`` and ``Explicit``
meshes, and writes

* ``OUT_DIR/<run>.npz``: final parameters and optimizer state (flattened by key path;
  PRNG keys as key data) and the masks of every step;
* ``OUT_DIR/report.json``: shardings of the state, collectives in the compiled step,
  and compile-cache sizes.

``python3 tests/_sharding_worker.py OUT_DIR 1`` runs the same on one device and
writes ``OUT_DIR/ref_<run>.npz``: the reference (a separate process, so that both
run side by side with the same XLA flags). Importing this module has no side
effects; all transforms of one run are combined into one optimizer (one compile).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before JAX starts
  # Optimization level 0 only makes LLVM faster at compiling these tiny programs.
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={int(sys.argv[2])}"
    + " --xla_backend_optimization_level=0"
  )
  os.environ["JAX_PLATFORMS"] = "cpu"

import contextlib  # noqa: E402
import functools  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import magma_optax as magma  # noqa: E402

STEPS = 3
# name -> (shape, partition spec on a ("x"=2, "y"=4) mesh)
FLAT = {
  "rows": ((16, 8), P("x", None)),
  "cols": ((8, 16), P(None, "y")),
  "both": ((16, 16), P("x", "y")),
  "bias": ((16,), P("y")),
}
SQUARE = {k: v for k, v in FLAT.items() if k != "bias"}  # 4x4 tiles divide these
STACKED = {"layers": ((4, 8, 16), P(None, "x", "y")), "head": ((16, 8), P("y", None))}
# Rows long enough for the runs of masked block sums (_blocks.SUM_RUN entries): one
# leaf whose last axis is sharded, one whose last axis is whole on every device
# (split along a leading axis: periodic_mask's mask counts, in chunks of rows, stay
# local; rows split over devices would all-reduce a chunk's partial counts).
WIDE = {"cols": ((8, 1024), P(None, "y")), "stack": ((2, 16, 256), P("x", None, None))}
# Per-shard tiles: SQUARE and a stack of experts sharded along its stacking axis.
TILED = {**SQUARE, "experts": ((4, 8, 8), P("y", None, "x"))}


def core_transforms():
  """Case name -> (optimizer, parameter layout). Every core transform appears."""
  return {
    "magma_adam": (magma.magma(optax.adam(0.1), key=1), FLAT),
    "magma_adam_row": (magma.magma(optax.adam(0.1), key=2, granularity="row"), FLAT),
    "magma_rmsprop_column": (
      magma.magma(optax.rmsprop(0.1), key=3, granularity="column"),
      FLAT,
    ),
    "skip_update_sgd_element": (
      magma.skip_update(optax.sgd(0.1, momentum=0.9), key=4, granularity="element"),
      FLAT,
    ),
    "magma_adam_tile": (
      magma.magma(optax.adam(0.1), key=6, granularity=(4, 4)),
      SQUARE,
    ),
    "bernoulli_mask_tile": (
      optax.chain(
        optax.adam(0.1), magma.bernoulli_mask(0.5, key=5, granularity=(4, 4))
      ),
      SQUARE,
    ),
    "alignment_mask_row": (
      optax.chain(magma.alignment_mask(key=6, granularity="row"), optax.adam(0.1)),
      FLAT,
    ),
    "damping_row": (
      optax.chain(optax.adam(0.1), magma.damping(0.5, granularity="row")),
      FLAT,
    ),
    "magma_stacked": (
      magma.magma(optax.adam(0.1), key=7, stack_axes=1, granularity="row"),
      STACKED,
    ),
  }


EXPLICIT_CASES = (
  "magma_adam_row",
  "magma_adam_tile",  # block sums of tiles: reshapes of sharded axes
  "skip_update_sgd_element",
  "periodic_mask_sparse_state_nm_compact",
  "sharded_tiles_sparse_adam",  # with periodic_mask's tile sums: _sharded.reshape
  "periodic_mask_adam_magma",  # masked block sums: runs split an unsharded axis
)


def sparse_transforms():
  """The sparse-training wrappers (empty if the package does not have them)."""
  if not hasattr(magma, "periodic_mask") or not hasattr(magma, "sparse_state"):
    return {}
  # Each case covers both wrappers (periodic_mask hands its mask to sparse_state).
  # Skip storage, and N:M compact storage (per group, so it keeps the sharding;
  # every FLAT axis holds whole groups of 4 per device). Unstructured compact
  # storage keeps one flat vector per leaf by design and is documented to gather.
  cases = {
    "periodic_mask_sparse_state_skip": (
      magma.periodic_mask(
        magma.sparse_state(optax.adam(0.1), mode="skip"),
        sparsity=0.5,
        every=2,
      ),
      FLAT,
    ),
    "periodic_mask_sparse_state_nm_compact": (
      magma.periodic_mask(
        magma.sparse_state(optax.adam(0.1), mode="compact", structure=(2, 4)),
        structure=(2, 4),
        every=2,
      ),
      FLAT,
    ),
    # adam_magma's block sums over the existing entries (one variadic reduction).
    "periodic_mask_adam_magma": (
      magma.periodic_mask(
        magma.adam_magma(0.1, key=8, granularity="row"), sparsity=0.5, every=2
      ),
      WIDE,
    ),
  }
  if "block" in inspect.signature(magma.periodic_mask).parameters:
    # Whole 4x4 tiles: every sharded axis of SQUARE holds whole tiles per device.
    cases["periodic_mask_tiles"] = (
      magma.periodic_mask(optax.adam(0.1), sparsity=0.5, every=2, block=(4, 4)),
      SQUARE,
    )
  if hasattr(magma, "sparse_adam"):
    # Compact tile storage (one vector of tiles per leaf) under AxisType.Auto: XLA
    # keeps the compact tiles replicated and all-reduces the gathered active tiles
    # of g (density x the leaf, here 1/4 of it) every step; never the whole leaf.
    cases["periodic_mask_sparse_adam_tiles"] = (
      magma.periodic_mask(
        magma.sparse_adam(0.1, mode="compact", density=0.25, block=(4, 4)),
        sparsity=0.75,
        every=2,
        block=(4, 4),
      ),
      SQUARE,
    )
  return cases


MESH_AXES = {"x": 2, "y": 4}  # the ("x", "y") mesh of the 8-device runs


def tiled_parts(path, leaf):
  """``shards=`` for TILED: a leaf's shard counts along its axes (what
  magma.sharding.tile_shards reads from the sharded parameters: report "tile_shards").
  """
  del leaf
  spec = TILED[path[-1].key][1]
  return tuple(1 if e is None else MESH_AXES[e] for e in spec)


def tile_transforms():
  """Per-shard compact tile storage (shards=): every device keeps its own tiles."""
  if "shards" not in inspect.signature(magma.sparse_state).parameters:
    return {}
  kwargs = dict(mode="compact", density=0.5, block=(4, 4), shards=tiled_parts)

  def masked(inner):
    return magma.periodic_mask(
      inner, sparsity=0.5, every=2, block=(4, 4), shards=tiled_parts
    )

  # sparse_adam's storage is sparse_state's (the same classes); its tile step is
  # the part that differs (tests/sparse/test_sparse_state.py checks both on one device).
  return {
    "sharded_tiles_sparse_adam": (masked(magma.sparse_adam(0.1, **kwargs)), TILED)
  }


def tile_shards_report(mesh):
  """magma.sharding.tile_shards of TILED's sharded parameters (and a stacked leaf
  whose spec is shorter than its rank), built from the arrays and from their
  shardings alone, by leaf name."""
  layout = {**TILED, "stacked": ((2, 8, 16), P("x", "y"))}  # axes 0 and 1 split
  params = {
    n: jax.device_put(jnp.zeros(shape), NamedSharding(mesh, spec))
    for n, (shape, spec) in layout.items()
  }
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  out = {}
  for kind, tree in (
    ("arrays", params),
    ("shardings", jax.tree.map(lambda x: x.sharding, params)),
  ):
    shards = magma.sharding.tile_shards(tree)
    out[kind] = {path[-1].key: list(shards(path, x)) for path, x in leaves}
  return out


def flat_compact_error(mesh):
  """The error of unstructured compact storage on an Explicit-axis mesh (or None)."""
  tx = magma.sparse_state(optax.adam(0.1), mode="compact", density=0.5)
  sharding = NamedSharding(mesh, P(None, "y"))
  params = {"w": jax.device_put(jnp.ones((8, 16)), sharding)}
  mask = {"w": jax.device_put(jnp.arange(128).reshape(8, 16) % 2 == 0, sharding)}
  step = jax.jit(lambda p, s, m: tx.update(p, s, p, param_mask=m))
  try:
    step(params, tx.init(params), mask)
  except ValueError as e:
    return str(e)
  return None


def nm_split_groups_error(mesh):
  """The error of N:M compact storage whose groups of 4 are split over devices by
  an Explicit-axis sharding (8 devices on 8 columns), from a plain ``tx.init``."""
  tx = magma.sparse_state(optax.adam(0.1), mode="compact", structure=(2, 4))
  sharding = NamedSharding(mesh, P(None, ("x", "y")))
  params = {"w": jax.device_put(jnp.ones((16, 8)), sharding)}
  mask = {"w": jax.device_put(jnp.arange(128).reshape(16, 8) % 2 == 0, sharding)}
  try:
    jax.jit(lambda p, s, m: tx.update(p, s, p, param_mask=m))(
      params, tx.init(params), mask
    )
  except ValueError as e:
    return str(e)
  except Exception as e:  # noqa: BLE001 (the test shows it)
    return f"not a ValueError: {type(e).__name__}: {e}"
  return None


def per_case(txs):
  """One optimizer running ``txs[name]`` on ``params[name]`` (like multi_transform,
  but every transform sees its own subtree exactly as if used alone)."""

  def init_fn(params):
    return {k: tx.init(params[k]) for k, tx in txs.items()}

  def update_fn(updates, state, params=None, **extra_args):
    out_u, out_s = {}, {}
    for k, tx in txs.items():
      out_u[k], out_s[k] = tx.update(updates[k], state[k], params[k], **extra_args)
    return out_u, out_s

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def initial_params(cases):
  key = jax.random.key(0)
  return {
    case: {
      name: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
      for i, (name, (shape, _)) in enumerate(sorted(layout.items()))
    }
    for case, (_, layout) in cases.items()
  }


def loss(params):
  # Gradients change with the parameters, so masks, scores and moments all evolve.
  return sum(
    jnp.sum(jnp.sin(p) * jnp.arange(p.size, dtype=p.dtype).reshape(p.shape) / p.size)
    + 0.5 * jnp.sum(p * p)
    for p in jax.tree.leaves(params)
  )


def train_step_fn(tx):
  def step(params, state):
    grads = jax.grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def flatten(tree, prefix=""):
  """Key path -> numpy array (PRNG keys as their key data)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    out[prefix + jax.tree_util.keystr(path)] = np.asarray(leaf)
  return out


def step_masks(state):
  """The per-block masks drawn at the last step, by key path."""
  return {k: v for k, v in flatten(state).items() if ".mask[" in k}


def run(cases, steps=STEPS, shardings=None):
  """Trains ``steps`` steps on one device (``shardings=None``) or sharded.

  Returns (params, state, masks of every step, compiles per step, jitted step).
  """
  tx = per_case({k: tx for k, (tx, _) in cases.items()})
  params = initial_params(cases)
  if shardings is None:
    params = jax.device_put(params, jax.devices()[0])
    state = jax.jit(tx.init)(params)
    step = jax.jit(train_step_fn(tx))
  else:
    params = jax.device_put(params, shardings)
    state_sh = {
      k: magma.sharding.state_shardings(cases[k][0], params[k]) for k in cases
    }
    state = jax.jit(tx.init, out_shardings=state_sh)(params)  # one compile
    step = jax.jit(train_step_fn(tx), out_shardings=(shardings, state_sh))
  masks = {}
  compiles = []
  for t in range(steps):
    with count_compiles() as n:
      params, state = step(params, state)
    compiles.append(n[0])
    masks.update({f"step{t}/{k}": v for k, v in step_masks(state).items()})
  return params, state, masks, compiles, step


@contextlib.contextmanager
def count_compiles():
  """Counts XLA backend compilations inside the block (in a one-element list)."""
  n = [0]

  def listener(event, duration_secs, **kwargs):
    del duration_secs, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      n[0] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield n
  finally:
    unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
    if unregister is not None:
      unregister(listener)
    else:  # older JAX: private list
      from jax._src import monitoring

      monitoring._event_duration_secs_listeners.remove(listener)


# --- everything below runs only in the 8-device subprocess -------------------------

_COLLECTIVE = re.compile(
  r"=\s*(.*?)\s(all-gather|all-to-all|all-reduce|collective-permute|reduce-scatter)"
  r"(?:-start)?\("
)
_SHAPE = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")


def collectives(hlo_text):
  """[op, largest result size in elements] for each collective in compiled HLO."""
  out = []
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.search(line)
    if m:
      sizes = [
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for dims in _SHAPE.findall(m.group(1))
      ]
      out.append([m.group(2), max(sizes, default=1)])
  return out


def compile_counter_control():
  """Compiles counted for a fresh function called twice: must be exactly 1."""
  f, x = jax.jit(lambda x: x * 3 + 1), jnp.arange(7.0)
  with count_compiles() as n:
    f(x)
    f(x)
  return n[0]


def gathering_control(mesh):
  """Collectives of a step built to gather a sharded parameter (a full sort of it).

  The positive control of the "no parameter-sized collectives" checks: the same
  parser must find a parameter-sized all-gather here.
  """
  w = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P("x", "y")))
  hlo = jax.jit(lambda w: jnp.sort(w.reshape(-1))).lower(w).compile().as_text()
  return collectives(hlo)


def describe(x):
  s = x.sharding
  spec = list(map(str, s.spec)) if isinstance(s, NamedSharding) else type(s).__name__
  return {"spec": spec, "replicated": bool(s.is_fully_replicated), "ndim": x.ndim}


def sharded_run(name, cases, mesh, out_dir):
  shardings = {
    case: {n: NamedSharding(mesh, spec) for n, (_, spec) in layout.items()}
    for case, (_, layout) in cases.items()
  }
  params, state, masks, compiles, step = run(cases, shardings=shardings)
  with count_compiles() as n:  # the executable the steps ran: no new compile
    hlo = step.lower(params, state).compile().as_text()
  compiles.append(n[0])
  helper = {k: magma.sharding.state_shardings(cases[k][0], params[k]) for k in cases}
  np.savez(
    os.path.join(out_dir, f"{name}.npz"),
    **flatten(params, "params"),
    **flatten(state, "state"),
    **{"masks/" + k: v for k, v in masks.items()},
  )
  state_leaves = {
    k: describe(v) for k, v in zip(flatten(state), jax.tree.leaves(state), strict=True)
  }
  return {
    "collectives": collectives(hlo),
    "compiles_per_step": compiles,
    "state": state_leaves,
    "state_matches_helper": all(
      x.sharding.is_equivalent_to(s, x.ndim)
      for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(helper), strict=True)
    ),
    "params": {
      k: describe(v)
      for k, v in zip(flatten(params), jax.tree.leaves(params), strict=True)
    },
  }


def mlp_problem():
  """A two-layer MLP regression: (params, x, y, optimizer, step function)."""
  key = jax.random.key(42)
  k1, k2, k3 = jax.random.split(key, 3)
  params = {
    "w1": jax.random.normal(k1, (8, 16)) / 3,
    "w2": jax.random.normal(k2, (16, 4)) / 4,
  }
  x = jax.random.normal(k3, (16, 8))
  y = jnp.sin(x[:, :4])
  tx = magma.magma(optax.adam(0.05), key=11, granularity="row")

  def step(params, state, x, y):
    def loss_fn(p):
      return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    loss_value, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss_value

  return params, x, y, tx, step


def data_model_parallel(mesh, out_dir):
  """The MLP with its batch sharded on "x" (data parallel) and its hidden units on
  "y" (model parallel); state from magma.sharding.init."""
  params, x, y, tx, step = mlp_problem()
  p_sh = {
    "w1": NamedSharding(mesh, P(None, "y")),
    "w2": NamedSharding(mesh, P("y", None)),
  }
  params = jax.device_put(params, p_sh)
  batch = NamedSharding(mesh, P("x", None))
  x, y = jax.device_put(x, batch), jax.device_put(y, batch)
  state_sh = magma.sharding.state_shardings(tx, params)
  state = magma.sharding.init(tx, params)
  jstep = jax.jit(step, out_shardings=(p_sh, state_sh, NamedSharding(mesh, P())))
  hlo = jstep.lower(params, state, x, y).compile().as_text()
  losses, compiles = [], []
  for _ in range(STEPS):
    with count_compiles() as n:
      params, state, loss_value = jstep(params, state, x, y)
    compiles.append(n[0])
    losses.append(float(loss_value))
  np.savez(
    os.path.join(out_dir, "mlp.npz"),
    **flatten(params, "params"),
    **flatten(state, "state"),
    losses=np.array(losses),
  )
  return {
    "collectives": collectives(hlo),
    "compiles_per_step": compiles,
    "checkpoint": sharded_checkpoint(tx, params, state, out_dir),
  }


def sharded_checkpoint(tx, params, state, out_dir):
  """Saves the sharded state with orbax and restores it into abstract_state."""
  try:
    import orbax.checkpoint as ocp
  except ImportError:
    return None
  path = os.path.join(out_dir, "ckpt")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, state)
  target = magma.sharding.abstract_state(tx, params)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(path, target)
  leaves = zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True)
  same_values, same_shardings = True, True
  for got, want in leaves:
    same_shardings &= got.sharding.is_equivalent_to(want.sharding, want.ndim)
    if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
      got, want = jax.random.key_data(got), jax.random.key_data(want)
    same_values &= bool(np.array_equal(np.asarray(got), np.asarray(want)))
  return {"same_values": same_values, "same_shardings": same_shardings}


def _shard_map():
  if hasattr(jax, "shard_map"):
    return jax.shard_map, {"check_vma": False}
  from jax.experimental.shard_map import shard_map  # jax < 0.7

  return shard_map, {"check_rep": False}


def shard_map_cosine(mesh):
  """magma.sharding.block_cosine with axis_name inside shard_map vs the global one."""
  shard_map, no_check = _shard_map()
  key = jax.random.key(3)
  a = jax.random.normal(key, (16, 16))
  b = (a + jax.random.normal(jax.random.fold_in(key, 1), (16, 16))).at[:4].set(0.0)
  spec = P("x", "y")
  # granularity -> (axes that split a block, out spec, local output reshape)
  cases = {
    "tensor": (("x", "y"), P(), (1, 1)),
    "row": ("y", P("x"), (-1,)),
    "column": ("x", P("y"), (-1,)),
  }

  def both(a, b):
    out = {}
    for g, (axes, out_spec, local_shape) in cases.items():
      global_fn = shard_map(
        lambda u, v, g=g, axes=axes: magma.sharding.block_cosine(
          u, v, granularity=g, axis_name=axes
        ),
        mesh=mesh,
        in_specs=(spec, spec),
        out_specs=out_spec,
      )
      local_fn = shard_map(
        lambda u, v, g=g, s=local_shape: magma.sharding.block_cosine(
          u, v, granularity=g
        ).reshape(s),
        mesh=mesh,
        in_specs=(spec, spec),
        out_specs=spec if g == "tensor" else out_spec,
        **no_check,
      )
      out[g] = (global_fn(a, b), local_fn(a, b))
    return out

  results = jax.jit(both)(a, b)
  report = {}
  for g, (got, local) in results.items():
    want = np.asarray(magma.sharding.block_cosine(a, b, granularity=g))
    got, local = np.asarray(got), np.asarray(local)
    report[g] = {
      "err": float(np.max(np.abs(got - want))),
      "finite": bool(np.all(np.isfinite(got))),
      # Without axis_name each shard sees only its piece: a different answer.
      "local_differs": bool(
        local.shape != want.shape or np.max(np.abs(local - want)) > 1e-3
      ),
    }
  return report


def shard_map_local_steps(mesh):
  """Three steps of each transform inside a checked ``shard_map`` (every leaf split
  over both mesh axes) against the same steps on each shard alone: name -> the
  largest difference, or the error. Inside ``shard_map`` a transform sees only its
  shard (the documented, local algorithm); its loops and branches must keep their
  types there, and so must its state from ``init`` to each update: the steps run as
  a ``lax.scan`` whose carry is the state (``apply_if_finite``'s own counters change
  type there, optax's as well as ours, so it runs in a Python loop)."""
  shard_map, _ = _shard_map()
  cases = {
    "magma": magma.magma(optax.adam(0.1), key=1),
    "adam_magma": magma.adam_magma(0.1, key=2, granularity="row"),
    "alignment_mask": optax.chain(magma.alignment_mask(tau=2.0), optax.adam(0.1)),
    "periodic_mask": magma.periodic_mask(optax.adam(0.1), sparsity=0.5, every=2),
    "periodic_mask_nm_compact": magma.periodic_mask(
      magma.sparse_state(optax.adam(0.1), mode="compact", structure=(2, 4)),
      structure=(2, 4),
      every=2,
    ),
  }
  if hasattr(magma, "sparse_adam"):
    cases["periodic_mask_tiles_sparse_adam"] = magma.periodic_mask(
      magma.sparse_adam(0.1, mode="compact", density=0.5, block=(4, 4)),
      sparsity=0.5,
      every=2,
      block=(4, 4),
    )
  cases["multi_steps_magma"] = optax.MultiSteps(magma.magma(optax.adam(0.1)), 2)
  cases["multi_steps_periodic_mask_nm_compact"] = optax.MultiSteps(
    cases["periodic_mask_nm_compact"], 2
  )
  cases["inject_hyperparams_adam_magma"] = optax.inject_hyperparams(
    magma.adam_magma, static_args=("b1", "b2", "eps", "eps_root")
  )(learning_rate=0.1, key=2)
  cases["periodic_mask_masked_weight_decay"] = magma.periodic_mask(
    optax.chain(magma.masked_weight_decay(0.1, ramp_steps=2), optax.adam(0.1)),
    sparsity=0.5,
    every=2,
  )
  cases["apply_if_finite_periodic_mask"] = optax.apply_if_finite(
    magma.periodic_mask(optax.adam(0.1), sparsity=0.5, every=2), 3
  )
  key = jax.random.key(5)
  p = {"w": jax.random.normal(key, (16, 32))}
  g = {"w": jax.random.normal(jax.random.fold_in(key, 1), (16, 32))}
  spec = P("x", "y")
  rows, cols = 16 // mesh.shape["x"], 32 // mesh.shape["y"]

  def steps(tx, p, g):
    def step(carry, t):
      p, s = carry
      u, s = tx.update(jax.tree.map(lambda x: x * jnp.cos(t), g), s, p)
      return (optax.apply_updates(p, u), s), None

    s0, ts = tx.init(p), jnp.arange(3.0)
    carry = (p, s0)
    if isinstance(s0, optax.ApplyIfFiniteState):
      for t in ts:
        carry, _ = step(carry, t)
      return carry[0]
    return jax.lax.scan(step, carry, ts)[0][0]

  # A leaf replicated along x ("r", split along y only) whose shard has the shape
  # of w's: leaves stacked into one ranking (or tile storage's leaves of one tile
  # count, prepared together) must not make it vary along x.
  replicated = ("periodic_mask", "periodic_mask_nm_compact", "magma")
  if "periodic_mask_tiles_sparse_adam" in cases:
    replicated += ("periodic_mask_tiles_sparse_adam",)
  r_p = jax.random.normal(jax.random.fold_in(key, 2), (rows, 32))
  r_g = jax.random.normal(jax.random.fold_in(key, 3), (rows, 32))
  for name in replicated:
    cases[f"{name}_with_a_replicated_leaf"] = cases[name]
  # A second leaf split as w is ("t"): tile storage prepares the two together
  # inside shard_map (on each shard alone, in this 8-device process, apart).
  if "periodic_mask_tiles_sparse_adam" in cases:
    cases["periodic_mask_tiles_sparse_adam_with_a_twin_leaf"] = cases[
      "periodic_mask_tiles_sparse_adam"
    ]

  report = {}
  for name, tx in cases.items():
    tree = name.endswith("_with_a_replicated_leaf")
    p_in = {"w": p["w"], "r": r_p} if tree else p
    g_in = {"w": g["w"], "r": r_g} if tree else g
    if name.endswith("_with_a_twin_leaf"):
      p_in, g_in = {**p, "t": 0.5 * p["w"]}, {**g, "t": -g["w"]}
    specs = {k: P(None, "y") if k == "r" else spec for k in p_in}
    try:
      f = shard_map(
        functools.partial(steps, tx),
        mesh=mesh,
        in_specs=(specs, specs),
        out_specs=specs,
      )
      got = {k: np.asarray(v) for k, v in jax.jit(f)(p_in, g_in).items()}
      local = jax.jit(functools.partial(steps, tx))
      diff = 0.0
      for i in range(mesh.shape["x"]):
        for j in range(mesh.shape["y"]):
          at = {
            "w": (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols)),
            "r": (slice(None), slice(j * cols, (j + 1) * cols)),
          }
          at["t"] = at["w"]
          piece = local(
            {k: v[at[k]] for k, v in p_in.items()},
            {k: v[at[k]] for k, v in g_in.items()},
          )
          for k, v in piece.items():
            diff = max(diff, float(np.max(np.abs(got[k][at[k]] - np.asarray(v)))))
      report[name] = diff
    except Exception as e:  # noqa: BLE001 (the test shows it)
      report[name] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
  return report


def main(out_dir):
  assert jax.device_count() == 8, jax.devices()
  report = {"jax": jax.__version__, "seconds": {}}
  auto = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  t0 = time.perf_counter()

  def lap(name):
    nonlocal t0
    report["seconds"][name] = time.perf_counter() - t0
    t0 = time.perf_counter()

  report["core"] = sharded_run("core", core_transforms(), auto, out_dir)
  lap("core")
  if sparse_transforms():
    report["sparse"] = sharded_run("sparse", sparse_transforms(), auto, out_dir)
    lap("sparse")
  if tile_transforms():
    report["tiles"] = sharded_run("tiles", tile_transforms(), auto, out_dir)
    report["tile_shards"] = tile_shards_report(auto)
    lap("tiles")
  report["gathering_control"] = gathering_control(auto)
  report["compile_counter_control"] = compile_counter_control()
  report["mlp"] = data_model_parallel(auto, out_dir)
  lap("mlp")
  report["shard_map_cosine"] = shard_map_cosine(auto)
  report["shard_map_local_steps"] = shard_map_local_steps(auto)
  lap("shard_map")
  # Meshes from jax.make_mesh default to Explicit axes (sharding in types) in recent
  # JAX; the same transforms must work there too.
  explicit = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(explicit):
    every = {**core_transforms(), **sparse_transforms(), **tile_transforms()}
    cases = {k: v for k, v in every.items() if k in EXPLICIT_CASES}
    report["explicit"] = sharded_run("explicit", cases, explicit, out_dir)
    if sparse_transforms():
      report["explicit_flat_compact"] = flat_compact_error(explicit)
      report["explicit_nm_split_groups"] = nm_split_groups_error(explicit)
  lap("explicit")
  with open(os.path.join(out_dir, "report.json"), "w") as f:
    json.dump(report, f, indent=1)


def main_reference(out_dir):
  """The same runs on one device: the reference the tests compare against."""
  assert jax.device_count() == 1, jax.devices()
  for name, cases in (
    ("core", core_transforms()),
    ("sparse", sparse_transforms()),
    ("tiles", tile_transforms()),
  ):
    if not cases:
      continue
    params, state, masks, _, _ = run(cases)
    np.savez(
      os.path.join(out_dir, f"ref_{name}.npz"),
      **flatten(params, "params"),
      **flatten(state, "state"),
      **{"masks/" + k: v for k, v in masks.items()},
    )
  params, x, y, tx, step = mlp_problem()
  state = tx.init(params)
  step = jax.jit(step)
  losses = []
  for _ in range(STEPS):
    params, state, loss_value = step(params, state, x, y)
    losses.append(float(loss_value))
  np.savez(
    os.path.join(out_dir, "ref_mlp.npz"),
    **flatten(params, "params"),
    **flatten(state, "state"),
    losses=np.array(losses),
  )


if __name__ == "__main__":
  if int(sys.argv[2]) == 1:
    main_reference(sys.argv[1])
  else:
    main(sys.argv[1])
