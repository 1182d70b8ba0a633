"""``minicache``: MiniCache, cross-layer KV merging in depth (arXiv 2405.14366).

Adjacent layers ``(l, l + 1)`` of the merge range (default: from the middle of the
model to its end) share one SLERP-merged direction per token and KV head; each
layer keeps its own per-token magnitudes, and the most distant token pairs stay
unmerged (retained) for both layers. The pair's storage lives in a
``MiniCacheCoordinator`` (one per model); this cache is the per-layer view that
mlx_lm calls. Layers outside the range (and a last unpaired layer) keep float16
keys/values, or affine codes when ``minicache_bits`` is set. Saved prompt caches
round-trip: each layer saves its own share of the pair's store (``state``) and, on
load, refills it into the fresh coordinator that ``assign_roles`` injected.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from ..config import KVCacheConfig, config_error
from ..ops import quantize as q
from ..ops.attention import sdpa
from .base import CompressedCache, LayerInfo, require_int
from .minicache_coordinator import MiniCacheCoordinator

RETENTION_RULES = ("fraction", "paper")
DEFAULT_WINDOW = 64  # block merging: measured better perplexity than merging each token


def merge_range(config: KVCacheConfig, n_layers: int) -> tuple[int, int]:
    """First and last (inclusive) model layer index of the merge range."""
    start = config.minicache_start_layer
    end = config.minicache_end_layer
    start = n_layers // 2 if start is None else start
    end = n_layers - 1 if end is None else end
    if not 0 <= start < n_layers:
        raise config_error("minicache_start_layer", config.minicache_start_layer,
                           f"a layer index in [0, {n_layers - 1}] (the model has "
                           f"{n_layers} layers)")
    if not 0 <= end < n_layers:
        raise config_error("minicache_end_layer", config.minicache_end_layer,
                           f"a layer index in [0, {n_layers - 1}] (the model has "
                           f"{n_layers} layers)")
    if end <= start:
        raise config_error("minicache_end_layer", config.minicache_end_layer,
                           f"a layer index > minicache_start_layer={start} (a pair needs "
                           "two layers)")
    return start, end


class MiniCacheCache(CompressedCache):
    """One layer's view of a MiniCache pair (or a plain cache outside the range)."""

    method = "minicache"

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.bits = config.minicache_bits
        self.group_size = config.get("group_size", min(64, self.layer.head_dim))
        self.compute_dtype = mx.float32
        self.paired = self.layer.group_size == 2
        if self.paired and self.layer.coordinator is None:
            raise ValueError(
                f"minicache layer {self.layer.layer_idx} is in a merge pair but has no "
                "coordinator: build caches with KVCacheBuilder.for_model"
            )
        if self.bits is not None:
            for d in (self.layer.head_dim, self.layer.v_head_dim):
                if d % self.group_size:
                    raise config_error(
                        "group_size", self.group_size,
                        f"a divisor of head_dim={d} of layer {self.layer.layer_idx}",
                    )
        # Plain storage of unpaired layers: float16 or affine codes.
        self.keys: Any = None
        self.values: Any = None
        self._counters: tuple[int, ...] | None = None  # a loaded primary's pair counters

    @classmethod
    def validate_config(cls, config: KVCacheConfig) -> None:
        for name in ("minicache_start_layer", "minicache_end_layer"):
            value = getattr(config, name)
            if value is not None:
                require_int(name, value, minimum=0)
        s, e = config.minicache_start_layer, config.minicache_end_layer
        if s is not None and e is not None and e <= s:
            raise config_error("minicache_end_layer", e,
                               f"a layer index > minicache_start_layer={s}")
        t = config.minicache_t
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) \
                or not 0.0 <= t <= 1.0:
            raise config_error("minicache_t", t, "a number in [0, 1]")
        g = config.minicache_retention_threshold
        if isinstance(g, bool) or not isinstance(g, (int, float)) or math.isnan(g) \
                or not 0.0 <= g < 1.0:
            raise config_error("minicache_retention_threshold", g, "a number in [0, 1)")
        if config.bits is not None:
            # The shared ``bits`` would be silently ignored: directions use minicache_bits.
            raise config_error("bits", config.bits,
                               "None for minicache (set minicache_bits to quantize)")
        if config.minicache_retention not in RETENTION_RULES:
            raise config_error("minicache_retention", config.minicache_retention,
                               f"one of {list(RETENTION_RULES)}")
        if config.minicache_bits is not None:
            require_int("minicache_bits", config.minicache_bits, q.AFFINE_BITS)
        if config.group_size is not None:
            require_int("group_size", config.group_size, q.AFFINE_GROUP_SIZES)
        require_int("window", config.get("window", DEFAULT_WINDOW), minimum=0)

    @classmethod
    def assign_roles(cls, layers: list[LayerInfo], config: KVCacheConfig, model: Any) -> None:
        """Pair adjacent layers of the merge range and inject one coordinator."""
        if not layers:
            return
        start, end = merge_range(config, layers[0].n_layers)
        coord = MiniCacheCoordinator(
            t=float(config.minicache_t),
            retention=float(config.minicache_retention_threshold),
            window=config.get("window", DEFAULT_WINDOW),
            bits=config.minicache_bits,
            group_size=config.get("group_size", min(64, layers[0].head_dim)),
            rule=config.minicache_retention,
        )
        gid, i = 0, 0
        while i < len(layers):
            a = layers[i]
            b = layers[i + 1] if i + 1 < len(layers) else None
            in_range = start <= a.layer_idx and b is not None and b.layer_idx <= end
            if in_range and b.layer_idx == a.layer_idx + 1 and \
                    (a.n_kv_heads, a.head_dim, a.v_head_dim) == \
                    (b.n_kv_heads, b.head_dim, b.v_head_dim):
                for m, info in enumerate((a, b)):
                    info.group_id, info.member_idx, info.group_size = gid, m, 2
                    info.coordinator = coord
                i += 2
            else:
                a.group_id, a.member_idx, a.group_size = gid, 0, 1
                i += 1
            gid += 1

    # ---- mlx_lm protocol ----
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.check_input(keys, values)
        self.batch_size = keys.shape[0]
        self.compute_dtype = keys.dtype
        start = self.offset
        self.offset += keys.shape[2]
        if self.paired:
            coord, gid = self.layer.coordinator, self.layer.group_id
            if self.layer.member_idx == 0:
                coord.publish(gid, start, keys, values)
            else:
                coord.consume(gid, self.layer.layer_idx, start, keys, values)
        else:
            self._append_plain(keys, values)
        return keys, values

    def _append_plain(self, keys: mx.array, values: mx.array) -> None:
        if self.bits is None:
            dt = self.window_dtype(keys.dtype)
            k, v = keys.astype(dt), values.astype(dt)
            self.keys = k if self.keys is None else mx.concatenate([self.keys, k], axis=2)
            self.values = v if self.values is None else mx.concatenate([self.values, v], 2)
            return
        qk = q.quantize(keys, self.bits, self.group_size)
        qv = q.quantize(values, self.bits, self.group_size)
        self.keys = qk if self.keys is None else q.concat([self.keys, qk], axis=2)
        self.values = qv if self.values is None else q.concat([self.values, qv], axis=2)

    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """Transient dense keys/values of this layer (never stored)."""
        dtype = dtype or self.compute_dtype
        if self.paired:
            return self.layer.coordinator.reconstruct(self.layer.group_id,
                                                      self.layer.member_idx, dtype)
        if isinstance(self.keys, q.Quantized):
            return q.dequantize(self.keys, dtype), q.dequantize(self.values, dtype)
        return self.keys.astype(dtype), self.values.astype(dtype)

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        keys, values = self.dense_kv(queries.dtype)
        return sdpa(queries, keys, values, scale, mask)

    # ---- accounting ----
    def held_arrays(self) -> list[mx.array]:
        if self.paired:
            return self.layer.coordinator.held_arrays(self.layer.group_id,
                                                      self.layer.member_idx)
        out = []
        for x in (self.keys, self.values):
            if isinstance(x, q.Quantized):
                out.extend(x.arrays)
            elif x is not None:
                out.append(x)
        return out

    def accounted_bytes(self) -> int:
        B, H = max(self.batch_size, 1), self.layer.n_kv_heads
        D, Dv = self.layer.head_dim, self.layer.v_head_dim
        if self.paired:
            return self.layer.coordinator.accounted_bytes(
                self.layer.group_id, self.layer.member_idx, B, H, D, Dv)
        if self.keys is None:
            return 0
        if self.bits is None:
            return B * H * self.offset * (D + Dv) * self.keys.itemsize
        per_tok = sum(q.quantized_bytes(d, self.bits, self.group_size) for d in (D, Dv))
        return B * H * self.offset * per_tok

    # ---- save / load ----
    @property
    def state(self) -> list:
        # What this layer holds, nested (mlx_lm evaluates it after each prefill chunk;
        # save_prompt_cache writes it). A pair's store is split as in ``held_arrays``.
        if self.paired:
            return self.layer.coordinator.member_state(self.layer.group_id,
                                                       self.layer.member_idx)
        return [x.arrays if isinstance(x, q.Quantized) else x
                for x in (self.keys, self.values)]

    @state.setter
    def state(self, v: list) -> None:
        if self.paired:
            self.layer.coordinator.load_member_state(
                self.layer.group_id, self.layer.member_idx, v, self._counters)
            return
        out = []
        for x in v:
            if isinstance(x, (list, tuple)):
                if self.bits is None:
                    raise ValueError("saved minicache keys/values are quantized but "
                                     "minicache_bits is None")
                x = q.Quantized(x[0], x[1], x[2], self.bits, self.group_size)
            out.append(x)
        self.keys, self.values = out

    @property
    def meta_state(self) -> tuple[str, ...]:
        base = (str(self.offset), str(self.batch_size))
        if self.paired and self.layer.member_idx == 0:
            counters = self.layer.coordinator.counters(self.layer.group_id)
            return base + tuple(str(c) for c in counters)
        return base

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        self.offset, self.batch_size = int(v[0]), int(v[1])
        # The primary carries the pair's counters; the partner's setter leaves them.
        self._counters = tuple(int(c) for c in v[2:5]) if len(v) >= 5 else None
