"""Adam over the active tiles of compact tile storage: :func:`tile_adam`.

One step per leaf reads the gradient's active tiles and updates their compact
moments in one pass, with ``implementation=`` choosing the XLA reference
(:func:`tile_adam_reference`) or a Pallas kernel whose grid runs over the active
tiles only (:mod:`magma_optax.kernels.tiles.pallas`). The update comes back compact;
the caller expands it to the leaf.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from magma_optax.kernels import dispatch
from magma_optax.kernels import reference


class TileAdamOutput(NamedTuple):
  """What :func:`tile_adam` returns: the new compact moments and update.

  Attributes:
    mu: new first moments ``(K, r, c)`` (the input moment's dtype).
    nu: new second moments ``(K, r, c)``.
    update: ``(K, r, c)`` compact update (the gradient's dtype), 0 in empty slots
      whose moments are 0.
  """

  mu: jax.Array
  nu: jax.Array
  update: jax.Array


def tile_view(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
  """``(rows, r, cols, c)``: a leaf of ``shape`` seen as a grid of ``block`` tiles."""
  r, c = block
  if len(shape) < 2 or shape[-2] % r or shape[-1] % c:
    raise ValueError(
      f"a leaf of shape {tuple(shape)} is not made of {r}x{c} tiles: it needs >= 2"
      f" axes, the last two multiples of ({r}, {c})."
    )
  lead = 1
  for n in shape[:-2]:
    lead *= n
  return (lead * (shape[-2] // r), r, shape[-1] // c, c)


def gather_tiles(g4: jax.Array, tile_index: jax.Array) -> jax.Array:
  """The tiles ``tile_index`` of ``g4`` (a :func:`tile_view`), 0 for empty slots."""
  rows, _, cols, _ = g4.shape
  # An empty slot's index (the tile count) is clamped to a tile, then zeroed by a
  # select that XLA fuses into the reader; a gather with mode="fill" checks every
  # index's bounds in a computation of its own (a launch per leaf on XLA:CPU).
  tiles = g4.at[tile_index // cols, :, tile_index % cols, :].get(
    mode="clip", indices_are_sorted=True
  )
  stored = (tile_index < rows * cols)[:, None, None]
  return jnp.where(stored, tiles, jnp.zeros((), g4.dtype))


def tile_adam_reference(g4, mu, nu, tile_index, hyper) -> TileAdamOutput:
  """The XLA path: gather, then :func:`reference.tile_adam` (the same contract as
  :func:`magma_optax.kernels.tiles.pallas.tile_adam_pallas`)."""
  g = gather_tiles(g4, tile_index)
  new_m, new_v, u = reference.tile_adam(g, mu, nu, None, None, hyper)
  return TileAdamOutput(
    new_m.astype(mu.dtype), new_v.astype(nu.dtype), u.astype(g4.dtype)
  )


def pallas_backend(block, dtypes, interpret: bool | str = False) -> str:
  """The backend ``implementation="pallas"`` runs for these tiles.

  :func:`dispatch.pallas_backend`, except that on a Hopper GPU (not in its interpreter)
  Triton runs tiles that the Mosaic GPU tile kernel cannot.
  """
  from magma_optax.kernels.tiles import pallas as pallas_tiles  # noqa: PLC0415  Pallas on demand

  backend = dispatch.pallas_backend(interpret)
  if (
    backend == "mosaic_gpu"
    and interpret != "gpu"
    and pallas_tiles.why_unavailable(block, dtypes, backend) is not None
  ):
    return "triton"
  return backend


def why_unavailable(
  implementation: str, *, block, dtypes, interpret: bool | str = False
) -> str | None:
  """``None`` if ``implementation`` can run these tiles here, else why not."""
  dispatch.check_implementation(implementation)
  if implementation == "xla":
    return None
  reason = dispatch.device_reason(interpret)
  if reason is not None:
    return reason
  from magma_optax.kernels.tiles import pallas as pallas_tiles  # noqa: PLC0415  Pallas on demand

  backend = pallas_backend(block, dtypes, interpret)
  return pallas_tiles.why_unavailable(block, dtypes, backend)


def resolve_implementation(
  implementation: str | Sequence[str] | None,
  *,
  block: tuple[int, int],
  dtypes: Sequence[Any],
  interpret: bool | str = False,
) -> str:
  """The implementation :func:`tile_adam` will run (``ValueError`` as
  :func:`dispatch.resolve_implementation`)."""
  interpret = dispatch.check_interpret(interpret)
  return dispatch.first_available(
    implementation,
    lambda impl: why_unavailable(impl, block=block, dtypes=dtypes, interpret=interpret),
  )


def tile_adam(
  grad: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
  tile_index: jax.Array,
  *,
  count: Any,
  learning_rate: Any,
  b1: Any = 0.9,
  b2: Any = 0.999,
  eps: Any = 1e-8,
  eps_root: Any = 0.0,
  implementation: str | Sequence[str] | None = None,
  interpret: bool | str = False,
) -> TileAdamOutput:
  r"""One Adam step on the active tiles of a leaf (see the module docstring).

  Args:
    grad: the gradient, the whole leaf ``(..., R, C)``.
    mu: compact first moments ``(K, r, c)``: the tile shape is ``(r, c)``.
    nu: compact second moments, ``mu``'s shape.
    tile_index: int32 ``(K,)``, the tile in each slot, sorted; the number of
      tiles (``R / r * C / c`` times the leading axes) marks an empty slot.
    count: the step t >= 1 for bias correction (the incremented count).
    learning_rate: scalar (traced values are fine).
    b1, b2, eps, eps_root: Adam's decay rates and epsilons, scalars (traced
      values are fine: the kernels read them at run time).
    implementation: ``"xla"``, ``"pallas"``, a sequence to try in order, or
      ``None`` (``DEFAULT_IMPLEMENTATIONS``).
    interpret: as in :func:`magma_optax.kernels.masked_adam` (CPU tests only).

  Returns:
    A :class:`TileAdamOutput`.

  Raises:
    ValueError: for shapes that do not fit together, or an explicitly requested
      implementation that cannot run here (naming why).

  Example:
    >>> import jax.numpy as jnp
    >>> from magma_optax.kernels.tiles import api as tiles
    >>> g = jnp.ones((4, 8)); m = jnp.zeros((2, 2, 4)); v = jnp.zeros((2, 2, 4))
    >>> # tiles of 2 x 4: the leaf has 4; slot 0 holds tile 3, slot 1 is empty.
    >>> out = tiles.tile_adam(g, m, v, jnp.array([3, 4], jnp.int32), count=1,
    ...                       learning_rate=1e-3)
    >>> round(float(out.update[0, 0, 0]), 6)  # -lr * m_hat / (sqrt(v_hat) + eps)
    -0.001
    >>> bool((out.update[1] == 0).all())  # the empty slot
    True
  """
  if mu.ndim != 3 or mu.shape != nu.shape:
    raise ValueError(
      f"mu and nu must be compact tiles of one shape (K, r, c); got {mu.shape},"
      f" {nu.shape}."
    )
  if tile_index.shape != mu.shape[:1] or not jnp.issubdtype(
    tile_index.dtype, jnp.integer
  ):
    raise ValueError(
      f"tile_index must be an integer vector of the {mu.shape[0]} slots; got"
      f" {tile_index.dtype}{list(tile_index.shape)}."
    )
  block = tuple(mu.shape[1:])
  view = tile_view(grad.shape, block)
  interpret = dispatch.check_interpret(interpret)
  dtypes = (grad.dtype, mu.dtype, nu.dtype)
  impl = resolve_implementation(
    implementation, block=block, dtypes=dtypes, interpret=interpret
  )
  constants = reference.AdamConstants(b1, b2, eps, eps_root)
  hyper = reference.hyperparams(count, learning_rate, 0.0, constants)
  g4 = grad.reshape(view)
  tile_index = tile_index.astype(jnp.int32)
  if impl == "xla":
    return tile_adam_reference(g4, mu, nu, tile_index, hyper)
  from magma_optax.kernels.tiles import pallas as pallas_tiles  # noqa: PLC0415  Pallas on demand

  new_m, new_v, u = pallas_tiles.tile_adam_pallas(
    g4, mu, nu, tile_index, hyper,
    backend=pallas_backend(block, dtypes, interpret), interpret=bool(interpret),
  )  # fmt: skip
  return TileAdamOutput(new_m, new_v, u)
