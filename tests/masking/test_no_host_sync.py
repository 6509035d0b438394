"""The dense step lowered for a GPU holds no host sync (DESIGN.md section 6).

XLA:GPU runs a data-dependent ``while`` or ``case`` by reading its predicate back to
the host, which then waits: every transform of the dense step (``magma``,
``skip_update``, ``alignment_mask``, ``bernoulli_mask``, ``damping``,
``adam_magma`` with either implementation) must lower for CUDA without one, at
every granularity, scoped or not, alone, in ``optax.chain`` and under
``optax.inject_hyperparams``, and add none to ``optax.MultiSteps`` or
``optax.apply_if_finite`` (which have their own). A host callback would make the
lowering fail here (no GPU is attached). Lowered on this machine for a GPU that is
not attached (``_hlo.lowered``).
"""

import functools

import _hlo
import jax
import jax.numpy as jnp
import optax
import pytest

import magma_optax as magma

PARAMS = {
  "embed": {"embedding": jnp.ones((32, 16))},
  "h0": {
    "attn": {"c_attn": {"kernel": jnp.ones((16, 48)), "bias": jnp.ones(48)}},
    "mlp": {"c_fc": {"kernel": jnp.ones((16, 64))}},
    "ln_1": {"scale": jnp.ones(16)},
  },
}

# name -> (factory of the transform from keyword arguments, does it take labels=)
TRANSFORMS = {
  "magma": (functools.partial(magma.magma, optax.adam(1e-3)), True),
  "skip_update": (functools.partial(magma.skip_update, optax.adam(1e-3)), True),
  "alignment_mask": (
    lambda **kw: optax.chain(magma.alignment_mask(**kw), optax.adam(1e-3)),
    True,
  ),
  "bernoulli_mask": (
    lambda **kw: optax.chain(optax.adam(1e-3), magma.bernoulli_mask(**kw)),
    True,
  ),
  "damping": (
    lambda **kw: optax.chain(optax.adam(1e-3), magma.damping(0.1, **kw)),
    False,
  ),
  "adam_magma[xla]": (
    functools.partial(magma.adam_magma, 1e-3, implementation="xla"),
    True,
  ),
  "adam_magma[pallas]": (
    functools.partial(magma.adam_magma, 1e-3, implementation="pallas"),
    True,
  ),
}
NAMES = sorted(TRANSFORMS)
GRANULARITIES = ["tensor", "row", "column", "element", (2, 4)]
PALLAS_GRANULARITIES = ["tensor", "row", "element"]  # contiguous blocks

# name -> the transform under optax.inject_hyperparams.
INJECTED = {
  "magma": lambda: optax.inject_hyperparams(magma.magma)(
    optax.adam(1e-3), tau=2.0, keep_prob=0.5
  ),
  "skip_update": lambda: optax.inject_hyperparams(magma.skip_update)(
    optax.adam(1e-3), keep_prob=0.5
  ),
  "alignment_mask": lambda: optax.chain(
    optax.inject_hyperparams(magma.alignment_mask)(tau=2.0, keep_prob=0.5),
    optax.adam(1e-3),
  ),
  "bernoulli_mask": lambda: optax.chain(
    optax.adam(1e-3), optax.inject_hyperparams(magma.bernoulli_mask)(keep_prob=0.5)
  ),
  "damping": lambda: optax.chain(
    optax.adam(1e-3), optax.inject_hyperparams(magma.damping)(coefficient=0.1)
  ),
  **{
    f"adam_magma[{impl}]": functools.partial(
      lambda impl: optax.inject_hyperparams(
        magma.adam_magma, static_args=("b1", "b2", "eps", "eps_root")
      )(learning_rate=1e-3, tau=2.0, implementation=impl),
      impl,
    )
    for impl in ("xla", "pallas")
  },
}


def _step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _control_flow(tx, platform="cuda"):
  """The data-dependent control flow of ``tx``'s step lowered for ``platform``."""
  text = _hlo.lowered(_step(tx), PARAMS, tx.init(PARAMS), PARAMS, platform=platform)
  return _hlo.data_dependent_control_flow(text)


NONE = {"while": 0, "case": 0, "if": 0}


def _cases():
  for name in NAMES:
    grans = PALLAS_GRANULARITIES if name.endswith("[pallas]") else GRANULARITIES
    for granularity in grans:
      yield pytest.param(name, granularity, id=f"{name}-{granularity}")


@pytest.mark.parametrize("name, granularity", list(_cases()))
def test_step_lowered_for_cuda_has_no_data_dependent_control_flow(name, granularity):
  make, _ = TRANSFORMS[name]
  assert _control_flow(make(granularity=granularity)) == NONE


@pytest.mark.parametrize("name", NAMES)
def test_step_lowered_for_tpu_has_no_data_dependent_control_flow(name):
  # A TPU, too, would wait on the host for a branch's predicate.
  make, _ = TRANSFORMS[name]
  assert _control_flow(make(granularity="row"), "tpu") == NONE


@pytest.mark.parametrize("scope", ["where", "labels"])
@pytest.mark.parametrize("name", NAMES)
def test_scoped_step_lowered_for_cuda_has_no_data_dependent_control_flow(name, scope):
  make, takes_labels = TRANSFORMS[name]
  if scope == "where":
    tx = make(where=magma.attention_mlp_weights, granularity="row")
  elif takes_labels:  # a keep probability per label
    keep = {"attention": 0.5, "mlp": 0.25, "other": 1.0}
    tx = make(labels=magma.transformer_labels, keep_prob=keep)
  else:
    pytest.skip(f"{name} takes no labels")
  assert _control_flow(tx) == NONE


@pytest.mark.parametrize("context", ["chain", "inject_hyperparams"])
@pytest.mark.parametrize("name", NAMES)
def test_composed_step_lowered_for_cuda_has_no_data_dependent_control_flow(
  name, context
):
  if context == "chain":
    tx = optax.chain(optax.clip_by_global_norm(1.0), TRANSFORMS[name][0]())
  else:
    tx = INJECTED[name]()
  assert _control_flow(tx) == NONE


@pytest.mark.parametrize("wrapper", ["MultiSteps", "apply_if_finite"])
@pytest.mark.parametrize("name", NAMES)
def test_wrappers_with_control_flow_get_none_added(name, wrapper):
  wrap = {
    "MultiSteps": lambda tx: optax.MultiSteps(tx, every_k_schedule=2),
    "apply_if_finite": lambda tx: optax.apply_if_finite(tx, 3),
  }[wrapper]
  want = _control_flow(wrap(optax.adam(1e-3)))
  # apply_if_finite branches on the step's finiteness (the count sees it);
  # MultiSteps selects (its one case has a constant index).
  assert want == ({**NONE, "case": 1} if wrapper == "apply_if_finite" else NONE)
  assert _control_flow(wrap(TRANSFORMS[name][0]())) == want


def test_positive_controls_see_the_branches_xla_cpu_keeps():
  # The overflow rescue stays a branch on XLA:CPU, where it costs nothing: the same
  # count sees it in the program lowered for the CPU.
  assert _control_flow(magma.magma(optax.adam(1e-3)), "cpu") == {**NONE, "case": 1}
  tx = magma.adam_magma(1e-3, implementation="xla")
  assert _control_flow(tx, "cpu") == {**NONE, "while": 1}


def test_the_count_sees_data_dependent_control_flow_only():
  def branches(x):
    x = jax.lax.cond(x.sum() > 0, lambda x: x + 1, lambda x: x - 1, x)
    x = jax.lax.while_loop(lambda x: x.sum() < 5, lambda x: x * 2, x)
    # Not counted: a loop with a known trip count, a branch chosen per platform.
    x = jax.lax.fori_loop(0, 3, lambda i, x: x * 2 + i, x)
    return jax.lax.platform_dependent(
      x, cpu=lambda x: x, default=lambda x: jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x)
    )

  x = jnp.ones(3)
  cuda = _hlo.data_dependent_control_flow(_hlo.lowered(branches, x))
  assert cuda == {"while": 1, "case": 2, "if": 0}
  cpu = _hlo.data_dependent_control_flow(_hlo.lowered(branches, x, platform="cpu"))
  assert cpu == {"while": 1, "case": 1, "if": 0}
