"""Counting the compiles of a call, for tests that check there is no recompilation."""

from __future__ import annotations

import jax


def count_compiles(fn, *args) -> int:
  """How many XLA compiles ``fn(*args)`` runs (waiting for its results)."""
  counted = []

  def listener(event, duration, **kwargs):
    del duration, kwargs
    # A compile, or one taken from the suite's persistent cache (tests/conftest.py).
    if event in (
      "/jax/core/compile/backend_compile_duration",
      "/jax/compilation_cache/cache_retrieval_time_sec",
    ):
      counted.append(1)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    jax.block_until_ready(fn(*args))
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return len(counted)
