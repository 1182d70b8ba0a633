"""``affine``: MLX's own affine quantization of keys and values (``mx.quantize``).

Each token's key and value vectors are quantized in groups of ``group_size``
along the head dimension (per-token groups, as mlx_lm's ``QuantizedKVCache``).
An optional window of the most recent ``window`` tokens stays in full precision;
tokens leaving the window are quantized.

Decode speed: codes, scales and biases live in buffers written in place (a step of
1/32 of the tokens held, counted in ``accounted_bytes``), and attention runs on the
quantized part and the window separately, joined only at the scores: the codes are read
as bytes and the scales and biases applied to the small scores and probabilities, with
no dequantized copy; prefill attends in bounded key blocks (``ops.attention``). See
``docs/methods/affine.md`` and ``docs/cpu-performance.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from veloxquant_mlx.cache.base import LayerInfo, require_group_divides, window_dtype
from veloxquant_mlx.cache.numerics import (
    StoredNumerics,
    Stream,
    affine_roundtrip,
    cast,
    code_flips,
)
from veloxquant_mlx.cache.profile import Profile
from veloxquant_mlx.cache.segments import Dense, StoredForm, TokenCodes
from veloxquant_mlx.cache.stored import StoredFormCache
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.options import MethodOptions
from veloxquant_mlx.register import register

if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig


@dataclass(frozen=True)
class AffineOptions(MethodOptions):
    """MLX's affine quantization (``mx.quantize``), per token along the head dimension.

    bits: code width; group_size: values sharing one scale and bias; window: most
    recent tokens kept in full precision.
    """

    bits: int = 4
    group_size: int = 64
    window: int = 0

    def __post_init__(self) -> None:
        self.check_int("bits", q.AFFINE_BITS)
        self.check_int("group_size", q.AFFINE_GROUP_SIZES)
        self.check_int("window", minimum=0)


def _stored_numerics(config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
    """Every token older than the window is read back as its per-token codes, coded as
    soon as it is stored (a chunk longer than the window attends over its own codes),
    from the window dtype (from the input when the window was empty). Exact but for code
    flips (measured: at most 0.16 of a step at 4 and 8 bits)."""
    o = config.layer_options(layer.layer_idx)
    # The window is held in the window dtype; without one, codes come from the input.
    hold = cast(config.window_dtype) if o.window else None
    s = Stream(affine_roundtrip(o.bits, o.group_size), keep=o.window, hold=hold,
               fresh_from_input=True)
    return StoredNumerics(s, s, bound=code_flips(o.bits, 0.4))


def _tune_grid(context: int) -> list[dict[str, Any]]:
    # 8 bits down to 2, groups of 32 (finer scales) below 8 bits; a 32-token fp window.
    return [dict(bits=b, group_size=g, window=32)
            for b, g in ((8, 64), (6, 64), (5, 32), (4, 32), (3, 32), (2, 32))]


@register
class AffineCache(StoredFormCache):
    """Quantized K and V codes with per-group scales/biases, plus an fp window."""

    method = "affine"
    Options = AffineOptions
    profile = Profile(
        family="quantization", paper="MLX affine quantization (mx.quantize)",
        stores="K and V codes + per-group scale/bias, optional fp window",
        rotatable=True,
        drops_front=True,  # codes are per token: a ring may drop any of the oldest tokens
        small=dict(bits=4, group_size=32, window=4), lossless=dict(bits=8, group_size=32),
        stored_numerics=_stored_numerics, tune_grid=_tune_grid,
        ladders={"affine": {"base": {"group_size": 32, "rotate": True},
                            "knobs": {"bits": (2, 3, 4, 8)},
                            "streams": {"bits": ("keys", "values")}}})
    attends = True
    meta_fields = {"offset": int, "batch_size": int, "n_bits": int, "group_size": int,
                   "window": int}
    compute_dtype = mx.float32

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.n_bits = self.opts.bits
        self.group_size = self.opts.group_size
        self.window = self.opts.window
        require_group_divides(self.layer, self.group_size, self.method)
        d, dv = self.layer.head_dim, self.layer.v_head_dim
        # Per-token codes, then the full-precision window; saved window first (the
        # layout of earlier saved files).
        self.codes = (TokenCodes(self.n_bits, self.group_size, d),
                      TokenCodes(self.n_bits, self.group_size, dv))
        self.win = (Dense(), Dense())
        self.stored = StoredForm([self.codes[0], self.win[0]], [self.codes[1], self.win[1]],
                                 state_order=[*self.win, *self.codes])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.begin(keys, values)
        if self.window == 0:
            self.codes[0].append(keys)
            self.codes[1].append(values)
            return keys, values
        wdt = window_dtype(self.config, keys.dtype)
        for codes, win, x in zip(self.codes, self.win, (keys, values)):
            win.dtype = wdt
            # Joining the window is cheap (``window`` tokens); the first chunk is coded
            # from its incoming precision (no round trip through the window dtype).
            held = x if win.x is None else mx.concatenate([win.x, x.astype(wdt)], axis=2)
            overflow = held.shape[2] - self.window
            if overflow > 0:
                codes.append(held[:, :, :overflow].astype(x.dtype))
                held = held[:, :, overflow:]
            # A kept slice of a multi-token chunk pins window + chunk: copy it out. A
            # decode step pins one token more, no copy.
            win.set(held, copy=overflow > 1)
        return keys, values
