"""Adam with sparse state, its step written for each storage (:func:`sparse_adam`).

The same transformation and state as ``sparse_state(optax.adam(...))``, whose Adam
step each storage computes itself (:meth:`magma_optax.sparse.storage.Storage.
fused_adam`): over the active tiles with a fused kernel, or from merged moments that
XLA updates in place. Complex leaves take Adam's complex step in XLA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from magma_optax._core import arguments as _arguments
from magma_optax._core import schedules as _schedules
from magma_optax._core import scoping as _scoping
from magma_optax._core import trees as _trees
from magma_optax._core import xla_cpu as _xla_cpu
from magma_optax.kernels import dispatch
from magma_optax.kernels import reference
from magma_optax.kernels.tiles import api as tiles
from magma_optax.sparse import step as _step
from magma_optax.sparse import storage as _storage
from magma_optax.sparse.state import DEFAULT_DENSITY_THRESHOLD
from magma_optax.sparse.state import Planner
from magma_optax.sparse.state import SparseState


def sparse_adam(
  learning_rate: optax.ScalarOrSchedule,
  b1: jax.typing.ArrayLike = 0.9,
  b2: jax.typing.ArrayLike = 0.999,
  eps: jax.typing.ArrayLike = 1e-8,
  eps_root: jax.typing.ArrayLike = 0.0,
  *,
  mode: str = "skip",
  density: float | None = None,
  structure: tuple[int, int] | None = None,
  axis: int = -1,
  block: tuple[int, int] | None = None,
  shards: Any = None,
  density_threshold: float = DEFAULT_DENSITY_THRESHOLD,
  offload_after: int = 100,
  where: _scoping.Where = None,
  cache_index: bool = True,
  on_error: str = "raise",
  implementation: str | Sequence[str] | None = None,
  interpret: bool | str = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Adam with sparse state, its step fused per storage.

  The same transformation as ``sparse_state(optax.adam(learning_rate, b1, b2, eps,
  eps_root=eps_root), mode=mode, ...)`` with the same storage arguments -- the same
  state (a checkpoint of one restores into the other), masks, errors and updates
  -- whose Adam step is written for each storage instead of running ``optax.adam``
  on the stored tree:

  * **tiles** (``block=(r, c)``): one step per leaf reads the gradient's active
    tiles and updates their compact moments in one pass
    (:func:`magma_optax.kernels.tile_adam`); with
    ``implementation="pallas"`` a kernel whose grid runs over the active tiles'
    slots only, so its cost follows ``density``;
  * **skip** (dense storage, element masks): the frozen moments are merged first,
    ``m <- where(M, m', m)``, and the update is computed from the merged moments
    (equal where ``M`` holds, masked to 0 elsewhere), so XLA updates them in
    place (what :func:`sparse_state` does for a generic base by tracing it, see
    :mod:`magma_optax.sparse.freeze`);
  * other storages (flat and N:M compact, dense leaves): Adam's element-wise step
    on the stored entries, in XLA.

  Everything is computed in float32 (``optax.adam`` on bfloat16 moments computes
  in bfloat16): on float32 parameters the moments equal those of
  ``sparse_state(optax.adam(...))`` and the updates agree to float32 rounding.
  Complex leaves take Adam's complex step (``nu`` the EMA of ``|g|^2``, as in
  ``optax.adam``) in XLA in every storage, whatever ``implementation``.

  Args:
    learning_rate: a float or an ``optax`` schedule, as in ``optax.adam``.
    b1, b2, eps, eps_root: Adam's decay rates (in [0, 1)) and epsilons (>= 0):
      Python floats or scalar arrays, read at run time by every storage's step
      and kernel, so ``optax.inject_hyperparams(magma.sparse_adam)(...)``
      injects them like ``optax.adam``'s. The storage's numbers that shape
      compact storage must stay static: ``static_args=("density",
      "density_threshold")``, plus ``"axis"`` with ``structure`` (their errors
      say so); ``magma.sparse_adam.static_args`` lists every argument that may
      stay static.
    mode: ``"skip"``, ``"compact"`` or ``"offload"``, as in :func:`sparse_state`.
    density, structure, axis, block, shards: the storage, as in
      :func:`sparse_state`.
    density_threshold, offload_after, where, cache_index, on_error: as in
      :func:`sparse_state`.
    implementation: for tile storage, ``"xla"`` (the default), ``"pallas"``, or a
      sequence to try in order (see :func:`magma_optax.kernels.masked_adam`). An
      explicit request that cannot run here raises ``ValueError`` saying why
      (here, or at the first step for a dtype the kernel cannot tile).
    interpret: ``False``, or a Pallas interpreter (``True``, ``"tpu"``,
      ``"gpu"``) for tests on CPU.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a :class:`SparseState`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = magma.periodic_mask(
    ...     magma.sparse_adam(1e-3, mode="compact", density=0.5, block=(2, 2)),
    ...     sparsity=0.5, block=(2, 2), every=100)
    >>> params = {"w": jnp.arange(16.0).reshape(4, 4)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((4, 4))}, state, params)
    >>> state.inner_state.base_state[0].mu["w"].shape
    (2, 2, 2)
  """
  _schedules.check_adam(b1, b2, eps, eps_root)
  constants = reference.AdamConstants(b1, b2, eps, eps_root)
  _check_learning_rate(learning_rate)
  interpret = dispatch.check_interpret(interpret)
  if block is None and implementation not in (None, "xla"):
    raise ValueError(
      f"implementation={implementation!r} chooses the kernel of tile storage"
      " (block=(r, c)); the other storages run in XLA."
    )
  planner = _arguments.from_arguments(Planner.create, locals())
  # Fails fast (here, for float32 tiles) where the request cannot run at all; the
  # step checks again with the leaves' dtypes.
  tiles.resolve_implementation(
    implementation,
    block=block or (8, 128),
    dtypes=(jnp.float32,),
    interpret=interpret,
  )
  base = optax.adam(learning_rate, b1, b2, eps, eps_root=eps_root)
  step = _adam_step(learning_rate, constants, implementation, interpret)
  # The step returns frozen moments already (merged, or compact).
  return _step.transformation(
    base, planner, offload_after, step, state_type=SparseState, frozen=True,
    on_error=on_error, name="sparse_adam",
  )  # fmt: skip


# What optax.inject_hyperparams may leave static: the numbers that shape compact
# storage (they must be static where they do), and the arguments it would take for
# schedules (callables) or inject (numbers) although they are neither.
sparse_adam.static_args = (
  "density", "density_threshold", "offload_after", "axis", "cache_index", "shards",
  "where", "interpret",
)  # fmt: skip


def _check_learning_rate(learning_rate: Any) -> None:
  if not callable(learning_rate) and (
    isinstance(learning_rate, bool | str | list | tuple | dict)
    or learning_rate is None
    or jnp.ndim(learning_rate) != 0
    or not jnp.issubdtype(jnp.result_type(learning_rate), jnp.number)
  ):
    raise ValueError(
      "sparse_adam: learning_rate must be a real scalar or an optax schedule;"
      f" got {learning_rate!r}."
    )


def _adam_step(learning_rate, constants, implementation, interpret):
  """The step of :func:`sparse_adam` (as :func:`magma_optax.sparse.step.base_step`
  is :func:`sparse_state`'s): each storage's Adam step on its leaf."""

  def step(storages, ctx, treedef, flat_g, flat_p, state, stored_masks, extra_args):
    del flat_p, extra_args
    adam, lr_state = state
    count = optax.safe_increment(adam.count)
    if callable(learning_rate):
      lr = learning_rate(lr_state.count)
      lr_state = lr_state._replace(count=optax.safe_increment(lr_state.count))
    else:
      lr = learning_rate
    args = _storage.AdamArgs(
      count=count,
      learning_rate=lr,
      hyper=reference.hyperparams(count, lr, 0.0, constants),
      constants=constants,
      implementation=implementation,
      interpret=interpret,
    )
    outs = [
      _leaf_adam(s, c, mask, g, m, v, args)
      for s, c, mask, g, m, v in zip(
        storages, ctx, stored_masks, flat_g, treedef.flatten_up_to(adam.mu),
        treedef.flatten_up_to(adam.nu), strict=True,
      )
    ]  # fmt: skip
    adam = adam._replace(
      count=count,
      mu=treedef.unflatten([o.mu for o in outs]),
      nu=treedef.unflatten([o.nu for o in outs]),
    )
    return [o.update for o in outs], (adam, lr_state)

  return step


def _leaf_adam(s, ctx, mask, g, m, v, args) -> tiles.TileAdamOutput:
  """A leaf's Adam step: its storage's, or for a complex leaf Adam's complex step
  on its stored entries (the fused real steps would drop ``Im g``)."""
  if not jnp.iscomplexobj(g):
    return s.fused_adam(ctx, mask, g, m, v, args)
  frozen = s.freezable and not _trees.is_masked(mask)
  return _complex_adam(s.gather(ctx, g), m, v, mask if frozen else None, args)


def _complex_adam(g, mu, nu, mask, args) -> tiles.TileAdamOutput:
  """Adam's step on complex stored entries, as ``optax.adam`` computes it:
  ``nu`` is the EMA of ``|g|^2`` (real values in the parameter's complex dtype),
  the update ``m_hat / (sqrt(v_hat + eps_root) + eps)`` complex; frozen where
  ``mask`` (skip storage) is False."""
  hyper, constants = args.hyper, args.constants
  dtype = jnp.promote_types(g.dtype, jnp.complex64)
  g, m = g.astype(dtype), mu.astype(dtype)
  v = jnp.real(nu.astype(dtype))
  new_m = (1 - constants.b1) * g + constants.b1 * m
  new_v = (1 - constants.b2) * jnp.real(jnp.conj(g) * g) + constants.b2 * v
  if mask is not None:
    new_m = _xla_cpu.kept(mask, new_m, m)
    new_v = _xla_cpu.kept(mask, new_v, v)
  bc1 = hyper[reference.BIAS_CORRECTION1].astype(new_v.dtype)
  bc2 = hyper[reference.BIAS_CORRECTION2].astype(new_v.dtype)
  u = (new_m / bc1) / (jnp.sqrt(new_v / bc2 + constants.eps_root) + constants.eps)
  u = u * -hyper[reference.LEARNING_RATE].astype(new_v.dtype)
  return tiles.TileAdamOutput(
    new_m.astype(mu.dtype), new_v.astype(nu.dtype), u.astype(g.dtype)
  )
