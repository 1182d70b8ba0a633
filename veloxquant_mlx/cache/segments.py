"""A cache's stored form, declared once: named segments of keys and values.

A method says what it stores as a :class:`StoredForm`: its key segments and its value
segments, each in token order (keys and values may be cut at different tokens, as in
KIVI), and the order in which they appear in ``state``. A segment kind knows its bytes,
its ``state`` entries, how attention reads it (an ``ops.parts`` part), its dense view,
how it drops tokens from its front (sliding rings) and from its end (trim), and how the
same segment of several sequences lies side by side (batches). The cache base class
(``CompressedCache``) derives ``held_arrays``, ``accounted_bytes``, ``state``,
``attend``, ``keys_and_values``, ``trim`` and ring drops from the form; a method only decides
which segment a new token goes to.

Kinds: :class:`Dense` (a full-precision run: windows, sinks, residuals),
:class:`TokenCodes` (per-token affine codes along the head dimension, in a buffer
written in place), :class:`ChannelCodes` (per-channel codes along the tokens in whole
groups: KIVI's keys), :class:`CodebookCodes` (per-vector Lloyd-Max codes of rotated
vectors: TurboQuant), :class:`FloatCodes` (microscaled floats, ``nvfp4``). A new
quantizer or layout is a new kind here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import mlx.core as mx

from veloxquant_mlx.ops import codebook as cb
from veloxquant_mlx.ops import fpcodes as fp
from veloxquant_mlx.ops import kernels
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.buffers import TokenBuffer, owned, without_front
from veloxquant_mlx.ops.parts import Part, Slot, slot_parts


class Segment(ABC):
    """``n`` tokens of one side (keys or values) in one stored form."""

    kind: ClassVar[str] = ""
    n_state: ClassVar[int] = 1  # entries the segment takes in a cache's ``state``
    # Tokens the front and the end can be cut in (whole groups for per-channel codes).
    align: int = 1
    side: str = "key"  # or "value": the fastest path can differ by side (ops.kernels)

    @property
    @abstractmethod
    def n(self) -> int:
        """Tokens held."""

    @abstractmethod
    def arrays(self) -> list[mx.array]:
        """Every array the segment keeps alive (a reserve included)."""

    @abstractmethod
    def accounted(self, batch: int, heads: int) -> int:
        """Bytes the storage formula gives for what is held (a reserve included)."""

    @abstractmethod
    def append(self, x: mx.array) -> None:
        """Store ``x`` ``[B, H, L, D]`` (full precision) after the held tokens."""

    @abstractmethod
    def slot(self, packed: bool | None = None) -> Slot:
        """The held tokens as attention reads them (``ops.parts.Slot``); ``packed``:
        multiply the codes with ``mx.quantized_matmul`` where the kind can (None: as
        ``ops.kernels`` chose for this shape class on this backend)."""

    @abstractmethod
    def dense(self, dtype: mx.Dtype) -> mx.array:
        """The held tokens as a transient ``[B, H, n, D]`` array (``n > 0``)."""

    @abstractmethod
    def drop_front(self, n: int) -> None:
        """Forget the ``n`` oldest tokens (a multiple of ``align``)."""

    @abstractmethod
    def keep(self, n: int) -> None:
        """Keep the ``n`` oldest tokens, released exactly (``n`` a multiple of ``align``
        or all of them)."""

    @abstractmethod
    def state(self) -> list[mx.array | None]:
        """``n_state`` entries (``None`` when empty)."""

    @abstractmethod
    def load(self, entries: Sequence[mx.array | None]) -> None:
        """Adopt saved ``state`` entries."""

    def dense_range(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        """Tokens ``start:stop`` as a transient dense array."""
        return self.dense(dtype)[:, :, start:stop]

    def batch(self, rows: Sequence[Segment]) -> list[mx.array] | None:
        """The same segment of several sequences side by side along the batch axis, or
        ``None`` when their lengths differ (attention then runs per row)."""
        if any(r.n != rows[0].n for r in rows) or not rows[0].n:
            return None
        return [mx.concatenate(xs, axis=0) for xs in zip(*(r.state() for r in rows))]


class Dense(Segment):
    """A full-precision run ``[B, H, n, D]`` in ``dtype`` (``None``: the input's)."""

    kind = "dense"

    def __init__(self, dtype: mx.Dtype | None = None) -> None:
        self.dtype = dtype
        self.x: mx.array | None = None

    @property
    def n(self) -> int:
        return 0 if self.x is None else self.x.shape[2]

    def arrays(self) -> list[mx.array]:
        return [] if self.x is None else [self.x]

    def accounted(self, batch: int, heads: int) -> int:
        return 0 if self.x is None else self.x.nbytes

    def append(self, x: mx.array) -> None:
        x = x if self.dtype is None or x.dtype == self.dtype else x.astype(self.dtype)
        self.x = x if self.x is None else mx.concatenate([self.x, x], axis=2)

    def set(self, x: mx.array | None, copy: bool = False) -> None:
        """Hold ``x`` as it is (``copy``: a new buffer, for a slice of a larger array)."""
        if x is not None and self.dtype is not None and x.dtype != self.dtype:
            x, copy = x.astype(self.dtype), False
        self.x = None if x is None or x.shape[2] == 0 else (owned(x) if copy else x)

    def take(self, n: int, copy: bool = True) -> mx.array | None:
        """Remove and return the ``n`` oldest tokens. The rest is copied out (a slice
        pins its parent) unless ``copy`` is False (a decode step: one token more)."""
        if self.x is None or n <= 0:
            return None
        head = self.x[:, :, :n]
        if copy or n >= self.n:
            self.x = without_front(self.x, n, 2)
        else:
            self.x = self.x[:, :, n:]
        return head

    def slot(self, packed: bool | None = None) -> Slot:
        return Slot("dense", self.arrays(), self.n)

    def dense(self, dtype: mx.Dtype) -> mx.array:
        return self.x if self.x.dtype == dtype else self.x.astype(dtype)

    def drop_front(self, n: int) -> None:
        self.x = without_front(self.x, n, 2)

    def keep(self, n: int) -> None:
        if self.x is not None and n < self.n:
            self.x = owned(self.x[:, :, :n]) if n > 0 else None

    def state(self) -> list[mx.array | None]:
        return [self.x]

    def load(self, entries: Sequence[mx.array | None]) -> None:
        self.x = entries[0]


class Buffered(Segment):
    """Per-token arrays in a buffer written in place (a reserve of about 3% of the
    tokens, counted). A per-token kind is also a codec without state: ``encode`` gives
    a chunk's stored arrays, ``slot_of`` reads such arrays back, ``token_bytes`` prices a
    token (what a ring of codes uses, ``cache.kept``)."""

    def __init__(self) -> None:
        self.buf = TokenBuffer()

    @abstractmethod
    def encode(self, x: mx.array) -> list[mx.array]:
        """``x`` ``[B, H, L, D]`` in the stored form: arrays with the token on axis 2."""

    @abstractmethod
    def slot_of(self, arrays: list[mx.array]) -> Slot:
        """Arrays ``encode`` gave (any tokens of them) as a slot."""

    @abstractmethod
    def token_bytes(self) -> int:
        """Bytes of one token of one head."""

    def append(self, x: mx.array) -> None:
        self.buf.append(self.encode(x))

    def accounted(self, batch: int, heads: int) -> int:
        return batch * heads * self.buf.slots * self.token_bytes()

    def slot(self, packed: bool | None = None) -> Slot:
        slot = self.slot_of(list(self.buf.used() or []))
        if packed is None or packed == slot.packed:
            return slot
        return Slot(slot.kind, slot.arrays, slot.n, slot.meta, packed)

    def dense(self, dtype: mx.Dtype) -> mx.array:
        return self.slot_of(self.buf.used()).part().dense(0, self.n, dtype)

    @property
    def n(self) -> int:
        return self.buf.n

    def arrays(self) -> list[mx.array]:
        return list(self.buf.arrays or [])

    def drop_front(self, n: int) -> None:
        used = self.buf.used()
        if used is not None and n:
            self.buf.load([without_front(a, n, 2) for a in used] if n < self.n else None)

    def keep(self, n: int) -> None:
        if n < self.n:
            self.buf.truncate(n)

    def state(self) -> list[mx.array | None]:
        used = self.buf.used()
        return list(used) if used is not None else [None] * self.n_state

    def load(self, entries: Sequence[mx.array | None]) -> None:
        self.buf.load(None if entries[0] is None else list(entries))
        if entries[0] is not None:
            self.adopt(entries)

    def adopt(self, entries: Sequence[mx.array]) -> None:
        """Code new tokens as the loaded ``entries`` are coded (default: one way only)."""


class TokenCodes(Buffered):
    """Per-token affine codes along the head dimension (``mx.quantize``; the input cast
    to ``dtype`` first when given, which sets the scales' dtype)."""

    kind = "token"
    n_state = 3

    def __init__(self, bits: int, group_size: int, dim: int,
                 dtype: mx.Dtype | None = None) -> None:
        super().__init__()
        self.bits, self.group_size, self.dim, self.dtype = bits, group_size, dim, dtype

    def encode(self, x: mx.array) -> list[mx.array]:
        x = x if self.dtype is None else x.astype(self.dtype)
        return q.quantize(x, self.bits, self.group_size).arrays

    def token_bytes(self) -> int:
        return q.quantized_bytes(self.dim, self.bits, self.group_size)

    def slot_of(self, arrays: list[mx.array]) -> Slot:
        n = arrays[0].shape[2] if arrays else 0
        packed = kernels.packed("token", self.bits, self.group_size, self.dim, self.side)
        return Slot("token", arrays, n, (self.bits, self.group_size), packed)

    def codes(self) -> q.Quantized:
        return q.Quantized(*self.buf.used(), self.bits, self.group_size)

    def dense(self, dtype: mx.Dtype) -> mx.array:
        return q.dequantize(self.codes(), dtype)


class ChannelCodes(Segment):
    """Per-channel affine codes along the tokens in whole groups of ``group_size``
    tokens (``quantize.quantize_tokens``): codes ``[B, H, D, n * bits / 32]``."""

    kind = "channel"
    n_state = 3

    def __init__(self, bits: int, group_size: int, dim: int) -> None:
        self.bits, self.group_size, self.dim = bits, group_size, dim
        self.align = group_size
        self.qt: q.Quantized | None = None

    @property
    def n(self) -> int:
        return 0 if self.qt is None else self.qt.scales.shape[-1] * self.group_size

    def arrays(self) -> list[mx.array]:
        return [] if self.qt is None else self.qt.arrays

    def accounted(self, batch: int, heads: int) -> int:
        if not self.n:
            return 0
        return batch * heads * self.dim * q.quantized_bytes(self.n, self.bits, self.group_size)

    def append(self, x: mx.array) -> None:
        # Float32 scales come from the exact min/max of each group.
        new = q.quantize_tokens(x.astype(mx.float32), self.bits, self.group_size)
        self.qt = new if self.qt is None else q.concat_packed([self.qt, new])

    def slot(self, packed: bool | None = None) -> Slot:
        if packed is None:
            packed = kernels.packed("channel", self.bits, self.group_size, self.dim)
        return Slot("channel", self.arrays(), self.n, (self.bits, self.group_size), packed)

    def dense(self, dtype: mx.Dtype) -> mx.array:
        return q.dequantize_tokens(self.qt, dtype)

    def _groups(self, start: int, stop: int) -> q.Quantized | None:
        return q.slice_groups(self.qt, start, stop) if stop > start else None

    def drop_front(self, n: int) -> None:
        if self.qt is not None and n:
            self.qt = self._groups(n // self.group_size, self.n // self.group_size)

    def keep(self, n: int) -> None:
        if self.qt is not None and n < self.n:
            self.qt = self._groups(0, n // self.group_size)

    def dense_range(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        # Only the groups that hold the range are decoded.
        g0, g1 = start // self.group_size, -(-stop // self.group_size)
        x = q.dequantize_tokens(q.slice_groups(self.qt, g0, g1), dtype)
        return x[:, :, start - g0 * self.group_size:stop - g0 * self.group_size]

    def state(self) -> list[mx.array | None]:
        return list(self.qt.arrays) if self.qt is not None else [None] * 3

    def load(self, entries: Sequence[mx.array | None]) -> None:
        self.qt = None if entries[0] is None else q.Quantized(*entries, self.bits,
                                                             self.group_size)


class CodebookCodes(Buffered):
    """Per-vector Lloyd-Max codes of rotated vectors (``ops.codebook``): a float16 scale
    per vector and ``bits`` per channel (fractional widths split the channels), packed
    in bytes where the width allows (``packing``; bit planes in caches saved that way)."""

    kind = "coded"

    def __init__(self, bits: float, dim: int, packing: str = "bytes") -> None:
        super().__init__()
        self.bits, self.dim = bits, dim
        self.widths = tuple(cb.split_bits(bits, dim))
        self.n_state = len(self.widths) + 1
        self.packing = packing

    def encode(self, x: mx.array) -> list[mx.array]:
        return cb.encode(x, self.bits, self.packing).arrays

    def token_bytes(self) -> int:
        return cb.coded_bytes(1, self.dim, self.bits)

    def slot_of(self, arrays: list[mx.array]) -> Slot:
        n = arrays[0].shape[2] if arrays else 0
        return Slot("coded", arrays, n, (self.widths, self.packing))

    def adopt(self, entries: Sequence[mx.array]) -> None:
        self.packing = cb.packing_of(entries, self.widths)  # saved in planes: go on so


class FloatCodes(Buffered):
    """Per-token microscaled float codes (``ops.fpcodes``: ``nvfp4``, ``mxfp4``,
    ``mxfp8``): an 8-bit scale per group of channels, E2M1 / E4M3 values, no biases."""

    kind = "float"
    n_state = 2

    def __init__(self, mode: str, dim: int) -> None:
        super().__init__()
        self.mode, self.dim = mode, dim
        self.bits, self.group_size = fp.BY_NAME[mode]

    def encode(self, x: mx.array) -> list[mx.array]:
        return fp.encode(x, self.mode).arrays

    def token_bytes(self) -> int:
        return fp.vector_bytes(self.dim, self.mode)

    def slot_of(self, arrays: list[mx.array]) -> Slot:
        n = arrays[0].shape[2] if arrays else 0
        packed = kernels.packed("float", self.bits, self.group_size, self.dim, self.side)
        return Slot("float", arrays, n, (self.mode,), packed)


Layout = Sequence["Segment | tuple[Segment, ...]"]


class StoredForm:
    """A cache's keys and values as segments, each side in token order.

    ``state_order`` lists every segment once, in the order of the cache's ``state``
    (the saved-file layout); by default the keys' segments, then the values'. A tuple
    of segments there is saved as one nested entry: their entries in one list, or
    ``None`` while all of them are empty.
    """

    def __init__(self, keys: list[Segment], values: list[Segment],
                 state_order: Layout | None = None) -> None:
        self.keys, self.values = keys, values
        for s in values:
            s.side = "value"
        self.layout = list(state_order) if state_order is not None else [*keys, *values]
        self.order = [s for e in self.layout for s in (e if isinstance(e, tuple) else (e,))]
        if sorted(map(id, self.order)) != sorted(map(id, [*keys, *values])):
            raise ValueError("state_order must list every key and value segment once")

    def segments(self) -> list[Segment]:
        return self.order

    def arrays(self) -> list[mx.array]:
        return [a for s in self.order for a in s.arrays()]

    def accounted(self, batch: int, heads: int) -> int:
        return sum(s.accounted(batch, heads) for s in self.order)

    def tokens(self) -> tuple[int, int]:
        return sum(s.n for s in self.keys), sum(s.n for s in self.values)

    def state(self) -> list[Any]:
        out: list[Any] = []
        for e in self.layout:
            if not isinstance(e, tuple):
                out += e.state()
            else:
                out.append([x for s in e for x in s.state()] if any(s.n for s in e)
                           else None)
        return out

    def load(self, entries: Sequence[Any]) -> None:
        need = sum(1 if isinstance(e, tuple) else e.n_state for e in self.layout)
        if len(entries) != need:
            raise ValueError(f"state has {len(entries)} entries; this stored form takes "
                             f"{need} ({', '.join(s.kind for s in self.order)})")
        i = 0
        for e in self.layout:
            if isinstance(e, tuple):
                _load_group(e, entries[i])
                i += 1
            else:
                e.load(entries[i:i + e.n_state])
                i += e.n_state

    def slots(self, packed: bool | None = None) -> tuple[list[Slot], list[Slot]]:
        """Key and value slots in token order (empty segments included, ``n == 0``)."""
        return [s.slot(packed) for s in self.keys], [s.slot(packed) for s in self.values]

    def parts(self, packed: bool | None = None) -> tuple[list[Part], list[Part]]:
        keys, values = self.slots(packed)
        return slot_parts(keys), slot_parts(values)

    def keys_and_values(self, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        out = []
        for side in (self.keys, self.values):
            xs = [s.dense(dtype) for s in side if s.n]
            out.append(xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=2))
        return out[0], out[1]

    @staticmethod
    def _cut_end(side: list[Segment], n: int) -> None:
        """Drop ``n`` tokens from the end of one side. A segment that can only cut whole
        groups hands the kept tokens of a cut group, decoded, to the dense segment after
        it (what attention already read for them)."""
        left = n
        for i in range(len(side) - 1, -1, -1):
            s = side[i]
            cut = min(left, s.n)
            if not cut:
                continue
            keep = s.n - cut
            whole = keep // s.align * s.align
            tail = s.dense_range(whole, keep, mx.float32) if whole < keep else None
            s.keep(whole)
            left -= cut
            if tail is not None:
                after = side[i + 1] if i + 1 < len(side) else None
                if not isinstance(after, Dense):
                    raise ValueError(f"a {s.kind} segment cut in a group needs a dense "
                                     "segment after it to hold the group's kept tokens")
                after.set(tail, copy=True)
            if not left:
                return

    def trim(self, n: int) -> None:
        """Drop the last ``n`` tokens of keys and values."""
        self._cut_end(self.keys, n)
        self._cut_end(self.values, n)

    def drop_front(self, n: int) -> None:
        """Forget the ``n`` oldest tokens of each side (multiples of every ``align``)."""
        for side in (self.keys, self.values):
            left = n
            for s in side:
                cut = min(left, s.n)
                s.drop_front(cut)
                left -= cut

    @property
    def align(self) -> int:
        """Tokens a front drop must come in (the largest segment alignment)."""
        return max(s.align for s in self.order)


def _load_group(group: tuple[Segment, ...], entry: Sequence[Any] | None) -> None:
    need = sum(s.n_state for s in group)
    entry = [None] * need if entry is None else list(entry)
    if len(entry) != need:
        raise ValueError(f"a nested state entry has {len(entry)} arrays; its segments "
                         f"({', '.join(s.kind for s in group)}) take {need}")
    i = 0
    for s in group:
        s.load(entry[i:i + s.n_state])
        i += s.n_state
