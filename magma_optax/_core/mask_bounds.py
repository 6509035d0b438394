"""What :func:`magma_optax.periodic_mask` tells the transform inside it about the
masks it will pass (:class:`MaskBound`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any
from typing import NamedTuple

import jax.numpy as jnp


class MaskBound(NamedTuple):
  """The densest parameter mask a wrapper will hand one leaf, as far as its ``init``
  knows: what :func:`magma_optax.sparse_state`'s ``init`` checks its compact
  storage against, so that a mask that certainly cannot be stored is a
  ``ValueError`` at ``init`` instead of a failed step.

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
      ``sparsity``: its counts never grow). Given at ``update``
      (:func:`mask_promises`), it lets :func:`magma_optax.sparse_state` compile
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


# The bounds of the masks that a wrapper's init is about to hand its inner transform,
# by leaf key path (jax.tree_util.keystr) and leaf object (its id: the same object
# under the same path is the same leaf). optax's init takes the params only, so the
# wrapper sets them around its inner init (:func:`mask_bounds`); nothing else reads
# or writes them, and they are gone when that init returns.
_MASK_BOUNDS: contextvars.ContextVar[dict[str, MaskBound] | None] = (
  contextvars.ContextVar("magma_optax_mask_bounds", default=None)
)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value: Any):
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


def mask_bounds(bounds: dict[tuple[str, int], MaskBound]):
  """Makes ``bounds`` (by key path and ``id`` of the leaf) what :func:`mask_bound`
  returns inside."""
  return _setting(_MASK_BOUNDS, bounds)


# What a wrapper's update promises of the masks it hands its inner update, by the
# mask leaf's id (the very array passed as ``param_mask``: a wrapper in between that
# makes new masks loses the promise, and its masks are checked as any others).
_MASK_PROMISES: contextvars.ContextVar[dict[int, MaskBound] | None] = (
  contextvars.ContextVar("magma_optax_mask_promises", default=None)
)


def mask_promises(promises: dict[int, MaskBound]):
  """Makes ``promises`` (bounds with ``always``, by ``id`` of the mask leaf) what
  :func:`mask_promise` returns inside."""
  return _setting(_MASK_PROMISES, promises)


def mask_promise(mask: Any) -> MaskBound | None:
  """The bound that an enclosing :func:`mask_promises` promises of every value of
  the mask leaf ``mask`` (this object, of the bound's shape), or ``None``."""
  bound = (_MASK_PROMISES.get() or {}).get(id(mask))
  if bound is None or not bound.always or bound.shape != tuple(jnp.shape(mask)):
    return None
  return bound


def mask_bound(name: str, leaf: Any) -> MaskBound | None:
  """The bound set by an enclosing :func:`mask_bounds` for ``leaf`` at key path
  ``name``, or ``None``. Both must match: optax's wrappers hand their inner
  transform the same leaf objects at the same paths (``optax.masked`` replaces
  others by ``MaskedNode``), and a wrapper that hands it a subtree or new arrays
  gets no bound (nothing is checked at init)."""
  bound = (_MASK_BOUNDS.get() or {}).get((name, id(leaf)))
  return bound if bound is not None and bound.shape == tuple(jnp.shape(leaf)) else None
