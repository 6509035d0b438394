"""Checkpoints (orbax-checkpoint): save mid-run, restore in a fresh process, go on.

The optimizer state holds a typed PRNG key (``jax.random.key``); orbax-checkpoint
0.12 saves and restores typed keys as they are, so no conversion is needed. The
restored run must be *bitwise* identical to the uninterrupted one -- parameters and
masks at every step, and the final optimizer state.
"""

from __future__ import annotations

import os
import subprocess
import sys

import _checkpoint_worker as worker
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma

ocp = pytest.importorskip("orbax.checkpoint")

BEFORE, AFTER = 2, 3
WORKER = os.path.join(os.path.dirname(__file__), "_checkpoint_worker.py")


def _save(path, tree):
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("ckpt")
  params, tx, step = worker.problem()
  state = tx.init(params)
  params, state, _ = worker.train(params, state, step, BEFORE)
  ckpt = str(tmp / "step2")
  _save(ckpt, {"params": params, "opt_state": state})
  # The uninterrupted run continues from the in-memory state.
  _, final_state, trajectory = worker.train(params, state, step, AFTER)
  out = str(tmp / "resumed.npz")
  proc = subprocess.run(
    [sys.executable, WORKER, ckpt, out, str(AFTER)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  with np.load(out) as data:
    resumed = dict(data)
  return {
    "ckpt": ckpt,
    "trajectory": trajectory,
    "final": worker.flatten(final_state, "final/state"),
    "resumed": resumed,
    "params": params,
    "tx": tx,
  }


def test_resumed_trajectory_is_bitwise_identical(runs):
  resumed, want = runs["resumed"], runs["trajectory"] | runs["final"]
  assert set(want) <= set(resumed)
  for k, v in want.items():
    assert resumed[k].dtype == v.dtype, k
    np.testing.assert_array_equal(resumed[k], v, err_msg=k)
  # The masks are real draws (some blocks dropped, some kept) over the continued steps.
  masks = np.concatenate([v.ravel() for k, v in want.items() if "/mask" in k])
  assert 0 < masks.mean() < 1


def test_typed_key_survives_the_round_trip(runs):
  assert str(runs["resumed"]["key_dtype"]) == "key<fry>"
  restored = worker.restore(runs["ckpt"], runs["params"], runs["tx"])
  key = restored["opt_state"].mask_state.key
  assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(jax.random.key_data(key), [0, 17])


def test_restoring_into_a_different_tree_is_a_clear_error(runs):
  params = runs["params"]
  bigger = {**params, "extra": jnp.zeros((3,))}
  target = {
    "params": jax.eval_shape(lambda: bigger),
    "opt_state": magma.sharding.abstract_state(runs["tx"], bigger),
  }
  with ocp.StandardCheckpointer() as checkpointer:
    with pytest.raises(ValueError, match="extra"):  # names the missing entry
      checkpointer.restore(runs["ckpt"], target)


def test_restoring_another_optimizers_state_is_a_clear_error(runs):
  skip = magma.skip_update(optax.adam(0.05), key=17, granularity="row")
  target = {
    "params": jax.eval_shape(lambda: runs["params"]),
    "opt_state": magma.sharding.abstract_state(skip, runs["params"]),
  }
  with ocp.StandardCheckpointer() as checkpointer:
    with pytest.raises(ValueError, match="[Ss]tructure|mismatch|not found"):
      checkpointer.restore(runs["ckpt"], target)


def test_a_state_for_other_params_is_rejected_at_update(runs):
  # A state restored without a target and fed to the wrong parameters fails loudly
  # at the first update instead of silently masking the wrong leaves.
  params, tx = runs["params"], runs["tx"]
  state = tx.init(params)
  other = {"w": params["w"]}
  with pytest.raises(ValueError):
    tx.update(other, state, other)
