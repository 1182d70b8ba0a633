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

Stacked with quantization (``store="affine"`` or ``"codebook"``, ``cache.kvstore``): the
sinks stay in the window dtype and the recent window is a ring of codes. Each token is
coded once, at the end of the step that attended over it in full precision; a decode
step attends over the sinks, the ring (its oldest slot, outside the band, masked out)
and its own token, then writes its codes over that oldest slot.

Trimming is exact while nothing has been evicted (at most ``sink + window`` tokens seen);
after that the evicted tokens a shorter prompt would still hold are gone, and
``trim`` raises ``NotTrimmableError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from veloxquant_mlx.cache import kvstore as ks
from veloxquant_mlx.cache.base import CompressedCache, LayerInfo, NotTrimmableError
from veloxquant_mlx.cache.numerics import StoredNumerics, Stream, cast
from veloxquant_mlx.cache.sliding import sliding_window_of
from veloxquant_mlx.ops.attention import sdpa, split_attention
from veloxquant_mlx.ops.buffers import owned
from veloxquant_mlx.options import MethodOptions
from veloxquant_mlx.register import register

if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig


@dataclass(frozen=True)
class StreamingOptions(MethodOptions):
    """StreamingLLM (Xiao et al., ICLR 2024, https://arxiv.org/abs/2309.17453).

    sink: first tokens always kept (attention sinks); window: most recent tokens kept,
    the current one included (sink + window = 1024 tokens per layer by default);
    store: how the window is held, ``"dense"`` (window dtype), ``"affine"`` or
    ``"codebook"`` (``cache.kvstore``; the sinks stay in the window dtype);
    k_bits / v_bits / group_size: of a quantized store.
    """

    sink: int = 4
    window: int = 1020
    store: str = "dense"
    k_bits: float = 4
    v_bits: float = 4
    group_size: int = 32

    def __post_init__(self) -> None:
        self.check_int("sink", minimum=0)
        self.check_int("window", minimum=1)
        ks.check_store_options(self)


@register
class StreamingCache(ks.StoreCapabilities, CompressedCache):
    """Attention sinks + a sliding window of recent tokens (fixed size)."""

    method = "streaming"
    family = "eviction"
    paper = "StreamingLLM, Xiao et al., ICLR 2024 (arXiv 2309.17453)"
    stores = "sink tokens + recent window (fixed size)"
    Options = StreamingOptions
    attends = True
    evicts = True
    rotatable = True
    meta_fields = ("offset", "batch_size", "sink", "window")
    # Defaults for instances that mlx_lm's ``from_state`` builds without __init__.
    store = ks.DENSE
    sink_kv = win = fresh = None

    @classmethod
    def stored_numerics(cls, config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
        """The first ``sink`` tokens and the ``window`` most recent positions up to each
        query, as received (mlx_lm's ``RotatingKVCache(sink + window, keep=sink)`` band);
        a local layer keeps ``min(window, sliding_window)`` and no sinks. Exact with the
        dense store; a quantized store is not emulated (its codes: ``cache.kvstore``)."""
        o = config.layer_options(layer.layer_idx)
        sink, window = o.sink, o.window
        if layer.sliding_window:
            sink, window = 0, min(window, layer.sliding_window)
        if o.store != "dense":
            raise NotImplementedError("streaming with a quantized store declares no "
                                      "same-numerics reference")
        # A chunk attends over itself as received, a decode step over its own stored token.
        held = Stream(cast(config.window_dtype), commit="next_chunk")
        return StoredNumerics(held, held, evict=(sink, window))

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
        info = self.layer
        self.store = ks.make_store(self.opts, info.head_dim, info.v_head_dim, mx.float16,
                                   f"layer {info.layer_idx}")
        # A quantized store: sinks in the window dtype, the window a ring of codes, and
        # a decode step's token in full precision until it has attended ("fresh").
        self.sink_kv: ks.Block | None = None
        self.win: ks.Block | None = None
        self.fresh: ks.Block | None = None

    @classmethod
    def tune_grid(cls, context: int) -> list[dict[str, Any]]:
        # Windows of 3/4, 1/2 and 1/3 of the context, dense and as codebook codes from
        # 4 to 2 bits: from about half of fp16 down to about 0.06.
        grid: list[dict[str, Any]] = []
        for frac in (0.75, 0.5, 0.35):
            window = max(32, int(context * frac)) - 4
            grid.append(dict(window=window))
            grid += [dict(window=window, store="codebook", k_bits=k, v_bits=v)
                     for k, v in ((4, 4), (3, 3), (3, 2), (2, 2))]
        return grid

    @classmethod
    def small_options(cls) -> dict[str, Any]:
        return dict(window=16, sink=2)

    @classmethod
    def lossless_options(cls) -> dict[str, Any]:
        return dict(window=1000)

    @classmethod
    def supports_layer(cls, layer_cache: Any) -> bool:
        # Sliding-window layers too: the ring is then bounded by the layer's window.
        return super().supports_layer(layer_cache) or \
            sliding_window_of(layer_cache) is not None

    def check_state(self) -> None:
        """The restored arrays against the layer and the store (``cache.restore_check``)."""
        B, H = self.batch_size, self.layer.n_kv_heads
        dims = (self.layer.head_dim, self.layer.v_head_dim)
        if self.store.quantized:
            n = ks.check_dense(self.sink_kv, B, H, dims, "sink tokens") + \
                self.store.check(self.win, B, H, "window codes") + \
                ks.check_dense(self.fresh, B, H, dims, "fresh tokens")
        else:
            held = None if self.keys is None else [self.keys, self.values]
            n = ks.check_dense(held, B, H, dims, "held keys and values")
        if n > self.offset:
            raise ValueError(f"the saved arrays hold {n} tokens, more than the saved offset "
                             f"{self.offset}")

    # ---- positions of the held tokens ----
    def _n_held(self) -> int:
        if self.store.quantized:
            return ks.tokens(self.sink_kv) + ks.tokens(self.win) + ks.tokens(self.fresh)
        return 0 if self.keys is None else self.keys.shape[2]

    def _held_positions(self) -> mx.array:
        n = self._n_held()
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
        if self.store.quantized:
            return self._update_coded(keys, values)
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
            self.keys, self.values = owned(self.keys), owned(self.values)
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
        if self._pending == "fresh":
            return self._attend_fresh(queries, scale)
        L = queries.shape[2]
        if self._pending == "ring":
            # Ring decode step: every held token is visible; their order does not matter.
            self._pending = None
            return sdpa(queries, self.keys, self.values, scale)
        keys, values, positions, start = self._pending
        self._pending = None
        if L == 1 and not self.store.quantized:
            # A single query: the held tokens are exactly what it may see.
            keys, values = self.keys, self.values
            band = None
        else:
            band = self.band_mask(positions, start, L)
        return sdpa(queries, keys, values, scale, band)

    # ---- layers that attend by themselves (see adapter.mlx_lm) ----
    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """What the last chunk attends over, as ``attend`` would: sinks, the window
        before it and the chunk in time order (one token: everything held, any order);
        ``make_mask`` gives the matching band."""
        pending = self._pending
        if isinstance(pending, tuple) and (self.store.quantized or self.offset - pending[3] > 1):
            keys, values = pending[0], pending[1]
        elif self.store.quantized:
            self._flush()  # the fresh token takes the oldest slot: every held token is visible
            keys, values = self._held_dense(dtype or mx.float32)
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

    # ---- a quantized store ----
    def _held_dense(self, dtype: mx.Dtype) -> tuple[mx.array, mx.array] | None:
        """Sinks then the window in time order, dense (a transient)."""
        win = ks.reorder(self.win, self.ring)
        parts = [tuple(x.astype(dtype) for x in self.sink_kv)] if self.sink_kv else []
        if win is not None:
            parts.append(self.store.decode(win, dtype))
        if not parts:
            return None
        return tuple(mx.concatenate(xs, axis=2) if len(xs) > 1 else xs[0]
                     for xs in zip(*parts))

    def _update_coded(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.check_input(keys, values)
        self._flush()  # a step that did not attend leaves its token uncoded
        self.batch_size = keys.shape[0]
        wdt = self.window_dtype(keys.dtype)
        start, L = self.offset, keys.shape[2]
        n_sink = ks.tokens(self.sink_kv)
        if L == 1 and n_sink == self.sink:  # a decode step: coded after it attends
            self.fresh = [keys.astype(wdt), values.astype(wdt)]
            self.offset += 1
            self._pending = "fresh"
            return keys, values
        positions = mx.concatenate([self._held_positions(), mx.arange(start, start + L)])
        held = self._held_dense(keys.dtype)
        all_k, all_v = (keys, values) if held is None else (
            mx.concatenate([held[0], keys], axis=2), mx.concatenate([held[1], values], axis=2))
        self._pending = (all_k, all_v, positions, start)
        self.offset += L
        s = max(0, min(self.sink - n_sink, L))  # the chunk's first tokens may be sinks
        if s:
            self.sink_kv = ks.cat(self.sink_kv, ks.take([keys.astype(wdt),
                                                         values.astype(wdt)], 0, s))
        if L > s:
            new = self.store.encode(keys[:, :, s:][:, :, -self.window:],
                                    values[:, :, s:][:, :, -self.window:])
            old = ks.reorder(self.win, self.ring)
            drop = max(0, ks.tokens(old) + ks.tokens(new) - self.window)
            self.win = ks.cat(ks.take(old, drop) if drop else old, new)
            self.ring = 0
        return keys, values

    def _attend_fresh(self, queries: mx.array, scale: float) -> mx.array:
        """A decode step: sinks, the ring without its oldest slot when full, the token."""
        self._pending = None
        parts = [tuple(self.sink_kv)] if self.sink_kv else []
        n_win = ks.tokens(self.win)
        if n_win:
            parts.append(self.store.parts(self.win, queries.dtype))
        parts.append(tuple(self.fresh))
        mask = None
        if n_win == self.window:  # the oldest slot is outside this query's band
            S = ks.tokens(self.sink_kv) + n_win + 1
            mask = (mx.arange(S) != ks.tokens(self.sink_kv) + self.ring)[None]
        out = split_attention(queries, parts, scale, mask)
        self._flush()
        return out

    def _flush(self) -> None:
        """Code the last decode step's token: over the oldest slot, or appended."""
        if self.fresh is None:
            return
        new = self.store.encode(*self.fresh)
        self.fresh = None
        if ks.tokens(self.win) == self.window:
            ks.write(self.win, self.ring, new)
            self.ring = (self.ring + 1) % self.window
        else:
            self.win = ks.cat(ks.reorder(self.win, self.ring), new)
            self.ring = 0

    # ---- trimming ----
    def is_trimmable(self) -> bool:
        return self.offset <= self.sink + self.window

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens: exact while nothing has been evicted."""
        if not self.is_trimmable():
            raise NotTrimmableError(
                f"streaming cache of layer {self.layer.layer_idx}: not trimmable after "
                f"eviction ({self.offset} tokens seen, sink + window = "
                f"{self.sink + self.window} held): a shorter prompt would still hold "
                "tokens this cache has dropped")
        n = max(0, min(self.offset, n))
        keep = self.offset - n  # every token is held, in time order (no ring step yet)
        if self.store.quantized:
            self._flush()
            n_sink = min(ks.tokens(self.sink_kv), keep)
            self.sink_kv = ks.take(self.sink_kv, 0, n_sink) if n_sink else None
            self.win = ks.take(self.win, 0, keep - n_sink)
        elif n:
            kept = ks.take([self.keys, self.values], 0, keep)
            self.keys, self.values = kept if kept else (None, None)
        self.offset, self._pending = keep, None
        return n

    def attended_tokens(self) -> int:
        return min(self.offset, self.sink + self.window)

    # ---- storage ----
    def held_arrays(self) -> list[mx.array]:
        out = [self.keys, self.values, *(self.sink_kv or []), *(self.win or []),
               *(self.fresh or [])]
        return [a for a in out if a is not None]

    def accounted_bytes(self) -> int:
        total = sum(a.nbytes for a in (*(self.sink_kv or []), *(self.fresh or [])))
        total += max(self.batch_size, 1) * self.layer.n_kv_heads * ks.tokens(self.win) * \
            self.store.token_bytes()
        if self.keys is not None:
            B, H, n, D = self.keys.shape
            total += B * H * n * (D + self.values.shape[3]) * self.keys.itemsize
        return total

    @property
    def state(self) -> list[Any]:
        if self.store.quantized:  # the ring in time order: a loaded cache starts at slot 0
            return [self.sink_kv, ks.reorder(self.win, self.ring), self.fresh]
        # Saved in time order, so a loaded cache starts with its ring at slot 0.
        return [] if self.keys is None else list(self._in_time_order())

    @state.setter
    def state(self, v: list[Any]) -> None:
        self.ring, self._pending = 0, None
        if self.store.quantized:
            self.sink_kv, self.win, self.fresh = v
            self.store.adopt(self.win)
            return
        self.keys, self.values = (v[0], v[1]) if v else (None, None)
