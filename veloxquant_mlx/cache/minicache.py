"""``minicache``: MiniCache, cross-layer KV merging in depth (arXiv 2405.14366).

Adjacent layers ``(l, l + 1)`` of the merge range (default: from the middle of the
model to its end) share one SLERP-merged direction per token and KV head; each
layer keeps its own per-token magnitudes, and the most distant token pairs stay
unmerged (retained) for both layers. The pair's storage lives in a
``MiniCacheCoordinator`` (one per model); this cache is the per-layer view that
mlx_lm calls. Layers outside the range (and a last unpaired layer) keep float16
keys/values, or affine codes when the option ``bits`` is set. Saved prompt caches
round-trip: each layer saves its own share of the pair's store (``state``) and, on
load, refills it into the fresh coordinator that ``assign_roles`` injected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from veloxquant_mlx.cache.base import CompressedCache, LayerInfo
from veloxquant_mlx.cache.minicache_coordinator import MiniCacheCoordinator, keep_tokens
from veloxquant_mlx.cache.numerics import StoredNumerics, dense_loss
from veloxquant_mlx.cache.restore_check import FLOATS, flat_state, require_dtypes
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.attention import sdpa
from veloxquant_mlx.options import MethodOptions, config_error
from veloxquant_mlx.register import register

if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig

RETENTION_RULES = ("fraction", "paper")


@dataclass(frozen=True)
class MiniCacheOptions(MethodOptions):
    """MiniCache (Liu et al., NeurIPS 2024, https://arxiv.org/abs/2405.14366).

    start_layer / end_layer: merged layer range (``None``: from the middle of the model
    to its end); t: SLERP interpolation parameter; retention_threshold: gamma of the
    retention rule; retention: ``"fraction"`` (the most distant fraction of tokens stays
    unmerged) or ``"paper"`` (distance below ``d_min + (d_max - d_min) * gamma``);
    bits / group_size: affine codes for the merged directions (``None``: float16);
    window: recent tokens kept unmerged (merging in blocks measured better than per token).
    """

    start_layer: int | None = None
    end_layer: int | None = None
    t: float = 0.5
    retention_threshold: float = 0.05
    retention: str = "fraction"
    bits: int | None = None
    group_size: int | None = None
    window: int = 64

    def __post_init__(self) -> None:
        self.check_int("start_layer", minimum=0, optional=True)
        self.check_int("end_layer", minimum=0, optional=True)
        if None not in (self.start_layer, self.end_layer) and \
                self.end_layer <= self.start_layer:
            raise self.error("end_layer", f"a layer index > start_layer={self.start_layer}")
        self.check_number("t", 0.0, 1.0)
        self.check_number("retention_threshold", 0.0, 1.0, high_open=True)
        self.check_choice("retention", RETENTION_RULES)
        self.check_int("bits", q.AFFINE_BITS, optional=True)
        self.check_int("group_size", q.AFFINE_GROUP_SIZES, optional=True)
        self.check_int("window", minimum=0)


def merge_range(opts: MiniCacheOptions, n_layers: int) -> tuple[int, int]:
    """First and last (inclusive) model layer index of the merge range."""
    start = n_layers // 2 if opts.start_layer is None else opts.start_layer
    end = n_layers - 1 if opts.end_layer is None else opts.end_layer
    where = f"a layer index in [0, {n_layers - 1}] (the model has {n_layers} layers)"
    if not 0 <= start < n_layers:
        raise opts.error("start_layer", where)
    if not 0 <= end < n_layers:
        raise opts.error("end_layer", where)
    if end <= start:
        raise opts.error("end_layer", f"a layer index > start_layer={start} (a pair needs "
                         "two layers)")
    return start, end


@register
class MiniCacheCache(CompressedCache):
    """One layer's view of a MiniCache pair (or a plain cache outside the range)."""

    method = "minicache"
    family = "merging (cross-layer)"
    paper = "MiniCache, Liu et al., NeurIPS 2024 (arXiv 2405.14366)"
    stores = "one SLERP direction per token per layer pair + magnitudes + retained tokens"
    cross_layer = True
    Options = MiniCacheOptions
    attends = True
    rotatable = True
    min_layers = 2  # a pair

    @classmethod
    def stored_numerics(cls, config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
        """Dense: a pair's merged directions depend on both layers. Nothing is merged
        while every token is in the window; beyond, merging a random tiny model's layers
        moves its logits by up to 1.2 times their scale (window 8): the bound, 2.5,
        catches only crashes, NaN and gross errors there; the lossless settings check
        the bookkeeping."""
        o = config.layer_options(layer.layer_idx)
        return dense_loss(2.5, lossless_until=o.window)

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.code_bits = self.opts.bits
        self.group_size = self.opts.group_size or min(64, self.layer.head_dim)
        self.compute_dtype = mx.float32
        self.paired = self.layer.group_size == 2
        if self.paired and self.layer.coordinator is None:
            raise ValueError(
                f"minicache layer {self.layer.layer_idx} is in a merge pair but has no "
                "coordinator: build caches with KVCacheBuilder.for_model"
            )
        if self.code_bits is not None:
            for d in (self.layer.head_dim, self.layer.v_head_dim):
                if d % self.group_size:
                    raise config_error(
                        "group_size", self.group_size,
                        f"a divisor of head_dim={d} of layer {self.layer.layer_idx}",
                        self.method)
        # Plain storage of unpaired layers: float16 or affine codes.
        self.keys: Any = None
        self.values: Any = None
        self._counters: tuple[int, ...] | None = None  # a loaded primary's pair counters

    @classmethod
    def tune_grid(cls, context: int) -> list[dict[str, Any]]:
        # The paper's merge (from the middle layer on) alone (about 0.8 of fp16), then
        # with the paper's quantization of every layer (8 to 2 bits), and merging from
        # the first layer (every layer in a pair) for the smallest sizes.
        return [{}, dict(bits=8), dict(bits=4), dict(bits=3), dict(bits=4, start_layer=0),
                dict(bits=2), dict(bits=2, start_layer=0)]

    @classmethod
    def small_options(cls) -> dict[str, Any]:
        return dict(window=8)

    @classmethod
    def lossless_options(cls) -> dict[str, Any]:
        return dict(window=1000)

    @classmethod
    def few_layer_options(cls) -> dict[str, Any]:
        # The default merge range (the second half) of a two-layer model holds one layer.
        return {"start_layer": 0}

    @classmethod
    def assign_roles(cls, layers: list[LayerInfo], config: KVCacheConfig, model: Any) -> None:
        """Pair adjacent layers of the merge range and inject one coordinator.

        ``layers`` holds only the layers this method compresses: layers of another kind
        in between (recurrent, sliding-window) are skipped, and only layers of the same
        KV shape pair.
        """
        if not layers:
            return
        opts = config.options
        start, end = merge_range(opts, layers[0].n_layers)
        coord = MiniCacheCoordinator(
            t=float(opts.t), retention=float(opts.retention_threshold), window=opts.window,
            bits=opts.bits, group_size=opts.group_size or min(64, layers[0].head_dim),
            rule=opts.retention)
        gid, i = 0, 0
        while i < len(layers):
            a = layers[i]
            b = layers[i + 1] if i + 1 < len(layers) else None
            in_range = start <= a.layer_idx and b is not None and b.layer_idx <= end
            if in_range and \
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
        if self.code_bits is None:
            dt = self.window_dtype(keys.dtype)
            k, v = keys.astype(dt), values.astype(dt)
            self.keys = k if self.keys is None else mx.concatenate([self.keys, k], axis=2)
            self.values = v if self.values is None else mx.concatenate([self.values, v], 2)
            return
        qk = q.quantize(keys, self.code_bits, self.group_size)
        qv = q.quantize(values, self.code_bits, self.group_size)
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

    def check_state(self) -> None:
        """The restored form against the options and the pair's counters
        (``cache.restore_check``; its dense view checks the shapes after this)."""
        coded = self.code_bits is not None
        # Floats everywhere but the codes (uint32) and the retained positions (int32).
        require_dtypes("saved arrays", [a for _, a in flat_state(self.state)],
                       (*FLOATS, mx.int32, *((mx.uint32,) if coded else ())))
        if not self.paired:
            held = [x for x in (self.keys, self.values) if x is not None]
            if any(isinstance(x, q.Quantized) != coded for x in held):
                raise ValueError(f"saved keys/values are {'dense' if coded else 'codes'}; "
                                 f"the option bits={self.code_bits} stores "
                                 f"{'codes' if coded else 'float16'}")
            return
        coord, pair, member = self.layer.coordinator, self.layer.group_id, \
            self.layer.member_idx
        store = coord.store(pair)
        n_merged, published, consumed = coord.counters(pair)
        for part in (store.keys, store.values):
            if part.direction is not None and \
                    isinstance(part.direction, q.Quantized) != coded:
                raise ValueError(f"saved merged directions do not match the option "
                                 f"bits={self.code_bits}")
            idx = part.retained_idx  # gathered from: positions must lie in the merged run
            if idx is not None and idx.size and (idx.dtype != mx.int32 or not (
                    0 <= mx.min(idx).item() and mx.max(idx).item() < n_merged)):
                raise ValueError(f"saved retained positions ({idx.dtype}) are not int32 "
                                 f"positions below the {n_merged} merged tokens")
        held = n_merged + store.n_pending(member)
        if not published == consumed == self.offset or held != self.offset:
            raise ValueError(f"pair counters (merged {n_merged}, published {published}, "
                             f"consumed {consumed}) and {held} tokens held do not match "
                             f"the offset {self.offset}")

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        keys, values = self.dense_kv(queries.dtype)
        return sdpa(queries, keys, values, scale, mask)

    # ---- trimming ----
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens; every kept token stays exactly as held (see
        ``MiniCacheCoordinator.trim`` for merged pairs)."""
        n = max(0, min(n, self.offset))
        keep = self.offset - n
        if self.paired:
            self.layer.coordinator.trim(self.layer.group_id, keep)
        else:
            self.keys = keep_tokens(self.keys, keep)
            self.values = keep_tokens(self.values, keep)
        self.offset = keep
        return n

    # ---- accounting ----
    def step_arrays(self) -> list[mx.array]:
        # The partner's step merges into the pair's shared store, which the primary holds.
        if not self.paired:
            return self.held_arrays()
        coord, gid = self.layer.coordinator, self.layer.group_id
        return coord.held_arrays(gid, 0) + coord.held_arrays(gid, 1)

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
        if self.code_bits is None:
            return B * H * self.offset * (D + Dv) * self.keys.itemsize
        per_tok = sum(q.quantized_bytes(d, self.code_bits, self.group_size) for d in (D, Dv))
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
                if self.code_bits is None:
                    raise ValueError("saved minicache keys/values are quantized but "
                                     "the option bits is None")
                x = q.Quantized(x[0], x[1], x[2], self.code_bits, self.group_size)
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
