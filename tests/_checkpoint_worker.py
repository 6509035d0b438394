"""Restores a checkpoint in a fresh process and continues training (test_checkpoint).

``python3 tests/_checkpoint_worker.py CKPT_DIR OUT_NPZ STEPS`` restores the
parameters and optimizer state saved by the test with orbax-checkpoint, runs STEPS
more steps and saves the trajectory (parameters, masks and final state) to OUT_NPZ.
Importing the module only defines the problem both processes share.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import magma_optax as magma


def problem():
  """(initial params, optimizer, jitted train step) -- identical in every process."""
  key = jax.random.key(0)
  params = {
    "w": jax.random.normal(key, (8, 4)),
    "b": jnp.zeros((4,)),
  }
  x = jax.random.normal(jax.random.fold_in(key, 1), (16, 8))
  y = jnp.sin(x[:, :4])
  tx = magma.magma(optax.adam(0.05), key=17, granularity="row")

  @jax.jit
  def step(params, state):
    def loss(p):
      return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)

    grads = jax.grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return params, tx, step


def flatten(tree, prefix):
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    out[prefix + jax.tree_util.keystr(path)] = np.asarray(leaf)
  return out


def train(params, state, step, steps):
  """Runs ``steps`` steps; returns (params, state, trajectory arrays by name)."""
  trajectory = {}
  for t in range(steps):
    params, state = step(params, state)
    trajectory |= flatten(params, f"step{t}/params")
    trajectory |= flatten(magma.mask_stats(state)["mask"], f"step{t}/mask")
  return params, state, trajectory


def restore(ckpt_dir, params_like, tx):
  """Restores {"params", "opt_state"} with the right dtypes (typed keys included)."""
  import orbax.checkpoint as ocp

  target = {
    "params": jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      params_like,
    ),
    "opt_state": magma.sharding.abstract_state(tx, params_like),
  }
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(ckpt_dir, target)


def main(ckpt_dir, out_npz, steps):
  params, tx, step = problem()
  restored = restore(ckpt_dir, params, tx)
  params, state, trajectory = train(
    restored["params"], restored["opt_state"], step, steps
  )
  key_dtype = str(state.mask_state.key.dtype)
  np.savez(
    out_npz,
    key_dtype=np.array(key_dtype),
    **trajectory,
    **flatten(state, "final/state"),
  )


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
