"""What one decode step over a cache costs in arithmetic (the roofline's FLOPs).

Functions of a cache (its ``layer``, ``offset`` and ``batch_size``): the default cost is
dense attention's over the tokens a query attends. A method that rebuilds keys or
attends in a factor space, or that evicts, declares what it does as its profile's
``decode_flops`` (``dense_flops`` over the tokens it keeps, or its own count).
"""

from __future__ import annotations

from typing import Any


def window_tokens(cache: Any) -> int:
    """Tokens within the layer's own attention window (a local layer's at most): what a
    dense cache of this layer attends, whatever the method keeps."""
    return min(cache.offset, cache.layer.sliding_window or cache.offset)


def query_heads(cache: Any) -> int:
    """Query heads of the layer's attention (its KV heads if it does not say)."""
    return int(getattr(cache.layer.attention, "n_heads", 0) or cache.layer.n_kv_heads)


def dense_flops(cache: Any, attended: int | None = None) -> int:
    """FLOPs (2 per multiply-add) of one decode query's dense attention over
    ``attended`` tokens (default: the layer's window of what it saw)."""
    n = window_tokens(cache) if attended is None else attended
    d = cache.layer.head_dim + cache.layer.v_head_dim
    return 2 * max(cache.batch_size, 1) * query_heads(cache) * n * d


def fp16_bytes(cache: Any) -> int:
    """Bytes a dense float16 cache (mlx_lm's for this layer: a local layer's holds its
    window at most) would hold for the tokens ``cache`` has seen."""
    info = cache.layer
    width = info.n_kv_heads * (info.head_dim + info.v_head_dim)
    return max(cache.batch_size, 1) * window_tokens(cache) * width * 2


def layer_stats(cache: Any) -> dict[str, Any]:
    """One layer's cache: held, accounted and fp16-equivalent bytes, tokens, the ratio
    and one decode query's FLOPs (what ``veloxquant bench`` and the server report)."""
    held, fp16 = cache.nbytes, fp16_bytes(cache)
    return {
        "method": cache.method,
        "layer": cache.layer.layer_idx,
        "tokens": cache.offset,
        "held_bytes": held,
        "accounted_bytes": cache.accounted_bytes(),
        "fp16_bytes": fp16,
        "ratio": (held / fp16) if fp16 else 0.0,
        "decode_flops": type(cache).profile.decode_flops(cache),
    }
