"""Hyperparameters that may be constants or ``optax.Schedule``s, and their checks.

A hyperparameter such as ``keep_prob`` or ``tau`` is a float, a (possibly traced) JAX
scalar -- ``optax.inject_hyperparams`` passes those -- or a schedule ``count -> value``.
Constants are checked at construction; a schedule is checked by evaluating it at step
0 (schedules are pure functions of the count, so this is cheap and catches the common
mistakes). Traced values cannot be checked and are taken as given.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from magma_optax._core import compat as _compat

ScalarOrSchedule = float | jax.Array | optax.Schedule


def is_schedule(value: Any) -> bool:
  return callable(value) and not isinstance(value, jax.Array)


def evaluate(value: ScalarOrSchedule, count: jax.Array) -> jax.Array:
  """The hyperparameter's value at step ``count``, as an f32 scalar."""
  if is_schedule(value):
    value = value(count)
  return jnp.asarray(value, dtype=jnp.float32)


def evaluate_fraction(value: ScalarOrSchedule, count: jax.Array) -> jax.Array:
  """:func:`evaluate` clipped to [0, 1]: a probability or a sparsity.

  Construction checks a schedule only at step 0; a schedule that later leaves the
  range is clipped here (documented rule), never turned into a NaN mask scale or a
  sparsity above 1.
  """
  return jnp.clip(evaluate(value, count), 0.0, 1.0)


def _concrete(value: Any) -> float | None:
  """A Python float for a concrete scalar, ``None`` for a traced one."""
  if _compat.is_tracer(value):
    return None
  is_bool_array = jnp.dtype(getattr(value, "dtype", "f4")) == jnp.bool_
  if isinstance(value, (bool, str, bytes)) or is_bool_array:
    raise ValueError(f"expected a number, got {value!r}")  # float() would take them
  try:
    return float(value)
  except (TypeError, ValueError) as e:
    raise ValueError(f"expected a scalar, got {value!r}") from e


def check_range(
  name: str,
  value: ScalarOrSchedule,
  low: float,
  high: float,
  *,
  low_open: bool,
  high_open: bool,
  schedules: bool = True,
) -> ScalarOrSchedule:
  """Raises ``ValueError`` unless ``value`` (or the schedule at 0) lies in the range.

  ``schedules=False``: a schedule is an error too (a hyperparameter that only
  ``optax.inject_hyperparams`` may schedule).
  """
  kinds = "a float or an optax.Schedule" if schedules else "a float or a scalar array"
  probe = value
  what = ""
  if is_schedule(value) and not schedules:
    raise ValueError(
      f"{name} must be {kinds}, not a schedule; got {value!r}. To schedule it, wrap"
      " the factory in optax.inject_hyperparams, which evaluates the schedule and"
      " passes its value."
    )
  if is_schedule(value):
    try:
      probe = value(jnp.zeros([], jnp.int32))
    except Exception:  # noqa: BLE001  a schedule we cannot evaluate is taken as is
      return value
    what = " (schedule at step 0)"
  try:
    x = _concrete(probe)
  except ValueError as e:
    raise ValueError(f"{name} must be {kinds}; {e}.") from None
  if x is None:
    return value
  lo_ok = x > low if low_open else x >= low
  hi_ok = x < high if high_open else x <= high
  if not (lo_ok and hi_ok):
    interval = (
      ("(" if low_open else "[") + f"{low}, {high}" + (")" if high_open else "]")
    )
    raise ValueError(f"{name} must lie in {interval}; got {x}{what}.")
  return value


def check_positive(name: str, value: ScalarOrSchedule) -> ScalarOrSchedule:
  return check_range(name, value, 0.0, float("inf"), low_open=True, high_open=True)


def check_probability(name: str, value: ScalarOrSchedule) -> ScalarOrSchedule:
  """A keep probability: (0, 1]."""
  return check_range(name, value, 0.0, 1.0, low_open=True, high_open=False)


def check_decay(name: str, value: ScalarOrSchedule) -> ScalarOrSchedule:
  """An EMA decay: [0, 1)."""
  return check_range(name, value, 0.0, 1.0, low_open=False, high_open=True)


def check_adam(b1: Any, b2: Any, eps: Any, eps_root: Any) -> None:
  """Checks Adam's decay rates (in [0, 1)) and epsilons (>= 0).

  Each is a Python float or a scalar array: the kernels read them at run time, so
  ``optax.inject_hyperparams`` may inject them (traced values are taken as given).
  A schedule is an error: ``optax.inject_hyperparams`` schedules them.
  """
  for name, value, high in (
    ("b1", b1, 1.0), ("b2", b2, 1.0), ("eps", eps, float("inf")),
    ("eps_root", eps_root, float("inf")),
  ):  # fmt: skip
    check_range(name, value, 0.0, high, low_open=False, high_open=True, schedules=False)
