"""Readings of MLX's allocator: bytes really alive, without the buffer cache's slack.

The server, the measurement of retained bytes (``adapter.retained``), the benchmarks and
the tests read memory through these helpers so that every reading means the same.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx


def active_bytes() -> int:
    """Bytes MLX keeps alive once garbage and the buffer cache are gone."""
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


@contextmanager
def no_buffer_cache() -> Iterator[None]:
    """MLX's buffer cache off: a new array then gets a buffer of its own size, not a
    recycled one up to twice as large (allocator slack that is not the cache's)."""
    limit = mx.set_cache_limit(0)
    try:
        yield
    finally:
        mx.set_cache_limit(limit)


def transient_peak(fn: Callable[[], Any]) -> int:
    """Bytes MLX allocated at the peak of evaluating ``fn()`` beyond what was alive
    before: its transients, with the buffer cache off so that a recycled buffer hides
    no allocation."""
    with no_buffer_cache():
        mx.synchronize()
        base = active_bytes()
        mx.reset_peak_memory()
        mx.eval(fn())
        mx.synchronize()
        return mx.get_peak_memory() - base
