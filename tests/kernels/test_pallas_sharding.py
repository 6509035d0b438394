"""The Pallas kernel on sharded leaves runs per shard: equal results, no gathers.

Runs in a subprocess on 8 forced CPU devices (the device count is fixed when jax
starts), the kernel in interpret mode, on a 2x4 mesh with Auto and with Explicit
axes (the two code paths of ``kernels.partitioned``: the SPMD partitioner's
callback, and ``shard_map`` when the types carry the shardings). Compared against
the unsharded XLA reference at relative tolerance 1e-4 (sums are reduced in another
order; float32 sums of up to 16384 terms). The compiled step must contain no
all-gather, and the outputs keep the gradient's partition spec.
"""

import _eight_devices

SCRIPT = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import magma_optax as magma
from magma_optax import kernels
from magma_optax.kernels import reference

XY, REP = P("x", "y"), P()
CASES = [  # shape, granularity, stack_axes, spec (or specs of g, m, v, p), masked
  ((64, 256), "tensor", 0, XY, False),
  ((64, 256), "row", 0, XY, True),
  ((8, 16, 128), "tensor", 1, P("x", None, "y"), False),
  ((64, 256), (4,), 0, XY, False),
  ((64, 256), "element", 0, P(None, "y"), True),
  # 128-entry tiles: a quarter of 256 columns holds no whole tile (kept whole).
  ((16, 256), (128,), 0, XY, False),
  # ZeRO-style: replicated gradient, sharded moments and params.
  ((16, 256), "row", 0, (REP, XY, XY, XY), True),
]
C = reference.AdamConstants()
out = {"devices": jax.device_count(), "cases": []}
for axis_type in (AxisType.Auto, AxisType.Explicit):
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(axis_type,) * 2)
  for shape, gran, stack, specs, masked in CASES:
    specs = specs if isinstance(specs, tuple) else (specs,) * 4
    spec = next((sp for sp in specs if sp != REP), REP)  # what the outputs keep
    layout = magma.block_layout(shape, gran, stack)
    ks = jax.random.split(jax.random.key(len(shape) + stack), 5)
    g, m, p = (jax.random.normal(k, shape) for k in ks[:3])
    v = jnp.abs(jax.random.normal(ks[3], shape))
    mask = jax.random.bernoulli(ks[4], 0.7, shape) if masked else None
    scale = jax.random.uniform(ks[4], layout.block_shape)

    def fused(g, m, v, p, mask, impl):
      return kernels.masked_adam(
          g, m, v, count=3, learning_rate=1e-2, weight_decay=0.01, params=p,
          param_mask=mask, scale=scale, layout=layout, implementation=impl,
          interpret=impl == "pallas")

    ref = jax.jit(fused, static_argnums=5)(g, m, v, p, mask, "xla")
    sh = NamedSharding(mesh, spec)
    args = [jax.device_put(a, NamedSharding(mesh, sp))
            for a, sp in zip((g, m, v, p), specs)]
    args.append(None if mask is None else jax.device_put(mask, sh))
    f = jax.jit(fused, static_argnums=5)
    res = f(*args, "pallas")
    hlo = f.lower(*args, "pallas").compile().as_text()
    err = max(float(jnp.max(jnp.abs(a - b) / (1e-3 + jnp.abs(b))))
              for a, b in zip(res, ref))
    out["cases"].append({
        "case": f"{axis_type} {shape} {gran} {specs}", "err": err,
        "all_gathers": len(re.findall(r"all-gather(-start)?\(", hlo)),
        "whole_tiles": not isinstance(gran, tuple) or shape[-1] % (4 * gran[0]) == 0,
        "all_reduces": len(re.findall(r"all-reduce(-start)?\(", hlo)),
        "update_spec": str(res.update.sharding.spec), "spec": str(sh.spec),
    })

# adam_magma with the Pallas kernel on sharded params equals one device (XLA).
mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
specs = {"w": ((64, 256), P("x", "y")), "b": ((256,), P("y"))}
params = {k: jax.random.normal(jax.random.key(i), s)
          for i, (k, (s, _)) in enumerate(specs.items())}
def run(impl, params):
  tx = magma.adam_magma(0.1, key=1, implementation=impl, interpret=impl == "pallas")
  def step(p, s):
    u, s = tx.update(jax.tree.map(lambda x: jnp.sin(3 * x) + 0.1, p), s, p)
    return optax.apply_updates(p, u), s
  f, s = jax.jit(step), tx.init(params)
  hlo = f.lower(params, s).compile().as_text()
  for _ in range(3):
    params, s = f(params, s)
  return params, len(re.findall(r"all-gather(-start)?\(", hlo))
p1, _ = run("xla", params)
p2, gathers = run("pallas", jax.device_put(
    params, {k: NamedSharding(mesh, sp) for k, (_, sp) in specs.items()}))
out["adam_magma"] = {
    "err": max(float(jnp.max(jnp.abs(a - b)))
               for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2))),
    "all_gathers": gathers,
    "w_spec_kept": p2["w"].sharding.spec == specs["w"][1],
}
print(json.dumps(out))
"""


def test_pallas_on_sharded_leaves_runs_per_shard():
  out = _eight_devices.run(SCRIPT)
  assert out["devices"] == 8
  assert len(out["cases"]) == 14
  for case in out["cases"]:
    assert case["err"] <= 1e-4, case
    # Shards without whole tiles get the last axis gathered (and cut after).
    assert (case["all_gathers"] == 0) == case["whole_tiles"], case
    assert case["update_spec"] == case["spec"], case
  # Blocks split over devices need their sums all-reduced (tensor, row, stacked).
  assert sum(c["all_reduces"] > 0 for c in out["cases"]) >= 6, out["cases"]
  am = out["adam_magma"]
  assert am["err"] <= 1e-6, am
  assert am["all_gathers"] == 0, am
  assert am["w_spec_kept"], am
