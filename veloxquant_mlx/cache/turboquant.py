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
select tree for the codebook, a byte view for affine codes) with the per-vector scales
and biases applied to the small scores and probabilities; prefill attends in bounded
key blocks.

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

from veloxquant_mlx.cache.base import CompressedCache, LayerInfo
from veloxquant_mlx.cache.numerics import StoredNumerics, Stream, cast, code_flips
from veloxquant_mlx.ops import codebook as cb
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.attention import attend_parts
from veloxquant_mlx.ops.buffers import TokenBuffer, owned
from veloxquant_mlx.ops.parts import Slot, slot_parts
from veloxquant_mlx.ops.rotation import shared_rotation
from veloxquant_mlx.options import MethodOptions, config_error
from veloxquant_mlx.register import register

if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig

QUANTIZERS = ("codebook", "affine")
CODEBOOK_BITS = (1, 1.5, 2, 2.5, 3, 3.5, 4)
STREAMS = ("keys", "values")


@dataclass(frozen=True)
class TurboQuantOptions(MethodOptions):
    """TurboQuant-style rotated quantization (https://arxiv.org/abs/2504.19874).

    k_bits / v_bits: code width of keys / values (codebook: 1-4 in halves; affine:
    2, 3, 4, 5, 6, 8); quantizer: ``"codebook"`` (Lloyd-Max, float16 scale per vector)
    or ``"affine"`` (MLX affine codes, one group per vector); rotate: apply the random
    rotation (off only to measure what it buys); sink: first tokens kept in float16;
    window: most recent tokens kept in float16; seed: of the rotation.
    """

    k_bits: float = 4
    v_bits: float = 4
    quantizer: str = "codebook"
    rotate: bool = True
    sink: int = 4
    window: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        self.check_choice("quantizer", QUANTIZERS)
        allowed = CODEBOOK_BITS if self.quantizer == "codebook" else q.AFFINE_BITS
        for name in ("k_bits", "v_bits"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) not in allowed:
                raise self.error(name, f"one of {list(allowed)} for quantizer="
                                 f"{self.quantizer!r}")
        self.check_bool("rotate")
        self.check_int("sink", minimum=0)
        self.check_int("window", minimum=0)
        self.check_int("seed", minimum=0)


class _Codes:
    """One stream's coded tokens in a growing buffer (codebook or affine form)."""

    def __init__(self, quantizer: str, bits: float, d: int) -> None:
        self.quantizer, self.bits, self.d = quantizer, bits, d
        self.buf = TokenBuffer()
        self.widths = tuple(cb.split_bits(bits, d)) if quantizer == "codebook" else ()
        # Bytes decode without a gather; caches saved with bit planes load as planes.
        self.packing = "bytes"

    def append(self, x: mx.array) -> None:
        if self.quantizer == "codebook":
            c = cb.encode(x, self.bits, self.packing)
            self.buf.append(c.arrays)
        else:
            self.buf.append(q.quantize(x.astype(mx.float32), int(self.bits), self.d).arrays)

    def load(self, arrays: list[mx.array] | None) -> None:
        """Adopt saved arrays; a byte-packable width saved as [.., g, bits] is planes."""
        self.buf.load(arrays)
        if arrays and self.quantizer == "codebook":
            planes = any(a.ndim == 5 for a, (_, b) in zip(arrays, self.widths)
                         if b in cb.BYTE_WIDTHS)
            self.packing = "planes" if planes else "bytes"

    def slot(self) -> Slot:
        """What attention reads: the codes as a slot (``ops.attention``)."""
        used = self.buf.used() or []
        n = used[0].shape[2] if used else 0
        if self.quantizer == "codebook":
            return Slot("coded", used, n, (self.widths, self.packing))
        return Slot("token", used, n, (int(self.bits), self.d))

    def nbytes(self, tokens: int, batch_heads: int) -> int:
        if self.quantizer == "codebook":
            per = cb.coded_bytes(1, self.d, self.bits)
        else:
            per = q.quantized_bytes(self.d, int(self.bits), self.d)
        return batch_heads * tokens * per


@register
class TurboQuantCache(CompressedCache):
    """Rotated K/V codes + float16 sinks and recent window."""

    method = "turboquant"
    family = "quantization (rotated)"
    paper = "TurboQuant, Zandieh et al., 2025 (arXiv 2504.19874)"
    stores = "rotated K/V: codebook or affine codes + norm scales, fp16 sinks and window"
    Options = TurboQuantOptions
    attends = True
    meta_fields = ("offset", "batch_size")

    @classmethod
    def stored_numerics(cls, config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
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
                return q.dequantize(q.quantize(x, int(bits), d))

            return Stream(rotated(code), keep=o.window, commit="next",
                          hold=rotated(held), sink=o.sink)

        return StoredNumerics(stream(o.k_bits, layer.head_dim),
                              stream(o.v_bits, layer.v_head_dim),
                              bound=code_flips(min(o.k_bits, o.v_bits), 1.0))

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        o, info = self.opts, self.layer
        for name, d in (("head_dim", info.head_dim), ("v_head_dim", info.v_head_dim)):
            if o.quantizer == "codebook" and d % 8:
                raise config_error("quantizer", o.quantizer, f"'affine' for layer "
                                   f"{info.layer_idx}: {name}={d} is not a multiple of 8",
                                   self.method)
            if o.quantizer == "affine" and d not in q.AFFINE_GROUP_SIZES:
                raise config_error("quantizer", o.quantizer, f"'codebook' for layer "
                                   f"{info.layer_idx}: affine needs {name} in "
                                   f"{list(q.AFFINE_GROUP_SIZES)}, got {d}", self.method)
        self.codes = {"keys": _Codes(o.quantizer, o.k_bits, info.head_dim),
                      "values": _Codes(o.quantizer, o.v_bits, info.v_head_dim)}
        self.sinks: list[mx.array] | None = None  # [keys, values] float16, rotated
        self.win: list[mx.array] | None = None
        self.rot_k = shared_rotation(info.head_dim, o.seed) if o.rotate else None
        self.rot_v = shared_rotation(info.v_head_dim, o.seed) if o.rotate else None
        self.owns_rotation = True  # the builder leaves it to the first layer only

    @classmethod
    def tune_grid(cls, context: int) -> list[dict[str, Any]]:
        # From about 4.5 to about 1.5 bits per value; a window of recent tokens in fp16
        # costs (16 - bits) / context of a bit per value, so it shrinks with the budget.
        widths = [(4, 4, 64), (4, 4, 32), (4, 3, 32), (3.5, 3, 16), (3, 3, 16),
                  (3, 2.5, 16), (2.5, 2.5, 16), (2.5, 2, 8), (2, 2, 8), (2, 1.5, 8),
                  (1.5, 1.5, 8)]
        grid = [dict(k_bits=k, v_bits=v, window=w) for k, v, w in widths]
        grid += [dict(quantizer="affine", k_bits=k, v_bits=v, window=32)
                 for k, v in ((8, 8), (4, 4), (4, 3), (3, 3), (3, 2), (2, 2))]
        return grid

    @classmethod
    def curve_tags(cls, opts: Any) -> list[str]:
        return [] if opts.quantizer == "codebook" else [f"quantizer={opts.quantizer}"]

    @classmethod
    def precision_ladders(cls) -> dict[str, dict[str, Any]]:
        halves, widths = (1, 1.5, 2, 2.5, 3, 3.5, 4), (2, 3, 4, 5, 6, 8)
        streams = {"k_bits": ("keys",), "v_bits": ("values",)}
        return {
            cls.method: {"base": {"window": 16}, "knobs": {"k_bits": halves,
                                                            "v_bits": halves},
                         "streams": streams},
            # MLX affine codes of rotated vectors, up to 8 bits: the wider budgets.
            f"{cls.method}-affine": {"base": {"quantizer": "affine", "window": 32},
                                     "knobs": {"k_bits": widths, "v_bits": widths},
                                     "streams": streams},
        }

    @classmethod
    def small_options(cls) -> dict[str, Any]:
        return dict(window=8)

    @classmethod
    def lossless_options(cls) -> dict[str, Any]:
        return dict(quantizer="affine", k_bits=8, v_bits=8)

    @classmethod
    def after_build(cls, caches: list[CompressedCache], config: KVCacheConfig,
                    model: Any) -> None:
        # The rotations are shared by every layer: the first layer declares them.
        for i, c in enumerate(caches):
            c.owns_rotation = i == 0

    def _rotations(self) -> list[mx.array]:
        if not self.owns_rotation:
            return []
        return list({id(r): r for r in (self.rot_k, self.rot_v) if r is not None}.values())

    # ---- storage ----
    def _rotate(self, x: mx.array, rot: mx.array | None) -> mx.array:
        x = x.astype(mx.float32)
        return x if rot is None else x @ rot

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.check_input(keys, values)
        self._flush()  # a previous step that did not attend leaves its tokens unflushed
        self.batch_size = keys.shape[0]
        k = self._rotate(keys, self.rot_k)
        v = self._rotate(values, self.rot_v)
        wdt = self.window_dtype(mx.float32)
        n_sink = max(0, min(self.opts.sink - self.offset, k.shape[2]))
        if n_sink:
            new = [owned(x[:, :, :n_sink].astype(wdt)) for x in (k, v)]
            self.sinks = new if self.sinks is None else [
                mx.concatenate([a, b], axis=2) for a, b in zip(self.sinks, new)]
            k, v = k[:, :, n_sink:], v[:, :, n_sink:]
        if k.shape[2]:
            new = [k.astype(wdt), v.astype(wdt)]
            self.win = new if self.win is None else [
                mx.concatenate([a, b], axis=2) for a, b in zip(self.win, new)]
        self.offset += keys.shape[2]
        return keys, values

    def _flush(self) -> None:
        """Code the tokens that have left the window (after they were attended)."""
        if self.win is None:
            return
        n = self.win[0].shape[2] - self.opts.window
        if n <= 0:
            return
        for stream, x in zip(STREAMS, self.win):
            self.codes[stream].append(x[:, :, :n])
        rest = self.win[0].shape[2] - n
        # Copies: a kept slice would pin the whole pre-flush window buffer.
        self.win = [owned(x[:, :, n:]) for x in self.win] if rest else None

    # ---- attention ----
    def attention_slots(self) -> tuple[list[Slot], list[Slot]]:
        """Key slots and value slots in token order: sinks, codes, window (rotated)."""
        out = []
        for i, stream in enumerate(STREAMS):
            out.append([Slot("dense", [] if fp is None else [fp[i]],
                             0 if fp is None else fp[i].shape[2])
                        for fp in (self.sinks, None, self.win)])
            out[-1][1] = self.codes[stream].slot()
        return out[0], out[1]

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        dt = queries.dtype
        qr = self._rotate(queries, self.rot_k)
        keys, values = self.attention_slots()
        out = attend_parts(qr, slot_parts(keys), slot_parts(values), scale, mask)
        if self.rot_v is not None:
            out = out @ self.rot_v.T
        self._flush()
        return out.astype(dt)

    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """Transient dense keys/values (decoded, rotated back) for diagnostics."""
        out = []
        for i, (stream, rot) in enumerate(zip(STREAMS, (self.rot_k, self.rot_v))):
            pieces = [] if self.sinks is None else [self.sinks[i].astype(mx.float32)]
            slot = self.codes[stream].slot()
            if slot.n:
                pieces.append(slot.part().dense(0, slot.n, mx.float32))
            if self.win is not None:
                pieces.append(self.win[i].astype(mx.float32))
            x = mx.concatenate(pieces, axis=2)
            out.append((x if rot is None else x @ rot.T).astype(dtype or mx.float32))
        return out[0], out[1]

    # ---- accounting ----
    def held_arrays(self) -> list[mx.array]:
        out = [*(self.sinks or []), *(self.win or [])]
        for c in self.codes.values():
            out.extend(c.buf.arrays or [])
        return out + self._rotations()

    def accounted_bytes(self) -> int:
        B, H = max(self.batch_size, 1), self.layer.n_kv_heads
        fp = sum(a.nbytes for a in (*(self.sinks or []), *(self.win or [])))
        coded = sum(c.nbytes(c.buf.slots, B * H) for c in self.codes.values())
        return fp + coded + sum(r.nbytes for r in self._rotations())

    @property
    def state(self) -> list[Any]:
        return [self.sinks, self.win, *(c.buf.used() for c in self.codes.values())]

    @state.setter
    def state(self, v: list[Any]) -> None:
        self.sinks = list(v[0]) if v[0] else None
        self.win = list(v[1]) if v[1] else None
        for c, arrays in zip(self.codes.values(), v[2:4]):
            c.load(arrays)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens: codes and windows are per token, so it is exact."""
        n = max(0, min(self.offset, n))
        keep = self.offset - n
        n_sink = 0 if self.sinks is None else self.sinks[0].shape[2]
        n_code = self.codes["keys"].buf.n
        if keep < n_sink:
            self.sinks = [owned(x[:, :, :keep]) for x in self.sinks] if keep else None
        w_keep = max(0, keep - n_sink - n_code)
        if self.win is not None:
            self.win = [owned(x[:, :, :w_keep]) for x in self.win] if w_keep else None
        if keep - n_sink < n_code:
            for c in self.codes.values():
                c.buf.truncate(max(0, keep - n_sink))
        self.offset = keep
        return n
