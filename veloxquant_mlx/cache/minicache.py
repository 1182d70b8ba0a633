"""``minicache``: MiniCache, cross-layer KV merging in depth (arXiv 2405.14366).

Adjacent layers ``(l, l + 1)`` of the merge range (default: from the middle of the
model to its end) share one SLERP-merged direction per token and KV head; each
layer keeps its own per-token magnitudes, and the most distant token pairs stay
unmerged (retained) for both layers. The pair's storage lives in a
``MiniCacheCoordinator`` (one per model); this cache is the per-layer view that
mlx_lm calls: its stored form is its two sides of the pair store (``cache.merged``),
from which bytes, ``state``, the dense view and ``trim`` follow. Layers outside the
range (and a last unpaired layer) keep float16 keys/values, or affine codes when the
option ``bits`` is set. Saved prompt caches round-trip: each layer saves its own share
of the pair's store (``state``) and, on load, refills it into the fresh coordinator
that ``assign_roles`` injected.

Attention reads the stored form a range of tokens at a time (``cache.merged``): a prompt
chunk's key blocks rebuild only their own tokens and a decode step reads blocks of at
most ``kernels.BLOCK`` tokens, so no dense copy of the context is built. Where
``ops.dispatch`` picks MLX's fused kernel (a GPU, half precision, a decode over few
keys) that kernel reads the dense view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from veloxquant_mlx.cache.base import DTYPES, LayerInfo
from veloxquant_mlx.cache.merged import PairSide, codes_range
from veloxquant_mlx.cache.minicache_coordinator import MiniCacheCoordinator
from veloxquant_mlx.cache.numerics import StoredNumerics, dense_loss
from veloxquant_mlx.cache.profile import Profile
from veloxquant_mlx.cache.restore_check import FLOATS, flat_state, require_dtypes
from veloxquant_mlx.cache.segment_kinds import ExactCodes
from veloxquant_mlx.cache.segments import Dense, StoredForm
from veloxquant_mlx.cache.stored import StoredFormCache
from veloxquant_mlx.ops import dispatch
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.attention import (
    attend_on_mlx,
    decodes_at_once,
    fit_mask,
    gather_tokens,
    sdpa,
)
from veloxquant_mlx.ops.kernels import BLOCK, on_gpu
from veloxquant_mlx.ops.parts import DensePart, Part, RangePart
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


def _stored_numerics(config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
    """Dense: a pair's merged directions depend on both layers. Nothing is merged
    while every token is in the window; beyond, merging a random tiny model's layers
    moves its logits by up to 1.2 times their scale (window 8): the bound, 2.5,
    catches only crashes, NaN and gross errors there; the lossless settings check
    the bookkeeping."""
    o = config.layer_options(layer.layer_idx)
    return dense_loss(2.5, lossless_until=o.window)


def _tune_grid(context: int) -> list[dict[str, Any]]:
    # The paper's merge (from the middle layer on) alone (about 0.8 of fp16), then
    # with the paper's quantization of every layer (8 to 2 bits), and merging from
    # the first layer (every layer in a pair) for the smallest sizes.
    return [{}, dict(bits=8), dict(bits=4), dict(bits=3), dict(bits=4, start_layer=0),
            dict(bits=2), dict(bits=2, start_layer=0)]


def _assign_roles(layers: list[LayerInfo], config: KVCacheConfig, model: Any) -> None:
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


def _step_arrays(cache: Any) -> list[mx.array]:
    # The partner's step merges into the pair's shared store, which the primary holds.
    if not cache.paired:
        return cache.held_arrays()
    return cache.layer.coordinator.pair_arrays(cache.layer.group_id)


def _check_restored(cache: Any) -> None:
    """The restored form against the options and the pair's counters
    (``cache.restore_check``; its dense view checks the shapes after this)."""
    coded = cache.code_bits is not None
    # Floats everywhere but the codes (uint32) and the retained positions (int32).
    require_dtypes("saved arrays", [a for _, a in flat_state(cache.state)],
                   (*FLOATS, mx.int32, *((mx.uint32,) if coded else ())))
    if not cache.paired:  # the segments checked their own arrays
        return
    coord, pair, member = cache.layer.coordinator, cache.layer.group_id, \
        cache.layer.member_idx
    store = coord.store(pair)
    n_merged, published, consumed = coord.counters(pair)
    for part in (store.keys, store.values):
        if part.direction is not None and \
                isinstance(part.direction, q.Quantized) != coded:
            raise ValueError(f"saved merged directions do not match the option "
                             f"bits={cache.code_bits}")
        idx = part.retained_idx  # gathered from: positions must lie in the merged run
        if idx is not None and idx.size and (idx.dtype != mx.int32 or not (
                0 <= mx.min(idx).item() and mx.max(idx).item() < n_merged)):
            raise ValueError(f"saved retained positions ({idx.dtype}) are not int32 "
                             f"positions below the {n_merged} merged tokens")
    held = n_merged + store.n_pending(member)
    if not published == consumed == cache.offset or held != cache.offset:
        raise ValueError(f"pair counters (merged {n_merged}, published {published}, "
                         f"consumed {consumed}) and {held} tokens held do not match "
                         f"the offset {cache.offset}")


def _blocks(parts: list[Part], dtype: mx.Dtype) -> list[Part]:
    """The parts as dense blocks of at most ``BLOCK`` tokens, what a decode step
    decodes at once (up to ``BLOCK`` tokens: one block, the dense view)."""
    S = sum(p.n for p in parts)
    return [DensePart(gather_tokens(parts, a, min(S, a + BLOCK), dtype)) for a in range(0, S, BLOCK)]


@register
class MiniCacheCache(StoredFormCache):
    """One layer's view of a MiniCache pair (or a plain cache outside the range)."""

    method = "minicache"
    Options = MiniCacheOptions
    profile = Profile(
        check_restored=_check_restored,
        family="merging (cross-layer)",
        paper="MiniCache, Liu et al., NeurIPS 2024 (arXiv 2405.14366)",
        stores="one SLERP direction per token per layer pair + magnitudes + retained tokens",
        cross_layer=True,
        rotatable=True,
        min_layers=2,  # a pair
        stored_numerics=_stored_numerics,
        assign_roles=_assign_roles,
        step_arrays=_step_arrays,
        tune_grid=_tune_grid,
        small=dict(window=8),
        lossless=dict(window=1000),
        few_layer={"start_layer": 0},
    )
    attends = True

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
        self.stored = self._form()

    def _form(self) -> StoredForm:
        """A paired layer's sides of the pair store; other layers keep their own
        window-dtype keys/values, or affine codes of ``bits``."""
        layer = self.layer
        dims = (layer.head_dim, layer.v_head_dim)
        if self.paired:
            k, v = (PairSide(layer.coordinator, layer.group_id, layer.member_idx, side, d)
                    for side, d in enumerate(dims))
            return StoredForm([k], [v])
        if self.code_bits is None:
            name = self.config.window_dtype
            dt = None if name is None else DTYPES[name]
            return StoredForm([Dense(dt)], [Dense(dt)])
        k, v = (ExactCodes(self.code_bits, self.group_size, d) for d in dims)
        return StoredForm([k], [v], state_order=[(k,), (v,)])

    # ---- mlx_lm protocol ----
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start = self.offset
        self.begin(keys, values)
        if self.paired:
            coord, gid = self.layer.coordinator, self.layer.group_id
            if self.layer.member_idx == 0:
                coord.publish(gid, start, keys, values)
            else:
                coord.consume(gid, self.layer.layer_idx, start, keys, values)
        (k,), (v,) = self.stored.keys, self.stored.values
        k.append(keys)
        v.append(values)
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        """Attention as over the dense view, on the engine ``ops.dispatch`` picks for
        dense arrays; the library's engine reads the stored form in ranges instead."""
        L, heads = queries.shape[2], self.layer.n_kv_heads
        S = self.stored.tokens()[0]
        engine = dispatch.route(queries, "arrays", mask, heads, S, label=self._label(),
                                gpu=on_gpu())
        if engine != dispatch.PARTS:
            keys, values = self.keys_and_values(queries.dtype)
            return sdpa(queries, keys, values, scale, mask)
        keys, values = (self._parts(side, queries) for side in (0, 1))
        if decodes_at_once(queries.shape[1], heads, L):
            keys, values = _blocks(keys, queries.dtype), _blocks(values, queries.dtype)
        return attend_on_mlx(queries, keys, values, scale, fit_mask(mask, L, S))

    def _parts(self, side: int, after: mx.array) -> list[Part]:
        """One side's held tokens as parts read a range at a time, their arrays read
        only once ``after`` (the queries) exists: MLX then decodes nothing of this
        layer ahead of its place in the step."""
        (seg,) = (self.stored.keys, self.stored.values)[side]
        if isinstance(seg, PairSide):
            return seg.parts(after)
        if not seg.n:
            return []
        if isinstance(seg, Dense):
            return [DensePart(mx.depends([seg.x], [after])[0])]
        qt = seg.codes()
        qt = q.Quantized(*mx.depends(qt.arrays, [after]), qt.bits, qt.group_size)
        return [RangePart(seg.n, self.layer.n_kv_heads,
                          lambda a, b, dt: codes_range(qt, a, b, dt))]

    @classmethod
    def _attend_rows(cls, rows: list[Any], queries: mx.array, scale: float
                    ) -> mx.array | None:
        # A batch's rows attend one by one, each over its own dense view (``attend``).
        return None

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
        if self.paired and len(v) >= 5:
            self.layer.coordinator.set_counters(self.layer.group_id,
                                                tuple(int(c) for c in v[2:5]))
