"""Blocks: how a parameter tensor is cut into the blocks that share one mask draw.

A :class:`BlockLayout` maps a leaf to its per-block array and back, for a
granularity: ``"tensor"`` (the leaf is one block), ``"row"``, ``"column"``,
``"element"``, or a tile shape; ``stack_axes=k`` blocks each slice along the first
``k`` axes (stacked layers) separately. Layouts depend on static shapes only.
:class:`DeclaredAxes` is what a state declares of its per-block arrays.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from magma_optax._core import sharded as _sharded

Granularity = str | tuple[int, ...]

NAMED_GRANULARITIES = ("tensor", "row", "column", "element")


def validate_granularity(granularity: Granularity) -> Granularity:
  """Returns ``granularity`` normalised, or raises ``ValueError`` naming the choices."""
  if isinstance(granularity, str):
    if granularity not in NAMED_GRANULARITIES:
      raise ValueError(
        f"granularity must be one of {NAMED_GRANULARITIES} or a tile shape such"
        f" as (3, 3); got {granularity!r}."
      )
    return granularity
  if isinstance(granularity, Sequence) and len(granularity) > 0:
    tile = tuple(granularity)
    if all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tile):
      return tile
  raise ValueError(
    f"granularity must be one of {NAMED_GRANULARITIES} or a tile shape of positive"
    f" ints such as (3, 3); got {granularity!r}."
  )


def validate_stack_axes(stack_axes: int | None) -> int:
  """Checks ``stack_axes`` (``None`` means 0): a static Python int >= 0."""
  if stack_axes is None:
    return 0
  if isinstance(stack_axes, bool) or not isinstance(stack_axes, int) or stack_axes < 0:
    raise ValueError(
      f"stack_axes must be a Python int >= 0 or None; got {stack_axes!r}. (With"
      " optax.inject_hyperparams, pass static_args=('stack_axes',).)"
    )
  return stack_axes


# Entries of the last axis summed in one run by ``BlockLayout.masked_block_sums``
# where they divide it (else the whole axis is one run): a bound on the rounding
# of a sequential float32 sum for long rows, long enough to cost nothing on XLA:CPU.
SUM_RUN = 128


@dataclasses.dataclass(frozen=True)
class BlockLayout:
  """How one leaf is cut into blocks (all fields static).

  Attributes:
    shape: the leaf's shape.
    expanded_shape: the leaf reshaped so that block axes and within-block axes are
      separate axes (a free reshape of a contiguous array).
    reduce_axes: the axes of ``expanded_shape`` that lie within a block.
    source_axes: for each axis of ``expanded_shape``, the leaf axis it comes from
      (a tiled leaf axis gives two: the tile count and the position in the tile);
      empty means one to one.
  """

  shape: tuple[int, ...]
  expanded_shape: tuple[int, ...]
  reduce_axes: tuple[int, ...]
  source_axes: tuple[int, ...] = ()

  @property
  def param_axes(self) -> tuple[int, ...]:
    """For each axis of :attr:`block_shape`, the leaf axis that it indexes.

    This is the per-block layout a state declares (``magma.sharding`` gives a
    per-block array the leaf's partition spec on these axes): ``"row"`` keeps every
    axis but the last, ``"column"`` the stacked axes and the last, a tile shape
    every axis (counting tiles), ``"tensor"`` only the stacked axes.
    """
    source = self.source_axes or tuple(range(len(self.expanded_shape)))
    return tuple(a for i, a in enumerate(source) if i not in self.reduce_axes)

  @property
  def block_shape(self) -> tuple[int, ...]:
    """Shape of the per-block arrays (scores, masks) of this leaf."""
    return tuple(
      d for i, d in enumerate(self.expanded_shape) if i not in self.reduce_axes
    )

  @property
  def block_size(self) -> int:
    """Number of entries in one block (all blocks of a leaf have the same size)."""
    return math.prod(self.expanded_shape[i] for i in self.reduce_axes)

  @property
  def num_blocks(self) -> int:
    return math.prod(self.block_shape)

  def block_sum(self, x: jax.Array) -> jax.Array:
    """Sums a leaf-shaped array within each block; returns ``block_shape``."""
    return jnp.sum(self._expand(x), axis=self.reduce_axes)

  def masked_block_sums(
    self, xs: Sequence[jax.Array], where: jax.Array
  ) -> tuple[jax.Array, ...]:
    """``block_sum`` of each of ``xs`` over the entries where ``where`` holds.

    One reduction for all of them (a variadic ``lax.reduce``) with the selection
    inside it: XLA:CPU writes ``jnp.where(mask, x, 0)`` out before each of its
    reductions (4 bytes per entry and input, in fresh pages on every step), and a
    reduction of several outputs takes the selection in. Where the last axis of
    ``expanded_shape`` lies within a block, it is summed first in runs of
    :data:`SUM_RUN` entries where they divide it (XLA:CPU emits such a reduction
    as a sequential loop; short runs bound its rounding), then ``jnp.sum`` sums
    the runs' sums. ``xs`` (at least one, of one dtype and the leaf's shape) and
    the sums have that dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> import magma_optax as magma
      >>> layout = magma.block_layout((2, 3), "row")
      >>> x = jnp.array([[1.0, 2.0, jnp.inf], [4.0, 5.0, 6.0]])
      >>> keep = jnp.array([[True, True, False], [False, True, True]])
      >>> [s.tolist() for s in layout.masked_block_sums([x, x * x], keep)]
      [[3.0, 11.0], [5.0, 61.0]]
    """
    if not xs:
      raise ValueError("masked_block_sums needs at least one array to sum.")
    dtypes = {jnp.result_type(x) for x in xs}
    shapes = {jnp.shape(x) for x in xs}
    if len(dtypes) > 1 or shapes != {tuple(self.shape)}:
      raise ValueError(
        f"masked_block_sums sums arrays of one dtype and the layout's shape"
        f" {tuple(self.shape)}; got dtypes {sorted(map(str, dtypes))} and shapes"
        f" {sorted(shapes)}."
      )
    zero = jnp.zeros((), xs[0].dtype)
    ops = [self._expand(jnp.where(where, x, zero)) for x in xs]
    axes, shape = self.reduce_axes, self.expanded_shape
    last = len(shape) - 1
    spec = _sharded.explicit_spec(ops[0])
    runs = (
      last in axes
      and shape[-1] % SUM_RUN == 0
      and shape[-1] > SUM_RUN
      and not (spec is not None and spec[-1])  # a split then moves no data
    )
    if runs:
      ops = [
        _sharded.reshape(x, (*shape[:-1], shape[-1] // SUM_RUN, SUM_RUN)) for x in ops
      ]
      first = (last + 1,)
    else:
      first = (last,) if last in axes else axes

    def add(a, b):
      return tuple(x + y for x, y in zip(a, b, strict=True))

    sums = jax.lax.reduce(tuple(ops), (zero,) * len(ops), add, first)
    # What is left of the block's axes (all of them after runs) lies at or before
    # ``last``: the same axis numbers.
    rest = axes if first == (last + 1,) else tuple(a for a in axes if a not in first)
    if not rest:
      return tuple(sums)
    return tuple(jnp.sum(s, axis=rest) for s in sums)

  def block_max_abs(self, x: jax.Array) -> jax.Array:
    """Largest ``|x|`` within each block (0 for empty blocks); ``block_shape``."""
    return jnp.max(self._expand(jnp.abs(x)), axis=self.reduce_axes, initial=0)

  def to_leaf(self, values: jax.Array) -> jax.Array:
    """Broadcasts per-block values back to the leaf's shape."""
    keep = tuple(
      1 if i in self.reduce_axes else d for i, d in enumerate(self.expanded_shape)
    )
    expanded = jnp.broadcast_to(_sharded.reshape(values, keep), self.expanded_shape)
    return _sharded.reshape(expanded, self.shape)

  def _expand(self, x: jax.Array) -> jax.Array:
    # Also where x is sharded over Explicit mesh axes (_sharded.reshape).
    return _sharded.reshape(x, self.expanded_shape)


def block_layout(
  shape: Sequence[int], granularity: Granularity, stack_axes: int = 0
) -> BlockLayout:
  """Returns the :class:`BlockLayout` of a leaf of ``shape``.

  Raises:
    ValueError: if ``stack_axes`` exceeds the leaf's rank or a tile does not divide
      the axes it cuts.

  Example:
    >>> import jax.numpy as jnp
    >>> import magma_optax as magma
    >>> layout = magma.block_layout((6, 4), (3, 2))  # 3x2 tiles
    >>> layout.block_shape, layout.block_size
    ((2, 2), 6)
    >>> layout.block_sum(jnp.ones((6, 4))).tolist()
    [[6.0, 6.0], [6.0, 6.0]]
    >>> magma.block_layout((8, 5, 3), "tensor", stack_axes=1).block_shape  # per layer
    (8,)
  """
  shape = tuple(int(d) for d in shape)
  if stack_axes > len(shape):
    raise ValueError(
      f"stack_axes={stack_axes} but a leaf has shape {shape} (rank {len(shape)});"
      " stack_axes must be <= the rank of every scoped leaf."
    )
  lead, body = shape[:stack_axes], shape[stack_axes:]
  k = len(lead)
  body_axes = tuple(range(k, len(shape)))
  if granularity == "element":
    return BlockLayout(shape, shape, ())
  if granularity == "row" and len(body) >= 2:
    return BlockLayout(shape, shape, (len(shape) - 1,))
  if granularity == "column" and len(body) >= 2:
    return BlockLayout(shape, shape, body_axes[:-1])
  if isinstance(granularity, tuple) and len(body) >= len(granularity):
    r = len(granularity)
    tiled = body[len(body) - r :]
    for dim, t in zip(tiled, granularity, strict=True):
      if dim % t:
        raise ValueError(
          f"granularity tile {granularity} does not divide the last {r} axes"
          f" {tiled} of a leaf of shape {shape}; choose a tile whose sizes"
          " divide those axes, or scope the leaf out with `where`."
        )
    expanded = lead + body[: len(body) - r]
    source = tuple(range(len(expanded)))
    reduce_axes = []
    for axis, (dim, t) in enumerate(zip(tiled, granularity, strict=True)):
      expanded += (dim // t, t)
      source += (len(shape) - r + axis,) * 2
      reduce_axes.append(len(expanded) - 1)
    return BlockLayout(shape, expanded, tuple(reduce_axes), source)
  # "tensor", and the fall-back for leaves with too few axes for the granularity.
  return BlockLayout(shape, shape, body_axes)


@dataclasses.dataclass(frozen=True)
class DeclaredAxes:
  """A state's declaration of its per-block arrays: static (no arrays, part of the
  state's tree structure), read by :func:`magma_optax.sharding.state_shardings`.

  ``entries``: ``(keystr(path), array shape, param_axes)`` per array kind: the
  arrays of that shape at the parameter ``path`` index the parameter axes
  ``param_axes``, one per array axis (``None``: an axis of no parameter axis).
  """

  entries: tuple[tuple[str, tuple[int, ...], tuple[int | None, ...]], ...] = ()

  @classmethod
  def of_layouts(cls, named_layouts: Sequence[tuple[str, BlockLayout]]) -> DeclaredAxes:
    """The declaration of the per-block arrays of these ``(path, layout)``."""
    return cls(
      tuple(
        (path, tuple(layout.block_shape), tuple(layout.param_axes))
        for path, layout in named_layouts
      )
    )


jax.tree_util.register_static(DeclaredAxes)


def declarations(state: Any) -> dict[tuple[str, tuple[int, ...]], set]:
  """Every declaration in ``state`` (any pytree), by ``(path, array shape)``: the
  set of ``param_axes`` declared for arrays of that shape at that parameter."""
  found: dict[tuple[str, tuple[int, ...]], set] = {}
  is_declared = lambda x: isinstance(x, DeclaredAxes)  # noqa: E731
  for node in jax.tree.leaves(state, is_leaf=is_declared):
    if is_declared(node):
      for path, shape, axes in node.entries:
        found.setdefault((path, tuple(shape)), set()).add(tuple(axes))
  return found
