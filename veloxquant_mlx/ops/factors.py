"""Low-rank token factors stored one row per token (xKV), and their fast decoding.

A token factor ``A`` [..., T, r] is kept as float16 or as MLX affine codes quantized
along its rank axis in groups of ``ROW_GROUP`` (one scale and bias per token and group).
Each token's row is independent of the others, so rows can be appended, sliced and
trimmed exactly, and a row never changes once written.

Decoding is the cost of every attention step over the factor (the codes are read
once per forward pass and group of layers). ``mx.dequantize`` is slow on the CPU
(measured: 2-3 ms for [4096, 384] at 4 bits with float32 scales, far more with
float16 ones); reading the codes through a byte view (``ops.quantize.code_values``)
and applying scale and bias with plain ops takes about 1.2 ms.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from veloxquant_mlx.ops import native
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.buffers import owned

ROW_GROUP = 32  # quantization group along the rank axis
FAST_BITS = (2, 4, 8)  # code widths read through a byte view


def padded_rank(r: int, bits: int | None) -> int:
    """The stored width of a rank-``r`` factor: a multiple of ``ROW_GROUP`` when coded."""
    return r if bits is None else -(-r // ROW_GROUP) * ROW_GROUP


def pad_rank(x: mx.array, width: int, axis: int) -> mx.array:
    """``x`` with zeros appended along ``axis`` up to ``width`` (rank padding)."""
    extra = width - x.shape[axis]
    if extra <= 0:
        return x
    shape = list(x.shape)
    shape[axis] = extra
    return mx.concatenate([x, mx.zeros(shape, x.dtype)], axis=axis)


def store_rows(x: mx.array, bits: int | None) -> Any:
    """Keep ``x`` [..., T, r] as float16, or as codes along ``r`` (``r`` padded)."""
    if bits is None:
        return x.astype(mx.float16)
    x = pad_rank(x.astype(mx.float32), padded_rank(x.shape[-1], bits), -1)
    return q.quantize(x, bits, ROW_GROUP)


def load_rows(x: Any, plus: mx.array | None = None) -> mx.array:
    """Float32 ``[..., T, r]`` from :func:`store_rows` (a transient), plus ``plus`` if
    given (added as the codes are decoded where the fused op runs)."""
    fused = native.floats_of(x, plus) if isinstance(x, q.Quantized) else None
    if fused is not None:
        return fused
    out = _decoded(x)
    return out if plus is None else plus + out


def _decoded(x: Any) -> mx.array:
    if not isinstance(x, q.Quantized):
        return x.astype(mx.float32)
    if x.bits not in FAST_BITS:
        return q.dequantize(x, mx.float32)
    c = q.code_values(x, mx.float32)
    lead, groups = x.scales.shape[:-1], x.scales.shape[-1]
    c = c.reshape(*lead, groups, -1)
    out = c * x.scales.astype(mx.float32)[..., None] + x.biases.astype(mx.float32)[..., None]
    return out.reshape(*lead, -1)


def rows_arrays(x: Any) -> list[mx.array]:
    return x.arrays if isinstance(x, q.Quantized) else [x]


def rows_count(x: Any) -> int:
    """Tokens (rows) held."""
    return (x.codes if isinstance(x, q.Quantized) else x).shape[-2]


def rows_width(x: Any) -> int:
    """Stored width (rank, padded when coded)."""
    if isinstance(x, q.Quantized):
        return x.scales.shape[-1] * x.group_size
    return x.shape[-1]


def append_rows(held: Any, new: Any) -> Any:
    """Rows of ``new`` after those of ``held`` (same width and coding)."""
    if held is None:
        return new
    if isinstance(new, q.Quantized):
        return q.concat([held, new], axis=-2)
    return mx.concatenate([held, new], axis=-2)


def keep_rows(x: Any, n: int) -> Any:
    """The first ``n`` rows, copied (a slice would pin the dropped rows)."""
    if isinstance(x, q.Quantized):
        return q.Quantized(*(owned(a[..., :n, :]) for a in x.arrays), x.bits,
                           x.group_size)
    return owned(x[..., :n, :])


def rows_from(arrays: list[mx.array], bits: int | None) -> Any:
    """Rebuild a stored factor from its ``rows_arrays`` (saved caches)."""
    if bits is None:
        return arrays[0]
    return q.Quantized(*arrays, bits, ROW_GROUP)


def rows_bytes(n_rows: int, width: int, bits: int | None) -> int:
    """Storage formula of ``n_rows`` rows of ``width`` values."""
    if bits is None:
        return 2 * n_rows * width
    return n_rows * q.quantized_bytes(width, bits, ROW_GROUP)
