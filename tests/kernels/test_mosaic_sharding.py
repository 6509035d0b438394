"""The Mosaic TPU kernel on sharded leaves (``kernels.partitioned``), 8 CPU devices.

In a subprocess on 8 forced CPU devices (see ``_eight_devices``), the TPU kernel in
the TPU interpreter (``interpret="tpu"``) on a 2x4 mesh:

* Explicit axes: one kernel per shard under ``shard_map``, with the shard's block
  layout and the per-block sums all-reduced over the mesh axes that split a block.
  The compiled step has no all-gather, and the outputs keep the gradient's spec.
* Auto axes: the interpreter's ordered callbacks cannot pass through
  ``custom_partitioning``, so the kernel runs unpartitioned (documented in
  ``partitioned``); one case, checked for the values only.

Compared against the unsharded XLA reference at relative tolerance 1e-4 (f32 sums
of up to 16384 terms reduced in another order: per shard, then psum).
"""

import _eight_devices

SCRIPT = r"""
import json, re
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import magma_optax as magma
from magma_optax import kernels

CASES = [  # shape, granularity, stack_axes, spec, masked
  ((64, 256), "row", 0, P("x", "y"), True),  # rows split over y: sums psum'd
  ((8, 16, 128), "tensor", 1, P("x", None, "y"), False),
  ((64, 256), "tensor", 0, P("x", "y"), False),  # one block over all 8 devices
]
out = {"devices": jax.device_count(), "cases": []}
for axis_type in (AxisType.Explicit, AxisType.Auto):
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(axis_type,) * 2)
  # Auto axes: the values of one case (the kernel runs unpartitioned there).
  cases = CASES if axis_type == AxisType.Explicit else CASES[:1]
  for shape, gran, stack, spec, masked in cases:
    layout = magma.block_layout(shape, gran, stack)
    ks = jax.random.split(jax.random.key(len(shape) + stack + masked), 5)
    g, m, p = (jax.random.normal(k, shape) for k in ks[:3])
    v = jnp.abs(jax.random.normal(ks[3], shape))
    mask = jax.random.bernoulli(ks[4], 0.7, shape) if masked else None
    scale = jax.random.uniform(ks[4], layout.block_shape)

    def fused(g, m, v, p, mask, impl):
      return kernels.masked_adam(
          g, m, v, count=3, learning_rate=1e-2, weight_decay=0.01, params=p,
          param_mask=mask, scale=scale, layout=layout, implementation=impl,
          interpret="tpu" if impl == "pallas" else False)

    ref = jax.jit(fused, static_argnums=5)(g, m, v, p, mask, "xla")
    sh = NamedSharding(mesh, spec)
    args = [jax.device_put(a, sh) for a in (g, m, v, p)]
    args.append(None if mask is None else jax.device_put(mask, sh))
    f = jax.jit(fused, static_argnums=5)
    res = f(*args, "pallas")
    hlo = f.lower(*args, "pallas").compile().as_text()
    err = max(float(jnp.max(jnp.abs(a - b) / (1e-3 + jnp.abs(b))))
              for a, b in zip(res, ref))
    out["cases"].append({
        "case": f"{axis_type} {shape} {gran}",
        "explicit": axis_type == AxisType.Explicit,
        "err": err, "all_gathers": len(re.findall(r"all-gather(-start)?\(", hlo)),
        "all_reduces": len(re.findall(r"all-reduce(-start)?\(", hlo)),
        "update_spec": str(res.update.sharding.spec), "spec": str(sh.spec),
    })
print(json.dumps(out))
"""


def test_tpu_kernel_on_sharded_leaves():
  out = _eight_devices.run(SCRIPT)
  assert out["devices"] == 8
  assert len(out["cases"]) == 4
  for case in out["cases"]:
    assert case["err"] <= 1e-4, case
    if case["explicit"]:  # per shard: no gathered leaf, the spec kept
      assert case["all_gathers"] == 0, case
      assert case["update_spec"] == case["spec"], case
  # Every case has blocks split over devices: their sums need an all-reduce.
  assert all(c["all_reduces"] > 0 for c in out["cases"] if c["explicit"]), out
