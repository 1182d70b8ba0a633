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

Storage (a ``StoredForm``, ``cache.segments``): keys and values each a bounded ring
(``kept.Ring``): the sinks, then the window. Once ``sink + window`` tokens are held, a
decode step writes its token in place over the oldest one; the order inside the ring
does not matter to a single query, which sees every held token. Multi-token chunks put
the ring back in time order first, and attend over a band of their own.

Stacked with quantization (``store="affine"`` or ``"codebook"``, ``cache.kept``): the
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

from veloxquant_mlx.cache import kept as kp
from veloxquant_mlx.cache.base import LayerInfo, window_dtype
from veloxquant_mlx.cache.numerics import StoredNumerics, Stream, cast
from veloxquant_mlx.cache.profile import Profile, plain_layer
from veloxquant_mlx.cache.segments import Dense
from veloxquant_mlx.cache.sliding import sliding_window_of
from veloxquant_mlx.cache.step_cost import dense_flops
from veloxquant_mlx.cache.stored import StoredFormCache
from veloxquant_mlx.ops.attention import sdpa
from veloxquant_mlx.ops.buffers import owned
from veloxquant_mlx.ops.parts import Slot
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
    ``"codebook"`` (``cache.kept``; the sinks stay in the window dtype);
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
        kp.check_store_options(self)


def _stored_numerics(config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
    """The first ``sink`` tokens and the ``window`` most recent positions up to each
    query, as received (mlx_lm's ``RotatingKVCache(sink + window, keep=sink)`` band);
    a local layer keeps ``min(window, sliding_window)`` and no sinks. Exact with the
    dense store; a quantized store is not emulated (its codes: ``cache.kept``)."""
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


def _tune_grid(context: int) -> list[dict[str, Any]]:
    # Windows of 3/4, 1/2 and 1/3 of the context, dense and as codebook codes from
    # 4 to 2 bits: from about half of fp16 down to about 0.06.
    grid: list[dict[str, Any]] = []
    for frac in (0.75, 0.5, 0.35):
        window = max(32, int(context * frac)) - 4
        grid.append(dict(window=window))
        grid += [dict(window=window, store="codebook", k_bits=k, v_bits=v)
                 for k, v in ((4, 4), (3, 3), (3, 2), (2, 2))]
    return grid


def _supports_layer(layer_cache: Any) -> bool:
    # Sliding-window layers too: the ring is then bounded by the layer's window.
    return plain_layer(layer_cache) or sliding_window_of(layer_cache) is not None


def _decode_flops(cache: Any) -> int:
    return dense_flops(cache, min(cache.offset, cache.sink + cache.window))


def _check_restored(cache: Any) -> None:
    """The tokens held against the saved offset (the segments are checked by
    ``cache.restore_check``)."""
    n = cache.stored.tokens()[0]
    if n > cache.offset:
        raise ValueError(f"the saved arrays hold {n} tokens, more than the saved offset "
                         f"{cache.offset}")


def _trim_refusal(cache: Any) -> str:
    return (f"it evicted the tokens between its {cache.sink} sinks and its {cache.window}-token "
            f"window ({cache.offset} seen), so the positions a trim would bring back are gone")


@register
class StreamingCache(StoredFormCache):
    """Attention sinks + a sliding window of recent tokens (fixed size)."""

    method = "streaming"
    Options = StreamingOptions
    profile = Profile(
        trim_refusal=_trim_refusal,
        check_restored=_check_restored,
        decode_flops=_decode_flops,
        needs_rotation=kp.store_needs_rotation, curve_tags=kp.store_curve_tags,
        family="eviction",
        paper="StreamingLLM, Xiao et al., ICLR 2024 (arXiv 2309.17453)",
        stores="sink tokens + recent window (fixed size)",
        evicts=True,
        rotatable=True,
        stored_numerics=_stored_numerics,
        supports_layer=_supports_layer,
        tune_grid=_tune_grid,
        small=dict(window=16, sink=2),
        lossless=dict(window=1000),
    )
    attends = True
    meta_fields = {"offset": int, "batch_size": int, "sink": int, "window": int}

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.sink = self.opts.sink
        self.window = self.opts.window
        if self.layer.sliding_window:
            # A local layer never attends beyond its window: keep at most that, no sinks.
            self.sink, self.window = 0, min(self.window, self.layer.sliding_window)
        o, info = self.opts, self.layer
        kp.check_store_fits(o, info.head_dim, info.v_head_dim, f"layer {info.layer_idx}")
        # The chunk being attended: keys/values of sinks + previous window + chunk and
        # the position of the chunk's first token. Released by ``attend``.
        self._pending: tuple[mx.array, mx.array, mx.array, int] | None = None
        self.quantized = o.store != "dense"
        self.stored = self._coded_form() if self.quantized else self._dense_form()

    def _dense_form(self) -> kp.KeptForm:
        """Keys and values each one ring, sinks then window (saved while held)."""
        wdt, info = window_dtype(self.config, None), self.layer
        self.ring = tuple(kp.Ring(kp.DenseBuffer(d, wdt), self.sink, self.window)
                          for d in (info.head_dim, info.v_head_dim))
        return kp.KeptForm([self.ring[0]], [self.ring[1]], optional=self.ring)

    def _coded_form(self) -> kp.KeptForm:
        """Sinks in the window dtype, the window a ring of codes, and a decode step's
        token in full precision until it has attended ("fresh")."""
        o, info = self.opts, self.layer
        self.sinks, self.fresh = (Dense(), Dense()), (Dense(), Dense())
        self.ring = (kp.Ring(kp.store_codes(o, o.k_bits, info.head_dim), 0, self.window),
                     kp.Ring(kp.store_codes(o, o.v_bits, info.v_head_dim), 0, self.window))
        return kp.KeptForm([self.sinks[0], self.ring[0], self.fresh[0]],
                           [self.sinks[1], self.ring[1], self.fresh[1]],
                           state_order=[self.sinks, self.ring, self.fresh])

    # ---- positions of the held tokens ----
    def _held_positions(self) -> mx.array:
        n = self.stored.tokens()[0]
        n_sink = min(self.sink, n)
        recent = mx.arange(self.offset - (n - n_sink), self.offset)
        return mx.concatenate([mx.arange(n_sink), recent])

    def _n_sinks(self) -> int:
        return self.sinks[0].n if self.quantized else min(self.ring[0].n, self.sink)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._commit()  # a step that did not attend leaves its token uncoded
        start, L = self.offset, keys.shape[2]
        decode = L == 1 and self._n_sinks() == self.sink
        # A chunk (and a token among the sinks of a quantized store) attends over a band
        # of its own: the held tokens in time order, then the chunk as received.
        band = L > 1 or (self.quantized and not decode)
        positions = self._held_positions() if band else None
        held = self.stored.keys_and_values(keys.dtype) if band and self.stored.tokens()[0] \
            else (None, None)
        self.begin(keys, values)
        self._pending = None if not band else (
            *(x if h is None else mx.concatenate([h, x], axis=2)
              for h, x in zip(held, (keys, values))),
            mx.concatenate([positions, mx.arange(start, start + L)]), start)
        if decode and self.quantized:  # coded after it attends, over the oldest slot
            wdt = window_dtype(self.config, keys.dtype)
            for fresh, x in zip(self.fresh, (keys, values)):
                fresh.set(x.astype(wdt))
            return keys, values
        for i, x in enumerate((keys, values)):
            s = max(0, min(self.sink - self.sinks[i].n, L)) if self.quantized else 0
            if s:  # the chunk's first tokens may be sinks
                self.sinks[i].append(owned(x[:, :, :s].astype(window_dtype(self.config, x.dtype))))
            if L > s:
                self.ring[i].append(x[:, :, s:])
        return keys, values

    def band_mask(self, positions: mx.array, start: int, n_queries: int) -> mx.array:
        """[L, S] boolean: query at t sees sinks (< sink) and keys in (t - window, t]."""
        t = mx.arange(start, start + n_queries)[:, None]
        p = positions[None]
        return (p <= t) & ((p < self.sink) | (p > t - self.window))

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        pending, self._pending = self._pending, None
        if pending is not None:
            keys, values, positions, start = pending
            band = self.band_mask(positions, start, queries.shape[2])
            return sdpa(queries, keys, values, scale, band)
        # A single query: every held token is in its band, in any order.
        return super().attend(queries, scale, None)

    def attention_slots(self) -> tuple[list[Slot], list[Slot]]:
        keys, values = super().attention_slots()
        if not (self.quantized and self.fresh[0].n and self.ring[0].full):
            return keys, values
        # The oldest slot of a full ring of codes is outside this step's band: its token
        # takes that slot once attended. Left out, no mask is needed.
        oldest = self.ring[0].start
        return tuple([side[0], *kp.without_token(side[1], oldest), side[2]]
                     for side in (keys, values))

    @classmethod
    def _attend_rows(cls, rows: list[Any], queries: mx.array, scale: float
                    ) -> mx.array | None:
        return None  # row by row: each row's band is its own

    # ---- layers that attend by themselves (see adapter.mlx_lm) ----
    def keys_and_values(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """What the last chunk attends over, as ``attend`` would: sinks, the window
        before it and the chunk in time order (one token: everything held, any order);
        ``make_mask`` gives the matching band."""
        pending = self._pending
        if pending is not None:
            keys, values = pending[0], pending[1]
            return (keys, values) if dtype is None else (keys.astype(dtype),
                                                         values.astype(dtype))
        self._commit()  # the fresh token takes the oldest slot: every held token is visible
        return super().keys_and_values(dtype)

    def make_mask(self, N: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array | None:
        """The band over what ``keys_and_values`` returns after a chunk of ``N`` (``attend``
        ignores the model's mask and builds the same band itself)."""
        if N == 1:
            return None
        positions = mx.concatenate([self._held_positions(),
                                    mx.arange(self.offset, self.offset + N)])
        return self.band_mask(positions, self.offset, N)

    def _commit(self) -> None:
        """Code the last decode step's token: over the oldest slot, or appended."""
        if self.quantized and self.fresh[0].n:
            for ring, fresh in zip(self.ring, self.fresh):
                ring.append(fresh.x)
                fresh.set(None)

    # ---- trimming ----
    def is_trimmable(self) -> bool:
        return self.offset <= self.sink + self.window
