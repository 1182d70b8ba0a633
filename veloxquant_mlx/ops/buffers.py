"""Token buffers that grow with a small reserve, so decode steps write in place.

Each buffer is a set of arrays sharing a token axis (axis 2: ``[B, H, T, ...]``). An
append that fits writes into the reserve; one that does not allocates new arrays with
``T // 32`` spare slots (about 3%) and copies the used part once. Views handed out
(``used()``) are slices and pin the buffers: read them, do not keep them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import mlx.core as mx

T = TypeVar("T")

RESERVE_FRACTION = 32  # spare slots = tokens held // 32


class TokenBuffer:
    """Arrays ``[B, H, slots, ...]`` of which the first ``n`` token slots are used."""

    def __init__(self) -> None:
        self.arrays: list[mx.array] | None = None
        self.n = 0

    @property
    def slots(self) -> int:
        return 0 if self.arrays is None else self.arrays[0].shape[2]

    def append(self, new: list[mx.array]) -> None:
        """Append ``new`` (same layout, ``L`` tokens each) after the used slots."""
        L = new[0].shape[2]
        if self.arrays is None or self.n + L > self.slots:
            spare = (self.n + L) // RESERVE_FRACTION
            self.arrays = [_grown(old, x, self.n, spare) for old, x in
                           zip(self.arrays or [None] * len(new), new)]
        else:
            for buf, x in zip(self.arrays, new):
                buf[:, :, self.n:self.n + L] = x
        self.n += L

    def used(self) -> list[mx.array] | None:
        """The used slots (views), or None when empty."""
        if self.arrays is None or self.n == 0:
            return None
        if self.n == self.slots:
            return list(self.arrays)
        return [a[:, :, :self.n] for a in self.arrays]

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens, in new exact-size arrays (the tail is released)."""
        n = max(0, min(n, self.n))
        self.arrays = [owned(a[:, :, :n]) for a in self.arrays] if n else None
        self.n = n

    def load(self, arrays: list[mx.array] | None) -> None:
        """Adopt saved arrays (no reserve)."""
        self.arrays = list(arrays) if arrays else None
        self.n = 0 if not arrays else arrays[0].shape[2]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays or [])


def _grown(buf: mx.array | None, new: mx.array, used: int, spare: int) -> mx.array:
    """``buf[:, :, :used]`` followed by ``new`` and ``spare`` empty token slots."""
    parts = [] if buf is None or used == 0 else [buf[:, :, :used]]
    parts.append(new)
    if spare:
        parts.append(mx.zeros((*new.shape[:2], spare, *new.shape[3:]), new.dtype))
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
    return owned(out) if len(parts) == 1 else out


def without_front(a: mx.array | None, n: int, axis: int) -> mx.array | None:
    """``a`` without its first ``n`` entries along ``axis``; ``None`` when nothing is
    left. A copy: a kept slice would pin the dropped part."""
    if a is None or n == 0:
        return a
    if n >= a.shape[axis]:
        return None
    index = [slice(None)] * a.ndim
    index[axis] = slice(n, None)
    return owned(a[tuple(index)])


def owned(x: mx.array) -> mx.array:
    """A copy of ``x`` in a buffer of its own size, to keep when its parent is dropped.

    ``mx.contiguous`` returns a slice as it is when the slice happens to be row-
    contiguous (a prefix of one KV head's tokens, one token of a token-major window),
    and an elementwise copy may take over the dying parent's larger buffer (donation
    checks the view's size): both keep the whole parent alive. A concatenation always
    writes a fresh buffer (measured with the allocator: the trimmed tail is freed).
    """
    return mx.concatenate([x, x[..., :0]], axis=-1)


class Views:
    """Views of stored arrays (slices, broadcasts, per-head reshapes) kept from one decode
    step to the next: on a CPU each is an MLX op of some microseconds, and a low-rank
    cache made dozens a layer. An entry is rebuilt when its sources are not the same
    objects; a view pins its source's buffer, so the owner calls ``clear()`` wherever it
    replaces or drops a stored array."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, tuple[tuple[Any, ...], Any]] = {}

    def get(self, key: Hashable, sources: tuple[Any, ...], make: Callable[[], T]) -> T:
        hit = self._entries.get(key)
        if hit is not None and len(hit[0]) == len(sources) and \
                all(a is b for a, b in zip(hit[0], sources)):
            return hit[1]
        out = make()
        self._entries[key] = (sources, out)
        return out

    def clear(self) -> None:
        self._entries.clear()
