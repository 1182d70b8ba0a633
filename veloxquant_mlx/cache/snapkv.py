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

Decode speed: keys and values live in buffers with a small reserve (1/32 of the
tokens held, counted in ``accounted_bytes``) that decode steps write in place.

Stacked with quantization (``store="affine"`` or ``"codebook"``, ``cache.kvstore``): the
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

from veloxquant_mlx.cache import kvstore as ks
from veloxquant_mlx.cache.base import CompressedCache, LayerInfo, NotTrimmableError
from veloxquant_mlx.cache.numerics import StoredNumerics, dense_loss
from veloxquant_mlx.ops.attention import attention_weights, sdpa, split_attention
from veloxquant_mlx.ops.buffers import TokenBuffer, owned
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
    ``"codebook"`` (``cache.kvstore``); k_bits / v_bits / group_size: of a quantized
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
        ks.check_store_options(self)
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
    B, Hq, _, P = weights.shape
    votes = weights.sum(axis=2)  # [B, Hq, P]
    # GQA: a KV head serves Hq / Hkv query heads; they vote together (mean).
    votes = votes.reshape(B, n_kv_heads, Hq // n_kv_heads, P).mean(axis=2)
    votes = pool_scores(votes, kernel, pooling)
    idx = mx.argpartition(-votes, kth=capacity - 1, axis=-1)[..., :capacity]
    return mx.sort(idx, axis=-1)  # keep the prompt order


@register
class SnapKVCache(ks.StoreCapabilities, CompressedCache):
    """Top-``capacity`` prompt tokens per KV head + the observation window + decode."""

    method = "snapkv"
    family = "eviction"
    paper = "SnapKV, Li et al., 2024 (arXiv 2404.14469)"
    stores = "top-capacity prompt tokens per KV head + observation window"
    Options = SnapKVOptions
    attends = True
    evicts = True
    rotatable = True
    meta_fields = ("offset", "batch_size", "window", "capacity", "kernel", "pooling",
                   "compressed", "evicted", "kept")
    meta_types = {"pooling": str, "compressed": lambda s: bool(int(s))}
    # Defaults for instances that mlx_lm's ``from_state`` builds without __init__.
    store = ks.DENSE
    compressed = False
    sink_kv = fresh = None
    codes = ks.NO_CODES

    @classmethod
    def stored_numerics(cls, config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
        """Dense: the keep-set follows the queries' scores, which a cache-side reference
        does not see. Nothing is evicted up to ``capacity + window`` prompt tokens;
        beyond, evicting all but 16 of a 24-token prompt moves the logits of the tiny
        models by up to 0.57 of their scale (bound 1.0: gross errors only there; the
        lossless settings check the bookkeeping)."""
        o = config.layer_options(layer.layer_idx)
        return dense_loss(1.0, lossless_until=o.capacity + o.window + o.sinks)

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.window = self.opts.window
        self.capacity = self.opts.capacity
        self.kernel = self.opts.kernel
        self.pooling = self.opts.pooling
        self.sink = self.opts.sinks
        info = self.layer
        self.store = ks.make_store(self.opts, info.head_dim, info.v_head_dim, mx.float16,
                                   f"layer {info.layer_idx}")
        # Buffers; the first n_held token slots are used, the rest is the reserve.
        self.kbuf: mx.array | None = None
        self.vbuf: mx.array | None = None
        self.n_held = 0
        self.obs_queries: mx.array | None = None  # last `window` prefill queries
        self.compressed = False
        self.evicted = 0  # prompt tokens dropped (per KV head)
        self.kept = 0  # held tokens chosen per head (sinks + keep-set): not trimmable
        # A quantized store after compression: sinks in the window dtype, the rest coded,
        # the last step's tokens in full precision until it has attended.
        self.sink_kv: ks.Block | None = None
        self.codes = TokenBuffer()
        self.fresh: ks.Block | None = None

    @classmethod
    def tune_grid(cls, context: int) -> list[dict[str, Any]]:
        # Keep-sets from half the prompt down to an eighth, dense and stored as 4- and
        # 3-bit codebook codes (the window of 32 and 4 sinks on top).
        grid: list[dict[str, Any]] = []
        for frac in (0.5, 0.35, 0.25, 0.125):
            cap = max(32, int(context * frac))
            grid.append(dict(capacity=cap))
            grid += [dict(capacity=cap, store="codebook", k_bits=b, v_bits=b)
                     for b in (4, 3)]
        return grid

    @classmethod
    def small_options(cls) -> dict[str, Any]:
        return dict(capacity=16, window=4)

    @classmethod
    def lossless_options(cls) -> dict[str, Any]:
        return dict(capacity=1000)

    @property
    def coded(self) -> bool:
        """Whether kept tokens are held as codes (a quantized store, after compression)."""
        return self.compressed and self.store.quantized

    @property
    def keys(self) -> mx.array | None:
        """The held keys (a view of the buffer without its reserve)."""
        return None if self.kbuf is None else self.kbuf[:, :, :self.n_held]

    @property
    def values(self) -> mx.array | None:
        return None if self.vbuf is None else self.vbuf[:, :, :self.n_held]

    def _set_held(self, keys: mx.array | None, values: mx.array | None) -> None:
        self.kbuf, self.vbuf = keys, values
        self.n_held = 0 if keys is None else keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.check_input(keys, values)
        self.batch_size = keys.shape[0]
        wdt = self.window_dtype(keys.dtype)
        k, v = keys.astype(wdt), values.astype(wdt)
        L = keys.shape[2]
        if self.coded:
            self._flush()  # a step that did not attend leaves its tokens uncoded
            self.fresh = [k, v]
            self.offset += L
            return keys, values
        n = self.n_held
        if self.kbuf is None or n + L > self.kbuf.shape[2]:
            # Grow with a small reserve so decode steps write in place, not concatenate.
            spare = (n + L) // 32
            self.kbuf, self.vbuf = (
                mx.concatenate([*([buf[:, :, :n]] if n else []), new,
                                *([mx.zeros((*new.shape[:2], spare, new.shape[3]), wdt)]
                                  if spare else [])], axis=2)
                for buf, new in ((self.kbuf, k), (self.vbuf, v)))
        else:
            self.kbuf[:, :, n:n + L] = k
            self.vbuf[:, :, n:n + L] = v
        self.n_held = n + L
        self.offset += L
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        L = queries.shape[2]
        if not self.compressed:
            if L == 1:
                self.compress(queries, scale)
                self.compressed = True
                self.obs_queries = None
            else:
                # Still in the prompt: remember the last `window` queries.
                q = queries.astype(mx.float32)
                if self.obs_queries is not None and L < self.window:
                    q = mx.concatenate([self.obs_queries, q], axis=2)
                # A copy: the slice would pin the whole chunk's queries until decode.
                self.obs_queries = owned(q[:, :, -self.window:])
        if self.coded:
            used = self.codes.used()
            coded = None if used is None else self.store.parts(used, queries.dtype)
            # In time order: the last L keys are this step's ("causal" aligns at the end).
            parts = [tuple(p) for p in (self.sink_kv, coded, self.fresh) if p is not None]
            out = split_attention(queries, parts, scale, "causal" if L > 1 else None)
            self._flush()
            return out
        # New tokens are always the last L held ones, so "causal" aligns at the end.
        return sdpa(queries, self.keys, self.values, scale, "causal" if L > 1 else None)

    def compress(self, queries: mx.array, scale: float) -> None:
        """Evict prompt tokens using the observation window ending at ``queries``."""
        n = self.n_held
        obs = queries.astype(mx.float32)
        if self.obs_queries is not None:
            obs = mx.concatenate([self.obs_queries, obs], axis=2)
        obs = obs[:, :, -self.window:]
        prefix = n - obs.shape[2]
        n_sink = max(0, min(self.sink, prefix))
        keep = None  # the prefix after the sinks, when nothing is evicted
        if prefix - n_sink > self.capacity:
            weights = attention_weights(obs, self.keys, scale, "causal")  # [B, Hq, W, n]
            idx = select_tokens(weights[..., n_sink:prefix], self.layer.n_kv_heads,
                                self.capacity, self.kernel, self.pooling) + n_sink
            keep = ks.gather([self.keys[:, :, :prefix], self.values[:, :, :prefix]], idx)
            self.evicted = prefix - n_sink - self.capacity
        # Tokens chosen per head cannot be trimmed by position; without eviction only
        # the sinks (held apart from the codes) are in the way.
        quantized = self.store.quantized
        self.kept = n_sink + self.capacity if self.evicted else (n_sink if quantized else 0)
        if quantized:
            self._to_codes(keep, n_sink, prefix, queries.shape[2])
        elif keep is not None:
            sinks = [self.keys[:, :, :n_sink], self.values[:, :, :n_sink]] if n_sink else None
            tail = [self.keys[:, :, prefix:], self.values[:, :, prefix:]]
            self._set_held(*ks.cat(sinks, keep, tail))
            mx.eval(self.kbuf, self.vbuf)  # drop the references to the full prompt

    def _to_codes(self, keep: ks.Block | None, n_sink: int, prefix: int, L: int) -> None:
        """Hold the compressed prompt as sinks (window dtype) + codes; the last ``L``
        tokens (this step's) stay in full precision until it has attended."""
        held = [self.keys, self.values]
        self.sink_kv = ks.take(held, 0, n_sink)
        if keep is None:
            keep = ks.take(held, n_sink, prefix)
        coded = ks.cat(keep, ks.take(held, prefix, self.n_held - L))
        if coded is not None:
            self.codes.append(self.store.encode(*coded))
        self.fresh = ks.take(held, self.n_held - L)
        self._set_held(None, None)
        mx.eval(self.held_arrays())  # drop the references to the full prompt

    def _flush(self) -> None:
        """Code the tokens of the last step (after it attended over them)."""
        if self.fresh is not None:
            self.codes.append(self.store.encode(*self.fresh))
            self.fresh = None

    # ---- trimming ----
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens: exact after the keep-set, refused inside it."""
        n = max(0, min(self.offset, n))
        tail = self.offset - self.evicted - self.kept
        if n > tail:
            raise NotTrimmableError(
                f"snapkv cache of layer {self.layer.layer_idx}: only its last {tail} tokens "
                f"can be trimmed, not {n}: the {self.kept} prompt tokens before them were "
                "chosen per KV head at compression and cannot be dropped by position")
        if self.coded:
            self._flush()
            self.codes.truncate(self.codes.n - n)
        elif n:
            keep = self.n_held - n  # copies: the trimmed tail and the reserve are released
            self._set_held(*(ks.take([self.keys, self.values], 0, keep) or (None, None)))
            if self.obs_queries is not None:  # the window queries of trimmed tokens go
                w = self.obs_queries.shape[2] - n
                self.obs_queries = owned(self.obs_queries[:, :, :w]) if w > 0 else None
        self.offset -= n
        return n

    def attended_tokens(self) -> int:
        return self.offset - self.evicted

    # ---- storage ----
    def held_arrays(self) -> list[mx.array]:
        out = [self.kbuf, self.vbuf, self.obs_queries, *(self.sink_kv or []),
               *(self.fresh or []), *(self.codes.arrays or [])]
        return [a for a in out if a is not None]

    def accounted_bytes(self) -> int:
        total = sum(a.nbytes for a in (*(self.sink_kv or []), *(self.fresh or [])))
        total += max(self.batch_size, 1) * self.layer.n_kv_heads * self.codes.slots * \
            self.store.token_bytes()
        if self.kbuf is not None:
            B, H, slots, D = self.kbuf.shape  # tokens held + reserve
            total += B * H * slots * (D + self.vbuf.shape[3]) * self.kbuf.itemsize
        if self.obs_queries is not None:
            total += self.obs_queries.size * self.obs_queries.itemsize
        return total

    @property
    def state(self) -> list[Any]:
        if self.coded:
            return [self.sink_kv, self.fresh, self.codes.used()]
        arrays = [self.keys, self.values, self.obs_queries]
        return [a for a in arrays if a is not None]

    @state.setter
    def state(self, v: list[Any]) -> None:
        if self.coded:  # meta_state (set first) says how the state is laid out
            self.sink_kv, self.fresh = v[0], v[1]
            self.codes.load(v[2])
            self.store.adopt(v[2])
            return
        self._set_held(*((v[0], v[1]) if v else (None, None)))
        self.obs_queries = v[2] if len(v) > 2 else None

    def check_state(self) -> None:
        """The restored arrays against the layer, the store and the offset
        (``cache.restore_check``: no dense view, so the arrays themselves)."""
        B, H = self.batch_size, self.layer.n_kv_heads
        dims = (self.layer.head_dim, self.layer.v_head_dim)
        if self.coded:
            n = ks.check_dense(self.sink_kv, B, H, dims, "sink tokens") + \
                ks.check_dense(self.fresh, B, H, dims, "fresh tokens") + \
                self.store.check(self.codes.used(), B, H, "coded tokens")
        else:
            held = None if self.kbuf is None else [self.keys, self.values]
            n = ks.check_dense(held, B, H, dims, "held keys and values")
        if n != self.offset - self.evicted:
            raise ValueError(f"the saved arrays hold {n} tokens; offset {self.offset} less "
                             f"{self.evicted} evicted is {self.offset - self.evicted}")

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
