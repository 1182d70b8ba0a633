"""The finiteness check of prompt chunks, once per layer call.

Coding NaN or Inf would poison a whole cache silently, so every prompt chunk is checked
before it is stored. The check reads one boolean back from MLX: a sync that waits for
the layer's computation. A batch of sequences (``cache.batch``) checks its whole chunk
once and lets its rows skip their own checks (one wait per layer instead of one per
row, measured as most of a server's prompt time with eight rows).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

_state = threading.local()


def all_finite(keys: mx.array, values: mx.array) -> bool:
    """Whether every key and value is finite (checked apart: widths may differ)."""
    return bool((mx.all(mx.isfinite(keys)) & mx.all(mx.isfinite(values))).item())


def require(keys: mx.array, values: mx.array, where: str) -> None:
    """``ValueError`` naming ``where`` unless every key and value is finite."""
    if not all_finite(keys, values):
        raise ValueError(f"{where}: keys/values contain NaN or Inf; only finite values "
                         "can be cached")


def already_checked() -> bool:
    """Whether the caller is inside :func:`checked` (its chunk was checked whole)."""
    return getattr(_state, "depth", 0) > 0


@contextmanager
def checked() -> Iterator[None]:
    """Rows updated inside this block skip their own check (the caller did it)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
