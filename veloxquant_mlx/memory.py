"""Readings of MLX's allocator: bytes really alive, without the buffer cache's slack.

The server, the measurement of retained bytes (``adapter.retained``), the benchmarks and
the tests read memory through these two helpers so that every reading means the same.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

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
