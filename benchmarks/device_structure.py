"""What the dense step's program holds on a device, lowered on this machine.

For each dense transform, its jitted step (update, then ``optax.apply_updates``)
on 4 leaves of 256 x 1024 is lowered for CUDA and for the CPU, and the
data-dependent ``while`` / ``case`` / ``if`` of the program are counted (what XLA:GPU
runs by reading a predicate back to the host; ``tests/_hlo.py`` says what counts).
Then ``adam_magma(implementation="pallas")`` on a transformer-shaped tree of 48
leaves is lowered for CUDA and for a TPU, and its Pallas kernel calls are counted.
No device is needed: jax lowers for one that is not attached (CUDA under an
abstract GPU device, as Pallas' Triton lowering asks for). With ``--sparse``, the
sparse steps instead: ``periodic_mask`` around Adam and the sparse storages, and
``sparse_state`` / ``sparse_adam`` given a parameter mask, on 2 leaves of 256 x 512:
their control flow reached on every step (not inside the refresh gate), all of it,
and whether a host callback is compiled.

Usage::

    python3 benchmarks/device_structure.py [--sparse]
"""

from __future__ import annotations

import pathlib
import sys
import warnings

import jax
import jax.numpy as jnp
import optax

import magma_optax as magma

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "tests"))
import _hlo  # noqa: E402  the tests' counting helper

TRANSFORMS = {
  "optax.adam": lambda: optax.adam(1e-3),
  "magma(adam)": lambda: magma.magma(optax.adam(1e-3)),
  "skip_update(adam)": lambda: magma.skip_update(optax.adam(1e-3)),
  "chain(alignment_mask, adam)": lambda: optax.chain(
    magma.alignment_mask(), optax.adam(1e-3)
  ),
  "chain(adam, bernoulli_mask)": lambda: optax.chain(
    optax.adam(1e-3), magma.bernoulli_mask(0.5)
  ),
  "chain(adam, damping)": lambda: optax.chain(optax.adam(1e-3), magma.damping(0.1)),
  "adam_magma[xla]": lambda: magma.adam_magma(1e-3, implementation="xla"),
  "adam_magma[pallas]": lambda: magma.adam_magma(1e-3, implementation="pallas"),
}


def step_of(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def transformer(layers: int = 3, width: int = 32):
  """16 leaves a layer: attention q, k, v, o and MLP up, down (kernels and biases),
  two norms (scale and bias)."""

  def w(*shape):
    return jnp.ones(shape, jnp.float32)

  def layer():
    return {
      "attn": {n: {"kernel": w(width, width), "bias": w(width)} for n in "qkvo"},
      "mlp": {
        "up": {"kernel": w(width, 4 * width), "bias": w(4 * width)},
        "down": {"kernel": w(4 * width, width), "bias": w(width)},
      },
      "ln_1": {"scale": w(width), "bias": w(width)},
      "ln_2": {"scale": w(width), "bias": w(width)},
    }

  return {f"layer_{i}": layer() for i in range(layers)}


def lowered(tx, params, platform):
  step = step_of(tx)
  return _hlo.lowered(step, params, tx.init(params), params, platform=platform)


def sparse_transforms():
  """name -> (transform, param_mask or None, extra args)."""
  ramp = optax.linear_schedule(0.5, 0.75, 100)

  def pm(inner, **kw):
    return magma.periodic_mask(inner, every=100, **kw)

  def ss(**kw):
    return magma.sparse_state(optax.adam(1e-3), **kw)

  tiles = dict(density=0.5, block=(8, 128))
  tile_mask = jnp.kron(jnp.eye(32, 4), jnp.ones((8, 128))) > 0
  quarter = jnp.arange(256 * 512).reshape(256, 512) % 4 == 0
  adam = optax.adam(1e-3)
  return {
    "pm(adam), per leaf": (pm(adam, sparsity=0.75), None, {}),
    "pm(adam), global, ramp": (pm(adam, sparsity=ramp, ranking="global"), None, {}),
    "pm(adam), N:M 2:4": (pm(adam, structure=(2, 4)), None, {}),
    "pm(adam), tiles 8x128": (pm(adam, sparsity=0.5, block=(8, 128)), None, {}),
    "pm(adam), refresh=False": (pm(adam, sparsity=0.75), None, {"refresh": False}),
    "pm(skip)": (pm(ss(), sparsity=0.75), None, {}),
    "pm(compact), ramp": (pm(ss(mode="compact", density=0.5), sparsity=ramp), None, {}),
    "pm(sparse_adam tiles)": (
      pm(
        magma.sparse_adam(1e-3, mode="compact", **tiles), sparsity=0.5, block=(8, 128)
      ),
      None,
      {},
    ),
    "sparse_state compact + mask": (ss(mode="compact", density=0.25), quarter, {}),
    "sparse_state N:M + mask": (ss(mode="compact", structure=(2, 4)), quarter, {}),
    "sparse_state tiles + mask": (ss(mode="compact", **tiles), tile_mask, {}),
    "sparse_state offload + mask": (ss(mode="offload", **tiles), tile_mask, {}),
    "sparse_adam tiles + mask": (
      magma.sparse_adam(1e-3, mode="compact", **tiles),
      tile_mask,
      {},
    ),
  }


def sparse_main():
  print(f"# jax {jax.__version__}, sparse steps lowered for CUDA")
  print("\n| step | every step: while / case / if | in all | host callback |")
  print("|---|---|---|---|")
  params = {"a": jnp.ones((256, 512)), "b": jnp.ones((256, 512))}

  def fmt(c):
    return f"{c['while']} / {c['case']} / {c['if']}"

  for name, (tx, mask, extra) in sparse_transforms().items():

    def step(p, s, *m, tx=tx, extra=extra):
      args = {"param_mask": {"a": m[0], "b": m[0]}} if m else {}
      u, s = tx.update(p, s, p, **args, **extra)
      return optax.apply_updates(p, u), s

    args = (params, tx.init(params), *(() if mask is None else (mask,)))
    try:
      # Not under an abstract GPU mesh: no Pallas kernel here, and jax 0.12
      # refuses periodic_mask's first target (evaluated at trace time) there.
      text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      cells = [
        fmt(_hlo.top_level_control_flow(text)),
        fmt(_hlo.data_dependent_control_flow(text)),
        "yes" if "callback" in text else "no",
      ]
    except Exception as e:  # noqa: BLE001 - reported, as the table's cell
      cells = [f"fails: {type(e).__name__}", "", ""]
    print(f"| {name} | " + " | ".join(cells) + " |")


def main():
  warnings.simplefilter("ignore")  # jax's Triton deprecation warning
  if "--sparse" in sys.argv[1:]:
    sparse_main()
    return
  print(f"# jax {jax.__version__}, lowered on {jax.default_backend()}")
  print("\n| step | CUDA: while / case / if | CPU: while / case / if |")
  print("|---|---|---|")
  params = {f"w{i}": jnp.ones((256, 1024)) for i in range(4)}
  for name, make in TRANSFORMS.items():
    cells = []
    for platform in ("cuda", "cpu"):
      try:
        c = _hlo.data_dependent_control_flow(lowered(make(), params, platform))
        cells.append(f"{c['while']} / {c['case']} / {c['if']}")
      except Exception as e:  # noqa: BLE001 - reported, as the table's cell
        cells.append(f"fails: {type(e).__name__}")
    print(f"| {name} | {cells[0]} | {cells[1]} |")
  tree = transformer()
  n = len(jax.tree.leaves(tree))
  print(f"\n| adam_magma[pallas], {n} leaves | Pallas kernel calls |")
  print("|---|---:|")
  for platform in ("cuda", "tpu"):
    tx = magma.adam_magma(1e-3, implementation="pallas")
    try:
      calls = _hlo.pallas_calls(lowered(tx, tree, platform))
    except Exception as e:  # noqa: BLE001 - reported, as the table's cell
      calls = f"fails: {type(e).__name__}"
    print(f"| lowered for {platform} | {calls} |")


if __name__ == "__main__":
  main()
