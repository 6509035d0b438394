"""Every workaround for XLA:CPU, in one place, each with its cause and its benchmark.

Each function names the jax line where it was measured and the command that shows
what it buys (the numbers are in ``benchmarks/RESULTS.md``); when a benchmark stops
showing a difference, the function becomes its plain form and its callers stay.
Where the other backends want the plain form, the choice is made at lowering time
(``jax.lax.platform_dependent``), so a step compiled for a GPU carries none of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from magma_optax._core import compat as _compat
from magma_optax._core import shard_map as _shard_map

# --- a select whose other case is not the loaded value --------------------------------


def kept(mask: Any, new: jax.Array, old: jax.Array) -> jax.Array:
  """``jnp.where(mask, new, old)``, for an ``old`` that the result overwrites (a
  frozen state entry, written in place into its donated buffer).

  Cause (jax 0.10.2, not 0.12; x86 with AVX): XLA:CPU compiles a select whose other
  case is the value loaded from the address it stores to as a masked store
  (``vmaskmovps``), which AMD's Zen cores run slowly. On the CPU the other case
  here is ``old``'s bits and-ed with ``~mask`` (all ones where it is taken): the
  same value bit for bit (NaN payloads, signed zeros), but not the loaded value, so
  LLVM stores the select as it is; other platforms get ``jnp.where``. Other dtypes,
  or ``new`` and ``old`` of different dtypes or shapes: ``jnp.where``. Derivatives
  are ``jnp.where``'s. Benchmark: the skip rows of ``python3
  benchmarks/sparse_state.py --tiles --donate --width 1024 --layers 4 --steps 50
  --repeats 25`` on an AMD EPYC.
  """
  new, old = jnp.asarray(new), jnp.asarray(old)
  dtype = old.dtype
  if (
    new.dtype != dtype
    or new.shape != old.shape
    or dtype.itemsize not in _UINTS
    or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
  ):
    return jnp.where(mask, new, old)
  mask = jnp.asarray(mask).astype(bool)  # as jnp.where reads it
  if jnp.issubdtype(dtype, jnp.integer):  # no tangent: float0
    return _on_cpu_bits(mask, new, old)
  return _kept_floats(mask, new, old)


_UINTS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _on_cpu_bits(mask: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
  def on_bits(mask, new, old):
    # The select stays (an elementwise op of one operand would be duplicated into
    # every reader by XLA's fusion, which then reads the old state after it is
    # overwritten: a copy of it each step), and its other case is old & ~mask.
    uint = _UINTS[old.dtype.itemsize]
    keep = ~(-mask.astype(uint))  # all ones where not mask
    bits = jax.lax.bitcast_convert_type(old, uint) & keep
    return jnp.where(mask, new, jax.lax.bitcast_convert_type(bits, old.dtype))

  return jax.lax.platform_dependent(
    mask, new, old, cpu=on_bits, default=lambda m, n, o: jnp.where(m, n, o)
  )


# The tangent is the select's (a bitcast has no derivative).
_kept_floats = jax.custom_jvp(_on_cpu_bits)


@_kept_floats.defjvp
def _kept_floats_jvp(primals, tangents):
  mask, new, old = primals
  _, d_new, d_old = tangents
  return _kept_floats(mask, new, old), jnp.where(mask, d_new, d_old)


# --- a branch that computes a value once ----------------------------------------------


def computed_once(u: jax.Array, needed: jax.Array) -> jax.Array:
  """``u`` computed into a buffer of its own on XLA:CPU (``u`` where ``needed``;
  zeros elsewhere, for a caller whose result is zero then whatever ``u`` holds).

  Cause (jax 0.10.2 and 0.12): XLA:CPU fuses the producer of ``u`` into a gather
  that reads it (a tile or N:M expansion, one read per parameter), so ``u``'s
  arithmetic runs once per parameter instead of once per stored entry; it does not
  fuse into a branch, and it removes ``optimization_barrier`` before fusing. Other
  platforms keep the fusion (the arithmetic is cheaper than the buffer there, and
  a branch may wait on its predicate). Benchmark: the tile rows of ``python3
  benchmarks/sparse_state.py --tiles --donate --width 1024 --layers 4 --steps 50
  --repeats 25``.
  """

  def on_cpu(u, needed):
    return _shard_map.cond(needed, lambda u: u, jnp.zeros_like, u)

  return jax.lax.platform_dependent(u, needed, cpu=on_cpu, default=lambda u, _: u)


# --- a rescue in a branch on the CPU, in every step elsewhere ------------------------


def branch_on_cpu(
  on_cpu: Callable[..., Any], elsewhere: Callable[..., Any], *operands: Any
) -> Any:
  """``on_cpu(*operands)`` where the step is lowered for XLA:CPU, else
  ``elsewhere(*operands)``: for a rescue (sums that overflowed or cancelled,
  recomputed) that ``on_cpu`` runs in a branch, or a loop of zero or one step,
  taken only on the steps that need it, and ``elsewhere`` on every step.

  Cause (jax 0.10.2 and 0.12): on XLA:CPU an untaken branch costs nothing and each
  extra reduction is a pass of its own; a GPU or a TPU waits on the host for a
  branch's predicate, and fuses the extra reductions into one pass. Chosen at
  lowering time (:func:`magma_optax._core.shard_map.platform_dependent`): a step
  lowered for a GPU or a TPU holds no branch. Benchmarks: ``python3
  benchmarks/device_structure.py`` (control flow per platform) and ``python3
  benchmarks/step_overhead.py --sizes 1e6,25e6,transformer --rounds 15``.
  """
  return _shard_map.platform_dependent(*operands, cpu=on_cpu, default=elsewhere)


# --- barriers -------------------------------------------------------------------------


def unshared(x: Any) -> Any:
  """``x`` (a pytree) behind an ``optimization_barrier``: XLA does not merge the
  expressions computed from it with equal ones computed from ``x`` elsewhere.

  Cause (jax 0.10.2 and 0.12): XLA:CPU's reductions read their operand from memory,
  so a product shared by a reduction and an elementwise loop (``g * g`` of Adam's
  second moment and of ``||g||^2``) is written out in full; kept apart, each
  reduction computes its product in its own pass. Benchmark: ``python3
  benchmarks/step_overhead.py --sizes 25e6,transformer --rounds 11``.
  """
  return jax.lax.optimization_barrier(x)


def in_place(x: Any) -> Any:
  """``x`` (a pytree) behind an ``optimization_barrier``: XLA materialises it once,
  into the donated buffer it overwrites, and later readers read it there.

  Cause (jax 0.10.2 and 0.12): without it XLA:CPU evaluates an elementwise state
  update twice -- into the state's buffer and again inside the update's loop,
  which then reads the old state, and copies that state first. Benchmark: the skip
  rows of ``python3 benchmarks/sparse_state.py --tiles --donate --width 1024
  --layers 4 --steps 50 --repeats 25``.
  """
  return jax.lax.optimization_barrier(x)


# --- a loop of zero or one step -------------------------------------------------------


def run_if(pred: jax.Array, fn: Callable[[Any], Any], operand: Any) -> Any:
  """``fn(operand)`` if ``pred`` else ``operand``, as a loop of zero or one step.

  Cause (jax 0.10.2 and 0.12): a ``lax.cond`` copies ``operand`` into its output
  buffers whichever branch runs (with donated buffers: every step); a loop updates
  its carry in place. Benchmark: ``python3 benchmarks/sparse_state.py
  --refresh-only --donate --repeats 11``. A ``while_loop`` has no reverse mode, so
  the loop has a JVP rule of its own: the primal is the loop, the tangent a
  ``lax.cond`` (which transposes). It applies wherever the tangents come from, also
  where the loop was traced before them (a ``lax.scan`` body, a ``cond`` branch)
  and to what ``fn`` closes over (hoisted into arguments).
  """
  # Inside shard_map, the operand typed as the loop's carry will be: the hoisted
  # jaxpr then runs on what it was traced on.
  operand, traced = _shard_map.typed_carry(fn, operand)
  converted, consts = _compat.hoist_closure(fn, operand, traced)
  return _run_if(converted, pred, operand, *consts)


def passed_through(x: Any) -> Any:
  """``x``, which a :func:`run_if` body returns untouched, behind a barrier: XLA
  would hoist it out of the loop as an invariant and copy it."""
  return jax.lax.optimization_barrier(x)


def _loop_if(fn: Callable[..., Any], pred: Any, operand: Any, *consts: Any) -> Any:
  """``run_if`` as a loop of zero or one step, ``fn`` taking ``consts`` too.

  ``run_if`` typed ``operand`` as ``fn`` gives it back, and the body gives ``pred``
  its own type: the carry keeps its type without a trace to find it."""
  return jax.lax.while_loop(
    # The body's predicate is the constant False (XLA then sees one step at
    # most, and keeps fewer buffers), typed like `pred` inside shard_map.
    lambda c: c[0],
    lambda c: (
      _shard_map.vary_along(jnp.asarray(False), _shard_map.varying(c[0])),
      fn(c[1], *consts),
    ),
    (pred, operand),
  )[1]


_run_if = jax.custom_jvp(_loop_if, nondiff_argnums=(0,))


@_run_if.defjvp
def _run_if_jvp(fn: Callable[..., Any], primals: Any, tangents: Any) -> Any:
  # The primal is the loop (in place); the tangent is fn's, or the operand's
  # when pred is False, chosen by a cond. Integer and bool leaves have float0
  # tangents, which a cond cannot return: they pass through.
  pred, operand, *consts = primals
  _, t_operand, *t_consts = tangents
  out = _run_if(fn, pred, operand, *consts)
  leaves, treedef = jax.tree.flatten(t_operand)
  real = [i for i, t in enumerate(leaves) if t.dtype != jax.dtypes.float0]

  def ran():
    t = jax.jvp(fn, (operand, *consts), (t_operand, *t_consts))[1]
    flat = treedef.flatten_up_to(t)
    return [flat[i] for i in real]

  taken = _shard_map.cond(pred, ran, lambda: [leaves[i] for i in real])
  for i, t in zip(real, taken, strict=True):
    leaves[i] = t
  return out, treedef.unflatten(leaves)
