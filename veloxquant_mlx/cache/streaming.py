"""``streaming``: StreamingLLM (Xiao et al., ICLR 2024, arXiv 2309.17453).

The cache keeps the first ``streaming_sink`` tokens (attention sinks) and the most
recent ``window`` tokens; everything in between is evicted for good. Memory is
fixed at ``sink + window`` tokens per layer however long the generation runs.

Every query attends to the sinks and to the ``window`` most recent positions up to
and including itself. Within a prefill chunk longer than the window each query
gets its own band (a boolean mask over sinks + previous window + chunk), so
chunked prefill gives the same attention as decoding token by token.

Positions: keys keep the RoPE of their original positions (as mlx_lm's
``RotatingKVCache``), the paper instead assigns positions within the cache. See
``docs/methods/streaming.md`` for why.

Decode speed: once ``sink + window`` tokens are held, the window part of the buffer
is a ring. A decode step writes its token in place over the oldest one; the order
inside the buffer does not matter to a single query, which sees every held token.
Multi-token chunks put the buffer back in time order first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..config import KVCacheConfig
from ..options import MethodOptions
from ..registry import register
from .base import CompressedCache, LayerInfo
from .sliding import sliding_window_of


@dataclass(frozen=True)
class StreamingOptions(MethodOptions):
    """StreamingLLM (Xiao et al., ICLR 2024, https://arxiv.org/abs/2309.17453).

    sink: first tokens always kept (attention sinks); window: most recent tokens kept,
    the current one included (sink + window = 1024 tokens per layer by default).
    """

    sink: int = 4
    window: int = 1020

    def __post_init__(self) -> None:
        self.check_int("sink", minimum=0)
        self.check_int("window", minimum=1)


@register
class StreamingCache(CompressedCache):
    """Attention sinks + a sliding window of recent tokens (fixed size)."""

    method = "streaming"
    family = "eviction"
    paper = "StreamingLLM, Xiao et al., ICLR 2024 (arXiv 2309.17453)"
    stores = "sink tokens + recent window (fixed size)"
    Options = StreamingOptions
    attends = True
    meta_fields = ("offset", "batch_size", "sink", "window")

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.sink = self.opts.sink
        self.window = self.opts.window
        if self.layer.sliding_window:
            # A local layer never attends beyond its window: keep at most that, no sinks.
            self.sink, self.window = 0, min(self.window, self.layer.sliding_window)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        # Ring slot (within the window part) holding the oldest recent token.
        self.ring = 0
        # The chunk being attended: keys/values of sinks + previous window + chunk and
        # the position of the chunk's first token. Released by ``attend``.
        # "ring" after an in-place decode step.
        self._pending: tuple[mx.array, mx.array, mx.array, int] | str | None = None

    @classmethod
    def supports_layer(cls, layer_cache: Any) -> bool:
        # Sliding-window layers too: the ring is then bounded by the layer's window.
        return super().supports_layer(layer_cache) or \
            sliding_window_of(layer_cache) is not None

    # ---- positions of the held tokens ----
    def _held_positions(self) -> mx.array:
        n = 0 if self.keys is None else self.keys.shape[2]
        n_sink = min(self.sink, n)
        recent = mx.arange(self.offset - (n - n_sink), self.offset)
        return mx.concatenate([mx.arange(n_sink), recent])

    def _in_time_order(self) -> tuple[mx.array, mx.array]:
        """Held keys/values with the ring unrolled (sinks, then oldest to newest)."""
        if not self.ring:
            return self.keys, self.values
        s, r = self.sink, self.sink + self.ring
        return tuple(mx.concatenate([x[:, :, :s], x[:, :, r:], x[:, :, s:r]], axis=2)
                     for x in (self.keys, self.values))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.check_input(keys, values)
        self.batch_size = keys.shape[0]
        start = self.offset
        L = keys.shape[2]
        full = self.keys is not None and self.keys.shape[2] == self.sink + self.window
        if L == 1 and full:
            # Steady decode: overwrite the oldest recent token in place.
            wdt = self.window_dtype(keys.dtype)
            i = self.sink + self.ring
            self.keys[:, :, i:i + 1] = keys.astype(wdt)
            self.values[:, :, i:i + 1] = values.astype(wdt)
            self.ring = (self.ring + 1) % self.window
            self.offset += 1
            self._pending = "ring"
            return keys, values
        positions = self._held_positions()
        if self.keys is None:
            all_k, all_v = keys, values
        else:
            held_k, held_v = self._in_time_order()
            all_k = mx.concatenate([held_k.astype(keys.dtype), keys], axis=2)
            all_v = mx.concatenate([held_v.astype(values.dtype), values], axis=2)
        positions = mx.concatenate([positions, mx.arange(start, start + L)])
        self._pending = (all_k, all_v, positions, start)
        self.offset += L
        # Evict: keep the sinks and the last `window` tokens.
        n = all_k.shape[2]
        wdt = self.window_dtype(keys.dtype)
        if n > self.sink + self.window:
            keep_k = [all_k[:, :, :self.sink], all_k[:, :, n - self.window:]]
            keep_v = [all_v[:, :, :self.sink], all_v[:, :, n - self.window:]]
            all_k = mx.concatenate(keep_k, axis=2) if self.sink else keep_k[1]
            all_v = mx.concatenate(keep_v, axis=2) if self.sink else keep_v[1]
        self.keys, self.values = all_k.astype(wdt), all_v.astype(wdt)
        if n > self.sink + self.window and not self.sink:
            # Without sinks the kept window is a slice pinning held + chunk: copy it (a
            # no-op after a cast). Only multi-token chunks evict, never a decode step.
            self.keys, self.values = mx.contiguous(self.keys), mx.contiguous(self.values)
        self.ring = 0
        return keys, values

    def band_mask(self, positions: mx.array, start: int, n_queries: int) -> mx.array:
        """[L, S] boolean: query at t sees sinks (< sink) and keys in (t - window, t]."""
        t = mx.arange(start, start + n_queries)[:, None]
        p = positions[None]
        return (p <= t) & ((p < self.sink) | (p > t - self.window))

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        if self._pending is None:
            raise RuntimeError("streaming: attend called without a preceding update_and_fetch")
        L = queries.shape[2]
        if self._pending == "ring":
            # Ring decode step: every held token is visible; their order does not matter.
            self._pending = None
            return mx.fast.scaled_dot_product_attention(
                queries, self.keys.astype(queries.dtype), self.values.astype(queries.dtype),
                scale=scale)
        keys, values, positions, start = self._pending
        self._pending = None
        if L == 1:
            # A single query: the held tokens are exactly what it may see.
            keys, values = self.keys, self.values
            band = None
        else:
            band = self.band_mask(positions, start, L)
        keys, values = keys.astype(queries.dtype), values.astype(queries.dtype)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=band)

    # ---- layers that attend by themselves (see integration.mlx_lm) ----
    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """What the last chunk attends over, as ``attend`` would: sinks, the window
        before it and the chunk in time order (one token: everything held, any order);
        ``make_mask`` gives the matching band."""
        pending = self._pending
        if isinstance(pending, tuple) and self.offset - pending[3] > 1:
            keys, values = pending[0], pending[1]
        else:
            keys, values = self.keys, self.values
        return (keys, values) if dtype is None else (keys.astype(dtype), values.astype(dtype))

    def make_mask(self, N: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array | None:
        """The band over what ``dense_kv`` returns after a chunk of ``N`` (``attend``
        ignores the model's mask and builds the same band itself)."""
        if N == 1:
            return None
        positions = mx.concatenate([self._held_positions(),
                                    mx.arange(self.offset, self.offset + N)])
        return self.band_mask(positions, self.offset, N)

    # ---- storage ----
    def held_arrays(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    def accounted_bytes(self) -> int:
        if self.keys is None:
            return 0
        B, H, n, D = self.keys.shape
        return B * H * n * (D + self.values.shape[3]) * self.keys.itemsize

    @property
    def state(self) -> list[mx.array]:
        # Saved in time order, so a loaded cache starts with its ring at slot 0.
        return [] if self.keys is None else list(self._in_time_order())

    @state.setter
    def state(self, v: list[mx.array]) -> None:
        self.keys, self.values = (v[0], v[1]) if v else (None, None)
        self.ring, self._pending = 0, None
