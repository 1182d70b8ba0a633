"""``turboquant``: rotated, norm-scaled codebook quantization of keys and values.

After TurboQuant (Zandieh et al., 2025, arXiv 2504.19874). Every key and value vector
of a head is rotated by one seeded random orthogonal matrix ``R`` (a randomized
Hadamard transform, ``ops.rotation``); after rotation each coordinate is close to
``N(0, |x|^2 / d)`` whatever the model, so one fixed scalar quantizer fits every vector:

- ``quantizer="codebook"`` (the paper's): the Lloyd-Max codebook of ``N(0, 1)`` applied
  to ``x / (|x| / sqrt(d))``; a vector costs its float16 scale and ``bits`` per channel,
  packed in bytes for 1, 2 and 4 bits and in bit planes otherwise (``ops.codebook``).
  Fractional widths (2.5, 3.5) give half the channels one more bit.
- ``quantizer="affine"``: MLX's affine codes with one group per rotated vector (scale
  and bias per vector).

Attention reads the codes as parts (``ops.attention``): the codes as floats (a compiled
polynomial of the code for the codebook, a byte view for affine codes) with the
per-vector scales and biases applied to the small scores and probabilities; prefill
attends in bounded key blocks.

Queries are rotated the same way, so scores need no inverse; the attention output,
computed over rotated values, is rotated back once per head (``out R^T``). The first
``sink`` tokens (attention sinks) and the most recent ``window`` tokens stay in float16;
as in KIVI, a step attends over its new tokens in full precision and they are coded at
the end of the step. Keys and values have their own widths (``k_bits``, ``v_bits``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from veloxquant_mlx.cache.base import LayerInfo, window_dtype
from veloxquant_mlx.cache.numerics import StoredNumerics, Stream, cast, code_flips
from veloxquant_mlx.cache.profile import Profile
from veloxquant_mlx.cache.rotated import first_layer_owns
from veloxquant_mlx.cache.segments import (
    CodebookCodes,
    Dense,
    FloatCodes,
    Segment,
    StoredForm,
    TokenCodes,
)
from veloxquant_mlx.cache.stored import StoredFormCache
from veloxquant_mlx.ops import codebook as cb
from veloxquant_mlx.ops import fpcodes as fp
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.buffers import owned
from veloxquant_mlx.ops.rotation import shared_rotation
from veloxquant_mlx.options import MethodOptions, config_error
from veloxquant_mlx.register import register

if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig

QUANTIZERS = ("codebook", "affine", "float")
FLOAT_MODES = {4: "nvfp4", 8: "mxfp8"}  # bits -> MLX microscaled float mode
CODEBOOK_BITS = (1, 1.5, 2, 2.5, 3, 3.5, 4)


@dataclass(frozen=True)
class TurboQuantOptions(MethodOptions):
    """TurboQuant-style rotated quantization (https://arxiv.org/abs/2504.19874).

    k_bits / v_bits: code width of keys / values (codebook: 1-4 in halves; affine:
    2, 3, 4, 5, 6, 8; float: 4 or 8); quantizer: ``"codebook"`` (Lloyd-Max, float16
    scale per vector), ``"affine"`` (MLX affine codes, one group per vector) or
    ``"float"`` (MLX microscaled floats: ``nvfp4`` at 4 bits, an E4M3 scale per 16
    channels; ``mxfp8`` at 8; multiplied fused by ``mx.quantized_matmul`` on every
    backend); rotate: apply the random
    rotation (off only to measure what it buys); sink: first tokens kept in float16;
    window: most recent tokens kept in float16; block: tokens leave the window for
    codes this many at a time (the window holds ``window`` to ``window + block - 1``
    tokens; 1: one per step); seed: of the rotation.
    """

    k_bits: float = 4
    v_bits: float = 4
    quantizer: str = "codebook"
    rotate: bool = True
    sink: int = 4
    window: int = 32
    block: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        self.check_choice("quantizer", QUANTIZERS)
        allowed = {"codebook": CODEBOOK_BITS, "affine": q.AFFINE_BITS,
                   "float": tuple(FLOAT_MODES)}[self.quantizer]
        for name in ("k_bits", "v_bits"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) not in allowed:
                raise self.error(name, f"one of {list(allowed)} for quantizer="
                                 f"{self.quantizer!r}")
        self.check_bool("rotate")
        self.check_int("sink", minimum=0)
        self.check_int("window", minimum=0)
        self.check_int("block", minimum=1)
        self.check_int("seed", minimum=0)


def _stored_numerics(config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
    """Sinks and the window as received; every other token, at the next update, as
    its codes of the rotated vector rotated back. Exact but for code flips (the
    cache attends in the rotated basis; measured: at most 0.56 of a step with 4-bit
    codebook codes, 0.1 with 8-bit affine codes)."""
    o = config.layer_options(layer.layer_idx)

    held = cast(config.window_dtype) or (lambda x: x)

    def stream(bits: float, d: int) -> Stream:
        def rotated(fn: Any) -> Any:
            # ``fn`` on the rotated vectors, rotated back (the rotation is shared).
            def through(x: mx.array) -> mx.array:
                rot = shared_rotation(d, o.seed) if o.rotate else None
                x = x.astype(mx.float32)
                return fn(x) if rot is None else fn(x @ rot) @ rot.T
            return through

        def code(x: mx.array) -> mx.array:
            if o.quantizer == "codebook":
                return cb.decode(cb.encode(x, bits, "bytes"))
            if o.quantizer == "float":
                return fp.decode(fp.encode(x, FLOAT_MODES[int(bits)]))
            return q.dequantize(q.quantize(x, int(bits), d))

        return Stream(rotated(code), keep=o.window, block=o.block, commit="next",
                      hold=rotated(held), sink=sinks_of(o, layer))

    return StoredNumerics(stream(o.k_bits, layer.head_dim),
                          stream(o.v_bits, layer.v_head_dim),
                          bound=code_flips(min(o.k_bits, o.v_bits), 1.0))


def _tune_grid(context: int) -> list[dict[str, Any]]:
    # From about 4.5 to about 1.5 bits per value; a window of recent tokens in fp16
    # costs (16 - bits) / context of a bit per value, so it shrinks with the budget.
    widths = [(4, 4, 64), (4, 4, 32), (4, 3, 32), (3.5, 3, 16), (3, 3, 16),
              (3, 2.5, 16), (2.5, 2.5, 16), (2.5, 2, 8), (2, 2, 8), (2, 1.5, 8),
              (1.5, 1.5, 8)]
    grid = [dict(k_bits=k, v_bits=v, window=w) for k, v, w in widths]
    grid += [dict(quantizer="affine", k_bits=k, v_bits=v, window=32)
             for k, v in ((8, 8), (4, 4), (4, 3), (3, 3), (3, 2), (2, 2))]
    grid += [dict(quantizer="float", k_bits=k, v_bits=v, window=32)
             for k, v in ((8, 8), (8, 4), (4, 4))]
    return grid


def _curve_tags(opts: Any) -> list[str]:
    return [] if opts.quantizer == "codebook" else [f"quantizer={opts.quantizer}"]


def _precision_ladders() -> dict[str, dict[str, Any]]:
    halves, widths = (1, 1.5, 2, 2.5, 3, 3.5, 4), (2, 3, 4, 5, 6, 8)
    streams = {"k_bits": ("keys",), "v_bits": ("values",)}
    return {
        "turboquant": {"base": {"window": 16},
                       "knobs": {"k_bits": halves, "v_bits": halves}, "streams": streams},
        # MLX affine codes of rotated vectors, up to 8 bits: the wider budgets.
        "turboquant-affine": {"base": {"quantizer": "affine", "window": 32},
                              "knobs": {"k_bits": widths, "v_bits": widths},
                              "streams": streams},
    }


@register
class TurboQuantCache(StoredFormCache):
    """Rotated K/V codes + float16 sinks and recent window."""

    method = "turboquant"
    Options = TurboQuantOptions
    profile = Profile(
        family="quantization (rotated)",
        paper="TurboQuant, Zandieh et al., 2025 (arXiv 2504.19874)",
        stores="rotated K/V: codebook or affine codes + norm scales, fp16 sinks and window",
        recommended=True,  # near-lossless at 0.29 of fp16 (BENCHMARKS.md)
        # Codes are per token: a sliding-window ring drops its oldest sinks and codes
        # (never the float16 window, whose commit timing is part of the numerics).
        drops_front=True,
        stored_numerics=_stored_numerics,
        after_build=first_layer_owns,  # its rotations are shared by every layer
        tune_grid=_tune_grid,
        curve_tags=_curve_tags,
        ladders=_precision_ladders(),
        small=dict(window=8),
        lossless=dict(quantizer="affine", k_bits=8, v_bits=8),
    )
    attends = True
    attend_dtype = mx.float32

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        o, info = self.opts, self.layer
        for name, d in (("head_dim", info.head_dim), ("v_head_dim", info.v_head_dim)):
            if o.quantizer == "codebook" and d % 8:
                raise config_error("quantizer", o.quantizer, f"'affine' for layer "
                                   f"{info.layer_idx}: {name}={d} is not a multiple of 8",
                                   self.method)
            if o.quantizer == "float" and d % 32:
                raise config_error("quantizer", o.quantizer, f"'codebook' for layer "
                                   f"{info.layer_idx}: float codes need {name}={d} to be "
                                   "a multiple of 32", self.method)
            if o.quantizer == "affine" and d not in q.AFFINE_GROUP_SIZES:
                raise config_error("quantizer", o.quantizer, f"'codebook' for layer "
                                   f"{info.layer_idx}: affine needs {name} in "
                                   f"{list(q.AFFINE_GROUP_SIZES)}, got {d}", self.method)
        # Per side, in token order: float16 sinks, codes, the float16 recent window (all
        # rotated). Saved as [sinks, window, key codes, value codes], each one nested list.
        self.sinks = (Dense(), Dense())
        self.codes = tuple(self._codes(b, d) for b, d in ((o.k_bits, info.head_dim),
                                                          (o.v_bits, info.v_head_dim)))
        self.window = (Dense(), Dense())
        self.stored = StoredForm(
            [self.sinks[0], self.codes[0], self.window[0]],
            [self.sinks[1], self.codes[1], self.window[1]],
            state_order=[self.sinks, self.window, self.codes[:1], self.codes[1:]])
        if o.rotate:
            self.basis = (shared_rotation(info.head_dim, o.seed),
                          shared_rotation(info.v_head_dim, o.seed))
        self.owns_rotation = True  # the builder leaves it to the first layer only

    def _codes(self, bits: float, d: int) -> Segment:
        if self.opts.quantizer == "codebook":
            return CodebookCodes(bits, d)
        if self.opts.quantizer == "float":
            return FloatCodes(FLOAT_MODES[int(bits)], d)
        # One group per rotated vector; float32 in, so the scales are float32.
        return TokenCodes(int(bits), d, d, dtype=mx.float32)

    def shared_arrays(self) -> list[mx.array]:
        if not self.owns_rotation:
            return []
        return list({id(r): r for r in self.basis if r is not None}.values())

    # ---- storage ----
    def _incoming(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The chunk rotated and in the window dtype, as the sinks and window hold it."""
        wdt = window_dtype(self.config, mx.float32)
        x32 = [x.astype(mx.float32) for x in (keys, values)]
        k, v = ((x if r is None else x @ r).astype(wdt) for x, r in zip(x32, self.basis))
        return k, v

    def update_and_fetch(self, keys: mx.array, values: mx.array,
                         incoming: tuple[mx.array, mx.array] | None = None
                         ) -> tuple[mx.array, mx.array]:
        n_sink = max(0, min(sinks_of(self.opts, self.layer) - self.offset, keys.shape[2]))
        self.begin(keys, values)  # a step that did not attend leaves its tokens uncoded
        wdt = window_dtype(self.config, mx.float32)
        for sink, win, x in zip(self.sinks, self.window,
                                incoming or self._incoming(keys, values)):
            if n_sink:  # owned copies: a kept slice would pin the whole chunk
                sink.append(owned(x[:, :, :n_sink]))
                x = owned(x[:, :, n_sink:]) if x.shape[2] > n_sink else x[:, :, :0]
            if x.shape[2]:
                win.dtype = wdt
                win.append(x)
        return keys, values

    def _commit(self) -> None:
        """Code the tokens that have left the window (after they were attended), whole
        blocks of them: coding one token per step cost a layer about 30 small MLX
        operations per step, the largest part of a batch step's overhead (measured)."""
        n = self.window[0].n - self.opts.window
        n -= n % self.opts.block
        if n <= 0:
            return
        for codes, win in zip(self.codes, self.window):
            # ``take`` copies the rest: a kept slice would pin the pre-commit buffer.
            codes.append(win.take(n))

    def drop_oldest(self, n: int) -> None:
        """Forget up to ``n`` oldest tokens, sinks then codes (sliced, never re-coded),
        for a sliding-window ring (``cache.sliding``, which reads back how many went).

        The float16 window is never cut: when its tokens are coded follows how many it
        holds (whole ``block`` s past ``window``), and a cut would code them at other
        steps than the declared numerics. It holds at most ``window + block - 1`` tokens
        after a commit, so the ring stays bounded all the same."""
        self._commit()
        n = min(n, self.sinks[0].n + self.codes[0].n)
        if n > 0:
            self.stored.drop_front(n)
            self.offset -= n


def sinks_of(opts: TurboQuantOptions, layer: LayerInfo) -> int:
    """Float16 sink tokens of a layer: ``sink``, at most ``W - 1`` in a sliding-window
    layer of window ``W``. A ring keeps at least ``W - 1`` tokens after a drop, so it
    never holds fewer than the sinks and never files a later token as one."""
    if layer.sliding_window:
        return min(opts.sink, max(int(layer.sliding_window) - 1, 0))
    return opts.sink
