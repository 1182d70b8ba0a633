"""Undo and re-apply a layer's RoPE, so a cache can store keys before rotation.

``mx.fast.rope`` with a negated position scale rotates by the opposite angle,
which inverts the rotation exactly (max error about 2e-6 in float32).

On the CPU, ``mx.fast.rope`` is composed of MLX ops whose ``cos`` and ``sin`` are
scalar loops: rotating 1020 keys of 3 heads (32k angles) took 1.3-1.7 ms, most of it
the angles' ``cos`` and ``sin``, against 0.1 ms for one pass over the keys. A cache that
rebuilds keys before RoPE rotates every stored token at every decode step, so on the
CPU long runs of positions take their ``cos`` and ``sin`` by angle addition from
``length / 32 + 32`` angles instead of ``length`` (:func:`angles`; 0.65 ms for the
same keys). Short runs (a decode step's token) and other backends keep the fused
``mx.fast.rope``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.ops.kernels import on_gpu


def rotate(x: mx.array, dims: int, base: float, traditional: bool, scale: float,
           offset: int) -> mx.array:
    """Apply RoPE to ``x`` [..., L, head_dim] for positions ``offset .. offset+L-1``
    (every decode step: on the CPU, long runs by angle addition)."""
    if on_gpu() or x.shape[-2] < 2 * FINE:
        return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale,
                            offset=offset)
    return _rotate_by_table(x, dims, base, traditional, scale, offset)


def unrotate(x: mx.array, dims: int, base: float, traditional: bool, scale: float,
             offset: int) -> mx.array:
    """Undo RoPE on ``x`` [..., L, head_dim] rotated at positions ``offset ..`` by the
    model (once per token, when it is stored: ``mx.fast.rope``'s own angles, so that
    the stored keys are the model's keys before rotation to 2e-6)."""
    return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=-scale,
                        offset=offset)


def apply(module: nn.Module, x: mx.array, offset: int = 0) -> mx.array:
    """A model's own RoPE module on ``x`` from position ``offset``: through
    :func:`rotate` when it is a plain ``nn.RoPE`` (its parameters say all it does),
    else the module itself (scaled variants with their own frequencies)."""
    if type(module) is nn.RoPE:
        return rotate(x, module.dims, module.base, module.traditional, module.scale, offset)
    return module(x, offset=offset)


FINE = 32  # positions per step of the coarse table (see ``angles``)


@dataclass(frozen=True)
class Tables:
    """RoPE of a run of positions for a kernel that rotates as it reads
    (``ops.native.Placed``): the inverse frequencies ``inv`` ``[1, 1, 1, dims // 2]``
    and the first position ``start`` ``[1, 1, 1, 1]`` int32. The kernel makes each
    position's cos and sin as :func:`angles` does, a few tokens at a time: no table sized
    by the tokens exists. The rotated dims are twice the frequencies."""

    inv: mx.array
    start: mx.array
    traditional: bool


def tables(offset: int, dims: int, base: float, traditional: bool, scale: float) -> Tables:
    """:class:`Tables` of positions from ``offset`` on."""
    return Tables(_inverse(dims, base, scale)[None, None, None],
                  mx.array([offset], dtype=mx.int32)[None, None, None], traditional)


def module_tables(module: nn.Module, offset: int) -> Tables | None:
    """:func:`tables` of a model's RoPE module when it is a plain ``nn.RoPE``; None for
    scaled variants (their own frequencies: the module must rotate)."""
    if type(module) is not nn.RoPE:
        return None
    return tables(offset, module.dims, module.base, module.traditional, module.scale)


def _inverse(dims: int, base: float, scale: float) -> mx.array:
    """RoPE's ``dims // 2`` inverse frequencies, times ``scale``."""
    half = dims // 2
    return mx.exp(-mx.arange(0, half, dtype=mx.float32) * (math.log(base) / half)) * scale


def angles(length: int, offset: int, dims: int, base: float,
           scale: float) -> tuple[mx.array, mx.array]:
    """``cos`` and ``sin`` [length, dims // 2] of RoPE's angles at positions
    ``offset ..``, from ``cos``/``sin`` of far fewer angles: position ``offset + F c + j``
    turns by the coarse angle of ``offset + F c`` plus the fine one of ``j < F``
    (angle addition), so ``cos`` and ``sin`` run on ``length / F + F`` positions
    instead of ``length``. A lazy graph of small arrays: nothing sized by ``length``
    exists before it runs (a table computed ahead would be held by every step's
    graph until it is evaluated). The angles round differently from ``mx.fast.rope``'s
    (one product ``p w``, rounded once): rotated vectors differ from its by at most
    about 3e-8 x position x their largest coordinate, the size of a float32 angle's
    own rounding there."""
    half = dims // 2
    inv = _inverse(dims, base, scale)
    coarse = (offset + FINE * mx.arange(0, -(-length // FINE), dtype=mx.float32))[:, None] * inv
    fine = mx.arange(0, FINE, dtype=mx.float32)[:, None] * inv
    cc, sc, cf, sf = mx.cos(coarse)[:, None], mx.sin(coarse)[:, None], mx.cos(fine), mx.sin(fine)
    cos = (cc * cf - sc * sf).reshape(-1, half)[:length]
    sin = (sc * cf + cc * sf).reshape(-1, half)[:length]
    return cos, sin


def _turn(a: mx.array, b: mx.array, cos: mx.array, sin: mx.array) -> list[mx.array]:
    return [a * cos - b * sin, a * sin + b * cos]


# One pass over the pairs (shapeless: the lengths change at every step).
_interleaved = mx.compile(lambda a, b, c, s: mx.stack(_turn(a, b, c, s), axis=-1),
                          shapeless=True)
_halves = mx.compile(lambda a, b, c, s: mx.concatenate(_turn(a, b, c, s), axis=-1),
                     shapeless=True)


def _rotate_by_table(x: mx.array, dims: int, base: float, traditional: bool, scale: float,
                     offset: int) -> mx.array:
    *lead, length, width = x.shape
    cos, sin = angles(length, offset, dims, base, scale)
    half = dims // 2
    head = x[..., :dims]
    if traditional:  # pairs of neighbours (2i, 2i+1)
        pairs = head.reshape(*lead, length, half, 2)
        out = _interleaved(pairs[..., 0], pairs[..., 1], cos, sin).reshape(*lead, length, dims)
    else:  # pairs across the halves (i, i + dims/2)
        out = _halves(head[..., :half], head[..., half:], cos, sin)
    out = out.astype(x.dtype)
    return out if dims == width else mx.concatenate([out, x[..., dims:]], axis=-1)
