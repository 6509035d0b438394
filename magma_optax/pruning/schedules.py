"""Sparsity schedules: the target sparsity of :func:`magma_optax.periodic_mask` over
time.

:func:`polynomial_sparsity_schedule` (``optax.polynomial_schedule``: Zhu & Gupta's
gradual pruning, cubic by default) and :func:`linear_sparsity_schedule`
(``optax.linear_schedule``) with the sparsity's checks; any ``optax.Schedule`` works,
checked at step 0 and clipped to [0, 1] wherever it is evaluated.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from magma_optax._core import schedules as _schedules

RAMPS = ("constant", "linear", "cubic")


def check_sparsity(name: str, value: Any) -> Any:
  """A target sparsity (or a schedule of one, at step 0) in [0, 1)."""
  return _schedules.check_range(name, value, 0.0, 1.0, low_open=False, high_open=True)


def polynomial_sparsity_schedule(
  final_sparsity: float,
  *,
  begin_step: int,
  end_step: int,
  initial_sparsity: float = 0.0,
  power: float = 3.0,
) -> optax.Schedule:
  r"""Gradual-magnitude-pruning ramp of the target sparsity (cubic by default).

  .. math::

     s_t = s_f + (s_i - s_f)\left(1 - \frac{\min(\max(t - t_0, 0), T)}{T}\right)^{p},
     \qquad T = t_1 - t_0

  so ``s_t = s_i`` before ``begin_step`` (t_0), ``s_f`` from ``end_step`` (t_1) on, and
  the sparsity grows fast early and slowly near the end (p = 3 is Zhu & Gupta's
  choice; p = 1 is a linear ramp, see :func:`linear_sparsity_schedule`). This is
  ``optax.polynomial_schedule(s_i, s_f, p, T, t_0)`` with the arguments checked and
  a float32 result.

  Args:
    final_sparsity: s_f in [0, 1).
    begin_step: t_0 >= 0, the step at which the ramp starts.
    end_step: t_1 > t_0, the step at which ``final_sparsity`` is reached.
    initial_sparsity: s_i in [0, 1) (default 0).
    power: p > 0 (default 3).

  Returns:
    An ``optax.Schedule`` ``count -> f32 sparsity``.

  Example:
    >>> import magma_optax as magma
    >>> sched = magma.polynomial_sparsity_schedule(0.8, begin_step=0, end_step=100)
    >>> round(float(sched(100)), 6), round(float(sched(0)), 6)
    (0.8, 0.0)

  References:
    Zhu & Gupta, To prune, or not to prune, arXiv 1710.01878 (2017), Eq. 1.
  """
  check_sparsity("final_sparsity", final_sparsity)
  check_sparsity("initial_sparsity", initial_sparsity)
  _schedules.check_positive("power", power)
  if isinstance(begin_step, bool) or not isinstance(begin_step, int) or begin_step < 0:
    raise ValueError(f"begin_step must be an int >= 0; got {begin_step!r}.")
  if (
    isinstance(end_step, bool)
    or not isinstance(end_step, int)
    or end_step <= begin_step
  ):
    raise ValueError(
      f"end_step must be an int > begin_step={begin_step}; got {end_step!r}."
    )
  ramp_fn = optax.polynomial_schedule(
    init_value=initial_sparsity,
    end_value=final_sparsity,
    power=power,
    transition_steps=end_step - begin_step,
    transition_begin=begin_step,
  )
  return lambda count: jnp.asarray(ramp_fn(count), jnp.float32)


def linear_sparsity_schedule(
  final_sparsity: float,
  *,
  begin_step: int,
  end_step: int,
  initial_sparsity: float = 0.0,
) -> optax.Schedule:
  """Linear ramp of the target sparsity: ``optax.linear_schedule``, checked.

  :func:`polynomial_sparsity_schedule` with ``power=1``.

  Example:
    >>> import magma_optax as magma
    >>> sched = magma.linear_sparsity_schedule(0.5, begin_step=0, end_step=10)
    >>> round(float(sched(5)), 6)
    0.25
  """
  return polynomial_sparsity_schedule(
    final_sparsity,
    begin_step=begin_step,
    end_step=end_step,
    initial_sparsity=initial_sparsity,
    power=1.0,
  )


def validate_ramp(schedule: str | None) -> str:
  """``periodic_mask``'s ``schedule=``: ``None`` (= ``"constant"``) or a ramp name."""
  if schedule is None:
    return "constant"
  if schedule not in RAMPS:
    raise ValueError(
      f"schedule must be None or one of {RAMPS}; got {schedule!r} (pass a custom"
      " ramp as sparsity=<optax.Schedule>)."
    )
  return schedule


def ramp(
  schedule: str, sparsity: Any, *, start: int, end: int | None
) -> _schedules.ScalarOrSchedule:
  """The target sparsity of ``periodic_mask(schedule=...)``.

  ``"constant"``: ``sparsity`` itself (a float or a schedule); ``"linear"`` /
  ``"cubic"``: a ramp from 0 at ``start`` to the float ``sparsity`` at ``end``.
  """
  if schedule == "constant":
    return sparsity
  if end is None or end <= start or _schedules.is_schedule(sparsity):
    raise ValueError(
      f"schedule={schedule!r} ramps from 0 at start to a float sparsity at end;"
      f" it needs a float sparsity and end > start (got sparsity={sparsity!r},"
      f" start={start}, end={end})."
    )
  return polynomial_sparsity_schedule(
    float(sparsity),
    begin_step=start,
    end_step=end,
    power=1.0 if schedule == "linear" else 3.0,
  )
