"""Tiles, N:M groups and shard parts: the shapes that parameter masks and sparse
storage share.

Validation of ``structure=(n, m)``, ``block=(r, c)`` and ``shards=`` (with errors
that name the argument, the leaf and the fix), the tile count of a leaf, and the
split of a leaf's last axes into equal parts (a device's shard) and back.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from magma_optax._core import sharded as _sharded


def validate_nm_structure(structure: Any) -> tuple[int, int]:
  """Checks an N:M structure ``(n, m)``: ints with ``1 <= n <= m``."""
  ok = (
    isinstance(structure, tuple | list)
    and len(structure) == 2
    and all(isinstance(v, int) and not isinstance(v, bool) for v in structure)
  )
  if not ok or not 1 <= structure[0] <= structure[1]:
    raise ValueError(
      f"structure must be None or (n, m) ints with 1 <= n <= m (N:M keeps n of"
      f" every m); got {structure!r}."
    )
  return tuple(structure)


def _positive_ints(value: Any, message: str, size: int | None = 2) -> tuple[int, ...]:
  """``value`` as a tuple of ints >= 1 (``size`` of them; ``None``: two or more),
  else ``ValueError(message)``."""
  ok = (
    isinstance(value, tuple | list)
    and (len(value) == size if size is not None else len(value) >= 2)
    and all(
      isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_) and v >= 1
      for v in value
    )
  )
  if not ok:
    raise ValueError(message)
  return tuple(int(v) for v in value)


def validate_block(block: Any) -> tuple[int, int]:
  """Checks a tile shape ``(r, c)``: positive ints."""
  return _positive_ints(
    block,
    f"block must be None or (r, c) ints >= 1 (tiles of r x c entries over the"
    f" last two axes); got {block!r}.",
  )


def check_tiles(shape: tuple[int, ...], block: tuple[int, int], name: str) -> None:
  """Raises ``ValueError`` unless ``block`` tiles the last two axes of ``shape``."""
  r, c = block
  if len(shape) < 2 or shape[-2] % r or shape[-1] % c:
    raise ValueError(
      f"block={block} prunes r x c tiles over the last two axes, so every pruned"
      f" leaf needs >= 2 axes with the last two multiples of ({r}, {c}); leaf"
      f" {name} has shape {shape}. Scope it out with `where` (e.g."
      " where=magma.attention_mlp_weights) or choose another block."
    )


def num_tiles(shape: tuple[int, ...], block: tuple[int, int]) -> int:
  """The number of ``r x c`` tiles of the last two axes of ``shape`` (whole ones)."""
  return math.prod(shape[:-2]) * (shape[-2] // block[0]) * (shape[-1] // block[1])


def validate_shards(shards: Any, block: tuple[int, int] | None, who: str) -> Any:
  """Checks ``shards``: ``None``, ints >= 1 for the last ``k >= 2`` axes (``(sr,
  sc)``, or e.g. ``(se, sr, sc)``), or a callable ``(path, leaf) -> counts | None``
  (checked per leaf by :func:`leaf_shards`)."""
  if shards is None or callable(shards):
    pass
  else:
    shards = _shard_counts(shards, f"{who}: shards")
  if shards is not None and block is None:
    raise ValueError(
      f"{who}: shards= splits the tile grid of block=(r, c); give block too."
    )
  return shards


def _shard_counts(value: Any, what: str) -> tuple[int, ...]:
  return _positive_ints(
    value,
    f"{what} must be ints >= 1, the number of equal parts of each of the last k"
    f" >= 2 axes: (sr, sc) for the last two, (se, sr, sc) for the last three; got"
    f" {value!r}.",
    size=None,
  )


def leaf_shards(
  shards: Any, path: Any, leaf: Any, block: tuple[int, int], name: str
) -> tuple[int, ...] | None:
  """A leaf's parts of its tile grid (counts for its last ``k`` axes), or ``None``
  for one part (unless the leaf is sharded over ``Explicit`` mesh axes).

  Each part must hold whole tiles: the last two axes are multiples of ``sr * r``
  and ``sc * c``, the axes before them multiples of their counts (a ``ValueError``
  naming the leaf otherwise).
  """
  if shards is None:
    return None
  parts = shards(path, leaf) if callable(shards) else shards
  if parts is None:
    return None
  parts = _shard_counts(parts, f"shards for leaf {name}")
  shape = tuple(jnp.shape(leaf))
  r, c = block
  if len(shape) < len(parts):
    raise ValueError(
      f"shards={parts} gives counts for the last {len(parts)} axes, but leaf {name}"
      f" has {len(shape)} (shape {shape}); give each leaf its counts with a"
      " callable (path, leaf) -> counts, e.g. magma.sharding.tile_shards(params)."
    )
  need = (*parts[:-2], parts[-2] * r, parts[-1] * c)
  if any(n % k for n, k in zip(shape[len(shape) - len(parts) :], need, strict=True)):
    sizes = " x ".join(map(str, parts))
    raise ValueError(
      f"shards={parts} splits the last {len(parts)} axes of leaf {name} (shape"
      f" {shape}) into {sizes} parts of whole {r}x{c} tiles, so they must be"
      f" multiples of {need}."
    )
  if all(k == 1 for k in parts) and _sharded.explicit_spec(leaf) is None:
    return None  # one part: the leaf's plain tile storage
  # (On Explicit axes, even of size 1, one part is kept as parts: its per-part
  # work runs with the axes as Auto, where the plain storage is refused.)
  return parts


def split_parts(x: jax.Array, parts: tuple[int, ...]) -> jax.Array:
  """``(..., A_1, ..., A_k) -> (s_1, ..., s_k, ..., A_1 / s_1, ..., A_k / s_k)`` for
  ``parts = (s_1, ..., s_k)``: part ``(a_1, ..., a_k)`` is the ``a_i``-th of ``s_i``
  equal pieces of each of the last ``k`` axes (a device's shard of a parameter
  split that way)."""
  k = len(parts)
  lead, split = x.shape[: x.ndim - k], x.shape[x.ndim - k :]
  pieces = [d for s, a in zip(parts, split, strict=True) for d in (s, a // s)]
  x = _sharded.reshape(x, (*lead, *pieces))
  n = len(lead)
  return jnp.moveaxis(x, [n + 2 * i for i in range(k)], list(range(k)))


def join_parts(x: jax.Array, k: int) -> jax.Array:
  """The inverse of :func:`split_parts` with ``k`` part axes."""
  n = x.ndim - 2 * k
  x = jnp.moveaxis(x, list(range(k)), [n + 2 * i for i in range(k)])
  lead, pieces = x.shape[:n], x.shape[n:]
  return _sharded.reshape(
    x, (*lead, *(pieces[2 * i] * pieces[2 * i + 1] for i in range(k)))
  )


def check_parts_on_devices(x: Any, parts: tuple[int, ...], who: str, name: str):
  """Under ``Explicit`` mesh axes every part of ``x`` must lie on one device: the
  axes that ``parts`` does not count name no mesh axis (not even one of size 1:
  the parts' sharding types must match the parameter's), and each counted axis is
  split into a number of pieces that divides its count (a ``ValueError`` that says
  so otherwise; elsewhere nothing to check)."""
  spec = _sharded.explicit_spec(x)
  if spec is None:
    return
  mesh = jax.typeof(x).sharding.mesh
  counts = [_sharded.mesh_axis_size(mesh, e) for e in spec]
  k = len(parts)
  split = counts[len(counts) - k :]
  if any(e is not None for e in spec[: len(spec) - k]) or any(
    p % n for p, n in zip(parts, split, strict=True)
  ):
    raise ValueError(
      f"{who}: shards={parts} splits the last {k} axes of leaf {name} into parts,"
      f" but the leaf is sharded over Explicit mesh axes as"
      f" {jax.sharding.PartitionSpec(*spec)} ({' x '.join(map(str, counts))}"
      " pieces): every part must lie on one device, so give counts for every axis"
      " the spec names, each a multiple of its number of pieces (shards="
      "magma.sharding.tile_shards(params) gives them)."
    )
