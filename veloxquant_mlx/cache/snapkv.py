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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..config import KVCacheConfig
from ..ops.attention import attention_weights, sdpa
from ..options import MethodOptions
from ..registry import register
from .base import CompressedCache, LayerInfo

POOLINGS = ("max", "avg")


@dataclass(frozen=True)
class SnapKVOptions(MethodOptions):
    """SnapKV (Li et al., 2024, https://arxiv.org/abs/2404.14469).

    capacity: prompt tokens kept per KV head besides the observation window;
    window: the observation window (last prompt queries, kept in full);
    kernel: pooling kernel over the token axis (odd); pooling: ``"max"`` or ``"avg"``.
    """

    capacity: int = 1024
    window: int = 32
    kernel: int = 7
    pooling: str = "max"

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
class SnapKVCache(CompressedCache):
    """Top-``capacity`` prompt tokens per KV head + the observation window + decode."""

    method = "snapkv"
    family = "eviction"
    paper = "SnapKV, Li et al., 2024 (arXiv 2404.14469)"
    stores = "top-capacity prompt tokens per KV head + observation window"
    Options = SnapKVOptions
    attends = True
    meta_fields = ("offset", "batch_size", "window", "capacity", "kernel", "pooling",
                   "compressed", "evicted")
    meta_types = {"pooling": str, "compressed": lambda s: bool(int(s))}

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.window = self.opts.window
        self.capacity = self.opts.capacity
        self.kernel = self.opts.kernel
        self.pooling = self.opts.pooling
        # Buffers; the first n_held token slots are used, the rest is the reserve.
        self.kbuf: mx.array | None = None
        self.vbuf: mx.array | None = None
        self.n_held = 0
        self.obs_queries: mx.array | None = None  # last `window` prefill queries
        self.compressed = False
        self.evicted = 0  # prompt tokens dropped (per KV head)

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
        n, L = self.n_held, keys.shape[2]
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
                if self.offset > 1:
                    self.compress(queries, scale)
                self.compressed = True
                self.obs_queries = None
            else:
                # Still in the prompt: remember the last `window` queries.
                q = queries.astype(mx.float32)
                if self.obs_queries is not None and L < self.window:
                    q = mx.concatenate([self.obs_queries, q], axis=2)
                # A copy: the slice would pin the whole chunk's queries until decode.
                self.obs_queries = mx.contiguous(q[:, :, -self.window:])
        # New tokens are always the last L held ones, so "causal" aligns at the end.
        return sdpa(queries, self.keys, self.values, scale, "causal" if L > 1 else None)

    def compress(self, queries: mx.array, scale: float) -> None:
        """Evict prompt tokens using the observation window ending at ``queries``."""
        n = self.keys.shape[2]
        obs = queries.astype(mx.float32)
        if self.obs_queries is not None:
            obs = mx.concatenate([self.obs_queries, obs], axis=2)
        obs = obs[:, :, -self.window:]
        W = obs.shape[2]
        prefix = n - W
        if prefix <= self.capacity:
            return
        weights = attention_weights(obs, self.keys, scale, "causal")  # [B, Hq, W, n]
        idx = select_tokens(weights[..., :prefix], self.layer.n_kv_heads, self.capacity,
                            self.kernel, self.pooling)[..., None]
        keep_k = mx.take_along_axis(self.keys[:, :, :prefix], idx, axis=2)
        keep_v = mx.take_along_axis(self.values[:, :, :prefix], idx, axis=2)
        self._set_held(mx.concatenate([keep_k, self.keys[:, :, prefix:]], axis=2),
                       mx.concatenate([keep_v, self.values[:, :, prefix:]], axis=2))
        self.evicted = prefix - self.capacity
        mx.eval(self.kbuf, self.vbuf)  # drop the references to the full prompt

    # ---- storage ----
    def held_arrays(self) -> list[mx.array]:
        return [a for a in (self.kbuf, self.vbuf, self.obs_queries) if a is not None]

    def accounted_bytes(self) -> int:
        if self.kbuf is None:
            return 0
        B, H, slots, D = self.kbuf.shape  # tokens held + reserve
        total = B * H * slots * (D + self.vbuf.shape[3]) * self.kbuf.itemsize
        if self.obs_queries is not None:
            total += self.obs_queries.size * self.obs_queries.itemsize
        return total

    @property
    def state(self) -> list[mx.array]:
        arrays = [self.keys, self.values, self.obs_queries]
        return [a for a in arrays if a is not None]

    @state.setter
    def state(self, v: list[mx.array]) -> None:
        self._set_held(*((v[0], v[1]) if v else (None, None)))
        self.obs_queries = v[2] if len(v) > 2 else None
