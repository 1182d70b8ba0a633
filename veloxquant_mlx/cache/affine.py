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
from typing import Any, ClassVar

import mlx.core as mx

from veloxquant_mlx.cache.base import CompressedCache, LayerInfo, require_group_divides
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.attention import Slot, attend_parts, slot_parts
from veloxquant_mlx.options import MethodOptions
from veloxquant_mlx.registry import register


def reserve(n: int) -> int:
    """Spare token slots added when a buffer grows to ``n`` tokens (~3%)."""
    return n // 32


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


@register
class AffineCache(CompressedCache):
    """Quantized K and V codes with per-group scales/biases, plus an fp window."""

    method = "affine"
    family = "quantization"
    paper = "MLX affine quantization (mx.quantize)"
    stores = "K and V codes + per-group scale/bias, optional fp window"
    Options = AffineOptions
    attends = True
    rotatable = True
    meta_fields = ("offset", "batch_size", "n_bits", "group_size", "window")
    compute_dtype = mx.float32
    # Multiply on the packed codes (``mx.quantized_matmul``) instead of dequantizing
    # into a transient first; see the measurements in docs/methods/affine.md.
    use_quantized_matmul: ClassVar[bool] = False

    @classmethod
    def tune_grid(cls, context: int) -> list[dict[str, Any]]:
        # 8 bits down to 2, groups of 32 (finer scales) below 8 bits; a 32-token fp window.
        return [dict(bits=b, group_size=g, window=32)
                for b, g in ((8, 64), (6, 64), (5, 32), (4, 32), (3, 32), (2, 32))]

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.n_bits = self.opts.bits
        self.group_size = self.opts.group_size
        self.window = self.opts.window
        # [codes, scales, biases] buffers of keys and values; the first n_q slots are used.
        self.kbuf: list[mx.array] | None = None
        self.vbuf: list[mx.array] | None = None
        self.n_q = 0
        self.win_keys: mx.array | None = None
        self.win_values: mx.array | None = None
        require_group_divides(self.layer, self.group_size, self.method)

    # ---- the quantized part ----
    def _part(self, buf: list[mx.array] | None) -> q.Quantized | None:
        if buf is None or self.n_q == 0:
            return None
        if buf[0].shape[2] != self.n_q:
            buf = [a[:, :, :self.n_q] for a in buf]
        return q.Quantized(*buf, self.n_bits, self.group_size)

    @property
    def qkeys(self) -> q.Quantized | None:
        return self._part(self.kbuf)

    @property
    def qvalues(self) -> q.Quantized | None:
        return self._part(self.vbuf)

    def _append_codes(self, k: mx.array, v: mx.array) -> None:
        qk = q.quantize(k, self.n_bits, self.group_size)
        qv = q.quantize(v, self.n_bits, self.group_size)
        n, L = self.n_q, k.shape[2]
        if self.kbuf is None or n + L > self.kbuf[0].shape[2]:
            # Grow with a small reserve so decode steps write in place, not concatenate.
            spare = reserve(n + L)
            self.kbuf, self.vbuf = (
                [_grown(b, new, n, spare) for b, new in
                 zip(buf or [None] * 3, part.arrays)]
                for buf, part in ((self.kbuf, qk), (self.vbuf, qv))
            )
        else:
            for buf, part in ((self.kbuf, qk), (self.vbuf, qv)):
                for i, new in enumerate(part.arrays):
                    buf[i][:, :, n:n + L] = new
        self.n_q = n + L

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.check_input(keys, values)
        self.batch_size = keys.shape[0]
        self.compute_dtype = keys.dtype
        self.offset += keys.shape[2]
        if self.window == 0:
            self._append_codes(keys, values)
            return keys, values
        wdt = self.window_dtype(keys.dtype)
        if self.win_keys is None:
            wk, wv = keys, values
        else:
            # The window is small (``window`` tokens): joining it is cheap.
            wk = mx.concatenate([self.win_keys, keys.astype(wdt)], axis=2)
            wv = mx.concatenate([self.win_values, values.astype(wdt)], axis=2)
        overflow = wk.shape[2] - self.window
        if overflow > 0:
            # Quantize from the incoming precision where possible (no fp16 round trip).
            self._append_codes(wk[:, :, :overflow].astype(keys.dtype),
                               wv[:, :, :overflow].astype(values.dtype))
            wk, wv = wk[:, :, overflow:], wv[:, :, overflow:]
        wk, wv = wk.astype(wdt), wv.astype(wdt)
        if overflow > 1:
            # A kept slice pins its whole parent (window + chunk): copy it out (no-op when
            # the cast made a new buffer). A decode step pins one token more, no copy.
            wk, wv = mx.contiguous(wk), mx.contiguous(wv)
        self.win_keys, self.win_values = wk, wv
        return keys, values

    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """Transient dense keys/values (dequantized codes followed by the window)."""
        dtype = dtype or self.compute_dtype
        ks, vs = [], []
        if self.n_q:
            ks.append(q.dequantize(self.qkeys, dtype))
            vs.append(q.dequantize(self.qvalues, dtype))
        if self.win_keys is not None:
            ks.append(self.win_keys.astype(dtype))
            vs.append(self.win_values.astype(dtype))
        if len(ks) == 1:
            return ks[0], vs[0]
        return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)

    def attention_slots(self) -> tuple[list[Slot], list[Slot]]:
        """Key and value slots in token order: the codes, then the window."""
        meta, packed = (self.n_bits, self.group_size), self.use_quantized_matmul
        n_win = 0 if self.win_keys is None else self.win_keys.shape[2]
        out = []
        for part, win in ((self.qkeys, self.win_keys), (self.qvalues, self.win_values)):
            out.append([Slot("token", part.arrays if part else [], self.n_q, meta, packed),
                        Slot("dense", [] if win is None else [win], n_win)])
        return out[0], out[1]

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        keys, values = self.attention_slots()
        return attend_parts(queries, slot_parts(keys), slot_parts(values), scale, mask)

    # ---- storage ----
    def held_arrays(self) -> list[mx.array]:
        out = [self.win_keys, self.win_values, *(self.kbuf or []), *(self.vbuf or [])]
        return [a for a in out if a is not None]

    def accounted_bytes(self) -> int:
        B, H = max(self.batch_size, 1), self.layer.n_kv_heads
        n_win = 0 if self.win_keys is None else self.win_keys.shape[2]
        slots = 0 if self.kbuf is None else self.kbuf[0].shape[2]  # tokens + reserve
        per_tok_q = sum(q.quantized_bytes(d, self.n_bits, self.group_size)
                        for d in (self.layer.head_dim, self.layer.v_head_dim))
        itemsize = 2 if self.win_keys is None else self.win_keys.itemsize
        per_tok_w = (self.layer.head_dim + self.layer.v_head_dim) * itemsize
        return B * H * (slots * per_tok_q + n_win * per_tok_w)

    @property
    def state(self):
        return [self.win_keys, self.win_values, *q.state_arrays(self.qkeys, self.qvalues)]

    @state.setter
    def state(self, v) -> None:
        self.win_keys, self.win_values = v[0], v[1]
        self.kbuf = None if v[2] is None else list(v[2:5])
        self.vbuf = None if v[5] is None else list(v[5:8])
        self.n_q = 0 if v[2] is None else v[2].shape[2]

    # ---- trimming (prompt-cache reuse across chat turns) ----
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (codes are per token, so slicing is exact)."""
        n = max(0, min(self.offset, n))
        keep = self.offset - n
        if keep >= self.n_q:
            w = keep - self.n_q
            # Copies: a kept slice would pin the trimmed tail.
            self.win_keys = mx.contiguous(self.win_keys[:, :, :w]) if w else None
            self.win_values = mx.contiguous(self.win_values[:, :, :w]) if w else None
        else:
            self.win_keys = self.win_values = None
            # Exact copies: the trimmed tail (and the reserve) is released.
            self.kbuf = [mx.contiguous(a[:, :, :keep]) for a in self.kbuf] if keep else None
            self.vbuf = [mx.contiguous(a[:, :, :keep]) for a in self.vbuf] if keep else None
            self.n_q = keep
        self.offset = keep
        return n


def _grown(buf: mx.array | None, new: mx.array, used: int, spare: int) -> mx.array:
    """``buf[:, :, :used]`` followed by ``new`` and ``spare`` empty token slots."""
    parts = [] if buf is None or used == 0 else [buf[:, :, :used]]
    parts.append(new)
    if spare:
        parts.append(mx.zeros((*new.shape[:2], spare, *new.shape[3:]), new.dtype))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
