"""Merged layer pairs as a segment kind: one layer's side of a MiniCache pair store.

A pair's store (``cache.minicache_coordinator``) is shared by two layers: merged tokens
(a shared direction, per-layer magnitudes, retained tokens unmerged) and each layer's
window of tokens not merged yet. :class:`PairSide` is one layer's keys or values in it,
merged tokens then window, in token order. The store is cut by absolute position, so the
four sides of a pair (two layers, keys and values) each ask for the same cut and the
first one makes it, the whole pair at once or not at all; a side counts its own tokens
so that the later asks see what their layer held.

Attention reads a side as parts (:meth:`PairSide.parts`): the merged run as a
:class:`RangePart` that rebuilds only the token range a key block asks for, then the
window as it is held, so a prompt chunk builds no dense copy of the whole context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from veloxquant_mlx.cache.segments import Segment
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.parts import DensePart, Part, RangePart, Slot


def codes_range(qt: q.Quantized, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
    """Tokens ``start:stop`` (axis 2) of per-token codes, dequantized as a whole
    dequantize gives them."""
    return q.dequantize(q.Quantized(*(a[:, :, start:stop] for a in qt.arrays), qt.bits,
                                    qt.group_size), dtype)


@dataclass(frozen=True)
class MergedRun:
    """One member's merged tokens of one side: the pair's direction ``[B, H, N, D]``
    (floats or codes), the member's magnitudes ``[B, H, N]``, its retained vectors
    ``[B, H, R, D]`` and their positions ``[B, H, R]`` (``None``: nothing retained)."""

    direction: mx.array | q.Quantized
    magnitude: mx.array
    retained: mx.array | None
    positions: mx.array | None

    def tied(self, after: mx.array) -> MergedRun:
        """The same run, its arrays read only once ``after`` exists."""
        d = self.direction
        codes = d.arrays if isinstance(d, q.Quantized) else [d]
        kept = [] if self.positions is None else [self.retained, self.positions]
        tied = mx.depends([*codes, self.magnitude, *kept], [after])
        k = len(codes)
        d = q.Quantized(*tied[:k], d.bits, d.group_size) if isinstance(d, q.Quantized) \
            else tied[0]
        return MergedRun(d, tied[k], *(tied[k + 1:] or (None, None)))

    def read(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        """Tokens ``start:stop`` with the float operations of the coordinator's whole
        rebuild (every value the same): magnitude times direction, retained put back."""
        d = self.direction
        d = codes_range(d, start, stop, dtype) if isinstance(d, q.Quantized) else \
            d[:, :, start:stop].astype(dtype)
        x = self.magnitude[..., start:stop].astype(dtype)[..., None] * d
        idx = self.positions
        if idx is None:
            return x
        # Retained positions outside the range all land on one spare row, dropped after.
        n, (B, H, _, D) = stop - start, x.shape
        at = mx.where((idx >= start) & (idx < stop), idx - start, n)
        x = mx.concatenate([x, mx.zeros((B, H, 1, D), dtype)], axis=2)
        x = mx.put_along_axis(x, mx.broadcast_to(at[..., None], (*at.shape, D)),
                              self.retained.astype(dtype), axis=2)
        return x[:, :, :n]


class PairSide(Segment):
    """Keys (``side`` 0) or values (1) of ``member`` of pair ``pair_id`` of ``coord``.

    State, as the pair's layers always saved it: the keys side one entry (its share of
    the merged keys), the values side two (its share of the merged values, then the
    layer's window ``[keys, values]``)."""

    kind = "merged"
    # Its entries are one layer's share of a store, not one encoder's output per token:
    # the profile's ``check_restored`` and the dense view check them on a restore.
    checked_by_cache = True

    def __init__(self, coord: Any, pair_id: int, member: int, side: int, dim: int) -> None:
        self.coord, self.pair_id, self.member, self.index, self.dim = \
            coord, pair_id, member, side, dim
        self.n_state = 1 + side
        self.seen: int | None = 0  # None: count from the store (after a load)

    @property
    def n(self) -> int:
        if self.seen is None:
            self.seen = self.coord.tokens(self.pair_id, self.member)
        return self.seen

    def arrays(self) -> list[mx.array]:
        return self.coord.side_arrays(self.pair_id, self.member, self.index)

    def accounted(self, batch: int, heads: int) -> int:
        return self.coord.side_accounted(self.pair_id, self.member, self.index, batch,
                                         heads, self.dim)

    def append(self, x: mx.array) -> None:
        """Count ``x``'s tokens: the layer's update gave them to the pair store."""
        self.seen = self.n + x.shape[2]

    def slot(self, packed: bool | None = None) -> Slot:
        xs = [self.dense(mx.float32)] if self.n else []
        return Slot("dense", xs, self.n)

    def dense(self, dtype: mx.Dtype) -> mx.array:
        return self.coord.side_dense(self.pair_id, self.member, self.index, dtype)

    def parts(self, after: mx.array) -> list[Part]:
        """The merged run, then the window, as attention parts; their arrays are read
        only once ``after`` (the layer's queries) exists, so MLX rebuilds no block of
        this layer ahead of its place in the step."""
        store = self.coord.store(self.pair_id)
        part, m = (store.keys, store.values)[self.index], self.member
        window = store.pending[m]
        out: list[Part] = []
        if store.n_merged:
            run = MergedRun(part.direction, part.magnitude[m], part.retained[m],
                            part.retained_idx).tied(after)
            out.append(RangePart(store.n_merged, run.magnitude.shape[1], run.read))
        if window is not None:
            out.append(DensePart(mx.depends([window[self.index]], [after])[0]))
        return out

    def drop_front(self, n: int) -> None:
        raise NotImplementedError("a merged pair cannot drop its oldest tokens")

    def keep(self, n: int) -> None:
        self.coord.cut(self.pair_id, n)  # refused before anything changes, or done
        self.seen = min(self.n, n)

    def state(self) -> list[Any]:
        share = self.coord.share_state(self.pair_id, self.member, self.index)
        if not self.index:
            return [share]
        return [share, self.coord.window_state(self.pair_id, self.member)]

    def load(self, entries: Sequence[Any]) -> None:
        self.coord.load_share(self.pair_id, self.member, self.index, entries[0])
        if self.index:
            self.coord.load_window(self.pair_id, self.member, entries[1])
        self.seen = None

