"""Sharding: every transform on a 2x4 mesh of forced CPU devices equals one device.

The 8-device runs and the one-device reference run in two subprocesses
(tests/_sharding_worker.py, once per session). Tolerance for float
leaves (parameters, moments, scores): 2e-5 relative to max(1, |reference|) -- the
sharded run reduces per-block sums in a different order, and a few steps of Adam
amplify the f32 rounding slightly. Everything else (masks, counts, PRNG keys) must be
bitwise equal.
"""

from __future__ import annotations

import math

import _sharding_runs as runs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import magma_optax as magma
from magma_optax._core import sharded as _sharded

RTOL = 2e-5
# The smallest sharded parameter matrix has 64 entries; per-block arrays (at most 16
# entries here) may be reduced or gathered, parameter-sized arrays never.
SMALLEST_MATRIX = 64


@pytest.fixture(scope="module")
def report():
  return runs.sharded_results()[0]


def assert_trees_match(got: dict, want: dict):
  assert got.keys() == want.keys()
  assert got, "nothing to compare"
  for k in want:
    a, b = got[k], want[k]
    assert a.shape == b.shape and a.dtype == b.dtype, k
    if np.issubdtype(b.dtype, np.floating):
      scale = max(1.0, float(np.max(np.abs(b), initial=0.0)))
      err = float(np.max(np.abs(a - b), initial=0.0)) / scale
      assert err <= RTOL, f"{k}: relative error {err:.2e}"
    else:
      np.testing.assert_array_equal(a, b, err_msg=k)


@pytest.mark.parametrize("run", ["core", "explicit", "sparse", "tiles"])
def test_sharded_equals_unsharded(report, run):
  if run not in report:
    pytest.skip("the package has no periodic_mask/sparse_state")
  got = runs.sharded_arrays(run)
  assert_trees_match(got, runs.reference(run))
  # The masks really vary (a run with an all-ones mask would prove little).
  masks = [v for k, v in got.items() if k.startswith("masks/") and v.size > 1]
  assert any(not m.all() for m in masks) and any(m.any() for m in masks)


def test_covers_every_transform(report):
  names = {k.split("'")[1] for k in runs.sharded_arrays("core") if k.startswith("par")}
  assert names == set(runs.worker.core_transforms())
  for expected in ("magma", "skip_update", "bernoulli_mask", "alignment_mask"):
    assert any(n.startswith(expected) for n in names)
  assert "damping_row" in names


def test_data_and_model_parallel_mlp(report):
  got = runs.sharded_arrays("mlp")
  want = runs.reference("mlp")
  assert_trees_match(
    {k: v for k, v in got.items() if k != "losses"},
    {k: v for k, v in want.items() if k != "losses"},
  )
  np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
  assert got["losses"][-1] < got["losses"][0]


def test_sharded_checkpoint_restores_into_abstract_state(report):
  # orbax saves the 8-device state; magma.sharding.abstract_state is the target.
  result = report["mlp"]["checkpoint"]
  if result is None:
    pytest.skip("orbax-checkpoint is not installed")
  assert result == {"same_values": True, "same_shardings": True}


@pytest.mark.parametrize("run", ["core", "explicit"])
def test_state_follows_parameter_shardings(report, run):
  r = report[run]
  assert r["state_matches_helper"]
  params = r["params"]
  checked = 0
  for path, leaf in r["state"].items():
    if leaf["ndim"] == 0:  # counts, keys, active fractions
      assert leaf["replicated"], path
      continue
    case, name = path.split("'")[1], path.split("'")[-2]
    param = params.get(f"['{case}']['{name}']")
    if param is not None and leaf["ndim"] == param["ndim"] and ".mask[" not in path:
      # Moments (mu, nu, trace, own momentum) and element-wise scores.
      if "bernoulli_mask_tile" not in path:
        assert leaf["spec"] == param["spec"], path
        checked += 1
  assert checked >= {"core": 30, "explicit": 10}[run]


def _assert_the_parser_finds_a_gather(report):
  """Positive control: a step built to gather a sharded (16, 64) parameter."""
  big = [(op, n) for op, n in report["gathering_control"] if n >= SMALLEST_MATRIX]
  assert big, report["gathering_control"]


@pytest.mark.parametrize("run", ["core", "explicit", "mlp"])
def test_no_parameter_sized_collectives(report, run):
  _assert_the_parser_finds_a_gather(report)
  ops = report[run]["collectives"]
  assert any(op == "all-reduce" for op, _ in ops)  # the per-block partial sums
  big = [(op, n) for op, n in ops if n >= SMALLEST_MATRIX]
  assert not big, f"parameter-sized collectives in the compiled step: {big}"


def test_sparse_wrappers_no_parameter_sized_gathers(report):
  if "sparse" not in report:
    pytest.skip("the package has no periodic_mask/sparse_state")
  _assert_the_parser_finds_a_gather(report)
  big = [(op, n) for op, n in report["sparse"]["collectives"] if n >= SMALLEST_MATRIX]
  # Compact tile storage (periodic_mask_sparse_adam_tiles: density 0.25, 4x4 tiles
  # of the SQUARE leaves) is one replicated vector of tiles per leaf: XLA all-reduces
  # the active tiles of g it gathers, capacity * 16 entries (32 for the 8-tile
  # leaves, 64 for the 16-tile one), which is less than any of those leaves (128+).
  tile_buffers = {math.ceil(0.25 * tiles) * 16 for tiles in (8, 16)}
  big = [(op, n) for op, n in big if not (op == "all-reduce" and n in tile_buffers)]
  assert not big, big


def test_n_m_compact_state_keeps_parameter_shardings(report):
  # Grouped (N:M) compact storage shrinks the group axis by n/m; the moments and
  # the per-group bits stay sharded like their parameter.
  if "sparse" not in report:
    pytest.skip("the package has no periodic_mask/sparse_state")
  r = report["sparse"]
  assert r["state_matches_helper"]
  specs = stored_specs(r, "nm_compact")
  for path, (spec, param_spec) in specs.items():
    assert spec == param_spec, path
  assert len(specs) == 3 * 4  # mu, nu and bits of 4 leaves


def stored_specs(r, case):
  """``{path: (spec, its parameter's spec)}`` of the stored moments and bits
  (``mu``, ``nu``, ``stored_bits``) of the cases whose name contains ``case``."""
  out = {}
  for path, leaf in r["state"].items():
    if case not in path or not any(
      f".{field}[" in path for field in ("mu", "nu", "stored_bits")
    ):
      continue
    name, param = path.split("'")[1], path.split("'")[-2]
    out[path] = (leaf["spec"], r["params"][f"['{name}']['{param}']"]["spec"])
  return out


def test_per_shard_tile_storage_stays_on_its_devices(report):
  # shards= (periodic_mask's balanced masks, sparse_adam's tile storage per
  # shard): no tile crosses devices -- only scalars (the capacity check, whether a
  # stored set changed), per-part counts and a few packed mask bytes of the mask
  # statistics, fewer than the 16 entries of one 4x4 tile -- where the unsharded
  # tile storage of the "sparse" run all-reduces its gathered tiles, 2 or more per
  # leaf (the positive control: the same parser sees those).
  if "tiles" not in report:
    pytest.skip("the package has no per-shard tile storage")
  ops = report["tiles"]["collectives"]
  assert ops and all(n < 16 for _, n in ops), ops
  unsharded = [n for op, n in report["sparse"]["collectives"] if op == "all-reduce"]
  assert max(unsharded) >= 2 * 16, unsharded
  # The tile buffers (sr, sc, capacity, 4, 4) and their bits (sr, sc, bytes) are
  # sharded like the parameter's last two axes (all three for the stack of
  # experts split along its stacking axis), on Auto and on Explicit axes.
  for run, cases in (("tiles", 1), ("explicit", 1)):
    assert report[run]["state_matches_helper"]
    specs = stored_specs(report[run], "sharded_tiles")
    for path, (spec, param_spec) in specs.items():
      k = len(param_spec)
      assert spec[:k] == param_spec and set(spec[k:]) == {"None"}, path
    assert len(specs) == cases * 3 * 4  # per case mu, nu and bits of 4 leaves
    assert any(spec[0] == "y" for spec, _ in specs.values())  # the experts' axis 0
  # magma.sharding.tile_shards reads the same parts from the sharded parameters:
  # from the first split axis on.
  want = {"rows": [2, 1], "cols": [1, 4], "both": [2, 4], "experts": [4, 1, 2]}
  want["stacked"] = [2, 4, 1]
  assert report["tile_shards"] == {"arrays": want, "shardings": want}


def test_flat_compact_storage_rejects_explicit_axes_clearly(report):
  if "explicit_flat_compact" not in report:
    pytest.skip("the package has no periodic_mask/sparse_state")
  message = report["explicit_flat_compact"]
  assert message is not None and "Explicit mesh axes (['y'])" in message
  assert "structure=(n, m)" in message


def test_nm_storage_with_groups_split_over_devices_is_refused_clearly(report):
  if "explicit_nm_split_groups" not in report:
    pytest.skip("the package has no periodic_mask/sparse_state")
  message = report["explicit_nm_split_groups"]
  assert message is not None, "no ValueError"
  assert "split into 8 pieces of 1 entries, not whole groups of 4" in message


@pytest.mark.parametrize("run", ["core", "explicit", "sparse", "tiles", "mlp"])
def test_compiles_once(report, run):
  if run not in report:
    pytest.skip("the package has no periodic_mask/sparse_state")
  assert report["compile_counter_control"] == 1  # the counter does count compiles
  compiles = report[run]["compiles_per_step"]
  # The first step compiles once; the mlp step was compiled ahead (lower().compile()).
  assert compiles[0] == (0 if run == "mlp" else 1), compiles
  assert not any(compiles[1:]), compiles


def test_transforms_run_inside_shard_map_as_on_each_shard(report):
  # Loops and branches keep their carry types under shard_map's checks: before,
  # adam_magma and every periodic_mask failed there with a while_loop or cond
  # TypeError (a constant carry against a varying body). And init's state has the
  # types of the updated state: before, the lax.scan over steps, MultiSteps and
  # apply_if_finite failed (a state built from constants came back varying). A
  # leaf replicated along x stacked with one split along it came back varying.
  steps = report["shard_map_local_steps"]
  assert len(steps) >= 14, steps
  for name, diff in steps.items():
    # With the replicated leaf, the shards rank their two leaves apart and one
    # shard alone ranks them stacked; with the twin leaf, tile storage prepares
    # the two together inside shard_map and apart on one shard alone (in the
    # 8-device process): the masks agree, and XLA fuses the Adam step around
    # them differently (1-2 ulp).
    tol = 1e-6 if name.endswith(("_replicated_leaf", "_twin_leaf")) else 0.0
    assert isinstance(diff, float) and diff <= tol, (name, diff)


@pytest.mark.parametrize("granularity", ["tensor", "row", "column"])
def test_shard_map_block_cosine(report, granularity):
  r = report["shard_map_cosine"][granularity]
  assert r["finite"]
  assert r["err"] < 1e-6
  assert r["local_differs"]  # without axis_name the answer is wrong


# --- the helpers on this process's single device (abstract shapes only) ----------


def _mesh():
  return jax.make_mesh((1, 1), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _abstract(shape, spec):
  return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(_mesh(), spec))


def test_reshape_of_explicit_sharded_axes_keeps_them_on_the_major_piece():

  mesh = jax.make_mesh((1, 1), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
  x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x", "y")))
  cases = [  # new shape, the spec it gets
    ((2, 4, 8), P("x", None, "y")),  # split: the major piece keeps the axes
    ((2, 4, 2, 4), P("x", None, "y", None)),
    # Size-1 axes inserted: a mesh axis of size 1 goes to the first piece, size 1
    # or not (split_parts' part axes of count 1 keep it so).
    ((8, 1, 8, 1), P("x", "y", None, None)),
    ((1, 8, 8), P("x", None, "y")),
  ]
  for shape, spec in cases:
    y = jax.jit(lambda x, shape=shape: _sharded.reshape(x, shape))(x)
    assert jax.typeof(y).sharding.spec == spec, shape
    np.testing.assert_array_equal(np.asarray(y), np.arange(64.0).reshape(shape))
    back = jax.jit(lambda y: _sharded.reshape(y, (8, 8)))(y)  # merge: the major's
    assert jax.typeof(back).sharding.spec == P("x", "y")
  assert _sharded.reshape(jnp.ones((2, 6)), (3, 4)).shape == (3, 4)  # unsharded


def test_tile_shards_reads_the_split_axes():
  # On one device every count is 1 (the 8-device run checks real counts:
  # test_per_shard_tile_storage_stays_on_its_devices).
  params = {
    "a": _abstract((2, 8, 16), P("x", "y")),  # a leading axis and axis -2 split
    "b": _abstract((8, 16), P("x")),
    "c": _abstract((16,), P("y")),
  }
  # A (1, 1) mesh: counts from the first axis the spec names.
  want = {"['a']": (1, 1, 1), "['b']": (1, 1), "['c']": None}
  from_arrays = magma.sharding.tile_shards(params)
  shardings = jax.tree.map(lambda x: x.sharding, params)
  from_shardings = magma.sharding.tile_shards(shardings)
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = jax.tree_util.keystr(path)
    assert from_arrays(path, x) == want[name], name
    assert from_arrays(path, None) == want[name], name
    # A sharding alone has no rank: P("x", "y") of the 3-D leaf "a" is of its
    # axes 0 and 1, which the leaf passed in tells.
    assert from_shardings(path, x) == want[name], name
  path_a = jax.tree_util.tree_flatten_with_path(params)[0][0][0]
  with pytest.raises(ValueError, match="do not say the rank"):
    from_shardings(path_a, None)
  with pytest.raises(ValueError, match=r"no parameter at path \['z'\]"):
    from_arrays((jax.tree_util.DictKey("z"),), None)
  with pytest.raises(ValueError, match="carry a sharding"):
    magma.sharding.tile_shards({"w": 1.0})


@pytest.mark.parametrize(
  "granularity, stack_axes, shape, spec, want",
  [
    ("tensor", 0, (16, 8), P("x", "y"), P()),
    ("row", 0, (16, 8), P("x", "y"), P("x")),
    ("column", 0, (16, 8), P("x", "y"), P("y")),
    ("element", 0, (16, 8), P("x", "y"), P("x", "y")),
    ((4, 4), 0, (16, 8), P("x", "y"), P("x", "y")),
    ("tensor", 1, (4, 16, 8), P("x", None, "y"), P("x")),
    ("row", 1, (4, 16, 8), P(None, "x", "y"), P(None, "x")),
    ("column", 1, (4, 16, 8), P(None, "x", "y"), P(None, "y")),
    # A square matrix: the shape cannot tell row from column blocks; the layout
    # the transform declared does.
    ("row", 0, (8, 8), P("x", "y"), P("x")),
    ("column", 0, (8, 8), P("x", "y"), P("y")),
  ],
)
def test_state_shardings_of_block_arrays(granularity, stack_axes, shape, spec, want):
  tx = magma.magma(optax.adam(1e-3), granularity=granularity, stack_axes=stack_axes)
  params = {"w": _abstract(shape, spec)}
  shardings = magma.sharding.state_shardings(tx, params)
  assert shardings.inner_state[0].mu["w"].spec == spec
  assert shardings.mask_state.scores["w"].spec == want
  assert shardings.mask_state.mask["w"].spec == want
  assert shardings.mask_state.count.spec == P()
  assert shardings.mask_state.key.spec == P()
  # The same shardings come with abstract_state, the checkpoint restore target.
  abstract = magma.sharding.abstract_state(tx, params)
  assert abstract.mask_state.scores["w"].sharding.spec == want
  assert (
    abstract.mask_state.key.dtype
    == jax.eval_shape(tx.init, params).mask_state.key.dtype
  )


def test_conflicting_declared_layouts_replicate():
  # Row blocks in one transform and column blocks in another give (8,) arrays for
  # the same (8, 8) parameter: each keeps its own declared axes only if the layouts
  # agree, so here both are replicated (correct, and small).
  tx = optax.chain(
    magma.bernoulli_mask(0.5, granularity="row"),
    magma.bernoulli_mask(0.5, granularity="column"),
  )
  params = {"w": _abstract((8, 8), P("x", "y"))}
  shardings = magma.sharding.state_shardings(tx, params)
  assert shardings[0].mask["w"].spec == P()
  assert shardings[1].mask["w"].spec == P()
  # Positive control: the same chain with one granularity keeps the row axis.
  tx = optax.chain(magma.bernoulli_mask(0.5, granularity="row"), magma.damping(0.1))
  assert magma.sharding.state_shardings(tx, params)[0].mask["w"].spec == P("x")


def test_state_shardings_of_n_m_compact_storage():
  # 3:8 along the columns: stored moments (8, 6) and bits (8, 2) of an (8, 16)
  # parameter keep its partition spec (6 does not divide 16).
  tx = magma.sparse_state(optax.adam(1e-3), mode="compact", structure=(3, 8))
  params = {"w": _abstract((8, 16), P("x", "y"))}
  shardings = magma.sharding.state_shardings(tx, params)
  assert jax.eval_shape(tx.init, params).base_state[0].mu["w"].shape == (8, 6)
  assert shardings.base_state[0].mu["w"].spec == P("x", "y")
  assert shardings.stored_bits["w"].spec == P("x", "y")


def test_state_shardings_with_masked_leaves_and_chains():
  params = {"w": _abstract((8, 4), P("x")), "b": _abstract((4,), P())}
  tx = optax.chain(
    optax.adam(1e-3),
    magma.bernoulli_mask(0.5, where=lambda path, x: x.ndim == 2),
  )
  shardings = magma.sharding.state_shardings(tx, params)
  assert shardings[0][0].mu["w"].spec == P("x")
  assert isinstance(shardings[1].mask["b"], optax.MaskedNode)
  state = jax.jit(tx.init, out_shardings=shardings)(
    jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), params)
  )
  assert state[0][0].mu["w"].sharding.spec == P("x")


def test_single_device_params_without_mesh():
  params = {"w": jnp.ones((4, 3))}  # SingleDeviceSharding
  tx = magma.skip_update(optax.sgd(0.1), granularity="row")
  state = magma.sharding.init(tx, params)
  assert state.mask_state.mask["w"].shape == (4,)


def test_errors_name_the_problem():
  tx = magma.magma(optax.adam(1e-3))
  with pytest.raises(ValueError, match="carry a sharding"):
    magma.sharding.state_shardings(tx, {"w": np.ones((2, 2), np.float32)})
  with pytest.raises(ValueError, match="one shape"):
    magma.sharding.block_cosine(jnp.ones((2, 3)), jnp.ones((3, 2)))
  with pytest.raises(ValueError, match="granularity"):
    magma.sharding.block_cosine(jnp.ones(3), jnp.ones(3), granularity="rows")


def test_block_cosine_matches_numpy():
  rng = np.random.default_rng(0)
  a = rng.normal(size=(3, 5)).astype(np.float32)
  b = rng.normal(size=(3, 5)).astype(np.float32)
  b[1] = 0.0
  got = np.asarray(
    magma.sharding.block_cosine(jnp.asarray(a), jnp.asarray(b), granularity="row")
  )
  norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
  want = np.where(norms > 0, (a * b).sum(1) / np.where(norms > 0, norms, 1), 0.0)
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert got[1] == 0.0


def test_state_shardings_inside_multi_transform():
  # optax.multi_transform hands each group a tree in which the other group is an
  # optax.MaskedNode; the group's moments and masks still follow the parameters.
  params = {
    "body": {"w": _abstract((16, 8), P("x", "y"))},
    "head": {"w": _abstract((8, 16), P("y", "x"))},
  }
  tx = optax.multi_transform(
    {"m": magma.magma(optax.adam(1e-3), granularity="row"), "p": optax.adam(1e-3)},
    {"body": "m", "head": "p"},
  )
  shardings = magma.sharding.state_shardings(tx, params)
  inner = shardings.inner_states["m"].inner_state
  assert inner.inner_state[0].mu["body"]["w"].spec == P("x", "y")
  assert inner.mask_state.scores["body"]["w"].spec == P("x")
  plain = shardings.inner_states["p"].inner_state
  assert plain[0].nu["head"]["w"].spec == P("y", "x")
