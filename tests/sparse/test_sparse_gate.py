"""The ordinary sparse step on a device: one gate for the whole tree, no host
callback, and failures recorded in the state (``docs/sparse.md``).

The programs are lowered for CUDA on this machine and their data-dependent control
flow counted (``tests/_hlo.py``: what XLA:GPU runs by reading a predicate back to
the host); each count has a positive control in the same test.
"""

from __future__ import annotations

import re

import _hlo
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma

LR = 1e-2
PARAMS = {"a": jnp.ones((16, 32)), "b": jnp.ones((32, 16))}
RAMP = optax.linear_schedule(0.5, 0.75, 100)


def ss(**kw):
  return magma.sparse_state(optax.adam(LR), **kw)


def tiles_adam(mode="compact"):
  return magma.sparse_adam(LR, mode=mode, density=0.5, block=(8, 8))


# periodic_mask around every storage, with each kind of mask it makes.
WRAPPED = {
  "adam, per leaf": lambda: magma.periodic_mask(optax.adam(LR), sparsity=0.75, every=4),
  "adam, global, ramp": lambda: magma.periodic_mask(
    optax.adam(LR), sparsity=RAMP, every=4, ranking="global"
  ),
  "adam, tiles": lambda: magma.periodic_mask(
    optax.adam(LR), sparsity=0.5, block=(8, 8), every=4
  ),
  "skip": lambda: magma.periodic_mask(ss(), sparsity=0.75, every=4),
  "compact, ramp": lambda: magma.periodic_mask(
    ss(mode="compact", density=0.5), sparsity=RAMP, every=4
  ),
  "N:M": lambda: magma.periodic_mask(
    ss(mode="compact", structure=(2, 4)), structure=(2, 4), every=4
  ),
  "sparse_adam tiles": lambda: magma.periodic_mask(
    tiles_adam(), sparsity=0.5, block=(8, 8), every=4
  ),
  "offload tiles": lambda: magma.periodic_mask(
    tiles_adam("offload"), sparsity=0.5, block=(8, 8), every=4
  ),
}
TILE_MASK = {
  k: jnp.kron(jnp.eye(x.shape[0] // 8, x.shape[1] // 8), jnp.ones((8, 8))) > 0
  for k, x in PARAMS.items()
}
QUARTER = {k: jnp.arange(x.size).reshape(x.shape) % 4 == 0 for k, x in PARAMS.items()}
# sparse_state / sparse_adam given a parameter mask, on_error="raise" (default).
MASKED = {
  "compact": (lambda: ss(mode="compact", density=0.25), QUARTER),
  "N:M": (lambda: ss(mode="compact", structure=(2, 4)), QUARTER),
  "tiles": (lambda: ss(mode="compact", density=0.5, block=(8, 8)), TILE_MASK),
  "offload": (lambda: ss(mode="offload", density=0.5, block=(8, 8)), TILE_MASK),
  "sparse_adam tiles": (tiles_adam, TILE_MASK),
}


def lowered(tx, *mask, platform="cuda", **extra):
  def step(p, s, *m):
    args = {"param_mask": m[0]} if m else {}
    u, s = tx.update(p, s, p, **args, **extra)
    return optax.apply_updates(p, u), s

  # Not under _hlo.abstract_gpu (no Pallas kernel here): on jax 0.12 periodic_mask
  # evaluates its first target eagerly, which an abstract mesh refuses.
  traced = jax.jit(step).trace(PARAMS, tx.init(PARAMS), *mask)
  return traced.lower(lowering_platforms=(platform,)).as_text()


def total(counts):
  return sum(counts.values())


@pytest.mark.parametrize("name", list(WRAPPED))
def test_periodic_mask_steps_hold_one_gate_and_ordinary_steps_none(name):
  tx = WRAPPED[name]()
  gated = lowered(tx)
  # The default: one data-dependent branch at the top, the refresh's gate.
  assert total(_hlo.top_level_control_flow(gated)) == 1
  # Positive control: refresh=True (XLA:CPU's structure) runs the refresh in a
  # loop of its own at the top, which the same count sees.
  assert total(_hlo.top_level_control_flow(lowered(tx, refresh=True))) >= 1
  # The ordinary step of a loop that refreshes by itself: no branch at all.
  assert total(_hlo.data_dependent_control_flow(lowered(tx, refresh=False))) == 0


@pytest.mark.parametrize("name", list(MASKED))
def test_masked_steps_hold_one_gate_and_no_callback(name):
  make, mask = MASKED[name]
  tx = make()
  cuda = lowered(tx, mask)
  # At most the gate that moves the stored sets, for the whole tree.
  assert total(_hlo.top_level_control_flow(cuda)) <= 1
  assert "callback" not in cuda
  # Positive control: lowered for XLA:CPU, on_error="raise" keeps its callback
  # (the regex finds it), which raises the error in the step there.
  assert re.search(r"custom_call @\w*callback", lowered(tx, mask, platform="cpu"))


def run(tx, refresh_of, steps=6):
  """``steps`` jitted steps on a quadratic loss; ``refresh_of(t)``: the extra
  argument ``refresh`` of step ``t`` (``None``: not passed)."""
  params = {"a": jnp.linspace(-1.0, 1.0, 512).reshape(16, 32), "b": PARAMS["b"]}
  state = tx.init(params)

  def step(p, s, t, *, refresh=None):
    g = jax.tree.map(lambda x: x * jnp.cos(t + x), p)
    extra = {} if refresh is None else {"refresh": refresh}
    u, s = tx.update(g, s, p, **extra)
    return optax.apply_updates(p, u), s

  step = jax.jit(step, static_argnames="refresh")
  for t in range(steps):
    params, state = step(params, state, jnp.float32(t), refresh=refresh_of(t))
  return params, state


@pytest.mark.parametrize("name", ["compact, ramp", "sparse_adam tiles"])
def test_a_loop_that_refreshes_by_itself_equals_the_gated_step(name, monkeypatch):
  # every=4, start=0: the loop passes refresh=True on steps 0 and 4.
  tx = WRAPPED[name]()
  want = run(tx, lambda t: None)
  got = run(tx, lambda t: t % 4 == 0)
  # The program lowered for a GPU or a TPU (its branch of every platform_dependent:
  # the one gate, the unchanged masks' ordinary side), run here.
  monkeypatch.setattr(
    jax.lax, "platform_dependent", lambda *ops, default, **_: default(*ops)
  )
  device = run(tx, lambda t: None)
  monkeypatch.undo()
  for other in (got, device):  # float32 rounding of programs fused differently
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(other), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=0)
    magma.check_sparse_state(other[1])
  # Control: a loop that never refreshes passes masks that are not stored (all
  # active: too many tiles, or else a broken promise); the step raises it
  # on XLA:CPU where the masks are not promised to fit (the ramp), else the
  # state holds it.
  errors = (ValueError, jax.errors.JaxRuntimeError)
  with pytest.raises(errors, match="promised it unchanged|capacity overflow"):
    magma.check_sparse_state(run(tx, lambda t: False, steps=2)[1])


def test_a_broken_promise_is_recorded_and_the_leaf_kept():
  # refresh=False on the first step: the masks are all-active, the stored sets
  # empty. The leaves keep their (empty) stored sets and state and take no
  # update; the failure is recorded, with no callback, even on_error="raise".
  tx = magma.periodic_mask(ss(mode="compact", density=0.5), sparsity=0.5, every=4)
  state = tx.init(PARAMS)
  step = jax.jit(lambda p, s: tx.update(p, s, p, refresh=False))
  u, new = step(PARAMS, state)
  for k in PARAMS:
    np.testing.assert_array_equal(np.asarray(u[k]), 0.0)
  inner, before = new.inner_state, state.inner_state
  for a, b in zip(
    jax.tree.leaves(inner.base_state), jax.tree.leaves(before.base_state), strict=True
  ):
    if a.ndim:  # the stored moments (Adam's count is the step's, not a leaf's)
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match=r"leaf \['a'\].*promised it unchanged"):
    magma.check_sparse_state(new)
  # Control: the gated first step stores the masks and records nothing.
  u, ok = jax.jit(lambda p, s: tx.update(p, s, p))(PARAMS, state)
  magma.check_sparse_state(ok)
  assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(u))


def test_refresh_must_be_a_python_bool():
  tx = WRAPPED["skip"]()
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match="refresh must be None .* or a Python bool"):
    jax.jit(lambda s, r: tx.update(PARAMS, s, PARAMS, refresh=r))(state, True)


@pytest.mark.parametrize(
  "kw, bad",
  [
    (dict(mode="compact", density=0.25, cache_index=False), jnp.arange(32) < 9),
    (dict(mode="compact", structure=(2, 4)), jnp.arange(32) % 4 < 3),
  ],
)
def test_on_a_device_raise_mode_keeps_what_record_mode_keeps(kw, bad, monkeypatch):
  # Lowered for a GPU, on_error="raise" compiles no callback: a failing mask must
  # leave the stored set exactly as "record" does on XLA:CPU (the reference).
  p = {"w": jnp.linspace(-1.0, 1.0, 32)}
  good = {"w": jnp.arange(32) % 4 < 2}
  recording, raising = ss(on_error="record", **kw), ss(**kw)

  def two_steps(tx):
    step = jax.jit(lambda s, m: tx.update(p, s, p, param_mask=m))
    _, state = step(tx.init(p), good)
    return step(state, {"w": bad})

  want = two_steps(recording)
  monkeypatch.setattr(
    jax.lax, "platform_dependent", lambda *ops, default, **_: default(*ops)
  )
  got = two_steps(raising)
  monkeypatch.undo()
  np.testing.assert_array_equal(np.asarray(got[0]["w"]), 0.0)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="overflow"):
    magma.check_sparse_state(got[1])
  # Control: on XLA:CPU the same step raises.
  with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match="overflow"):
    jax.block_until_ready(two_steps(raising))
