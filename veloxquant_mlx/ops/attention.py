"""Attention numerics shared by caches that run their own attention.

A cache hands what it holds to :func:`attend_parts` as *parts* laid one after the other
along the token axis (keys and values may be cut at different places, as in KIVI):

- :class:`DensePart`: an array ``[B, H, n, D]`` (windows, sinks, residuals);
- :class:`TokenCodes`: per-token codes along the head dimension, ``x = s * c + b`` per
  group of channels (affine, KIVI values, TurboQuant's codebook and affine codes);
- :class:`ChannelCodes`: per-channel codes along the tokens (KIVI keys);
- :class:`PackedCodes`: per-token codes multiplied by ``mx.quantized_matmul``.

Two paths, neither builds a dequantized copy of the cache or a full score matrix:

- decode (at most ``DECODE_ROWS`` query rows per KV head): each part multiplies its codes
  as floats in the keys-major orientation ``K @ q^T`` (OpenBLAS is several times slower on
  the skinny ``q @ K^T`` that ``mx.fast.scaled_dot_product_attention`` runs) and applies
  scales and biases to the small scores and probabilities. Codes of 2, 4 and 8 bits are
  read as bytes, one float array per position in a byte (``quantize.byte_phases``), so
  nothing is interleaved: the queries are sliced instead. The transient is one part's
  codes as float32, freed within the layer.
- prefill (more rows): key blocks of ``KEY_BLOCK`` tokens with an online softmax; each
  block is decoded on its own, so memory is bounded by a block whatever the context.

The softmax exponent is a compiled polynomial (:func:`exp_nonpositive`, 1.9e-7 relative
error): ``mx.exp`` is scalar on this CPU build and was the largest single cost of decode
attention (docs/cpu-performance.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from veloxquant_mlx.ops import codebook as cb
from veloxquant_mlx.ops import quantize as q

DECODE_ROWS = 16  # query rows per KV head (heads per group x tokens) of the decode path
KEY_BLOCK = 4096  # most keys per block of the prefill path
BLOCK_FLOATS = 1 << 19  # score floats per block of the prefill path (2 MB)
_LOG2E = 1.4426950408889634
# 2^f on [0, 1): minimax polynomial, highest degree first.
_EXP2 = (1.8775767e-3, 8.9893397e-3, 5.5826318e-2, 2.4015361e-1, 6.9315308e-1, 9.9999994e-1)
_FLOOR = -1e30  # a row max below this is a fully masked row: its output is 0, not NaN
_TINY = 1e-30


def _exp2_fraction(x: mx.array) -> mx.array:
    """``2^f``, ``f`` the fractional part of ``x * log2(e)`` (clamped at -127)."""
    t = mx.maximum(x * _LOG2E, -127.0)
    f = t - mx.floor(t)
    p = _EXP2[0] * f + _EXP2[1]
    for c in _EXP2[2:]:
        p = p * f + c
    return p


def _exp2_exponent(x: mx.array) -> mx.array:
    """Float32 bits of ``2^n``, ``n`` the integer part; clamping at -127 makes the
    exponent bits 0, so ``exp(-inf)`` (a masked score) is exactly 0."""
    t = mx.maximum(x * _LOG2E, -127.0)
    return (mx.floor(t).astype(mx.int32) + 127) << 23


# Shapeless: decode lengths change every step, and a retrace per shape costs ~10 ms.
# Two single-output kernels: a two-output one materializes its intermediates (6x the
# input's memory instead of 2x, measured).
_exp2_kernels = (mx.compile(_exp2_fraction, shapeless=True),
                 mx.compile(_exp2_exponent, shapeless=True))


def exp_nonpositive(x: mx.array) -> mx.array:
    """``exp(x)`` for ``x <= 0`` (or ``-inf``): a compiled ``2^n * p(f)``, max relative
    error 1.9e-7 against ``mx.exp`` (float32); other dtypes use ``mx.exp``."""
    if x.dtype != mx.float32:
        return mx.exp(x)
    fraction, exponent = _exp2_kernels
    return fraction(x) * exponent(x).view(mx.float32)  # a bit view cannot be traced


def causal_mask(n_queries: int, n_keys: int) -> mx.array:
    """Boolean [L, S] mask where the L queries are the last L of the S key positions."""
    q_pos = mx.arange(n_keys - n_queries, n_keys)[:, None]
    k_pos = mx.arange(n_keys)[None]
    return q_pos >= k_pos


def fit_mask(mask: Any, n_queries: int, n_keys: int) -> Any:
    """Adapt mlx_lm's mask to a cache that holds ``n_keys`` positions.

    ``"causal"`` and ``None`` carry over (the kernel aligns causal masks to the end);
    an array mask wider than the held keys keeps its last ``n_keys`` columns.
    """
    if mask is None or isinstance(mask, str):
        if mask == "causal" and n_queries == 1:
            return None
        return mask
    if mask.shape[-1] != n_keys:
        mask = mask[..., -n_keys:]
    return mask


def grouped_mask(mask: Any, H: int, rep: int, L: int, S: int, start: int = 0,
                 stop: int | None = None) -> mx.array | None:
    """mlx_lm's mask as an array broadcastable to scores ``[B, H, rep, L, stop - start]``
    (key columns ``start:stop`` of ``S``); a 4-D mask ``[B, Hq or 1, L, S]`` is regrouped
    by KV head."""
    stop = S if stop is None else stop
    mask = fit_mask(mask, L, S)
    if mask is None:
        return None
    if isinstance(mask, str):
        # A constant, not arange nodes: those made MLX evaluate every key block of the
        # prefill path at once (peak 3x higher, measured).
        return mx.array(np.arange(S - L, S)[:, None] >= np.arange(start, stop)[None])
    if mask.ndim == 4:
        mask = (mask[:, :, None] if mask.shape[1] == 1
                else mask.reshape(mask.shape[0], H, rep, *mask.shape[2:]))
    return mask if (start, stop) == (0, S) else mask[..., start:stop]


def _apply_mask(scores: mx.array, mask: mx.array | None) -> mx.array:
    if mask is None:
        return scores
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, -mx.inf)
    return scores + mask.astype(scores.dtype)


def masked_softmax(scores: mx.array, mask: Any = None) -> mx.array:
    """Softmax over the last axis of ``scores`` [..., L, S] after mlx_lm's ``mask``.

    Scores grouped by KV head ([B, H, rep, L, S]) take a 4-D mask [B, Hq or 1, L, S]
    regrouped to match. A boolean mask drops positions; an additive one is added in
    the scores' dtype.
    """
    L, S = scores.shape[-2:]
    mask = fit_mask(mask, L, S)
    if isinstance(mask, str):
        mask = causal_mask(L, S)
    if mask is not None:
        if mask.ndim == 4 and scores.ndim == 5:
            H, rep = scores.shape[1], scores.shape[2]
            mask = (mask[:, :, None] if mask.shape[1] == 1
                    else mask.reshape(mask.shape[0], H, rep, *mask.shape[2:]))
        scores = (mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_
                  else scores + mask.astype(scores.dtype))
    return mx.softmax(scores, axis=-1, precise=True)


def sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
         mask: Any = None) -> mx.array:
    """Grouped-query attention over dense keys/values (cast to the query dtype)."""
    if keys.dtype != queries.dtype:
        keys = keys.astype(queries.dtype)
    if values.dtype != queries.dtype:
        values = values.astype(queries.dtype)
    mask = fit_mask(mask, queries.shape[2], keys.shape[2])
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def attention_weights(queries: mx.array, keys: mx.array, scale: float,
                      mask: Any = None) -> mx.array:
    """Softmax attention probabilities [B, Hq, L, S] (for scoring, e.g. SnapKV)."""
    B, Hq, L, D = queries.shape
    Hkv = keys.shape[1]
    rep = Hq // Hkv
    qr = queries.reshape(B, Hkv, rep, L, D).astype(mx.float32)
    scores = (qr * scale) @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)
    return masked_softmax(scores, mask).reshape(B, Hq, L, keys.shape[2])


# ------------------------------------------------------------------ parts
class Part(Protocol):
    """What :func:`attend_parts` reads: ``n`` tokens of ``heads`` KV heads."""

    n: int
    heads: int

    def key_scores(self, qt: mx.array) -> mx.array:
        """``K @ qt``: ``qt`` ``[B, H, D, rows]`` -> ``[B, H, n, rows]``."""

    def value_product(self, p: mx.array) -> mx.array:
        """``p @ V``: ``p`` ``[B, H, rows, n]`` -> ``[B, H, rows, Dv]``."""

    def dense(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        """Tokens ``start:stop`` as floats ``[B, H, stop - start, D]`` (a transient)."""

    def floats(self) -> list[mx.array]:
        """The codes as the float arrays decode multiplies (profiling; dense: none)."""


class DensePart:
    """Keys or values held as an array ``[B, H, n, D]`` (cast to the compute dtype)."""

    def __init__(self, x: mx.array) -> None:
        self.x, self.n, self.heads = x, x.shape[2], x.shape[1]

    def _as(self, dtype: mx.Dtype) -> mx.array:
        return self.x if self.x.dtype == dtype else self.x.astype(dtype)

    def key_scores(self, qt: mx.array) -> mx.array:
        return self._as(qt.dtype) @ qt

    def value_product(self, p: mx.array) -> mx.array:
        return p @ self._as(p.dtype)

    def dense(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        x = self.x if (start, stop) == (0, self.n) else self.x[:, :, start:stop]
        return x if x.dtype == dtype else x.astype(dtype)

    def floats(self) -> list[mx.array]:
        return []


Phases = list[tuple[mx.array, int, int]]  # (codes as floats [B, H, n, w], first dim, stride)


class TokenCodes:
    """Per-token codes along the head dimension: ``x = scales * c + biases`` per group.

    ``phases()`` gives the codes as float arrays whose column ``j`` is head dim
    ``first + stride * j``; ``scales`` / ``biases`` are ``[B, H, n, G]`` for ``G`` groups
    of consecutive dims (``None``: nothing to apply); ``decode(start, stop, dtype)``
    rebuilds a token range in dim order (prefill blocks). With ``G > 1`` every phase's
    columns must fall in groups of consecutive columns (true of byte phases).
    """

    def __init__(self, n: int, dim: int, heads: int, phases: Callable[[], Phases],
                 scales: mx.array | None, biases: mx.array | None,
                 decode: Callable[[int, int, mx.Dtype], mx.array]) -> None:
        self.n, self.dim, self.heads = n, dim, heads
        self.phases, self.scales, self.biases, self.decode = phases, scales, biases, decode

    @property
    def groups(self) -> int:
        return 1 if self.scales is None else self.scales.shape[-1]

    def key_scores(self, qt: mx.array) -> mx.array:
        B, H, D, rows = qt.shape
        G = self.groups
        acc: Any = 0
        for c, first, stride in self.phases():
            w = c.shape[-1]
            qk = qt[:, :, first:first + stride * (w - 1) + 1:stride]  # [B, H, w, rows]
            if G > 1:  # block-diagonal queries: group g's columns meet rows g*rows..
                qk = _block_diagonal(qk, G)  # [B, H, w, G * rows]
            acc = acc + (c if c.dtype == qt.dtype else c.astype(qt.dtype)) @ qk
        if self.scales is None:
            return acc
        s = self.scales.astype(qt.dtype)  # [B, H, n, G]
        out = acc * s if G == 1 else (acc.reshape(B, H, -1, G, rows) * s[..., None]).sum(3)
        if self.biases is not None:
            qsum = qt.reshape(B, H, G, D // G, rows).sum(axis=3)  # [B, H, G, rows]
            out = out + self.biases.astype(qt.dtype) @ qsum
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
    """``[B, H, w, rows]`` -> ``[B, H, w, G * rows]``: column block ``g`` keeps the rows
    of group ``g`` (``w / G`` consecutive rows each), zeros elsewhere."""
    B, H, w, rows = qk.shape
    eye = mx.eye(G, dtype=qk.dtype)[:, None, :, None]  # [G, 1, G, 1]
    blocks = qk.reshape(B, H, G, w // G, 1, rows) * eye
    return blocks.reshape(B, H, w, G * rows)


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
        qt.scales, qt.biases, decode)


def coded_part(c: cb.Coded) -> TokenCodes:
    """Codebook-coded vectors ``[B, H, n, ...]`` (``ops.codebook``) as a part: centroids
    from a compiled select tree (``codebook.centroid_phases``), the per-vector scale
    applied to the scores and probabilities."""
    n, heads = c.scales.shape[2], c.scales.shape[1]
    dim = sum(w for w, _ in c.widths)

    def decode(start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        part = c if (start, stop) == (0, n) else cb.Coded(
            [p[:, :, start:stop] for p in c.parts], c.scales[:, :, start:stop], c.widths,
            c.packing)
        return cb.decode(part, dtype)

    return TokenCodes(n, dim, heads, lambda: cb.centroid_phases(c), c.scales, None, decode)


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

    def key_scores(self, qt: mx.array) -> mx.array:
        k, dt = self.qt, qt.dtype
        if self.packed:
            return mx.quantized_matmul(
                qt.swapaxes(-1, -2), k.codes, k.scales.astype(dt), k.biases.astype(dt),
                transpose=False, group_size=k.group_size, bits=k.bits).swapaxes(-1, -2)
        if k.bits not in q.BYTE_BITS or dt != mx.float32:
            return self._kt(0, self.n, dt).swapaxes(-1, -2) @ qt
        # Tokens per*j + k of every channel in phase k: scores come out in phase order
        # and are interleaved back (a small [rows, n] copy).
        qr = qt.swapaxes(-1, -2)  # [B, H, rows, D]
        outs = [qr @ c for c in q.channel_phases(k)]  # [B, H, rows, n / per]
        B, H, rows, _ = qr.shape
        s = outs[0] if len(outs) == 1 else mx.stack(outs, axis=-1)
        return s.reshape(B, H, rows, self.n).swapaxes(-1, -2)

    def value_product(self, p: mx.array) -> mx.array:
        return p @ self.dense(0, self.n, p.dtype)

    def dense(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        return self._kt(start, stop, dtype).swapaxes(-1, -2)

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

    def key_scores(self, qt: mx.array) -> mx.array:
        return self._qmm(qt.swapaxes(-1, -2), True).swapaxes(-1, -2)

    def value_product(self, p: mx.array) -> mx.array:
        return self._qmm(p, False)

    def dense(self, start: int, stop: int, dtype: mx.Dtype) -> mx.array:
        return q.dequantize(_slice_quantized(self.qt, start, stop), dtype)

    def floats(self) -> list[mx.array]:
        return []


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
    (codebook parts then scales; ``meta`` = widths, packing) or ``"channel"`` (per-channel
    ``Quantized`` codes along the tokens, ``[B, H, D, n * bits / 32]``; ``meta`` = bits,
    group size). ``n == 0``: the sequence has nothing there yet (``arrays`` empty).
    ``packed``: multiply the codes with ``mx.quantized_matmul``.
    """

    kind: str
    arrays: list[mx.array]
    n: int
    meta: tuple = ()
    packed: bool = False

    def part(self) -> Part:
        """The slot as a part :func:`attend_parts` reads."""
        a, m = self.arrays, self.meta
        if self.kind == "dense":
            return DensePart(a[0])
        if self.kind == "coded":
            return coded_part(cb.Coded(a[:-1], a[-1], *m))
        qt = q.Quantized(*a, *m)
        if self.kind == "channel":
            return ChannelCodes(qt, self.packed)
        return PackedCodes(qt) if self.packed else token_codes(qt)


def slot_parts(slots: Sequence[Slot]) -> list[Part]:
    """The non-empty slots as parts."""
    return [s.part() for s in slots if s.n]


# ------------------------------------------------------------------ attention
def attend_parts(queries: mx.array, keys: Sequence[Part], values: Sequence[Part],
                 scale: float, mask: Any = None) -> mx.array:
    """Attention of ``queries`` ``[B, Hq, L, D]`` over key parts and value parts that
    each cover the same tokens in order; ``mask`` as mlx_lm passes it. Returns
    ``[B, Hq, L, Dv]``; a query row with every key masked gets zeros."""
    B, Hq, L, D = queries.shape
    H = keys[0].heads
    qr = (queries * scale).reshape(B, H, Hq // H, L, D)
    if (Hq // H) * L <= DECODE_ROWS:
        out = _decode(qr, keys, values, mask)
    else:
        out = _blocked(qr, keys, values, mask)
    return out.reshape(B, Hq, L, -1)


def _decode(qr: mx.array, keys: Sequence[Part], values: Sequence[Part],
            mask: Any) -> mx.array:
    B, H, rep, L, D = qr.shape
    rows = rep * L
    qt = qr.reshape(B, H, rows, D).swapaxes(-1, -2)  # [B, H, D, rows]
    s = [k.key_scores(qt) for k in keys]
    s = s[0] if len(s) == 1 else mx.concatenate(s, axis=2)  # [B, H, S, rows]
    S = s.shape[2]
    s = _apply_mask(s.swapaxes(-1, -2).reshape(B, H, rep, L, S),
                    grouped_mask(mask, H, rep, L, S))
    m = mx.maximum(s.max(axis=-1, keepdims=True), _FLOOR)
    e = exp_nonpositive(s - m)
    den = e.sum(axis=-1, keepdims=True)
    e = e.reshape(B, H, rows, S)
    out, start = None, 0
    for v in values:
        p = e if v.n == S else e[..., start:start + v.n]
        o = v.value_product(p)
        out = o if out is None else out + o
        start += v.n
    return out.reshape(B, H, rep, L, -1) / mx.maximum(den, _TINY)


def _gather(parts: Sequence[Part], start: int, stop: int, dtype: mx.Dtype) -> mx.array:
    """Tokens ``start:stop`` across consecutive parts, as floats."""
    pieces, offset = [], 0
    for p in parts:
        lo, hi = max(start, offset), min(stop, offset + p.n)
        if lo < hi:
            pieces.append(p.dense(lo - offset, hi - offset, dtype))
        offset += p.n
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)


def _settle(mask: mx.array) -> None:
    """Evaluate a mask array up front (small): a lazy mask built from ``arange`` nodes
    made MLX evaluate every key block at once. Not possible while a function is being
    compiled; then it stays lazy."""
    try:
        mx.eval(mask)
    except (RuntimeError, ValueError):
        pass


def _key_block(rows: int) -> int:
    """Keys per block for ``rows`` query rows: a score block of about ``BLOCK_FLOATS``
    (each of the few block-sized transients stays small), a multiple of 128."""
    return max(128, min(KEY_BLOCK, (BLOCK_FLOATS // max(rows, 1)) // 128 * 128))


def _blocked(qr: mx.array, keys: Sequence[Part], values: Sequence[Part],
             mask: Any) -> mx.array:
    """Online softmax over key blocks: no full score matrix and no decoded copy of the
    cache, only block-sized transients. (Chaining the blocks with ``mx.depends`` to force
    one block at a time raised the measured peak: MLX then kept more alive.)"""
    B, H, rep, L, D = qr.shape
    S = sum(k.n for k in keys)
    step = _key_block(B * H * rep * L)
    if isinstance(mask, mx.array):
        _settle(mask)
    m = den = acc = None
    for t0 in range(0, S, step):
        t1 = min(S, t0 + step)
        kb = _gather(keys, t0, t1, qr.dtype)
        s = qr @ kb[:, :, None].swapaxes(-1, -2)  # [B, H, rep, L, block]
        # A causal block that every query sees whole needs no mask.
        if not (mask == "causal" and t1 <= S - L + 1):
            s = _apply_mask(s, grouped_mask(mask, H, rep, L, S, t0, t1))
        m_new = mx.maximum(s.max(axis=-1, keepdims=True), _FLOOR)
        if m is not None:
            m_new = mx.maximum(m, m_new)
        e = exp_nonpositive(s - m_new)
        del s
        pv = e @ _gather(values, t0, t1, qr.dtype)[:, :, None]
        if m is None:
            den, acc = e.sum(axis=-1, keepdims=True), pv
        else:
            # mx.exp on this small array: the compiled kernel here raised the peak 3x
            # (measured; it changes the order MLX evaluates the blocks in).
            c = mx.exp(m - m_new)
            den, acc = den * c + e.sum(axis=-1, keepdims=True), acc * c + pv
        m = m_new
    return acc / mx.maximum(den, _TINY)


def split_attention(queries: mx.array, parts: list[tuple[Any, Any]], scale: float,
                    mask: Any = None, quantized_matmul: bool = False) -> mx.array:
    """Attention over several key/value parts without concatenating them.

    Each part is ``(keys, values)`` covering the same tokens: dense ``[B, H, S_i, D]``
    arrays (any dtype, cast to the query dtype), ``ops.quantize.Quantized`` codes
    quantized per token along the head dimension (multiplied with
    ``mx.quantized_matmul`` when ``quantized_matmul``), or parts of this module. See
    :func:`attend_parts`.
    """
    keys = [as_part(k, quantized_matmul) for k, _ in parts]
    values = [as_part(v, quantized_matmul) for _, v in parts]
    return attend_parts(queries, keys, values, scale, mask)
