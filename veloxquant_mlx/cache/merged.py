"""Merged layer pairs as a segment kind: one layer's side of a MiniCache pair store.

A pair's store (``cache.minicache_coordinator``) is shared by two layers: merged tokens
(a shared direction, per-layer magnitudes, retained tokens unmerged) and each layer's
window of tokens not merged yet. :class:`PairSide` is one layer's keys or values in it,
merged tokens then window, in token order. The store is cut by absolute position, so the
four sides of a pair (two layers, keys and values) each ask for the same cut and the
first one makes it, the whole pair at once or not at all; a side counts its own tokens
so that the later asks see what their layer held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from veloxquant_mlx.cache.segments import Segment
from veloxquant_mlx.ops.parts import Slot


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
