"""Executes every notebook in notebooks/ headless in small mode; a failing cell fails.

Runs with ``MAGMA_NOTEBOOK_SMALL=1`` (each notebook switches to tiny sizes), kernel
``python3`` and the notebooks' folder as working directory, so relative paths in a
notebook behave as when it is opened there. New notebooks are picked up automatically.
"""

import os
import pathlib
import time

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
TIMEOUT_PER_CELL_S = 300  # a generous bound; the suite's budget is ~3 min in total


def test_there_are_notebooks():
  assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


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
  assert os.environ["MAGMA_NOTEBOOK_SMALL"] == "1"
