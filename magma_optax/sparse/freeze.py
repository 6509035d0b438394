"""Freezing a generic base's new state where it is computed, so that its update reads
the frozen state.

Skip storage keeps a base's state where the parameter mask is off: ``where(M, s',
s)``. :func:`evaluate` traces the base's step and replaces each state output to be
frozen, where it is computed, by that select behind a barrier, so that every later
use reads the frozen value and XLA copies no old state. It applies only where every
use of ``s'`` is elementwise (checked per output); :func:`reads_inputs` finds the
outputs of a function that read its inputs' values. Design notes:
``docs/design/internals.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from magma_optax._core import xla_cpu as _xla_cpu

# Primitives that map each position of their (same-shaped or scalar) operands to the
# same position of their result.
ELEMENTWISE = frozenset({
  "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh",
  "cbrt", "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh",
  "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt",
  "integer_pow", "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min",
  "mul", "ne", "neg", "nextafter", "not", "or", "pow", "reduce_precision", "rem",
  "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "sub", "tan",
  "tanh", "xor",
})  # fmt: skip
_CALLS = frozenset({"jit", "pjit"})
_TRACE_ERRORS = (
  jax.errors.ConcretizationTypeError,
  jax.errors.TracerArrayConversionError,
  jax.errors.TracerIntegerConversionError,
)


class Target(NamedTuple):
  """A state output to freeze: ``where(mask, new, old)``; ``group``: the outputs
  (flat indices) that are masked by the same ``mask`` downstream."""

  mask: jax.Array
  old: jax.Array
  group: Collection[int]


def _is_var(x: Any) -> bool:
  return not isinstance(x, jcore.Literal)


def _elementwise_slice(jaxpr: Any, start: set, shape: tuple) -> set | None:
  """The vars of ``jaxpr`` that read (transitively) the vars ``start``, or ``None``
  where one of them is not an elementwise function of ``shape``-shaped values."""
  reach = set(start)
  for eqn in jaxpr.eqns:
    hit = [i for i, x in enumerate(eqn.invars) if _is_var(x) and x in reach]
    if not hit:
      continue
    name = eqn.primitive.name
    if name in _CALLS:  # followed inside: a jit of a whole tree has other outputs
      inner = eqn.params["jaxpr"].jaxpr
      inner_reach = _elementwise_slice(inner, {inner.invars[i] for i in hit}, shape)
      if inner_reach is None:
        return None
      reach.update(
        o for o, x in zip(eqn.outvars, inner.outvars, strict=True)
        if _is_var(x) and x in inner_reach
      )  # fmt: skip
    elif name in ELEMENTWISE:
      if any(o.aval.shape != shape for o in eqn.outvars) or any(
        getattr(x.aval, "shape", ()) not in ((), shape) for x in eqn.invars
      ):
        return None
      reach.update(eqn.outvars)
    else:
      return None
  return reach


# Calls whose inner jaxpr takes the equation's inputs one to one: followed inside.
_CALL_JAXPRS = {
  "jit": "jaxpr", "pjit": "jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr",
  "remat2": "jaxpr",
  "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
  "custom_jvp_call": "call_jaxpr",
}  # fmt: skip


def _reads(jaxpr: Any, start: set) -> set:
  """The vars of ``jaxpr`` whose values read (transitively) the vars ``start``:
  calls (``jit``, ``checkpoint``, ``custom_jvp``) are followed inside; any other
  primitive's outputs read all of its inputs (so a value read through control
  flow counts, conservatively)."""
  reach = set(start)
  for eqn in jaxpr.eqns:
    hit = [i for i, x in enumerate(eqn.invars) if _is_var(x) and x in reach]
    if not hit:
      continue
    inner = eqn.params.get(_CALL_JAXPRS.get(eqn.primitive.name, ""))
    inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's, or a Jaxpr
    if inner is not None and len(inner.invars) == len(eqn.invars):
      inner_reach = _reads(inner, {inner.invars[i] for i in hit})
      reach.update(
        o for o, x in zip(eqn.outvars, inner.outvars, strict=True)
        if _is_var(x) and x in inner_reach
      )  # fmt: skip
    else:
      reach.update(eqn.outvars)
  return reach


def reads_inputs(fn: Callable[..., Any], *args: Any) -> Any:
  """Whether each output leaf of ``fn(*args)`` reads the *values* of ``args`` (not
  only their shapes and dtypes): a tree of bools like ``fn``'s output, from the
  dataflow of its jaxpr (nothing is computed).

  Example:
    >>> import jax.numpy as jnp
    >>> from magma_optax.sparse import freeze as _freeze
    >>> _freeze.reads_inputs(lambda x: (jnp.zeros_like(x), 2 * x), jnp.ones(3))
    (False, True)
  """
  closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  reach = _reads(closed.jaxpr, set(closed.jaxpr.invars))
  flags = [_is_var(x) and x in reach for x in closed.jaxpr.outvars]
  return jax.tree.unflatten(jax.tree.structure(shape), flags)


def evaluate(
  fn: Callable[[], Any],
  targets_of: Callable[[Any], Mapping[int, Target]],
  tracing: bool = True,
) -> tuple[Any, set[int]]:
  """``fn()``, with the targets among its flat outputs frozen where they are
  computed.

  ``fn`` takes no arguments (its inputs are closed over) and is traced once.
  ``targets_of(shapes)`` gets the tree of its outputs' ``jax.ShapeDtypeStruct`` and
  names the targets by their index among the flat outputs.

  Returns ``(fn's outputs, the indices of the targets frozen)``; the other outputs
  are as ``fn`` computed them (the caller freezes them as before).

  Only where something is traced (``tracing``: under ``jit``, ``vmap``, ``grad``):
  run eagerly, each operation executes on its own and there is no copy to save, so
  ``fn`` is called as it is (a base may then also read values, print them, ...).
  Where tracing it fails for want of a concrete value, ``fn`` is called as it is too
  (its Python side effects then run twice).
  """
  if not tracing:
    return fn(), set()
  try:
    closed, shape = jax.make_jaxpr(fn, return_shape=True)()
  except _TRACE_ERRORS:
    return fn(), set()
  targets = targets_of(shape)
  jaxpr = closed.jaxpr
  outs = jaxpr.outvars
  readers: dict[Any, set[int]] = {}  # var -> the output indices it is
  for k, x in enumerate(outs):
    if _is_var(x):
      readers.setdefault(x, set()).add(k)
  inputs = set(jaxpr.invars) | set(jaxpr.constvars)
  # One array as two entries: each has its own old value (frozen after the step).
  shared = {x for x, ks in readers.items() if len(ks & targets.keys()) > 1}
  freeze: dict[Any, Target] = {}
  for k, t in targets.items():
    x = outs[k]
    if not _is_var(x) or x in inputs or x in shared:
      continue
    aval = x.aval
    if (t.mask.shape, t.old.shape, t.old.dtype) != (aval.shape, aval.shape, aval.dtype):
      continue
    reach = _elementwise_slice(jaxpr, {x}, aval.shape)
    if reach is not None and all(readers.get(y, set()) <= set(t.group) for y in reach):
      freeze[x] = t
  env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))

  def read(x):
    return env[x] if _is_var(x) else x.val

  def output(x):  # a constant output as the array fn returned, not a literal
    return env[x] if _is_var(x) else jnp.asarray(x.val, x.aval.dtype)

  for eqn in jaxpr.eqns:
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
      got = eqn.primitive.bind(*map(read, eqn.invars), **params)
    if not eqn.primitive.multiple_results:
      got = [got]
    for x, value in zip(eqn.outvars, got, strict=True):
      if x in freeze:
        t = freeze[x]
        value = _xla_cpu.in_place(_xla_cpu.kept(t.mask, value, t.old))
      env[x] = value
  done = {k for k in targets if _is_var(outs[k]) and outs[k] in freeze}
  return jax.tree.unflatten(jax.tree.structure(shape), map(output, outs)), done
