"""Several sequences' stored slots side by side, for one attention call over a batch.

Each row of a batch holds the same segments (same kinds and metadata: one method, one
set of options) of different lengths. A segment of every row is padded with zeros to the
longest row's length and the rows are stacked along the batch axis; a boolean mask drops
the padded positions. Keys and values may be cut at different tokens (KIVI), so their
padded layouts differ: ``value_index`` maps each value position to the key position of
the same token (or to a zero column for padding), and attention reads the probabilities
of the values through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from veloxquant_mlx.ops.parts import Slot


def _padded(slot: Slot, n: int, like: Slot) -> list[mx.array]:
    """``slot``'s arrays with zeros after its tokens up to ``n`` (shapes from ``like``
    when the slot is empty)."""
    out = []
    source = slot if slot.n else like
    for i, (axis, per) in enumerate(like.token_axes()):
        a = source.arrays[i]
        have = round(slot.n * per)
        want = round(n * per)
        shape = list(a.shape)
        shape[axis] = want - have
        pad = mx.zeros(shape, a.dtype)
        if not slot.n:
            out.append(pad)
        elif want == have:
            out.append(a)
        else:
            out.append(mx.concatenate([a, pad], axis=axis))
    return out


def _stack(slots: Sequence[Slot]) -> Slot | None:
    """One segment of every row, padded and stacked; None when nothing is held."""
    n = max(s.n for s in slots)
    if not n:
        return None
    like = next(s for s in slots if s.n)
    rows = [_padded(s, n, like) for s in slots]
    arrays = [mx.concatenate(xs, axis=0) for xs in zip(*rows)]
    return Slot(like.kind, arrays, n, like.meta, like.packed)


def _positions(lengths: list[list[int]]) -> tuple[list[np.ndarray], int]:
    """Per row, the padded position of each real token in order; the padded width."""
    widths = [max(col) for col in zip(*lengths)]
    starts = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
    rows = [np.concatenate([np.arange(s, s + n) for s, n in zip(starts, row)])
            for row in lengths]
    return rows, int(sum(widths))


@dataclass
class BatchedSlots:
    """Keys and values of several rows as slots of batch ``B``; ``mask`` ``[B, 1, 1, S]``
    marks the real key positions; ``value_index`` ``[B, S_v]`` (or None when both layouts
    agree) gives each value position's key position, ``S`` for padding."""

    keys: list[Slot]
    values: list[Slot]
    mask: mx.array
    value_index: mx.array | None


def batch_slots(rows: Sequence[tuple[list[Slot], list[Slot]]]) -> BatchedSlots | None:
    """The rows' ``(key slots, value slots)`` side by side, or None when their segments
    differ in number, kind or metadata (attention then runs per row)."""
    first = rows[0]
    for side in (0, 1):
        sig = [(s.kind, s.meta, s.packed) for s in first[side]]
        if any([(s.kind, s.meta, s.packed) for s in r[side]] != sig for r in rows):
            return None
    sides, layouts = [], []
    for side in (0, 1):
        columns = list(zip(*(r[side] for r in rows)))
        stacked = [_stack(col) for col in columns]
        sides.append([s for s in stacked if s is not None])
        layouts.append(_positions([[s.n for s in r[side]] for r in rows]))
    (kpos, S), (vpos, S_v) = layouts
    if any(len(k) != len(v) for k, v in zip(kpos, vpos)):
        raise ValueError("a row holds different numbers of keys and values")
    mask = np.zeros((len(rows), S), dtype=bool)
    for b, p in enumerate(kpos):
        mask[b, p] = True
    index = None
    if any(not np.array_equal(k, v) for k, v in zip(kpos, vpos)) or S != S_v:
        index = np.full((len(rows), S_v), S, dtype=np.int32)
        for b, (k, v) in enumerate(zip(kpos, vpos)):
            index[b, v] = k
        index = mx.array(index)
    return BatchedSlots(sides[0], sides[1], mx.array(mask[:, None, None, :]), index)
