"""Tests for the init-time check of periodic_mask's masks against compact storage.

``periodic_mask``'s init checks the storage of the transform inside it against the
densest mask each leaf will get (``_mask_bounds.MaskBound``: all-active before
``start`` and at the start of a ramp, the top-k count of the first refresh, the
tiles, the N:M groups) and raises, before any step, the ``ValueError`` that a step
would where that mask certainly cannot be stored. The reference is the first step
of the same composition with the init check switched off: it must fail exactly
where init raises, with the same message where the count is the one init knew.
"""

import re
from unittest import mock

import jax
import jax.numpy as jnp
import optax
import pytest

import magma_optax as magma
from magma_optax._core import mask_bounds as _mask_bounds

LR = 0.05
_keys = jax.random.split(jax.random.key(0), 6)
PARAMS = {
  "b": jax.random.normal(_keys[0], (256,)),
  "v": jax.random.normal(_keys[1], (16, 256)),
  "w": jax.random.normal(_keys[2], (16, 512)),
}
GRADS = {
  k: jax.random.normal(_keys[3 + i], x.shape) for i, (k, x) in enumerate(PARAMS.items())
}


def matrices(path, x):
  del path
  return x.ndim == 2


def tiles(**kw):
  kw = {"density": 0.3, "block": (8, 128), "where": matrices, **kw}
  return magma.sparse_adam(LR, mode="compact", **kw)


def flat(**kw):
  return magma.sparse_state(optax.adam(LR), mode="compact", **kw)


def multi_steps(inner):
  # MultiSteps.gradient_transformation() is a plain GradientTransformation, which
  # drops extra arguments (param_mask): its init and update take and pass them.
  ms = optax.MultiSteps(inner, every_k_schedule=2)
  return optax.GradientTransformationExtraArgs(ms.init, ms.update)


TILED = {"block": (8, 128), "where": matrices}
# name: (inner, periodic_mask arguments, the init error (a regex) or None, whether
# the first step's message is the same). Tiles of 8x128: "w" has 8 (capacity 3 at
# density 0.3), "v" 4 (capacity 2); with shards=(2, 2) 2 and 1 per part (capacity 1).
CASES = {
  "tiles fit": (tiles(), {"sparsity": 0.7, **TILED}, None, True),
  "tiles overflow": (
    tiles(),
    {"sparsity": 0.5, **TILED},
    r"leaf \['w'\] \(8 tiles of 8x128\) has 4 active tiles.*first refresh, at step"
    r" 0, targets sparsity 0.5, which keeps 4 of 8 8x128 tiles\.",
    True,
  ),
  "ramp": (
    tiles(),
    {"sparsity": 0.7, "schedule": "cubic", "end": 6, **TILED},
    r"\['v'\] \(4 tiles of 8x128\) has 4 active.*its cubic ramp starts there",
    True,
  ),
  "start": (
    tiles(),
    {"sparsity": 0.7, "start": 1, **TILED},
    r"has 4 active tiles.*periodic_mask\(start=1\) passes an all-active mask",
    True,
  ),
  "entries into tiles": (
    tiles(),
    {"sparsity": 0.7, "where": matrices},
    r"\['v'\] will be made of entries \(1229 active entries, not a multiple of"
    r" 1024\), not of the whole 8x128 tiles",
    False,
  ),
  "1x128 tiles into 8x128": (
    tiles(),
    {"sparsity": 0.7, "block": (1, 128), "where": matrices},
    r"made of 1x128 tiles \(1280 active entries, not a multiple of 1024\)",
    False,
  ),
  "2x2 tiles per part into 2x4": (
    tiles(block=(2, 4), shards=(2, 1), density=1.0, density_threshold=1.0),
    {"sparsity": 0.499, "block": (2, 2), "shards": (2, 1), "where": matrices},
    r"leaf \['v'\] will be made of 2x2 tiles \(1028 active entries in each of its"
    r" 2x1 shard parts, not a multiple of 8\)",
    False,  # the step names the first tile that is not whole
  ),
  "8x128 tiles into 1x128": (
    tiles(block=(1, 128)),
    {"sparsity": 0.7, **TILED},
    None,
    True,
  ),
  "entries overflow": (
    flat(density=0.2),
    {"sparsity": 0.7},
    r"leaf \['b'\] \(size 256\) has 77 active entries.*keeps 77 of 256 entries\.",
    True,
  ),
  "entries fit": (flat(density=0.3), {"sparsity": 0.7}, None, True),
  "a leaf without a mask": (
    flat(density=0.3),
    {"sparsity": 0.7, "where": matrices},
    r"leaf 0 \(\['b'\]\) uses compact storage but param_mask has no mask.*passes"
    r" it no mask",
    True,
  ),
  "global share overflow": (
    flat(density=0.3),
    {"sparsity": 0.05, "ranking": "global"},
    r"leaf \['v'\] \(size 4096\) has at least 3469 active entries.*keeps 11917 of"
    r" all 12544"
    r" entries together: at least 3469 of this leaf's 4096",
    False,  # the step counts what the top-k gave it, >= 3469
  ),
  "n:m overflow": (
    flat(structure=(1, 4)),
    {"structure": (2, 4)},
    r"a group of 4 entries has 2 active but structure=\(1, 4\) stores 1",
    True,
  ),
  "n:m fit": (flat(structure=(2, 4)), {"structure": (2, 4)}, None, True),
  "2:4 into 2:8": (
    flat(structure=(2, 8)),
    {"structure": (2, 4)},
    r"a group of 8 entries has 4 active but structure=\(2, 8\) stores 2",
    True,
  ),
  "entries into n:m": (
    flat(structure=(2, 4)),
    {"sparsity": 0.25},
    r"has at least 3 active but structure=\(2, 4\) stores 2 \(leaf \['b'\]",
    False,  # init names the mean of a group, the step its fullest
  ),
  "n:m start": (
    flat(structure=(2, 4)),
    {"structure": (2, 4), "start": 2},
    r"a group of 4 entries has 4 active",
    True,
  ),
  "parts fit": (
    tiles(shards=(2, 2)),
    {"sparsity": 0.5, "shards": (2, 2), **TILED},
    None,
    True,
  ),
  "parts overflow": (
    tiles(shards=(2, 2)),
    {"sparsity": 0.2, "shards": (2, 2), **TILED},
    r"each of the 2x2 shard parts of leaf \['w'\] \(2 tiles of 8x128\) has 2 active",
    False,  # the step names the part
  ),
  "wrapped inner": (
    multi_steps(
      optax.chain(
        optax.clip(1.0),
        optax.masked(
          flat(density=0.2), lambda p: jax.tree.map(lambda x: x.ndim == 2, p)
        ),
      )
    ),
    {"sparsity": 0.7},
    r"leaf \['v'\] \(size 4096\) has 1229 active entries",
    True,
  ),
}


def first_step_error(inner, kwargs):
  """The message of the ValueError that the first step raises with the init check
  switched off, or None. The step is jitted (one compile, not an eager op at a
  time): an error found while tracing is a ValueError, one found by the step's
  check comes through the runtime -- what init spares."""
  tx = magma.periodic_mask(inner, every=3, **kwargs)
  with mock.patch.object(_mask_bounds, "check_init", lambda *args: None):
    state = tx.init(PARAMS)
  try:
    jax.block_until_ready(jax.jit(tx.update)(GRADS, state, PARAMS))
  except ValueError as e:
    return str(e)
  except jax.errors.JaxRuntimeError as e:  # raised inside a traced step (a cond)
    return re.search(r"ValueError: (.*)", str(e)).group(1)
  return None


@pytest.mark.parametrize("name", list(CASES))
def test_init_raises_where_the_first_step_fails(name):
  inner, kwargs, expected, same = CASES[name]
  tx = magma.periodic_mask(inner, every=3, **kwargs)
  if expected is None:
    tx.init(PARAMS)
    if name == "8x128 tiles into 1x128":  # (the other steps run in other modules)
      assert first_step_error(inner, kwargs) is None
    return
  step_error = first_step_error(inner, kwargs)
  with pytest.raises(ValueError, match=expected) as raised:
    tx.init(PARAMS)
  assert step_error is not None
  problem, _ = str(raised.value).split(" Found at init, before any step: ")
  if same:
    assert problem == step_error
  if name in ("ramp", "parts overflow", "n:m overflow"):  # also where init is traced
    with pytest.raises(ValueError, match=expected):
      jax.jit(tx.init)(PARAMS)


def test_what_init_cannot_know_is_left_to_the_step():
  # A global top-k shares the kept count out by value: where no leaf is certain to
  # overflow, nothing at init, whatever the step finds (here all of it in "a").
  params = {"a": jnp.full((64,), 10.0), "b": jnp.full((64,), 0.1)}
  tx = magma.periodic_mask(flat(density=0.3), sparsity=0.5, every=3, ranking="global")
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"leaf \['a'\] \(size 64\) has 64 active"):
    tx.update(params, state, params)
  # An entry mask with a multiple of r * c entries may be whole r x c tiles: here it
  # is (the two large tiles win), and the run works.
  w = jnp.full((4, 4), 0.01).at[:2, :2].set(5.0).at[2:, 2:].set(4.0)
  inner = tiles(block=(2, 2), density=0.5, density_threshold=1.0, where=None)
  tx = magma.periodic_mask(inner, sparsity=0.5, every=3)
  state = tx.init({"w": w})
  u, _ = jax.jit(tx.update)({"w": jnp.ones((4, 4))}, state, {"w": w})
  assert int((u["w"] == -w).sum()) == 8  # two tiles pruned, two stepped
  # A traced target (inject_hyperparams under jit): nothing known, nothing raised.
  inject = optax.inject_hyperparams(
    magma.periodic_mask, static_args=("every", "start", "end", "axis", "where")
  )
  injected = inject(flat(density=0.2), sparsity=0.7, every=3)
  jax.jit(injected.init)(PARAMS)
  with pytest.raises(ValueError, match="has 77 active"):  # a concrete one: known
    injected.init(PARAMS)
  # A target of 0 prunes nothing: entry masks are whole tiles then, known or not.
  for density, expected in (
    (0.5, r"\['v'\] \(4 tiles of 8x128\) has 4 active"),
    (1.0, None),
  ):
    inner = tiles(density=density, density_threshold=1.0)
    jax.jit(inject(inner, sparsity=0.0, every=3, where=matrices).init)(PARAMS)
    tx = magma.periodic_mask(inner, sparsity=0.0, every=3, where=matrices)
    if expected is None:
      tx.init(PARAMS)
    else:
      with pytest.raises(ValueError, match=expected):
        tx.init(PARAMS)
  assert first_step_error(inner, {"sparsity": 0.0, "where": matrices}) is None


def test_a_bound_is_for_its_leaf_and_a_promise_for_its_mask_array():
  bound = _mask_bounds.MaskBound((2, 2), "test", 4)
  assert bound.all_active
  assert not bound._replace(exact=False).all_active
  # At init: a storage is matched to the wrapper's leaf by tree structure. Here
  # leaf "['w']" of the storage's tree is the wrapper's leaf 1 ("['w']"), and a
  # bound of all 4 entries overflows its capacity of 1.
  params = {"v": jnp.ones((2, 2)), "w": jnp.ones((2, 2))}
  inner = magma.sparse_state(optax.adam(LR), mode="compact", density=0.25)
  state = inner.init(params)
  params_def = jax.tree.structure(params)
  with pytest.raises(ValueError, match=r"leaf \['w'\] \(size 4\) has 4.*Found at init"):
    _mask_bounds.check_init(state, params_def, [None, bound])
  _mask_bounds.check_init(state, params_def, [None, None])  # no bound: nothing
  # A storage given another tree (a subtree) gets no bound.
  sub = inner.init({"w": jnp.ones((2, 2))})
  _mask_bounds.check_init(sub, params_def, [None, bound])
  # At update: a promise is of the very mask array passed, of the bound's shape.
  m, same_values = jnp.ones((2, 2), bool), jnp.ones((2, 2), bool)
  promises = _mask_bounds.MaskPromises(((m, bound._replace(always=True)),))
  assert promises.bound_of(m) is promises.pairs[0][1]
  assert promises.bound_of(same_values) is None  # another array
  assert _mask_bounds.MaskPromises(((m, bound),)).bound_of(m) is None  # not always


def test_a_wrapper_that_hands_on_a_subtree_gets_no_bound():
  # The storage sees params["enc"]: its leaf "['w']" is not periodic_mask's
  # "['w']" (unscoped there, of the same shape), so nothing is checked at init.
  def on_enc(inner):
    inner = optax.with_extra_args_support(inner)

    def update(u, s, params=None, param_mask=None, **extra):
      u_enc, s = inner.update(
        u["enc"], s, params["enc"], param_mask=param_mask["enc"], **extra
      )
      return {**u, "enc": u_enc}, s

    return optax.GradientTransformationExtraArgs(
      lambda params: inner.init(params["enc"]), update
    )

  params = {"w": jnp.ones((4, 4)), "enc": {"w": jnp.arange(1.0, 17.0).reshape(4, 4)}}
  in_enc = lambda path, x: "enc" in jax.tree_util.keystr(path)  # noqa: E731
  tx = magma.periodic_mask(
    on_enc(flat(density=0.5)), sparsity=0.5, every=3, where=in_enc
  )
  state = tx.init(params)
  u, _ = tx.update(params, state, params)
  assert int((u["enc"]["w"] == 0).sum()) == 0  # 8 stepped, 8 pruned (-p, p != 0)
