"""Sphinx configuration of the magma_optax docs (``python3 -m sphinx -W -b html docs
docs/_build/html``).

No network at build time: no intersphinx, and notebooks are rendered from their
saved outputs, never executed. The notebooks live in ``notebooks/`` at the
repository root; they are copied next to these sources at build time (Sphinx reads
only files under its source folder).
"""

import pathlib
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # build from a checkout even before `pip install -e`

import magma_optax  # noqa: E402

project = "magma_optax"
author = "The magma_optax authors"
copyright = "2026, The magma_optax authors"  # noqa: A001  (Sphinx's name)
release = magma_optax.__version__
version = release

extensions = [
  "myst_nb",  # Markdown (MyST) pages and notebooks
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",  # Google-style docstrings (Args:, Returns:, ...)
  "sphinx.ext.mathjax",
  "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
nb_execution_mode = "off"  # render saved outputs; the test suite runs the notebooks
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields, not entries that :members: repeats
napoleon_custom_sections = [("References", "notes_style")]

html_theme = "alabaster"
html_title = f"magma_optax {release}"

# Sphinx reads sources only under docs/: bring the notebooks in at build time.
_NOTEBOOKS = DOCS / "notebooks"
_NOTEBOOKS.mkdir(exist_ok=True)
for _nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
  shutil.copyfile(_nb, _NOTEBOOKS / _nb.name)
