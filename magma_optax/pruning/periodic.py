"""Periodic parameter masks (CAST-style pruning), kept pure: no post-step hook.

:func:`periodic_mask` wraps an inner optimizer and, every ``every`` steps between
``start`` and ``end``, recomputes a boolean mask per leaf from importance scores by
an exact top-k (per leaf, over all leaves, per shard part, or N:M groups; whole
tiles with ``block=``), resets the inner moments of regrown entries, and hands the
mask to the inner transform as ``param_mask=``. Its update emits ``where(mask, u,
-p)`` so that pruned weights are exactly zero after every step. What it promises the
inner storage: :mod:`magma_optax._core.mask_bounds`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from magma_optax._core import arguments as _arguments
from magma_optax._core import compat as _compat
from magma_optax._core import geometry as _geometry
from magma_optax._core import mask_bounds as _mask_bounds
from magma_optax._core import schedules as _schedules
from magma_optax._core import scoping as _scoping
from magma_optax._core import shard_map as _shard_map
from magma_optax._core import sharded as _sharded
from magma_optax._core import trees as _trees
from magma_optax._core import xla_cpu as _xla_cpu
from magma_optax.pruning import importance as _importance
from magma_optax.pruning import radix_select as _radix_select
from magma_optax.pruning import schedules as _sparsity
from magma_optax.pruning import topk as _topk

# The search's entry points also under the names tests and benchmarks import here.
from magma_optax.pruning.topk import count_true as _count
from magma_optax.pruning.topk import top_k_mask as _top_k_mask
from magma_optax.pruning.topk import top_k_masks as _top_k_masks

RANKINGS = ("per_leaf", "global")
DEFAULT_MOMENT_NAMES = ("mu", "nu", "trace")


class PeriodicMaskState(NamedTuple):
  """State of :func:`periodic_mask`.

  Attributes:
    count: int32 scalar, number of updates so far.
    mask: pytree like the params; per scoped leaf a bool array of the leaf's shape
      (True = the weight exists), ``optax.MaskedNode`` where unscoped. The mask the
      last update used; the model's forward pass multiplies by it.
    target_sparsity: f32 scalar, the target sparsity at the last refresh.
    sparsity: f32 scalar, fraction of scoped entries pruned by ``mask``.
    num_regrown: int32 scalar, entries that became active at the last refresh.
    inner_state: the inner optimizer's state.
  """

  count: jax.Array
  mask: Any
  target_sparsity: jax.Array
  sparsity: jax.Array
  num_regrown: jax.Array
  inner_state: Any


# At most this many parameters are ranked in one stack: their stacked scores and
# old and new masks are the refresh's only extra memory, and a leaf this large
# costs far more than its share of a step's launch.
_STACKED = 2**20
# The device form stacks every leaf of a shape: its search then counts all of them
# in one reduction per pass (their keys exist at once either way).
_UNCAPPED = 2**62


def _per_backend(refresh: Any, *operands: Any) -> Any:
  """``refresh(*operands, device=...)``, chosen when the step is lowered: XLA:CPU
  gets its form (``device=False``), every other platform the device form."""
  return jax.lax.platform_dependent(
    *operands,
    cpu=functools.partial(refresh, device=False),
    default=functools.partial(refresh, device=True),
  )


def reset_moments(
  inner_state: Any,
  reset: list[Any],
  treedef: Any,
  names: tuple[str, ...],
  initial: Any = None,
) -> Any:
  """Restarts the entries ``reset[i]`` (bool, leaf-shaped, or None) of named moments.

  Fields called one of ``names`` are found with ``optax.tree_utils``; a field is
  changed only where its tree is like ``treedef`` (:func:`magma_optax._core.trees.
  split_like`: ``MaskedNode`` leaves and subtrees allowed), and there only in the
  entries that have the shape of ``reset[i]``. They take the value of the same field
  in ``initial`` (the inner transform's initial state: zero for Adam's moments,
  ``initial_scale`` for RMSProp's ``nu``), or zero where ``initial`` is ``None``.
  """
  starts = {}
  if initial is not None:
    for name in names:
      starts.update(optax.tree_utils.tree_get_all_with_path(initial, name))

  def restart(i, m, start=None):
    r = reset[i]
    if r is None or not hasattr(m, "shape") or m.shape != r.shape:
      return m
    if start is None or jnp.shape(start) != m.shape:
      start = jnp.zeros([], m.dtype)
    return jnp.where(r, jnp.asarray(start, m.dtype), m)

  for name in names:
    for path, value in optax.tree_utils.tree_get_all_with_path(inner_state, name):
      if _trees.split_like(value, treedef) is None:
        continue
      more = () if path not in starts else (starts[path],)
      inner_state = optax.tree_utils.tree_set(
        inner_state,
        lambda p, v, target=path: p == target,
        **{name: _trees.map_like(restart, value, treedef, *more)},
      )
  return inner_state


def periodic_mask(
  inner: optax.GradientTransformation,
  *,
  sparsity: _schedules.ScalarOrSchedule | None = None,
  every: int,
  importance: _importance.Importance = "magnitude_grad",
  structure: tuple[int, int] | None = None,
  block: tuple[int, int] | None = None,
  shards: Any = None,
  schedule: str | None = None,
  start: int = 0,
  end: int | None = None,
  where: _scoping.Where = None,
  ranking: str = "per_leaf",
  axis: int = -1,
  moment_names: tuple[str, ...] = DEFAULT_MOMENT_NAMES,
) -> optax.GradientTransformationExtraArgs:
  r"""Prunes parameters to a target sparsity with a mask recomputed every few steps.

  At steps ``t = start, start + every, ...`` (up to ``end``, inclusive)::

      S     = importance(W_t, g_t)                 (default |W| * |g|, per entry)
      M_t   = top-k(S) per leaf                    (k = n - round(s_t n); or N:M)
              (block=(r, c): top-k of the tile sums of S, n the number of tiles)
      reset inner moments where M_t & ~M_{t-1}     (regrown weights start fresh)

  and at every step, with ``M`` the current mask::

      u_inner, inner_state = inner.update(g, inner_state, W, param_mask=M)
      u = where(M, u_inner, -W)        so that   W + u == M * (W + u)   exactly.

  Args:
    inner: the optimizer to wrap, e.g. ``optax.adam(1e-3)`` or
      ``magma.sparse_state(optax.adam(1e-3), mode="compact", density=0.2)``. It
      receives ``param_mask=`` as an extra argument.
    sparsity: target fraction of pruned entries in [0, 1): a float, or an
      ``optax.Schedule`` of the step count (see
      :func:`~magma_optax.polynomial_sparsity_schedule` and
      :func:`~magma_optax.linear_sparsity_schedule`), checked at step 0 and
      clipped to [0, 1] where evaluated. With ``structure=(n, m)`` leave it
      ``None`` (it is ``1 - n / m``).
    every: refresh period T >= 1 in steps.
    importance: ``"magnitude_grad"`` (``|W| |g|``), ``"magnitude"`` (``|W|``) or a
      callable ``(param, grad) -> scores`` of the parameter's shape (higher = keep;
      under ``optax.inject_hyperparams`` list a callable in ``static_args``, as
      ``where``: it calls every callable argument as a schedule of the count).
    structure: ``(n, m)`` with 1 <= n <= m for N:M sparsity along ``axis``;
      ``None`` for unstructured top-k.
    block: ``(r, c)`` to prune whole ``r x c`` tiles over the last two axes: a
      tile's importance is the sum of its entries' scores, and the exact top-k
      (per leaf or ``"global"``) keeps ``T - round(s T)`` of a leaf's ``T`` tiles
      (ties as for entries: active tiles first, then the lower tile index in
      row-major order of the tile grid). Every pruned leaf needs >= 2 axes with
      the last two multiples of ``(r, c)`` (a ``ValueError`` at ``init`` names the
      leaf otherwise; scope such leaves out with ``where``). ``None``: entries.
    shards: with ``block``, ``(sr, sc)`` (or a callable ``(path, leaf) -> counts
      | None``, e.g. :func:`magma_optax.sharding.tile_shards`) to balance the mask
      over the shards of a parameter split ``sr`` ways along axis -2 and ``sc``
      ways along axis -1: the top-k runs in each of the ``sr x sc`` parts of the
      tile grid, which keeps ``T_p - round(s T_p)`` of its ``T_p`` tiles (the same
      number in every part, what :func:`sparse_state`'s per-shard tile storage with
      the same ``shards`` needs). Counts for the last ``k > 2`` axes (``(se, sr,
      sc)``: a stack sharded ``se`` ways along axis -3) split those axes too.
      The target is rounded per part, so the kept fraction moves in steps of ``1
      / T_p``; a float ``sparsity`` that keeps no tile of a part where the leaf's
      one top-k would keep some is a
      ``ValueError`` at ``init`` (a whole layer pruned). Needs
      ``ranking="per_leaf"``; each part must hold whole tiles (a ``ValueError`` at
      ``init`` names the leaf otherwise). ``None``: one top-k per leaf.
    schedule: ``None``/``"constant"`` (the target is ``sparsity`` from ``start``),
      ``"linear"`` or ``"cubic"``: ramp from 0 at ``start`` to ``sparsity`` at
      ``end`` (needs a float ``sparsity`` and ``end``).
    start: first refresh step (>= 0); the mask is all-active before it.
    end: last step at which the mask may change (inclusive), or ``None``.
    where: which leaves are pruned (``None``: all floating leaves, real or
      complex: a complex weight counts by its magnitude; a callable
      ``(path, leaf) -> bool`` such as :func:`attention_mlp_weights`; or a pytree of
      bools). Other leaves are never masked.
    ranking: ``"per_leaf"`` (every leaf reaches the target) or ``"global"`` (one
      top-k over all scoped entries; leaves end up with different sparsities).
    axis: the axis along which N:M groups are formed (default: the last).
    moment_names: names of the inner state's per-entry moments to reset on
      regrowth, to the inner's initial state (``inner.init(params)``: zero for
      Adam's ``mu`` and ``nu``). Fields not named keep their stale values for
      regrown entries; name every per-entry field of your optimizer, e.g. ``("mu",
      "nu", "nu_max")`` for AMSGrad, ``("sum_of_squares",)`` for Adagrad.
      (Compact storage of :func:`sparse_state` restarts all of its stored
      entries' state on its own.)

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a :class:`PeriodicMaskState`;
    ``params`` must be passed to ``update``. Its ``init`` tells ``inner`` the
    densest mask each leaf will get (all-active before ``start`` and where a ramp
    starts; else the first refresh's count, per leaf or shard part, or with
    ``ranking="global"`` the least share the leaf must take; its tiles and N:M
    groups): compact storage of :func:`sparse_state` inside raises a
    ``ValueError`` there, before any step, where that mask certainly cannot fit
    (the mask is assumed to reach it unchanged, as through optax's wrappers).
    Ranking per leaf with a constant Python number for ``sparsity`` (or with
    ``structure``), no later mask is denser, and its ``update`` promises that of
    the mask arrays it passes: compact storage that holds the densest one then
    compiles no host callback for its mask checks (see :func:`sparse_state`).

    ``update`` takes the static extra argument ``refresh``: ``None`` (default)
    refreshes where the count says so, in one data-dependent branch for the
    whole step (on a GPU the host waits for its predicate once per step);
    ``False`` keeps the masks of the previous update with no branch at all
    (promised to the inner transform, whose storages then move nothing);
    ``True`` runs the step as the default does. A training loop that knows the
    step number passes ``True`` on the first step and where the schedule
    refreshes, ``False`` elsewhere (``docs/sparse.md``); ``False`` where the
    schedule refreshes skips that refresh.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = magma.periodic_mask(optax.adam(1e-2), sparsity=0.5, every=10)
    >>> params = {"w": jnp.arange(1.0, 9.0).reshape(2, 4)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((2, 4))}, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> int((params["w"] == 0).sum())
    4

  References:
    Zhu & Gupta, To prune, or not to prune, arXiv 1710.01878 (2017);
    Lee et al., jaxpruner, arXiv 2304.14082 (2023);
    Mishra et al., Accelerating Sparse Deep Neural Networks (2:4), arXiv 2104.08378.
  """
  pruning = _arguments.from_arguments(_Pruning.create, locals())
  return optax.GradientTransformationExtraArgs(
    *_shard_map.typed(pruning.init, pruning.update)
  )


@dataclasses.dataclass(frozen=True, eq=False)
class _Pruning:
  """:func:`periodic_mask`'s validated arguments, and its phases: the plan, the
  bounds it tells its inner transform, the refreshed masks, init and update."""

  inner: Any
  sparsity: Any  # a schedule of the count (the ramp, if any, folded in)
  every: int
  importance: Any
  structure: tuple[int, int] | None
  block: tuple[int, int] | None
  shards: Any
  schedule: str
  start: int
  end: int | None
  where: Any
  ranking: str
  axis: int
  moment_names: tuple[str, ...]
  final: float | None  # the target the per-part rounding check needs at init

  @classmethod
  def create(
    cls,
    *,
    inner,
    sparsity,
    every,
    importance,
    structure,
    block,
    shards,
    schedule,
    start,
    end,
    where,
    ranking,
    axis,
    moment_names,
  ) -> _Pruning:
    """Checks every argument (``ValueError`` naming it)."""
    # Python ints: they shape the traced step. optax.inject_hyperparams turns numeric
    # arguments, defaults included, into arrays, hence the hint.
    hint = (
      " (With optax.inject_hyperparams, pass static_args=('every', 'start', 'end',"
      " 'axis'), plus 'importance' and 'where' where those are callables: it takes"
      " any callable argument for a schedule.)"
    )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
      raise ValueError(f"every must be an int >= 1; got {every!r}.{hint}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
      raise ValueError(f"start must be an int >= 0; got {start!r}.{hint}")
    if end is not None and (
      isinstance(end, bool) or not isinstance(end, int) or end < start
    ):
      raise ValueError(
        f"end must be None or an int >= start={start}; got {end!r}.{hint}"
      )
    importance = _importance.validate(importance)
    if ranking not in RANKINGS:
      raise ValueError(f"ranking must be one of {RANKINGS}; got {ranking!r}.")
    schedule = _sparsity.validate_ramp(schedule)
    if isinstance(axis, bool) or not isinstance(axis, int):
      raise ValueError(f"axis must be an int; got {axis!r}.{hint}")
    if block is not None:
      block = _geometry.validate_block(block)
      if structure is not None:
        raise ValueError(
          f"give structure (N:M groups) or block (tiles), not both; got"
          f" structure={structure!r}, block={block!r}."
        )
    shards = _geometry.validate_shards(shards, block, "periodic_mask")
    if shards is not None and ranking != "per_leaf":
      raise ValueError(
        f"shards= balances each leaf's tiles over its shards, which needs"
        f" ranking='per_leaf'; got ranking={ranking!r}."
      )
    if structure is not None:
      structure = _geometry.validate_nm_structure(structure)
      if sparsity is not None and not _schedules.is_schedule(sparsity):
        implied = 1.0 - structure[0] / structure[1]
        if abs(float(sparsity) - implied) > 1e-6:
          raise ValueError(
            f"sparsity={sparsity} contradicts structure={structure} (which implies"
            f" sparsity {implied}); leave sparsity=None with structure."
          )
      elif sparsity is not None or schedule != "constant":
        raise ValueError(
          "structure=(n, m) fixes the sparsity at 1 - n/m; it takes no sparsity"
          " schedule."
        )
      sparsity = 1.0 - structure[0] / structure[1]
    if sparsity is None:
      raise ValueError("sparsity is required (a float in [0, 1) or a schedule).")
    sparsity = _sparsity.check_sparsity("sparsity", sparsity)
    # The target the per-part rounding check needs at init (a traced value, as
    # under optax.inject_hyperparams, is only known in the step).
    final = (
      None
      if _schedules.is_schedule(sparsity) or _compat.is_tracer(sparsity)
      else float(sparsity)
    )
    sparsity = _sparsity.ramp(schedule, sparsity, start=start, end=end)
    inner = optax.with_extra_args_support(inner)
    return cls(
      inner, sparsity, every, importance, structure, block, shards, schedule, start,
      end, where, ranking, axis, moment_names, final,
    )  # fmt: skip

  def plan(self, tree):
    plans, treedef = _scoping.plan_scope(tree, where=self.where, complex_ok=True)
    return plans, treedef

  def parts_of(self, plans, tree):
    """Per leaf, the parts its tiles are ranked in (counts for its last axes), or
    ``None`` (also for zero-size leaves, which have nothing to rank)."""
    paths_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [
      None
      if p.layout is None or self.block is None or math.prod(jnp.shape(x)) == 0
      else _geometry.leaf_shards(
        self.shards, path, x, self.block, jax.tree_util.keystr(path)
      )
      for p, (path, x) in zip(plans, paths_leaves, strict=True)
    ]

  def check_structure(self, plans, params):
    paths_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for p, (path, x) in zip(plans, paths_leaves, strict=True):
      if p.layout is not None and self.block is not None:
        _geometry.check_tiles(jnp.shape(x), self.block, jax.tree_util.keystr(path))
    for parts, (path, x) in zip(
      self.parts_of(plans, params), paths_leaves, strict=True
    ):
      if parts is None:
        continue
      name = jax.tree_util.keystr(path)
      _geometry.check_parts_on_devices(x, parts, "periodic_mask", name)
      if self.final is not None:
        self.check_parts_keep(parts, jnp.shape(x), name)
    if self.structure is None:
      return
    m = self.structure[1]
    for p, (_, x) in zip(plans, paths_leaves, strict=True):
      if p.layout is None:
        continue
      shape = jnp.shape(x)
      if not shape or not -len(shape) <= self.axis < len(shape) or shape[self.axis] % m:
        raise ValueError(
          f"structure={self.structure} needs axis {self.axis} of every pruned leaf"
          f" to be a multiple of {m}; leaf {p.index} has shape {shape}. Scope it"
          " out with"
          " `where` or choose another axis."
        )

  def check_parts_keep(self, parts, shape, name):
    # The top-k of a part rounds the target on its T_p tiles: where that keeps no
    # tile while the leaf's top-k would keep some, the layer would be pruned whole.
    tiles = _geometry.num_tiles(shape, self.block)
    per_part = tiles // math.prod(parts)
    keep = functools.partial(_topk.num_keep_host, self.final)
    if keep(per_part) == 0 < keep(tiles):
      raise ValueError(
        f"periodic_mask: shards={parts} splits the {tiles} tiles of leaf {name} into"
        f" parts of {per_part}, and sparsity={self.final} keeps none of a part's"
        f" (round(s * {per_part}) pruned in each), so the whole leaf would be"
        f" pruned where one top-k would keep {keep(tiles)} tiles. Use fewer shards,"
        " smaller tiles or a lower sparsity, or scope the leaf out with `where`."
      )

  def first_target(self):
    """The target sparsity of the first refresh (at ``start``), as a float, or
    ``None`` where it is not known at init (a traced hyperparameter)."""
    with jax.ensure_compile_time_eval():
      s0 = _schedules.evaluate_fraction(self.sparsity, jnp.int32(self.start))
    return None if _compat.is_tracer(s0) else float(s0)

  def bounds_of(self, plans, params):
    """Per leaf, the densest mask this wrapper will hand its inner transform, or
    that it hands none (:class:`magma_optax._core.mask_bounds.MaskBound`): the
    compact storage of :func:`sparse_state` inside is checked against it at init.
    Leaves whose counts are traced get none (``None``)."""
    paths_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    bounds = [None] * len(plans)
    leaves = []  # (leaf index, shape, units a top-k ranks, their parts)
    for j, (p, (_, x), parts) in enumerate(
      zip(plans, paths_leaves, self.parts_of(plans, params), strict=True)
    ):
      shape = tuple(jnp.shape(x))
      if p.layout is None and hasattr(x, "shape"):  # it gets no mask
        what = "periodic_mask passes it no mask (its `where` does not prune it)"
        bounds[j] = _mask_bounds.MaskBound(shape, what, None, masked=False)
      if p.layout is None or math.prod(shape) == 0:
        continue
      units = (
        math.prod(shape)
        if self.block is None
        else _geometry.num_tiles(shape, self.block)
      )
      leaves.append((j, shape, units, parts))
    total = sum(units for _, _, units, _ in leaves)
    s0 = 0.0 if self.start > 0 else self.first_target()
    if self.start > 0:
      why = (
        f"periodic_mask(start={self.start}) passes an all-active mask until its first"
        f" refresh at step {self.start}"
      )
    elif s0 is not None:
      ramp = (
        ""
        if self.schedule == "constant"
        else f" (its {self.schedule} ramp starts there)"
      )
      why = (
        f"periodic_mask's first refresh, at step {self.start}, targets sparsity"
        f" {s0:.4g}{ramp}"
      )
    unit = "entries" if self.block is None else f"{self.block[0]}x{self.block[1]} tiles"
    area = 1 if self.block is None else self.block[0] * self.block[1]
    # Every mask keeps at most the first refresh's count where the target is a
    # constant Python number ranked per leaf (all-active before `start`). A
    # schedule may lower it later (a ramp is one here: its first masks are
    # all-active, which compact storage does not hold); a global top-k shares out.
    always = (
      self.ranking == "per_leaf"
      and isinstance(self.sparsity, numbers.Real)
      and not isinstance(self.sparsity, bool)
    )
    for j, shape, units, parts in leaves:
      size = math.prod(shape)
      if self.structure is not None:
        n, m = self.structure
        nm = {
          "structure": self.structure,
          "axis": self.axis % len(shape),
          "always": True,
        }
        if self.start > 0:
          bounds[j] = _mask_bounds.MaskBound(shape, why, size, **nm)
        else:
          what = f"periodic_mask(structure={self.structure}) keeps {n} of every {m}"
          what += f" entries along axis {self.axis}"
          bounds[j] = _mask_bounds.MaskBound(shape, what, size * n // m, **nm)
        continue
      if s0 is None:  # traced: the counts are known in the step only
        continue
      n_parts = math.prod(parts or (1,))
      if self.ranking == "per_leaf":
        keep, exact = _topk.num_keep_host(s0, units // n_parts), True
        what = why
        if self.start == 0:
          what += f", which keeps {keep} of {units // n_parts} {unit}"
          what += "" if parts is None else " in each shard part"
      else:
        # One top-k over all leaves: this leaf keeps at least what the others
        # cannot hold (exactly everything where nothing is pruned).
        kept = _topk.num_keep_host(s0, total)
        keep, exact = max(0, kept - (total - units)), kept == total
        what = why
        if not exact:
          what += (
            f", which keeps {kept} of all {total} {unit} together: at least"
            f" {keep} of this leaf's {units}"
          )
      tiles = None if self.block is None else keep
      bounds[j] = _mask_bounds.MaskBound(
        shape, what, keep * area * n_parts, exact, self.block, tiles, parts,
        always=always and exact,
      )  # fmt: skip
    return bounds

  def init(self, params):
    plans, treedef = self.plan(params)
    leaves = treedef.flatten_up_to(params)
    self.check_structure(plans, params)
    # Sharded like the parameters on Explicit axes (the step gives them that type).
    masks = [
      optax.MaskedNode()
      if p.layout is None
      else _sharded.put_like(jnp.ones(jnp.shape(x), jnp.bool_), x)
      for p, x in zip(plans, leaves, strict=True)
    ]
    return PeriodicMaskState(
      count=jnp.zeros([], jnp.int32),
      mask=treedef.unflatten(masks),
      target_sparsity=jnp.zeros([], jnp.float32),
      sparsity=jnp.zeros([], jnp.float32),
      num_regrown=jnp.zeros([], jnp.int32),
      inner_state=self.init_inner(plans, treedef, params),
    )

  def init_inner(self, plans, treedef, params):
    """The inner state, its compact storage checked against the masks this
    wrapper will pass (a mask that certainly cannot be stored fails here)."""
    inner_state = self.inner.init(params)
    _mask_bounds.check_init(inner_state, treedef, self.bounds_of(plans, params))
    return inner_state

  def ranked_units(self, plans, params, grads, old):
    """The leaves a refresh ranks (scoped, not zero-size), and per leaf the scores
    and activity of its units (entries, or tiles with ``block=``)."""
    # Zero-size leaves have nothing to rank: their (empty) masks stay as they are.
    idx = [
      i
      for i, p in enumerate(plans)
      if p.layout is not None and math.prod(p.layout.shape) > 0
    ]
    # Tiles: NaN is handled in the tile sums (a NaN entry makes its tile's sum NaN,
    # ranked -inf, as a -inf entry would), so the built-in scores fuse into them. A
    # callable's scores are written out first: fused, XLA:CPU would add its last
    # product into the sum unrounded (an FMA) or skip a bfloat16 rounding, and
    # tiles of equal entry scores would not tie.
    entry_scores = self.block is None or callable(self.importance)
    scores = {
      i: _importance.scores(self.importance, params[i], grads[i], entry_scores)
      for i in idx
    }
    active = {i: old[i] for i in idx}
    if (
      self.block is not None
    ):  # rank tiles: their summed scores, active if any entry is
      scores = {i: _topk.tile_sum(scores[i], self.block) for i in idx}
      active = {i: _topk.tile_any(old[i], self.block) for i in idx}
    return idx, scores, active

  def new_masks(self, plans, params, grads, old, target, parts):
    """The refreshed masks, and the numbers of regrown and of kept scoped entries
    (XLA:CPU's form: :meth:`device_masks` finds the same masks).

    Whole leaves of one shape are ranked by one computation over their stack
    (:func:`_trees.map_stacked`), not one per leaf: on XLA:CPU every step's launch
    grows with the program's buffers, those of a refresh that does not run included.
    """
    idx, scores, active = self.ranked_units(plans, params, grads, old)

    def ranked(s, a, k):
      if self.structure is not None:
        return _topk.n_m_mask(s, a, *self.structure, self.axis)
      return _top_k_mask(s, a, k)

    def stacked_row(s, o, k):  # one stacked leaf: its mask and counts
      m = ranked(s, o if self.block is None else _topk.tile_any(o, self.block), k)
      m = m if self.block is None else _topk.untile(m, self.block)
      return m, _count([m & ~o]), _count([m])

    out = list(old)
    alone = []  # ranked alone (as tiles if block=): untiled and counted below
    regrown = kept = jnp.zeros([], jnp.int32)
    if self.structure is not None or self.ranking == "per_leaf":
      # N:M groups never cross a leaf, so N:M leaves need no parts.
      whole = [i for i in idx if self.structure is not None or parts[i] is None]
      for group in _trees.same_shape_groups(
        [old[i] for i in whole], _STACKED, also=[scores[i] for i in whole]
      ):
        leaves = [whole[j] for j in group]
        k = _topk.num_keep(target, scores[leaves[0]].size)
        if len(leaves) == 1:
          out[leaves[0]] = ranked(scores[leaves[0]], active[leaves[0]], k)
          alone.append(leaves[0])
          continue
        rows = _trees.map_stacked(
          functools.partial(stacked_row, k=k),
          [scores[i] for i in leaves],
          [old[i] for i in leaves],
        )
        for i, (m, r, n) in zip(leaves, rows, strict=True):
          out[i] = m
          regrown, kept = regrown + r, kept + n
    if self.structure is None and self.ranking == "per_leaf":
      for i in idx:
        if parts[i] is None:
          continue
        # Balanced over the shards: one top-k per part of the tile grid.
        n = len(parts[i])
        s, a = (_geometry.split_parts(x, parts[i]) for x in (scores[i], active[i]))
        k = _topk.num_keep(target, math.prod(s.shape[n:]))
        # k is an argument, not a constant: under Explicit mesh axes like_auto
        # runs the top-k with them as Auto, and k must come in through it.
        per_part = _top_k_mask
        for _ in range(n):
          per_part = jax.vmap(per_part, (0, 0, None))
        out[i] = _geometry.join_parts(_sharded.like_auto(per_part, s, s, a, k), n)
        alone.append(i)
    elif self.structure is None and idx:
      n = sum(scores[i].size for i in idx)
      keep = _top_k_masks(
        [scores[i] for i in idx], [active[i] for i in idx], _topk.num_keep(target, n)
      )
      for i, m in zip(idx, keep, strict=True):
        out[i] = m
      alone.extend(idx)
    if self.block is not None:
      for i in alone:
        out[i] = _topk.untile(out[i], self.block)
    regrown = regrown + _count([out[i] & ~old[i] for i in alone])
    kept = kept + _count([out[i] for i in alone])
    return out, regrown, kept

  def device_masks(self, plans, params, grads, old, target, parts):
    """:meth:`new_masks` for GPUs and TPUs: the same masks and counts, without a
    data-dependent loop or branch (each would wait for the host to read its
    predicate back) and with one search for all leaves.

    Leaves of one shape are stacked, and the rows of every stack (and the shard
    parts of a ``shards=`` leaf) are ranked by one :func:`radix_select.top_k`,
    whose loops have constant trip counts; N:M groups need no loop.
    """
    idx, scores, active = self.ranked_units(plans, params, grads, old)
    sizes = [scores[i].size for i in idx]
    together = sum(sizes) if self.ranking == "global" else max(sizes, default=0)
    if self.structure is None and together > _radix_select.MAX_ENTRIES:
      # Beyond what one search ranks: XLA:CPU's form (exact, with its loops).
      return self.new_masks(plans, params, grads, old, target, parts)
    whole = [i for i in idx if self.structure is not None or parts[i] is None]
    # Rankings: (leaves, stacked scores, stacked activity, leading axes of rows).
    rankings = []
    for group in _trees.same_shape_groups(
      [old[i] for i in whole], _UNCAPPED, also=[scores[i] for i in whole]
    ):
      leaves = [whole[j] for j in group]
      s, a = (jnp.stack([x[i] for i in leaves]) for x in (scores, active))
      rankings.append((leaves, s, a, 1))
    for i in idx:
      if i not in whole:  # balanced over the shards: each part of the tile grid
        s, a = (_geometry.split_parts(x[i], parts[i]) for x in (scores, active))
        rankings.append(([i], s, a, len(parts[i])))
    out = list(old)
    regrown = kept = jnp.zeros([], jnp.int32)
    if not rankings:
      return out, regrown, kept
    units = [r[1] for r in rankings]
    if self.structure is not None:
      axis = self.axis if self.axis < 0 else self.axis + 1  # after the stack's
      ranked = [_topk.n_m_mask(s, a, *self.structure, axis) for _, s, a, _ in rankings]
    elif self.ranking == "per_leaf":
      ranked = _radix_select.top_k(
        units,
        [r[2] for r in rankings],
        [_topk.num_keep(target, math.prod(s.shape[j:])) for _, s, _, j in rankings],
        [r[3] for r in rankings],
      )
    else:  # one top-k over the leaves in order: a stack's rows are apart
      start = {i: sum(sizes[:n]) for n, i in enumerate(idx)}
      ranked = _radix_select.top_k(
        units,
        [r[2] for r in rankings],
        [_topk.num_keep(target, sum(sizes))],
        [1] * len(rankings),
        joint=True,
        row_offsets=[[start[i] for i in r[0]] for r in rankings],
      )
    for (leaves, _, _, lead), m in zip(rankings, ranked, strict=True):
      if leaves[0] not in whole:
        m = _geometry.join_parts(m, lead)[None]
      if self.block is not None:
        m = _topk.untile(m, self.block)
      o = jnp.stack([old[i] for i in leaves])
      regrown, kept = regrown + _count([m & ~o]), kept + _count([m])
      for r, i in enumerate(leaves):
        out[i] = m[r]
    return out, regrown, kept

  def refreshed(
    self, plans, treedef, params, grads, target, parts, old, inner_state, device
  ):
    """The refresh: new masks, the moments of regrown entries reset, and the
    numbers of regrown and kept entries; by :meth:`device_masks` if ``device``,
    else by :meth:`new_masks` (XLA:CPU)."""
    param_leaves = treedef.flatten_up_to(params)
    find = self.device_masks if device else self.new_masks
    masks, num, kept = find(plans, param_leaves, grads, old, target, parts)
    regrown = [
      None if p.layout is None else masks[i] & ~old[i] for i, p in enumerate(plans)
    ]

    def reset(s):
      return reset_moments(
        s, regrown, treedef, self.moment_names, self.inner.init(params)
      )

    # The reset reads and writes every moment. On XLA:CPU it runs only when an
    # entry regrew (rare with the default |W|*|g|: pruned weights score 0); a
    # device would wait on the host for that predicate, and resets regardless.
    if device:
      return masks, reset(inner_state), num, kept
    return masks, _xla_cpu.run_if(num > 0, reset, inner_state), num, kept

  def update(self, updates, state, params=None, **extra_args):
    refreshes = extra_args.pop("refresh", None)
    if refreshes is not None and not isinstance(refreshes, bool):
      raise ValueError(
        "periodic_mask's extra argument refresh must be None (the step refreshes"
        " when its count says so) or a Python bool (True: this step may refresh;"
        f" False: it does not, with no branch at all); got {refreshes!r}. A traced"
        " value cannot choose the step's program: compute it in Python from the"
        " loop's step number."
      )
    if params is None:
      raise ValueError(
        "periodic_mask needs the parameters: call update(updates, state, params)."
      )
    if "param_mask" in extra_args:
      raise ValueError(
        "periodic_mask got a param_mask extra arg (from an enclosing periodic_mask,"
        " or passed to update): it makes the parameter mask itself and hands it to"
        " its inner optimizer, so it takes none. Use one periodic_mask per"
        " parameter (group them with optax.multi_transform or where=)."
      )
    _trees.check_shapes("periodic_mask", updates, params)
    plans, treedef = self.plan(updates)
    plans = _scoping.match_state(plans, state.mask, treedef)
    _trees.check_shapes(
      "periodic_mask", updates, state.mask, "the mask its state holds there"
    )
    grads = treedef.flatten_up_to(updates)
    parts = self.parts_of(plans, updates)
    param_leaves = treedef.flatten_up_to(params)
    paths = jax.tree_util.tree_flatten_with_path(updates)[0]
    for i, p in enumerate(parts):
      if p is not None:
        name = jax.tree_util.keystr(paths[i][0])
        for x in (grads[i], param_leaves[i]):
          _geometry.check_parts_on_devices(x, p, "periodic_mask", name)
    old = treedef.flatten_up_to(state.mask)
    count = state.count
    is_refresh = (count >= self.start) & ((count - self.start) % self.every == 0)
    if self.end is not None:
      is_refresh = is_refresh & (count <= self.end)
    target = _schedules.evaluate_fraction(self.sparsity, count)

    scoped = [i for i, p in enumerate(plans) if p.layout is not None]
    total = sum(old[i].size for i in scoped)

    # The refresh runs through _xla_cpu.run_if, not a cond: on other steps the masks and
    # the inner state pass through untouched, where a cond would copy every mask
    # on every step. The refresh also resets the moments of regrown entries, so
    # nothing after it reads the old masks.
    def refresh(carry):
      old_masks, inner_state, _, _, _ = carry
      masks, inner_state, num, kept = _per_backend(
        functools.partial(self.refreshed, plans, treedef, params, grads, target, parts),
        old_masks,
        inner_state,
      )
      # No scoped entry (only zero-size leaves): nothing is pruned.
      pruned = (total - kept.astype(jnp.float32)) / max(total, 1)
      return masks, inner_state, target, num, pruned

    kept_as_is = (
      old,
      state.target_sparsity,
      jnp.zeros([], jnp.int32),
      state.sparsity,
    )
    bounds = self.bounds_of(plans, params)
    extra_args.pop("mask_promises", None)  # an outer wrapper's: not of these masks

    def inner_update(masks, inner_state, unchanged):
      # What every mask of the run is (counts, tiles, groups), promised to the inner
      # update for these very mask arrays: sparse_state's compact storage then
      # needs no host callback for a check they cannot fail. `unchanged`: they are
      # the previous update's masks, so its storage moves nothing.
      promises = _mask_bounds.MaskPromises(
        tuple(
          (m, bound)
          for m, bound in zip(masks, bounds, strict=True)
          if bound is not None and bound.always
        ),
        tuple(masks[i] for i in scoped) if unchanged else (),
      )
      args = dict(extra_args)
      if promises.pairs or promises.unchanged:
        args["mask_promises"] = promises
      return self.inner.update(
        updates, inner_state, params, param_mask=treedef.unflatten(masks), **args
      )

    def gated(inner_state):  # the refresh when the count says so
      masks, inner_state, *rest = _xla_cpu.run_if(
        is_refresh, refresh, (old, inner_state, *kept_as_is[1:])
      )
      return masks, *rest, *inner_update(masks, inner_state, unchanged=False)

    def ordinary(inner_state):  # the masks of the previous update
      return *kept_as_is, *inner_update(old, inner_state, unchanged=True)

    def first_step(inner_state):  # the initial masks, new to the inner transform
      return *kept_as_is, *inner_update(old, inner_state, unchanged=False)

    def refreshed(inner_state):  # a step the count makes a refresh
      masks, inner_state, *rest = refresh((old, inner_state, *kept_as_is[1:]))
      return masks, *rest, *inner_update(masks, inner_state, unchanged=False)

    if refreshes is True:
      outs = gated(state.inner_state)
    elif refreshes is False:
      outs = ordinary(state.inner_state)
    elif not _compat.is_tracer(count):
      outs = gated(state.inner_state)
    else:
      # On a GPU or a TPU a loop's predicate is read back by the host: one branch
      # for the whole step, whose ordinary side holds no loop at all. XLA:CPU
      # keeps the loop of zero or one step, which updates the state in place (a
      # cond would copy it).
      index = jnp.where(is_refresh, 2, jnp.where(count == 0, 1, 0))
      branches = [ordinary, first_step, refreshed]
      outs = _shard_map.platform_dependent(
        state.inner_state,
        cpu=gated,
        default=lambda s: _shard_map.switch(index, branches, s),
      )
    masks, target_now, num_regrown, sparsity_now, inner_updates, inner_state = outs
    mask_tree = treedef.unflatten(masks)
    out = []
    for p, u, w, m in zip(
      plans, treedef.flatten_up_to(inner_updates), param_leaves, masks, strict=True
    ):
      if p.layout is None:
        out.append(u)
        continue
      out.append(jnp.where(m, u, -jnp.asarray(w).astype(u.dtype)))
    new_state = PeriodicMaskState(
      count=optax.safe_increment(count),
      mask=mask_tree,
      target_sparsity=jnp.asarray(target_now, jnp.float32),
      sparsity=jnp.asarray(sparsity_now, jnp.float32),
      num_regrown=num_regrown,
      inner_state=inner_state,
    )
    return treedef.unflatten(out), new_state
