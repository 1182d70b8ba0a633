"""``snapkv``: SnapKV (Li et al., 2024, arXiv 2404.14469).

Prefill runs dense (causal attention over every prompt token). When the prompt is
complete the last ``window`` queries (the observation window) score the earlier
prompt tokens: softmax attention summed over the window queries, averaged over
the query heads of each KV head (GQA), pooled along the token axis (kernel
``snapkv_kernel``, max or avg). Each KV head keeps its ``snapkv_capacity``
best-scoring prompt tokens plus the observation window; the rest is evicted.
Decode tokens are appended after and never evicted.

When it triggers: mlx_lm feeds the prompt in multi-token chunks and then the last
prompt token alone (``L == 1``). Compression runs at the first single-token step
after a multi-token update, with the window queries taken from the end of the
prefill (only a ``[B, Hq, window, D]`` slice is kept) plus that step's query.

Storage (a ``StoredForm``, ``cache.segments``): until compression, the keys and values
in buffers with a small reserve (1/32 of the tokens held, counted) that decode steps
write in place (``kept.DenseBuffer``), and the observation-window queries beside them;
compression scores one query head at a time (``window_votes``: its transient is one
head's window scores, not every head's) and keeps the chosen tokens by a gather
(``kept.keep_chosen``). The pending prompt is the method's own growth of the prompt's
working set (docs/methods/snapkv.md, "Memory during the prompt").

Stacked with quantization (``store="affine"`` or ``"codebook"``, ``cache.kept``): the
prompt is held dense until compression, as above; then the first ``sink`` prompt tokens
(attention sinks, always kept) stay in the window dtype and the keep-set, the
observation window and every later token are stored as codes. A step attends over its
own new tokens in full precision; they are coded at the end of the step.

Trimming: exact for the tokens after the keep-set (the observation window and what came
after it), and for anything before compression; trimming into the keep-set, chosen per
KV head, raises ``NotTrimmableError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from veloxquant_mlx.cache import kept as kp
from veloxquant_mlx.cache.base import CompressedCache, LayerInfo, window_dtype
from veloxquant_mlx.cache.numerics import StoredNumerics, dense_loss
from veloxquant_mlx.cache.profile import Profile
from veloxquant_mlx.cache.restore_check import check_arrays
from veloxquant_mlx.cache.segments import Dense
from veloxquant_mlx.cache.step_cost import dense_flops
from veloxquant_mlx.cache.stored import StoredFormCache
from veloxquant_mlx.ops.attention import BLOCK_FLOATS, causal_mask, masked_softmax
from veloxquant_mlx.ops.buffers import owned
from veloxquant_mlx.options import MethodOptions
from veloxquant_mlx.register import register

if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig

POOLINGS = ("max", "avg")


@dataclass(frozen=True)
class SnapKVOptions(MethodOptions):
    """SnapKV (Li et al., 2024, https://arxiv.org/abs/2404.14469).

    capacity: prompt tokens kept per KV head besides the observation window;
    window: the observation window (last prompt queries, kept in full);
    kernel: pooling kernel over the token axis (odd); pooling: ``"max"`` or ``"avg"``;
    store: how kept tokens are held, ``"dense"`` (window dtype), ``"affine"`` or
    ``"codebook"`` (``cache.kept``); k_bits / v_bits / group_size: of a quantized
    store; sink: first prompt tokens always kept, in the window dtype (default: 4 with a
    quantized store, 0 with the dense one, as the paper).
    """

    capacity: int = 1024
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    store: str = "dense"
    k_bits: float = 4
    v_bits: float = 4
    group_size: int = 32
    sink: int | None = None

    def __post_init__(self) -> None:
        self.check_int("window", minimum=1)
        self.check_int("capacity", minimum=1)
        if self.window > self.capacity:
            raise self.error("window", "an observation window no larger than "
                             f"capacity={self.capacity}")
        self.check_int("kernel", minimum=1)
        if self.kernel % 2 == 0:
            raise self.error("kernel", "an odd integer >= 1 (the pooling keeps the length)")
        self.check_choice("pooling", POOLINGS)
        kp.check_store_options(self)
        self.check_int("sink", minimum=0, optional=True)

    @property
    def sinks(self) -> int:
        """The first prompt tokens always kept (``sink``, or its default)."""
        return (4 if self.store != "dense" else 0) if self.sink is None else self.sink


def pool_scores(scores: mx.array, kernel: int, pooling: str) -> mx.array:
    """Stride-1 1-D pooling along the last axis, same length (padding kernel // 2).

    Max pools pad with -inf; avg pools pad with zeros and divide by ``kernel``
    (PyTorch's ``avg_pool1d`` default, as the reference code).
    """
    if kernel == 1:
        return scores
    pad = kernel // 2
    fill = -mx.inf if pooling == "max" else 0.0
    widths = [(0, 0)] * (scores.ndim - 1) + [(pad, pad)]
    padded = mx.pad(scores, widths, constant_values=fill)
    n = scores.shape[-1]
    shifted = [padded[..., i:i + n] for i in range(kernel)]
    if pooling == "max":
        out = shifted[0]
        for s in shifted[1:]:
            out = mx.maximum(out, s)
        return out
    return sum(shifted[1:], shifted[0]) / kernel


def select_tokens(weights: mx.array, n_kv_heads: int, capacity: int, kernel: int,
                  pooling: str) -> mx.array:
    """Indices [B, Hkv, capacity] (sorted) of the prompt tokens each KV head keeps.

    ``weights``: [B, Hq, W, P] attention of the W window queries on the P prefix tokens.
    """
    return choose_tokens(weights.sum(axis=2), n_kv_heads, capacity, kernel, pooling)


def choose_tokens(votes: mx.array, n_kv_heads: int, capacity: int, kernel: int,
                  pooling: str) -> mx.array:
    """:func:`select_tokens` from the window's summed attention ``votes`` [B, Hq, P]."""
    B, Hq, P = votes.shape
    # GQA: a KV head serves Hq / Hkv query heads; they vote together (mean).
    votes = votes.reshape(B, n_kv_heads, Hq // n_kv_heads, P).mean(axis=2)
    votes = pool_scores(votes, kernel, pooling)
    idx = mx.argpartition(-votes, kth=capacity - 1, axis=-1)[..., :capacity]
    return mx.sort(idx, axis=-1)  # keep the prompt order


def window_votes(obs: mx.array, keys: mx.array, scale: float, start: int,
                 stop: int) -> mx.array:
    """``attention_weights(obs, keys, scale, "causal")[..., start:stop].sum(axis=2)``
    ([B, Hq, stop - start]), bit for bit, one query head at a time, each evaluated
    before the next: the transient is one KV head's keys as floats and one head's window
    scores, not every head's (rows are independent; the softmax takes the path the
    whole score array would take)."""
    B, Hq, W, D = obs.shape
    Hkv, n = keys.shape[1], keys.shape[2]
    whole = B * Hq * W * n > BLOCK_FLOATS  # masked_softmax's choice for all heads at once
    out = []
    for g in range(Hkv):
        k = keys[:, g:g + 1].astype(mx.float32)[:, :, None].swapaxes(-1, -2)
        for h in range(g * Hq // Hkv, (g + 1) * Hq // Hkv):
            q = obs[:, h:h + 1].reshape(B, 1, 1, W, D).astype(mx.float32)
            w = _window_softmax((q * scale) @ k, whole).reshape(B, 1, W, n)
            out.append(w[..., start:stop].sum(axis=2))
            mx.eval(out[-1])
    return mx.concatenate(out, axis=1)


def _window_softmax(scores: mx.array, whole: bool) -> mx.array:
    """``masked_softmax(scores, "causal")`` as on the score array of every head: a large
    one takes ``mx.softmax``, which a single head's smaller array would not."""
    if not whole:
        return masked_softmax(scores, "causal")
    W, n = scores.shape[-2:]
    masked = mx.where(causal_mask(W, n), scores, -mx.inf) if W > 1 else scores
    return mx.softmax(masked, axis=-1, precise=True)


def _stored_numerics(config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
    """Dense: the keep-set follows the queries' scores, which a cache-side reference
    does not see. Nothing is evicted up to ``capacity + window`` prompt tokens;
    beyond, evicting all but 16 of a 24-token prompt moves the logits of the tiny
    models by up to 0.57 of their scale (bound 1.0: gross errors only there; the
    lossless settings check the bookkeeping)."""
    o = config.layer_options(layer.layer_idx)
    return dense_loss(1.0, lossless_until=o.capacity + o.window + o.sinks)


def _tune_grid(context: int) -> list[dict[str, Any]]:
    # Keep-sets from half the prompt down to an eighth, dense and stored as 4- and
    # 3-bit codebook codes (the window of 32 and 4 sinks on top).
    grid: list[dict[str, Any]] = []
    for frac in (0.5, 0.35, 0.25, 0.125):
        cap = max(32, int(context * frac))
        grid.append(dict(capacity=cap))
        grid += [dict(capacity=cap, store="codebook", k_bits=b, v_bits=b)
                 for b in (4, 3)]
    return grid


def _decode_flops(cache: Any) -> int:
    return dense_flops(cache, cache.offset - cache.evicted)


def _check_restored(cache: Any) -> None:
    """The restored queries against the layer, and the tokens held against the
    offset (the segments are checked by ``cache.restore_check``)."""
    if cache.obs.n:
        B, Hq = cache.batch_size, cache.obs.x.shape[1]
        check_arrays("observation-window queries", [cache.obs.x],
                     [mx.zeros((B, Hq, cache.obs.n, cache.layer.head_dim), mx.float32)])
    n = cache.stored.tokens()[0]
    if n != cache.offset - cache.evicted:
        raise ValueError(f"the saved arrays hold {n} tokens; offset {cache.offset} less "
                         f"{cache.evicted} evicted is {cache.offset - cache.evicted}")


@register
class SnapKVCache(StoredFormCache):
    """Top-``capacity`` prompt tokens per KV head + the observation window + decode."""

    method = "snapkv"
    Options = SnapKVOptions
    profile = Profile(
        holds_prompt=True,
        check_restored=_check_restored,
        decode_flops=_decode_flops,
        needs_rotation=kp.store_needs_rotation, curve_tags=kp.store_curve_tags,
        family="eviction",
        paper="SnapKV, Li et al., 2024 (arXiv 2404.14469)",
        stores="top-capacity prompt tokens per KV head + observation window",
        evicts=True,
        rotatable=True,
        stored_numerics=_stored_numerics,
        tune_grid=_tune_grid,
        small=dict(capacity=16, window=4),
        lossless=dict(capacity=1000),
    )
    attends = True
    meta_fields = {"offset": int, "batch_size": int, "window": int, "capacity": int,
                   "kernel": int, "pooling": str, "compressed": lambda s: bool(int(s)),
                   "evicted": int, "kept": int}
    # No dense view: a layer that attends by itself would never reach the eviction,
    # which runs at attention (the builder refuses such layers instead).
    keys_and_values = CompressedCache.keys_and_values

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.window = self.opts.window
        self.capacity = self.opts.capacity
        self.kernel = self.opts.kernel
        self.pooling = self.opts.pooling
        self.sink = self.opts.sinks
        info = self.layer
        kp.check_store_fits(self.opts, info.head_dim, info.v_head_dim,
                            f"layer {info.layer_idx}")
        self.compressed = False
        self.evicted = 0  # prompt tokens dropped (per KV head)
        self.kept = 0  # held tokens chosen per head (sinks + keep-set): not trimmable
        # Until compression: every token in a reserve buffer, the last `window` prefill
        # queries beside them (the saved layout: keys, values, queries while held).
        wdt = window_dtype(self.config, None)
        self.held = (kp.DenseBuffer(info.head_dim, wdt), kp.DenseBuffer(info.v_head_dim, wdt))
        self.obs = Dense()
        self.stored = kp.KeptForm([self.held[0]], [self.held[1]], aside=[self.obs],
                                  optional=[*self.held, self.obs])
        self.sinks = self.codes = self.fresh = None

    def _to_coded_form(self) -> None:
        """A quantized store after compression: sinks in the window dtype, the rest as
        codes, the last step's tokens in full precision until it has attended (saved as
        sinks, fresh tokens, codes: nested entries)."""
        o, info = self.opts, self.layer
        self.sinks, self.fresh = (Dense(), Dense()), (Dense(), Dense())
        self.codes = (kp.store_codes(o, o.k_bits, info.head_dim),
                      kp.store_codes(o, o.v_bits, info.v_head_dim))
        self.stored = kp.KeptForm([self.sinks[0], self.codes[0], self.fresh[0]],
                                  [self.sinks[1], self.codes[1], self.fresh[1]],
                                  state_order=[self.sinks, self.fresh, self.codes])

    @property
    def coded(self) -> bool:
        """Whether kept tokens are held as codes (a quantized store, after compression)."""
        return self.compressed and self.opts.store != "dense"

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.begin(keys, values)  # a step that did not attend leaves its tokens uncoded
        if self.coded:
            wdt = window_dtype(self.config, keys.dtype)
            for fresh, x in zip(self.fresh, (keys, values)):
                fresh.set(x.astype(wdt))
        else:
            for held, x in zip(self.held, (keys, values)):
                held.append(x)
        return keys, values

    def _commit(self) -> None:
        """Code the tokens of the last step (after it attended over them)."""
        if self.fresh is not None and self.fresh[0].n:
            for codes, fresh in zip(self.codes, self.fresh):
                codes.append(fresh.x)
                fresh.set(None)

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        L = queries.shape[2]
        if not self.compressed:
            if L == 1:
                self.compress(queries, scale)
            else:
                # Still in the prompt: remember the last `window` queries.
                q = queries.astype(mx.float32)
                if self.obs.n and L < self.window:
                    q = mx.concatenate([self.obs.x, q], axis=2)
                # A copy: the slice would pin the whole chunk's queries until decode.
                self.obs.set(owned(q[:, :, -self.window:]))
        # New tokens are always the last L held ones, so "causal" aligns at the end.
        return super().attend(queries, scale, "causal" if L > 1 else None)

    @classmethod
    def _attend_rows(cls, rows: list[Any], queries: mx.array, scale: float
                    ) -> mx.array | None:
        return None  # row by row: a row's first decode step compresses it

    def compress(self, queries: mx.array, scale: float) -> None:
        """Evict prompt tokens using the observation window ending at ``queries``."""
        keys = self.held[0].buf.used()[0]
        obs = queries.astype(mx.float32)
        if self.obs.n:
            obs = mx.concatenate([self.obs.x, obs], axis=2)
        obs = obs[:, :, -self.window:]
        prefix = keys.shape[2] - obs.shape[2]
        n_sink = max(0, min(self.sink, prefix))
        if prefix - n_sink > self.capacity:
            votes = window_votes(obs, keys, scale, n_sink, prefix)  # [B, Hq, P]
            idx = choose_tokens(votes, self.layer.n_kv_heads, self.capacity, self.kernel,
                                self.pooling)
            for held in self.held:
                kp.keep_chosen(held, idx, n_sink, prefix)
            self.evicted = prefix - n_sink - self.capacity
        self.compressed = True
        self.obs.set(None)
        # Tokens chosen per head cannot be trimmed by position; without eviction only
        # the sinks (held apart from the codes) are in the way.
        quantized = self.opts.store != "dense"
        self.kept = n_sink + self.capacity if self.evicted else (n_sink if quantized else 0)
        if quantized:
            self._to_codes(n_sink, queries.shape[2])
        self._pin()
        mx.eval(self.held_arrays())  # drop the references to the full prompt

    def _to_codes(self, n_sink: int, L: int) -> None:
        """Hold the compressed prompt as sinks (window dtype) + codes; the last ``L``
        tokens (this step's) stay in full precision until it has attended."""
        held = [h.buf.used()[0] for h in self.held]
        n = held[0].shape[2]
        self._to_coded_form()
        for sink, codes, fresh, x in zip(self.sinks, self.codes, self.fresh, held):
            sink.set(x[:, :, :n_sink], copy=True)
            if n - L > n_sink:
                codes.append(x[:, :, n_sink:n - L])
            fresh.set(x[:, :, n - L:], copy=True)
        for h in self.held:  # the full-precision prompt goes
            h.buf.load(None)

    def _pin(self) -> None:
        self.stored.pinned = (self.kept, f"snapkv cache of layer {self.layer.layer_idx}: "
                              "only its last {tail} tokens can be trimmed, not {n}: the "
                              "{pinned} prompt tokens before them were chosen per KV head "
                              "at compression and cannot be dropped by position")

    @property
    def meta_state(self) -> tuple[str, ...]:
        return CompressedCache.meta_state.fget(self)

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        # Saved before ``kept`` existed: nothing before the end counts as trimmable.
        old = len(v) == len(self.meta_fields) - 1
        CompressedCache.meta_state.fset(self, (*v, "0") if old else v)
        if old and self.compressed:
            self.kept = self.offset - self.evicted
        if self.coded:  # the saved state is laid out as the coded form
            self._to_coded_form()
        self._pin()
