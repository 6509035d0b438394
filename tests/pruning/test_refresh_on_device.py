"""periodic_mask's refresh on a GPU or TPU: no host sync inside it, the same masks.

A GPU runs a data-dependent ``while`` or ``case`` by reading its predicate back to
the host. Lowered for CUDA (and TPU) on this CPU, the refresh step must hold no such
op but its gate; its search (:mod:`magma_optax.pruning.radix_select`) has loops of
constant trip count only. The positive control is the same step lowered for the CPU,
whose search keeps its data-dependent loops. The device form, forced on this CPU,
must find exactly the masks of a numpy top-k (score desc, then active, then the
lower flat index), also on leaves sharded over 8 devices, which it never gathers.
"""

import _eight_devices
import _hlo
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma
from magma_optax.pruning import periodic
from magma_optax.pruning import radix_select
from magma_optax.pruning import topk

PARAMS = {
  "a": jnp.ones((64, 48)),
  "b": jnp.ones((64, 48)),  # a's shape: ranked as rows of one stack
  "bias": jnp.ones(48),
  "stack": jnp.ones((2, 32, 16)),
}
MATRICES = lambda path, x: x.ndim >= 2  # noqa: E731
RAMP = magma.linear_sparsity_schedule(
  0.5, begin_step=0, end_step=100, initial_sparsity=0.1
)
CASES = {
  "per_leaf": dict(sparsity=0.5),
  "global": dict(sparsity=0.5, ranking="global"),
  "ramp": dict(sparsity=RAMP),
  "ramp_global": dict(sparsity=RAMP, ranking="global"),
  "n_m": dict(structure=(2, 4)),
  "tiles": dict(sparsity=0.5, block=(4, 8), where=MATRICES),
  "tiles_global": dict(sparsity=0.5, block=(4, 8), ranking="global", where=MATRICES),
  "tiles_ramp": dict(sparsity=RAMP, block=(4, 8), where=MATRICES),
  "tiles_shards": dict(sparsity=0.5, block=(4, 8), shards=(2, 2), where=MATRICES),
}


def _refresh_step(**kwargs):
  tx = magma.periodic_mask(optax.adam(1e-3), every=100, **kwargs)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step, (PARAMS, tx.init(PARAMS), PARAMS)


def _lowered(fn, *args, platform="cuda"):
  """``fn`` lowered for ``platform`` (no Pallas kernel here: no abstract GPU mesh,
  under which jax 0.12 cannot evaluate periodic_mask's first target at trace
  time)."""
  traced = jax.jit(fn).trace(*args)
  return traced.lower(lowering_platforms=(platform,)).as_text()


def _loops(text):
  return text.count("stablehlo.while(")


@pytest.mark.parametrize("name", sorted(CASES))
def test_refresh_step_for_a_device_has_no_data_dependent_control_flow_but_its_gate(
  name,
):
  step, args = _refresh_step(**CASES[name])
  cuda = _lowered(step, *args)
  # The refresh gate (one branch around the whole step: refresh or not) and
  # nothing inside it.
  assert _hlo.data_dependent_control_flow(cuda) == {"while": 0, "case": 1, "if": 0}
  if name != "n_m":  # the search's two loops are there, with constant trip counts
    assert _loops(cuda) == 2
  # Positive control: XLA:CPU keeps its search's loops and branches (and the loop
  # that resets regrown moments only when an entry regrew), which the same count
  # sees inside the gate.
  cpu = _hlo.data_dependent_control_flow(_lowered(step, *args, platform="cpu"))
  assert cpu["while"] > 1
  if name != "n_m":
    assert cpu["while"] + cpu["case"] > 4


@pytest.mark.parametrize("name", ["per_leaf", "tiles_global"])
def test_refresh_step_for_a_tpu_has_no_data_dependent_control_flow_but_its_gate(name):
  step, args = _refresh_step(**CASES[name])
  tpu = _hlo.data_dependent_control_flow(_lowered(step, *args, platform="tpu"))
  assert tpu == {"while": 0, "case": 1, "if": 0}


def test_the_search_alone_has_none():
  s, a = jnp.ones((3, 64, 48)), jnp.ones((3, 64, 48), bool)
  k = jnp.int32(100)

  def rows(s, a, k):
    return radix_select.top_k([s, s[0, 0]], [a, a[0, 0]], [k, k], [1, 0])

  def joint(s, a, k):
    return radix_select.top_k([s, s[0, 0]], [a, a[0, 0]], [k], [1, 0], joint=True)

  for fn in (rows, joint):
    text = _lowered(fn, s, a, k)
    assert _hlo.data_dependent_control_flow(text) == {"while": 0, "case": 0, "if": 0}
    assert _loops(text) == 2
  # Positive control: XLA:CPU's search, lowered for CUDA, branches on the data.
  cpu_form = _lowered(lambda s, a, k: topk.top_k_masks([s], [a], k), s, a, k)
  assert _hlo.data_dependent_control_flow(cpu_form)["while"] >= 1


def test_the_count_reads_loops_nested_in_counted_loops():
  # Counted loops written inline (fori_loop bodies are outlined into calls): one
  # inside another is not data-dependent, a while_loop on the data inside one is
  # (the positive control). (The inner loop's own `} do {` once ended the outer
  # body early, which then read as a loop of unknown trip count.)
  def counted(n, body, x):
    return jax.lax.while_loop(
      lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[1])), (0, x)
    )[1]

  def on_data(y):
    return jax.lax.while_loop(lambda z: z.sum() < 10.0, lambda z: z * 2.0, y)

  def count(inner):
    text = _lowered(lambda x: counted(4, inner, x), jnp.ones(3))
    return _hlo.data_dependent_control_flow(text)

  assert count(lambda y: counted(3, lambda z: z * 2.0, y))["while"] == 0
  assert count(on_data)["while"] == 1


def test_rankings_past_one_search_keep_the_cpu_form(monkeypatch):
  # More units ranked together than a search's tie index holds: the device form
  # falls back to XLA:CPU's search (its loops show inside the gate), rather than
  # fail or rank wrongly.
  step, args = _refresh_step(sparsity=0.5, ranking="global")
  monkeypatch.setattr(radix_select, "MAX_ENTRIES", 1000)  # the tree has 7216 units
  counts = _hlo.data_dependent_control_flow(_lowered(step, *args))
  assert counts["while"] > 1


def np_top_k(score, active, k):
  """Reference: the k best of score desc, then active first, then low flat index."""
  s = np.asarray(score, np.float32).ravel()
  a = np.asarray(active).ravel()
  order = np.lexsort((np.arange(s.size), ~a, -s))
  out = np.zeros(s.size, bool)
  out[order[:k]] = True
  return out.reshape(np.shape(score))


def _ranked(x):
  """Scores as the refresh ranks them (NaN last, -0.0 tied with +0.0)."""
  return topk.ranked_scores(jnp.asarray(x, jnp.float32))


# NaN ranks last (as -inf), -0.0 ties +0.0; the rest is a ladder with heavy ties.
VALUES = np.array([np.nan, -np.inf, -1.5, -0.0, 0.0, 1e-30, 2.0, np.inf], np.float32)


def _cases(rng, shape):
  n = int(np.prod(shape))
  yield "ties, NaN, signed zeros", rng.choice(VALUES, size=shape)
  yield "all equal", np.full(shape, 0.5, np.float32)
  yield "all zero, signed", rng.choice(np.float32([0.0, -0.0]), size=shape)
  yield "distinct", rng.permutation(n).reshape(shape).astype(np.float32)
  yield "continuous", rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape", [(1,), (7,), (5, 9), (2, 3, 4)])
def test_device_top_k_of_one_leaf_matches_numpy(shape):
  rng = np.random.default_rng(sum(shape))
  top_k = jax.jit(lambda s, a, k: radix_select.top_k([_ranked(s)], [a], [k])[0])
  n = int(np.prod(shape))
  for name, score in _cases(rng, shape):
    active = rng.random(shape) < 0.5
    for k in sorted({0, 1, n // 2, n - 1, n}):
      got = np.asarray(top_k(score, active, k))
      want = np_top_k(np.asarray(_ranked(score)), active, k)
      np.testing.assert_array_equal(got, want, err_msg=f"{name}, k={k}")


def test_device_top_k_per_row_of_stacks_and_parts_matches_numpy():
  # Per row: a stack of 3 leaves (one k for all), and parts over two lead axes
  # (a k per part).
  rng = np.random.default_rng(3)
  stack = rng.choice(VALUES, size=(3, 6, 5))
  parts = rng.choice(VALUES, size=(2, 2, 4, 3))
  a1, a2 = rng.random(stack.shape) < 0.5, rng.random(parts.shape) < 0.3
  k_parts = np.array([[0, 12], [5, 7]], np.int32)

  @jax.jit
  def top_k(k):
    return radix_select.top_k(
      [_ranked(stack), _ranked(parts)], [a1, a2], [k, k_parts], [1, 2]
    )

  for k in (0, 1, 13, 29, 30):
    got_stack, got_parts = (np.asarray(x) for x in top_k(k))
    for r in range(3):
      want = np_top_k(np.asarray(_ranked(stack[r])), a1[r], k)
      np.testing.assert_array_equal(got_stack[r], want, err_msg=f"row {r}, k={k}")
    for i in np.ndindex(2, 2):
      want = np_top_k(np.asarray(_ranked(parts[i])), a2[i], int(k_parts[i]))
      np.testing.assert_array_equal(got_parts[i], want, err_msg=f"part {i}")


def test_device_top_k_over_several_leaves_follows_their_order():
  # One top-k over leaves L0 (4, 6), L1 (5,), L2 (4, 6) in that order; L0 and L2
  # are ranked as the rows of one stack, apart in the order.
  rng = np.random.default_rng(4)
  leaves = [rng.choice(VALUES, size=s) for s in ((4, 6), (5,), (4, 6))]
  actives = [rng.random(x.shape) < 0.5 for x in leaves]
  ranked = [np.asarray(_ranked(x)) for x in leaves]
  flat_s = np.concatenate([x.ravel() for x in ranked])
  flat_a = np.concatenate([x.ravel() for x in actives])

  @jax.jit
  def top_k(k):
    return radix_select.top_k(
      [jnp.stack([ranked[0], ranked[2]]), ranked[1]],
      [jnp.stack([actives[0], actives[2]]), actives[1]],
      [k],
      [1, 0],
      joint=True,
      row_offsets=[[0, 29], [24]],
    )

  for k in range(flat_s.size + 1):
    stacked, middle = (np.asarray(x) for x in top_k(k))
    got = np.concatenate([stacked[0].ravel(), middle, stacked[1].ravel()])
    np.testing.assert_array_equal(got, np_top_k(flat_s, flat_a, k), err_msg=str(k))


SHARDED = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import magma_optax as magma
from magma_optax.pruning import periodic

specs = {
  "rows": ((64, 32), P("x", None)),
  "cols": ((32, 64), P(None, "y")),
  "both": ((64, 64), P("x", "y")),
  "stack": ((4, 32, 64), P(None, "x", "y")),
  "bias": ((64,), P("y")),
}
def tree(seed):
  return {k: jax.random.normal(jax.random.key(seed + i), s)
          for i, (k, (s, _)) in enumerate(specs.items())}
# Heavy ties: scores |W| |g| on a grid of a few values, so the cuts split ties.
params = jax.tree.map(lambda x: jnp.round(2 * x) / 2, tree(0))
grads = jax.tree.map(lambda x: jnp.round(2 * x) / 2, tree(10))
square = lambda path, x: x.ndim >= 2
cases = {
  "per_leaf": dict(sparsity=0.6),
  "global": dict(sparsity=0.6, ranking="global"),
  "tiles_shards": dict(sparsity=0.5, block=(4, 8), shards=(2, 4), where=square),
}
cpu_form = periodic._per_backend
device_form = lambda refresh, *ops: refresh(*ops, device=True)
MOVED = r"=\s*(\S+)\s(?:all-gather|all-to-all|collective-permute)(?:-start)?\("

def masks_after_two_refreshes(kw, choose, shard=None):
  periodic._per_backend = choose
  tx = magma.periodic_mask(optax.sgd(0.1), every=1, **kw)
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  p, g = params, grads
  if shard is not None:
    p, g = jax.device_put(params, shard), jax.device_put(grads, shard)
  s = tx.init(p)
  # One compile: the compiled step runs both refreshes, its HLO is read.
  f = jax.jit(step).lower(p, s, g).compile()
  for _ in range(2):  # a refresh, then one from that mask
    p, s = f(p, s, g)
  return s.mask, f.as_text()

out = {"devices": jax.device_count()}
# The one-device masks of XLA:CPU's form, once per case.
want = {name: masks_after_two_refreshes(kw, cpu_form)[0] for name, kw in cases.items()}
# Each case on one kind of mesh axes, shards= on both (few compiles).
runs = {"Auto": ("global", "tiles_shards"), "Explicit": ("per_leaf", "tiles_shards")}
for types, names in runs.items():
  axis_type = getattr(jax.sharding.AxisType, types)
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(axis_type,) * 2)
  shard = {k: NamedSharding(mesh, sp) for k, (_, sp) in specs.items()}
  for name in names:
    kw = cases[name]
    got, hlo = masks_after_two_refreshes(kw, device_form, shard)
    pruned = [k for k in specs if kw.get("where") is None or len(specs[k][0]) >= 2]
    out[f"{types}/{name}"] = {
      "equal": all(np.array_equal(want[name][k], got[k]) for k in specs),
      "some_pruned": all(0 < got[k].sum() < got[k].size for k in pruned),
      "moved": re.findall(MOVED, hlo),
      "all_reduces": len(re.findall(r"all-reduce(?:-start)?\(", hlo)),
    }
# Positive control for the search above: a step built to gather a sharded leaf.
w = jax.device_put(params["both"], shard["both"])
gather = jax.jit(lambda w: 2 * w, out_shardings=NamedSharding(mesh, P()))
out["control"] = re.findall(MOVED, gather.lower(w).compile().as_text())
print(json.dumps(out))
"""


def _elements(hlo_type):
  dims = hlo_type[hlo_type.index("[") + 1 : hlo_type.index("]")]
  return int(np.prod([int(d) for d in dims.split(",") if d]))


def test_device_form_on_sharded_leaves_equals_one_device_and_gathers_nothing():
  out = _eight_devices.run(SHARDED)
  assert out.pop("devices") == 8
  smallest = 64  # entries of the smallest sharded leaf
  # The count sees a gathered leaf where one is built.
  assert any(_elements(t) >= smallest for t in out.pop("control"))
  assert len(out) == 4
  for name, run in out.items():
    assert run["equal"] and run["some_pruned"], name
    # Counts are all-reduced; no leaf-sized array moves between devices.
    assert not [t for t in run["moved"] if _elements(t) >= smallest], (name, run)
    assert run["all_reduces"] >= 1, name


def _mixed_tree(seed):
  """A scalar, a zero-size, a bfloat16, a complex and three float32 leaves (two of
  one shape: stacked), on a coarse grid (ties), with NaN, +-inf and -0.0."""
  rng = np.random.default_rng(seed)
  grid = lambda shape: np.round(2 * rng.standard_normal(shape)) / 2  # noqa: E731
  w = grid((8, 16)).astype(np.float32)
  w.ravel()[rng.permutation(w.size)[:8]] = np.repeat(VALUES[[0, 1, 3, 7]], 2)
  return {
    "scalar": jnp.float32(grid(())),
    "empty": jnp.zeros((0, 8)),
    "half": jnp.asarray(grid((8, 16)), jnp.bfloat16),
    "complex": jnp.asarray(grid((8, 16)) + 1j * grid((8, 16)), jnp.complex64),
    "w": jnp.asarray(w),
    "w2": jnp.asarray(grid((8, 16)), jnp.float32),
    "v": jnp.asarray(grid((16,)), jnp.float32),
  }


RAMP3 = magma.linear_sparsity_schedule(
  0.7, begin_step=0, end_step=3, initial_sparsity=0.2
)
GRAD = lambda p, g: jnp.abs(g)  # noqa: E731  (pruned weights regrow)
# (inner optimizer, periodic_mask's arguments)
FORMS_CASES = {
  "per_leaf": ("sgd", dict(sparsity=0.5)),
  "ramp_global": ("sgd", dict(sparsity=RAMP3, ranking="global", importance=GRAD)),
  # More units than one search ranks (made few below): XLA:CPU's form runs.
  "global_past_one_search": (
    "sgd",
    dict(sparsity=0.5, ranking="global", importance=GRAD),
  ),
  "n_m": ("sgd", dict(structure=(2, 4), where=lambda path, x: x.ndim >= 1)),
  "tiles_ramp_global": (
    "sgd",
    dict(
      sparsity=RAMP3, block=(2, 4), ranking="global", importance=GRAD, where=MATRICES
    ),
  ),
  "tiles_shards": (
    "sgd",
    dict(sparsity=0.5, block=(2, 4), shards=(2, 2), importance=GRAD, where=MATRICES),
  ),
}


def _np_reference(params, grads, old, sparsity, ranking, importance):
  """An unstructured refresh's masks: scores ``|W| |g|`` (``importance=GRAD``:
  ``|g|``) of the magnitudes jax computes (float32, NaN last, -0.0 as +0.0), ranked
  by numpy; the scalar and nonempty leaves in the tree's order."""
  names = [k for k in sorted(params) if params[k].size]
  scores = []
  for k in names:
    p, g = (np.abs(np.asarray(jnp.abs(x[k]), np.float32)) for x in (params, grads))
    with np.errstate(invalid="ignore"):  # inf * 0: NaN, ranked last
      s = g if importance is GRAD else p * g
    scores.append(np.where(np.isnan(s), -np.inf, s) + np.float32(0.0))
  actives = [np.asarray(old[k]) for k in names]

  def keep(n):
    return n - int(np.round(np.float32(sparsity) * n))

  if ranking == "global":
    flat = np.concatenate([s.ravel() for s in scores])
    m = np_top_k(flat, np.concatenate([a.ravel() for a in actives]), keep(flat.size))
    bounds = np.cumsum([0] + [s.size for s in scores])
    return {
      k: m[a:b].reshape(s.shape)
      for k, s, a, b in zip(names, scores, bounds[:-1], bounds[1:], strict=True)
    }
  return {
    k: np_top_k(s, a, keep(s.size))
    for k, s, a in zip(names, scores, actives, strict=True)
  }


@pytest.mark.parametrize("name", sorted(FORMS_CASES))
def test_device_form_equals_the_cpu_form_on_every_kind_of_leaf(name, monkeypatch):
  # Three refreshes (every=1) on the mixed tree, a new gradient each step, in both
  # forms of the refresh: the same masks, regrown counts, sparsity and parameters.
  # Unstructured: also numpy's top-k of the same scores, exactly.
  inner, kw = FORMS_CASES[name]
  if name == "global_past_one_search":
    monkeypatch.setattr(radix_select, "MAX_ENTRIES", 100)
  params = _mixed_tree(0)
  grads = [_mixed_tree(1 + t) for t in range(3)]
  device_calls = []

  def device_form(refresh, *ops):
    device_calls.append(1)
    return refresh(*ops, device=True)

  runs = {}
  for form in ("cpu", "device"):
    if form == "device":
      monkeypatch.setattr(periodic, "_per_backend", device_form)
    tx = magma.periodic_mask(getattr(optax, inner)(0.5), every=1, **kw)

    @jax.jit
    def step(p, s, g, tx=tx):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    p, s, records = params, tx.init(params), []
    for g in grads:
      old = s.mask
      new_p, s = step(p, s, g)
      records.append((p, g, old, s))
      p = new_p
    runs[form] = records, p
  assert device_calls  # the device form ran
  regrown = 0
  (cpu_runs, cpu_params), (dev_runs, dev_params) = runs["cpu"], runs["device"]
  for k in params:  # NaN where a NaN gradient reached a kept weight
    np.testing.assert_array_equal(dev_params[k], cpu_params[k], err_msg=k)
  for (p, g, old, cpu), (_, _, _, dev) in zip(cpu_runs, dev_runs, strict=True):
    for k in params:
      np.testing.assert_array_equal(dev.mask[k], cpu.mask[k], err_msg=k)
    assert int(dev.num_regrown) == int(cpu.num_regrown)
    assert float(dev.sparsity) == float(cpu.sparsity)
    regrown += int(cpu.num_regrown)
    if "structure" in kw or "block" in kw:
      continue
    want = _np_reference(
      p, g, old, float(cpu.target_sparsity), kw.get("ranking"), kw.get("importance")
    )
    for k, m in want.items():
      np.testing.assert_array_equal(dev.mask[k], m, err_msg=k)
  if kw.get("importance") is GRAD:
    assert regrown > 0  # the counts were tested on a refresh that regrows
