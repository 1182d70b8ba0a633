"""``kivi``: KIVI, tuning-free asymmetric 2/4-bit KV-cache quantization.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
ICML 2024 (arXiv 2402.02750). Keys have a few outlier channels, so they are
quantized per channel: each channel of each group of ``group_size`` tokens shares
one scale and zero point. Values are quantized per token, in groups of
``group_size`` along the head dimension. The most recent tokens stay in full
precision (the residual of length R = ``window``), following the reference code:

- keys: the residual grows until it holds R tokens and is then quantized as one
  block (R is a multiple of ``group_size``), so 0..R-1 keys stay in full precision;
- values: the residual always holds the last R tokens; older ones are quantized
  one token at a time as they leave it.

As in the reference, a step attends over the new tokens in full precision and
quantizes them afterwards (at the end of ``attend``). Attention reads the codes as
parts (``ops.attention``): keys per channel (``ChannelCodes``), values per token with
their scales applied to the probabilities (``TokenCodes``), the residual dense; no
dequantized copy of the cache is built, prefill attends in bounded key blocks. The
quantized values live in a buffer written in place (``ops.buffers``), so a decode step
does not copy them. Whether keys and values are multiplied packed
(``mx.quantized_matmul``; ``transpose=False`` for the per-channel keys stored as K^T) or
read as floats in bounded blocks is measured per backend (``ops.kernels``).
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
    channel_roundtrip,
    code_flips,
)
from veloxquant_mlx.cache.profile import Profile
from veloxquant_mlx.cache.segments import ChannelCodes, Dense, StoredForm, TokenCodes
from veloxquant_mlx.cache.stored import StoredFormCache
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.options import MethodOptions
from veloxquant_mlx.register import register

if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig

KIVI_BITS = (2, 4)


@dataclass(frozen=True)
class KIVIOptions(MethodOptions):
    """KIVI (Liu et al., ICML 2024, https://arxiv.org/abs/2402.02750).

    bits: code width of keys and values; group_size: tokens per key group (per
    channel) and channels per value group (per token); window: the full-precision
    residual R, a multiple of ``group_size``; block: values older than the last R
    leave the residual this many at a time (1: one per step, as the reference code).
    """

    bits: int = 2
    group_size: int = 32
    window: int = 128
    block: int = 16

    def __post_init__(self) -> None:
        self.check_int("bits", KIVI_BITS)
        self.check_int("group_size", q.AFFINE_GROUP_SIZES)
        self.check_int("window", minimum=0)
        self.check_int("block", minimum=1)
        if self.window == 0 or self.window % self.group_size:
            raise self.error("window", f"a positive multiple of group_size={self.group_size} "
                             "(KIVI quantizes the key residual in blocks of window tokens)")


def _tune_grid(context: int) -> list[dict[str, Any]]:
    # The paper's 2 and 4 bits with residual windows of 32 to 128 tokens.
    return [dict(bits=b, group_size=32, window=w) for b in (4, 2) for w in (128, 32)]


def _ring_alignment(opts: Any) -> int:
    # Keys are quantized in blocks of the residual length, counted from the cache's
    # first token: a drop of whole blocks keeps the rest aligned.
    return opts.window


def _precision_ladders() -> dict[str, dict[str, Any]]:
    return {"kivi": {"base": {}, "knobs": {"bits": (2, 4)},
                         "streams": {"bits": ("keys", "values")}}}


def _stored_numerics(config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
    """Keys: whole blocks of ``window`` tokens coded per channel in groups of
    ``group_size`` tokens; values: per token once older than the last ``window``, in
    blocks of ``block``; both coded at the next update (a step attends over its
    tokens as received); trimming cuts key groups as ``trim`` says. Exact but for
    code flips (measured: at most 0.1 of a step at 4 bits)."""
    o = config.layer_options(layer.layer_idx)
    hold = cast(config.window_dtype)  # the residual's dtype
    keys = Stream(channel_roundtrip(o.bits, o.group_size), block=o.window,
                  commit="next", hold=hold, trim_group=o.group_size)
    values = Stream(affine_roundtrip(o.bits, o.group_size), keep=o.window,
                    block=o.block, commit="next", hold=hold)
    return StoredNumerics(keys, values, bound=code_flips(o.bits, 0.25))


@register
class KIVICache(StoredFormCache):
    """Per-channel key codes, per-token value codes, and a full-precision residual."""

    method = "kivi"
    Options = KIVIOptions
    profile = Profile(
        family="quantization",
        paper="KIVI, Liu et al., ICML 2024 (arXiv 2402.02750)",
        stores="K per-channel / V per-token packed codes + fp residual window",
        rotatable=True,
        drops_front=True,  # in whole key blocks (``ring_alignment``)
        tune_grid=_tune_grid,
        ring_alignment=_ring_alignment,
        ladders=_precision_ladders(),
        small=dict(bits=4, group_size=32, window=32),
        lossless=dict(bits=4, group_size=32, window=128),
        stored_numerics=_stored_numerics,
    )
    attends = True
    meta_fields = {"offset": int, "batch_size": int, "n_bits": int, "group_size": int,
                   "window": int}

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.n_bits = self.opts.bits
        self.group_size = self.opts.group_size
        self.window = self.opts.window
        require_group_divides(self.layer, self.group_size, self.method)
        bits, g = self.n_bits, self.group_size
        # Keys per channel along the tokens, values per token, each followed by its
        # full-precision residual; saved residuals first (earlier files' layout).
        self.codes = (ChannelCodes(bits, g, self.layer.head_dim),
                      TokenCodes(bits, g, self.layer.v_head_dim))
        self.residual = (Dense(), Dense())
        self.stored = StoredForm([self.codes[0], self.residual[0]],
                                 [self.codes[1], self.residual[1]],
                                 state_order=[*self.residual, *self.codes])

    def _incoming(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The chunk in the residual's dtype."""
        wdt = window_dtype(self.config, keys.dtype)
        return keys.astype(wdt), values.astype(wdt)

    def update_and_fetch(self, keys: mx.array, values: mx.array,
                         incoming: tuple[mx.array, mx.array] | None = None
                         ) -> tuple[mx.array, mx.array]:
        self.begin(keys, values)  # a step that did not attend leaves its tokens uncoded
        wdt = window_dtype(self.config, keys.dtype)
        for res, x in zip(self.residual, incoming or self._incoming(keys, values)):
            res.dtype = wdt
            res.append(x)
        return keys, values

    def _commit(self) -> None:
        """Code what has left the residual, as the reference does after a step attended
        over it in full precision: keys in whole blocks of R, values once older than R,
        ``block`` at a time (coding one per step cost every layer a few small MLX
        operations per step and row of a batch, measured)."""
        R = self.window
        res_k, res_v = self.residual
        n_q = res_k.n - res_k.n % R
        if n_q:
            self.codes[0].append(res_k.take(n_q))
        extra = res_v.n - R
        extra -= extra % self.opts.block
        if extra > 0:
            # One token is taken in place (the residual pins it); more are copied out.
            self.codes[1].append(res_v.take(extra, copy=extra > 1).astype(mx.float32))
