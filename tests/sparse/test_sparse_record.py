"""Tests for ``on_error="record"`` of sparse_state / sparse_adam and check_sparse_state.

A step whose parameter mask fails a check of compact storage (capacity overflow, a
mask not made of whole tiles) raises nothing in record mode: the failing leaf keeps
its stored set (the mask is replaced by it), gets a zero update, and its first
failure is kept in ``SparseState.errors`` (per leaf: its kind and counts) until
``check_sparse_state`` raises it with the message that ``on_error="raise"`` gives.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma
from magma_optax.sparse import errors as _errors

LR = 0.05


def adam_sparse(**kw):
  return magma.sparse_state(optax.adam(LR), **kw)


def adam_fused(**kw):
  return magma.sparse_adam(LR, **kw)


def tiles_of(shape, block, tiles):
  """A mask of ``shape`` with the listed ``(i, j)`` tiles of ``block`` active."""
  m = np.zeros(shape, bool)
  r, c = block
  for i, j in tiles:
    m[i * r : (i + 1) * r, j * c : (j + 1) * c] = True
  return jnp.asarray(m)


def first(n, shape):
  return jnp.arange(math_prod(shape)).reshape(shape) < n


def math_prod(shape):
  return int(np.prod(shape))


# name: (factory, storage arguments, shape of the checked leaf "w", a mask that
# fits, a first failing mask, a second (other) failing mask)
CASES = {
  "flat": (
    adam_sparse,
    dict(mode="compact", density=0.25),
    (16,),
    first(4, (16,)),
    first(6, (16,)),
    first(9, (16,)),
  ),
  "N:M 2:4": (
    adam_sparse,
    dict(mode="compact", structure=(2, 4)),
    (4, 8),
    jnp.tile(jnp.asarray([True, False, True, False]), (4, 2)),
    jnp.tile(jnp.asarray([True, True, True, False]), (4, 2)),
    jnp.ones((4, 8), bool),
  ),
  "tiles": (
    adam_sparse,
    dict(mode="compact", density=0.25, block=(2, 4)),
    (4, 8),
    tiles_of((4, 8), (2, 4), [(1, 0)]),
    tiles_of((4, 8), (2, 4), [(0, 0), (1, 1)]),
    jnp.zeros((4, 8), bool).at[0, 0].set(True),  # not whole tiles
  ),
  "sparse_adam tiles": (
    adam_fused,
    dict(mode="compact", density=0.25, block=(2, 4)),
    (4, 8),
    tiles_of((4, 8), (2, 4), [(0, 1)]),
    jnp.zeros((4, 8), bool).at[3, 7].set(True),  # not whole tiles
    tiles_of((4, 8), (2, 4), [(0, 0), (1, 1)]),
  ),
  "sparse_adam tiles, shards=(2, 2)": (
    adam_fused,
    dict(mode="compact", density=0.25, block=(2, 2), shards=(2, 2)),
    (8, 8),
    tiles_of((8, 8), (2, 2), [(0, 0), (0, 3), (3, 0), (2, 2)]),  # 1 per part
    # 2 tiles in part (1, 1); part (0, 0) moves to another tile, which a failing
    # leaf must not do either (it keeps every part's stored tiles).
    tiles_of((8, 8), (2, 2), [(1, 1), (0, 3), (3, 0), (2, 2), (3, 3)]),
    tiles_of((8, 8), (2, 2), [(0, 0), (1, 1)]),  # 2 in part (0, 0)
  ),
}


CASES["flat, cache_index=False"] = (
  adam_sparse,
  dict(mode="compact", density=0.25, cache_index=False),
  *CASES["flat"][2:],
)


def raised(tx, state, params, mask):
  """The ValueError message of the raise-mode transform for this step (eager)."""
  with pytest.raises(ValueError) as e:
    tx.update(params, state, params, param_mask=mask)
  return str(e.value)


def without_errors(state):
  return state._replace(errors=optax.MaskedNode())


def cleared(state):
  """The state with no failure recorded (both modes' states record)."""
  return state._replace(errors=jnp.zeros_like(state.errors))


@pytest.mark.parametrize("case", list(CASES))
def test_a_failing_mask_is_recorded_and_the_leaf_left_on_its_stored_set(case):
  factory, kw, shape, good, bad, other = CASES[case]
  tx = factory(on_error="record", **kw)
  strict = factory(**kw)
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"w": jax.random.normal(keys[0], shape), "v": jnp.ones(shape)}
  grads = [
    {"w": jax.random.normal(k, shape), "v": jax.random.normal(k, shape) + 1.0}
    for k in keys[1:]
  ]
  fits_v = good  # the other leaf's mask always fits
  step = jax.jit(lambda g, s, m: tx.update(g, s, params, param_mask=m))

  state = tx.init(params)
  assert not any(np.any(np.asarray(e)) for e in jax.tree.leaves(state.errors))
  _, state = step(grads[0], state, {"w": good, "v": fits_v})
  magma.check_sparse_state(state)  # nothing recorded
  want = raised(strict, cleared(state), params, {"w": bad, "v": fits_v})

  u, failed = step(grads[1], state, {"w": bad, "v": fits_v})
  # The reference: the same step with the stored set (the mask that fitted).
  u_ref, ref = step(grads[1], state, {"w": good, "v": fits_v})
  np.testing.assert_array_equal(np.asarray(u["w"]), 0.0)
  assert np.any(np.asarray(u_ref["w"]) != 0)  # control: a zero update means it
  np.testing.assert_array_equal(np.asarray(u["v"]), np.asarray(u_ref["v"]))
  for a, b in zip(
    jax.tree.leaves(without_errors(failed)),
    jax.tree.leaves(without_errors(ref)),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError) as e:
    magma.check_sparse_state(failed)
  assert str(e.value) == want

  # Another failure later: the first one stays recorded.
  other_msg = raised(strict, cleared(failed), params, {"w": other, "v": fits_v})
  assert other_msg != want
  u, later = step(grads[2], failed, {"w": other, "v": fits_v})
  np.testing.assert_array_equal(np.asarray(u["w"]), 0.0)
  with pytest.raises(ValueError) as e:
    magma.check_sparse_state(later)
  assert str(e.value) == want
  # A mask that fits runs as usual (the record stays).
  u, later = step(grads[2], later, {"w": good, "v": fits_v})
  assert np.any(np.asarray(u["w"]) != 0)
  with pytest.raises(ValueError):
    magma.check_sparse_state(later)
  assert step._cache_size() == 1


def test_record_mode_raises_nothing_outside_jit_either():
  factory, kw, shape, good, bad, _ = CASES["tiles"]
  tx = factory(on_error="record", **kw)
  params = {"w": jnp.ones(shape)}
  state = tx.init(params)
  u, state = tx.update(params, state, params, param_mask={"w": bad})
  np.testing.assert_array_equal(np.asarray(u["w"]), 0.0)
  with pytest.raises(ValueError, match="has 2 active tiles"):
    magma.check_sparse_state(state)


def test_record_mode_compiles_no_host_callback():
  # One host callback in the compiled step makes XLA:CPU run every step
  # synchronously; record mode has none (the raise mode has one: the control).
  params = {"w": jnp.ones((4, 8))}
  mask = {"w": jnp.ones((4, 8), bool)}
  texts = {}
  for on_error in _errors.ON_ERROR:
    tx = adam_fused(mode="compact", density=0.5, block=(2, 4), on_error=on_error)
    step = jax.jit(lambda g, s, m, tx=tx: tx.update(g, s, params, param_mask=m))
    texts[on_error] = step.lower(params, tx.init(params), mask).as_text()
  assert "callback" in texts["raise"]
  assert "callback" not in texts["record"]


def test_check_sparse_state_finds_records_inside_wrappers_and_batches():
  params = {"w": jnp.ones((4, 8)), "v": jnp.full((4, 8), 0.1), "b": jnp.ones(8)}
  matrices = lambda path, x: x.ndim == 2  # noqa: E731
  inner = magma.sparse_adam(
    LR, mode="compact", density=0.25, block=(2, 4), on_error="record",
    where=matrices,
  )  # fmt: skip
  # A global top-k keeps half of the 8 tiles, all of them in "w" (the larger
  # |W| |g|): 4 > its capacity of 1, at the first refresh. (A count that init
  # can know to overflow is an error there: tests/sparse/test_sparse_bounds.py.)
  tx = optax.MultiSteps(
    magma.periodic_mask(
      inner, sparsity=0.5, block=(2, 4), start=0, every=10, where=matrices,
      ranking="global",
    ),
    every_k_schedule=1,
  )  # fmt: skip
  state = tx.init(params)
  magma.check_sparse_state(state)
  u, state = jax.jit(tx.update)(params, state, params)
  kept = np.asarray(state.inner_opt_state.mask["w"])
  assert kept.sum() == 32  # 4 tiles
  assert not np.asarray(state.inner_opt_state.mask["v"]).any()
  # The kept tiles get no update (nothing stored yet); periodic_mask zeroes the
  # pruned ones (-p); the dense leaf takes its step.
  np.testing.assert_array_equal(np.asarray(u["w"]), np.zeros((4, 8)))
  np.testing.assert_allclose(np.asarray(u["v"]), np.full((4, 8), -0.1))
  assert np.all(np.asarray(u["b"]) != 0)
  with pytest.raises(ValueError, match=r"leaf \['w'\] \(4 tiles of 2x4\) has 4"):
    magma.check_sparse_state(state)

  # A vmapped batch of states: one element fails.
  flat = magma.sparse_state(
    optax.adam(LR), mode="compact", density=0.25, on_error="record"
  )
  p = {"w": jnp.ones(8)}
  masks = jnp.stack([jnp.arange(8) < 2, jnp.arange(8) < 5])
  states = jax.vmap(lambda _: flat.init(p))(jnp.arange(2))
  step = jax.vmap(lambda s, m: flat.update(p, s, p, param_mask={"w": m}))
  _, states = step(states, masks[:1].repeat(2, 0))
  magma.check_sparse_state(states)  # both fit
  _, states = step(states, masks)
  with pytest.raises(ValueError, match="has 5 active entries"):
    magma.check_sparse_state(states)
  # Raise-mode states hold no record.
  magma.check_sparse_state(magma.sparse_state(optax.adam(LR)).init(p))
  # With several SparseStates holding records, the first in tree order.
  two = optax.multi_transform(
    {"a": flat, "b": flat}, {"w": "a", "x": "b"}
  )  # fmt: skip
  p2 = {"w": jnp.ones(8), "x": jnp.ones(8)}
  s2 = two.init(p2)
  m2 = {"w": jnp.arange(8) < 2, "x": jnp.arange(8) < 6}
  _, s2 = two.update(p2, s2, p2, param_mask=m2)
  m2 = {"w": jnp.arange(8) < 7, "x": jnp.arange(8) < 2}
  _, s2 = two.update(p2, s2, p2, param_mask=m2)
  with pytest.raises(ValueError, match=r"leaf \['w'\] \(size 8\) has 7"):
    magma.check_sparse_state(s2)


RESTORE_AND_CHECK = """
import sys
import jax, jax.numpy as jnp, numpy as np, optax
import magma_optax as magma
saved = np.load(sys.argv[1])
tx = magma.sparse_state(optax.adam(0.05), mode="compact", density=0.25,
                        on_error="record")
target = jax.eval_shape(tx.init, {"w": jnp.ones((4, 8)), "v": jnp.ones(16)})
leaves = [saved[f"a{i}"] for i in range(len(saved.files))]
state = jax.tree.unflatten(jax.tree.structure(target), leaves)
try:
  magma.check_sparse_state(state)
except ValueError as e:
  print(e)
"""


def test_a_restored_record_is_raised_in_full_without_a_step(tmp_path):
  # The record (kind and counts) is state; the message's static part (the leaf,
  # its size, the capacity) comes with the state's structure. A fresh process
  # that restores the state into the structure of tx.init -- no step traced
  # there -- raises the message the step's process would.
  p = {"w": jnp.ones((4, 8)), "v": jnp.ones(16)}
  masks = {"w": jnp.zeros((4, 8), bool), "v": jnp.ones(16, bool)}
  tx = adam_sparse(mode="compact", density=0.25, on_error="record")
  _, state = jax.jit(lambda g, s, m: tx.update(g, s, p, param_mask=m))(
    p, tx.init(p), masks
  )
  with pytest.raises(ValueError) as e:
    magma.check_sparse_state(state)
  assert "leaf ['v'] (size 16) has 16 active" in str(e.value)
  saved = tmp_path / "state.npz"
  np.savez(
    saved, **{f"a{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(state))}
  )
  run = subprocess.run(
    [sys.executable, "-c", RESTORE_AND_CHECK, str(saved)], capture_output=True,
    text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )  # fmt: skip
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.strip() == str(e.value)
  # Positive control: the same restore of a state without a failure raises nothing.
  clean = tx.init(p)
  np.savez(
    saved, **{f"a{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(clean))}
  )
  run = subprocess.run(
    [sys.executable, "-c", RESTORE_AND_CHECK, str(saved)], capture_output=True,
    text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )  # fmt: skip
  assert run.returncode == 0 and run.stdout.strip() == "", run.stderr[-3000:]


def test_record_steps_compile_the_same_program_in_every_trace():
  # What a record step compiles in (the kinds of its checks) must not depend on
  # the process: the persistent compilation cache, several processes compiling
  # one program.
  p = {"w": jnp.ones((4, 8)), "v": jnp.ones(16)}
  masks = {"w": jnp.ones((4, 8), bool) & False, "v": jnp.ones(16, bool)}

  def lowered():
    tx = adam_sparse(mode="compact", density=0.25, on_error="record")
    step = jax.jit(lambda g, s, m: tx.update(g, s, p, param_mask=m))
    return step.lower(p, tx.init(p), masks).as_text()

  assert lowered() == lowered()


def test_check_sparse_state_refuses_a_state_without_sparse_state():
  p = {"w": jnp.ones(8)}
  with pytest.raises(ValueError, match="holds no SparseState.*target"):
    magma.check_sparse_state(optax.adam(LR).init(p))
  with pytest.raises(ValueError, match="holds no SparseState"):
    magma.check_sparse_state({"base_state": {}, "errors": np.zeros(9, np.int32)})


def test_inject_hyperparams_with_where():
  p = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
  tx = optax.inject_hyperparams(
    magma.sparse_adam, static_args=magma.sparse_adam.static_args
  )(
    learning_rate=LR, mode="compact", density=0.5, block=(2, 4),
    where=lambda path, x: x.ndim == 2, on_error="record",
  )  # fmt: skip
  state = tx.init(p)
  mask = {"w": tiles_of((4, 8), (2, 4), [(0, 0)]), "b": jnp.ones(8, bool)}
  u, state = jax.jit(lambda s: tx.update(p, s, p, param_mask=mask))(state)
  assert int(jnp.sum(u["w"] != 0)) == 8
  assert np.all(np.asarray(u["b"]) != 0)
  magma.check_sparse_state(state)


@pytest.mark.parametrize("factory", [adam_sparse, adam_fused])
def test_bad_on_error_is_refused(factory):
  with pytest.raises(ValueError, match=r"on_error must be one of .*'warn'"):
    factory(mode="compact", density=0.5, on_error="warn")


def test_both_on_error_settings_record_and_share_their_state():
  # Both settings record failures in the state (a GPU step pays no callback), so
  # a state of either runs in the other, and what one recorded the other raises.
  p = {"w": jnp.ones(8)}
  kw = dict(mode="compact", density=0.25)
  recording, raising = adam_sparse(on_error="record", **kw), adam_sparse(**kw)
  fits, bad = {"w": jnp.arange(8) < 2}, {"w": jnp.arange(8) < 5}
  assert jax.tree.structure(recording.init(p)) == jax.tree.structure(raising.init(p))
  _, failed = recording.update(p, recording.init(p), p, param_mask=bad)
  with pytest.raises(ValueError, match="has 5 active entries"):
    raising.update(p, failed, p, param_mask=fits)
  _, ok = raising.update(p, recording.init(p), p, param_mask=fits)
  magma.check_sparse_state(ok)


def test_record_mode_steps_export_for_several_platforms():
  # jax.export cannot lower the default on_error="raise" host callback for several
  # platforms (nor serialize it); the docstring points exporters to "record". Its
  # step exports for CPU, CUDA and TPU at once, and the exported step run here
  # equals the jitted one bit for bit (keys compared by their data).
  p = {"w": jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)}
  m = {"w": jnp.arange(32).reshape(4, 8) % 3 == 0}
  cases = {
    "compact": (adam_sparse(mode="compact", density=0.5, on_error="record"), m),
    "tiles": (
      magma.sparse_adam(
        0.1, mode="compact", density=0.5, block=(1, 8), on_error="record"
      ),
      {"w": jnp.asarray([[True], [False], [True], [False]]) & jnp.ones((4, 8), bool)},
    ),
    "periodic_mask": (
      magma.periodic_mask(
        adam_sparse(mode="compact", density=0.5, on_error="record"),
        sparsity=0.5,
        every=1,
      ),
      None,
    ),
  }

  def data(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)

  for name, (tx, mask) in cases.items():
    kw = {} if mask is None else {"param_mask": mask}
    step = jax.jit(lambda p, s, tx=tx, kw=kw: tx.update(p, s, p, **kw))
    state = tx.init(p)
    exported = jax.export.export(step, platforms=("cpu", "cuda", "tpu"))(p, state)
    got, want = exported.call(p, state), step(p, state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(data(a), data(b), err_msg=name)
