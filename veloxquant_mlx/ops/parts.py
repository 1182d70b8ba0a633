"""What :func:`ops.attention.attend_parts` reads: the cache's keys and values as parts.

Parts are laid one after the other along the token axis (keys and values may be cut at
different places, as in KIVI):

- :class:`DensePart`: an array ``[B, H, n, D]`` (windows, sinks, residuals);
- :class:`TokenCodes`: per-token codes along the head dimension, ``x = s * c + b`` per
  group of channels (affine, KIVI values, TurboQuant's codebook and affine codes);
- :class:`ChannelCodes`: per-channel codes along the tokens (KIVI keys);
- :class:`PackedCodes`: per-token codes multiplied by ``mx.quantized_matmul``.

A cache describes each stretch it holds as a :class:`Slot` (plain arrays and metadata,
also what batches and saved caches see); ``slot_parts`` turns slots into parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

import mlx.core as mx

from veloxquant_mlx.ops import codebook as cb
from veloxquant_mlx.ops import fpcodes as fp
from veloxquant_mlx.ops import quantize as q


class Part(Protocol):
    """What :func:`ops.attention.attend_parts` reads: ``n`` tokens of ``heads`` KV heads."""

    n: int
    heads: int

    def key_scores(self, q: mx.array) -> mx.array:
        """``q @ K^T``: ``q`` ``[B, H, rows, D]`` -> ``[B, H, rows, n]``."""

    def value_product(self, p: mx.array) -> mx.array:
        """``p @ V``: ``p`` ``[B, H, rows, n]`` -> ``[B, H, rows, Dv]``."""

    def dense(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        """Tokens ``start:stop`` as floats ``[B, H, stop - start, D]`` (a transient)."""

    def floats(self) -> list[mx.array]:
        """The codes as the float arrays decode multiplies (profiling; dense: none)."""

    def stored(self) -> Stored | None:
        """The stored form as the fused CPU kernel reads it (``ops.native``), or
        ``None`` where it reads no such form."""


# (kind, bits, group size, arrays, biases or None, levels table or None): "dense" holds
# one array; "token" codes and scales, the group along the head dim; "channel" codes and
# scales, the group along the tokens.
Stored = tuple[str, int, int, list[mx.array], mx.array | None, mx.array | None]


class DensePart:
    """Keys or values held as an array ``[B, H, n, D]`` (cast to the compute dtype)."""

    def __init__(self, x: mx.array) -> None:
        self.x, self.n, self.heads = x, x.shape[2], x.shape[1]

    def _as(self, dtype: mx.Dtype) -> mx.array:
        return self.x if self.x.dtype == dtype else self.x.astype(dtype)

    def key_scores(self, q: mx.array) -> mx.array:
        return q @ self._as(q.dtype).swapaxes(-1, -2)

    def value_product(self, p: mx.array) -> mx.array:
        return p @ self._as(p.dtype)

    def dense(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        x = self.x if (start, stop) == (0, self.n) else self.x[:, :, start:stop]
        return x if x.dtype == dtype else x.astype(dtype)

    def floats(self) -> list[mx.array]:
        return []

    def stored(self) -> Stored:
        return ("dense", 0, 0, [self.x], None, None)


Read = Callable[[int, int, mx.Dtype], mx.array]


class RangePart:
    """Stored tokens that attention reads as floats one token range at a time:
    ``read(start, stop, dtype)`` builds only that range (merged pairs, factors, cached
    layer inputs rebuilt on the blocked prompt path). The
    products decode the whole part: callers hand the decode path blocks, not this."""

    def __init__(self, n: int, heads: int, read: Read) -> None:
        self.n, self.heads, self.read = n, heads, read

    def dense(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        return self.read(start, stop, dtype)

    def key_scores(self, qr: mx.array) -> mx.array:
        return qr @ self.read(0, self.n, qr.dtype).swapaxes(-1, -2)

    def value_product(self, p: mx.array) -> mx.array:
        return p @ self.read(0, self.n, p.dtype)

    def floats(self) -> list[mx.array]:
        return []

    def stored(self) -> None:
        return None


Phases = list[tuple[mx.array, int, int]]  # (codes as floats [B, H, n, w], first dim, stride)


class TokenCodes:
    """Per-token codes along the head dimension: ``x = scales * c + biases`` per group.

    ``phases()`` gives the codes as float arrays whose column ``j`` is head dim
    ``first + stride * j``; ``scales`` / ``biases`` are ``[B, H, n, G]`` for ``G`` groups
    of consecutive dims (``None``: nothing to apply); ``decode(start, stop, dtype)``
    rebuilds a token range in dim order (prefill blocks). With ``G > 1`` every phase's
    columns must fall in groups of consecutive columns (true of byte phases).
    ``form``: the stored form for the fused kernel (:meth:`stored`), if it reads it.
    """

    def __init__(self, n: int, dim: int, heads: int, phases: Callable[[], Phases],
                 scales: mx.array | None, biases: mx.array | None,
                 decode: Callable[[int, int, mx.Dtype], mx.array],
                 form: Stored | None = None) -> None:
        self.n, self.dim, self.heads = n, dim, heads
        self.phases, self.scales, self.biases, self.decode = phases, scales, biases, decode
        self.form = form

    def stored(self) -> Stored | None:
        return self.form

    @property
    def groups(self) -> int:
        return 1 if self.scales is None else self.scales.shape[-1]

    def key_scores(self, q: mx.array) -> mx.array:
        B, H, rows, D = q.shape
        G = self.groups
        acc: Any = 0
        for c, first, stride in self.phases():
            w = c.shape[-1]
            qk = q[..., first:first + stride * (w - 1) + 1:stride]  # [B, H, rows, w]
            if G > 1:  # block-diagonal queries: group g's columns meet rows g*rows..
                qk = _block_diagonal(qk, G)  # [B, H, G * rows, w]
            c = c if c.dtype == q.dtype else c.astype(q.dtype)
            acc = acc + qk @ c.swapaxes(-1, -2)
        if self.scales is None:
            return acc
        s = self.scales.astype(q.dtype).swapaxes(-1, -2)  # [B, H, G, n]
        out = acc * s if G == 1 else (acc.reshape(B, H, G, rows, -1) * s[:, :, :, None]).sum(2)
        if self.biases is not None:
            qsum = q.reshape(B, H, rows, G, D // G).sum(axis=-1)  # [B, H, rows, G]
            out = out + qsum @ self.biases.astype(q.dtype).swapaxes(-1, -2)
        return out

    def value_product(self, p: mx.array) -> mx.array:
        B, H, rows, n = p.shape
        G = self.groups
        if self.scales is None:
            ps = p
        else:  # rows scaled by each group's scales, stacked: [B, H, G * rows, n]
            s = self.scales.astype(p.dtype).swapaxes(-1, -2)[:, :, :, None]  # [B,H,G,1,n]
            ps = (p[:, :, None] * s).reshape(B, H, G * rows, n)
        outs = []
        for c, first, stride in self.phases():
            o = ps @ (c if c.dtype == p.dtype else c.astype(p.dtype))  # [B, H, G*rows, w]
            outs.append((o if G == 1 else _diagonal_blocks(o, G), first, stride))
        out = _assemble(outs, self.dim)
        if self.biases is not None:
            pb = p @ self.biases.astype(p.dtype)  # [B, H, rows, G]
            out = (out.reshape(B, H, rows, G, -1) + pb[..., None]).reshape(B, H, rows, -1)
        return out

    def dense(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        return self.decode(start, stop, dtype)

    def floats(self) -> list[mx.array]:
        return [c for c, _, _ in self.phases()]


def _block_diagonal(qk: mx.array, G: int) -> mx.array:
    """``[B, H, rows, w]`` -> ``[B, H, G * rows, w]``: row block ``g`` keeps the columns
    of group ``g`` (``w / G`` consecutive columns each), zeros elsewhere."""
    B, H, rows, w = qk.shape
    eye = mx.eye(G, dtype=qk.dtype)[:, None, :, None]  # [G, 1, G, 1]
    blocks = qk.reshape(B, H, 1, rows, G, w // G) * eye
    return blocks.reshape(B, H, G * rows, w)


def _diagonal_blocks(o: mx.array, G: int) -> mx.array:
    """``[B, H, G * rows, w]`` (row block ``g`` scaled for group ``g``) -> ``[B, H, rows,
    w]`` keeping, for each group's ``w / G`` columns, its own row block."""
    B, H, grows, w = o.shape
    o = o.reshape(B, H, G, grows // G, G, w // G)
    return mx.concatenate([o[:, :, g, :, g] for g in range(G)], axis=-1)


def _assemble(outs: list[tuple[mx.array, int, int]], dim: int) -> mx.array:
    """Per-phase outputs ``[..., w]`` (columns at dims ``first + stride * j``) in dim order."""
    if len(outs) == 1 and outs[0][1:] == (0, 1):
        return outs[0][0]
    per = len(outs)
    if all((f, s) == (k, per) for k, (_, f, s) in enumerate(outs)):
        arrays = [o for o, _, _ in outs]
        return mx.stack(arrays, axis=-1).reshape(*arrays[0].shape[:-1], dim)
    dims = [f + s * j for o, f, s in outs for j in range(o.shape[-1])]
    order = mx.array(sorted(range(dim), key=dims.__getitem__))
    return mx.concatenate([o for o, _, _ in outs], axis=-1)[..., order]


def _slice_quantized(qt: q.Quantized, start: int, stop: int) -> q.Quantized:
    """Tokens ``start:stop`` (axis 2) of per-token codes (views)."""
    if (start, stop) == (0, qt.codes.shape[2]):
        return qt
    return q.Quantized(qt.codes[:, :, start:stop], qt.scales[:, :, start:stop],
                       qt.biases[:, :, start:stop], qt.bits, qt.group_size)


def token_codes(qt: q.Quantized) -> TokenCodes:
    """Per-token ``Quantized`` codes ``[B, H, n, D * bits / 32]`` as a part. Widths that
    straddle bytes (3, 5, 6 bits) are dequantized whole instead (one phase)."""
    n, heads = qt.codes.shape[2], qt.codes.shape[1]
    dim = qt.scales.shape[-1] * qt.group_size

    def decode(start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        part = _slice_quantized(qt, start, stop)
        return (q.dequantize_unpacked if 32 % qt.bits == 0 else q.dequantize)(part, dtype)

    if qt.bits not in q.BYTE_BITS:
        return TokenCodes(n, dim, heads, lambda: [(decode(0, n, mx.float32), 0, 1)],
                          None, None, decode)
    per = 8 // qt.bits
    return TokenCodes(n, dim, heads, lambda: [
        (a, k, per) for k, a in enumerate(q.byte_phases(qt.codes, qt.bits))],
        qt.scales, qt.biases, decode, _token_form(qt))


def shared_by_heads(x: Any, heads: int, n: int | None = None) -> Any:
    """The first ``n`` tokens (all: ``None``) of a stored form ``[B, S, w]`` (floats, or
    per-token ``Quantized`` codes) as one part that every KV head reads: a view with head
    stride 0, no copy (the fused kernel reads such a part once for all heads' rows)."""

    def view(a: mx.array) -> mx.array:
        a = a[:, None] if n is None else a[:, None, :n]
        return mx.broadcast_to(a, (a.shape[0], heads, *a.shape[2:]))

    if isinstance(x, q.Quantized):
        return token_codes(q.Quantized(*(view(a) for a in x.arrays), x.bits, x.group_size))
    return DensePart(view(x))


def _token_form(qt: q.Quantized) -> Stored:
    return ("token", qt.bits, qt.group_size, [qt.codes, qt.scales], qt.biases, None)


def coded_part(c: cb.Coded) -> TokenCodes:
    """Codebook-coded vectors ``[B, H, n, ...]`` (``ops.codebook``) as a part: centroids
    from a compiled polynomial of the code (``codebook.centroid_phases``), the
    per-vector scale applied to the scores and probabilities."""
    n, heads = c.scales.shape[2], c.scales.shape[1]
    dim = sum(w for w, _ in c.widths)

    def decode(start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        part = c if (start, stop) == (0, n) else cb.Coded(
            [p[:, :, start:stop] for p in c.parts], c.scales[:, :, start:stop], c.widths,
            c.packing)
        return cb.decode(part, dtype)

    form = None
    if len(c.widths) == 1 and cb.packed_in_bytes(c.packing, c.widths[0][1]):
        bits = c.widths[0][1]
        form = ("token", bits, dim, [c.parts[0], c.scales], None, _levels(bits))
    return TokenCodes(n, dim, heads, lambda: cb.centroid_phases(c), c.scales, None, decode,
                      form)


@cache
def _levels(bits: int) -> mx.array:
    """The levels codes of ``bits`` decode to, as the fused kernel's table."""
    return mx.array(cb.centroids(bits)[0], dtype=mx.float32)


class ChannelCodes:
    """Per-channel codes along the tokens (``quantize.quantize_tokens``): codes
    ``[B, H, D, n * bits / 32]``, one scale and bias per channel per ``group_size`` tokens.
    ``packed``: scores multiply the packed words with ``mx.quantized_matmul``."""

    def __init__(self, qt: q.Quantized, packed: bool = False) -> None:
        self.qt, self.heads, self.packed = qt, qt.codes.shape[1], packed
        self.n = qt.scales.shape[-1] * qt.group_size

    def _kt(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        """Keys ``[B, H, D, stop - start]`` (decoded from the enclosing whole groups)."""
        g = self.qt.group_size
        g0, g1 = start // g, -(-stop // g)
        per_word = 32 // self.qt.bits
        part = self.qt if (g0, g1) == (0, self.n // g) else q.Quantized(
            self.qt.codes[..., g0 * g // per_word:g1 * g // per_word],
            self.qt.scales[..., g0:g1], self.qt.biases[..., g0:g1], self.qt.bits, g)
        kt = (q.dequantize_unpacked if 32 % self.qt.bits == 0 else q.dequantize)(part, dtype)
        lo, hi = start - g0 * g, stop - g0 * g
        return kt if (lo, hi) == (0, kt.shape[-1]) else kt[..., lo:hi]

    def key_scores(self, qr: mx.array) -> mx.array:
        k, dt = self.qt, qr.dtype
        if self.packed:
            return mx.quantized_matmul(
                qr, k.codes, k.scales.astype(dt), k.biases.astype(dt),
                transpose=False, group_size=k.group_size, bits=k.bits)
        if k.bits not in q.BYTE_BITS or dt != mx.float32:
            return qr @ self._kt(0, self.n, dt)
        # Tokens per*j + k of every channel in phase k: scores come out in phase order
        # and are interleaved back (a small [rows, n] copy).
        outs = [qr @ c for c in q.channel_phases(k)]  # [B, H, rows, n / per]
        B, H, rows, _ = qr.shape
        s = outs[0] if len(outs) == 1 else mx.stack(outs, axis=-1)
        return s.reshape(B, H, rows, self.n)

    def value_product(self, p: mx.array) -> mx.array:
        return p @ self.dense(0, self.n, p.dtype)

    def dense(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        return self._kt(start, stop, dtype).swapaxes(-1, -2)

    def stored(self) -> Stored | None:
        k = self.qt
        return (("channel", k.bits, k.group_size, [k.codes, k.scales], k.biases, None)
                if k.bits in q.BYTE_BITS else None)

    def floats(self) -> list[mx.array]:
        if self.packed:
            return []
        if self.qt.bits in q.BYTE_BITS:
            return q.channel_phases(self.qt)
        return [self._kt(0, self.n, mx.float32)]


class PackedCodes:
    """Per-token codes multiplied on the packed words with ``mx.quantized_matmul``."""

    def __init__(self, qt: q.Quantized) -> None:
        self.qt, self.n, self.heads = qt, qt.codes.shape[2], qt.codes.shape[1]

    def _qmm(self, x: mx.array, transpose: bool) -> mx.array:
        qt, dt = self.qt, x.dtype
        return mx.quantized_matmul(x, qt.codes, qt.scales.astype(dt), qt.biases.astype(dt),
                                   transpose=transpose, group_size=qt.group_size,
                                   bits=qt.bits)

    def key_scores(self, q: mx.array) -> mx.array:
        return self._qmm(q, True)

    def value_product(self, p: mx.array) -> mx.array:
        return self._qmm(p, False)

    def dense(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        return q.dequantize(_slice_quantized(self.qt, start, stop), dtype)

    def floats(self) -> list[mx.array]:
        return []

    def stored(self) -> Stored | None:
        return _token_form(self.qt) if self.qt.bits in q.BYTE_BITS else None


class FloatCodes:
    """Per-token microscaled float codes (``ops.fpcodes``): multiplied fused on the codes
    (``packed``) or decoded to floats first (the slot's blocks bound the transient)."""

    def __init__(self, c: fp.FPCodes, packed: bool) -> None:
        self.c, self.packed = c, packed
        self.n, self.heads = c.codes.shape[2], c.codes.shape[1]

    def key_scores(self, q: mx.array) -> mx.array:
        if self.packed:
            return fp.matmul(q, self.c, True)
        return q @ fp.decode(self.c, q.dtype).swapaxes(-1, -2)

    def value_product(self, p: mx.array) -> mx.array:
        if self.packed:
            return fp.matmul(p, self.c, False)
        return p @ fp.decode(self.c, p.dtype)

    def dense(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        part = self.c if (start, stop) == (0, self.n) else fp.FPCodes(
            self.c.codes[:, :, start:stop], self.c.scales[:, :, start:stop], self.c.mode)
        return fp.decode(part, dtype)

    def floats(self) -> list[mx.array]:
        return [] if self.packed else [fp.decode(self.c)]

    def stored(self) -> None:
        return None


def as_part(x: Any, quantized_matmul: bool = False) -> Any:
    """An array, per-token ``Quantized`` codes or a part, as a part."""
    if isinstance(x, q.Quantized):
        return PackedCodes(x) if quantized_matmul else token_codes(x)
    if isinstance(x, mx.array):
        return DensePart(x)
    return x


# ------------------------------------------------------------------ slots
@dataclass
class Slot:
    """One stretch of one sequence's keys or values, as a cache hands it to attention.

    ``kind``: ``"dense"`` (one array ``[B, H, n, D]``), ``"token"`` (per-token
    ``Quantized`` codes, scales, biases; ``meta`` = bits, group size), ``"coded"``
    (codebook parts then scales; ``meta`` = widths, packing), ``"float"`` (microscaled
    float codes and scales; ``meta`` = the MLX mode) or ``"channel"`` (per-channel
    ``Quantized`` codes along the tokens, ``[B, H, D, n * bits / 32]``; ``meta`` = bits,
    group size). ``n == 0``: the sequence has nothing there yet (``arrays`` empty).
    ``packed``: multiply the codes with ``mx.quantized_matmul``.
    """

    kind: str
    arrays: list[mx.array]
    n: int
    meta: tuple = ()
    packed: bool = False

    def token_axes(self) -> list[tuple[int, float]]:
        """Per array: (its token axis, entries per token along it)."""
        if self.kind == "channel":  # codes [B, H, D, n * bits / 32]; scales [.., n / g]
            bits, group = self.meta
            return [(-1, bits / 32), (-1, 1 / group), (-1, 1 / group)]
        return [(2, 1.0)] * len(self.arrays)

    def blocks(self, size: int) -> list[Slot]:
        """The slot as consecutive slots of at most ``size`` tokens (views; whole groups
        for per-channel codes), so what attention decodes at once stays bounded."""
        if self.kind == "channel":
            size = max(size // self.meta[1], 1) * self.meta[1]
        if self.n <= size:
            return [self]
        out = []
        for start in range(0, self.n, size):
            stop = min(self.n, start + size)
            arrays = []
            for a, (axis, per) in zip(self.arrays, self.token_axes()):
                index = [slice(None)] * a.ndim
                index[axis] = slice(round(start * per), round(stop * per))
                arrays.append(a[tuple(index)])
            out.append(Slot(self.kind, arrays, stop - start, self.meta, self.packed))
        return out

    def part(self) -> Part:
        """The slot as a part :func:`attend_parts` reads."""
        a, m = self.arrays, self.meta
        if self.kind == "dense":
            return DensePart(a[0])
        if self.kind == "coded":
            return coded_part(cb.Coded(a[:-1], a[-1], *m))
        if self.kind == "float":
            return FloatCodes(fp.FPCodes(a[0], a[1], m[0]), self.packed)
        qt = q.Quantized(*a, *m)
        if self.kind == "channel":
            return ChannelCodes(qt, self.packed)
        return PackedCodes(qt) if self.packed else token_codes(qt)


def slot_parts(slots: Sequence[Slot]) -> list[Part]:
    """The non-empty slots as parts."""
    return [s.part() for s in slots if s.n]
