"""Scalar codebooks for Gaussian coordinates (Lloyd-Max), and bit-plane packed codes.

After a random rotation every coordinate of a head vector is close to ``N(0, |x|^2/d)``
(``ops.rotation``). Scaled by ``sqrt(d) / |x|`` it is close to ``N(0, 1)``, for which the
MSE-optimal b-bit scalar quantizer is known in advance: the Lloyd-Max codebook, computed
here once per width. A vector is stored as its norm (float16) and one code per
coordinate.

Codes are packed in bit planes: for every 8 consecutive coordinates, plane ``j`` is one
byte holding bit ``j`` of their 8 codes. Any width 1..8 then costs exactly ``b`` bits per
coordinate, and a head dimension only needs to be a multiple of 8. Fractional widths
(2.5, 3.5 bits) give the first half of the channels one bit more than the second half
(after rotation no channel is special).

``packing="bytes"`` packs widths 1, 2 and 4 as MLX does (code of coordinate ``per * j + k``
in bits ``k * b`` of byte ``j``, ``per = 8 // b``), at the same cost; other widths stay in
planes. Codes decode to an odd polynomial of the code (:func:`centroids`: Lloyd-Max's
levels at 1-2 bits, within 0.2% of their distortion at 3-4), evaluated in the kernel that
unpacks the bytes: on the CPU a per-element gather ``levels[codes]`` was the slowest step
of a decode, and a select tree over the code bits still cost several times an affine
decode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np

BYTE_WIDTHS = (1, 2, 4)  # widths that byte packing takes (codes never straddle a byte)
PACKINGS = ("planes", "bytes")
_SHIFTS = mx.arange(8, dtype=mx.uint8)


def _normal_pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


@cache
def lloyd_max(bits: int, iterations: int = 200) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Centroids (2^bits) and decision thresholds (2^bits - 1) for ``N(0, 1)``.

    Lloyd's iteration with the exact conditional means of the normal distribution:
    a centroid is the mean of its cell, a threshold the midpoint of two centroids.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"lloyd_max: bits={bits} must be in 1..8")
    n = 2 ** bits
    c = np.linspace(-2.5, 2.5, n) if n > 2 else np.array([-0.8, 0.8])
    for _ in range(iterations):
        t = (c[1:] + c[:-1]) / 2
        lo = np.concatenate([[-np.inf], t])
        hi = np.concatenate([t, [np.inf]])
        mass = _normal_cdf(hi) - _normal_cdf(lo)
        c = (_normal_pdf(lo) - _normal_pdf(hi)) / np.maximum(mass, 1e-300)
    t = (c[1:] + c[:-1]) / 2
    return tuple(float(v) for v in c), tuple(float(v) for v in t)


# Odd powers t, t^3, t^5 of the code's offset from the middle. A fourth term made MLX's
# compiled CPU kernel 3x slower (measured) for a distortion gain of 0.2%.
POLY_TERMS = 3


@cache
def _odd_polynomial(bits: int) -> tuple[float, ...]:
    """Float32 coefficients of the odd polynomial in ``t = code - (2^bits - 1) / 2`` that
    fits the Lloyd-Max centroids (least squares; exact at 1 and 2 bits, where the
    ``2^(bits-1)`` magnitudes need at most ``POLY_TERMS`` coefficients)."""
    n = 2 ** bits
    t = np.arange(n) - (n - 1) / 2
    powers = np.stack([t ** (2 * j + 1) for j in range(min(POLY_TERMS, n // 2))], axis=1)
    coeffs = np.linalg.lstsq(powers, np.array(lloyd_max(bits)[0]), rcond=None)[0]
    return tuple(float(np.float32(c)) for c in coeffs)


@cache
def centroids(bits: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The levels codes decode to (2^bits, ascending) and the encoder's thresholds (their
    midpoints). Decoding evaluates a polynomial, not a table: on the CPU a per-element
    gather, or a select tree over the code bits, cost several times an affine decode,
    while a few multiply-adds fuse into the byte unpacking. At 1 and 2 bits the levels
    are Lloyd-Max's; at 3 and 4 bits the distortion per N(0, 1) coordinate is within
    0.2% of Lloyd-Max's (``codebook_mse``)."""
    c = mx.array(np.arange(2 ** bits, dtype=np.uint8))
    levels = np.array(_levels(c, bits, 0)).astype(np.float64)
    return tuple(levels.tolist()), tuple(((levels[1:] + levels[:-1]) / 2).tolist())


def codebook_mse(bits: int, levels: str = "lloyd_max") -> float:
    """Expected squared error per N(0, 1) coordinate of the b-bit codebook (numeric):
    ``levels`` ``"lloyd_max"`` (the optimum) or ``"centroids"`` (what codes decode to)."""
    table = {"lloyd_max": lloyd_max, "centroids": centroids}
    if levels not in table:
        raise ValueError(f"levels={levels!r} is not allowed: one of {list(table)}")
    c, t = (np.array(v) for v in table[levels](bits))
    x = np.linspace(-8, 8, 200001)
    idx = np.searchsorted(t, x)
    return float(np.trapezoid((x - c[idx]) ** 2 * _normal_pdf(x), x))


def split_bits(bits: float, d: int) -> list[tuple[int, int]]:
    """``[(channels, width), ...]`` for a (possibly half-integer) width over ``d`` channels."""
    lo = math.floor(bits)
    if bits == lo:
        return [(d, lo)]
    half = d // 2
    if half % 8:
        raise ValueError(f"{bits} bits need the head dim split in halves of multiples of "
                         f"8 channels; head dim {d} cannot be")
    return [(half, lo + 1), (d - half, lo)]


def pack_planes(codes: mx.array, bits: int) -> mx.array:
    """``[..., n]`` codes (< 2^bits, n % 8 == 0) -> ``[..., n // 8, bits]`` uint8 planes."""
    *lead, n = codes.shape
    c = codes.astype(mx.uint8).reshape(*lead, n // 8, 1, 8)
    planes = (c >> mx.arange(bits, dtype=mx.uint8)[:, None]) & 1  # [..., g, bits, 8]
    return (planes << _SHIFTS).sum(axis=-1).astype(mx.uint8)


def unpack_planes(planes: mx.array) -> mx.array:
    """Inverse of :func:`pack_planes`: ``[..., g, bits]`` uint8 -> ``[..., g * 8]`` uint8."""
    *lead, g, bits = planes.shape
    b = (planes[..., None] >> _SHIFTS) & 1  # [..., g, bits, 8]
    weights = (mx.array(1, dtype=mx.uint8) << mx.arange(bits, dtype=mx.uint8))[:, None]
    return (b * weights).sum(axis=-2).astype(mx.uint8).reshape(*lead, g * 8)


def pack_bytes(codes: mx.array, bits: int) -> mx.array:
    """``[..., n]`` codes (< 2^bits, ``bits`` in 1, 2, 4) -> ``[..., n * bits // 8]`` uint8,
    the code of element ``per * j + k`` in bits ``k * bits`` of byte ``j``."""
    *lead, n = codes.shape
    per = 8 // bits
    c = codes.astype(mx.uint8).reshape(*lead, n // per, per)
    shifts = mx.arange(0, 8, bits, dtype=mx.uint8)
    return (c << shifts).sum(axis=-1).astype(mx.uint8)  # disjoint bits: sum == or


def packing_of(parts: Sequence[mx.array], widths: Sequence[tuple[int, int]]) -> str:
    """The packing of saved codes: a byte width held as [.., groups, bits] is in bit
    planes (caches saved before byte packing), as [.., bytes] in bytes."""
    planes = any(p.ndim == 5 for p, (_, b) in zip(parts, widths) if b in BYTE_WIDTHS)
    return "planes" if planes else "bytes"


def packed_in_bytes(packing: str, bits: int) -> bool:
    """Whether a channel part of width ``bits`` is byte-packed under ``packing``."""
    return packing == "bytes" and bits in BYTE_WIDTHS


@dataclass
class Coded:
    """Vectors stored as a float16 scale per vector and packed codes per channel part."""

    parts: list[mx.array]  # per channel part: [..., n_i // 8, bits_i] planes or bytes
    scales: mx.array  # [..., 1] float16: norm / sqrt(d)
    widths: tuple[tuple[int, int], ...]  # (channels, bits) per part
    packing: str = "planes"

    @property
    def arrays(self) -> list[mx.array]:
        return [*self.parts, self.scales]


def encode(x: mx.array, bits: float, packing: str = "planes") -> Coded:
    """Code rotated vectors ``x [..., d]`` with the Lloyd-Max codebook (``bits`` 1..4,
    halves allowed). The scale is ``|x| / sqrt(d)``, so ``x / scale`` is ~N(0, 1)."""
    if packing not in PACKINGS:
        raise ValueError(f"packing={packing!r}: one of {PACKINGS}")
    d = x.shape[-1]
    widths = tuple(split_bits(bits, d))
    # A decode step codes one token per layer and side: compiled, its dozen small ops
    # run as a few (a trace per shape, so longer chunks run as they are).
    if x.ndim > 1 and x.shape[-2] == 1:
        *parts, scale = _encoder(widths, packing)(x)
    else:
        *parts, scale = _encode(x, widths, packing)
    return Coded(parts, scale, widths, packing)


def _encode(x: mx.array, widths: tuple[tuple[int, int], ...], packing: str
            ) -> list[mx.array]:
    """The packed codes of each channel part, then the float16 scales."""
    x = x.astype(mx.float32)
    scale = mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True))
    z = x / mx.maximum(scale, 1e-30)
    parts, start = [], 0
    for n, b in widths:
        t = mx.array(centroids(b)[1], dtype=mx.float32)
        codes = (z[..., start:start + n, None] > t).sum(axis=-1)
        parts.append(pack_bytes(codes, b) if packed_in_bytes(packing, b)
                     else pack_planes(codes, b))
        start += n
    return [*parts, scale.astype(mx.float16)]


@cache
def _encoder(widths: tuple[tuple[int, int], ...], packing: str
             ) -> Callable[[mx.array], list[mx.array]]:
    return mx.compile(lambda x: _encode(x, widths, packing))


@cache
def _centroid_kernel(bits: int, per: int) -> Callable[[mx.array], list[mx.array]]:
    """Compiled: bytes holding ``per`` codes each -> ``per`` float32 centroid arrays."""

    def phases(u8: mx.array) -> list[mx.array]:
        return [_levels(u8, bits, k) for k in range(per)]

    return mx.compile(phases, shapeless=True)


def _levels(u8: mx.array, bits: int, k: int) -> mx.array:
    """The centroids of the ``k``-th code of each byte: the odd polynomial of
    :func:`centroids` in Horner form (a few multiply-adds per code, no gather)."""
    c = (u8 >> (k * bits)) & ((1 << bits) - 1)
    t = c.astype(mx.float32) - (2 ** bits - 1) / 2
    coeffs = _odd_polynomial(bits)
    # mx.square, not t * t: with an input used twice MLX's shapeless compile stopped
    # fusing and materialized intermediates (peak 2x the output, 1.5x the time).
    u = mx.square(t)
    p = mx.array(coeffs[-1], dtype=mx.float32)
    for a in reversed(coeffs[:-1]):
        p = p * u + a
    return t * p


@cache
def _phase_kernel(bits: int, k: int) -> Callable[[mx.array], mx.array]:
    """Compiled: the ``k``-th code of each byte -> its centroids (one output)."""
    return mx.compile(lambda u8: _levels(u8, bits, k), shapeless=True)


def centroid_phases(c: Coded) -> list[tuple[mx.array, int, int]]:
    """The centroids of ``c`` (scales not applied) as ``(values, first, stride)`` float32
    arrays ``[..., w]``: ``values[..., j]`` is channel ``first + stride * j``.

    Byte-packed parts give one array per position in a byte; plane-packed parts are
    unpacked to codes first (one array in channel order).
    """
    out, start = [], 0
    for p, (n, b) in zip(c.parts, c.widths):
        if packed_in_bytes(c.packing, b):
            per = 8 // b
            out += [(_phase_kernel(b, k)(p), start + k, per) for k in range(per)]
        else:
            out.append((_centroid_kernel(b, 1)(unpack_planes(p))[0], start, 1))
        start += n
    return out


def decode(c: Coded, dtype: mx.Dtype = mx.float32) -> mx.array:
    """Dequantized vectors ``[..., d]`` (a transient: the stored form stays packed)."""
    pieces = []
    for p, (_, b) in zip(c.parts, c.widths):
        if packed_in_bytes(c.packing, b):
            phases = _centroid_kernel(b, 8 // b)(p)
            pieces.append(mx.stack(phases, axis=-1).reshape(*p.shape[:-1], -1))
        else:
            pieces.append(_centroid_kernel(b, 1)(unpack_planes(p))[0])
    z = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)
    return (z * c.scales.astype(mx.float32)).astype(dtype)


def coded_bytes(n_vectors: int, d: int, bits: float) -> int:
    """Bytes of ``n_vectors`` coded vectors of width ``d`` (codes + float16 scale)."""
    return n_vectors * (sum(n * b // 8 for n, b in split_bits(bits, d)) + 2)
