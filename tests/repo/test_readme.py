"""The recipes of the README and the guides run as written: each test takes a
Python block from README.md or docs/*.md (found by a line it holds) and runs it."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax

import magma_optax as magma

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _block(holding: str) -> str:
  """The one Python block of README.md or docs/*.md that holds the line
  ``holding``, dedented."""
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
  blocks = []
  for page in pages:
    blocks += re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
  found = [b for b in blocks if holding in b]
  assert len(found) == 1, f"{len(found)} blocks of the docs hold {holding!r}"
  return textwrap.dedent(found[0])


def test_the_vmap_ensemble_recipe_gives_each_member_its_key():
  scope = {}
  exec(_block("# vmap ensemble: a key per member"), scope)  # noqa: S102
  keys, params, grads = scope["keys"], scope["params"], scope["grads"]
  updates = scope["updates"]
  # Each member equals the same optimizer run alone with its key.
  for i in range(4):
    tx = magma.magma(optax.adam(1e-3), key=keys[i])
    member = lambda x, i=i: x[i]
    p, g = jax.tree.map(member, params), jax.tree.map(member, grads)
    want, _ = tx.update(g, tx.init(p), p)
    np.testing.assert_allclose(updates["w"][i], want["w"], rtol=1e-6, atol=0)
  # The members' masks differ: 4 keys, elementwise blocks would tell them apart;
  # at the tensor level the keys themselves must be the members'.
  state_keys = jax.random.key_data(scope["opt_state"].mask_state.key)
  assert len({tuple(np.asarray(k)) for k in state_keys}) == 4
  np.testing.assert_array_equal(state_keys, jax.random.key_data(keys))


def test_the_sharding_snippet_runs_on_an_explicit_mesh():
  # docs/scale.md's snippet on 8 CPU devices: Explicit axes, one compile for
  # repeated steps, the moments sharded like the parameters.
  check = textwrap.dedent("""
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,) * 2
    params, opt_state = step(params, opt_state, jax.tree.map(jnp.ones_like, params))
    assert step._cache_size() == 1
    spec = opt_state.inner_state[0].mu["w"].sharding.spec
    assert spec == P(None, "model"), spec
    print("ok")
  """)
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  env["PYTHONPATH"] = str(ROOT)
  run = subprocess.run(
    [sys.executable, "-c", _block("jax.make_mesh(") + check],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.strip().endswith("ok"), run.stdout


def test_keys_per_member_inside_vmap_are_used_by_the_draws():
  # Positive control for the recipe's claim: with per-member keys the masks of
  # identical members differ; with one key they are identical.
  params = {"w": jnp.ones((4, 64))}
  grads = {"w": jnp.ones((4, 64))}
  tx = magma.skip_update(optax.sgd(1.0), keep_prob=0.5, granularity="element")
  for keys, distinct in (
    (jax.random.split(jax.random.key(0), 4), True),
    (jnp.stack([jax.random.key(0)] * 4), False),
  ):
    init = jax.vmap(
      lambda k, p: magma.skip_update(
        optax.sgd(1.0), keep_prob=0.5, granularity="element", key=k
      ).init(p)
    )
    updates, _ = jax.vmap(tx.update)(grads, init(keys, params), params)
    rows = {tuple(np.asarray(u) != 0) for u in updates["w"]}
    assert (len(rows) == 4) == distinct


def test_the_quick_start_installs_what_each_command_needs():
  # The demo needs the demo extra (flax, matplotlib), not the test extras.
  text = (ROOT / "README.md").read_text()
  quick = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```")[0]
  lines = [line for line in quick.splitlines() if "pip install" in line]
  demo = [line for line in lines if "magma_optax.demo" in line]
  tests = [line for line in lines if "pytest" in line]
  assert len(demo) == 1 and '".[demo]"' in demo[0], demo
  assert len(tests) == 1 and '".[test]"' in tests[0], tests
