"""The docs site builds offline with warnings as errors and documents every public name.

Builds ``docs/`` into a temporary folder with ``python -m sphinx -W`` (the README's
command), with every proxy pointed at a closed local port so that any fetch from the
network fails the build, and reads the HTML back: each name a public module exports
must have an entry in the API reference, each notebook a rendered page. Also: the
code blocks of the README and the guides run, the README's test command is the one
``.ci/run`` runs, and the prose files keep the sizes a newcomer can read.
"""

import importlib
import inspect
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")
pytest.importorskip("flax")  # the API reference documents magma_optax.flax too

from magma_optax._core import compat as _compat

ROOT = pathlib.Path(__file__).resolve().parents[2]
PUBLIC_MODULES = (
  "magma_optax",
  "magma_optax.sharding",
  "magma_optax.kernels",
  "magma_optax.flax",
  "magma_optax.flax.scaling",
  "magma_optax.demo.corpus",
  "magma_optax.demo.llama",
  "magma_optax.demo.run",
)
_CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there


# The site is built once, on the newest jax line (CI line 2), as it is published:
# the public names and pages are the same on every line, and the build is ~20 s of
# the older line's 2-core budget. The examples in the docstrings run on every line
# (tests/repo/test_docstrings.py).
newest_line_only = pytest.mark.skipif(
  _compat.JAX_VERSION < (0, 11),
  reason="the docs site is built on the newest jax line, as it is published",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  out = tmp_path_factory.mktemp("docs")
  env = {
    "PATH": "/usr/bin:/bin",
    "HOME": str(out),
    **{k: _CLOSED for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")},
    "no_proxy": "",
  }
  cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b"]
  cmd += ["html", "-d", str(out / "doctrees"), str(ROOT / "docs"), str(out / "html")]
  run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, f"sphinx failed:\n{run.stdout}\n{run.stderr}"
  assert "WARNING" not in run.stderr, run.stderr
  return out / "html"


def _public_names(module_name):
  """(name, object) for each name the module exports (its ``__all__``, else defs)."""
  module = importlib.import_module(module_name)
  if hasattr(module, "__all__"):
    return [(n, getattr(module, n)) for n in module.__all__]
  return [
    (n, obj)
    for n, obj in vars(module).items()
    if not n.startswith("_")
    and (inspect.isfunction(obj) or inspect.isclass(obj))
    and obj.__module__ == module_name
  ]


def _anchors(obj, module_name, name):
  """The HTML ids under which Sphinx may have documented ``obj``."""
  if inspect.ismodule(obj):
    return {f"module-{obj.__name__}"}
  ids = {f"{module_name}.{name}"}
  if getattr(obj, "__module__", None) and getattr(obj, "__qualname__", None):
    ids.add(f"{obj.__module__}.{obj.__qualname__}")
  return ids


def test_conf_fetches_nothing():
  conf = (ROOT / "docs" / "conf.py").read_text()
  assert "sphinx.ext.intersphinx" not in conf
  assert re.search(r'nb_execution_mode\s*=\s*"off"', conf)


@newest_line_only
def test_every_public_name_is_documented(site):
  html = (site / "api.html").read_text()
  ids = set(re.findall(r'id="([^"]+)"', html))
  expected = [
    (module, name, _anchors(obj, module, name))
    for module in PUBLIC_MODULES
    for name, obj in _public_names(module)
  ]
  assert len(expected) > 60  # the lists above are not empty by accident
  missing = [f"{m}.{n}" for m, n, anchors in expected if not anchors & ids]
  assert not missing, f"not in docs/api.md: {missing}"


@newest_line_only
def test_guides_results_and_notebooks_are_rendered(site):
  assert "Quick start" in (site / "guide.html").read_text()
  assert "Benchmark results" in (site / "results.html").read_text()
  assert "Changelog" in (site / "changelog.html").read_text()
  notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
  assert notebooks
  for nb in notebooks:
    page = site / "notebooks" / f"{nb.stem}.html"
    assert page.exists(), f"{nb.name} has no page"
  images = list((site / "_images").glob("*.png"))
  assert images, "RESULTS.md's figures and the notebooks' plots were not copied"


# Guides whose ```python blocks run top to bottom on one CPU device (each file in one
# namespace). kernels.md, scale.md and demo.md show fragments (arrays of your own,
# 8 devices, a data loader) and are left out.
RUNNABLE_DOCS = ("README.md", "docs/masking.md", "docs/pruning.md", "docs/sparse.md")


def _python_blocks(text):
  """The ```python blocks of a Markdown text, dedented (a block may sit in a list)."""
  fence = re.compile(r"^( *)```python\n(.*?)^\1```", re.M | re.S)
  return [textwrap.dedent(body) for _, body in fence.findall(text)]


def test_python_blocks_are_found_in_lists_too():
  text = "x\n```python\na = 1\n```\n- item\n\n  ```python\n  b = a + 1\n  ```\n"
  blocks = _python_blocks(text)
  assert blocks == ["a = 1\n", "b = a + 1\n"]  # the positive control of the next test


@pytest.mark.parametrize("name", RUNNABLE_DOCS)
def test_the_code_blocks_of_the_docs_run(name):
  blocks = _python_blocks((ROOT / name).read_text())
  assert blocks, f"{name} has no python block"
  namespace = {"__name__": f"docs_{pathlib.Path(name).stem}"}
  for i, block in enumerate(blocks):
    exec(compile(block, f"{name} (python block {i})", "exec"), namespace)


def test_readme_test_command_is_what_ci_runs():
  command = 'python3 -m pip install -e ".[test]" && python3 -m pytest'
  readme = (ROOT / "README.md").read_text()
  ci = (ROOT / ".ci" / "run").read_text()
  body = re.search(r"readme_test_command\(\) \{\n(.*?)\n\}", ci, re.S)
  assert body, ".ci/run defines no readme_test_command"
  assert body.group(1).strip() == command
  assert f"\n{command}\n" in readme, "the README's quick start lost its test command"


@pytest.mark.parametrize(
  "name, most", [("README.md", 250), ("benchmarks/RESULTS.md", 300),
                 ("CHANGELOG.md", 150)],
)  # fmt: skip
def test_prose_files_stay_readable(name, most):
  lines = (ROOT / name).read_text().count("\n")
  assert lines <= most, f"{name} has {lines} lines; keep it to {most} (history: git)"
