"""Microscaled float codes (MLX's ``nvfp4``, ``mxfp4``, ``mxfp8`` modes) per token.

Each group of channels of a vector shares one 8-bit scale (E4M3 for ``nvfp4``'s groups of
16, a power of two for the ``mx`` formats' groups of 32) and each value is an E2M1 (4 bits)
or E4M3 (8 bits) float: levels that crowd near zero like a Gaussian's, so on rotated
vectors (close to i.i.d. Gaussian) the 4-bit codes lose about what the Lloyd-Max codebook
of the same width does, while ``mx.quantized_matmul`` multiplies them fused on every
backend. No biases.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# (bits, group) -> MLX mode
MODES = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}
BY_NAME = {mode: bg for bg, mode in MODES.items()}


@dataclass
class FPCodes:
    """Codes ``[..., n, d * bits / 32]`` (uint32) and scales ``[..., n, d / group]``."""

    codes: mx.array
    scales: mx.array
    mode: str

    @property
    def bits(self) -> int:
        return BY_NAME[self.mode][0]

    @property
    def group_size(self) -> int:
        return BY_NAME[self.mode][1]

    @property
    def arrays(self) -> list[mx.array]:
        return [self.codes, self.scales]


def encode(x: mx.array, mode: str) -> FPCodes:
    """Vectors ``x [..., d]`` (``d`` a multiple of the mode's group) as float codes."""
    if mode not in BY_NAME:
        raise ValueError(f"mode={mode!r}: one of {sorted(BY_NAME)}")
    bits, group = BY_NAME[mode]
    codes, scales = mx.quantize(x.astype(mx.float32), group_size=group, bits=bits,
                                mode=mode)
    return FPCodes(codes, scales, mode)


def decode(c: FPCodes, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The vectors as floats (a transient)."""
    out = mx.dequantize(c.codes, c.scales, group_size=c.group_size, bits=c.bits,
                        mode=c.mode)
    return out if out.dtype == dtype else out.astype(dtype)


def matmul(x: mx.array, c: FPCodes, transpose: bool) -> mx.array:
    """``x @ decode(c).T`` (``transpose``) or ``x @ decode(c)``, fused on the codes."""
    return mx.quantized_matmul(x, c.codes, c.scales, transpose=transpose,
                               group_size=c.group_size, bits=c.bits, mode=c.mode)


def vector_bytes(d: int, mode: str) -> int:
    """Bytes of one coded vector of width ``d``."""
    bits, group = BY_NAME[mode]
    return d * bits // 8 + d // group
