"""Memory: Magma reads Adam's ``mu``; it adds no parameter-sized buffer of its own.

State bytes are counted on abstract states (``jax.eval_shape``: nothing allocated),
PRNG keys by their key data. The overhead of ``magma(optax.adam)`` over
``optax.adam`` must be exactly the per-block scores (f32) and masks (bool) plus a
handful of scalars.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from _hlo import entry_copies
from _hlo import entry_ops
from _hlo import fusions_computing

import magma_optax as magma
from magma_optax import kernels
from magma_optax._core import xla_cpu as _xla_cpu

PARAMS = {
  "attn": {"q_proj": {"kernel": jax.ShapeDtypeStruct((64, 64), jnp.float32)}},
  "mlp": {"up_proj": {"kernel": jax.ShapeDtypeStruct((64, 128), jnp.float32)}},
  "norm": {"scale": jax.ShapeDtypeStruct((64,), jnp.float32)},
}
NUM_PARAMS = 64 * 64 + 64 * 128 + 64
NUM_LEAVES = 3


def state_bytes(tx, params=PARAMS):
  state = jax.eval_shape(tx.init, params)
  total = 0
  for leaf in jax.tree.leaves(state):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.eval_shape(jax.random.key_data, leaf)
    total += math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
  return total


def scalar_bytes(num_labels):
  # mask count (int32), key (2 x uint32), active_fraction, one f32 per label.
  return 4 + 8 + 4 + 4 * num_labels


def test_magma_adam_adds_only_per_block_scores_and_masks():
  adam = state_bytes(optax.adam(1e-3))
  assert adam == 2 * 4 * NUM_PARAMS + 4  # mu, nu and a count
  overhead = state_bytes(magma.magma(optax.adam(1e-3))) - adam
  # Per leaf one f32 score and one bool mask (tensor blocks); labels: 3.
  assert overhead == NUM_LEAVES * (4 + 1) + scalar_bytes(num_labels=3)
  assert overhead < 0.001 * adam


@pytest.mark.parametrize(
  "granularity, num_blocks",
  [("row", 64 + 64 + 1), ("column", 64 + 128 + 1), ((8, 8), 64 + 128 + 1)],
)
def test_finer_blocks_cost_five_bytes_per_block(granularity, num_blocks):
  adam = state_bytes(optax.adam(1e-3))
  tx = magma.magma(optax.adam(1e-3), granularity=granularity, where=_matrices)
  overhead = state_bytes(tx) - adam
  # The norm scale is unscoped here (where=_matrices): no per-block state for it.
  assert overhead == (num_blocks - 1) * (4 + 1) + scalar_bytes(num_labels=2)


def _matrices(path, leaf):
  del path
  return leaf.ndim == 2


def test_momentum_is_read_from_the_base_not_copied():
  adam = state_bytes(optax.adam(1e-3))
  auto = state_bytes(magma.magma(optax.adam(1e-3)))
  own = state_bytes(magma.magma(optax.adam(1e-3), momentum="own"))
  # momentum="own" keeps a second param-sized EMA: exactly 4 bytes per parameter
  # more; the default reads Adam's mu and keeps none.
  assert own - auto == 4 * NUM_PARAMS
  assert auto - adam < 100


def test_bases_without_momentum_get_one_buffer_in_the_requested_dtype():
  rms = state_bytes(optax.rmsprop(1e-3))
  f32 = state_bytes(magma.magma(optax.rmsprop(1e-3)))
  bf16 = state_bytes(magma.magma(optax.rmsprop(1e-3), momentum_dtype=jnp.bfloat16))
  blocks = NUM_LEAVES * (4 + 1) + scalar_bytes(num_labels=3)
  assert f32 - rms == 4 * NUM_PARAMS + blocks
  assert bf16 - rms == 2 * NUM_PARAMS + blocks


def test_skip_update_adds_only_masks():
  adam = state_bytes(optax.adam(1e-3))
  skip = state_bytes(magma.skip_update(optax.adam(1e-3)))
  assert skip - adam == NUM_LEAVES * 1 + scalar_bytes(num_labels=3)


def test_update_step_needs_no_parameter_sized_scratch_in_f32():
  # XLA's own accounting of the compiled step: Magma's cosines fuse into the
  # reductions instead of materialising copies (f32 parameters; see the report for
  # bf16 on CPU).
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), PARAMS)

  def temp_bytes(tx):
    state = jax.eval_shape(tx.init, params)
    compiled = jax.jit(tx.update).lower(params, state, params).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
      pytest.skip("this backend reports no memory analysis")
    return analysis.temp_size_in_bytes

  adam = temp_bytes(optax.adam(1e-3))
  magma_temp = temp_bytes(magma.magma(optax.adam(1e-3)))
  # The largest leaf alone has 4 * 64 * 128 = 32 KiB; the scratch stays far below.
  assert magma_temp - adam < 4 * 64 * 128 / 4


DONATED = {
  "adam_magma": lambda: magma.adam_magma(1e-3, granularity="row"),
  # The per-leaf kernel (explicit block_sizes): the grouped kernel's program in the
  # generic interpreter is not what a device runs (its loop carries flat views and
  # copies them back); benchmarks/gpu_check.py checks it compiled for the GPU.
  "adam_magma pallas": lambda: magma.adam_magma(
    1e-3,
    granularity="row",
    implementation="pallas",
    interpret=True,
    block_sizes=kernels.BlockSizes(),
  ),
  "magma(adam)": lambda: magma.magma(optax.adam(1e-3), granularity="row"),
  "alignment_mask": lambda: optax.chain(magma.alignment_mask(), optax.adam(1e-3)),
}


@pytest.mark.parametrize("name", sorted(DONATED))
def test_donated_step_copies_no_moment(name):
  # Every step tests the block sums of the whole tree and, in a loop of zero or
  # one step, recomputes those that overflowed; that loop reads the moments (and
  # adam_magma's Pallas path reads m_{t-1}, which the kernel overwrites). Read
  # the wrong way, XLA copies every moment before the step overwrites its donated
  # buffer (measured: 1.7x -> 2.6x optax.adam on a 144-leaf tree). Checked on
  # the compiled, donated step.
  params = {"w": jnp.ones((48, 40)), "v": jnp.ones((40, 24))}
  tx = DONATED[name]()

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def step_keeping_the_old_state(p, s, g):  # positive control: must copy them
    u, new = tx.update(g, s, p)
    return optax.apply_updates(p, u), new, s

  def moment_copies(fn):
    args = (params, tx.init(params), params)
    return entry_copies(fn, args, r"f32\[(?:48,40|40,24)\]")

  assert not moment_copies(step)
  assert len(moment_copies(step_keeping_the_old_state)) >= 4


def _old_partial_sums(layout, mu, grad, param_mask=None):
  # The block sums as they were: masked copies of m and g, then three sums.
  m = jnp.where(param_mask, mu.astype(jnp.float32), 0.0)
  g = jnp.where(param_mask, grad.astype(jnp.float32), 0.0)
  return layout.block_sum(m * g), layout.block_sum(m * m), layout.block_sum(g * g)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_masked_adam_magma_step_writes_only_moments_and_params(
  granularity, monkeypatch
):
  # With a param_mask the block sums leave the pruned entries out. XLA:CPU wrote
  # where(mask, m, 0) and where(mask, g, 0) out before its reductions: two
  # leaf-sized temporaries per leaf, in fresh pages every step (6.2-6.5x
  # optax.adam's donated step at 4 M params, 2.0x without them). One reduction with
  # the selection inside leaves the entry computing m_t, v_t and the parameters.
  shape = (48, 256)
  params = {"w": jnp.ones(shape), "b": jnp.ones((256,))}
  mask = {"w": jnp.arange(48 * 256).reshape(shape) % 3 == 0, "b": None}
  tx = magma.adam_magma(1e-3, key=0, granularity=granularity)

  def leaf_sized():
    def step(p, s, g):  # a new function: traced again
      u, s = tx.update(g, s, p, param_mask=mask)
      return optax.apply_updates(p, u), s

    args = (params, tx.init(params), params)
    return entry_ops(step, args, r"f32\[48,256\]", "fusion")

  assert len(leaf_sized()) <= 3
  # Positive control: the old sums write the two masked copies (XLA:CPU).
  monkeypatch.setattr(magma.kernels.reference, "partial_sums", _old_partial_sums)
  if jax.default_backend() == "cpu":
    assert len(leaf_sized()) >= 5


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's fusion")
@pytest.mark.parametrize("kind", ["sparse_adam", "sparse_state"])
@pytest.mark.parametrize("block", [(1, 128), (8, 128), "2:4"])
def test_compact_update_is_computed_per_stored_entry_not_per_parameter(
  kind, block, monkeypatch
):
  # The expansion of the compact update into the parameter-shaped one reads it at
  # every parameter (tiles: a gather; N:M: a select among the n stored entries of
  # each group). XLA:CPU fused the compact Adam update into it, so its square
  # roots and divisions ran per parameter (N:M: n per parameter), not per stored
  # entry: tiles 1.1x optax.adam's donated step at 4 M params and d = 0.3, 0.7-0.8x
  # without.
  shape = (16, 256)
  params = {"w": jnp.ones(shape)}
  if block == "2:4":
    storage = {"structure": (2, 4)}
    mask = {"w": jnp.arange(16 * 256).reshape(shape) % 4 < 2}
  else:
    storage = {"density": 0.5, "block": block}
    r, c = block
    tiles = jnp.arange((16 // r) * (256 // c)).reshape(16 // r, 256 // c) % 2 == 0
    mask = {"w": jnp.repeat(jnp.repeat(tiles, r, 0), c, 1)}
  if kind == "sparse_adam":
    tx = magma.sparse_adam(1e-3, mode="compact", **storage)
  else:
    tx = magma.sparse_state(optax.adam(1e-3), mode="compact", **storage)

  def per_parameter():
    def step(p, s, g, m):  # a new function: traced again
      u, s = tx.update(g, s, p, param_mask=m)
      return optax.apply_updates(p, u), s

    # The mask an argument, as in training (a constant one could fold the branch).
    args = (params, tx.init(params), params, mask)
    return fusions_computing(step, args, r"f32\[16,256\]", "sqrt")

  assert not per_parameter()
  # Positive control: without the branch, XLA:CPU fuses the update into it.
  monkeypatch.setattr(_xla_cpu, "computed_once", lambda u, _: u)
  assert per_parameter()
