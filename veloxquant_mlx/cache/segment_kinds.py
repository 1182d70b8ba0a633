"""Segment kinds beside ``cache.segments``' own.

:class:`Grown` is mlx_lm's ``KVCache`` buffer (the dense reference, ``none``).
:class:`ExactCodes` holds per-token affine codes with no reserve (MiniCache's layers
outside its pairs; a pair's sides are ``cache.merged``).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from veloxquant_mlx.cache.segments import Segment, TokenCodes
from veloxquant_mlx.ops.buffers import without_front
from veloxquant_mlx.ops.parts import Slot


class Grown(Segment):
    """A full-precision run in a buffer grown in steps of ``step`` tokens and written in
    place, in the dtype received (mlx_lm's ``KVCache``): an append copies nothing held
    until a step fills. Held bytes include the step's unused slots; accounted bytes are
    the tokens'. ``keep`` only moves the end, as mlx_lm's ``trim`` does: the next
    append writes over the cut tokens."""

    kind = "dense"

    def __init__(self, step: int = 256) -> None:
        self.step = step
        self.buf: mx.array | None = None
        self.used = 0

    @property
    def n(self) -> int:
        return self.used

    def view(self) -> mx.array:
        """The held tokens, a view of the buffer."""
        return self.buf[..., :self.used, :]

    def arrays(self) -> list[mx.array]:
        return [] if self.buf is None else [self.buf]

    def accounted(self, batch: int, heads: int) -> int:
        if self.buf is None:
            return 0
        B, H, _, D = self.buf.shape
        return self.used * B * H * D * self.buf.itemsize

    def encode(self, x: mx.array) -> list[mx.array]:
        """What the segment stores for ``x``: ``x`` itself (restore checks' template)."""
        return [x]

    def append(self, x: mx.array) -> None:
        B, H, L, D = x.shape
        prev = self.used
        if self.buf is None or prev + L > self.buf.shape[2]:
            grown = mx.zeros((B, H, (self.step + L - 1) // self.step * self.step, D), x.dtype)
            self.buf = grown if self.buf is None else \
                mx.concatenate([self.buf[..., :prev, :], grown], axis=2)
        self.used += L
        self.buf[..., prev:self.used, :] = x

    def slot(self, packed: bool | None = None) -> Slot:
        return Slot("dense", [self.view()] if self.used else [], self.used)

    def dense(self, dtype: mx.Dtype | None) -> mx.array:
        x = self.view()
        return x if dtype is None or x.dtype == dtype else x.astype(dtype)

    def drop_front(self, n: int) -> None:
        if self.buf is not None and n:
            self.buf = without_front(self.view(), n, 2)
            self.used = 0 if self.buf is None else self.buf.shape[2]

    def keep(self, n: int) -> None:
        self.used = min(self.used, n)

    def state(self) -> list[mx.array | None]:
        return [None if self.buf is None else self.view()]

    def load(self, entries: Sequence[mx.array | None]) -> None:
        self.buf = entries[0]
        self.used = 0 if self.buf is None else self.buf.shape[2]


class ExactCodes(TokenCodes):
    """Per-token affine codes, each chunk's codes concatenated to the held ones: no
    reserve, so held bytes are the tokens' exactly (a store that grows by whole prompts
    rather than by many single tokens)."""

    def append(self, x: mx.array) -> None:
        new, held = self.encode(x), self.buf.used()
        self.buf.load(new if held is None else
                      [mx.concatenate([a, b], axis=2) for a, b in zip(held, new)])

