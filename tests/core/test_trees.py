"""Tests for magma_optax._trees: the parameter-shaped subtrees of a state."""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from magma_optax._core import shard_map as _shard_map
from magma_optax._core import trees as _trees
from magma_optax._core import xla_cpu as _xla_cpu


def test_map_like_with_masked_subtrees_shapes_and_more_trees():
  params = {"a": jnp.ones(2), "b": {"c": jnp.ones(3), "d": jnp.ones(1)}}
  params_def = jax.tree.structure(params)
  # A group's moments: the "b" subtree masked as a whole, as optax.masked does.
  group = optax.adam(1e-3).init({"a": params["a"], "b": optax.MaskedNode()})
  entries = _trees.split_like(group[0].mu, params_def)
  assert [getattr(e, "shape", None) for e in entries] == [(2,), None, None]
  assert _trees.split_like(group[0].count, params_def) is None
  # fn sees the parameter index and the entry of every extra tree at that place.
  other = jax.tree.map(lambda x: x + 1.0, group)
  out = _trees.map_like(lambda i, x, y: x + y + i, group, params_def, other)
  assert out[0].mu["a"].tolist() == [1.0, 1.0]
  assert isinstance(out[0].mu["b"], optax.MaskedNode)
  assert int(out[0].count) == 0  # not parameter-like: unchanged
  # shapes: a tree at other shapes than the given ones is not parameter-like.
  same = _trees.map_like(lambda i, x: x + 1.0, group, params_def, shapes=[(5,)] * 3)
  assert same[0].mu["a"].tolist() == [0.0, 0.0]
  moved = _trees.map_like(lambda i, x: x + 1.0, group, params_def, shapes=[(2,)] * 3)
  assert moved[0].mu["a"].tolist() == [1.0, 1.0]


def test_run_if_runs_zero_or_one_step_and_is_reverse_differentiable():
  # A loop of zero or one step (state updated in place); its tangent comes from a
  # lax.cond, since a while_loop has no reverse mode.
  fn = lambda x: {"a": x["a"] * 3.0}
  x = {"a": jnp.arange(3.0)}
  assert _xla_cpu.run_if(jnp.asarray(True), fn, x)["a"].tolist() == [0.0, 3.0, 6.0]
  assert _xla_cpu.run_if(jnp.asarray(False), fn, x)["a"].tolist() == [0.0, 1.0, 2.0]

  def loss(s, pred):
    return jnp.sum(_xla_cpu.run_if(pred, fn, {"a": s * x["a"]})["a"])

  for pred, want in ((True, 9.0), (False, 3.0)):
    grad = jax.jit(jax.grad(loss))(jnp.asarray(1.0), jnp.asarray(pred))
    assert float(grad) == want
    # under vmap too
    grads = jax.vmap(jax.grad(loss), (0, None))(jnp.ones(2), jnp.asarray(pred))
    assert grads.tolist() == [want, want]


def test_run_if_nested_in_a_differentiated_run_if_is_reverse_differentiable():
  # The outer loop traces its body on plain tracers: the inner run_if sees no
  # tangent in its operand, and must still take its tangent from a cond.
  def loss(s, outer, inner):
    def fn(c):
      return _xla_cpu.run_if(inner, lambda d: {"a": d["a"] * 3.0}, {"a": c["a"] * 2.0})

    return jnp.sum(_xla_cpu.run_if(outer, fn, {"a": s * jnp.arange(3.0)})["a"])

  grad = jax.jit(jax.grad(loss))
  for outer, inner, want in ((1, 1, 18.0), (1, 0, 6.0), (0, 1, 3.0), (0, 0, 3.0)):
    got = grad(jnp.asarray(1.0), jnp.asarray(bool(outer)), jnp.asarray(bool(inner)))
    assert float(got) == want


def test_run_if_differentiates_what_fn_closes_over_also_inside_scan():
  # The tangent flows through fn's closure (s), not the operand; in a scan the
  # loop is traced before any tangent exists. Two steps: sum(x * s**2), d/ds = 6.
  def loss(s, pred):
    def body(c, _):
      return _xla_cpu.run_if(pred, lambda x: {"a": x["a"] * s}, c), None

    out, _ = jax.lax.scan(body, {"a": jnp.arange(3.0)}, None, length=2)
    return jnp.sum(out["a"])

  grad = jax.jit(jax.grad(loss))
  assert float(grad(jnp.asarray(1.0), jnp.asarray(True))) == 6.0
  assert float(grad(jnp.asarray(1.0), jnp.asarray(False))) == 0.0
  # forward mode agrees
  tangent = jax.jvp(lambda s: loss(s, jnp.asarray(True)), (1.0,), (1.0,))[1]
  assert float(tangent) == 6.0


def test_inside_shard_map_bodies_are_traced_once_for_their_types():
  # Inside shard_map a loop's carry and a cond's outputs are cast to the types the
  # body gives them; the trace that finds those types is replayed as the body, so
  # nested loops and branches do not trace their bodies again at every level.

  mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  calls = {"body": 0, "true": 0, "false": 0, "fn": 0}

  def body(c):  # a constant count made to vary by the shard's values
    calls["body"] += 1
    i, n, x = c
    return i + 1, n + jnp.sum(x > 0).astype(jnp.int32), x

  def local(x):
    _, n, _ = _shard_map.while_loop(
      lambda c: c[0] < 2, body, (jnp.int32(0), jnp.int32(0), x)
    )

    def true_fun(x):
      calls["true"] += 1
      return x * 2.0, jnp.sum(x)  # varies along x

    def false_fun(x):
      calls["false"] += 1
      return x, jnp.float32(0.0)  # a constant: cast to vary along x

    y, s = _shard_map.cond(n > 2, true_fun, false_fun, x)

    def fn(c):
      calls["fn"] += 1
      return {"a": c["a"] + x.sum(), "k": c["k"] + 1}

    z = _xla_cpu.run_if(n > 0, fn, {"a": jnp.float32(0.0), "k": jnp.int32(0)})
    return y, s[None], z["a"][None], z["k"][None]

  f = jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
  x = jnp.arange(-1.0, 3.0)
  y, s, a, k = jax.jit(f)(x)
  assert y.tolist() == [-2.0, 0.0, 2.0, 4.0] and s.tolist() == [2.0]
  assert a.tolist() == [2.0] and k.tolist() == [1]
  # One pass finds a type to cast, the next finds none: two traces, no third.
  assert calls["body"] == 2, calls
  assert calls["true"] == 1 and calls["false"] == 1, calls  # no retrace by lax.cond
  assert calls["fn"] == 2, calls  # run_if: typing (2) then replayed in its loop
  # The same outside shard_map: each body traced once by lax itself.
  calls.update(body=0, true=0, false=0, fn=0)
  y2, *_ = jax.jit(local)(x)
  assert y2.tolist() == y.tolist()
  assert calls == {"body": 1, "true": 1, "false": 1, "fn": 1}, calls
