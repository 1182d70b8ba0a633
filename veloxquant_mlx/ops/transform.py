"""Transform coding numerics for caches at rest: PCA bases, bit allocation, quantizers.

Everything here is numpy on float32/float64 arrays; ``apps.at_rest`` wires it to caches
and files. A vector is decorrelated with a PCA basis, each coefficient gets a number of
bits by reverse water-filling on its variance (greedy marginal gain), and is quantized
with a uniform quantizer whose step is the Gaussian-optimal one for that many bits.
"""

from __future__ import annotations

import heapq

import numpy as np

# Step (in standard deviations) of the MSE-optimal uniform quantizer of a unit Gaussian
# with 2**b levels (Max, 1960), b = 1..8; the levels sit at (k + 1/2) * step about 0.
GAUSS_STEP: tuple[float, ...] = (1.596, 0.9957, 0.5860, 0.3352, 0.1881, 0.1041, 0.0569, 0.0308)
MAX_BITS = len(GAUSS_STEP)


def pca_basis(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean ``[D]``, orthonormal basis ``[D, D]`` (columns, by falling variance) and the
    variance of each coefficient ``[D]`` of the rows of ``x`` ``[N, D]``."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"pca_basis needs [N >= 2, D] samples, got shape {x.shape}")
    mean = x.mean(axis=0)
    cov = np.cov(x - mean, rowvar=False, bias=True).reshape(x.shape[1], x.shape[1])
    var, vec = np.linalg.eigh(cov)
    order = np.argsort(var)[::-1]
    return (mean.astype(np.float32), vec[:, order].astype(np.float32),
            np.maximum(var[order], 0.0).astype(np.float32))


def allocate_bits(var: np.ndarray, total_bits: int, max_bits: int = MAX_BITS) -> np.ndarray:
    """Bits per coefficient (0 drops it) summing to at most ``total_bits``.

    Greedy marginal gain: each added bit to a coefficient of variance ``v`` holding ``b``
    bits cuts its distortion from ``v * 4**-b`` to ``v * 4**-(b+1)``; the biggest cut goes
    first. This is reverse water-filling in integer bits.
    """
    var = np.asarray(var, dtype=np.float64).reshape(-1)
    if total_bits < 0 or max_bits < 1 or max_bits > MAX_BITS:
        raise ValueError(f"allocate_bits: total_bits {total_bits} must be >= 0 and max_bits "
                         f"{max_bits} in 1..{MAX_BITS}")
    bits = np.zeros(var.shape[0], dtype=np.int64)
    heap = [(-0.75 * v, j) for j, v in enumerate(var) if v > 0]
    heapq.heapify(heap)
    left = int(total_bits)
    while left > 0 and heap:
        gain, j = heapq.heappop(heap)
        bits[j] += 1
        left -= 1
        if bits[j] < max_bits:
            heapq.heappush(heap, (gain / 4.0, j))
    return bits


def _steps(bits: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Each coefficient's quantizer step, in float64 (``bits > 0``)."""
    return np.asarray(GAUSS_STEP)[bits - 1] * np.asarray(std, dtype=np.float64)


def quantize(coeffs: np.ndarray, bits: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Codes ``[K, N]`` uint8 of the coefficients ``[N, D]`` with ``bits > 0`` (K of them,
    in column order): uniform, step ``GAUSS_STEP[b-1] * std``, clipped to ``2**b`` levels."""
    keep = np.flatnonzero(bits > 0)
    b = np.asarray(bits)[keep].astype(np.int64)
    # In the coefficients' own precision, as one column at a time would compute it.
    dt = coeffs.dtype if np.issubdtype(coeffs.dtype, np.floating) else np.float64
    step = np.maximum(_steps(b, np.asarray(std)[keep]), 1e-30).astype(dt)
    levels = (1 << b) - 1
    q = np.floor(coeffs[:, keep] / step + ((levels + 1) / 2.0).astype(dt))
    return np.ascontiguousarray(np.clip(q, 0, levels).astype(np.uint8).T)


def dequantize(codes: np.ndarray, bits: np.ndarray, std: np.ndarray, n: int) -> np.ndarray:
    """Coefficients ``[n, D]`` back from ``quantize``'s codes; dropped ones are 0."""
    out = np.zeros((n, bits.shape[0]), dtype=np.float32)
    keep = np.flatnonzero(bits > 0)
    b = np.asarray(bits)[keep].astype(np.int64)
    step = _steps(b, np.asarray(std)[keep]).astype(np.float32)
    half = (((1 << b) - 1) / 2.0).astype(np.float32)
    out[:, keep] = ((codes.astype(np.float32) - half[:, None]) * step[:, None]).T
    return out


def pack_codes(codes: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Codes ``[K, N]`` of ``widths[k] >= 1`` bits each as bit planes ``[sum(widths),
    ceil(N/8)]`` uint8: exactly the allocated bits (byte symbols would cost an entropy
    coder at least one bit each, whatever their width)."""
    widths = np.asarray(widths, dtype=np.int64)
    col = np.repeat(np.arange(widths.size), widths)
    plane = np.concatenate([np.arange(w) for w in widths]) if widths.size else \
        np.zeros(0, np.int64)
    bits = (codes[col] >> plane[:, None].astype(np.uint8)) & 1
    return np.packbits(bits.astype(np.uint8), axis=-1)


def unpack_codes(planes: np.ndarray, widths: np.ndarray, n: int) -> np.ndarray:
    """``pack_codes`` undone: codes ``[K, n]`` uint8."""
    widths = np.asarray(widths, dtype=np.int64)
    if widths.size == 0 or n == 0:
        return np.zeros((widths.size, n), dtype=np.uint8)
    bits = np.unpackbits(planes, axis=-1, count=n).astype(np.uint16)
    plane = np.concatenate([np.arange(w) for w in widths])
    starts = np.concatenate([[0], np.cumsum(widths)[:-1]])
    return np.add.reduceat(bits << plane[:, None], starts, axis=0).astype(np.uint8)


# Multiples of the standard deviation tried as a coefficient's quantizer scale: heavy
# tails (key outliers) clip at the Gaussian step, and a clipped outlier costs most.
SCALE_CHOICES: tuple[float, ...] = (1.0, 1.25, 1.6, 2.0, 3.0)


def fit_scales(coeffs: np.ndarray, bits: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Per coefficient the scale (``std`` times one of ``SCALE_CHOICES``) whose
    ``quantize``/``dequantize`` round trip has the least squared error on ``coeffs``."""
    scales = np.asarray(std, dtype=np.float32).copy()
    keep = np.flatnonzero(bits > 0)
    if keep.size == 0:
        return scales
    col, b, base = coeffs[:, keep], np.asarray(bits)[keep], scales[keep]
    choices = np.stack([base * m for m in SCALE_CHOICES])  # [choices, K] float32
    errs = []
    for s in choices:
        back = dequantize(quantize(col, b, s), b, s, col.shape[0])
        # Summed per column along a contiguous row, as a column alone is summed.
        errs.append(np.sum(np.ascontiguousarray((back - col).T) ** 2, axis=1))
    best = np.argmin(np.stack(errs), axis=0)
    scales[keep] = choices[best, np.arange(keep.size)]
    return scales
