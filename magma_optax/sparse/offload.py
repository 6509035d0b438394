"""Offload: a cold leaf's sparse state moved to host memory between steps.

Offload storage is skip storage (or tile storage) plus a per-leaf count of
consecutive all-inactive steps; :func:`offload_sparse_state`, called on the host
between jitted steps, moves the state of cold leaves to ``pinned_host`` memory and
brings back the leaves that became active. Inside the step a host-resident leaf is
only transferred when its mask has an active entry.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from magma_optax._core import shard_map as _shard_map
from magma_optax._core import trees as _trees
from magma_optax.sparse import storage as _storage
from magma_optax.sparse.sharded_tiles import ShardedTiles
from magma_optax.sparse.skip import Skip
from magma_optax.sparse.tiles import Tiles

HOST_MEMORY_KIND = "pinned_host"


# jax.memory.Space names memory spaces inside jit; a jax without it: no offload.
_SPACE = getattr(getattr(jax, "memory", None), "Space", None)


def _memory_space(x: Any) -> Any:
  try:
    return getattr(jax.typeof(x), "memory_space", None)
  except Exception:  # noqa: BLE001  non-array leaves have no memory space
    return None


def _on_host(x: Any) -> bool:
  return _SPACE is not None and _memory_space(x) == _SPACE.Host


@dataclasses.dataclass(frozen=True)
class Offload(Skip):
  """Skip storage whose entries may live in host memory while the leaf is cold.

  A host-resident entry is copied to the device, updated and copied back only when
  the leaf's mask has an active entry (a ``lax.cond``); otherwise it stays put.
  """

  tracks_cold = True

  def load(self, x, active):
    if not _on_host(x):
      return x
    return _shard_map.cond(
      True if active is None else active,
      lambda: jax.device_put(x, _SPACE.Device),
      lambda: jnp.zeros(x.shape, x.dtype),
    )

  def unload(self, new, orig, active):
    if not _on_host(orig):
      return new
    return _shard_map.cond(
      True if active is None else active,
      lambda: jax.device_put(new, _SPACE.Host),
      lambda: orig,
    )


class HostTiles:
  """Tile storage whose buffers may live in host memory while the leaf is cold (no
  active tile for ``offload_after`` steps), as :class:`Offload` (a mixin over
  :class:`Tiles` and :class:`ShardedTiles`).

  Inactive tiles hold no moments in compact storage (regrown tiles start from
  zero), so the unit that can go to host memory is a leaf's whole tile buffer."""

  tracks_cold = True
  load = Offload.load
  unload = Offload.unload

  def remap_key(self, ctx, bits, entries, fresh):
    del ctx, bits, entries, fresh
    return None  # alone: each buffer may be on the host

  def remap_fresh(self, ctx, x, bits, fresh, kept):
    # Runs before `load` (and only when some stored set changed): a host-resident
    # buffer is remapped on the device and put back.
    if not _on_host(x):
      return super().remap_fresh(ctx, x, bits, fresh, kept)
    moved = super().remap_fresh(
      ctx, jax.device_put(x, _SPACE.Device), bits, fresh, kept
    )
    return jax.device_put(moved, _SPACE.Host)


@dataclasses.dataclass(frozen=True)
class OffloadTiles(HostTiles, Tiles):
  """:class:`Tiles` with offload (:class:`HostTiles`)."""


@dataclasses.dataclass(frozen=True)
class OffloadShardedTiles(HostTiles, ShardedTiles):
  """:class:`ShardedTiles` with offload (:class:`HostTiles`)."""


def host_offload_available(device: jax.Device | None = None) -> bool:
  """Whether ``device`` (default: the first) has a ``pinned_host`` memory kind.

  Example:
    >>> import magma_optax as magma
    >>> isinstance(magma.host_offload_available(), bool)
    True
  """
  if _SPACE is None:
    return False
  device = device or jax.devices()[0]
  try:
    kinds = {m.kind for m in device.addressable_memories()}
  except Exception:  # noqa: BLE001  backends without memory kinds
    return False
  return HOST_MEMORY_KIND in kinds


def _put(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
  """``jax.device_put(x, sharding)``, or a jitted copy where the runtime refuses.

  jax 0.12.1's CPU client cannot copy an array that a jitted step wrote to host
  memory (its layout keeps the memory space) back to device memory; a jitted copy
  with ``out_shardings`` can.
  """
  try:
    return jax.device_put(x, sharding)
  except jax.errors.JaxRuntimeError as err:
    if "UNIMPLEMENTED" not in str(err):
      raise
    return _copy_to(sharding)(x)


@functools.cache
def _copy_to(sharding: jax.sharding.Sharding) -> Any:
  return jax.jit(lambda a: a, out_shardings=sharding)


def offload_sparse_state(opt_state: Any, params: Any) -> Any:
  """Moves cold leaves' sparse state to host memory and active ones back to device.

  Call on the host between (jitted) steps; it reads the per-leaf ``cold`` flags of
  every offload-mode :class:`SparseState` in ``opt_state`` (a host sync) and
  ``jax.device_put``\\ s their per-entry base state to ``memory_kind="pinned_host"``
  (cold) or the device's default memory (no longer cold). Sharding is kept. Where
  host memory kinds are unavailable (see :func:`host_offload_available`) the state
  is returned unchanged.

  Args:
    opt_state: an optimizer state containing a ``sparse_state(mode="offload")``.
    params: the parameters (their structure and shapes identify per-entry state).

  Returns:
    The state with per-entry base state placed by coldness.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import magma_optax as magma
    >>> tx = magma.sparse_state(optax.adam(1e-3), mode="offload", offload_after=1)
    >>> params = {"w": jnp.ones(4)}
    >>> state = tx.init(params)
    >>> mask = {"w": jnp.zeros(4, bool)}
    >>> _, state = tx.update(params, state, params, param_mask=mask)
    >>> state = magma.offload_sparse_state(state, params)
  """
  if not host_offload_available():
    return opt_state
  is_state = _storage.is_sparse_state
  params_def = jax.tree.structure(params)
  shapes = [tuple(jnp.shape(x)) for x in params_def.flatten_up_to(params)]
  bare = params_def.num_nodes == 1

  def place(node):
    # Inside optax.masked / multi_transform a group's state holds MaskedNode for
    # the other groups' leaves and subtrees; split_like reads it against the
    # whole parameter tree.
    cold = _trees.split_like(node.cold, params_def)
    if cold is None:
      if any(not _trees.is_masked(c) for c in jax.tree.leaves(node.cold)):
        raise ValueError(
          "offload_sparse_state: params do not have the tree structure of the"
          " parameters this SparseState keeps (its per-leaf flags are"
          f" {jax.tree.structure(node.cold)}, params are {params_def}); pass the"
          " params the optimizer updates."
        )
      return node
    cold = [None if _trees.is_masked(c) else bool(c) for c in cold]

    def move(i, x):
      if cold[i] is None or (bare and jnp.ndim(x) == 0):
        return x
      sharding = x.sharding
      want = HOST_MEMORY_KIND if cold[i] else jax.devices()[0].default_memory().kind
      if sharding.memory_kind == want:
        return x
      return _put(x, sharding.with_memory_kind(want))

    # Without shapes: compact tile buffers have their stored shapes; base_state
    # holds only per-entry state of the stored tree, and a scalar such as a count
    # is never like a parameter tree that has more than a bare leaf. With a bare
    # leaf every leaf of the state is "like" it: `move` skips scalars (counts)
    # unless the parameter is a scalar itself, where only its shape tells.
    return node._replace(
      base_state=_trees.map_like(
        move,
        node.base_state,
        params_def,
        shapes=shapes if bare and shapes[0] == () else None,
      )
    )

  return jax.tree.map(
    lambda x: place(x) if is_state(x) else x, opt_state, is_leaf=is_state
  )
