"""adam_magma (XLA path) on a 2x4 mesh of forced CPU devices equals one device.

Runs in a subprocess (the device count is fixed when jax starts). Tolerance: 1e-6
absolute on parameters of order 1 after 3 steps (the sharded block sums are reduced
in another order). The compiled step must contain no all-gather: per-block sums
are all-reduced, parameter-sized arrays are never gathered (a step built to gather
one is the count's positive control).
"""

import _eight_devices

SCRIPT = r"""
import json, re, sys
import jax, jax.numpy as jnp, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import magma_optax as magma

mesh = jax.make_mesh((2, 4), ("x", "y"))
specs = {"w": ((64, 32), P("x", "y")), "v": ((16, 128), P(None, "y")),
         "b": ((32,), P("y"))}
params = {k: jax.random.normal(jax.random.key(i), s)
          for i, (k, (s, _)) in enumerate(specs.items())}
out = {}
for gran in ("tensor", "column"):
  tx = magma.adam_magma(0.1, key=1, granularity=gran, weight_decay=0.01,
                        implementation="xla")
  def step(p, s):
    g = jax.tree.map(lambda x: jnp.sin(3 * x) + 0.1, p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  f = jax.jit(step)
  p1, s1 = params, tx.init(params)
  for _ in range(3):
    p1, s1 = f(p1, s1)
  shard = {k: NamedSharding(mesh, sp) for k, (_, sp) in specs.items()}
  p2 = jax.device_put(params, shard)
  s2 = tx.init(p2)
  hlo = f.lower(p2, s2).compile().as_text()
  for _ in range(3):
    p2, s2 = f(p2, s2)
  out[gran] = {
    "err": max(float(jnp.max(jnp.abs(a - b)))
               for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2))),
    "all_gathers": len(re.findall(r"all-gather(-start)?\(", hlo)),
    "still_sharded": p2["w"].sharding.spec == P("x", "y"),
    "devices": jax.device_count(),
  }
# Positive control for the count above: a step built to gather a sharded leaf.
w = jax.device_put(params["w"], NamedSharding(mesh, P("x", "y")))
gather = jax.jit(lambda w: 2 * w, out_shardings=NamedSharding(mesh, P()))
control = gather.lower(w).compile().as_text()
out["control_all_gathers"] = len(re.findall(r"all-gather(-start)?\(", control))
print(json.dumps(out))
"""


def test_sharded_equals_one_device_without_gathers():
  out = _eight_devices.run(SCRIPT)
  assert out.pop("control_all_gathers") >= 1  # the count does see a gather
  for gran, r in out.items():
    assert r["devices"] == 8
    assert r["err"] <= 1e-6, (gran, r)
    assert r["all_gathers"] == 0, (gran, r)
    assert r["still_sharded"], gran
