"""Several sequences' stored slots side by side, for one attention call over a batch.

Each row of a batch holds the same segments (same kinds and metadata: one method, one
set of options) of different lengths. A segment of every row is padded with zeros to the
longest row's length and the rows are laid side by side; a boolean mask drops the padded
positions. Keys and values may be cut at different tokens (KIVI), so their padded
layouts differ: ``value_index`` maps each value position to the key position of the same
token (or to a zero column for padding), and attention reads the probabilities of the
values through it.

The rows are laid out heads-major, ``[H, B, ...]`` (KV head first, then row): each
array of a segment is then one concatenation of the rows and their padding along the
axis after the head (a free reshape splits it), instead of a pad and a copy per row and
one more copy to stack them. A decode step redoes this for every layer, so the number
of operations counts (8 rows of 700 tokens: about a quarter of a KIVI step went here).
:func:`heads_major` and :func:`rows_major` turn queries and outputs between the layouts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from veloxquant_mlx.ops.parts import Slot


def _zeros(like: mx.array, axis: int, size: int) -> mx.array:
    """Padding: a broadcast zero (a view; ``mx.zeros`` would fill a buffer that the
    concatenation then copies again)."""
    shape = list(like.shape)
    shape[axis] = size
    return mx.broadcast_to(mx.array(0, like.dtype), shape)


def _in_words(a: mx.array) -> bool:
    """Whether bytes (codes) are laid out as 32-bit words: MLX copies a concatenation
    element by element, so a quarter of the elements take about half the time (8 rows of
    700 tokens of 4-bit codes, measured). Needs a last axis of whole words."""
    return a.dtype == mx.uint8 and a.shape[-1] % 4 == 0


def _laid(arrays: Sequence[mx.array | None], like: mx.array, axis: int, have: list[int],
          want: int) -> mx.array:
    """Rows' arrays ``[1, H, ...]`` (``None``: empty) padded to ``want`` entries along
    ``axis`` and laid side by side as ``[H, B, ...]``."""
    B, H = len(arrays), like.shape[1]
    after_head = axis in (2, 2 - like.ndim)  # the token axis is the one after the head
    if after_head and _in_words(like):
        words = [None if a is None else a.view(mx.uint32) for a in arrays]
        return _laid(words, like.view(mx.uint32), axis, have, want).view(like.dtype)
    if after_head:
        pieces = []
        for a, n in zip(arrays, have):
            if n:
                pieces.append(a)
            if want > n:
                pieces.append(_zeros(like, 2, want - n))
    else:  # pad each row along its token axis, then concatenate after the head
        pieces = [a if n == want else _zeros(like, axis, want) if not n else
                  mx.concatenate([a, _zeros(a, axis, want - n)], axis=axis)
                  for a, n in zip(arrays, have)]
    out = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)
    return out.reshape(H, B, -1, *out.shape[3:])


def _stack(slots: Sequence[Slot]) -> Slot | None:
    """One segment of every row, padded and laid heads-major; None when nothing is
    held."""
    n = max(s.n for s in slots)
    if not n:
        return None
    like = next(s for s in slots if s.n)
    arrays = []
    for i, (axis, per) in enumerate(like.token_axes()):
        have = [round(s.n * per) for s in slots]
        rows = [s.arrays[i] if s.n else None for s in slots]
        arrays.append(_laid(rows, like.arrays[i], axis, have, round(n * per)))
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
    """Keys and values of several rows as heads-major slots (``[H, B, ...]``); ``mask``
    ``[1, B, 1, 1, S]`` marks the real key positions; ``value_index`` ``[1, B, 1, S_v]``
    (or None when both layouts agree) gives each value position's key position, ``S``
    for padding."""

    keys: list[Slot]
    values: list[Slot]
    mask: mx.array
    value_index: mx.array | None


def _one_sequence(rows: Sequence[tuple[list[Slot], list[Slot]]]) -> bool:
    return all(a.shape[0] == 1 for r in rows for side in r for s in side for a in s.arrays)


def _tied(rows: Sequence[tuple[list[Slot], list[Slot]]], after: mx.array
          ) -> list[tuple[list[Slot], list[Slot]]]:
    """The rows' slots with every array made to wait for ``after`` (one operation)."""
    flat = iter(mx.depends([a for r in rows for side in r for s in side for a in s.arrays],
                           [after]))
    return [tuple([Slot(s.kind, [next(flat) for _ in s.arrays], s.n, s.meta, s.packed)
                   for s in side] for side in r) for r in rows]


def batch_slots(rows: Sequence[tuple[list[Slot], list[Slot]]],
                after: mx.array | None = None) -> BatchedSlots | None:
    """The rows' ``(key slots, value slots)`` side by side, or None when their segments
    differ in number, kind or metadata, or a row holds more than one sequence
    (attention then runs per row). With ``after`` (the layer's queries), the layout
    waits for it: nothing else ties a layer's layout to its place in the step, and MLX
    laid out later layers' rows ahead (a TurboQuant step of 8 rows of 3000 tokens
    allocated 80-91 MiB at its peak, 29 MiB tied, measured)."""
    first = rows[0]
    for side in (0, 1):
        sig = [(s.kind, s.meta, s.packed) for s in first[side]]
        if any([(s.kind, s.meta, s.packed) for s in r[side]] != sig for r in rows):
            return None
    if not _one_sequence(rows):
        return None
    if after is not None:
        rows = _tied(rows, after)
    sides = []
    for side in (0, 1):
        columns = list(zip(*(r[side] for r in rows)))
        stacked = [_stack(col) for col in columns]
        sides.append([s for s in stacked if s is not None])
    lengths = tuple(tuple(tuple(s.n for s in r[side]) for r in rows) for side in (0, 1))
    mask, index = _layout(*lengths)
    return BatchedSlots(sides[0], sides[1], mx.array(mask),
                        None if index is None else mx.array(index))


@functools.lru_cache(maxsize=2)
def _layout(keys: tuple[tuple[int, ...], ...], values: tuple[tuple[int, ...], ...]
            ) -> tuple[np.ndarray, np.ndarray | None]:
    """The mask and value index of rows whose segments hold these lengths. Every layer
    of a step has the same lengths, so they are worked out once per step; kept as host
    arrays (an MLX array kept here would stay in MLX's memory after its batch is gone)."""
    (kpos, S), (vpos, S_v) = _positions([list(r) for r in keys]), _positions(
        [list(r) for r in values])
    if any(len(k) != len(v) for k, v in zip(kpos, vpos)):
        raise ValueError("a row holds different numbers of keys and values")
    B = len(keys)
    mask = np.zeros((B, S), dtype=bool)
    for b, p in enumerate(kpos):
        mask[b, p] = True
    index = None
    if any(not np.array_equal(k, v) for k, v in zip(kpos, vpos)) or S != S_v:
        index = np.full((B, S_v), S, dtype=np.int32)
        for b, (k, v) in enumerate(zip(kpos, vpos)):
            index[b, v] = k
        index = index.reshape(1, B, 1, S_v)
    return mask.reshape(1, B, 1, 1, S), index


def heads_major(queries: mx.array, kv_heads: int) -> mx.array:
    """Decode queries ``[B, Hq, L, D]`` as ``[H, B * Hq / H, L, D]``: for attention over
    heads-major slots, the rows of a batch stand where the KV heads were."""
    B, Hq, L, D = queries.shape
    q = queries.reshape(B, kv_heads, Hq // kv_heads, L, D).transpose(1, 0, 2, 3, 4)
    return q.reshape(kv_heads, B * (Hq // kv_heads), L, D)


def rows_major(out: mx.array, batch: int) -> mx.array:
    """An output ``[H, B * Hq / H, L, Dv]`` of heads-major attention as ``[B, Hq, L, Dv]``."""
    H, BR, L, Dv = out.shape
    o = out.reshape(H, batch, BR // batch, L, Dv).transpose(1, 0, 2, 3, 4)
    return o.reshape(batch, H * (BR // batch), L, Dv)
