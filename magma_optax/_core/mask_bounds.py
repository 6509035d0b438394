"""What :func:`magma_optax.periodic_mask` tells the transform inside it about the
masks it will pass: a :class:`MaskBound` per leaf.

At ``update`` the wrapper promises the bounds of the very mask arrays it passes, in
the extra argument ``mask_promises`` (:class:`MaskPromises`). ``init(params)``
cannot carry anything but the parameters, so there the direction is reversed: the
wrapper reads its inner state's receivers (:class:`Receiver`, a static part of a
state that says how each leaf is stored) and checks them (:func:`check_init`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from magma_optax._core import trees as _trees


class MaskBound(NamedTuple):
  """The densest parameter mask a wrapper will hand one leaf, as far as its ``init``
  knows: what the compact storage of :func:`magma_optax.sparse_state` is checked
  against at ``init`` (:func:`check_init`), so that a mask that certainly cannot be
  stored is a ``ValueError`` at ``init`` instead of a failed step.

  Attributes:
    shape: the leaf's shape (a bound for another leaf of the same path is ignored).
    why: how that mask arises, for the message.
    entries: its number of active entries (``exact``), or a number it certainly
      reaches (a global top-k's share); ``None`` where ``init`` cannot know it.
    exact: whether ``entries`` and ``tiles`` are exact counts.
    block: ``(r, c)`` where the masks are made of whole ``r x c`` tiles of the last
      two axes (every mask, not only the densest); ``None`` otherwise.
    tiles: with ``block``, its active tiles (per part with ``parts``), counted as
      ``entries`` is; ``None`` where unknown.
    parts: with ``block``, the counts of the parts that each hold ``tiles``.
    structure: ``(n, m)`` where every mask keeps ``n`` of each ``m`` along ``axis``.
    axis: the N:M axis, non-negative.
    masked: ``False`` where the wrapper passes no mask for the leaf
      (``optax.MaskedNode``: it does not prune it); the counts are then ``None``.
    always: whether *every* mask the wrapper hands the leaf is within this bound
      by construction -- at most ``entries`` (``tiles``) active, made of whole
      ``block`` tiles or ``structure`` groups -- not only the first refresh's
      (:func:`magma_optax.periodic_mask` ranking per leaf with a Python number for
      ``sparsity``: its counts never grow). Promised at ``update``
      (:class:`MaskPromises`), it lets :func:`magma_optax.sparse_state` compile
      no host callback for a check the leaf's masks cannot fail.
  """

  shape: tuple[int, ...]
  why: str
  entries: int | None
  exact: bool = True
  block: tuple[int, int] | None = None
  tiles: int | None = None
  parts: tuple[int, ...] | None = None
  structure: tuple[int, int] | None = None
  axis: int = 0
  masked: bool = True
  always: bool = False

  @property
  def all_active(self) -> bool:
    return self.exact and self.entries == math.prod(self.shape)


@dataclasses.dataclass(frozen=True, eq=False)
class MaskPromises:
  """The extra argument ``mask_promises``: bounds that hold for *every* value of
  the very mask arrays passed as ``param_mask`` (a wrapper in between that makes
  new masks loses the promise, and its masks are checked as any others).

  ``pairs``: ``(mask array, bound)``; the wrapper keeps the arrays alive while its
  inner update runs, so identity is meaningful. ``unchanged``: mask arrays equal
  to those of the wrapper's previous update. Not a pytree: a leaf to JAX.
  """

  pairs: tuple[tuple[Any, MaskBound], ...] = ()
  # Mask arrays equal to the masks of the wrapper's previous update (it changes
  # masks on its refresh steps only, and says so on the others): the inner
  # transform keeps what it built for them and moves nothing.
  unchanged: tuple[Any, ...] = ()

  def is_unchanged(self, mask: Any) -> bool:
    """Whether this very mask leaf is promised equal to the previous update's."""
    return any(m is mask for m in self.unchanged)

  def bound_of(self, mask: Any) -> MaskBound | None:
    """The bound promised of this very mask leaf (of the bound's shape), or
    ``None``."""
    for m, bound in self.pairs:
      if m is mask and bound.always and bound.shape == tuple(jnp.shape(mask)):
        return bound
    return None


class Receiver:
  """A static node of a state that receives the bounds announced at ``init``:
  ``treedef`` is the structure of the parameters its transform was given, and
  :meth:`bound_problem` says why a leaf's masks certainly fail."""

  treedef: Any

  def bound_problem(self, i: int, bound: MaskBound) -> str | None:
    """Why leaf ``i``'s masks, within ``bound``, certainly cannot be used, or
    ``None`` (also where that depends on their values)."""
    raise NotImplementedError


def check_init(inner_state: Any, params_def: Any, bounds: list[MaskBound | None]):
  """Raises the first problem that a :class:`Receiver` in ``inner_state`` (the state
  a wrapper's inner ``init`` returned) finds with ``bounds`` (per leaf of the
  wrapper's parameters, structured as ``params_def``).

  A receiver's leaves are matched to the wrapper's by tree structure
  (:func:`magma_optax._core.trees.split_like`: ``optax.MaskedNode`` may stand for
  any subtree, as ``optax.masked`` leaves it): a receiver given another tree (a
  wrapper in between that hands on a subtree) gets no bound.
  """
  is_receiver = lambda x: isinstance(x, Receiver)  # noqa: E731
  for node in jax.tree.leaves(inner_state, is_leaf=is_receiver):
    if not is_receiver(node) or node.treedef is None:
      continue
    index = node.treedef.unflatten(list(range(node.treedef.num_leaves)))
    matched = _trees.split_like(index, params_def)
    if matched is None:
      continue
    for bound, i in zip(bounds, matched, strict=True):
      if bound is None or _trees.is_masked(i):
        continue
      problem = node.bound_problem(i, bound)
      if problem is not None:
        raise ValueError(f"{problem} Found at init, before any step: {bound.why}.")
