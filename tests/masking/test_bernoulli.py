"""bernoulli_mask: draws, statistics, keys, schedules, labels, inject_hyperparams."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma

N_STEPS = 400


def _masks_over_steps(tx, params, steps=N_STEPS):
  """Runs ``steps`` updates in one compiled scan; returns stacked masks and updates."""
  ones = jax.tree.map(jnp.ones_like, params)

  @jax.jit
  def run(state):
    def body(state, _):
      updates, state = tx.update(ones, state, params)
      return state, (magma.mask_stats(state)["mask"], updates)

    return jax.lax.scan(body, state, None, length=steps)

  _, (masks, updates) = run(tx.init(params))
  return masks, updates


def test_masks_follow_the_documented_key_derivation():
  # Leaves that share a block shape are drawn in one batched call: still the same
  # bits as one documented draw per leaf, also with another p within the batch.
  params = {
    "a": jnp.zeros((3, 4)),
    "b": jnp.zeros((5,)),
    "d": jnp.zeros((6,)),
    "mlp": {"up": jnp.zeros((3, 7))},
  }
  probs = {"mlp": 0.8, "other": 0.3}
  tx = magma.bernoulli_mask(probs, key=11, granularity="row")
  state = tx.init(params)
  ones = jax.tree.map(jnp.ones_like, params)
  key = jax.random.key(11)
  leaf_p = [(3,), (), (), (3,)], [0.3, 0.3, 0.3, 0.8]
  paths = ["['a']", "['b']", "['d']", "['mlp']['up']"]  # keystr of each leaf's path
  for step in range(3):
    _, state = tx.update(ones, state)
    leaves = jax.tree.leaves(state.mask)
    for path, leaf, shape, p in zip(paths, leaves, *leaf_p, strict=True):
      leaf_id = zlib.crc32(path.encode())
      k = jax.random.fold_in(jax.random.fold_in(key, step), leaf_id)
      np.testing.assert_array_equal(leaf, jax.random.bernoulli(k, p, shape))


def test_groups_with_one_key_draw_different_masks():
  """Keys come from the leaf's path in the whole tree, not its position, which
  restarts at 0 inside each optax.multi_transform / optax.masked group."""
  params = {"a": jnp.zeros((64,)), "m": jnp.zeros((64,))}
  group = lambda: magma.bernoulli_mask(0.5, key=3, granularity="element")
  tx = optax.multi_transform({"a": group(), "m": group()}, {"a": "a", "m": "m"})
  alone = group()
  ones = jax.tree.map(jnp.ones_like, params)
  state, alone_state = tx.init(params), alone.init(params)
  for _ in range(3):
    u, state = tx.update(ones, state)
    want, alone_state = alone.update(ones, alone_state)
    assert not np.array_equal(u["a"], u["m"])
    # Each group draws what the transform alone draws for that path.
    np.testing.assert_array_equal(u["a"], want["a"])
    np.testing.assert_array_equal(u["m"], want["m"])
  # Adding an unrelated leaf does not change the others' masks.
  more = {**params, "extra": jnp.zeros((5,))}
  u_more, _ = group().update(jax.tree.map(jnp.ones_like, more), group().init(more))
  u_base, _ = group().update(ones, group().init(params))
  np.testing.assert_array_equal(u_more["m"], u_base["m"])


@pytest.mark.parametrize("p", [0.25, 0.5, 0.9])
def test_keep_fraction_and_unbiasedness(p):
  params = {"w": jnp.zeros((8, 8))}
  tx = magma.bernoulli_mask(p, key=1, granularity="row")
  masks, updates = _masks_over_steps(tx, params)
  z = np.asarray(masks["w"], np.float64)  # (steps, 8)
  n = z.size
  # Binomial mean: 5 standard errors (false failure rate < 1e-6).
  assert abs(z.mean() - p) < 5 * np.sqrt(p * (1 - p) / n)
  # Kept blocks are scaled by 1/p, so the mean update is the incoming one (1.0).
  u = np.asarray(updates["w"], np.float64)
  np.testing.assert_allclose(np.unique(u), sorted({0.0, 1.0 / p}), rtol=1e-6)
  assert abs(u.mean() - 1.0) < 5 * np.sqrt((1 - p) / p / n)


def test_blocks_and_steps_are_independent():
  params = {"w": jnp.zeros((16,))}
  masks, _ = _masks_over_steps(
    magma.bernoulli_mask(0.5, key=2, granularity="element"), params
  )
  z = np.asarray(masks["w"], np.float64)  # (steps, 16)
  corr = np.corrcoef(z.T)  # across blocks
  off_diag = corr[~np.eye(16, dtype=bool)]
  # Independent draws: |corr| ~ N(0, 1/steps); 5 sigma bound on every pair.
  assert np.abs(off_diag).max() < 5 / np.sqrt(N_STEPS)
  lag1 = np.corrcoef(z[:-1].ravel(), z[1:].ravel())[0, 1]  # across steps
  assert abs(lag1) < 5 / np.sqrt(z.size)


def test_keys_same_and_different():
  params = {"w": jnp.zeros((32,))}
  tx = lambda key: magma.bernoulli_mask(0.5, key=key, granularity="element")
  a, _ = _masks_over_steps(tx(0), params, steps=20)
  b, _ = _masks_over_steps(tx(0), params, steps=20)
  c, _ = _masks_over_steps(tx(1), params, steps=20)
  d, _ = _masks_over_steps(tx(jax.random.key(1)), params, steps=20)
  np.testing.assert_array_equal(a["w"], b["w"])
  assert (np.asarray(a["w"]) != np.asarray(c["w"])).mean() > 0.3
  np.testing.assert_array_equal(c["w"], d["w"])  # int and typed key agree


def test_rescale_false_keeps_kept_blocks_unscaled():
  params = {"w": jnp.zeros((4, 4))}
  tx = magma.bernoulli_mask(0.5, rescale=False, granularity="row")
  masks, updates = _masks_over_steps(tx, params, 8)
  z = np.asarray(masks["w"], np.float32)  # (steps, 4): one draw per row
  np.testing.assert_array_equal(updates["w"], np.broadcast_to(z[..., None], (8, 4, 4)))
  assert 0 < z.mean() < 1  # both kept (exactly 1, no 1/p) and dropped blocks occur


def test_per_label_keep_probabilities_and_stats():
  params = {
    "layer": {
      "attn": {"q_proj": jnp.zeros((4, 4))},
      "mlp": {"up": jnp.zeros((4, 4))},
      "norm": {"scale": jnp.zeros((4,))},
    },
    "embed": jnp.zeros((6, 4)),
  }
  probs = {"attention": 0.6, "mlp": 0.8, "other": 0.9}
  tx = magma.bernoulli_mask(probs, key=3, granularity="element")
  ones = jax.tree.map(jnp.ones_like, params)

  @jax.jit
  def run(state):
    def body(state, _):
      _, state = tx.update(ones, state, params)
      return state, magma.mask_stats(state)["active_fraction_by_label"]

    return jax.lax.scan(body, state, None, length=200)

  _, fractions = run(tx.init(params))
  sizes = {"attention": 16, "mlp": 16, "other": 28}
  for label, p in probs.items():
    n = 200 * sizes[label]
    assert abs(float(np.mean(fractions[label])) - p) < 5 * np.sqrt(p * (1 - p) / n)


def test_label_mapping_scopes_and_rejects_unknown_labels():
  params = {"attn": {"q": jnp.zeros((4, 4))}, "head": jnp.zeros((4, 2))}
  tx = magma.bernoulli_mask({"attention": 0.5})
  state = tx.init(params)
  assert isinstance(state.mask["head"], optax.MaskedNode)
  with pytest.raises(ValueError, match="atention"):
    magma.bernoulli_mask({"atention": 0.5}).init(params)


def test_keep_prob_schedule():
  params = {"w": jnp.zeros((64,))}
  schedule = optax.linear_schedule(1.0, 0.2, transition_steps=10)
  masks, _ = _masks_over_steps(
    magma.bernoulli_mask(schedule, key=4, granularity="element"), params, steps=30
  )
  z = np.asarray(masks["w"], np.float64)
  assert z[0].all()  # p = 1 at step 0
  late = z[10:].mean()
  assert abs(late - 0.2) < 5 * np.sqrt(0.2 * 0.8 / z[10:].size)


def test_inject_hyperparams_over_the_factories():
  params = {"w": jnp.zeros((64,))}
  g = {"w": jnp.ones((64,))}
  tx = optax.inject_hyperparams(magma.bernoulli_mask)(
    keep_prob=0.5, granularity="element"
  )
  state = tx.init(params)
  step = jax.jit(tx.update)
  _, state = step(g, state, params)
  state.hyperparams["keep_prob"] = jnp.asarray(1.0, jnp.float32)
  for _ in range(3):
    updates, state = step(g, state, params)
    np.testing.assert_array_equal(updates["w"], 1.0)
  assert step._cache_size() == 1
  assert float(magma.mask_stats(state)["active_fraction"]) == 1.0
  # Wrappers too (the base optimizer is passed through statically).
  tx = optax.inject_hyperparams(magma.magma)(optax.adam(1e-2), tau=2.0, keep_prob=0.5)
  state = tx.init(params)
  _, state = jax.jit(tx.update)(g, state, params)
  state.hyperparams["tau"] = jnp.asarray(0.5, jnp.float32)
  _, state = jax.jit(tx.update)(g, state, params)
  # cos(mu, g) = 1 for a constant gradient: s_2 = 0.81*0.5 + 0.09*sig(0.5) + 0.1*sig(2)
  expected = 0.81 * 0.5 + 0.09 * jax.nn.sigmoid(0.5) + 0.1 * jax.nn.sigmoid(2.0)
  np.testing.assert_allclose(
    magma.mask_stats(state)["scores"]["w"], expected, rtol=1e-6
  )


def test_schedules_leaving_the_range_are_clipped_not_nan():
  # Valid at step 0, below 0 from step 2 on: clipped to p = 0 (nothing kept, no 0/0).
  schedule = optax.linear_schedule(1.0, -1.0, 4)
  params = {"w": jnp.zeros((8,))}
  for tx in (
    magma.bernoulli_mask(schedule, granularity="element"),
    magma.alignment_mask(keep_prob=schedule, granularity="element"),
  ):
    masks, updates = _masks_over_steps(tx, params, 5)
    u = np.asarray(updates["w"])
    assert np.all(np.isfinite(u))
    np.testing.assert_array_equal(u[2:], 0.0)
    assert np.asarray(masks["w"])[0].all()  # p = 1 at step 0


def test_bad_hyperparameter_types_are_refused():
  for bad in ("0.5", True, np.bool_(True)):
    with pytest.raises(ValueError, match="keep_prob must be a float"):
      magma.bernoulli_mask(bad)
  with pytest.raises(ValueError, match="tau must be a float"):
    magma.alignment_mask(tau="2")
  with pytest.raises(ValueError, match="momentum_dtype must be a floating dtype"):
    magma.magma(optax.adam(1e-3), momentum_dtype="int8")
  params = {"a": jnp.ones(3), "b": jnp.ones(3)}
  for where in ({"a": "no", "b": True}, {"a": 0, "b": 1}):
    with pytest.raises(ValueError, match=r"where must give a bool per leaf.*\['a'\]"):
      magma.bernoulli_mask(0.5, where=where).init(params)
  tx = magma.bernoulli_mask(0.5, where={"a": np.bool_(False), "b": jnp.asarray(True)})
  state = tx.init(params)  # numpy / jax booleans are fine
  assert isinstance(state.mask["a"], optax.MaskedNode)
