"""Tests for magma_optax.demo.corpus: file list, split, batch iterators, bad input."""

import os
import pathlib

import numpy as np
import pytest

from magma_optax.demo import corpus


@pytest.fixture(scope="module")
def data():
  return corpus.load()


def test_file_list_is_sorted_unique_and_present(data):
  assert list(corpus.STDLIB_FILES) == sorted(set(corpus.STDLIB_FILES))
  assert data.files == corpus.STDLIB_FILES  # all present on CPython 3.11 / 3.12
  for name in corpus.STDLIB_FILES:
    assert os.path.isfile(os.path.join(corpus.stdlib_dir(), name))


def test_split_is_head_and_tail_of_each_file(data):
  heads, tails = [], []
  for name in data.files:
    with open(os.path.join(data.root, name), "rb") as f:
      text = f.read()
    cut = int(round(len(text) * 0.9))
    heads.append(text[:cut])
    tails.append(text[cut:])
  assert data.train.tobytes() == b"\x00".join(heads)
  assert data.validation.tobytes() == b"\x00".join(tails)
  assert data.train.dtype == np.uint8
  frac = len(data.validation) / (len(data.train) + len(data.validation))
  assert 0.09 < frac < 0.11
  assert len(data.train) > 1_000_000  # a real corpus, not a toy string


def test_load_is_deterministic(data):
  again = corpus.load()
  np.testing.assert_array_equal(again.train, data.train)
  np.testing.assert_array_equal(again.validation, data.validation)


def test_missing_files_are_skipped_and_too_few_is_an_error(tmp_path):
  for name in ("a.py", "b.py", "c.py"):
    (tmp_path / name).write_bytes(b"x" * 100)
  got = corpus.load(["a.py", "b.py", "c.py", "missing.py"], root=str(tmp_path))
  assert got.files == ("a.py", "b.py", "c.py")
  assert len(got.train) == 3 * 90 + 2 and len(got.validation) == 3 * 10 + 2
  with pytest.raises(ValueError, match="could be read"):
    corpus.load(["a.py", "m1.py", "m2.py"], root=str(tmp_path))


def test_max_bytes_truncates(tmp_path):
  (tmp_path / "a.py").write_bytes(bytes(range(200)))
  got = corpus.load(["a.py"], root=str(tmp_path), max_bytes=100)
  assert got.train.tobytes() == bytes(range(90))
  assert got.validation.tobytes() == bytes(range(90, 100))


def test_train_batches_are_contiguous_windows_and_reproducible():
  data = np.arange(250, dtype=np.uint8)  # each window must count up by one
  it = corpus.train_batches(data, batch_size=64, seq_len=16, seed=3)
  batch = next(it)
  assert batch.shape == (64, 17) and batch.dtype == np.int32
  np.testing.assert_array_equal(np.diff(batch, axis=1), 1)
  assert batch.min() >= 0 and batch.max() <= 249
  assert len(np.unique(batch[:, 0])) > 20  # starts are spread, not constant
  np.testing.assert_array_equal(
    next(corpus.train_batches(data, batch_size=64, seq_len=16, seed=3)), batch
  )
  assert not np.array_equal(next(it), batch)  # the stream moves on
  other = next(corpus.train_batches(data, batch_size=64, seq_len=16, seed=4))
  assert not np.array_equal(other, batch)


def test_train_batch_starts_are_uniform():
  data = np.zeros(1010, dtype=np.uint8)
  data[:] = np.arange(1010) % 2  # parity of the first byte = parity of the start
  it = corpus.train_batches(data, batch_size=4000, seq_len=9, seed=0)
  odd = next(it)[:, 0].mean()
  # Binomial(4000, 1/2): standard deviation 0.0079; 5 sigma.
  assert abs(odd - 0.5) < 0.04


def test_validation_batches_are_fixed_and_cover_the_data():
  data = np.arange(256, dtype=np.uint8)
  v = corpus.validation_batches(data, batch_size=4, seq_len=10, num_batches=3)
  assert v.shape == (3, 4, 11)
  np.testing.assert_array_equal(np.diff(v, axis=-1), 1)
  starts = v[..., 0].ravel()
  assert starts[0] == 0 and starts[-1] == 256 - 11
  np.testing.assert_array_equal(
    v, corpus.validation_batches(data, batch_size=4, seq_len=10, num_batches=3)
  )


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"batch_size": 0, "seq_len": 8}, "batch_size"),
    ({"batch_size": 2, "seq_len": 0}, "seq_len"),
    ({"batch_size": 2, "seq_len": 100}, "exceeds"),
  ],
)
def test_bad_batch_arguments(kwargs, match):
  data = np.zeros(50, np.uint8)
  with pytest.raises(ValueError, match=match):
    corpus.train_batches(data, **kwargs)  # raises at the call, not at next()
  with pytest.raises(ValueError, match=match):
    corpus.validation_batches(data, num_batches=1, **kwargs)


def test_bad_load_arguments():
  with pytest.raises(ValueError, match="validation_fraction"):
    corpus.load(validation_fraction=1.0)
  with pytest.raises(ValueError, match="max_bytes"):
    corpus.load(max_bytes=1)
  with pytest.raises(ValueError, match="num_batches"):
    corpus.validation_batches(
      np.zeros(50, np.uint8), batch_size=1, seq_len=4, num_batches=0
    )


def test_stdlib_sources_lists_every_py_file_but_third_party(tmp_path):
  for name in ("a.py", "b.txt", "pkg/z.py", "pkg/__init__.py", "pkg/sub/y.py",
               "site-packages/third.py", "dist-packages/third.py",
               "__pycache__/a.py", "pkg/site-packages/x.py"):  # fmt: skip
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_bytes(b"x = 1\n")
  (tmp_path / "linked").symlink_to(tmp_path / "pkg", target_is_directory=True)
  assert corpus.stdlib_sources(str(tmp_path)) == (
    "a.py", "pkg/__init__.py", "pkg/sub/y.py", "pkg/z.py"
  )  # fmt: skip


def test_stdlib_sources_of_this_interpreter():
  root = corpus.stdlib_dir()
  files = corpus.stdlib_sources()
  assert files == corpus.stdlib_sources() and list(files) == sorted(set(files))
  assert set(corpus.STDLIB_FILES) <= set(files)
  # Independent listing: pathlib's glob, third-party folders filtered after.
  third_party = {"site-packages", "dist-packages"}
  expected = sorted(
    p.relative_to(root).as_posix()
    for p in pathlib.Path(root).rglob("*.py")
    if not third_party & set(p.relative_to(root).parts)
  )
  assert list(files) == expected
  data = corpus.load(files)
  assert data.files == files and len(data.train) > 5 * len(corpus.load().train)


def test_train_starts_are_train_batches_windows():
  data = np.random.default_rng(0).integers(0, 256, 1000).astype(np.uint8)
  starts = corpus.train_starts(data, batch_size=5, seq_len=12, num_batches=4, seed=7)
  assert starts.shape == (4, 5)
  it = corpus.train_batches(data, batch_size=5, seq_len=12, seed=7)
  for row in starts:
    np.testing.assert_array_equal(data[row[:, None] + np.arange(13)], next(it))
  with pytest.raises(ValueError, match="num_batches"):
    corpus.train_starts(data, batch_size=5, seq_len=12, num_batches=0)
  with pytest.raises(ValueError, match="exceeds"):
    corpus.train_starts(data, batch_size=5, seq_len=1000, num_batches=1)
