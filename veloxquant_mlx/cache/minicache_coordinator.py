"""MiniCache's pairwise coordinator: one primary publishes, one partner merges.

Layers ``l`` (primary, member 0) and ``l + 1`` (partner, member 1) of a merged pair
share one ``PairStore``. Within a forward pass the primary runs first: it publishes
its new keys/values, which wait in its full-precision window so it can attend on
them. The partner then consumes the same token range, and the tokens of both
layers that leave the window are merged: one SLERP direction per token and head,
two magnitudes, and the most distant tokens retained unmerged for both layers.
From then on both layers read the merged store.

The coordinator is single-threaded by construction: mlx_lm calls the layers in
order, so plain dicts need no locking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from veloxquant_mlx.cache.base import NotTrimmableError
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.buffers import owned


def slerp_merge(x0: mx.array, x1: mx.array, t: float
                ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """SLERP of the directions of ``x0`` and ``x1`` along the last axis (float32).

    Returns the merged direction, the two magnitudes (norms) and the angular
    distance ``Omega / pi`` in [0, 1] of every vector pair.
    """
    x0, x1 = x0.astype(mx.float32), x1.astype(mx.float32)
    n0 = mx.linalg.norm(x0, axis=-1, keepdims=True)
    n1 = mx.linalg.norm(x1, axis=-1, keepdims=True)
    eps = 1e-12
    u0, u1 = x0 / mx.maximum(n0, eps), x1 / mx.maximum(n1, eps)
    cos = mx.clip(mx.sum(u0 * u1, axis=-1, keepdims=True), -1.0, 1.0)
    omega = mx.arccos(cos)
    sin = mx.sin(omega)
    # Nearly (anti)parallel pairs: sin(omega) ~ 0, fall back to linear interpolation.
    ok = sin > 1e-6
    safe = mx.where(ok, sin, 1.0)
    a = mx.where(ok, mx.sin((1.0 - t) * omega) / safe, 1.0 - t)
    b = mx.where(ok, mx.sin(t * omega) / safe, t)
    direction = a * u0 + b * u1
    return direction, n0[..., 0], n1[..., 0], omega[..., 0] / math.pi


def _cat(a: mx.array | None, b: mx.array, axis: int = 2) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=axis)


def keep_tokens(x: Any, n: int) -> Any:
    """The first ``n`` tokens (axis 2) of an array, a pair of arrays or affine codes,
    copied (a slice would pin the dropped ones); ``None`` when ``n`` is 0."""
    if x is None or n == 0:
        return None
    if isinstance(x, tuple):
        return tuple(keep_tokens(a, n) for a in x)
    if isinstance(x, q.Quantized):
        return q.Quantized(*(owned(a[:, :, :n]) for a in x.arrays), x.bits,
                           x.group_size)
    return owned(x[:, :, :n])


def _cut_part(part: _Part, keep: int, cut: int) -> None:
    """Drop merged tokens from ``keep`` on, and the ``cut`` retained ones among them."""
    part.direction = keep_tokens(part.direction, keep)
    part.magnitude = [owned(m[..., :keep]) for m in part.magnitude]
    idx = part.retained_idx
    if idx is None or cut == 0:
        return
    held = idx.shape[-1] - cut
    if held == 0:
        part.retained, part.retained_idx = [None, None], None
        return
    # Each row's kept entries first (their order within the row does not matter).
    order = mx.argsort((idx >= keep).astype(mx.int32), axis=-1)[..., :held]
    part.retained_idx = owned(mx.take_along_axis(idx, order, axis=-1))
    gather = mx.broadcast_to(order[..., None], (*order.shape, part.retained[0].shape[-1]))
    part.retained = [owned(mx.take_along_axis(r, gather, axis=2))
                     for r in part.retained]


@dataclass
class _Part:
    """Merged form of one tensor kind (keys or values) of a pair."""

    direction: mx.array | q.Quantized | None = None  # [B, H, N, D], shared
    magnitude: list = field(default_factory=lambda: [None, None])  # [B, H, N] per member
    retained: list = field(default_factory=lambda: [None, None])  # [B, H, R, D] per member
    retained_idx: mx.array | None = None  # [B, H, R] int32 positions, shared

    def arrays(self, member: int) -> list[mx.array]:
        out = [self.magnitude[member], self.retained[member]]
        if member == 0:  # the primary holds the shared parts (counted once)
            d = self.direction
            out += d.arrays if isinstance(d, q.Quantized) else [d]
            out.append(self.retained_idx)
        return [a for a in out if a is not None]


@dataclass
class PairStore:
    """Everything a merged pair holds: merged parts and both full-precision windows."""

    keys: _Part = field(default_factory=_Part)
    values: _Part = field(default_factory=_Part)
    n_merged: int = 0
    # Unmerged recent tokens of each member: [(keys, values) or None, ...].
    pending: list = field(default_factory=lambda: [None, None])
    published_end: int = 0  # tokens the primary has published
    consumed_end: int = 0  # tokens the partner has consumed
    partner: int | None = None  # layer index of the one consumer

    def n_pending(self, member: int) -> int:
        p = self.pending[member]
        return 0 if p is None else p[0].shape[2]

    def n_retained(self) -> tuple[int, int]:
        rk, rv = self.keys.retained_idx, self.values.retained_idx
        return (0 if rk is None else rk.shape[2], 0 if rv is None else rv.shape[2])


class MiniCacheCoordinator:
    """Shared merge store of one model: one ``PairStore`` per merged layer pair.

    ``t``: SLERP parameter; ``retention``: gamma of the retention ``rule``:
    ``"fraction"`` keeps that fraction of each merged block's tokens (per KV head)
    with the largest angular distance unmerged, ``"paper"`` keeps the tokens whose
    distance is below ``d_min + (d_max - d_min) * gamma`` within the block; ``window``: recent tokens kept unmerged (0 merges
    every token as it arrives; otherwise a block is merged whenever ``2 * window``
    tokens are pending, keeping the newest ``window``); ``bits``/``group_size``:
    affine quantization of the merged directions (``bits=None``: float16).
    """

    def __init__(self, t: float = 0.5, retention: float = 0.05, window: int = 0,
                 bits: int | None = None, group_size: int = 64,
                 store_dtype: mx.Dtype = mx.float16, rule: str = "fraction") -> None:
        self.t = t
        self.retention = retention
        self.rule = rule
        self.window = window
        self.bits = bits
        self.group_size = group_size
        self.store_dtype = store_dtype
        self.pairs: dict[int, PairStore] = {}

    def store(self, pair_id: int) -> PairStore:
        if pair_id not in self.pairs:
            self.pairs[pair_id] = PairStore()
        return self.pairs[pair_id]

    # ---- the pairwise contract ----
    def publish(self, pair_id: int, token_start: int, keys: mx.array,
                values: mx.array) -> None:
        """The primary publishes its keys/values for ``[token_start, +L)``."""
        s = self.store(pair_id)
        if s.published_end != s.consumed_end:
            raise RuntimeError(
                f"MiniCache pair {pair_id}: the primary published tokens "
                f"[{token_start}, {token_start + keys.shape[2]}) before its partner "
                f"consumed [{s.consumed_end}, {s.published_end})"
            )
        if token_start != s.published_end:
            raise ValueError(
                f"MiniCache pair {pair_id}: the primary published a range starting at "
                f"token {token_start}, expected {s.published_end}"
            )
        p = s.pending[0]
        dt = self.store_dtype
        s.pending[0] = (keys.astype(dt), values.astype(dt)) if p is None else (
            _cat(p[0], keys.astype(dt)), _cat(p[1], values.astype(dt)))
        s.published_end = token_start + keys.shape[2]

    def consume(self, pair_id: int, layer_idx: int, token_start: int, keys: mx.array,
                values: mx.array) -> None:
        """The partner consumes the published range with its own keys/values and merges."""
        s = self.store(pair_id)
        n = keys.shape[2]
        if s.partner is not None and s.partner != layer_idx:
            raise RuntimeError(
                f"MiniCache pair {pair_id}: layer {layer_idx} tried to consume, but layer "
                f"{s.partner} is already its merge partner (exactly one consumer per pair)"
            )
        if s.published_end == s.consumed_end:
            if token_start < s.consumed_end:
                raise RuntimeError(
                    f"MiniCache pair {pair_id}: tokens [{token_start}, {token_start + n}) "
                    "were already consumed (a second consume of the same range)"
                )
            raise RuntimeError(
                f"MiniCache pair {pair_id}: layer {layer_idx} consumed tokens "
                f"[{token_start}, {token_start + n}) before the primary published them"
            )
        if token_start != s.consumed_end or token_start + n != s.published_end:
            raise ValueError(
                f"MiniCache pair {pair_id}: consumed range [{token_start}, "
                f"{token_start + n}) does not match the published range "
                f"[{s.consumed_end}, {s.published_end})"
            )
        s.partner = layer_idx
        dt = self.store_dtype
        p = s.pending[1]
        s.pending[1] = (keys.astype(dt), values.astype(dt)) if p is None else (
            _cat(p[0], keys.astype(dt)), _cat(p[1], values.astype(dt)))
        s.consumed_end = token_start + n
        pend = s.n_pending(1)
        if self.window == 0:
            self._merge(s, pend)
        elif pend >= 2 * self.window:
            self._merge(s, pend - self.window)

    # ---- merging ----
    def _merge(self, s: PairStore, n: int) -> None:
        """Merge the oldest ``n`` pending tokens of both members into the store."""
        if n <= 0:
            return
        (k0, v0), (k1, v1) = s.pending
        self._merge_part(s.keys, k0[:, :, :n], k1[:, :, :n], s.n_merged)
        self._merge_part(s.values, v0[:, :, :n], v1[:, :, :n], s.n_merged)
        s.n_merged += n
        for m, (k, v) in enumerate(s.pending):
            # Copies (once per merged block): a kept slice would pin the whole window.
            s.pending[m] = None if k.shape[2] == n else (owned(k[:, :, n:]),
                                                           owned(v[:, :, n:]))

    def _merge_part(self, part: _Part, x0: mx.array, x1: mx.array, start: int) -> None:
        direction, n0, n1, dist = slerp_merge(x0, x1, self.t)
        dt = self.store_dtype
        if self.bits is None:
            part.direction = _cat(part.direction, direction.astype(dt))
        else:
            qd = q.quantize(direction, self.bits, self.group_size)
            part.direction = qd if part.direction is None else q.concat(
                [part.direction, qd], axis=2)
        part.magnitude = [_cat(part.magnitude[0], n0.astype(dt)),
                          _cat(part.magnitude[1], n1.astype(dt))]
        local = self._retained(dist)
        if local is None:
            return
        gather = mx.broadcast_to(local[..., None], (*local.shape, x0.shape[-1]))
        part.retained = [_cat(part.retained[0], mx.take_along_axis(x0, gather, 2).astype(dt)),
                         _cat(part.retained[1], mx.take_along_axis(x1, gather, 2).astype(dt))]
        part.retained_idx = _cat(part.retained_idx, local + start)

    def _retained(self, dist: mx.array) -> mx.array | None:
        """Block positions ``[B, H, r]`` kept unmerged in both layers (None: none)."""
        if self.rule == "fraction":
            # The r most distant tokens of each (batch, head).
            r = int(self.retention * dist.shape[-1])
            return None if r == 0 else \
                mx.argpartition(-dist, kth=r - 1, axis=-1)[..., :r].astype(mx.int32)
        # "paper": distance below d_min + (d_max - d_min) * gamma, per (batch, head).
        lo = mx.min(dist, axis=-1, keepdims=True)
        hi = mx.max(dist, axis=-1, keepdims=True)
        below = dist < lo + (hi - lo) * self.retention
        r = int(mx.max(mx.sum(below, axis=-1)).item())
        if r == 0:
            return None
        # Fixed shape: every row keeps its r nearest tokens, a superset of its own set
        # (rows with fewer qualifying tokens keep a few extra exactly; bytes counted).
        return mx.argpartition(dist, kth=r - 1, axis=-1)[..., :r].astype(mx.int32)

    # ---- trimming ----
    def cut(self, pair_id: int, keep: int) -> None:
        """Keep the pair's first ``keep`` tokens (both layers; the call of the pair's
        other layer with the same ``keep`` finds nothing left to do).

        Unmerged tokens are dropped from both windows; merged tokens are dropped from
        the end of the store (directions and magnitudes are per token; retained tokens
        beyond ``keep`` leave with them), so every kept token is held exactly as before.
        A cut that would drop a different number of retained tokens from different
        (batch, head) rows cannot keep the store's fixed shape: ``NotTrimmableError``.
        """
        s = self.store(pair_id)
        if s.consumed_end != s.published_end:
            raise NotTrimmableError(
                f"MiniCache pair {pair_id}: trimmed between its two layers' updates "
                "(finish the forward pass first)")
        if keep >= s.published_end:
            return
        if keep >= s.n_merged:
            for m in (0, 1):
                s.pending[m] = keep_tokens(s.pending[m], keep - s.n_merged)
        else:
            cuts = [self._retained_cut(pair_id, part, keep) for part in (s.keys, s.values)]
            for part, cut in zip((s.keys, s.values), cuts):
                _cut_part(part, keep, cut)
            s.pending = [None, None]
            s.n_merged = keep
        s.published_end = s.consumed_end = keep

    @staticmethod
    def _retained_cut(pair_id: int, part: _Part, keep: int) -> int:
        """Retained tokens at or after ``keep`` in every row (the same count in each)."""
        if part.retained_idx is None:
            return 0
        counts = (part.retained_idx >= keep).sum(axis=-1)
        lo, hi = int(counts.min().item()), int(counts.max().item())
        if lo != hi:
            raise NotTrimmableError(
                f"MiniCache pair {pair_id} is not trimmable back to token {keep}: that cut "
                f"falls inside a merged block and would drop {lo} to {hi} retained tokens "
                "from different heads (the store keeps one count per head); trim fewer "
                "tokens (the unmerged window), or back to the start of that block")
        return hi

    # ---- reading ----
    def reconstruct(self, pair_id: int, member: int, dtype: mx.Dtype
                    ) -> tuple[mx.array | None, mx.array | None]:
        """Transient dense keys/values of one member (merged tokens, then its window)."""
        s = self.store(pair_id)
        ks, vs = [], []
        if s.n_merged:
            ks.append(self._rebuild(s.keys, member, dtype))
            vs.append(self._rebuild(s.values, member, dtype))
        if s.pending[member] is not None:
            ks.append(s.pending[member][0].astype(dtype))
            vs.append(s.pending[member][1].astype(dtype))
        if not ks:
            return None, None
        if len(ks) == 1:
            return ks[0], vs[0]
        return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)

    def _rebuild(self, part: _Part, member: int, dtype: mx.Dtype) -> mx.array:
        d = part.direction
        d = q.dequantize(d, dtype) if isinstance(d, q.Quantized) else d.astype(dtype)
        x = part.magnitude[member].astype(dtype)[..., None] * d
        if part.retained_idx is not None:
            idx = part.retained_idx
            idx = mx.broadcast_to(idx[..., None], (*idx.shape, x.shape[-1]))
            x = mx.put_along_axis(x, idx, part.retained[member].astype(dtype), axis=2)
        return x

    def side_dense(self, pair_id: int, member: int, side: int, dtype: mx.Dtype
                   ) -> mx.array:
        """Transient dense keys (``side`` 0) or values (1) of one member."""
        return self.reconstruct(pair_id, member, dtype)[side]

    # ---- one member's share of a pair, per side (``cache.merged``) ----
    def tokens(self, pair_id: int, member: int) -> int:
        """Tokens one member holds: merged, then its window."""
        s = self.store(pair_id)
        return s.n_merged + s.n_pending(member)

    def side_arrays(self, pair_id: int, member: int, side: int) -> list[mx.array]:
        """Arrays one member holds of one side; the shared direction and positions go to
        the primary (counted once)."""
        s = self.store(pair_id)
        p = s.pending[member]
        return _parts(s)[side].arrays(member) + ([] if p is None else [p[side]])

    def side_accounted(self, pair_id: int, member: int, side: int, batch: int,
                       n_heads: int, dim: int) -> int:
        """Storage formula of one member's share of one side."""
        s = self.store(pair_id)
        item = mx.zeros((), self.store_dtype).itemsize
        r = s.n_retained()[side]
        per_head = s.n_merged * item + r * dim * item  # magnitudes, retained vectors
        per_head += s.n_pending(member) * dim * item
        if member == 0:  # directions + int32 positions
            per_tok = dim * item if self.bits is None else \
                q.quantized_bytes(dim, self.bits, self.group_size)
            per_head += s.n_merged * per_tok + r * 4
        return batch * n_heads * per_head

    def share_state(self, pair_id: int, member: int, side: int) -> list:
        """``[magnitude, retained]`` plus, for the primary, ``[direction, retained
        positions]`` (the direction as ``[codes, scales, biases]`` when quantized)."""
        part = _parts(self.store(pair_id))[side]
        share = [part.magnitude[member], part.retained[member]]
        if member == 0:
            d = part.direction
            share += [d.arrays if isinstance(d, q.Quantized) else d, part.retained_idx]
        return share

    def window_state(self, pair_id: int, member: int) -> list | None:
        p = self.store(pair_id).pending[member]
        return None if p is None else [p[0], p[1]]

    def load_share(self, pair_id: int, member: int, side: int, share: list) -> None:
        """Refill one member's share of one side from ``share_state`` output."""
        part = _parts(self.store(pair_id))[side]
        part.magnitude[member], part.retained[member] = share[0], share[1]
        if member == 0:
            d = share[2]
            if isinstance(d, (list, tuple)):
                if self.bits is None:
                    raise ValueError("saved MiniCache directions are quantized but "
                                     "this coordinator has bits=None (minicache option bits)")
                d = q.Quantized(d[0], d[1], d[2], self.bits, self.group_size)
            part.direction, part.retained_idx = d, share[3]

    def load_window(self, pair_id: int, member: int, window: list | None) -> None:
        self.store(pair_id).pending[member] = None if window is None else \
            (window[0], window[1])

    def counters(self, pair_id: int) -> tuple[int, int, int]:
        """``(n_merged, published_end, consumed_end)`` of a pair (saved by the primary)."""
        s = self.store(pair_id)
        return s.n_merged, s.published_end, s.consumed_end

    def set_counters(self, pair_id: int, counters: tuple[int, int, int]) -> None:
        s = self.store(pair_id)
        s.n_merged, s.published_end, s.consumed_end = counters

    def pair_arrays(self, pair_id: int) -> list[mx.array]:
        """Everything the pair holds (both members)."""
        return [a for m in (0, 1) for side in (0, 1) for a in self.side_arrays(pair_id, m, side)]


def _parts(s: PairStore) -> tuple[_Part, _Part]:
    return s.keys, s.values
