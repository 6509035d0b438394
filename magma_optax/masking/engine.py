"""The block-mask engine: the per-leaf plumbing every block-mask transform shares.

A :class:`BlockMask` pairs a validated :class:`MaskConfig` (scope, labels, keep
probabilities, granularity) with a :class:`Rule` (what happens to one leaf's
blocks): it plans the leaves, draws ``z ~ Bernoulli(p)`` per block from (key, step,
leaf path, block index), scales the update, and keeps one state layout for every
rule, whose ``block_axes`` field declares its per-block arrays for sharding. How a
new rule plugs in: ``docs/design/internals.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import ClassVar
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from magma_optax._core import blocks as _blocks
from magma_optax._core import schedules as _schedules
from magma_optax._core import scoping as _scoping
from magma_optax._core import shard_map as _shard_map
from magma_optax._core import trees as _trees

KeyLike = Any  # int, a typed key from jax.random.key, or legacy uint32[2] key data


def as_key(key: KeyLike) -> jax.Array:
  """A typed PRNG key from an int, a typed key or raw ``uint32[2]`` key data."""
  if isinstance(key, jax.Array) and jax.dtypes.issubdtype(
    key.dtype, jax.dtypes.prng_key
  ):
    return key
  if isinstance(key, (bool, str, bytes)):
    key_array = jnp.zeros([], jnp.float32)  # falls through to the error
  else:
    try:
      key_array = jnp.asarray(key)
    except OverflowError:
      raise ValueError(
        f"key={key!r} does not fit in an int32 (jax's default integer width); pass"
        " an int in [-2**31, 2**31) or a typed key from jax.random.key."
      ) from None
    except TypeError:
      key_array = jnp.zeros([], jnp.float32)
  if jnp.issubdtype(key_array.dtype, jnp.integer) and key_array.ndim == 0:
    return jax.random.key(key_array)
  if key_array.dtype == jnp.uint32 and key_array.shape == (2,):
    return jax.random.wrap_key_data(key_array)
  raise ValueError(
    "key must be an int, a typed key from jax.random.key, or uint32[2] key data;"
    f" got {key!r}."
  )


def leaf_key(key: jax.Array, count: jax.Array, path_id: Any) -> jax.Array:
  """The key of one leaf's draw at one step (see the module docstring)."""
  return jax.random.fold_in(jax.random.fold_in(key, count), path_id)


def draw_block_masks(
  key: jax.Array,
  count: jax.Array,
  plans: list[_scoping.LeafPlan],
  probs: list[Any],
) -> list[Any]:
  """Per-leaf boolean block masks ``z`` (``MaskedNode`` for unmasked leaves).

  ``probs[i]`` is leaf i's keep probability at this step. Leaves with the same block
  shape are drawn in one vmapped call: the same bits as one
  ``bernoulli(leaf_key(key, count, path_id), p, block_shape)`` per leaf (JAX's random
  functions commute with ``vmap``), in one random-bits computation instead of one
  per leaf (a launch each on XLA:CPU).
  """
  masks: list[Any] = [optax.MaskedNode()] * len(plans)
  groups: dict[tuple[int, ...], list[int]] = {}
  for i, plan in enumerate(plans):
    if plan.layout is not None:
      groups.setdefault(tuple(plan.layout.block_shape), []).append(i)
  for shape, members in groups.items():
    ids = jnp.asarray([plans[i].path_id for i in members], jnp.uint32)
    p = jnp.stack([probs[i] for i in members])
    keys = jax.vmap(leaf_key, in_axes=(None, None, 0))(key, count, ids)
    z = jax.vmap(lambda k, q, shape=shape: jax.random.bernoulli(k, q, shape))(keys, p)
    for j, i in enumerate(members):
      masks[i] = z[j]
  return masks


def scale_blocks(update: jax.Array, layout: _blocks.BlockLayout, scale: jax.Array):
  """``update * scale`` with per-block f32 ``scale``; keeps the update's dtype."""
  factor = layout.to_leaf(jnp.asarray(scale, jnp.float32))
  return (update * factor.astype(jnp.promote_types(update.dtype, jnp.float32))).astype(
    update.dtype
  )


def active_fractions(
  plans: list[_scoping.LeafPlan], masks: list[Any]
) -> tuple[jax.Array, dict[str, jax.Array] | jax.Array]:
  """Fraction of masked-scope entries whose update was kept: overall and per label.

  For a tree without leaves the per-label entry is a scalar leaf, not ``{}``: that is
  what ``init`` sees from ``optax.tree.map_params``' placeholder, and a leaf there is
  a prefix of any real state's label dict (an empty dict would not be).
  """
  if not plans:
    return jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32)
  kept: dict[str, Any] = {}
  total: dict[str, int] = {}
  for plan, z in zip(plans, masks, strict=True):
    if plan.layout is None:
      continue
    n = jnp.sum(z, dtype=jnp.float32) * plan.layout.block_size
    kept[plan.label] = kept.get(plan.label, 0.0) + n
    total[plan.label] = total.get(plan.label, 0) + plan.layout.num_blocks * (
      plan.layout.block_size
    )
  by_label = {
    label: jnp.asarray(kept[label] / max(total[label], 1), jnp.float32)
    for label in sorted(kept)
  }
  overall = sum(kept.values(), jnp.zeros([], jnp.float32)) / max(sum(total.values()), 1)
  return jnp.asarray(overall, jnp.float32), by_label


# --- configuration --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class MaskConfig:
  """The validated arguments every block-mask transform shares.

  Build it with :meth:`create` (which checks every argument once); the factories
  pass their user's arguments straight through.
  """

  keep_prob: Any
  key: jax.Array
  granularity: _blocks.Granularity
  stack_axes: int
  where: _scoping.Where
  labels: _scoping.Labels

  @classmethod
  def create(
    cls,
    *,
    keep_prob: Any = 1.0,
    key: KeyLike = 0,
    granularity: _blocks.Granularity = "tensor",
    stack_axes: int | None = None,
    where: _scoping.Where = None,
    labels: _scoping.Labels = None,
  ) -> MaskConfig:
    """Checks every argument (``ValueError`` naming it) and returns the config."""
    return cls(
      keep_prob=_scoping.validate_keep_prob(keep_prob),
      key=as_key(key),
      granularity=_blocks.validate_granularity(granularity),
      stack_axes=_blocks.validate_stack_axes(stack_axes),
      where=where,
      labels=labels,
    )

  def plan(self, tree: Any) -> tuple[list[_scoping.LeafPlan], Any]:
    """Per-leaf plans of ``tree`` (params at ``init``, updates at ``update``).

    Example:
      >>> import jax.numpy as jnp
      >>> from magma_optax.masking import engine as _engine
      >>> config = _engine.MaskConfig.create(keep_prob=0.5, granularity="row")
      >>> plans, _ = config.plan({"b": jnp.ones(4), "w": jnp.ones((3, 4))})
      >>> [(p.path, p.layout.block_shape) for p in plans]
      [("['b']", ()), ("['w']", (3,))]
    """
    return _scoping.plan_leaves(
      tree,
      where=self.where,
      labels=self.labels,
      keep_prob=self.keep_prob,
      granularity=self.granularity,
      stack_axes=self.stack_axes,
      complex_ok=True,
    )


# --- rules ----------------------------------------------------------------------------


def is_mask_state(x: Any) -> bool:
  """Whether ``x`` is the state of an engine transform (any rule): a state that
  declares its per-block arrays in a ``block_axes`` field."""
  return isinstance(getattr(x, "block_axes", None), _blocks.DeclaredAxes)


class LeafStep(NamedTuple):
  """What a rule sees of one scoped leaf at one step.

  Attributes:
    plan: the leaf's plan (label, layout, path).
    update: the update to be scaled (leaf-shaped).
    signal: the raw gradient for this leaf (for a standalone transform: the
      incoming update itself).
    momentum: the base optimizer's first moment for this leaf, or ``None``.
    mask: the block draw ``z`` (bool, block shape), or ``None`` for a rule that
      does not draw.
    keep_prob: f32 scalar, the keep probability at this step (clipped to [0, 1]).
    count: int32 scalar, the step count (``None`` for a stateless rule).
    state: dict field -> this leaf's entry of each rule field.
    measured: what :meth:`Rule.measure` computed for this leaf, after
      :meth:`Rule.settle` (``None`` for a rule that does not measure).
  """

  plan: _scoping.LeafPlan
  update: jax.Array
  signal: jax.Array
  momentum: jax.Array | None
  mask: jax.Array | None
  keep_prob: jax.Array | None
  count: jax.Array | None
  state: dict[str, Any]
  measured: Any = None


class Rule:
  """A masking rule: per-leaf state and a per-block scale (see the module docstring).

  Class attributes:
    state_type: the public ``NamedTuple`` state (fields ``count``, ``key``,
      ``mask``, the rule's fields, ``active_fraction``, ``active_fraction_by_label``),
      or ``None`` for a stateless rule (its state is ``optax.EmptyState``).
    block_fields: names of the rule's per-block fields (``layout.block_shape``).
    param_fields: names of its per-parameter fields (the leaf's shape).
    draws: whether the engine draws ``z ~ Bernoulli(keep_prob)`` per block.
  """

  state_type: ClassVar[type | None] = None
  block_fields: ClassVar[tuple[str, ...]] = ()
  param_fields: ClassVar[tuple[str, ...]] = ()
  draws: ClassVar[bool] = True

  def init_leaf(
    self, plan: _scoping.LeafPlan, param: Any, momentum: Any
  ) -> dict[str, Any]:
    """First values of the rule's fields for one scoped leaf (absent: MaskedNode)."""
    del plan, param, momentum
    return {}

  def measure(self, leaf: LeafStep) -> Any:
    """Optional first pass: this leaf's statistics (default ``None``)."""
    del leaf
    return None

  def settle(self, leaves: list[LeafStep]) -> list[Any]:
    """Optional pass over every scoped leaf's ``measured`` at once, before any leaf
    is scaled; returns the new ``measured`` per leaf (default: unchanged)."""
    return [leaf.measured for leaf in leaves]

  def scale(self, leaf: LeafStep) -> tuple[jax.Array, dict[str, Any]]:
    """The per-block f32 scale of ``leaf.update`` and the rule's new fields."""
    raise NotImplementedError


# --- the engine -----------------------------------------------------------------------


def block_tree(treedef: Any, values: list[Any], per_param: bool, dtype: Any) -> Any:
  """A per-leaf field as a tree like the params (see item 6 of the module docstring).

  A leafless tree (optax's ``map_params`` placeholder, or a group with no leaves)
  gives a scalar for per-block fields, so that ``map_params`` does not treat them as
  parameters; per-parameter fields stay trees like the params.
  """
  if treedef.num_leaves == 0 and not per_param:
    return jnp.zeros([], dtype)
  return treedef.unflatten(values)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
  """One block-mask transform: a validated :class:`MaskConfig` and a :class:`Rule`."""

  config: MaskConfig
  rule: Rule
  name: str = "block mask"  # the public factory, for error messages

  @property
  def stateful(self) -> bool:
    return self.rule.state_type is not None

  def init(self, params: Any, momentum: list[Any] | None = None) -> Any:
    """The state for ``params``; ``momentum``: per leaf the base's buffer or None."""
    plans, treedef = self.config.plan(params)
    if not self.stateful:
      return optax.EmptyState()
    leaves = treedef.flatten_up_to(params)
    momentum = momentum or [None] * len(plans)
    fields: dict[str, list[Any]] = {
      f: [] for f in self.rule.block_fields + self.rule.param_fields
    }
    masks = []
    for plan, x, m in zip(plans, leaves, momentum, strict=True):
      entries = {} if plan.layout is None else self.rule.init_leaf(plan, x, m)
      for name, values in fields.items():
        values.append(entries.get(name, optax.MaskedNode()))
      masks.append(
        optax.MaskedNode()
        if plan.layout is None
        else jnp.ones(plan.layout.block_shape, jnp.bool_)
      )
    return self.state(
      treedef,
      plans,
      count=jnp.zeros([], jnp.int32),
      # A fresh buffer per state: a donated state must not delete the key that
      # the next init() would hand out.
      key=jnp.copy(self.config.key),
      masks=masks,
      fields=fields,
    )

  def state(self, treedef, plans, *, count, key, masks, fields) -> Any:
    """The rule's state from per-leaf lists: ``masks`` (the draws) and ``fields``
    (name -> per leaf the rule field's entry, ``MaskedNode`` where unscoped)."""
    overall, by_label = active_fractions(plans, masks)
    trees = {
      name: block_tree(treedef, values, name in self.rule.param_fields, jnp.float32)
      for name, values in fields.items()
    }
    return self.rule.state_type(
      count=count,
      key=key,
      mask=block_tree(treedef, masks, False, jnp.bool_),
      active_fraction=overall,
      active_fraction_by_label=by_label,
      block_axes=(
        jnp.zeros([], jnp.int32)  # optax.tree.map_params keeps the real one
        if _trees.is_placeholder(treedef)
        else _blocks.DeclaredAxes.of_layouts(
          [(p.path, p.layout) for p in plans if p.layout is not None]
        )
      ),
      **trees,
    )

  def prepare(self, updates: Any, state: Any) -> tuple[list, Any, list, list]:
    """This step's plans (checked against the state), masks and probabilities."""
    plans, treedef = self.config.plan(updates)
    if not self.stateful:
      return plans, treedef, [None] * len(plans), [None] * len(plans)
    if plans:
      plans = _scoping.match_state(plans, state.mask, treedef)
      self._check_state_shapes(plans, treedef, updates, state)
    probs = [
      None
      if plan.layout is None
      else _schedules.evaluate_fraction(plan.keep_prob, state.count)
      for plan in plans
    ]
    if self.rule.draws:
      masks = draw_block_masks(state.key, state.count, plans, probs)
    else:
      masks = [optax.MaskedNode()] * len(plans)
    return plans, treedef, masks, probs

  def _check_state_shapes(self, plans, treedef, updates, state) -> None:
    """Where the state knows a leaf's shape (per-parameter fields) or its blocks
    (the last mask), an update of another shape is a ``ValueError`` naming it;
    with the params, the transforms check against those first."""
    for name in self.rule.param_fields:
      _trees.check_shapes(
        self.name, updates, getattr(state, name), f"the state's {name!r} there"
      )
    leaves = treedef.flatten_up_to(updates)
    masks = treedef.flatten_up_to(state.mask)
    for plan, x, z in zip(plans, leaves, masks, strict=True):
      if plan.layout is None or _trees.is_masked(z):
        continue
      if tuple(z.shape) != tuple(plan.layout.block_shape):
        raise ValueError(
          f"{self.name}: the update (gradient) at {plan.path} has shape"
          f" {tuple(jnp.shape(x))}, with blocks of shape"
          f" {tuple(plan.layout.block_shape)}, but the state was built for a"
          f" parameter with blocks of shape {tuple(z.shape)}. Updates must have"
          " their parameters' shapes; pass the params to update() to have both"
          " shapes named."
        )

  def step(
    self,
    updates: Any,
    state: Any,
    *,
    signal: Any = None,
    momentum: list[Any] | None = None,
  ) -> tuple[Any, Any]:
    """Scales ``updates`` per block; returns the new updates and state.

    Args:
      updates: the tree to scale (a base optimizer's update, or what flows in).
      state: this transform's state.
      signal: the raw gradients, for rules that look at them (default:
        ``updates``).
      momentum: per leaf the base optimizer's first moment, or ``None``.
    """
    plans, treedef, masks, probs = self.prepare(updates, state)
    leaves = treedef.flatten_up_to(updates)
    signals = leaves if signal is None else treedef.flatten_up_to(signal)
    momentum = momentum or [None] * len(plans)
    names = self.rule.block_fields + self.rule.param_fields
    old = {
      name: [optax.MaskedNode()] * len(plans)
      if not plans
      else treedef.flatten_up_to(getattr(state, name))
      for name in names
    }
    count = state.count if self.stateful else None
    steps = {
      i: LeafStep(
        plan=plan,
        update=leaves[i],
        signal=signals[i],
        momentum=momentum[i],
        mask=masks[i] if self.rule.draws else None,
        keep_prob=probs[i],
        count=count,
        state={name: old[name][i] for name in names},
      )
      for i, plan in enumerate(plans)
      if plan.layout is not None
    }
    steps = {
      i: leaf._replace(measured=self.rule.measure(leaf)) for i, leaf in steps.items()
    }
    settled = iter(self.rule.settle(list(steps.values())))
    out = []
    fields: dict[str, list[Any]] = {name: [] for name in names}
    for i, plan in enumerate(plans):
      if plan.layout is None:
        out.append(leaves[i])
        for values in fields.values():
          values.append(optax.MaskedNode())
        continue
      scale, new = self.rule.scale(steps[i]._replace(measured=next(settled)))
      out.append(scale_blocks(leaves[i], plan.layout, scale))
      for name, values in fields.items():
        values.append(new.get(name, optax.MaskedNode()))
    if not self.stateful:
      return treedef.unflatten(out), state
    new_state = self.state(
      treedef,
      plans,
      count=optax.safe_increment(state.count),
      key=state.key,
      masks=masks,
      fields=fields,
    )
    return treedef.unflatten(out), new_state

  def transformation(self) -> optax.GradientTransformationExtraArgs:
    """The rule applied to whatever flows through it (its signal is the update)."""

    def init_fn(params):
      return self.init(params)

    def update_fn(updates, state, params=None, **extra_args):
      del extra_args
      _trees.check_shapes(self.name, updates, params)
      return self.step(updates, state)

    return optax.GradientTransformationExtraArgs(*_shard_map.typed(init_fn, update_fn))
