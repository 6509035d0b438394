"""Tests for magma_optax.sparse_state: skip, compact and offload storage."""

import contextlib
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo import entry_copies
from algorithm1 import shard_parts
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import magma_optax as magma
from magma_optax._core import sharded as _sharded
from magma_optax.sparse import indices as _indices
from magma_optax.sparse import step as _step
from magma_optax.sparse import storage as _storage
from magma_optax.sparse.tiles import Tiles

B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 0.05


def tree(seed, shapes):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {
    f"p{i}": jax.random.normal(k, s)
    for i, (k, s) in enumerate(zip(keys, shapes, strict=True))
  }


def np_masked_adam(grads, masks):
  """Reference masked-moment Adam: inactive entries keep moments, update zero."""
  mu = np.zeros_like(grads[0])
  nu = np.zeros_like(grads[0])
  out = []
  for t, (g, m) in enumerate(zip(grads, masks, strict=True), start=1):
    mu = np.where(m, B1 * mu + (1 - B1) * g, mu)
    nu = np.where(m, B2 * nu + (1 - B2) * g * g, nu)
    mhat, vhat = mu / (1 - B1**t), nu / (1 - B2**t)
    out.append((np.where(m, -LR * mhat / (np.sqrt(vhat) + EPS), 0.0), mu, nu))
  return out


@pytest.mark.parametrize("mode", ["skip", "offload"])
def test_skip_matches_numpy_masked_moments(mode):
  shape = (3, 4)
  rng = np.random.default_rng(0)
  grads = [rng.normal(size=shape).astype(np.float32) for _ in range(4)]
  masks = [rng.random(shape) < 0.5 for _ in range(4)]
  tx = magma.sparse_state(optax.adam(LR, b1=B1, b2=B2, eps=EPS), mode=mode)
  params = {"w": jnp.zeros(shape)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  for (u_ref, mu_ref, nu_ref), g, m in zip(
    np_masked_adam(grads, masks), grads, masks, strict=True
  ):
    u, state = step({"w": g}, state, params, param_mask={"w": m})
    np.testing.assert_allclose(np.asarray(u["w"]), u_ref, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(state.base_state[0].mu["w"]), mu_ref, 1e-5)
    np.testing.assert_allclose(np.asarray(state.base_state[0].nu["w"]), nu_ref, 1e-5)
  assert step._cache_size() == 1


def test_no_mask_equals_base():
  params = tree(0, [(3, 4)])
  grads = tree(1, [(3, 4)])
  tx = magma.sparse_state(optax.adam(LR), mode="skip")
  u, _ = tx.update(grads, tx.init(params), params)
  v, _ = optax.adam(LR).update(grads, optax.adam(LR).init(params), params)
  np.testing.assert_array_equal(np.asarray(u["p0"]), np.asarray(v["p0"]))


@pytest.fixture(scope="module")
def mode_runs():
  """periodic_mask(sparse_state(base, mode)) for every mode, with regrowth."""
  shapes = [(8, 8), (2, 2, 4, 4)]
  runs = {}
  for base_name, make_base, names in [
    ("adam", lambda: optax.adam(LR), ("mu", "nu")),
    ("sgdm", lambda: optax.sgd(LR, momentum=0.9), ("trace",)),
    # States that do not start from zero: regrown entries restart from the
    # base's initial state in both storages (Adagrad's 0.1, RMSProp's 1.0).
    ("adagrad", lambda: optax.adagrad(LR), ("sum_of_squares",)),
    ("rmsprop", lambda: optax.rmsprop(LR, initial_scale=1.0), ("nu",)),
  ]:
    for mode in ["skip", "compact"]:
      inner = magma.sparse_state(
        make_base(), mode=mode, density=0.25 if mode == "compact" else None
      )
      tx = magma.periodic_mask(
        inner,
        sparsity=0.75,
        every=2,
        importance=lambda p, g: jnp.abs(g),
        moment_names=names,
      )
      params = tree(2, shapes)
      state = tx.init(params)
      step = jax.jit(tx.update)
      history, regrown = [], 0
      for t in range(7):
        updates, state = step(tree(10 + t, shapes), state, params)
        params = optax.apply_updates(params, updates)
        regrown += int(state.num_regrown)
        history.append(params)
      runs[base_name, mode] = (history, state, step, regrown)
  return runs


@pytest.mark.parametrize("base_name", ["adam", "sgdm", "adagrad", "rmsprop"])
def test_compact_equals_skip(mode_runs, base_name):
  skip_hist, _, _, regrown = mode_runs[base_name, "skip"]
  compact_hist, state, step, _ = mode_runs[base_name, "compact"]
  assert regrown > 0  # the comparison covers regrowth
  for a, b in zip(skip_hist, compact_hist, strict=True):
    for k in a:
      np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), atol=1e-6)
  assert step._cache_size() == 1


# Every compact storage of a (4, 8) leaf: flat, N:M, tiles, offloaded tiles.
COMPACT_STORAGES = pytest.mark.parametrize(
  "storage",
  [
    dict(mode="compact", density=0.25),
    dict(mode="compact", structure=(1, 4)),
    dict(mode="compact", density=0.5, block=(1, 4)),
    dict(mode="offload", density=0.5, block=(1, 4)),
  ],
  ids=["flat", "n:m", "tiles", "offload-tiles"],
)


@COMPACT_STORAGES
@pytest.mark.parametrize(
  "make_base",
  [lambda: optax.adagrad(1.0), lambda: optax.yogi(1.0), lambda: optax.adam(1.0)],
  ids=["adagrad", "yogi", "adam"],
)
def test_compact_entries_start_from_the_base_initial_state(storage, make_base):
  # A fixed mask (nothing regrows): the first step stores its entries anew, and
  # they must start from the base's init (Adagrad's 0.1, Yogi's 1e-6), as the
  # plain base and skip storage do. They started from 0: Adagrad's first update
  # was -1.0 instead of -0.30.
  params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32)}
  if "block" in storage:
    mask = np.zeros((4, 8), bool)
    mask[:2, :4] = True  # two of the eight 1x4 tiles
  else:
    mask = np.arange(32).reshape(4, 8) % 4 == 0  # 1 in every 4 along rows
  g = {"w": jnp.full((4, 8), 0.1)}
  base = make_base()
  want, _ = base.update(g, base.init(params), params)
  for kw in (storage, dict(mode="skip")):
    tx = magma.sparse_state(make_base(), **kw)
    state = tx.init(params)
    for step in range(2):
      u, state = tx.update(g, state, params, param_mask={"w": jnp.asarray(mask)})
      if step == 0:
        np.testing.assert_allclose(u["w"][mask], want["w"][mask], rtol=1e-6)
        np.testing.assert_array_equal(u["w"][~mask], 0.0)
    if kw is storage:
      got2 = u
    else:
      np.testing.assert_allclose(got2["w"], u["w"], rtol=1e-6)


@COMPACT_STORAGES
def test_compact_storage_of_a_base_whose_init_reads_the_params_is_an_error(storage):
  # Schedule-free's z is a copy of the parameters. Compact storage builds its
  # entries' state from zero parameters, so z started at 0, silently; now init
  # says so. Skip storage, and compact storage with the leaf scoped out, still run.
  params = {"w": jnp.ones((4, 8)), "b": jnp.ones((3,))}
  base = optax.contrib.schedule_free_adamw(1e-2)
  with pytest.raises(
    ValueError, match=r"stores compactly \(\['w'\]\): state field \.z"
  ):
    magma.sparse_state(base, where=lambda path, x: x.ndim == 2, **storage).init(params)
  # The state need not be shaped like the parameters: optax.flatten's is one vector.
  flat = optax.flatten(optax.contrib.schedule_free_adamw(1e-2))
  with pytest.raises(ValueError, match="stores compactly"):
    magma.sparse_state(flat, where=lambda path, x: x.ndim == 2, **storage).init(params)
  skip = magma.sparse_state(base)
  state = skip.init(params)
  np.testing.assert_array_equal(state.base_state.z["w"], params["w"])
  scoped = magma.sparse_state(base, where=lambda path, x: False, **storage)
  scoped.init(params)  # nothing stored compactly: nothing to start wrong


@pytest.mark.parametrize(
  "make_base",
  [
    lambda: optax.adam(1e-3),
    lambda: optax.adamw(1e-3),
    lambda: optax.adagrad(1e-2),
    lambda: optax.rmsprop(1e-3, initial_scale=1.0),
    lambda: optax.sgd(1e-2, momentum=0.9),
    lambda: optax.lion(1e-3),
    lambda: optax.amsgrad(1e-3),
    lambda: optax.adan(1e-3),
    lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    lambda: optax.apply_if_finite(optax.adam(1e-3), 3),
    lambda: magma.magma(optax.adam(1e-3), key=0),
  ],
  ids=[
    "adam", "adamw", "adagrad", "rmsprop", "sgd-momentum", "lion", "amsgrad",
    "adan", "inject", "apply_if_finite", "magma",
  ],
)  # fmt: skip
def test_compact_storage_takes_bases_whose_init_reads_only_shapes(make_base):
  # The check of the one above reads the jaxpr of init: zeros_like and full_like
  # read shapes only, so ordinary bases (and wrappers of them) are not rejected.
  params = {"w": jnp.ones((4, 8))}
  tx = magma.sparse_state(make_base(), mode="compact", density=0.5)
  jax.jit(tx.init)(params)


def test_reads_inputs_follows_values_through_jit_calls():
  from magma_optax.sparse import freeze as _freeze

  x = jnp.ones(3)
  inner = jax.jit(lambda x: (jnp.zeros_like(x), x + 1))
  assert _freeze.reads_inputs(lambda x: inner(x), x) == (False, True)
  assert _freeze.reads_inputs(lambda x: {"a": x * 0, "b": jnp.full_like(x, 2)}, x) == {
    "a": True,  # a value read (x * 0 is NaN where x is)
    "b": False,
  }
  # checkpoint and custom_jvp calls are followed too.
  assert _freeze.reads_inputs(jax.checkpoint(jnp.zeros_like), x) is False
  assert (
    _freeze.reads_inputs(lambda x: jax.nn.relu(x) * 0 + jnp.ones_like(x), x) is True
  )
  # Control flow: its outputs read its inputs, conservatively.
  branch = lambda x: jax.lax.cond(True, lambda y: jnp.zeros_like(y), lambda y: y, x)  # noqa: E731
  assert _freeze.reads_inputs(branch, x) is True


def test_compact_storage_shapes(mode_runs):
  _, state, _, _ = mode_runs["adam", "compact"]
  mu = state.inner_state.base_state[0].mu
  # capacity = ceil(0.25 * size) per leaf; 1 bit of bookkeeping per entry, and the
  # indices of the stored entries.
  assert {k: v.shape for k, v in mu.items()} == {"p0": (16,), "p1": (16,)}
  bits, index = state.inner_state.stored_bits["p0"]
  assert bits.shape == (8,) and index.shape == (16,)
  mask = np.asarray(state.mask["p0"]).reshape(-1)
  np.testing.assert_array_equal(index, np.flatnonzero(mask)[:16])
  np.testing.assert_array_equal(np.unpackbits(bits)[: mask.size], mask)


def state_bytes(state):
  return sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))


@pytest.mark.parametrize("density", [0.1, 0.3, 0.5])
def test_compact_state_bytes_follow_density(density):
  params = {"w": jnp.zeros((64, 64)), "v": jnp.zeros((32, 128))}
  dense = state_bytes(optax.adam(LR).init(params))
  tx = magma.sparse_state(
    optax.adam(LR), mode="compact", density=density, cache_index=False
  )
  ratio = state_bytes(tx.init(params)) / dense
  assert density <= ratio <= density + 0.05
  # The default keeps the stored entries' int32 indices too: + density / 2.
  tx = magma.sparse_state(optax.adam(LR), mode="compact", density=density)
  ratio = state_bytes(tx.init(params)) / dense
  assert 1.5 * density <= ratio <= 1.5 * density + 0.05


def test_cached_index_equals_rebuilt_index():
  # The cached index (rebuilt only when the mask changes) and the index rebuilt
  # every step give the same trajectory, through refreshes that regrow entries.
  params = {"w": jax.random.normal(jax.random.key(0), (16, 24))}

  def run(cache_index):
    tx = magma.periodic_mask(
      magma.sparse_state(
        optax.adam(LR), mode="compact", density=0.5, cache_index=cache_index
      ),
      sparsity=0.5,
      every=2,
    )
    state, p = tx.init(params), params
    update = jax.jit(tx.update)
    for t in range(6):
      g = {"w": jnp.sin(p["w"] * (t + 1))}
      u, state = update(g, state, p)
      p = optax.apply_updates(p, u)
    return p, state.inner_state.base_state

  want, got = run(False), run(True)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(x, y)
  with pytest.raises(ValueError, match="cache_index must be True or False"):
    magma.sparse_state(optax.adam(LR), mode="compact", density=0.5, cache_index=1)


@pytest.mark.parametrize("cache_index", [True, False])
def test_compact_leaves_refresh_on_their_own_steps(cache_index):
  # Each leaf's stored set is rebuilt and remapped in its own loop when its mask
  # changes: masks of two leaves change on alternate steps (entries regrow), and
  # every update and stored moment follows the numpy reference of compact storage
  # (regrown entries restart from zero moments).
  rng = np.random.default_rng(3)
  shapes, steps = {"a": (6, 10), "b": (37,)}, 6
  masks = {k: [] for k in shapes}
  for t in range(steps):
    for j, (k, shape) in enumerate(shapes.items()):
      keep = masks[k] and (t + j) % 2
      masks[k].append(masks[k][-1] if keep else rng.random(shape) < 0.4)
  density = max(m.mean() for ms in masks.values() for m in ms)
  grads = {k: [rng.normal(size=x).astype(np.float32) for _ in range(steps)]
           for k, x in shapes.items()}  # fmt: skip
  tx = magma.sparse_state(
    optax.adam(LR, b1=B1, b2=B2, eps=EPS), mode="compact", density=density,
    cache_index=cache_index,
  )  # fmt: skip
  params = {k: jnp.zeros(x) for k, x in shapes.items()}
  state, step = tx.init(params), jax.jit(tx.update)
  want = {k: np_tile_adam(grads[k], masks[k]) for k in shapes}
  for t in range(steps):
    u, state = step(
      {k: grads[k][t] for k in shapes}, state, params,
      param_mask={k: masks[k][t] for k in shapes},
    )  # fmt: skip
    for k in shapes:
      u_ref, mu_ref, _ = want[k][t]
      np.testing.assert_allclose(np.asarray(u[k]), u_ref, rtol=2e-5, atol=1e-7)
      m = masks[k][t].reshape(-1)
      got = np.asarray(state.base_state[0].mu[k])
      np.testing.assert_allclose(got[: m.sum()], mu_ref.reshape(-1)[m], rtol=1e-5)
  assert step._cache_size() == 1


def test_ordinary_compact_steps_do_not_copy_the_stored_state():
  # The index rebuild and the remap run in a loop of zero or one step per leaf,
  # which rewrites the compact moments and the cached indices in place; around a
  # lax.cond XLA copied both on every step (measured: 5.5x -> 2.3-2.8x dense Adam
  # at 4 M parameters, benchmarks/RESULTS.md). Checked on the compiled, donated
  # step.
  params = {"w": jnp.ones((64, 48)), "b": jnp.ones(48)}
  mask = {"w": jnp.arange(64 * 48).reshape(64, 48) % 3 == 0, "b": jnp.arange(48) < 9}
  tx = magma.sparse_state(optax.adam(1e-3), mode="compact", density=0.4)

  def step(p, s, g, m):
    u, s = tx.update(g, s, p, param_mask=m)
    return optax.apply_updates(p, u), s

  def step_keeping_the_old_state(p, s, g, m):  # positive control: must copy it
    u, new = tx.update(g, s, p, param_mask=m)
    return optax.apply_updates(p, u), new, s.base_state, s.stored_bits

  def stored_copies(fn):
    args = (params, tx.init(params), params, mask)
    return entry_copies(fn, args, r"(?:f32|s32)\[(?:1229|20)\]")

  assert not stored_copies(step)
  found = stored_copies(step_keeping_the_old_state)
  assert any("f32[1229]" in c for c in found) and any("s32[1229]" in c for c in found)


def test_auto_dense_above_threshold():
  params = {"w": jnp.zeros((8, 8))}
  tx = magma.sparse_state(optax.adam(LR), mode="compact", density=0.7)
  state = tx.init(params)
  assert state.base_state[0].mu["w"].shape == (8, 8)
  assert isinstance(state.stored_bits["w"], optax.MaskedNode)
  tx = magma.sparse_state(
    optax.adam(LR), mode="compact", density=0.7, density_threshold=0.8
  )
  assert tx.init(params).base_state[0].mu["w"].shape == (45,)


def test_n_m_capacity_is_exact():
  params = {"w": jnp.zeros((4, 8))}
  tx = magma.periodic_mask(
    magma.sparse_state(optax.adam(LR), mode="compact", structure=(2, 4)),
    structure=(2, 4),
    every=1,
  )
  state = tx.init(params)
  # Grouped storage: 2 slots per group of 4 along the last axis, 4 bits per group.
  assert state.inner_state.base_state[0].mu["w"].shape == (4, 4)
  assert state.inner_state.stored_bits["w"].shape == (4, 2)
  assert state.inner_state.stored_bits["w"].dtype == jnp.uint8
  grads = tree(3, [(4, 8)])
  updates, state = jax.jit(tx.update)({"w": grads["p0"]}, state, params)
  assert int(jnp.sum(updates["w"] != 0)) == 16


def n_m_history(mode, axis, shapes, structure=(2, 4), steps=7):
  """periodic_mask(sparse_state(adam, mode), N:M along axis): params per step."""
  inner = magma.sparse_state(
    optax.adam(LR),
    mode=mode,
    structure=structure if mode == "compact" else None,
    axis=axis,
  )
  tx = magma.periodic_mask(
    inner, structure=structure, axis=axis, every=2, importance=lambda p, g: jnp.abs(g)
  )
  params = tree(2, shapes)
  state = tx.init(params)
  step = jax.jit(tx.update)
  history, regrown = [], 0
  for t in range(steps):
    updates, state = step(tree(10 + t, shapes), state, params)
    params = optax.apply_updates(params, updates)
    regrown += int(state.num_regrown)
    history.append(params)
  return history, state, regrown


@pytest.mark.parametrize(
  "axis, shapes, structure",
  [
    (-1, [(4, 8), (8,)], (2, 4)),
    (0, [(8, 3), (4, 2, 2)], (1, 4)),
    (-1, [(2, 64)], (3, 32)),  # 32-bit group patterns
  ],
)
def test_n_m_grouped_compact_equals_skip(axis, shapes, structure):
  skip, _, regrown = n_m_history("skip", axis, shapes, structure)
  grouped, state, _ = n_m_history("compact", axis, shapes, structure)
  assert regrown > 0  # the comparison covers moments moving between slots
  n, m = structure
  for i, shape in enumerate(shapes):
    want = list(shape)
    want[axis] = want[axis] // m * n
    assert state.inner_state.base_state[0].mu[f"p{i}"].shape == tuple(want)
  for a, b in zip(skip, grouped, strict=True):
    for k in a:
      np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), atol=1e-6)


def test_n_m_grouped_state_bytes():
  params = {"w": jnp.zeros((64, 64)), "v": jnp.zeros((32, 128))}
  dense = state_bytes(optax.adam(LR).init(params))
  for structure, density in [
    ((2, 4), 0.5),
    ((1, 4), 0.25),
    ((2, 16), 0.125),
    ((1, 32), 1 / 32),
  ]:
    tx = magma.sparse_state(optax.adam(LR), mode="compact", structure=structure)
    ratio = state_bytes(tx.init(params)) / dense
    assert density <= ratio <= density + 0.05, structure


def test_n_m_grouped_overflow_and_bad_axis():
  params = {"w": jnp.ones((2, 8))}
  tx = magma.sparse_state(optax.adam(LR), mode="compact", structure=(2, 4))
  state = tx.init(params)
  three_of_four = {"w": jnp.tile(jnp.array([1, 1, 1, 0, 1, 1, 0, 0], bool), (2, 1))}
  with pytest.raises(ValueError, match="capacity overflow: a group of 4"):
    tx.update(params, state, params, param_mask=three_of_four)
  with pytest.raises(Exception, match="capacity overflow"):
    out = jax.jit(tx.update)(params, state, params, param_mask=three_of_four)
    jax.block_until_ready(out)
  with pytest.raises(ValueError, match="multiple of 4"):
    magma.sparse_state(optax.adam(LR), mode="compact", structure=(2, 4), axis=0).init(
      {"w": jnp.ones((6, 8))}
    )
  with pytest.raises(ValueError, match="axis must be an int"):
    magma.sparse_state(optax.adam(LR), mode="compact", structure=(2, 4), axis=1.0)


def test_n_m_wide_groups_fall_back_to_flat_storage():
  tx = magma.sparse_state(optax.adam(LR), mode="compact", structure=(1, 64))
  state = tx.init({"w": jnp.zeros((2, 64))})
  assert state.base_state[0].mu["w"].shape == (2,)


def test_capacity_overflow_raises():
  params = {"w": jnp.ones(8)}
  tx = magma.sparse_state(optax.adam(LR), mode="compact", density=0.25)
  state = tx.init(params)
  too_many = {"w": jnp.arange(8) < 3}
  with pytest.raises(ValueError, match="capacity overflow"):
    tx.update(params, state, params, param_mask=too_many)
  with pytest.raises(Exception, match="capacity overflow"):
    out = jax.jit(tx.update)(params, state, params, param_mask=too_many)
    jax.block_until_ready(out)
  ok = {"w": jnp.arange(8) < 2}
  jax.block_until_ready(jax.jit(tx.update)(params, state, params, param_mask=ok))


def test_compact_needs_a_mask():
  params = {"w": jnp.ones(8)}
  tx = magma.sparse_state(optax.adam(LR), mode="compact", density=0.25)
  with pytest.raises(ValueError, match="param_mask"):
    tx.update(params, tx.init(params), params)
  # A wrapper that drops extra arguments between periodic_mask and the storage:
  # the message names the likely cause (the user did use periodic_mask).
  inner = optax.MultiSteps(tx, every_k_schedule=2).gradient_transformation()
  outer = magma.periodic_mask(inner, sparsity=0.75, every=1)
  with pytest.raises(ValueError, match="outside periodic_mask"):
    outer.update(params, outer.init(params), params)


def test_unscoped_leaves_are_plain_dense():
  params = {"w": jnp.ones(8), "b": jnp.ones(3)}
  tx = magma.sparse_state(
    optax.adam(LR), mode="compact", density=0.25, where=lambda p, x: x.size == 8
  )
  state = tx.init(params)
  assert state.base_state[0].mu["b"].shape == (3,)
  mask = {"w": jnp.arange(8) < 2, "b": optax.MaskedNode()}
  adam = optax.adam(LR)
  ref_state = adam.init(params)
  step = jax.jit(tx.update)
  for t in range(3):  # random gradients: plain Adam on "b" and on w's active entries
    key = jax.random.key(t)
    g = {k: jax.random.normal(jax.random.fold_in(key, i), x.shape)
         for i, (k, x) in enumerate(params.items())}  # fmt: skip
    u, state = step(g, state, params, param_mask=mask)
    want, ref_state = adam.update(g, ref_state, params)
    np.testing.assert_allclose(u["b"], want["b"], rtol=1e-6)
    np.testing.assert_allclose(u["w"][:2], want["w"][:2], rtol=1e-6)
    assert np.all(np.asarray(u["w"])[2:] == 0)


@pytest.mark.skipif(
  not magma.host_offload_available(), reason="no pinned_host memory kind"
)
def test_offload_placement_and_reactivation():
  params = {"a": jnp.ones(4), "b": jnp.ones((2, 3))}
  tx = magma.sparse_state(optax.adam(LR), mode="offload", offload_after=2)
  ref = magma.sparse_state(optax.adam(LR), mode="skip")
  state, ref_state = tx.init(params), ref.init(params)
  step, ref_step = jax.jit(tx.update), jax.jit(ref.update)
  kinds = []
  for t in range(7):
    mask = {"a": jnp.full(4, t in (0, 5, 6)), "b": jnp.ones((2, 3), bool)}
    grads = jax.tree.map(lambda x, t=t: jnp.full(x.shape, t + 1.0), params)
    u, state = step(grads, state, params, param_mask=mask)
    v, ref_state = ref_step(grads, ref_state, params, param_mask=mask)
    state = magma.offload_sparse_state(state, params)
    mu = state.base_state[0].mu
    kinds.append((mu["a"].sharding.memory_kind, mu["b"].sharding.memory_kind))
    for k in params:
      np.testing.assert_allclose(np.asarray(u[k]), np.asarray(v[k]), atol=1e-7)
      np.testing.assert_allclose(
        np.asarray(mu[k]), np.asarray(ref_state.base_state[0].mu[k]), atol=1e-7
      )
  device = jax.devices()[0].default_memory().kind
  # "a" is inactive at steps 1..4: cold after 2 steps, back when active at step 5.
  assert [k[0] for k in kinds] == [device, device] + ["pinned_host"] * 3 + [device] * 2
  assert all(k[1] == device for k in kinds)
  assert isinstance(state.cold["a"], jax.Array)


def test_offload_helper_rejects_params_of_another_tree():
  if not magma.host_offload_available():
    pytest.skip("no host memory kinds here: the helper returns the state as it is")
  params = {"w": jnp.ones(4), "b": jnp.ones(2)}
  tx = magma.sparse_state(optax.adam(LR), mode="offload", offload_after=1)
  state = tx.init(params)
  mask = {"w": jnp.zeros(4, bool), "b": jnp.ones(2, bool)}
  _, state = tx.update(params, state, params, param_mask=mask)
  magma.offload_sparse_state(state, params)  # the right tree: fine
  # Another tree moved nothing, silently.
  with pytest.raises(ValueError, match="do not have the tree structure"):
    magma.offload_sparse_state(state, {"x": jnp.ones(3)})


def test_offload_helper_is_noop_without_offload_state():
  params = {"a": jnp.ones(4)}
  tx = magma.sparse_state(optax.adam(LR), mode="skip")
  state = tx.init(params)
  moved = magma.offload_sparse_state(state, params)
  assert jax.tree.structure(moved) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(state), strict=True):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(mode="dense"), "mode"),
    (dict(mode="compact"), "density"),
    (dict(mode="compact", density=0.0), "density"),
    (dict(mode="compact", density=1.5), "density"),
    (dict(mode="compact", structure=(5, 4)), "structure"),
    (dict(mode="compact", structure=(2, 4), density=0.5), "not both"),
    (dict(mode="offload", offload_after=0), "offload_after"),
    (dict(density_threshold=1.5), "density_threshold"),
    (dict(mode="compact", density=0.5, block=(0, 4)), "block"),
    (dict(mode="compact", block=(2, 4)), "needs mode='compact'"),
    (dict(mode="skip", block=(2, 4)), "needs mode='compact'"),
    (dict(mode="offload", block=(2, 4)), "density"),
    (dict(mode="compact", structure=(2, 4), block=(2, 4)), "without structure"),
    # Skip storage keeps every entry: a density or structure was silently ignored.
    (dict(mode="skip", density=0.25), "mode='skip' keeps every"),
    (dict(mode="skip", structure=(2, 4)), "mode='skip' keeps every"),
    # A traced density (optax.inject_hyperparams) says how to keep it static.
    (
      dict(mode="compact", density=jnp.asarray(0.25)),
      "density must be static.*static_args=\\('density', 'density_threshold'\\)",
    ),
  ],
)
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    magma.sparse_state(optax.adam(LR), **kwargs)


def test_bad_mask_shape_raises():
  params = {"w": jnp.ones(8)}
  tx = magma.sparse_state(optax.adam(LR), mode="skip")
  with pytest.raises(ValueError, match="shape"):
    tx.update(params, tx.init(params), params, param_mask={"w": jnp.ones(4, bool)})


def test_active_indices_match_numpy_nonzero():
  rng = np.random.default_rng(4)
  run = jax.jit(_indices.active_indices, static_argnums=1)
  # Lengths that are not multiples of 32, densities 0 and 1, and capacities below
  # the number of active entries (the first `size` are kept) and above it (filled).
  for n in (1, 31, 33, 100):
    for density in (0.0, 0.3, 1.0):
      mask = rng.random(n) < density
      for size in (1, n // 2 + 1, n, n + 5):
        got, count = run(jnp.asarray(mask), size)
        assert int(count) == mask.sum()
        want = np.full(size, n)
        idx = np.flatnonzero(mask)[:size]
        want[: idx.size] = idx
        np.testing.assert_array_equal(
          np.asarray(got), want, err_msg=f"{n} {density} {size}"
        )


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(mode="skip"),
    dict(mode="offload"),
    dict(mode="compact", density=0.5),
    dict(mode="compact", structure=(2, 4)),
  ],
)
def test_zero_size_leaves_every_storage(kwargs):
  params = {"e": jnp.zeros((0, 4)), "w": jnp.arange(1.0, 9.0).reshape(2, 4)}
  mask = {"e": jnp.zeros((0, 4), bool), "w": jnp.array([[1, 0, 1, 0]] * 2, bool)}
  tx = magma.sparse_state(optax.adam(LR), **kwargs)
  ref = magma.sparse_state(optax.adam(LR), mode="skip")
  state, ref_state = tx.init(params), ref.init(params)
  for _ in range(2):
    u, state = jax.jit(tx.update)(params, state, params, param_mask=mask)
    v, ref_state = ref.update(params, ref_state, params, param_mask=mask)
    assert u["e"].shape == (0, 4)
    np.testing.assert_allclose(np.asarray(u["w"]), np.asarray(v["w"]), atol=1e-7)
  assert float(jnp.abs(u["w"]).min()) == 0.0 and float(jnp.abs(u["w"]).max()) > 0


def counting(base):
  """``base`` whose update appends to a list when it runs (outside jit)."""
  calls = []

  def update_fn(updates, state, params=None, **extra):
    calls.append(1)
    return base.update(updates, state, params, **extra)

  return optax.GradientTransformationExtraArgs(base.init, update_fn), calls


def test_capacity_overflow_message_names_density_and_counts():
  params = {"w": jnp.ones(8)}
  base, calls = counting(optax.with_extra_args_support(optax.adam(LR)))
  tx = magma.sparse_state(base, mode="compact", density=0.25)
  state = tx.init(params)
  too_many = {"w": jnp.arange(8) < 3}
  want = (
    r"leaf \['w'\] \(size 8\) has 3 active entries .* capacity ceil\(density \*"
    r" size\) = ceil\(0.25 \* 8\) = 2\. Raise `density` to at least 0.375"
  )
  # Outside jit: a ValueError before the base optimizer runs.
  with pytest.raises(ValueError, match=want):
    tx.update(params, state, params, param_mask=too_many)
  assert calls == []
  # Under jit the runtime reports it, with the same message on its last line: a
  # JaxRuntimeError, or (jax 0.10.2 and 0.12, when the jitted step's first call
  # succeeded: an overflow at a later refresh) a ValueError. Either is accepted:
  # which one is JAX's dispatch detail, not a promise.
  errors = (ValueError, jax.errors.JaxRuntimeError)
  step = jax.jit(tx.update)
  with pytest.raises(errors, match=want):
    jax.block_until_ready(step(params, state, params, param_mask=too_many))
  step = jax.jit(tx.update)
  fits = {"w": jnp.arange(8) < 2}
  jax.block_until_ready(step(params, state, params, param_mask=fits))
  with pytest.raises(errors, match=want):
    jax.block_until_ready(step(params, state, params, param_mask=too_many))
  # Control: a mask that fits runs the base (eagerly: one more call).
  before = len(calls)
  tx.update(params, state, params, param_mask={"w": jnp.arange(8) < 2})
  assert len(calls) == before + 1


def tile_masks(rng, lead, tiles, block, steps, density):
  """Element masks made of whole tiles, fresh at random each step."""
  r, c = block
  out = []
  for _ in range(steps):
    t = rng.random((*lead, *tiles)) < density
    out.append(np.repeat(np.repeat(t, r, axis=-2), c, axis=-1))
  return out


def np_tile_adam(grads, masks):
  """Masked-moment Adam whose entries restart from zero moments when they become
  active again (what compact storage keeps: nothing for inactive entries)."""
  mu = np.zeros_like(grads[0])
  nu = np.zeros_like(grads[0])
  prev = np.zeros(grads[0].shape, bool)
  out = []
  for t, (g, m) in enumerate(zip(grads, masks, strict=True), start=1):
    regrown = m & ~prev
    mu, nu = np.where(regrown, 0.0, mu), np.where(regrown, 0.0, nu)
    mu = np.where(m, B1 * mu + (1 - B1) * g, mu)
    nu = np.where(m, B2 * nu + (1 - B2) * g * g, nu)
    mhat, vhat = mu / (1 - B1**t), nu / (1 - B2**t)
    out.append((np.where(m, -LR * mhat / (np.sqrt(vhat) + EPS), 0.0), mu, nu))
    prev = m
  return out


@pytest.mark.parametrize(
  "shape, block", [((8, 12), (2, 4)), ((3, 4, 256), (1, 128)), ((6, 6), (3, 1))]
)
def test_tile_compact_matches_numpy_with_regrowth(shape, block):
  r, c = block
  rng = np.random.default_rng(1)
  lead, tiles = shape[:-2], (shape[-2] // r, shape[-1] // c)
  masks = tile_masks(rng, lead, tiles, block, 6, 0.4)
  num_tiles = math.prod(lead) * tiles[0] * tiles[1]
  density = max(m.sum() for m in masks) / masks[0].size
  grads = [rng.normal(size=shape).astype(np.float32) for _ in masks]
  tx = magma.sparse_state(
    optax.adam(LR, b1=B1, b2=B2, eps=EPS), mode="compact", density=density,
    block=block,
  )  # fmt: skip
  params = {"w": jnp.zeros(shape)}
  state = tx.init(params)
  cap = math.ceil(density * num_tiles)
  assert state.base_state[0].mu["w"].shape == (cap, r, c)
  step = jax.jit(tx.update)
  regrown = 0
  for t, ((u_ref, mu_ref, nu_ref), g, m) in enumerate(
    zip(np_tile_adam(grads, masks), grads, masks, strict=True)
  ):
    regrown += t > 0 and bool((m & ~masks[t - 1]).any())
    u, state = step({"w": g}, state, params, param_mask={"w": m})
    np.testing.assert_allclose(np.asarray(u["w"]), u_ref, rtol=2e-5, atol=1e-7)
    # Stored moments: the active tiles in tile order, then zero (empty) slots.
    tiles_of = lambda x: x.reshape(-1, r, tiles[1], c).swapaxes(1, 2).reshape(-1, r, c)
    active = tiles_of(m)[:, 0, 0]
    n = int(active.sum())
    for name, ref in (("mu", mu_ref), ("nu", nu_ref)):
      got = np.asarray(getattr(state.base_state[0], name)["w"])
      np.testing.assert_allclose(got[:n], tiles_of(ref)[active], rtol=1e-5, atol=1e-8)
      assert np.all(got[n:] == 0)
  assert regrown >= 2  # tiles came back and restarted from zero moments
  assert step._cache_size() == 1


# Leaves of one tile count and capacity are prepared together (one stack of their
# tiles): (8, 12) and (12, 8) both have 12 tiles of 2x4, (4, 8) has 4.
GROUPED_SHAPES = {"a": (8, 12), "b": (8, 12), "c": (12, 8), "d": (8, 12), "e": (4, 8)}


@pytest.mark.parametrize("factory", ["sparse_state", "sparse_adam"])
def test_tile_leaves_prepared_together_match_numpy_per_leaf(factory):
  # Five leaves: four of 12 tiles of 2x4 (one batch, shapes differ), one of 4
  # (alone); every leaf's tiles drawn at random each step, so tiles move, regrow
  # and the stored sets change in some leaves and not in others.
  block, density = (2, 4), 0.5
  rng = np.random.default_rng(3)
  masks, grads = {}, {}
  for k, shape in GROUPED_SHAPES.items():
    tiles = (shape[0] // 2, shape[1] // 4)
    masks[k] = tile_masks(rng, (), tiles, block, 6, 0.4)
    for m in masks[k]:  # at most the capacity: 6 of 12 tiles (2 of 4)
      t = m[::2, ::4]
      if t.sum() > t.size // 2:
        m[:] = False
    grads[k] = [rng.normal(size=shape).astype(np.float32) for _ in masks[k]]
  if factory == "sparse_state":
    tx = magma.sparse_state(
      optax.adam(LR, b1=B1, b2=B2, eps=EPS), mode="compact", density=density,
      block=block,
    )  # fmt: skip
  else:
    tx = magma.sparse_adam(
      LR, b1=B1, b2=B2, eps=EPS, mode="compact", density=density, block=block
    )
  params = {k: jnp.zeros(s) for k, s in GROUPED_SHAPES.items()}
  state = tx.init(params)
  step = jax.jit(tx.update)
  refs = {k: np_tile_adam(grads[k], masks[k]) for k in GROUPED_SHAPES}
  for t in range(6):
    u, state = step(
      {k: grads[k][t] for k in params},
      state,
      params,
      param_mask={k: jnp.asarray(masks[k][t]) for k in params},
    )
    for k in params:
      np.testing.assert_allclose(
        np.asarray(u[k]), refs[k][t][0], rtol=2e-5, atol=1e-7, err_msg=k
      )
  assert step._cache_size() == 1


def scatter_ops(tx, params, mask):
  """The scatters of a jitted tile step (its index builds and slot maps)."""
  grads = jax.tree.map(jnp.ones_like, params)

  def fn(p, s, m):  # everything an argument: XLA would merge equal constants
    return tx.update(grads, s, p, param_mask=m)

  hlo = jax.jit(fn).lower(params, tx.init(params), mask).compile().as_text()
  entry = hlo[hlo.index("\nENTRY") :]
  entry = entry[: entry.index("\n}")]
  # The scatters themselves, and fusions that call a computation holding one.
  bodies = {}
  for part in hlo.split("\n\n"):
    head = re.match(r"\s*(%\S+)", part)
    if head:
      bodies[head.group(1)] = part
  called = re.findall(r" fusion\(.*?calls=(%[\w.\-]+)", entry)
  return len(re.findall(r" scatter\(", entry)) + sum(
    bool(re.search(r" scatter\(", bodies.get(c, ""))) for c in called
  )


def test_tile_leaves_of_one_shape_build_their_indices_in_one_computation():
  # Per leaf, the step builds its tiles' slots (a scatter) and the slot map that
  # expands its update (another): on a transformer's 72 leaves some 20 small
  # launches each, more than the bytes on XLA:CPU. Leaves of one tile count and
  # capacity do it over one stack: the count does not grow with the leaves.
  block = (2, 4)
  tx = magma.sparse_adam(
    LR, mode="compact", density=0.5, block=block, on_error="record"
  )

  def count(n):
    params = {f"w{i}": jnp.zeros((8, 12)) for i in range(n)}
    mask = {
      k: jnp.ones((8, 12), bool).at[: i % 4].set(False) for i, k in enumerate(params)
    }
    return scatter_ops(tx, params, mask)

  assert count(6) == count(2) > 0
  # The control: one computation per leaf, as before.
  saved = Tiles.batch_key
  Tiles.batch_key = lambda self: None
  try:
    assert count(6) == 3 * count(2) > 0
  finally:
    Tiles.batch_key = saved


# 600 bytes: RMSProp's 192-byte nu per leaf remapped 3 together, then 1 alone;
# 400 bytes: 2 and 2 (rows 2, 3 of the stacks prepared together).
# A bfloat16 "b": prepared with the others, remapped apart; "a", "c", "d" are then
# rows 0, 2, 3 of the stacks prepared together. Prepared apart (no batch key), the
# leaves are stacked for their remap alone.
@pytest.mark.parametrize(
  "remap_bytes, b_dtype, apart, sizes",
  [
    (None, "float32", False, [4]),
    (600, "float32", False, [3]),
    (400, "float32", False, [2, 2]),
    (None, "bfloat16", False, [3]),
    (None, "float32", True, [4]),
  ],
)
def test_tile_leaves_remapped_together_keep_each_leafs_state(
  monkeypatch, remap_bytes, b_dtype, apart, sizes
):
  # Leaves of one tile storage and state shapes are remapped by one computation
  # over their stack; a leaf whose stored set did not change keeps its entries
  # as they were, also its empty slots, where RMSProp's second moment (from
  # initial_scale=1) decays between remaps. The reference: each leaf alone.
  assert not _sharded.partitionable()  # one device: the leaves are grouped
  if remap_bytes is not None:
    monkeypatch.setattr(_step, "REMAP_BYTES", remap_bytes)
  groups = []  # the number of leaves of each remap group traced
  remap_group = Tiles.remap_group
  monkeypatch.setattr(
    Tiles,
    "remap_group",
    staticmethod(lambda s, *a: groups.append(len(s)) or remap_group(s, *a)),
  )
  if apart:
    monkeypatch.setattr(Tiles, "batch_key", lambda self: None)
  dtype = {"b": jnp.dtype(b_dtype)}
  block, steps = (2, 4), 5
  rng = np.random.default_rng(7)
  names = ["a", "b", "c", "d"]
  masks = {k: tile_masks(rng, (), (4, 3), block, steps, 0.4) for k in names}
  for k in names:  # at most 6 of 12 tiles; "b"'s set changes at the first step only
    for t, m in enumerate(masks[k]):
      if m[::2, ::4].sum() > 6 or (k == "b" and t > 0):
        m[:] = masks[k][0] if t > 0 else False
  grads = {k: [rng.normal(size=(8, 12)).astype(np.float32) for _ in range(steps)]
           for k in names}  # fmt: skip
  tx = magma.sparse_state(
    optax.rmsprop(LR, initial_scale=1.0), mode="compact", density=0.5, block=block
  )

  def run(keys):
    params = {k: jnp.zeros((8, 12), dtype.get(k, jnp.float32)) for k in keys}
    state, step, out = tx.init(params), jax.jit(tx.update), []
    for t in range(steps):
      g = {k: jnp.asarray(grads[k][t], params[k].dtype) for k in keys}
      m = {k: jnp.asarray(masks[k][t]) for k in keys}
      u, state = step(g, state, params, param_mask=m)
      out.append((u, state.base_state))
    return out

  together = run(names)
  assert groups == sizes
  for k in names:
    alone = run([k])
    for (u, s), (u1, s1) in zip(together, alone, strict=True):
      np.testing.assert_array_equal(u[k], u1[k], err_msg=k)
      for x, x1 in zip(
        jax.tree.leaves(optax.tree_utils.tree_get(s, "nu")[k]),
        jax.tree.leaves(optax.tree_utils.tree_get(s1, "nu")[k]),
        strict=True,
      ):
        np.testing.assert_array_equal(x, x1, err_msg=k)
  # The empty slots of "b" decayed and were kept (its set changed at step 0 only).
  nu_b = np.asarray(optax.tree_utils.tree_get(together[-1][1], "nu")["b"])
  n_b = int(masks["b"][0][::2, ::4].sum())
  assert n_b < 6 and np.all((nu_b[n_b:] > 0) & (nu_b[n_b:] < 1))


def remap_scatters(tx, n):
  """The scatters in the whole compiled tile step over ``n`` leaves of one shape,
  the loops that remap them included."""
  params = {f"w{i}": jnp.zeros((8, 12)) for i in range(n)}
  mask = {k: jnp.ones((8, 12), bool).at[: i % 4].set(False) for i, k in
          enumerate(params)}  # fmt: skip

  def fn(p, s, m):
    return tx.update(jax.tree.map(jnp.ones_like, p), s, p, param_mask=m)

  hlo = jax.jit(fn).lower(params, tx.init(params), mask).compile().as_text()
  return len(re.findall(r" scatter\(", hlo))


def test_tile_leaves_of_one_shape_are_remapped_in_one_computation():
  # Every scatter of the remap is in the program once, however many leaves; the
  # control (each leaf remapped alone) has them once per leaf: u scatters per
  # remap, 6 leaves against 2 adding 4 u, and 2 leaves alone u more than grouped.
  tx = magma.sparse_adam(
    LR, mode="compact", density=0.5, block=(2, 4), on_error="record"
  )
  grouped = remap_scatters(tx, 6), remap_scatters(tx, 2)
  saved = Tiles.remap_key
  Tiles.remap_key = _storage.Storage.remap_key
  try:
    alone = remap_scatters(tx, 6), remap_scatters(tx, 2)
  finally:
    Tiles.remap_key = saved
  per_remap = alone[1] - grouped[1]
  assert grouped[0] == grouped[1] > 0
  assert alone[0] - alone[1] == 4 * per_remap > 0


def step_kernels(tx, n):
  """The kernels (instructions other than parameters, constants, tuples and
  bitcasts) in the entry computation of the donated step over ``n`` leaves: what
  every step launches (a loop's body runs only on the steps that refresh)."""
  params = {f"w{i}": jnp.zeros((8, 12)) for i in range(n)}
  mask = {k: jnp.ones((8, 12), bool).at[: i % 4].set(False) for i, k in
          enumerate(params)}  # fmt: skip

  def fn(p, s, m):
    u, s = tx.update(jax.tree.map(jnp.ones_like, p), s, p, param_mask=m)
    return optax.apply_updates(p, u), s

  lowered = jax.jit(fn, donate_argnums=(0, 1)).lower(params, tx.init(params), mask)
  hlo = lowered.compile().as_text()
  entry = hlo[hlo.index("\nENTRY") :]
  entry = entry[: entry.index("\n}")]
  ops = re.findall(r"= \S+ ([\w-]+)\(", entry) + re.findall(r"\) ([\w-]+)\(", entry)
  free = ("parameter", "get-tuple-element", "bitcast", "tuple", "constant")
  return sum(op not in free for op in ops)


@pytest.mark.parametrize("base", ["sparse_adam", "sparse_state(adam)"])
def test_tile_step_launches_few_kernels_per_leaf(base):
  # On XLA:CPU each kernel is a launch, and a transformer has many small leaves.
  # Per tile leaf, the entry computation has 4 kernels more than Adam's step (9
  # against 5 on jax 0.10.2 and 0.12): the tile step's own work (the mask's tiles,
  # the new bits, the gradient's gather, the compact update and its branch) less
  # what it does not share with Adam's. Each leaf's slices of the stacks prepared
  # together (for the refresh loops' operands and for the branch's predicate) and
  # the gather's bounds check were 8 more.
  storage = dict(mode="compact", density=0.5, block=(2, 4), on_error="record")
  if base == "sparse_adam":
    tx = magma.sparse_adam(LR, **storage)
  else:
    tx = magma.sparse_state(optax.adam(LR), **storage)
  assert not _sharded.partitionable()
  per_leaf = (step_kernels(tx, 6) - step_kernels(tx, 2)) / 4
  adam = optax.adam(LR)
  adam_per_leaf = (step_kernels(adam, 6) - step_kernels(adam, 2)) / 4
  assert per_leaf <= adam_per_leaf + 4, (per_leaf, adam_per_leaf)


def test_tile_leaf_failing_in_a_batch_is_the_one_recorded():
  # Record mode: one leaf of a batch gets a mask over its capacity, another one
  # not made of whole tiles; each keeps its stored tiles and gets no update, the
  # others step, and the first failure is the one recorded.
  block = (2, 4)
  tx = magma.sparse_adam(
    LR, mode="compact", density=0.25, block=block, on_error="record"
  )
  params = {k: jnp.zeros((8, 16)) for k in ("a", "b", "c")}
  ok = jnp.zeros((8, 16), bool).at[:2, :8].set(True)  # 2 of 16 tiles
  grads = {k: jnp.full((8, 16), 0.5) for k in params}
  step = jax.jit(tx.update)
  _, state = step(grads, tx.init(params), params, param_mask={k: ok for k in params})
  over = jnp.zeros((8, 16), bool).at[:4, :].set(True)  # 8 tiles: capacity 4
  untiled = ok.at[0, 0].set(False)
  u, after = step(grads, state, params, param_mask={"a": ok, "b": over, "c": untiled})
  np.testing.assert_array_equal(np.asarray(u["b"]), 0.0)
  np.testing.assert_array_equal(np.asarray(u["c"]), 0.0)
  assert np.all(np.asarray(u["a"])[:2, :8] != 0)
  assert np.all(np.asarray(u["a"])[2:] == 0)
  bits = after.stored_bits
  np.testing.assert_array_equal(
    np.asarray(bits["b"]), np.asarray(state.stored_bits["b"])
  )
  with pytest.raises(ValueError, match=r"leaf \['b'\].*8 active tiles"):
    magma.check_sparse_state(after)
  # The other failure alone is recorded for its own leaf.
  _, after = step(grads, state, params, param_mask={"a": ok, "b": ok, "c": untiled})
  with pytest.raises(ValueError, match=r"\['c'\] is not made of whole 2x4 tiles"):
    magma.check_sparse_state(after)


def tile_history(mode, shapes, block, steps=7):
  inner = magma.sparse_state(
    optax.adam(LR), mode=mode, density=0.25 if mode == "compact" else None,
    block=block if mode == "compact" else None,
  )  # fmt: skip
  tx = magma.periodic_mask(
    inner, sparsity=0.75, block=block, every=2, importance=lambda p, g: jnp.abs(g)
  )
  params = tree(2, shapes)
  state = tx.init(params)
  step = jax.jit(tx.update)
  history, regrown = [], 0
  for t in range(steps):
    updates, state = step(tree(10 + t, shapes), state, params)
    params = optax.apply_updates(params, updates)
    regrown += int(state.num_regrown)
    history.append(params)
  return history, state, step, regrown


def test_tile_compact_equals_skip_under_periodic_mask():
  shapes, block = [(8, 16), (2, 4, 8)], (2, 4)
  skip, _, _, regrown = tile_history("skip", shapes, block)
  tiles, state, step, _ = tile_history("compact", shapes, block)
  assert regrown > 0
  mu = state.inner_state.base_state[0].mu
  assert {k: v.shape for k, v in mu.items()} == {"p0": (4, 2, 4), "p1": (2, 2, 4)}
  for a, b in zip(skip, tiles, strict=True):
    for k in a:
      np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), atol=1e-6)
  assert step._cache_size() == 1


@pytest.mark.parametrize("density", [0.1, 0.3, 0.5])
def test_tile_state_bytes_follow_density(density):
  params = {"w": jnp.zeros((64, 256)), "v": jnp.zeros((2, 32, 128))}
  dense = state_bytes(optax.adam(LR).init(params))
  tx = magma.sparse_state(
    optax.adam(LR), mode="compact", density=density, block=(1, 128)
  )
  ratio = state_bytes(tx.init(params)) / dense
  assert density <= ratio <= density + 0.05


def test_tile_overflow_and_untiled_mask_raise():
  params = {"w": jnp.ones((4, 8))}
  base, calls = counting(optax.with_extra_args_support(optax.adam(LR)))
  tx = magma.sparse_state(base, mode="compact", density=0.25, block=(2, 4))
  state = tx.init(params)  # 4 tiles, capacity 1
  two_tiles = {"w": jnp.zeros((4, 8), bool).at[:2].set(True)}
  overflow = r"4 tiles of 2x4\) has 2 active tiles .* = ceil\(0.25 \* 4\) = 1"
  untiled = {"w": jnp.zeros((4, 8), bool).at[0, 0].set(True)}
  not_tiles = r"not made of whole 2x4 tiles .* some entries differ"
  for mask, match in ((two_tiles, overflow), (untiled, not_tiles)):
    with pytest.raises(ValueError, match=match):
      tx.update(params, state, params, param_mask=mask)
  assert calls == []  # outside jit, raised before the base ran
  for mask, match in ((two_tiles, overflow), (untiled, not_tiles)):
    with pytest.raises(Exception, match=match):
      jax.block_until_ready(jax.jit(tx.update)(params, state, params, param_mask=mask))
  one_tile = {"w": jnp.zeros((4, 8), bool).at[2:, 4:].set(True)}  # control: fits
  u, _ = jax.jit(tx.update)(params, state, params, param_mask=one_tile)
  assert int(jnp.sum(u["w"] != 0)) == 8


def test_tile_bad_block_raises():
  adam = optax.adam(LR)
  with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(8,\)"):
    magma.sparse_state(adam, mode="compact", density=0.5, block=(2, 4)).init(
      {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
    )
  with pytest.raises(ValueError, match=r"shape \(4, 6\)"):
    magma.sparse_state(adam, mode="compact", density=0.5, block=(2, 4)).init(
      {"w": jnp.ones((4, 6))}
    )
  # Control: the same leaf scoped out with `where` is plain dense.
  tx = magma.sparse_state(
    adam, mode="compact", density=0.5, block=(2, 4), where=lambda p, x: x.ndim == 2
  )
  state = tx.init({"w": jnp.ones((4, 8)), "b": jnp.ones(8)})
  assert state.base_state[0].mu["w"].shape == (2, 2, 4)
  assert state.base_state[0].mu["b"].shape == (8,)


@pytest.mark.parametrize(
  "factory, mode, parts",
  [
    ("sparse_state", "compact", (2, 2)),
    ("sparse_state", "offload", (2, 1, 2)),  # also split the stacking axis
    ("sparse_adam", "compact", (2, 2, 2)),
  ],
)
def test_sharded_tiles_match_numpy_per_part(factory, mode, parts):
  shape, block = (2, 8, 16), (2, 4)
  r, c = block
  rng = np.random.default_rng(3)
  masks = tile_masks(rng, shape[:-2], (shape[-2] // r, shape[-1] // c), block, 6, 0.4)
  per_part = [shard_parts(m, parts)[..., ::r, ::c] for m in masks]  # tiles
  tiles_per_part = per_part[0][(0,) * len(parts)].size
  density = max(t[i].sum() for t in per_part for i in np.ndindex(*parts))
  density /= tiles_per_part
  kw = dict(mode=mode, density=density, block=block, shards=parts)
  kw["density_threshold"] = 1.0  # the densest part may hold most of its tiles
  if factory == "sparse_adam":
    tx = magma.sparse_adam(LR, b1=B1, b2=B2, eps=EPS, **kw)
  else:
    tx = magma.sparse_state(optax.adam(LR, b1=B1, b2=B2, eps=EPS), **kw)
  params = {"w": jnp.zeros(shape)}
  state = tx.init(params)
  cap = math.ceil(density * tiles_per_part)
  assert state.base_state[0].mu["w"].shape == (*parts, cap, r, c)
  step = jax.jit(tx.update)
  grads = [rng.normal(size=shape).astype(np.float32) for _ in masks]
  for (u_ref, mu_ref, nu_ref), g, m in zip(
    np_tile_adam(grads, masks), grads, masks, strict=True
  ):
    u, state = step({"w": g}, state, params, param_mask={"w": m})
    state = magma.offload_sparse_state(state, params)
    np.testing.assert_allclose(np.asarray(u["w"]), u_ref, rtol=2e-5, atol=1e-7)
    # Each part stores its own active tiles in tile order, then empty slots.
    for name, ref in (("mu", mu_ref), ("nu", nu_ref)):
      got = np.asarray(getattr(state.base_state[0], name)["w"])
      ref_parts, mask_parts = shard_parts(ref, parts), shard_parts(m, parts)
      for i in np.ndindex(*parts):
        t = lambda x: x.reshape(-1, r, x.shape[-1] // c, c).swapaxes(1, 2)
        tiles, active = t(ref_parts[i]), t(mask_parts[i])[:, :, 0, 0]
        tiles, active = tiles.reshape(-1, r, c), active.reshape(-1)
        n = int(active.sum())
        np.testing.assert_allclose(got[i][:n], tiles[active], rtol=1e-5, atol=1e-8)
        assert np.all(got[i][n:] == 0)
  assert step._cache_size() == 1


def test_sharded_tiles_overflow_names_the_part():
  params = {"w": jnp.ones((8, 8))}
  tx = magma.sparse_state(
    optax.adam(LR), mode="compact", density=0.25, block=(2, 2), shards=(2, 2)
  )
  state = tx.init(params)  # 4 parts of 4 tiles: 1 slot each
  # 2 tiles in part (1, 0) -- the whole leaf has 2 of 16, well under 0.25.
  two = {"w": jnp.zeros((8, 8), bool).at[4:6, :4].set(True)}
  match = r"part \(1, 0\) of the 2x2 shard parts of leaf \['w'\] \(4 tiles of 2x2\)"
  match += r" has 2 active .*"
  match += r"shards=\(2, 2\)"
  with pytest.raises(ValueError, match=match):
    tx.update(params, state, params, param_mask=two)
  step = jax.jit(tx.update)  # one compile for the failing step and the control
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(step(params, state, params, param_mask=two))
  # Control: one tile in every part fits.
  one_each = np.zeros((8, 8), bool)
  for a, b in ((0, 0), (0, 6), (6, 0), (4, 4)):
    one_each[a : a + 2, b : b + 2] = True
  u, _ = step(params, state, params, param_mask={"w": jnp.asarray(one_each)})
  assert int(jnp.sum(u["w"] != 0)) == 16
  assert step._cache_size() == 1
  # (periodic_mask with the same shards keeps as many tiles in every part:
  # test_periodic_mask.py::test_tile_masks_balanced_over_shards_match_numpy.)


def test_sharded_tiles_need_each_part_on_one_device_under_explicit_axes():
  # On a (1, 1) mesh of Explicit axes: a leaf sharded along a leading axis has parts
  # that would span devices (a clear error); along its last two axes it runs, with
  # the arrays' mesh only (no `jax.set_mesh`; the 8-device run uses one).
  mesh = jax.make_mesh((1, 1), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
  context = contextlib.nullcontext()
  tx = magma.sparse_state(
    optax.adam(LR), mode="compact", density=0.5, block=(2, 2), shards=(2, 2)
  )
  mask = jnp.zeros((2, 8, 8), bool).at[:, :2, :2].set(True)
  mask = mask.at[:, 4:6, 4:6].set(True).at[:, :2, 4:6].set(True)
  mask = mask.at[:, 4:6, :2].set(True)
  with context:
    for spec, ok in ((P(None, "x", "y"), True), (P("x", None, None), False)):
      sharding = NamedSharding(mesh, spec)
      params = {"w": jax.device_put(jnp.ones((2, 8, 8)), sharding)}
      m = {"w": jax.device_put(mask, sharding)}
      step = jax.jit(lambda p, s, m: tx.update(p, s, p, param_mask=m))
      if ok:
        u, _ = step(params, tx.init(params), m)
        assert int(jnp.sum(u["w"] != 0)) == int(mask.sum())
      else:
        with pytest.raises(ValueError, match="every part must lie on one device"):
          step(params, tx.init(params), m)  # (raised by init)
    # Counts for every axis the spec names (here of size 1), as tile_shards gives
    # them: parts along the leading axis too, also where all counts are 1.
    sharding = NamedSharding(mesh, P("x", None, "y"))
    params = {"w": jax.device_put(jnp.ones((2, 8, 8)), sharding)}
    m = {"w": jax.device_put(mask, sharding)}
    assert magma.sharding.tile_shards(params)((jax.tree_util.DictKey("w"),), None) == (
      1,
      1,
      1,
    )
    for shards in ((2, 2, 2), magma.sharding.tile_shards(params)):
      tx = magma.sparse_state(
        optax.adam(LR), mode="compact", density=0.5, block=(2, 2), shards=shards
      )
      u, _ = jax.jit(lambda p, s, m, tx=tx: tx.update(p, s, p, param_mask=m))(
        params, tx.init(params), m
      )
      assert jax.typeof(u["w"]).sharding.spec == P("x", None, "y")
      assert int(jnp.sum(u["w"] != 0)) == int(mask.sum())


@pytest.mark.parametrize("inner", ["sparse_state", "sparse_adam"])
def test_nm_storage_from_a_plain_init_keeps_explicit_shardings(inner):
  # On a (1, 1) mesh of Explicit axes, inside jax.set_mesh: `tx.init(params)`, not
  # magma.sharding.init, is what most loops call. The stored moments and bits must
  # carry the parameter's spec, or the step's select of new and old slots mixes
  # sharding types (a ShardingTypeError before the fix). Steps match the run
  # without a mesh.
  mesh = jax.make_mesh((1, 1), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
  storage = dict(mode="compact", structure=(2, 4))
  if inner == "sparse_state":
    base = magma.sparse_state(optax.adam(LR), **storage)
  else:
    base = magma.sparse_adam(LR, **storage)
  tx = magma.periodic_mask(base, structure=(2, 4), every=2)
  rng = np.random.default_rng(3)
  p0 = rng.standard_normal((8, 16)).astype(np.float32)
  grads = [rng.standard_normal((8, 16)).astype(np.float32) for _ in range(3)]

  def run(put):
    params = {"w": put(p0)}
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    for g in grads:
      u, state = step(params, state, {"w": put(g)})
      params = optax.apply_updates(params, u)
    return params, state

  want, _ = run(jnp.asarray)
  with jax.set_mesh(mesh):
    sharding = NamedSharding(mesh, P("x", "y"))
    got, state = run(lambda a: jax.device_put(a, sharding))
  stored = jax.tree.leaves(state.inner_state.base_state) + [
    state.inner_state.stored_bits["w"]
  ]
  for x in stored:
    if jnp.ndim(x) == 2:
      assert jax.typeof(x).sharding.spec == P("x", "y"), jax.typeof(x)
  # (Adam's step written by sparse_adam may round its last bit differently when
  # XLA rewrites its divisions in another compilation.)
  np.testing.assert_allclose(got["w"], want["w"], rtol=3e-7, atol=0)


def test_a_state_built_with_other_storage_arguments_is_refused_clearly():
  params = {"w": jnp.ones((8, 8))}
  mask = {"w": jnp.zeros((8, 8), bool).at[:2, :2].set(True)}
  kw = dict(mode="compact", density=0.5, block=(2, 2))
  per_shard = magma.sparse_state(optax.adam(LR), shards=(2, 2), **kw)
  one_part = magma.sparse_state(optax.adam(LR), **kw)
  with pytest.raises(ValueError, match=r"not built by this\s+transform.s init"):
    jax.jit(one_part.update)(params, per_shard.init(params), params, param_mask=mask)
  with pytest.raises(ValueError, match="other storage arguments"):
    magma.sparse_adam(LR, **kw).update(
      params, per_shard.init(params), params, param_mask=mask
    )
  # Control: each with its own state.
  for tx in (per_shard, one_part):
    jax.jit(tx.update)(params, tx.init(params), params, param_mask=mask)


def test_compact_steps_under_vmap_match_each_element():
  # An ensemble of optimizers: the capacity check (a host callback) runs per element.
  tx = magma.sparse_state(optax.adam(LR), mode="compact", density=0.25)
  params = {"w": jnp.stack([jnp.full((4, 4), i + 1.0) for i in range(3)])}
  grads = {"w": jax.random.normal(jax.random.key(0), (3, 4, 4))}
  eye = jnp.eye(4, dtype=bool)
  fit = jnp.stack([eye, eye[::-1], eye])  # 4 active entries each: the capacity
  step = jax.jit(lambda g, s, p, m: tx.update(g, s, p, param_mask={"w": m}))
  batched = jax.jit(
    jax.vmap(lambda g, s, p, m: tx.update(g, s, p, param_mask={"w": m}))
  )
  u, _ = batched(grads, jax.vmap(tx.init)(params), params, fit)
  for i in range(3):
    p, g = {"w": params["w"][i]}, {"w": grads["w"][i]}
    want, _ = step(g, tx.init(p), p, fit[i])
    np.testing.assert_allclose(np.asarray(u["w"][i]), np.asarray(want["w"]))
  overflow = fit.at[2].set(~eye)  # 12 active entries in the third
  with pytest.raises(Exception, match="has 12 active entries"):
    jax.block_until_ready(batched(grads, jax.vmap(tx.init)(params), params, overflow))


def test_shards_arguments_are_checked():
  adam = optax.adam(LR)
  kw = dict(mode="compact", density=0.5)
  with pytest.raises(ValueError, match="give block too"):
    magma.sparse_state(adam, shards=(2, 1), **kw)
  with pytest.raises(ValueError, match="give block too"):
    magma.sparse_adam(LR, shards=(2, 1), **kw)
  for bad in ((0, 1), (2,), (2.0, 1), (True, 1), (np.bool_(True), 1), "x"):
    with pytest.raises(ValueError, match="shards must be"):
      magma.sparse_state(adam, block=(2, 2), shards=bad, **kw)
  numpy_ints = magma.sparse_state(adam, block=(2, 2), shards=(np.int64(2), 1), **kw)
  assert numpy_ints.init({"w": jnp.ones((4, 8))}).base_state[0].mu["w"].shape[:2] == (
    2,
    1,
  )
  params = {"w": jnp.ones((4, 8))}
  with pytest.raises(ValueError, match=r"leaf \['w'\] .* multiples of \(8, 2\)"):
    magma.sparse_state(adam, block=(2, 2), shards=(4, 1), **kw).init(params)
  bad = lambda path, leaf: (3, "x")
  with pytest.raises(ValueError, match=r"shards for leaf \['w'\] must be"):
    magma.sparse_state(adam, block=(2, 2), shards=bad, **kw).init(params)
  # A callable may give one part (None or (1, 1)): the leaf's plain tile storage.
  for one in (None, (1, 1)):
    tx = magma.sparse_state(adam, block=(2, 2), shards=lambda p, x, o=one: o, **kw)
    assert tx.init(params).base_state[0].mu["w"].shape == (4, 2, 2)
  tx = magma.sparse_state(adam, block=(2, 2), shards=lambda p, x: (2, 2), **kw)
  assert tx.init(params).base_state[0].mu["w"].shape == (2, 2, 1, 2, 2)
  # Counts for more axes than the leaf has, or a stacking axis they do not divide.
  with pytest.raises(
    ValueError, match=r"last 3 axes, but leaf \['w'\] has 2 \(shape \(4, 8\)"
  ):
    magma.sparse_state(adam, block=(2, 2), shards=(1, 1, 1), **kw).init(params)
  stacked = {"w": jnp.ones((3, 4, 8))}
  with pytest.raises(ValueError, match=r"multiples of \(2, 2, 2\)"):
    magma.sparse_state(adam, block=(2, 2), shards=(2, 1, 1), **kw).init(stacked)
  tx = magma.sparse_state(adam, block=(2, 2), shards=(3, 1, 2), **kw)
  assert tx.init(stacked).base_state[0].mu["w"].shape == (3, 1, 2, 2, 2, 2)


@pytest.mark.skipif(
  not magma.host_offload_available(), reason="no pinned_host memory kind"
)
def test_offload_of_a_bare_array_parameter_moves_its_moments_not_its_count():
  p, block = jnp.ones((8, 16)), (2, 2)  # tile buffers: not the parameter's shape
  tx = magma.sparse_state(
    optax.adam(LR), mode="offload", offload_after=1, block=block, density=0.25
  )
  state = tx.init(p)
  for _ in range(2):
    _, state = tx.update(p, state, p, param_mask=jnp.zeros((8, 16), bool))
    state = magma.offload_sparse_state(state, p)
  adam = state.base_state[0]
  assert adam.mu.sharding.memory_kind == "pinned_host"  # was left on the device
  assert adam.nu.sharding.memory_kind == "pinned_host"
  assert adam.count.sharding.memory_kind != "pinned_host"
  on = jnp.zeros((8, 16), bool).at[:2, :2].set(True)  # back from host: one tile
  u, state = jax.jit(tx.update)(p, state, p, param_mask=on)
  np.testing.assert_array_equal(np.asarray(u != 0), np.asarray(on))


@pytest.mark.skipif(
  not magma.host_offload_available(), reason="no pinned_host memory kind"
)
def test_tile_offload_placement_and_reactivation():
  params = {"a": jnp.ones((4, 8)), "b": jnp.ones((2, 8))}
  kw = dict(density=0.5, block=(2, 4))
  tx = magma.sparse_state(optax.adam(LR), mode="offload", offload_after=2, **kw)
  ref = magma.sparse_state(optax.adam(LR), mode="compact", **kw)
  state, ref_state = tx.init(params), ref.init(params)
  assert state.base_state[0].mu["a"].shape == (2, 2, 4)
  step, ref_step = jax.jit(tx.update), jax.jit(ref.update)
  on = jnp.zeros((4, 8), bool).at[:2, :4].set(True)  # 1 of 4 tiles
  kinds = []
  for t in range(7):
    mask = {"a": on if t in (0, 5, 6) else jnp.zeros((4, 8), bool),
            "b": jnp.zeros((2, 8), bool).at[:, :4].set(True)}  # fmt: skip
    grads = jax.tree.map(lambda x, t=t: jnp.full(x.shape, t + 1.0), params)
    u, state = step(grads, state, params, param_mask=mask)
    v, ref_state = ref_step(grads, ref_state, params, param_mask=mask)
    state = magma.offload_sparse_state(state, params)
    mu = state.base_state[0].mu
    kinds.append((mu["a"].sharding.memory_kind, mu["b"].sharding.memory_kind))
    for k in params:
      np.testing.assert_allclose(np.asarray(u[k]), np.asarray(v[k]), atol=1e-7)
      np.testing.assert_allclose(
        np.asarray(mu[k]), np.asarray(ref_state.base_state[0].mu[k]), atol=1e-7
      )
  device = jax.devices()[0].default_memory().kind
  # "a" has no active tile at steps 1..4: cold after 2, back when active at step 5.
  assert [k[0] for k in kinds] == [device, device] + ["pinned_host"] * 3 + [device] * 2
  assert all(k[1] == device for k in kinds)
  # The regrown tile restarted from zero moments, as in compact storage.
  assert float(jnp.abs(u["a"][:2, :4]).min()) > 0


def test_reverse_mode_through_unrolled_sparse_steps():
  # d loss(params after 3 steps) / d learning rate (a hypergradient): the compact
  # storages' zero-or-one-step loops become conds under jax.grad; skip storage's
  # step is a traced and re-evaluated jaxpr with barriers (magma_optax._freeze).
  # Checked against a central finite difference (tolerance 2 %).
  rng = np.random.default_rng(5)
  grads = [rng.normal(size=(4, 8)).astype(np.float32) for _ in range(3)]
  masks = [np.arange(32).reshape(4, 8) % (3 + t) == 0 for t in range(3)]

  def loss(lr, **kw):
    tx = magma.sparse_state(optax.adam(lr), **kw)
    p = {"w": jnp.ones((4, 8))}
    state = tx.init(p)
    for g, m in zip(grads, masks, strict=True):
      u, state = tx.update({"w": g * p["w"]}, state, p, param_mask={"w": m})
      p = optax.apply_updates(p, u)
    return jnp.sum(p["w"] ** 2)

  compact = {"mode": "compact", "density": 0.5}
  for kw in (compact, {**compact, "cache_index": False}, {"mode": "skip"}):
    got = float(jax.jit(jax.grad(functools.partial(loss, **kw)))(0.01))
    h, value = 1e-3, jax.jit(functools.partial(loss, **kw))  # one compile, two calls
    want = (float(value(0.01 + h)) - float(value(0.01 - h))) / (2 * h)
    np.testing.assert_allclose(got, want, rtol=2e-2)


OVERFLOW_ON_8_DEVICES = """
import os
flags = os.environ.get("XLA_FLAGS", "")  # the suite's own (LLVM -O0, tests/conftest.py)
os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import magma_optax as magma
for axis_type in (AxisType.Auto, AxisType.Explicit):
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(axis_type,) * 2)
  sharding = NamedSharding(mesh, P("x", "y"))
  with jax.set_mesh(mesh):
    p = {"w": jax.device_put(jnp.ones((8, 16)), sharding)}
    shards = magma.sharding.tile_shards(p)
    kw = dict(mode="compact", density=0.25, block=(2, 2), shards=shards)
    tx = magma.sparse_adam(0.1, **kw)
    state, step = magma.sharding.init(tx, p), jax.jit(tx.update)
    masks = np.zeros((2, 8, 16), bool)
    masks[0, :4, :4] = True  # 4 tiles in part (0, 0), which holds 1
    for a in range(2):  # 1 tile per part: fits
      for b in range(4):
        masks[1, 4 * a : 4 * a + 2, 4 * b : 4 * b + 2] = True
    bad, good = (jax.device_put(jnp.asarray(m), sharding) for m in masks)
    try:
      jax.block_until_ready(step(p, state, p, param_mask={"w": bad}))
      raise SystemExit("no error")
    except Exception as e:
      assert "part (0, 0) of the 2x4 shard parts" in str(e), str(e)[-500:]
    u, _ = step(p, state, p, param_mask={"w": good})  # the runtime still works
    assert int(jnp.sum(u["w"] != 0)) == 8 * 4
print("raised on every device")
# on_error="record" needs no mesh context: no callback, nothing for the other
# devices to wait for (raise mode without one aborts the process).
mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
sharding = NamedSharding(mesh, P("x", "y"))
p = {"w": jax.device_put(jnp.ones((8, 16)), sharding)}
tx = magma.sparse_adam(0.1, on_error="record", **kw)
state, step = tx.init(p), jax.jit(tx.update)
bad, good = (jax.device_put(jnp.asarray(m), sharding) for m in masks)
u, state = step(p, state, p, param_mask={"w": bad})
assert not jnp.any(u["w"]), u["w"]
try:
  magma.check_sparse_state(state)
  raise SystemExit("not recorded")
except ValueError as e:
  assert "part (0, 0) of the 2x4 shard parts" in str(e), str(e)
u, _ = step(p, state, p, param_mask={"w": good})
assert int(jnp.sum(u["w"] != 0)) == 8 * 4
print("recorded without a mesh context")
"""


def test_capacity_overflow_on_several_devices_is_an_error_not_an_abort():
  # A host callback runs on one device: the check's cond would leave the other
  # devices waiting at the next collective (XLA:CPU aborts after 40 s). Under
  # jax.set_mesh every device runs the check (shard_map) and all raise together.
  import subprocess
  import sys

  run = subprocess.run(
    [sys.executable, "-c", OVERFLOW_ON_8_DEVICES],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  assert "raised on every device" in run.stdout
  assert "recorded without a mesh context" in run.stdout


def test_numpy_scalar_density_is_a_float():
  params = {"w": jnp.ones((4, 8))}
  mask = {"w": jnp.arange(32).reshape(4, 8) % 4 == 0}
  outs = []
  for density in (0.25, np.float32(0.25), np.float64(0.25)):
    tx = magma.sparse_state(optax.adam(LR), mode="compact", density=density)
    state = tx.init(params)
    u, state = tx.update(params, state, params, param_mask=mask)
    outs.append(u["w"])
    assert jax.tree.leaves(state.base_state)[1].shape == (8,)  # ceil(0.25 * 32)
  for u in outs[1:]:
    np.testing.assert_array_equal(u, outs[0])


def test_tile_storage_on_explicit_axes_points_to_per_shard_storage():
  # jax.make_mesh's default axes are Explicit: compact tile storage refuses them,
  # and its message names the fix, shards=magma.sharding.tile_shards(params),
  # which (the control) then runs and matches the step without a mesh.
  mesh = jax.make_mesh((1, 1), ("x", "y"))
  assert mesh.axis_types == (AxisType.Explicit,) * 2
  p0 = np.arange(64, dtype=np.float32).reshape(8, 8)
  mask = np.zeros((8, 8), bool)
  mask[:2, :2] = True
  storage = dict(mode="compact", density=0.5, block=(2, 2))

  def step(tx, put):
    params, m = {"w": put(p0)}, {"w": put(mask)}
    return jax.jit(lambda p, s: tx.update(p, s, p, param_mask=m))(
      params, tx.init(params)
    )[0]["w"]

  want = step(magma.sparse_state(optax.adam(LR), **storage), jnp.asarray)
  with jax.set_mesh(mesh):
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("x", "y")))
    params = {"w": put(p0)}
    with pytest.raises(ValueError, match=r"shards=magma\.sharding\.tile_shards"):
      step(magma.sparse_state(optax.adam(LR), **storage), put)
    shards = magma.sharding.tile_shards(params)
    got = step(magma.sparse_state(optax.adam(LR), shards=shards, **storage), put)
  np.testing.assert_allclose(got, want, rtol=1e-6)
