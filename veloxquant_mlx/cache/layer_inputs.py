"""Stored-form segments of a layer's cached inputs (XQuant, XQuant-CL).

XQuant keeps per token what a layer's keys and values are rebuilt from, not the keys and
values: the attention input X, or its two K/V latents. Each of these is a *part*
``[B, n, w]`` (tokens on axis 1, no heads). The segment kinds here hold one part each:

- :class:`InputCodes`: per-token affine codes of the part along its width
  (``mx.quantize``), scales and biases float16, or float32 for a layer whose values pass
  float16's range (decided once per layer, from the first values coded);
- :class:`InputWindow`: the most recent tokens of the part in full precision;
- :class:`CrossLayerDeltas`: codes of a layer's residual stream minus the previous
  layer's reconstruction (XQuant-CL); its dense view needs that reconstruction.

:class:`LayerInputForm` lays a layer's parts out in token order (coded tokens, then the
window) and says what the X hook reads of the earlier tokens. :class:`LayerInputCache`
derives ``held_arrays``, ``accounted_bytes``, ``state`` and ``trim`` from it; the saved
``state`` is every part's codes (codes, scales, biases), then every part's window.
``rows_of`` reads a run of tokens of any stored form (XQuant-CL's earlier tokens as
:class:`Normalized`, normalized where read), for attention a key block at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from veloxquant_mlx.cache.base import CompressedCache, require_built
from veloxquant_mlx.cache.restore_check import check_arrays
from veloxquant_mlx.cache.segments import Segment
from veloxquant_mlx.ops import factors as fr
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.buffers import owned, without_front
from veloxquant_mlx.ops.parts import Slot

# Beyond this magnitude a group's minimum (its bias) is too close to float16's 65504.
F16_SAFE = 16384.0


class InputCodes(Segment):
    """Per-token affine codes of one stored part ``[B, n, w]`` (``bits``, ``group_size``
    along ``w``), in ``scale_dtype`` scales and biases (set by the form)."""

    kind = "input codes"
    n_state = 3

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size
        self.scale_dtype = mx.float16
        self.qt: q.Quantized | None = None

    @property
    def n(self) -> int:
        return 0 if self.qt is None else self.qt.codes.shape[1]

    def arrays(self) -> list[mx.array]:
        return [] if self.qt is None else self.qt.arrays

    def accounted(self, batch: int, heads: int) -> int:
        if self.qt is None:
            return 0
        width = self.qt.scales.shape[-1] * self.group_size
        scale_bytes = self.qt.scales.itemsize
        return batch * self.n * q.quantized_bytes(width, self.bits, self.group_size,
                                                  scale_bytes)

    def append(self, x: mx.array) -> None:
        new = q.quantize(x, self.bits, self.group_size, self.scale_dtype)
        self.qt = new if self.qt is None else q.concat([self.qt, new], axis=1)

    def slot(self, packed: bool | None = None) -> Slot:
        raise NotImplementedError("a layer input is not attended as it is: the X hook "
                                  "rebuilds keys and values from it")

    def rows(self, plus: mx.array | None = None) -> mx.array:
        """Float32 rows of every held token (``plus`` added as they are decoded)."""
        return fr.load_rows(self.qt, plus=plus)

    def dense(self, dtype: mx.Dtype) -> mx.array:
        return self.rows().astype(dtype)

    def drop_front(self, n: int) -> None:
        if self.qt is not None and n:
            kept = [without_front(a, n, 1) for a in self.qt.arrays]
            self.qt = None if kept[0] is None else q.Quantized(*kept, self.bits,
                                                               self.group_size)

    def keep(self, n: int) -> None:
        # Copies: slices would pin the trimmed codes.
        if self.qt is not None and n < self.n:
            self.qt = q.Quantized(*(owned(a[:, :n]) for a in self.qt.arrays), self.bits,
                                  self.group_size) if n else None

    def state(self) -> list[mx.array | None]:
        return list(self.qt.arrays) if self.qt is not None else [None] * 3

    def load(self, entries: Sequence[mx.array | None]) -> None:
        self.qt = None if entries[0] is None else q.Quantized(*entries, self.bits,
                                                             self.group_size)
        if self.qt is not None:
            self.scale_dtype = self.qt.scales.dtype

    def check(self, what: str, batch: int, width: int) -> None:
        """The loaded codes against what the encoder stores for ``width``."""
        zeros = mx.zeros((batch, self.n, width), mx.float32)
        check_arrays(what, self.arrays(), q.quantize(zeros, self.bits, self.group_size).arrays)


class CrossLayerDeltas(InputCodes):
    """Codes of a layer's residual stream minus the previous layer's reconstruction
    (XQuant-CL): each layer corrects the quantization error of the one before it. Its
    rows exist only on top of that reconstruction, handed on while the model runs."""

    kind = "cross-layer deltas"

    def rows(self, plus: mx.array | None = None) -> mx.array:
        if plus is None:
            raise ValueError("cross-layer deltas decode only on top of the previous "
                             "layer's reconstruction")
        return super().rows(plus)


class InputWindow(Segment):
    """The most recent tokens of one stored part ``[B, n, w]`` in full precision."""

    kind = "input window"

    def __init__(self) -> None:
        self.x: mx.array | None = None

    @property
    def n(self) -> int:
        return 0 if self.x is None else self.x.shape[1]

    def arrays(self) -> list[mx.array]:
        return [] if self.x is None else [self.x]

    def accounted(self, batch: int, heads: int) -> int:
        return 0 if self.x is None else batch * self.n * self.x.shape[2] * self.x.itemsize

    def append(self, x: mx.array) -> None:
        self.x = x if self.x is None else mx.concatenate([self.x, x.astype(self.x.dtype)], 1)

    def set(self, x: mx.array | None) -> None:
        self.x = None if x is None or not x.shape[1] else x

    def slot(self, packed: bool | None = None) -> Slot:
        raise NotImplementedError("a layer input is not attended as it is: the X hook "
                                  "rebuilds keys and values from it")

    def dense(self, dtype: mx.Dtype) -> mx.array:
        return self.x.astype(dtype)

    def drop_front(self, n: int) -> None:
        self.x = without_front(self.x, n, 1)

    def keep(self, n: int) -> None:
        # A copy: a kept slice would pin the trimmed tail.
        if self.x is not None and n < self.n:
            self.x = owned(self.x[:, :n]) if n else None

    def state(self) -> list[mx.array | None]:
        return [self.x]

    def load(self, entries: Sequence[mx.array | None]) -> None:
        self.x = entries[0]


class LayerInputForm:
    """A layer's stored parts in token order: the coded tokens, then up to ``window``
    recent tokens in ``window_dtype``. ``deltas``: the codes are cross-layer deltas."""

    def __init__(self, bits: int, group_size: int, window: int = 0,
                 window_dtype: mx.Dtype = mx.float32, deltas: bool = False) -> None:
        self.bits, self.group_size, self.window = bits, group_size, window
        self.window_dtype, self.deltas = window_dtype, deltas
        self.codes: list[InputCodes] = []  # one per part
        self.recent: list[InputWindow] = []
        self.range_checked = False

    def segments(self) -> list[Segment]:
        return [*self.codes, *self.recent]

    @property
    def n_coded(self) -> int:
        return self.codes[0].n if self.codes else 0

    @property
    def n_recent(self) -> int:
        return self.recent[0].n if self.recent else 0

    @property
    def n(self) -> int:
        return self.n_coded + self.n_recent

    def arrays(self) -> list[mx.array]:
        return [a for s in self.segments() for a in s.arrays()]

    def accounted(self, batch: int) -> int:
        return sum(s.accounted(batch, 1) for s in self.segments())

    # ---- writing ----
    def _parts(self, n: int) -> None:
        kind = CrossLayerDeltas if self.deltas else InputCodes
        while len(self.codes) < n:
            self.codes.append(kind(self.bits, self.group_size))
        while len(self.recent) < n:
            self.recent.append(InputWindow())

    def _code(self, xs: list[mx.array]) -> None:
        """Code float32 ``xs`` (one per part). The first values coded decide the scales'
        dtype: float32 where they pass float16's range (Gemma 3's residual stream
        reaches 1e5, whose group minima would be inf as float16 biases)."""
        if not self.range_checked and not self.n_coded:
            self.range_checked = True
            wide = mx.abs(xs[0]).max().item() > F16_SAFE
            for s in self.codes:
                s.scale_dtype = mx.float32 if wide else mx.float16
        for s, x in zip(self.codes, xs):
            s.append(x)

    def append(self, parts: list[mx.array]) -> None:
        """Store a chunk's float32 ``parts``; what leaves the window is coded."""
        self._parts(len(parts))
        if not self.window:
            self._code(parts)
            return
        wdt = self.window_dtype
        win = parts if not self.n_recent else [
            mx.concatenate([s.x, p.astype(wdt)], axis=1) for s, p in zip(self.recent, parts)]
        overflow = win[0].shape[1] - self.window
        if overflow > 0:
            self._code([w[:, :overflow].astype(mx.float32) for w in win])
            win = [w[:, overflow:] for w in win]
        win = [w.astype(wdt) for w in win]
        if overflow > 1:
            # A kept slice pins its parent (window + chunk): copy it (a no-op after a
            # cast). A decode step pins one token more than the window, no copy.
            win = [owned(w) for w in win]
        for s, w in zip(self.recent, win):
            s.set(w)

    # ---- reading ----
    def earlier(self, joined: bool) -> Any:
        """What the X hook reads of the held tokens. ``joined``: one float32 array per
        part (``None`` when empty); else ``(first position, parts)`` per segment, the
        coded tokens as their codes (decoded where read), the window as floats."""
        pieces = []
        if self.n_coded:
            pieces.append((0, [s.rows() if joined else s.qt for s in self.codes]))
        if self.n_recent:
            pieces.append((self.n_coded, [s.x.astype(mx.float32) for s in self.recent]))
        if not joined:
            return pieces
        if not pieces:
            return None
        per_part = zip(*(parts for _, parts in pieces))
        return [p[0] if len(p) == 1 else mx.concatenate(p, axis=1) for p in per_part]

    def rows(self, plus: mx.array | None = None) -> mx.array:
        """The single coded part's float32 rows (XQuant-CL's reconstruction)."""
        return self.codes[0].rows(plus)

    def dense(self, dtype: mx.Dtype) -> list[mx.array]:
        """Every held token of each part in ``dtype`` (coded tokens decoded, then the
        window), transient."""
        out = []
        for i in range(max(len(self.codes), len(self.recent))):
            pieces = [s.dense(dtype) for s in (self.codes[i:i + 1] + self.recent[i:i + 1])
                      if s.n]
            out.append(pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1))
        return out

    # ---- save / restore / trim ----
    def state(self) -> list[mx.array]:
        """Each part's codes (codes, scales, biases), then each part's window; a segment
        that holds nothing is left out."""
        return [a for s in self.segments() if s.n for a in s.state()]

    def load(self, entries: Sequence[mx.array]) -> None:
        """Adopt ``state``: leading uint32 code triples, then window parts."""
        self.codes, self.recent = [], []
        i = 0
        kind = CrossLayerDeltas if self.deltas else InputCodes
        while i < len(entries) and entries[i].dtype == mx.uint32:
            self.codes.append(kind(self.bits, self.group_size))
            self.codes[-1].load(entries[i:i + 3])
            i += 3
        for x in entries[i:]:
            self.recent.append(InputWindow())
            self.recent[-1].load([x])
        self.range_checked = bool(self.codes)

    def check(self, batch: int, widths: Sequence[int], offset: int) -> None:
        """Restored parts against the stored ``widths`` and the ``offset`` (shapes only)."""
        for name, segs in (("codes", self.codes), ("window", self.recent)):
            if segs and len(segs) != len(widths):
                raise ValueError(f"{len(segs)} stored {name} parts, expected {len(widths)} "
                                 f"(widths {list(widths)})")
        for i, d in enumerate(widths):
            if self.codes:
                self.codes[i].check(f"codes of part {i}", batch, d)
            if self.recent:
                check_arrays(f"window of part {i}", self.recent[i].arrays(),
                             [mx.zeros((batch, self.n_recent, d), mx.float16)])
        if self.n != offset:
            raise ValueError(f"the saved arrays hold {self.n} tokens; the saved offset is "
                             f"{offset}")

    def trim(self, n: int) -> None:
        """Drop the last ``n`` tokens (window first, then the codes); kept tokens stay
        exactly as held."""
        keep = self.n - n
        for s in self.recent:
            s.keep(max(keep - self.n_coded, 0))
        for s in self.codes:
            s.keep(min(keep, s.n))


# ---- what the X hook reads a block of tokens at a time
class Normalized:
    """The first ``n`` rows of a reconstruction ``[B, S, w]`` through a layer's input
    norm, normalized where they are read (XQuant-CL's earlier tokens): the blocked
    attention normalizes a block at a time (the norm is per row)."""

    def __init__(self, h: mx.array, n: int, norm: Callable[[mx.array], mx.array]) -> None:
        self.h, self.n, self.norm = h, n, norm
        self._last: tuple[int, int, mx.array] | None = None

    def rows(self, a: int, b: int) -> mx.array:
        # The keys and then the values read each block: normalized once for both.
        if self._last is None or self._last[:2] != (a, b):
            self._last = (a, b, self.norm(self.h[:, a:b]))
        return self._last[2]


def whole(part: Any) -> Any:
    """A stored form as an array or codes (a :class:`Normalized` one normalized whole)."""
    return part.rows(0, part.n) if isinstance(part, Normalized) else part


def rows_count(part: Any) -> int:
    """Tokens held in a stored form ``[B, n, w]`` (floats, codes or :class:`Normalized`)."""
    return part.n if isinstance(part, Normalized) else fr.rows_count(part)


def rows_of(part: Any, a: int, b: int) -> Any:
    """Tokens ``a:b`` of a stored form ``[B, n, w]`` (views; normalized rows computed)."""
    if isinstance(part, Normalized):
        return part.rows(a, b)
    if (a, b) == (0, rows_count(part)):
        return part
    if isinstance(part, q.Quantized):
        return q.Quantized(*(x[:, a:b] for x in part.arrays), part.bits, part.group_size)
    return part[:, a:b]


class LayerInputCache(CompressedCache):
    """A cache of layer inputs: bytes, ``state`` and ``trim`` from ``self.stored`` (a
    :class:`LayerInputForm`) and what it keeps beside it (``shared_arrays``)."""

    stored: LayerInputForm

    def shared_arrays(self) -> list[mx.array]:
        """What the cache holds beside its form (installed projection factors)."""
        return []

    def held_arrays(self) -> list[mx.array]:
        return self.stored.arrays() + self.shared_arrays()

    def accounted_bytes(self) -> int:
        form = self.stored.accounted(max(self.batch_size, 1))
        return form + sum(a.nbytes for a in self.shared_arrays())

    @property
    def state(self) -> list[mx.array]:
        return self.stored.state()

    @state.setter
    def state(self, v: list[mx.array]) -> None:
        require_built(self)
        self.stored.load(v)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens; kept tokens stay exactly as held."""
        n = max(0, min(self.offset, n))
        if n:
            self.stored.trim(n)
            self.offset -= n
        return n
