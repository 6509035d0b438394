"""One of two JAX processes (``jax.distributed``) training on a 4-device CPU mesh.

``python3 tests/_multiprocess_worker.py PROCESS_ID PORT OUT_NPZ``: each of the two
processes owns 2 CPU devices; together they run ``magma_adam_row`` and
``skip_update_sgd_element`` of tests/_sharding_worker.py sharded over all 4 devices
(a multi-host job in miniature, with gloo collectives) and save the shards they can
address, the masks they drew included. test_multihost.py compares both against the
one-device reference.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
  )
  os.environ["JAX_PLATFORMS"] = "cpu"

import _sharding_worker as worker  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import magma_optax as magma  # noqa: E402

CASES = ("magma_adam_row", "skip_update_sgd_element")


def main(process_id, port, out_npz):
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"localhost:{port}",
    num_processes=2,
    process_id=process_id,
  )
  assert jax.device_count() == 4 and jax.local_device_count() == 2
  mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  cases = {k: v for k, v in worker.core_transforms().items() if k in CASES}
  tx = worker.per_case({k: t for k, (t, _) in cases.items()})
  shardings = {
    case: {n: NamedSharding(mesh, spec) for n, (_, spec) in layout.items()}
    for case, (_, layout) in cases.items()
  }
  host_params = jax.tree.map(np.asarray, worker.initial_params(cases))
  params = jax.tree.map(
    lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]),
    host_params,
    shardings,
  )
  state_sh = {k: magma.sharding.state_shardings(cases[k][0], params[k]) for k in cases}
  state = jax.jit(tx.init, out_shardings=state_sh)(params)
  step = jax.jit(worker.train_step_fn(tx), out_shardings=(shardings, state_sh))
  out = {}
  for t in range(worker.STEPS):
    params, state = step(params, state)
    for path, z in jax.tree_util.tree_flatten_with_path(state)[0]:
      name = jax.tree_util.keystr(path)
      if ".mask[" in name:  # replicated or sharded: save what this process holds
        for i, shard in enumerate(z.addressable_shards):
          out[f"masks/step{t}/{name}#{i}"] = np.asarray(shard.data)
          out[f"index/masks/step{t}/{name}#{i}"] = _index(shard.index, z.shape)
  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = "params" + jax.tree_util.keystr(path)
    for i, shard in enumerate(p.addressable_shards):
      out[f"{name}#{i}"] = np.asarray(shard.data)
      out[f"index/{name}#{i}"] = _index(shard.index, p.shape)
  np.savez(out_npz, **out)
  jax.distributed.shutdown()


def _index(index, shape):
  """A shard's index (tuple of slices) as an int array [[start, stop], ...]."""
  return np.array(
    [s.indices(d)[:2] for s, d in zip(index, shape, strict=True)], np.int64
  ).reshape(len(shape), 2)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
