"""The release artifacts: sdist and wheel build, the wheel installs bare and imports.

``python -m build`` makes both from this checkout; the wheel must hold the package
and its metadata only (no tests, benchmarks, notebooks, docs), declare exactly the
runtime dependencies ``import magma_optax`` needs, carry the license (PEP 639), and
install into a fresh virtual environment without extras, where ``magma_optax``
imports and takes a step while flax stays absent.
"""

import ast
import email
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

import magma_optax
from magma_optax._core import compat as _compat

pytest.importorskip("build")

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNTIME_DEPS = {"jax", "numpy", "optax"}


def _run(cmd, **kw):
  run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
  assert run.returncode == 0, (
    f"{cmd} failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
  )
  return run


# The artifacts are pure Python, the same on every jax line: they are built and
# installed on the newest one (CI line 2, Python >= 3.12), which keeps the older
# line's suite within its time budget (about 60 s of a 2-core run). The static
# checks of the imports below run on every line.
newest_line_only = pytest.mark.skipif(
  _compat.JAX_VERSION < (0, 11),
  reason="build and bare install run on the newest jax line (the wheel is pure Python)",
)


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
  out = tmp_path_factory.mktemp("dist")
  _run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out)],
       cwd=ROOT)  # fmt: skip
  (wheel,) = out.glob("*.whl")
  (sdist,) = out.glob("*.tar.gz")
  return wheel, sdist


@newest_line_only
def test_wheel_holds_the_package_only(dist):
  wheel, _ = dist
  version = magma_optax.__version__
  assert wheel.name == f"magma_optax-{version}-py3-none-any.whl"
  names = zipfile.ZipFile(wheel).namelist()
  info = f"magma_optax-{version}.dist-info/"
  outside = [n for n in names if not n.startswith(("magma_optax/", info))]
  assert not outside, outside
  for top in ("tests", "benchmarks", "notebooks", "docs", "examples"):
    assert not any(f"/{top}/" in f"/{n}" for n in names), top
  # The positive side of the same listing: what must be there is.
  for needed in ("magma_optax/__init__.py", "magma_optax/kernels/api.py",
                 "magma_optax/demo/llama.py", "magma_optax/py.typed",
                 f"{info}licenses/LICENSE", f"{info}METADATA"):  # fmt: skip
    assert needed in names, needed


@newest_line_only
def test_wheel_metadata(dist):
  wheel, _ = dist
  version = magma_optax.__version__
  meta = email.message_from_bytes(
    zipfile.ZipFile(wheel).read(f"magma_optax-{version}.dist-info/METADATA")
  )
  assert meta["Version"] == version
  assert meta["License-Expression"] == "Apache-2.0"
  assert meta.get_all("License-File") == ["LICENSE"]
  requires = meta.get_all("Requires-Dist")
  runtime = {re.match(r"[\w.-]+", r).group(0) for r in requires if "extra ==" not in r}
  assert runtime == RUNTIME_DEPS
  flax_extra = [r for r in requires if r.startswith("flax") and "extra ==" in r]
  assert flax_extra, requires  # flax only as an extra
  assert "Programming Language :: Python :: 3.12" in meta.get_all("Classifier")


@newest_line_only
def test_sdist_has_the_license_and_sources(dist):
  _, sdist = dist
  names = tarfile.open(sdist).getnames()
  base = sdist.name.removesuffix(".tar.gz")
  for needed in ("LICENSE", "pyproject.toml", "README.md", "magma_optax/__init__.py"):
    assert f"{base}/{needed}" in names, needed


def test_runtime_imports_are_the_declared_dependencies():
  """Every top-level import of the core package is stdlib, itself or a runtime dep."""
  imports = set()
  for path in (ROOT / "magma_optax").rglob("*.py"):
    parts = path.relative_to(ROOT / "magma_optax").parts
    if "flax" in parts or "demo" in parts:
      continue  # optional parts, behind extras
    imports |= _top_level_imports(path.read_text())
  third_party = imports - set(sys.stdlib_module_names) - {"magma_optax"}
  assert third_party == RUNTIME_DEPS


def _top_level_imports(source: str) -> set[str]:
  """Top-level module names imported anywhere in ``source`` (parsed, so a docstring
  line that starts with "from" is not an import)."""
  names = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names |= {alias.name.split(".")[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module.split(".")[0])
  return names


def test_import_parser_sees_imports_not_prose():
  # Positive control for the check above: a real import anywhere is found, and a
  # docstring line that reads like one is not.
  source = (
    '"""Docs.\nfrom the tiles, import nothing\n"""\n'
    "import flax\ndef f():\n  from orbax.checkpoint import x\n"
  )
  assert _top_level_imports(source) == {"flax", "orbax"}


@newest_line_only
def test_wheel_installs_without_extras_and_imports(dist, tmp_path):
  wheel, _ = dist
  venv = tmp_path / "venv"
  # Without PYTHONPATH: a checkout on it (PYTHONPATH=$PWD) would shadow the wheel.
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  _run([sys.executable, "-m", "venv", str(venv)], env=env)
  python = venv / "bin" / "python"
  _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
        str(wheel)], env=env)  # fmt: skip
  script = """
import importlib.util, sys
import jax, jax.numpy as jnp, optax
import magma_optax as magma
assert importlib.util.find_spec("flax") is None, "flax was installed"
assert "flax" not in sys.modules
tx = magma.magma(optax.adam(1e-2), key=0)
params = {"w": jnp.ones((4, 4))}
updates, _ = tx.update(params, tx.init(params), params)
assert updates["w"].shape == (4, 4)
try:
  import magma_optax.flax
except ImportError as e:
  assert "magma-optax[flax]" in str(e), e
else:
  raise AssertionError("magma_optax.flax imported without flax")
print(magma.__version__, magma.__file__)
"""
  run = _run([str(python), "-c", script], cwd=tmp_path, env=env)
  version, location = run.stdout.split()
  assert version == magma_optax.__version__
  assert str(venv) in location  # the wheel's copy, not this checkout
