"""A real byte-level text corpus that every machine has offline: the stdlib's source.

:func:`load` reads a fixed list of the Python standard library's source files from
the running interpreter (:func:`stdlib_sources` lists every ``.py`` file instead) and
splits each at 90 % of its length (heads for training, tails for validation); tokens
are bytes. :func:`train_batches` draws seeded random windows (:func:`train_starts`
their offsets), :func:`validation_batches` a fixed set.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Iterator
from collections.abc import Sequence

import numpy as np

VOCAB_SIZE = 256
SEPARATOR = b"\x00"

# Fixed and sorted; every entry exists on CPython 3.11 and 3.12.
STDLIB_FILES: tuple[str, ...] = (
  "_pydecimal.py",
  "argparse.py",
  "ast.py",
  "base64.py",
  "bisect.py",
  "calendar.py",
  "collections/__init__.py",
  "configparser.py",
  "contextlib.py",
  "copy.py",
  "csv.py",
  "dataclasses.py",
  "difflib.py",
  "email/message.py",
  "enum.py",
  "fractions.py",
  "functools.py",
  "heapq.py",
  "http/client.py",
  "inspect.py",
  "json/__init__.py",
  "json/decoder.py",
  "json/encoder.py",
  "logging/__init__.py",
  "pprint.py",
  "random.py",
  "shutil.py",
  "statistics.py",
  "string.py",
  "subprocess.py",
  "textwrap.py",
  "threading.py",
  "tokenize.py",
  "typing.py",
  "unittest/case.py",
  "uuid.py",
)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A byte corpus split into training and validation text.

  Attributes:
    train: uint8 array, the training bytes.
    validation: uint8 array, the validation bytes.
    files: the files read, relative to ``root``, in order.
    root: the directory the files were read from.
  """

  train: np.ndarray
  validation: np.ndarray
  files: tuple[str, ...]
  root: str


def stdlib_dir() -> str:
  """The running interpreter's standard-library source directory."""
  path = sysconfig.get_paths().get("stdlib")
  if path and os.path.isfile(os.path.join(path, "os.py")):
    return path
  return os.path.dirname(os.__file__)  # e.g. unusual sysconfig schemes


_NOT_STDLIB = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_sources(root: str | None = None) -> tuple[str, ...]:
  """Every ``.py`` file of the standard library, as sorted paths relative to ``root``.

  Third-party packages (``site-packages``, ``dist-packages``) are left out, and
  symbolic links to directories are not followed, so the list depends only on the
  CPython install: the same for a given minor version built the same way.
  Distributions that ship the ``test`` package apart (Debian, Ubuntu) list fewer
  files.

  Args:
    root: directory to list (default :func:`stdlib_dir`).

  Returns:
    Paths with ``/`` separators, for :func:`load`'s ``files``.

  Example:
    >>> from magma_optax.demo import corpus
    >>> files = corpus.stdlib_sources()
    >>> set(corpus.STDLIB_FILES) <= set(files)
    True
  """
  root = stdlib_dir() if root is None else root
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _NOT_STDLIB]
    rel = os.path.relpath(dirpath, root)
    prefix = "" if rel == os.curdir else rel.replace(os.sep, "/") + "/"
    found += [prefix + f for f in filenames if f.endswith(".py")]
  return tuple(sorted(found))


def load(
  files: Sequence[str] = STDLIB_FILES,
  *,
  root: str | None = None,
  validation_fraction: float = 0.1,
  max_bytes: int | None = None,
) -> Corpus:
  """Reads the corpus and splits it deterministically.

  Args:
    files: file paths relative to ``root`` (default :data:`STDLIB_FILES`).
    root: directory to read from (default :func:`stdlib_dir`).
    validation_fraction: fraction in (0, 1) of each file, its tail, held out.
    max_bytes: if given, each file is first truncated to this many bytes (for quick
      tests).

  Returns:
    A :class:`Corpus`.

  Raises:
    ValueError: on a bad ``validation_fraction`` or ``max_bytes``, or when fewer than
      half of ``files`` can be read.

  Example:
    >>> from magma_optax.demo import corpus
    >>> data = corpus.load()
    >>> batches = corpus.train_batches(data.train, batch_size=4, seq_len=64, seed=0)
    >>> next(batches).shape
    (4, 65)
  """
  if not 0.0 < validation_fraction < 1.0:
    raise ValueError(
      f"validation_fraction must be in (0, 1); got {validation_fraction!r}."
    )
  if max_bytes is not None and max_bytes < 2:
    raise ValueError(f"max_bytes must be >= 2 or None; got {max_bytes!r}.")
  root = stdlib_dir() if root is None else root
  heads, tails, found = [], [], []
  for name in files:
    try:
      with open(os.path.join(root, name), "rb") as f:
        text = f.read()
    except OSError:
      continue  # skipped: not in this install
    if max_bytes is not None:
      text = text[:max_bytes]
    cut = int(round(len(text) * (1.0 - validation_fraction)))
    heads.append(text[:cut])
    tails.append(text[cut:])
    found.append(name)
  if not files or 2 * len(found) < len(files):
    raise ValueError(
      f"only {len(found)} of {len(files)} corpus files could be read under"
      f" {root!r}; pass root= or files= for this Python install."
    )
  as_array = lambda parts: np.frombuffer(SEPARATOR.join(parts), dtype=np.uint8)
  return Corpus(as_array(heads), as_array(tails), tuple(found), root)


def _check_window(data: np.ndarray, batch_size: int, seq_len: int) -> None:
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1; got {batch_size!r}.")
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1; got {seq_len!r}.")
  if len(data) < seq_len + 1:
    raise ValueError(
      f"seq_len + 1 = {seq_len + 1} exceeds the data length {len(data)}."
    )


def train_batches(
  data: np.ndarray, *, batch_size: int, seq_len: int, seed: int = 0
) -> Iterator[np.ndarray]:
  """Endless random training windows.

  Each batch is ``int32[batch_size, seq_len + 1]``: inputs are ``[:, :-1]``, next-byte
  targets ``[:, 1:]``. Window starts are uniform over the data, drawn from
  ``numpy.random.default_rng(seed)``, so the stream is reproducible.

  Args:
    data: uint8 bytes, e.g. ``Corpus.train``.
    batch_size: windows per batch (>= 1).
    seq_len: model sequence length (>= 1).
    seed: seed of the window positions.

  Returns:
    An iterator of numpy batches.
  """
  _check_window(data, batch_size, seq_len)  # here, not at the first next()
  rng = np.random.default_rng(seed)
  offsets = np.arange(seq_len + 1)

  def windows():
    while True:
      starts = _draw_starts(rng, len(data), batch_size, seq_len)
      yield data[starts[:, None] + offsets].astype(np.int32)

  return windows()


def _draw_starts(rng: np.random.Generator, n: int, batch_size: int, seq_len: int):
  return rng.integers(0, n - seq_len, size=batch_size)


def train_starts(
  data: np.ndarray, *, batch_size: int, seq_len: int, num_batches: int, seed: int = 0
) -> np.ndarray:
  """The start offsets of :func:`train_batches`' first ``num_batches`` batches.

  For a training loop that keeps the text on the device and gathers each batch's
  windows there: ``data[starts[i][:, None] + arange(seq_len + 1)]`` is batch ``i``
  of ``train_batches(data, ..., seed=seed)``.

  Args:
    data: uint8 bytes, e.g. ``Corpus.train``.
    batch_size: windows per batch (>= 1).
    seq_len: model sequence length (>= 1).
    num_batches: number of batches (>= 1).
    seed: seed of the window positions.

  Returns:
    ``int64[num_batches, batch_size]``.
  """
  _check_window(data, batch_size, seq_len)
  if num_batches < 1:
    raise ValueError(f"num_batches must be >= 1; got {num_batches!r}.")
  rng = np.random.default_rng(seed)
  return np.stack(
    [_draw_starts(rng, len(data), batch_size, seq_len) for _ in range(num_batches)]
  )


def validation_batches(
  data: np.ndarray, *, batch_size: int, seq_len: int, num_batches: int
) -> np.ndarray:
  """A fixed set of evenly spaced validation windows.

  Args:
    data: uint8 bytes, e.g. ``Corpus.validation``.
    batch_size: windows per batch (>= 1).
    seq_len: model sequence length (>= 1).
    num_batches: number of batches (>= 1).

  Returns:
    ``int32[num_batches, batch_size, seq_len + 1]``, identical on every call.
  """
  _check_window(data, batch_size, seq_len)
  if num_batches < 1:
    raise ValueError(f"num_batches must be >= 1; got {num_batches!r}.")
  count = num_batches * batch_size
  starts = np.linspace(0, len(data) - seq_len - 1, count).astype(np.int64)
  windows = data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return windows.reshape(num_batches, batch_size, seq_len + 1)
