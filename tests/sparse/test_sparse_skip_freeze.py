"""Skip storage freezes a generic base's state where the base computes it
(magma_optax._freeze): the same results as freezing after the step, without the copy
of the old state.

The reference is the same composition with the rewrite switched off (``evaluate``
patched to call the step as it is: freeze after, the storage before this change),
and for Adam the plain-numpy masked Adam of tests/sparse/test_sparse_state.py.
"""

import functools
from typing import NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo import entry_copies

import magma_optax as magma
from magma_optax._core import xla_cpu as _xla_cpu
from magma_optax.sparse import freeze as _freeze

SHAPES = {"w": (6, 8), "b": (8,)}
STEPS = 4


def _plain(fn, targets_of, tracing=True):
  del targets_of, tracing
  return fn(), set()


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  grads, masks = [], []
  for t in range(STEPS):
    g = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    m = {k: rng.random(s) < 0.5 for k, s in SHAPES.items()}
    if t == 2:  # a non-finite gradient where the mask is off
      g["w"][~m["w"]] = np.inf
      g["w"][0, ~m["w"][0]] = np.nan
    if t == 3:  # a huge gradient where it is on (g * g overflows), a zero leaf
      i, j = np.argwhere(m["w"])[0]
      g["w"][i, j] = 3e38
      g["b"][:] = 0.0
    grads.append(g)
    masks.append(m)
  return grads, masks


def _run(base, rewrite: bool, donate=False):
  """Updates and states of STEPS jitted steps; and the targets frozen inside."""
  params = {k: jnp.ones(s) for k, s in SHAPES.items()}
  tx = magma.sparse_state(base)
  frozen = []
  real = _freeze.evaluate

  def spy(fn, targets_of, tracing=True):
    out, done = real(fn, targets_of, tracing)
    frozen.append(len(done))
    return out, done

  with mock.patch.object(_freeze, "evaluate", spy if rewrite else _plain):
    step = jax.jit(tx.update, donate_argnums=(1,) if donate else ())
    state = tx.init(params)
    out = []
    grads, masks = _inputs()
    for g, m in zip(grads, masks, strict=True):
      u, state = step(g, state, params, param_mask=m)
      out.append(jax.device_get((u, state)))  # before the next step donates it
  return out, frozen


def _jitted(fn):
  """A transform applying ``fn`` to the whole tree of updates inside one jit (as
  optax's own tree helpers are on newer versions): followed inside."""

  def update(updates, state, params=None):
    del params
    return jax.jit(fn)(updates), state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


BASES = {
  # name: (base, whether any state entry is frozen inside; which: see below)
  "adam": (optax.adam(0.1), True),
  "adamw": (optax.adamw(0.1, weight_decay=0.1), True),
  "adam bf16 mu": (optax.adam(0.1, mu_dtype=jnp.bfloat16), True),
  "sgd nesterov": (optax.sgd(0.1, momentum=0.9, nesterov=True), True),
  "adabelief": (optax.adabelief(0.1), True),
  "lion": (optax.lion(0.1), True),
  "rmsprop centered": (optax.rmsprop(0.1, momentum=0.9, centered=True), True),
  "clip, adam": (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)), True),
  "inject_hyperparams": (optax.inject_hyperparams(optax.adam)(learning_rate=0.1), True),
  "masked": (optax.masked(optax.adam(0.1), {"w": True, "b": False}), True),
  "multi_transform": (
    optax.multi_transform(
      {"a": optax.adam(0.1), "s": optax.sgd(0.1, momentum=0.5)}, {"w": "a", "b": "s"}
    ),
    True,
  ),
  "adam, jit over the tree": (
    optax.chain(optax.adam(0.1), _jitted(lambda t: jax.tree.map(lambda x: 2 * x, t))),
    True,
  ),
  # An update that reads a norm of the moments: not frozen inside (the freeze
  # after the step, as before).
  "lamb": (optax.lamb(0.1), False),
  "adam, a norm inside a jit": (
    optax.chain(
      optax.adam(0.1),
      _jitted(lambda t: jax.tree.map(lambda x: x / jnp.linalg.norm(x), t)),
    ),
    False,
  ),
  # Its all-or-nothing choice is a select by a scalar: elementwise.
  "apply_if_finite": (optax.apply_if_finite(optax.adam(0.1), 3), True),
  # Only the momentum (see test_what_is_frozen_inside).
  "adafactor": (optax.adafactor(0.1, min_dim_size_to_factor=4, momentum=0.9), True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BASES))
def test_freezing_inside_equals_freezing_after(name):
  base, inside = BASES[name]
  got, frozen = _run(base, rewrite=True)
  want, _ = _run(base, rewrite=False)
  assert (max(frozen) > 0) == inside, frozen
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_allclose(
      np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6, atol=0
    )


def test_what_is_frozen_inside():
  # Adam: both moments of both leaves. LAMB: its trust ratio reads a norm of the
  # update, which reads both moments: nothing. Adafactor with momentum: the
  # update is clipped by its root-mean-square over the leaf, which reads the
  # second moments ("b"'s, unfactored: not frozen inside), but the momentum comes
  # after that: both leaves' momenta.
  assert _run(optax.adam(0.1), rewrite=True)[1] == [4]
  assert _run(optax.lamb(0.1), rewrite=True)[1] == [0]
  assert _run(BASES["adafactor"][0], rewrite=True)[1] == [2]


def test_adam_equals_numpy_masked_adam_with_donated_state():
  b1, b2, eps, lr = 0.9, 0.999, 1e-8, 0.1
  got, _ = _run(optax.adam(lr, b1=b1, b2=b2, eps=eps), rewrite=True, donate=True)
  grads, masks = _inputs()
  mu = {k: np.zeros(s, np.float64) for k, s in SHAPES.items()}
  nu = {k: np.zeros(s, np.float64) for k, s in SHAPES.items()}
  for t, (g, m, (u, state)) in enumerate(zip(grads, masks, got, strict=True), 1):
    for k in SHAPES:
      with np.errstate(invalid="ignore", over="ignore"):
        mu[k] = np.where(m[k], b1 * mu[k] + (1 - b1) * g[k], mu[k])
        nu[k] = np.where(m[k], b2 * nu[k] + (1 - b2) * g[k] ** 2, nu[k])
        mhat, vhat = mu[k] / (1 - b1**t), nu[k] / (1 - b2**t)
        want = np.where(m[k], -lr * mhat / (np.sqrt(vhat) + eps), 0.0)
      np.testing.assert_allclose(u[k], want, rtol=2e-5, atol=1e-7)
      np.testing.assert_allclose(state.base_state[0].mu[k], mu[k], rtol=1e-5)
      np.testing.assert_allclose(state.base_state[0].nu[k], nu[k], rtol=1e-5)


def test_the_donated_skip_step_copies_no_moment():
  # Freezing after the step, XLA evaluated Adam's moment update twice (into the
  # donated state, in place, and in the update's loop from the old moments) and
  # copied both old moments first (benchmarks/RESULTS.md: 4-5x optax.adam at 4 M
  # parameters; 1.1-1.25x without the copy).
  params = {"w": jnp.ones((64, 48))}
  mask = {"w": jnp.arange(64 * 48).reshape(64, 48) % 3 == 0}

  def copies():  # a new step each time (jax caches a function's trace)
    tx = magma.sparse_state(optax.adam(1e-3))

    def step(p, s, g, m):
      u, s = tx.update(g, s, p, param_mask=m)
      return optax.apply_updates(p, u), s

    return entry_copies(step, (params, tx.init(params), params, mask), r"f32\[64,48\]")

  assert not copies()
  with mock.patch.object(_freeze, "evaluate", _plain):  # positive control
    assert len(copies()) >= 1  # the old moments (both, on the jax lines tested)


def test_vmap_through_the_rewrite():
  # A vmapped step against each element's step (reverse mode: in
  # tests/sparse/test_sparse_state.py, test_reverse_mode_through_unrolled_sparse_steps).
  rng = np.random.default_rng(1)
  grads = [rng.normal(size=(4, 8)).astype(np.float32) for _ in range(3)]
  masks = [np.arange(32).reshape(4, 8) % (2 + t) == 0 for t in range(3)]
  tx = magma.sparse_state(optax.adam(0.1))
  p = {"w": jnp.ones((4, 8))}
  g = jnp.stack(grads)
  m = jnp.stack(masks)
  state = jax.vmap(lambda _: tx.init(p))(jnp.arange(3))
  step = functools.partial(tx.update, params=p)
  u, new = jax.vmap(lambda g, s, m: step({"w": g}, s, param_mask={"w": m}))(g, state, m)
  for i in range(3):
    one = jax.tree.map(lambda x, i=i: x[i], state)
    u1, new1 = step({"w": g[i]}, one, param_mask={"w": m[i]})
    np.testing.assert_allclose(u["w"][i], u1["w"], rtol=1e-6)
    np.testing.assert_allclose(new.base_state[0].mu["w"][i], new1.base_state[0].mu["w"])


def test_a_base_that_needs_a_concrete_value_under_vmap_runs_as_it_is():
  # Under vmap (no jit) a value computed from closed-over constants is concrete,
  # and a base may read it; traced into a jaxpr it is not: the step then calls the
  # base as it is (freeze after).
  adam = optax.adam(0.1)
  scale = jnp.full(3, 2.0)

  def update(g, s, p=None):
    factor = float(jnp.max(scale))  # concrete under vmap, traced in a jaxpr
    u, s = adam.update(g, s, p)
    return jax.tree.map(lambda x: factor * x, u), s

  tx = magma.sparse_state(optax.GradientTransformation(adam.init, update))
  ref = magma.sparse_state(adam)
  params = {"w": jnp.ones((3, 4))}
  g = jnp.arange(24.0).reshape(2, 3, 4)
  m = jnp.arange(24).reshape(2, 3, 4) % 3 == 0

  def steps(tx):
    return jax.vmap(
      lambda g, m: tx.update({"w": g}, tx.init(params), params, param_mask={"w": m})
    )(g, m)

  (u, s), (ref_u, ref_s) = steps(tx), steps(ref)
  np.testing.assert_allclose(u["w"], 2 * np.asarray(ref_u["w"]), rtol=1e-6)
  np.testing.assert_array_equal(s.base_state[0].mu["w"], ref_s.base_state[0].mu["w"])


class _Two(NamedTuple):
  mom: dict
  last: dict


def _returns_one_array_twice():
  """A base whose state holds the same new array twice, from different old values
  (``mom`` starts at 0, ``last`` at 1)."""

  def init(p):
    return _Two(jax.tree.map(jnp.zeros_like, p), jax.tree.map(jnp.ones_like, p))

  def update(g, s, p=None):
    del p
    new = jax.tree.map(lambda g, m: 0.5 * m + g, g, s.mom)
    return jax.tree.map(lambda x: -0.1 * x, new), _Two(new, new)

  return optax.GradientTransformation(init, update)


def test_one_array_as_two_state_entries_keeps_each_old_value():
  # Frozen once, the array would take one entry's old value into both (found by an
  # adversarial review: `last` was [2, 0, 2] for [2, 1, 2]); such arrays are frozen
  # after the step.
  got, frozen = _run(_returns_one_array_twice(), rewrite=True)
  want, _ = _run(_returns_one_array_twice(), rewrite=False)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)
  assert frozen == [0]


def test_constant_state_entries_stay_arrays_inside_jit():
  # optimistic gradient descent keeps a constant flag in its state: traced, it is a
  # literal of the jaxpr, handed back as an array (what the base returned), so code
  # in the same jit can read its dtype.
  base = optax.optimistic_gradient_descent(0.1)
  tx = magma.sparse_state(base)
  params = {"w": jnp.ones((3, 4))}
  m = {"w": jnp.arange(12).reshape(3, 4) % 2 == 0}

  @jax.jit
  def dtypes(s):
    _, new = tx.update(params, s, params, param_mask=m)
    return [jnp.zeros([], x.dtype) for x in jax.tree.leaves(new)]

  want = [x.dtype for x in jax.tree.leaves(tx.init(params))]
  assert [x.dtype for x in dtypes(tx.init(params))] == want


def test_an_eager_step_runs_the_base_as_it_is():
  # Nothing traced, nothing to gain: the base runs on concrete values, and may read
  # them (a boolean index, a formatted value).
  adam = optax.adam(0.1)
  seen = []

  def update(g, s, p=None):
    u, s = adam.update(g, s, p)
    seen.append(f"{float(jnp.max(u['w'][u['w'] < 0])):.4f}")
    return u, s

  tx = magma.sparse_state(optax.GradientTransformation(adam.init, update))
  params = {"w": jnp.ones((3, 4))}
  g = {"w": jnp.arange(12.0).reshape(3, 4)}
  m = {"w": jnp.arange(12).reshape(3, 4) % 2 == 0}
  u, _ = tx.update(g, tx.init(params), params, param_mask=m)
  assert seen == ["-0.1000"]
  ref = magma.sparse_state(adam)
  want, _ = ref.update(g, ref.init(params), params, param_mask=m)
  np.testing.assert_array_equal(u["w"], want["w"])


# _xla_cpu.kept: the select of a frozen entry, written so that LLVM does not turn it
# into a masked store (slow on AMD's cores).

KEPT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8, jnp.uint8]
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _random_bits(rng, shape, dtype):
  """Arrays of ``dtype`` with random bit patterns (NaN payloads, infinities,
  subnormals, signed zeros among them for floats)."""
  uint = _UINT[jnp.dtype(dtype).itemsize]
  bits = rng.integers(0, np.iinfo(uint).max, size=shape, dtype=uint, endpoint=True)
  if jnp.issubdtype(dtype, jnp.floating):
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45]
    special = np.asarray(specials, np.float32).astype(jnp.dtype(dtype))
    bits.reshape(-1)[: len(specials)] = special.view(uint)
  return jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype)


def _bits(x):
  x = jnp.asarray(x)
  return np.asarray(jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]))


@pytest.mark.parametrize("dtype", KEPT_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_kept_is_where_bit_for_bit(dtype):
  rng = np.random.default_rng(3)
  new, old = (_random_bits(rng, (3, 40), dtype) for _ in range(2))
  mask = jnp.asarray(rng.random((3, 40)) < 0.5)
  want = _bits(jnp.where(mask, new, old))
  np.testing.assert_array_equal(_bits(jax.jit(_xla_cpu.kept)(mask, new, old)), want)
  np.testing.assert_array_equal(_bits(_xla_cpu.kept(mask, new, old)), want)
  batched = jax.jit(jax.vmap(_xla_cpu.kept))(mask, new, old)
  np.testing.assert_array_equal(_bits(batched), want)
  for m in (True, False):  # a scalar mask broadcasts, as in jnp.where
    np.testing.assert_array_equal(
      _bits(jax.jit(_xla_cpu.kept)(m, new, old)), _bits(jnp.where(m, new, old))
    )
  # A mask of another dtype reads as jnp.where reads it (nonzero: taken).
  numbers = jnp.asarray(rng.integers(-1, 2, size=(3, 40)), jnp.float32)
  np.testing.assert_array_equal(
    _bits(jax.jit(_xla_cpu.kept)(numbers, new, old)),
    _bits(jnp.where(numbers, new, old)),
  )


def test_kept_differentiates_as_where():
  mask = jnp.array([True, False, True, False])
  x = jnp.array([1.0, -2.0, 3.0, 0.5])

  def with_kept(x):
    return jnp.sum(_xla_cpu.kept(mask, x**2, 3.0 * x))

  def with_where(x):
    return jnp.sum(jnp.where(mask, x**2, 3.0 * x))

  np.testing.assert_array_equal(jax.grad(with_kept)(x), jax.grad(with_where)(x))
  np.testing.assert_array_equal(
    jax.jit(jax.grad(with_kept))(x), jax.jit(jax.grad(with_where))(x)
  )
  tangent = jnp.array([1.0, 2.0, -1.0, 4.0])
  got = jax.jvp(lambda x: _xla_cpu.kept(mask, x**2, 3.0 * x), (x,), (tangent,))
  want = jax.jvp(lambda x: jnp.where(mask, x**2, 3.0 * x), (x,), (tangent,))
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)


def test_the_donated_sparse_adam_skip_step_copies_no_moment():
  params = {"w": jnp.ones((64, 48))}
  mask = {"w": jnp.arange(64 * 48).reshape(64, 48) % 3 == 0}
  tx = magma.sparse_adam(1e-3)

  def step(p, s, g, m):
    u, s = tx.update(g, s, p, param_mask=m)
    return optax.apply_updates(p, u), s

  assert not entry_copies(
    step, (params, tx.init(params), params, mask), r"f32\[64,48\]"
  )


_MASKED_STORES = r"""
import sys
import jax, jax.numpy as jnp, optax
import magma_optax as magma

params = {"w": jnp.ones((64, 48))}
mask = {"w": jnp.arange(64 * 48).reshape(64, 48) % 3 == 0}
txs = {"sparse_state": magma.sparse_state(optax.adam(1e-3)),
       "sparse_adam": magma.sparse_adam(1e-3)}
which = sys.argv[1]

if which == "control":  # the moment update with a plain select
  def step(p, s, g, m):
    mu = jnp.where(m["w"], 0.9 * s["w"] + 0.1 * g["w"], s["w"])
    return p, {"w": mu}
  state = {"w": params["w"]}
else:
  tx = txs[which]
  state = tx.init(params)
  def step(p, s, g, m):
    u, s = tx.update(g, s, p, param_mask=m)
    return optax.apply_updates(p, u), s
jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params, mask).compile()
"""


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's code")
@pytest.mark.parametrize("which", ["sparse_state", "sparse_adam"])
def test_the_skip_step_has_no_masked_store(which, tmp_path):
  # LLVM compiled where(M, new, old) into a donated `old` as a masked store
  # (vmaskmovps), 1.4-1.5x the step of optax.adam on an AMD EPYC. Read from the
  # object code that XLA:CPU dumps; the positive control is the plain select.
  import platform
  import shutil
  import subprocess
  import sys

  if platform.machine() not in ("x86_64", "AMD64") or not shutil.which("objdump"):
    pytest.skip("reads x86 object code with objdump")

  def masked_stores(which):
    dump = tmp_path / which
    env = {**__import__("os").environ, "XLA_FLAGS": f"--xla_dump_to={dump}"}
    env["JAX_PLATFORMS"] = "cpu"
    subprocess.run(
      [sys.executable, "-c", _MASKED_STORES, which], env=env, check=True, timeout=300
    )
    objects = [o for o in dump.glob("*.o") if "jit_step" in o.name]
    if not objects:
      pytest.skip("this XLA dumps no object code")
    text = "".join(
      subprocess.run(
        ["objdump", "-d", str(o)], capture_output=True, text=True, check=True
      ).stdout
      for o in objects
    )
    return text.count("vmaskmov") + text.count("vpmaskmov")

  if not masked_stores("control"):
    pytest.skip("this CPU's compiler makes no masked store of the plain select")
  assert masked_stores(which) == 0
