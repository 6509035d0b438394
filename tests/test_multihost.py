"""Multi-host safety: masks depend only on (key, step, leaf, block).

The guarantee (documented in magma_optax.sharding): the mask of leaf ``i`` at step
``t`` is ``bernoulli(fold_in(fold_in(key, t), crc32(keystr(path_i))), keep_prob,
block_shape)``. Nothing
else enters -- not the device count, the mesh, the shardings, the process, nor the
gradients -- so every host of a multi-host job draws the same masks.

Checked three ways: 8 devices vs 1 device (the sharding worker), two real JAX
processes (``jax.distributed`` with gloo on CPU, tests/_multiprocess_worker.py) vs
1 device, and the formula itself against ``jax.random`` called directly.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import zlib

import _sharding_runs as runs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma


@pytest.mark.parametrize("run", ["core", "explicit"])
def test_eight_devices_and_one_device_draw_identical_masks(run):
  got = runs.sharded_arrays(run)
  want = runs.reference(run)
  keys = [k for k in want if k.startswith("masks/")]
  assert len(keys) >= 20
  for k in keys:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert {k for k in got if k.startswith("masks/")} == set(keys)


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  """Two JAX processes (jax.distributed, gloo), 2 CPU devices each, one 2x2 mesh."""
  tmp = tmp_path_factory.mktemp("multiprocess")
  script = os.path.join(os.path.dirname(__file__), "_multiprocess_worker.py")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  port = str(_free_port())
  outs = [str(tmp / f"process{i}.npz") for i in range(2)]
  procs = [
    subprocess.Popen(
      [sys.executable, script, str(i), port, outs[i]],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs = [p.communicate(timeout=300)[0] for p in procs]
  if any(p.returncode for p in procs):
    pytest.fail("multi-process run failed:\n" + "\n".join(x[-3000:] for x in logs))
  results = []
  for out in outs:
    with np.load(out) as data:
      results.append(dict(data))
  return results


def test_two_processes_draw_the_masks_of_one_device(two_processes):
  want = runs.reference("core")
  for shards in two_processes:
    checked = 0
    for name, got in shards.items():
      if name.startswith("index/"):
        continue
      index = tuple(slice(a, b) for a, b in shards["index/" + name])
      expected = want[name.split("#")[0]][index]
      if name.startswith("masks/"):
        np.testing.assert_array_equal(got, expected, err_msg=name)
      else:  # parameters after the steps: same math, other reduction order
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5, err_msg=name)
      checked += 1
    assert checked >= 40
  # Each process holds different shards of the sharded parameters.
  name = "params['magma_adam_row']['both']#0"
  assert not np.array_equal(two_processes[0][name], two_processes[1][name])


TRANSFORMS = {
  "magma": lambda key, **kw: magma.magma(optax.adam(0.1), key=key, **kw),
  "skip_update": lambda key, **kw: magma.skip_update(optax.sgd(0.1), key=key, **kw),
  "bernoulli_mask": lambda key, **kw: magma.bernoulli_mask(0.5, key=key, **kw),
  "alignment_mask": lambda key, **kw: magma.alignment_mask(key=key, **kw),
}
PARAMS = {"a": jnp.ones((6, 4)), "b": jnp.ones((5,)), "c": jnp.ones((2, 3, 4))}


def _train_masks(tx, grad_seed, steps=4, params=PARAMS):
  """The block masks drawn at each step, as numpy, for gradients from grad_seed."""
  state = tx.init(params)
  update = jax.jit(tx.update)
  out = []
  for t in range(steps):
    key = jax.random.fold_in(jax.random.key(grad_seed), t)
    grads = {
      name: jax.random.normal(jax.random.fold_in(key, j), x.shape)
      for j, (name, x) in enumerate(sorted(params.items()))
    }
    _, state = update(grads, state, params)
    out.append(jax.tree.map(np.asarray, magma.mask_stats(state)["mask"]))
  return out


@pytest.mark.parametrize(
  "name, granularity",
  [(name, "row") for name in sorted(TRANSFORMS)] + [("magma", "tensor")],
)
def test_mask_is_the_documented_function_of_key_step_leaf_block(name, granularity):
  key = jax.random.key(1234)
  tx = TRANSFORMS[name](key, granularity=granularity)
  masks = _train_masks(tx, grad_seed=0, steps=3)
  paths_leaves = jax.tree_util.tree_flatten_with_path(PARAMS)[0]
  for t, step_masks in enumerate(masks):
    zs = jax.tree.leaves(step_masks)
    for i, ((path, x), z) in enumerate(zip(paths_leaves, zs, strict=True)):
      layout = magma.block_layout(x.shape, granularity)
      leaf_id = zlib.crc32(jax.tree_util.keystr(path).encode())
      want = jax.random.bernoulli(
        jax.random.fold_in(jax.random.fold_in(key, t), leaf_id),
        0.5,
        layout.block_shape,
      )
      np.testing.assert_array_equal(z, np.asarray(want), err_msg=f"step {t} leaf {i}")


def test_masks_ignore_gradients_and_parameter_values_but_not_the_key():
  tx = TRANSFORMS["magma"](7, granularity="row")
  a = _train_masks(tx, grad_seed=1)
  other_params = jax.tree.map(lambda x: -3.0 * x, PARAMS)
  b = _train_masks(tx, grad_seed=2, params=other_params)
  c = _train_masks(TRANSFORMS["magma"](8, granularity="row"), grad_seed=1)
  flat = lambda m: np.concatenate([z.ravel() for s in m for z in jax.tree.leaves(s)])
  np.testing.assert_array_equal(flat(a), flat(b))
  assert not np.array_equal(flat(a), flat(c))
  # Across steps the draws change (they are not one fixed mask).
  assert not np.array_equal(flat(a[:1]), flat(a[1:2]))


def test_stacked_blocks_draw_per_slice_from_the_same_formula():
  key = jax.random.key(5)
  params = {"layers": jnp.ones((3, 4, 4))}
  tx = magma.skip_update(optax.sgd(0.1), key=key, stack_axes=1)
  masks = _train_masks(tx, grad_seed=0, steps=2, params=params)
  for t, m in enumerate(masks):
    leaf_id = zlib.crc32(b"['layers']")
    want = jax.random.bernoulli(
      jax.random.fold_in(jax.random.fold_in(key, t), leaf_id), 0.5, (3,)
    )
    np.testing.assert_array_equal(m["layers"], np.asarray(want))
