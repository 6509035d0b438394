"""Extreme and non-finite values: the masks poison nothing the base optimizer does not.

Block sums are float32. Where they overflow for finite entries the block's sums are
recomputed rescaled (``_alignment.exact_sums``), so the cosine and the score follow a
float64 Algorithm 1; where a block holds an inf or NaN the cosine is undefined and
the block keeps its previous score (``_alignment.next_score``), so the score stays
finite and the update is non-finite exactly where the base's is.
"""

import algorithm1 as ref
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma
from magma_optax._core import xla_cpu as _xla_cpu

PARAMS = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
WRAPPERS = {
  "magma(adam)": lambda: magma.magma(optax.adam(1e-2), keep_prob=1.0),
  "adam_magma": lambda: magma.adam_magma(1e-2, keep_prob=1.0),
  "alignment_mask": lambda: optax.chain(
    magma.alignment_mask(keep_prob=1.0), optax.adam(1e-2)
  ),
  "skip_update": lambda: magma.skip_update(optax.adam(1e-2), keep_prob=1.0),
}


@pytest.fixture(params=["cpu", "branch_free"])
def backend(request, monkeypatch):
  """Which form of the overflow rescue runs: ``"cpu"``, the one XLA:CPU lowers (a
  branch), or ``"branch_free"``, the one lowered for a GPU or a TPU (every step
  takes all sums in one pass and picks per block), run here on the CPU."""
  if request.param == "branch_free":
    monkeypatch.setattr(
      _xla_cpu, "branch_on_cpu", lambda on_cpu, elsewhere, *ops: elsewhere(*ops)
    )
  return request.param


def _run(tx, grads):
  state, step = tx.init(PARAMS), jax.jit(tx.update)
  out = []
  for g in grads:
    u, state = step(g, state, PARAMS)
    out.append(u)
  return out, state


@pytest.mark.parametrize("name", sorted(WRAPPERS))
@pytest.mark.parametrize("magnitude", [1e17, 1e30])
def test_huge_finite_gradients_give_finite_updates_and_scores(name, magnitude, backend):
  g = jax.tree.map(lambda x: jnp.full(x.shape, magnitude), PARAMS)
  ones = jax.tree.map(jnp.ones_like, PARAMS)
  updates, state = _run(WRAPPERS[name](), [g, g, ones])
  for u in updates:
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u)), name
  scores = magma.mask_stats(state)["scores"]
  if scores is not None:
    assert all(bool(jnp.all(jnp.isfinite(s))) for s in jax.tree.leaves(scores))


def test_wrapper_and_fused_agree_on_extreme_inputs(backend):
  g = {"w": jnp.full((4, 8), 1e30), "b": jnp.linspace(-1e20, 1e20, 8)}
  ones = jax.tree.map(jnp.ones_like, PARAMS)
  a, sa = _run(WRAPPERS["magma(adam)"](), [g, ones, g])
  b, sb = _run(WRAPPERS["adam_magma"](), [g, ones, g])
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5)
  for x, y in zip(
    jax.tree.leaves(magma.mask_stats(sa)["scores"]),
    jax.tree.leaves(magma.mask_stats(sb)["scores"]),
    strict=True,
  ):
    np.testing.assert_allclose(x, y, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(WRAPPERS))
@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_one_bad_entry_poisons_what_adam_poisons(name, bad, backend):
  g_bad = jax.tree.map(lambda x: jnp.ones(x.shape), PARAMS)
  g_bad["w"] = g_bad["w"].at[1, 2].set(bad)
  ones = jax.tree.map(jnp.ones_like, PARAMS)
  grads = [ones, g_bad, ones, ones]
  got, state = _run(WRAPPERS[name](), grads)
  want, _ = _run(optax.adam(1e-2), grads)
  for u, v in zip(got, want, strict=True):
    for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(v), strict=True):
      np.testing.assert_array_equal(np.isfinite(x), np.isfinite(y))
  scores = magma.mask_stats(state)["scores"]
  if scores is not None:
    assert all(bool(jnp.all(jnp.isfinite(s))) for s in jax.tree.leaves(scores))
    # The clean leaf's score follows cos = 1 for all four steps.
    sigmoid = 1 / (1 + np.exp(-0.5))
    np.testing.assert_allclose(scores["b"], 0.5 + (sigmoid - 0.5) * (1 - 0.9**4), 1e-6)


def test_apply_if_finite_skips_the_bad_step_and_keeps_the_scores():
  tx = optax.apply_if_finite(magma.magma(optax.adam(1e-2)), max_consecutive_errors=3)
  ones = jax.tree.map(jnp.ones_like, PARAMS)
  bad = {**ones, "w": ones["w"].at[0, 0].set(jnp.inf)}
  state, step = tx.init(PARAMS), jax.jit(tx.update)
  _, state = step(ones, state, PARAMS)
  before = magma.mask_stats(state)
  u, state = step(bad, state, PARAMS)
  after = magma.mask_stats(state)
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))  # step skipped
  assert int(state.notfinite_count) == 1
  for x, y in zip(
    jax.tree.leaves(before["scores"]), jax.tree.leaves(after["scores"]), strict=True
  ):
    np.testing.assert_array_equal(x, y)
  assert int(after["step"]) == int(before["step"])


def _huge(shape, t):
  """Finite gradients whose float32 block sums overflow (entries up to 1.8e19, with
  signs and sizes varying per entry and per step), between ordinary steps. Adam's
  own g * g stays finite (<= 3.3e38); a row's sum of them does not."""
  rng = np.random.default_rng(t)
  g = rng.uniform(-1.5, 1.5, size=shape) + 0.3
  return (g * (1e19 if t in (1, 2, 4) else 1.0)).astype(np.float32)


def _algorithm1_scores(grads, granularity, b1=0.9, tau=2.0, decay=0.9):
  """Magma's scores s_t in float64 (Adam's first moment, dense; no overflow)."""
  ids, n = ref.block_ids(grads[0].shape, granularity)
  m, s, out = np.zeros(grads[0].shape), np.full(n, 0.5), []
  for g in grads:
    g = np.asarray(g, np.float64)
    m = b1 * m + (1 - b1) * g
    s = decay * s + (1 - decay) * ref.sigmoid(ref.block_cosine(m, g, ids, n) / tau)
    out.append(s.copy())
  return out


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_overflowing_block_sums_give_the_algorithm1_scores(granularity, backend):
  # Finite gradients whose float32 block sums overflow (up to 1.8e19 per entry):
  # the blocks are recomputed rescaled, so every transform's scores follow a
  # float64 Algorithm 1 on every step (they used to keep their score there), and
  # adam_magma's carried ||m||^2 is lost to no overflow (it used to be NaN for
  # good, or clipped to 0, and then re-summed).
  shape, steps = (4, 8), 7
  grads = [{"w": jnp.asarray(_huge(shape, t))} for t in range(steps)]
  want = _algorithm1_scores([g["w"] for g in grads], granularity)
  kw = dict(keep_prob=1.0, granularity=granularity)
  runs = {
    "magma(adam)": magma.magma(optax.adam(1e-2), **kw),
    "magma(adam) own momentum": magma.magma(optax.adam(1e-2), momentum="own", **kw),
    "adam_magma": magma.adam_magma(1e-2, **kw),
    "adam_magma pallas": magma.adam_magma(
      1e-2, implementation="pallas", interpret=True, **kw
    ),
  }
  params_of = {}
  for name, tx in runs.items():
    params = {"w": jnp.ones(shape)}
    state, step = tx.init(params), jax.jit(tx.update)
    history = []
    for t, g in enumerate(grads):
      u, state = step(g, state, params)
      params = optax.apply_updates(params, u)
      history.append(params["w"])
      got = np.ravel(magma.mask_stats(state)["scores"]["w"])
      np.testing.assert_allclose(got, want[t], rtol=2e-6, err_msg=f"{name} step {t}")
    params_of[name] = history
    if name.startswith("adam_magma"):
      mu = state.mu["w"].astype(jnp.float32)
      direct = jnp.sum(mu * mu) if granularity == "tensor" else jnp.sum(mu * mu, -1)
      np.testing.assert_allclose(state.mu_sq_norm["w"], direct, rtol=1e-4)
  for name, history in params_of.items():
    for t, (p, p_want) in enumerate(
      zip(history, params_of["magma(adam)"], strict=True)
    ):
      np.testing.assert_allclose(p, p_want, rtol=1e-5, err_msg=f"{name} step {t}")


@pytest.mark.parametrize("magnitude", [1e19, 1e30, 3e38])
def test_cosines_of_huge_finite_blocks_are_exact(magnitude):
  # Up to float32's maximum, and a huge vector against an ordinary one (one of
  # the two rescaled, not both), against float64; tile blocks, complex and a
  # parameter mask take the same path.
  from magma_optax._core import blocks as _blocks
  from magma_optax.masking import alignment as _alignment

  rng = np.random.default_rng(1)
  a = rng.uniform(-1, 1, (6, 8))
  b = rng.uniform(-1, 1, (6, 8))
  a[0] *= magnitude  # row 0: a huge; row 1: b huge; row 2: both; others plain
  b[1] *= magnitude
  a[2] *= magnitude
  b[2] *= magnitude
  a, b = a.astype(np.float32), b.astype(np.float32)
  for granularity in ["row", (2, 4), "tensor"]:
    layout = _blocks.block_layout(a.shape, granularity)
    ids, n = ref.block_ids(a.shape, granularity)
    want = ref.block_cosine(a.astype(np.float64), b.astype(np.float64), ids, n)
    for got in cosines(layout, a, b):
      np.testing.assert_allclose(np.ravel(got), want, rtol=2e-6, atol=2e-7)
  layout = _blocks.block_layout(a.shape, "row")
  ids, n = ref.block_ids(a.shape, "row")
  ac, bc = a + 1j * b[::-1], b - 1j * a  # complex: the real inner product
  x = np.concatenate([ac.real, ac.imag], -1).astype(np.float64)
  y = np.concatenate([bc.real, bc.imag], -1).astype(np.float64)
  want = ref.block_cosine(x, y, ref.block_ids(x.shape, "row")[0], n)
  for got in cosines(layout, ac, bc):
    np.testing.assert_allclose(np.ravel(got), want, rtol=2e-6, atol=2e-7)
  keep = rng.uniform(size=a.shape) < 0.6
  a64, b64 = (np.where(keep, x, 0.0).astype(np.float64) for x in (a, b))
  want = ref.block_cosine(a64, b64, ids, n)
  for got in cosines(layout, a, b, keep):
    np.testing.assert_allclose(got, want, rtol=2e-6)
  # Rows 0-2 take the rescaled sums (what the test is about): a plain float32
  # sum there reaches 2**126 or overflows.
  plain = np.asarray(_alignment.block_sums(layout, jnp.asarray(a), jnp.asarray(b)))
  assert (~(np.abs(plain[:, :3]) < 2.0**126)).any(axis=0).all()


def cosines(layout, a, b, param_mask=None):
  """The block cosines of ``a`` and ``b`` by :func:`_alignment.block_cosine`,
  :func:`_alignment.exact_sums` (the rescue on XLA:CPU) and
  :func:`_alignment.branch_free_sums` (elsewhere)."""
  from magma_optax.masking import alignment as _alignment

  a, b = jnp.asarray(a), jnp.asarray(b)
  if param_mask is None:
    yield _alignment.block_cosine(layout, a, b)
  for sums_of in (_alignment.exact_sums, _alignment.branch_free_sums):
    sums, _ = sums_of(layout, a, b, param_mask=param_mask)
    yield _alignment.cosine_from_sums(*sums)


def test_the_rescue_costs_no_parameter_sized_scratch():
  # The recomputation for overflowing blocks runs in a loop of zero or one step
  # per update; its rescaled sums must fuse into their reductions, not be
  # written to memory (that was a leaf-sized temporary per leaf: 72 MB on a
  # 144-leaf model). XLA's accounting of the compiled step, against optax.adam's.
  from magma_optax._core import blocks as _blocks

  params = {f"w{i}": jnp.zeros((64, 512)) for i in range(4)}
  leaf = 64 * 512 * 4

  def temp_bytes(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
      pytest.skip("this backend reports no memory analysis")
    return analysis.temp_size_in_bytes

  def step_temp(tx):
    return temp_bytes(tx.update, params, tx.init(params), params)

  adam = step_temp(optax.adam(1e-3))
  for tx in [magma.magma(optax.adam(1e-3)), magma.adam_magma(1e-3, granularity="row")]:
    assert step_temp(tx) - adam < leaf / 4
  # Positive control: a per-block factor that two of the reductions share is
  # written to memory, leaf-sized (what exact_sums avoids).
  layout = _blocks.block_layout((64, 512), "row")

  def shared(x):
    f = layout.to_leaf(jnp.where(x[:, 0] > 0, 2.0**-80, 1.0))
    return layout.block_sum((x * f) * x), layout.block_sum((x * f) * (x * f))

  assert temp_bytes(shared, params["w0"]) >= leaf


@pytest.mark.parametrize("name", ["magma(adam)", "adam_magma", "alignment_mask"])
def test_hypergradient_through_scanned_jitted_steps(name, backend):
  # d loss(params after 3 steps) / d learning rate with the steps in lax.scan
  # (traced: a tangent is not visible to the transform there). The branch that
  # recomputes overflowing sums is a cond, which reverse mode differentiates;
  # a loop made this a ValueError. Against a central finite difference (2 %).
  rng = np.random.default_rng(3)
  grads = jnp.asarray(rng.normal(size=(3, 4, 8)).astype(np.float32))
  make = {
    "magma(adam)": lambda lr: magma.magma(optax.adam(lr), granularity="row"),
    "adam_magma": lambda lr: magma.adam_magma(lr, granularity="row"),
    "alignment_mask": lambda lr: optax.chain(magma.alignment_mask(), optax.adam(lr)),
  }[name]

  def loss(lr):
    tx = make(lr)
    p = jnp.ones((4, 8))

    def body(carry, g):
      p, state = carry
      u, state = tx.update(g * p, state, p)
      return (p + u, state), None

    (p, _), _ = jax.lax.scan(body, (p, tx.init(p)), grads)
    return jnp.sum(p**2)

  got = float(jax.jit(jax.grad(loss))(0.05))
  h, value = 1e-3, jax.jit(loss)
  want = (float(value(0.05 + h)) - float(value(0.05 - h))) / (2 * h)
  np.testing.assert_allclose(got, want, rtol=2e-2)
