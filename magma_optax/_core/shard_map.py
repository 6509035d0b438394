"""Transforms and control flow that keep their types inside ``jax.shard_map``.

Inside ``shard_map`` a value is typed by the manual mesh axes it varies along, and a
loop's carry, a branch's outputs and a transform's state must keep one type. These
helpers find that type (:func:`typed_carry`) and cast to it; outside ``shard_map``
each is the plain ``jax.lax`` function. :func:`typed` types a transform's initial
state as its update returns it.
"""

from __future__ import annotations

import contextvars
from typing import Any

import jax
import jax.numpy as jnp

from magma_optax._core import compat as _compat


def _manual_axes() -> tuple[str, ...]:
  """The mesh axes of the enclosing ``jax.shard_map`` (empty outside one)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  manual = jax.sharding.AxisType.Manual
  return tuple(
    n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == manual
  )


def _varying_aval(aval: Any) -> frozenset:
  """The manual mesh axes along which a value varies (its type inside shard_map):
  ``aval.mat.varying`` in JAX 0.10 and 0.12, ``aval.vma`` before."""
  mat = getattr(aval, "mat", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def varying(x: jax.Array) -> frozenset:
  """The manual mesh axes along which ``x`` varies (empty outside ``shard_map``)."""
  return _varying_aval(jax.typeof(x))


def vary_along(x: jax.Array, axes: Any) -> jax.Array:
  """``x`` cast to vary along those of the manual mesh ``axes`` (inside
  ``jax.shard_map``) along which it does not vary yet; elsewhere ``x``."""
  missing = tuple(a for a in _manual_axes() if a in axes and a not in varying(x))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def varying_like_body(body: Any, carry: Any) -> Any:
  """``carry`` cast to vary along every manual mesh axis along which ``body(carry)``
  varies, so that a loop over ``body`` keeps its carry's type.

  Inside ``jax.shard_map`` a loop's carry must have the same type before and after
  its body, and a carry that starts as a constant (a zero count, ``False``) becomes
  varying once the body mixes in the local shard's values. Outside ``shard_map``
  ``carry`` is returned as it is, and nothing is traced.
  """
  return typed_carry(body, carry)[0]


def typed_carry(body: Any, carry: Any) -> tuple[Any, tuple[Any, Any] | None]:
  """``(carry, traced)``: the carry of :func:`varying_like_body`, and inside
  ``jax.shard_map`` the trace of ``body`` on it that found its types
  (``jax.make_jaxpr(body, return_shape=True)(carry)``, for ``compat.replay`` and
  ``compat.hoist_closure``), else None."""
  if not _manual_axes():
    return carry, None
  for _ in range(len(jax.tree.leaves(carry)) + 1):  # each pass adds an axis or stops
    traced = jax.make_jaxpr(body, return_shape=True)(carry)
    out = traced[0].out_avals
    leaves, treedef = jax.tree.flatten(carry)
    if len(out) != len(leaves):
      return carry, traced
    cast = [vary_along(x, _varying_aval(y)) for x, y in zip(leaves, out, strict=True)]
    if all(c is x for c, x in zip(cast, leaves, strict=True)):
      return carry, traced
    carry = treedef.unflatten(cast)
  return carry, None


# Set while a typed transform's init types its state, and while a typed update
# runs: an init called there (an inner transform's, or a reset's initial values)
# is not typed again. Each typing traces an update, and nested typings multiply.
_UNTYPED = contextvars.ContextVar("magma_optax_untyped", default=False)


def typed(init_fn: Any, update_fn: Any, *, param_mask: bool = False) -> tuple[Any, Any]:
  """``(init, update)``: ``init_fn`` whose state, inside ``jax.shard_map``, has
  the types that ``update_fn`` gives it back, and ``update_fn``.

  Inside ``shard_map`` a state leaf built from constants (a zero count, a score,
  ``False``) is typed as the same on every shard, and an update that mixes in the
  shard's gradient returns it typed as varying along the manual mesh axes; a loop
  over steps (``lax.scan``), ``optax.MultiSteps`` and ``optax.apply_if_finite`` then
  fail, since their carry or branches must keep one type. Here the initial state
  is cast to the types of one traced update (gradients typed like the parameters,
  with ``param_mask`` a mask typed like them), as ``optax.adam``'s ``zeros_like``
  moments are. Values do not change. Only the outermost transform types its state
  (which holds its inner ones'). Outside ``shard_map`` this is ``init_fn`` and
  nothing more is traced; an update that cannot be traced from ``params`` alone
  (it needs other extra args) leaves the state as ``init_fn`` built it.
  """

  def untyped(fn: Any, *args: Any, **kwargs: Any) -> Any:
    token = _UNTYPED.set(True)
    try:
      return fn(*args, **kwargs)
    finally:
      _UNTYPED.reset(token)

  def typed_init(params: Any) -> Any:
    state = init_fn(params)
    extra = {}
    if param_mask:
      extra["param_mask"] = jax.tree.map(lambda p: p == p, params)

    def step(s: Any) -> Any:
      return update_fn(params, s, params, **extra)[1]

    try:
      return varying_like_body(step, state)
    except Exception:  # noqa: BLE001 - only the types are sought; see above
      return state

  def init(params: Any) -> Any:
    if _UNTYPED.get() or not _manual_axes():
      return init_fn(params)
    return untyped(typed_init, params)

  def update(*args: Any, **kwargs: Any) -> Any:
    if _UNTYPED.get() or not _manual_axes():
      return update_fn(*args, **kwargs)
    return untyped(update_fn, *args, **kwargs)

  return init, update


def while_loop(cond_fun: Any, body_fun: Any, init: Any) -> Any:
  """``jax.lax.while_loop``, also inside ``jax.shard_map`` where the body makes a
  constant initial carry vary (:func:`varying_like_body`)."""
  init, traced = typed_carry(body_fun, init)
  if traced is not None:  # the body as traced for its types, not traced again
    body_fun = _compat.replay(traced)
  return jax.lax.while_loop(cond_fun, body_fun, init)


def fori_loop(lower: int, upper: Any, body_fun: Any, init: Any) -> Any:
  """``jax.lax.fori_loop``, also inside ``jax.shard_map`` (as :func:`while_loop`)."""
  init = varying_like_body(lambda c: body_fun(jnp.int32(lower), c), init)
  return jax.lax.fori_loop(lower, upper, body_fun, init)


def _same_types(funs: list[Any], operands: tuple[Any, ...]) -> list[Any]:
  """``funs`` (each called on ``operands``), inside ``jax.shard_map`` each cast to
  vary along the manual mesh axes along which any of them varies, output by output,
  and traced once (for the types, then replayed); elsewhere ``funs``."""
  if not _manual_axes():
    return funs
  traced = [jax.make_jaxpr(f, return_shape=True)(*operands) for f in funs]
  outs = [closed.out_avals for closed, _ in traced]
  union = [
    frozenset().union(*map(_varying_aval, avals)) for avals in zip(*outs, strict=True)
  ]

  def cast(fun):
    def branch(*args):
      leaves, treedef = jax.tree.flatten(fun(*args))
      return treedef.unflatten(
        [vary_along(x, u) for x, u in zip(leaves, union, strict=True)]
      )

    return branch

  return [cast(_compat.replay(t)) for t in traced]


def cond(pred: Any, true_fun: Any, false_fun: Any, *operands: Any) -> Any:
  """``jax.lax.cond``, also inside ``jax.shard_map`` where one branch's output varies
  along a manual mesh axis and the other's does not (a constant): both are then
  cast to vary along the axes of either. Outside ``shard_map``, ``lax.cond``."""
  true_fun, false_fun = _same_types([true_fun, false_fun], operands)
  return jax.lax.cond(pred, true_fun, false_fun, *operands)


def switch(index: Any, branches: list[Any], *operands: Any) -> Any:
  """``jax.lax.switch``, also inside ``jax.shard_map`` (as :func:`cond`)."""
  return jax.lax.switch(index, _same_types(list(branches), operands), *operands)


def platform_dependent(*operands: Any, default: Any, **per_platform: Any) -> Any:
  """``per_platform[p](*operands)`` for the platform ``p`` the step is lowered for
  (``cpu``, ``cuda``, ``rocm``, ``tpu``), else ``default(*operands)``:
  ``jax.lax.platform_dependent``, chosen at lowering time (the program holds the
  one branch, in a ``case`` on a constant that XLA folds: no branch on the
  device), also inside ``jax.shard_map`` (as :func:`cond`)."""
  names = list(per_platform)
  funs = _same_types([per_platform[n] for n in names] + [default], operands)
  chosen = dict(zip(names, funs[:-1], strict=True))
  return jax.lax.platform_dependent(*operands, default=funs[-1], **chosen)
