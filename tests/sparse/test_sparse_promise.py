"""Tests for the masks that periodic_mask promises to compact sparse storage.

Where ``periodic_mask`` ranks per leaf with a constant Python number for
``sparsity`` (or with N:M ``structure``), every mask it hands a leaf has at most
the first refresh's count, made of its tiles or N:M groups. It promises that
(``MaskBound.always``) of the very mask arrays it passes, and ``sparse_state`` /
``sparse_adam`` then handle their checks in the step as ``on_error="record"``
does, with no host callback (one in the compiled step makes XLA:CPU run every step
synchronously), and read only each tile's first entry of a tile mask. Only a state
edited by hand can break the promise; the leaf is then left on its stored set (an
entry edited inside a tile is not seen: its tile's first entry decides).
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import magma_optax as magma
from magma_optax._core import mask_bounds as _mask_bounds
from magma_optax.sparse.compact import Compact
from magma_optax.sparse.nm import Grouped
from magma_optax.sparse.nm import Groups
from magma_optax.sparse.tiles import Tiles

LR = 0.05
BLOCK = (2, 4)
SHAPE = (8, 16)  # 16 tiles of 2x4
MATRICES = lambda path, x: x.ndim == 2  # noqa: E731


def params_of(key=0):
  k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
  return {
    "w": jax.random.normal(k1, SHAPE),
    "v": jax.random.normal(k2, SHAPE),
    "b": jax.random.normal(k3, (16,)),
  }


def adam_sparse(**kw):
  return magma.sparse_state(optax.adam(LR), mode="compact", where=MATRICES, **kw)


def adam_fused(**kw):
  return magma.sparse_adam(LR, mode="compact", where=MATRICES, **kw)


def pruned(inner, **kw):
  kw.setdefault("every", 2)
  return magma.periodic_mask(inner, where=MATRICES, **kw)


# name: the transform; every one keeps at most 4 of the 16 tiles (or entries at
# sparsity 0.75, or 2 of each 4) per leaf and stores exactly that.
PROMISED = {
  "sparse_adam tiles": lambda: pruned(
    adam_fused(density=0.25, block=BLOCK), sparsity=0.75, block=BLOCK
  ),
  "sparse_state tiles": lambda: pruned(
    adam_sparse(density=0.25, block=BLOCK), sparsity=0.75, block=BLOCK
  ),
  "1x4 storage of 2x4 tiles": lambda: pruned(
    adam_fused(density=0.25, block=(1, 4)), sparsity=0.75, block=BLOCK
  ),
  "sparse_adam tiles, shards=(2, 2)": lambda: pruned(
    adam_fused(density=0.25, block=BLOCK, shards=(2, 2)),
    sparsity=0.75,
    block=BLOCK,
    shards=(2, 2),
  ),
  "flat": lambda: pruned(adam_sparse(density=0.25), sparsity=0.75),
  "flat, cache_index=False": lambda: pruned(
    adam_sparse(density=0.25, cache_index=False), sparsity=0.75
  ),
  "N:M 2:4": lambda: pruned(adam_sparse(structure=(2, 4)), structure=(2, 4)),
  "offload tiles": lambda: pruned(
    magma.sparse_state(
      optax.adam(LR), mode="offload", density=0.25, block=BLOCK, where=MATRICES
    ),
    sparsity=0.75,
    block=BLOCK,
  ),
}

# Masks the wrapper cannot promise: the step keeps its host callback.
NOT_PROMISED = {
  "global ranking": lambda: pruned(
    adam_fused(density=0.5, block=BLOCK), sparsity=0.75, block=BLOCK, ranking="global"
  ),
  "a schedule for sparsity": lambda: pruned(
    adam_fused(density=0.25, block=BLOCK),
    sparsity=optax.constant_schedule(0.75),
    block=BLOCK,
  ),
  "entries into tile storage": lambda: pruned(
    adam_fused(density=0.25, block=BLOCK), sparsity=0.75
  ),
  "1x4 tiles into 2x4 storage": lambda: pruned(
    adam_fused(density=0.25, block=BLOCK), sparsity=0.75, block=(1, 4)
  ),
}


@contextlib.contextmanager
def unpromised():
  """Steps traced inside see no promise: every check goes through the host."""
  saved = _mask_bounds.MaskPromises.bound_of
  _mask_bounds.MaskPromises.bound_of = lambda self, mask: None
  try:
    yield
  finally:
    _mask_bounds.MaskPromises.bound_of = saved


def program(tx, params):
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  return step.lower(params, tx.init(params), params).as_text()


@pytest.mark.parametrize("case", list(PROMISED))
def test_promised_masks_compile_no_host_callback(case):
  assert "callback" not in program(PROMISED[case](), params_of())
  with unpromised():  # the control: these storages do check the masks
    assert "callback" in program(PROMISED[case](), params_of())


@pytest.mark.parametrize("case", list(NOT_PROMISED))
def test_masks_not_promised_keep_the_host_callback(case):
  assert "callback" in program(NOT_PROMISED[case](), params_of())


def test_inject_hyperparams_promises_only_a_static_sparsity():
  def inject(**static):
    return optax.inject_hyperparams(magma.periodic_mask, **static)(
      adam_fused(density=0.25, block=BLOCK),
      sparsity=0.75,
      block=BLOCK,
      every=2,
      where=MATRICES,
    )

  params = params_of()
  fixed = ("sparsity", "block", "every", "start", "axis", "where")
  assert "callback" not in program(inject(static_args=fixed), params)
  # A traced sparsity: the counts are known in the step only.
  assert "callback" in program(inject(static_args=fixed[1:]), params)


class _Fresh:
  """A wrapper that hands its inner transform new mask arrays (equal values)."""

  def __init__(self, inner):
    self.inner = inner

  def init(self, params):
    return self.inner.init(params)

  def update(self, updates, state, params=None, *, param_mask, **extra):
    masks = jax.tree.map(lambda m: m | jnp.zeros_like(m), param_mask)
    return self.inner.update(updates, state, params, param_mask=masks, **extra)


def test_a_wrapper_that_makes_new_masks_gets_no_promise():
  inner = _Fresh(adam_fused(density=0.25, block=BLOCK))
  tx = magma.periodic_mask(
    optax.GradientTransformationExtraArgs(inner.init, inner.update),
    sparsity=0.75,
    block=BLOCK,
    every=2,
    where=MATRICES,
  )
  assert "callback" in program(tx, params_of())


def run(tx, steps, params, promise=True):
  """Updates and states of ``steps`` jitted steps from ``params``; without
  ``promise``, as the step was before promises (every check through the host)."""
  with contextlib.nullcontext() if promise else unpromised():
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    state = tx.init(params)
    out = []
    for k in range(steps):
      grads = jax.tree.map(
        lambda x, k=k: jax.random.normal(jax.random.key(k), x.shape), params
      )
      u, state = step(grads, state, params)
      params = optax.apply_updates(params, u)
      out.append((u, state))
    return out


def leaves(tree):
  is_state = lambda x: isinstance(x, magma.SparseState)  # noqa: E731
  tree = jax.tree.map(
    lambda x: x._replace(errors=optax.MaskedNode()) if is_state(x) else x,
    tree,
    is_leaf=is_state,
  )
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("case", list(PROMISED))
def test_promised_steps_equal_the_checked_ones(case):
  # Refreshes every 2 steps (tiles move, moments are remapped and reset).
  params = params_of(1)
  got = run(PROMISED[case](), 5, params)
  want = run(PROMISED[case](), 5, params, promise=False)
  for a, b in zip(leaves(got), leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)


def edited(state, leaf, mask):
  """``state`` of ``periodic_mask`` with the mask of ``leaf`` replaced."""
  return state._replace(mask={**state.mask, leaf: mask})


def refreshed_once(**kw):
  """Tile storage in periodic_mask, whose only refresh is at step 0 (end=0)."""
  return magma.periodic_mask(
    adam_fused(density=0.25, block=BLOCK, **kw),
    sparsity=0.75,
    block=BLOCK,
    every=1,
    end=0,
    where=MATRICES,
  )


def test_a_state_edited_against_the_promise_leaves_the_leaf_as_it_was():
  # Past its last refresh (end=0), a mask of 8 tiles -- twice the capacity -- is
  # handed to the storage: the promise is broken. As with on_error="record", the
  # leaf keeps its stored tiles (its moments step there, as with the mask it had)
  # and gets no update inside the edited mask (outside it periodic_mask zeroes the
  # weights); the other leaf steps as usual.
  make = refreshed_once
  params = params_of(2)
  grads = jax.tree.map(lambda x: x + 1.0, params)
  dense = jnp.zeros(SHAPE, bool).at[:4, :].set(True)  # 8 of 16 tiles
  for on_error in ("raise", "record"):
    tx = make(on_error=on_error)
    step = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p))
    _, state = step(grads, tx.init(params), params)  # the refresh at step 0
    u, after = step(grads, edited(state, "w", dense), params)
    u_ref, ref = step(grads, state, params)  # the mask it had: its stored tiles
    np.testing.assert_array_equal(np.asarray(u["w"])[:4], 0.0)
    np.testing.assert_array_equal(np.asarray(u["w"])[4:], -np.asarray(params["w"])[4:])
    assert np.any(np.asarray(u_ref["w"])[:4] != 0)  # control: the zeros mean it
    np.testing.assert_array_equal(np.asarray(u["v"]), np.asarray(u_ref["v"]))
    for a, b in zip(leaves(after.inner_state), leaves(ref.inner_state), strict=True):
      np.testing.assert_array_equal(a, b)
    if on_error == "record":  # recorded as any failed check is
      with pytest.raises(ValueError, match="8 active tiles"):
        magma.check_sparse_state(after)
  # The control: the same step with every check through the host fails.
  with unpromised():
    tx = make()
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    _, state = step(grads, tx.init(params), params)
    with pytest.raises(Exception, match="8 active tiles"):
      jax.block_until_ready(step(grads, edited(state, "w", dense), params))


def test_a_promised_tile_mask_is_read_by_its_tiles_first_entries():
  # Promised masks are whole tiles: the step reads each tile's first entry only
  # (on a 72-leaf tree the full check cost 0.17x of an Adam step). So an entry
  # edited by hand inside an active tile (not its first) is no error: the tile
  # stays stored and steps as before, and periodic_mask prunes the entry.
  make = functools.partial(refreshed_once, on_error="record")
  params = params_of(3)
  grads = jax.tree.map(lambda x: x + 1.0, params)
  tx = make()
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  _, state = step(grads, tx.init(params), params)  # the refresh at step 0
  mask = np.asarray(state.mask["w"])
  i, j = np.argwhere(mask)[0]  # the first entry of an active tile
  assert i % BLOCK[0] == 0 and j % BLOCK[1] == 0
  holed = jnp.asarray(mask).at[i + 1, j + 1].set(False)
  u, after = step(grads, edited(state, "w", holed), params)
  u_ref, ref = step(grads, state, params)
  magma.check_sparse_state(after.inner_state)  # nothing recorded
  want = np.asarray(u_ref["w"]).copy()
  want[i + 1, j + 1] = -np.asarray(params["w"])[i + 1, j + 1]
  np.testing.assert_array_equal(np.asarray(u["w"]), want)
  for a, b in zip(leaves(after.inner_state), leaves(ref.inner_state), strict=True):
    np.testing.assert_array_equal(a, b)
  # The control: unpromised, the same mask is read in full and fails.
  with unpromised():
    tx = make()
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    _, state = step(grads, tx.init(params), params)
    _, after = step(grads, edited(state, "w", holed), params)
    with pytest.raises(ValueError, match="not made of whole 2x4 tiles"):
      magma.check_sparse_state(after.inner_state)


@pytest.mark.parametrize(
  ("storage", "bound", "suffices"),
  [
    # Tiles: whole tiles of the storage's block, and at most its capacity.
    ("tiles", dict(entries=32, block=(2, 4), tiles=4), True),
    ("tiles", dict(entries=40, block=(2, 4), tiles=5), False),  # over capacity
    ("tiles", dict(entries=32, block=(1, 4), tiles=8), False),  # not whole tiles
    ("tiles", dict(entries=32, block=None, tiles=None), False),  # entries
    ("tiles", dict(entries=32, block=(2, 4), tiles=4, exact=False), False),
    ("tiles", dict(entries=128, block=(2, 4), tiles=16), False),  # all active
    # Storage that holds every tile: any mask of whole tiles fits, but an
    # all-active bound of other tiles (masks before `start`) is followed by masks
    # that are not whole tiles of this block.
    ("all tiles", dict(entries=128, block=(2, 4), tiles=16), True),
    ("all tiles", dict(entries=128, block=(1, 4), tiles=32), False),
    ("all tiles", dict(entries=128, block=None, tiles=None), False),
    ("flat", dict(entries=32), True),
    ("flat", dict(entries=33), False),
    ("flat", dict(entries=None), False),
    ("N:M", dict(entries=64, structure=(2, 4)), True),
    ("N:M", dict(entries=64, structure=(1, 2)), True),  # 2 of each 4 as well
    ("N:M", dict(entries=96, structure=(3, 4)), False),
    ("N:M", dict(entries=64, structure=(2, 4), axis=0), False),  # other groups
    ("N:M", dict(entries=64, structure=None), False),
  ],
)
def test_which_bounds_suffice_for_a_storage(storage, bound, suffices):
  # The step's checks cannot fail for any mask within the bound exactly when
  # bound_suffices says so; the storages keep 32 of the 128 entries here (N:M 2:4
  # along the last axis: 64; "all tiles": all 128).
  shape = SHAPE
  make = {
    "tiles": lambda: Tiles(shape, "w", BLOCK, 4, "4"),
    "all tiles": lambda: Tiles(shape, "w", BLOCK, 16, "16"),
    "flat": lambda: Compact(shape, "w", 32, "32"),
    "N:M": lambda: Grouped(shape, "w", Groups(shape, 1, 2, 4)),
  }[storage]
  kw = dict(bound)
  if storage == "N:M" and kw.get("structure") is not None:
    kw.setdefault("axis", 1)
  got = make().bound_suffices(_mask_bounds.MaskBound(shape, "test", always=True, **kw))
  assert got is suffices
