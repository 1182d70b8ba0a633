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


# Score-block-sized arrays the prefill path may hold at once: twelve cover the most
# measured (22-24 MiB at a 256-token step on a tiny llama with 2-4 layers).
SCORE_BLOCKS = 12


def prompt_working_bound(prefill_step: int, heads: int, kv_heads: int, head_dim: int,
                         v_head_dim: int, layers: int) -> int:
    """Bytes the package's attention may add to the peak, over what the model itself
    needs for one prompt step, whatever the context (float32; docs/cpu-performance.md).

    A prompt step of ``P`` tokens attends in key blocks of
    ``kb = ops.attention._key_block(P * heads)`` keys: ``SCORE_BLOCKS`` arrays of
    ``P * heads * kb`` floats (about ``BLOCK_FLOATS`` each) and a block's keys and values
    decoded to floats, ``kb * kv_heads * (head_dim + v_head_dim)``. A decode step decodes
    at most ``ops.kernels.BLOCK`` tokens' codes at once per layer, ``BLOCK * kv_heads *
    (head_dim + v_head_dim)`` floats, counted for every layer since MLX may decode
    several layers' codes before it needs them.
    """
    from veloxquant_mlx.ops.attention import _key_block
    from veloxquant_mlx.ops.kernels import BLOCK

    rows = prefill_step * heads
    kb = _key_block(rows)
    width = kv_heads * (head_dim + v_head_dim)
    return 4 * (SCORE_BLOCKS * rows * kb + kb * width + layers * BLOCK * width)


def held_prompt_bytes(tokens: int, kv_heads: int, head_dim: int, v_head_dim: int,
                      layers: int, itemsize: int = 2) -> int:
    """Bytes a method that keeps the whole prompt until its first decode step (its
    profile's ``holds_prompt``: SnapKV scores the prompt's end before it evicts) adds to
    the prompt's working set: every layer's keys and values in the window dtype, with a
    growing buffer's spare slots (1/32), and one layer's buffer copied while it grows."""
    per_layer = tokens * kv_heads * (head_dim + v_head_dim) * itemsize
    return int(per_layer * (layers * 33 / 32 + 1))
