"""Executes every notebook in notebooks/ headless in small mode; a failing cell fails.

On the newest jax line only (CI line 2): the notebooks are for Colab, which runs it,
and their ~2 minutes do not fit the older line's 2-core budget next to the rest.

Runs with ``MAGMA_NOTEBOOK_SMALL=1`` (each notebook switches to tiny sizes), kernel
``python3`` and the notebooks' folder as working directory, so relative paths in a
notebook behave as when it is opened there. New notebooks are picked up automatically.
Every notebook starts with the same install cell, and prints ``small=True`` once it
has read the small-mode switch (so a notebook that ignores it fails here).
"""

import pathlib
import re
import time

import pytest

from magma_optax._core import compat as _compat

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
TIMEOUT_PER_CELL_S = 300  # a generous bound; the suite's budget is ~3 min in total


def test_there_are_notebooks():
  assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.skipif(
  _compat.JAX_VERSION < (0, 11),
  reason="notebooks run on the newest jax line, as on Colab (CI line 2)",
)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
  monkeypatch.setenv("MAGMA_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    nb,
    kernel_name="python3",
    timeout=TIMEOUT_PER_CELL_S,
    resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
  )
  start = time.perf_counter()
  try:
    client.execute()
  except nbclient.exceptions.CellExecutionError as e:
    pytest.fail(f"{path.name}: a cell failed:\n{e}")
  seconds = time.perf_counter() - start
  errors = [
    out
    for cell in nb.cells
    if cell.cell_type == "code"
    for out in cell.get("outputs", [])
    if out.get("output_type") == "error"
  ]
  assert not errors, f"{path.name}: error outputs {errors}"
  print(f"{path.name}: {seconds:.1f} s")
  printed = "".join(
    out.get("text", "")
    for cell in nb.cells
    if cell.cell_type == "code"
    for out in cell.get("outputs", [])
    if out.get("output_type") == "stream"
  )
  assert "small=True" in printed, f"{path.name} did not switch to small mode"
  assert re.search(r"^magma_optax \d+\.\d+", printed, re.M), printed[:500]  # cell 1


def _first_code_cell(path):
  nb = nbformat.read(path, as_version=4)
  return next(c.source for c in nb.cells if c.cell_type == "code")


def test_every_notebook_has_the_same_install_cell():
  cells = {path.name: _first_code_cell(path) for path in NOTEBOOKS}
  first = next(iter(cells.values()))
  assert "magma-optax[demo]" in first and '"-e"' in first  # PyPI and the checkout
  different = [name for name, cell in cells.items() if cell != first]
  assert not different, f"install cell differs from {NOTEBOOKS[0].name}: {different}"
