"""What the dense step's program holds on a device, lowered on this machine.

For each dense transform, its jitted step (update, then ``optax.apply_updates``)
on 4 leaves of 256 x 1024 is lowered for CUDA and for the CPU, and the
data-dependent ``while`` / ``case`` / ``if`` of the program are counted (what XLA:GPU
runs by reading a predicate back to the host; ``tests/_hlo.py`` says what counts).
Then ``adam_magma(implementation="pallas")`` on a transformer-shaped tree of 48
leaves is lowered for CUDA and for a TPU, and its Pallas kernel calls are counted.
No device is needed: jax lowers for one that is not attached (CUDA under an
abstract GPU device, as Pallas' Triton lowering asks for).

Usage::

    python3 benchmarks/device_structure.py
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


def main():
  warnings.simplefilter("ignore")  # jax's Triton deprecation warning
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
