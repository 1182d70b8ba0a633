"""``affine``: MLX's own affine quantization of keys and values (``mx.quantize``).

Each token's key and value vectors are quantized in groups of ``group_size``
along the head dimension (per-token groups, as mlx_lm's ``QuantizedKVCache``).
An optional window of the most recent ``window`` tokens stays in full precision;
tokens leaving the window are quantized. Attention dequantizes the codes into a
transient tensor and runs the dense kernel: on the CPU this is faster than MLX's
quantized matmul, which has no BLAS path.
"""

from __future__ import annotations

import mlx.core as mx

from ..config import KVCacheConfig, config_error
from ..ops import quantize as q
from ..ops.attention import sdpa
from .base import CompressedCache, require_int


class AffineCache(CompressedCache):
    """Quantized K and V codes with per-group scales/biases, plus an fp window."""

    method = "affine"
    compute_dtype = mx.float32

    def __init__(self, config: KVCacheConfig, layer=None) -> None:
        super().__init__(config, layer)
        self.n_bits = config.get("bits", 4)
        self.group_size = config.get("group_size", 64)
        self.window = config.get("window", 0)
        self.qkeys: q.Quantized | None = None
        self.qvalues: q.Quantized | None = None
        self.win_keys: mx.array | None = None
        self.win_values: mx.array | None = None
        for d in (self.layer.head_dim, self.layer.v_head_dim):
            if d % self.group_size:
                raise config_error(
                    "group_size", self.group_size,
                    f"a divisor of head_dim={d} of layer {self.layer.layer_idx} "
                    f"(one of {[g for g in q.AFFINE_GROUP_SIZES if d % g == 0]})",
                )

    @classmethod
    def validate_config(cls, config: KVCacheConfig) -> None:
        require_int("bits", config.get("bits", 4), q.AFFINE_BITS)
        require_int("group_size", config.get("group_size", 64), q.AFFINE_GROUP_SIZES)
        require_int("window", config.get("window", 0), minimum=0)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.check_input(keys, values)
        self.batch_size = keys.shape[0]
        self.compute_dtype = keys.dtype
        self.offset += keys.shape[2]
        wdt = self.window_dtype(keys.dtype)
        if self.win_keys is None:
            wk, wv = keys, values
        else:
            wk = mx.concatenate([self.win_keys, keys.astype(wdt)], axis=2)
            wv = mx.concatenate([self.win_values, values.astype(wdt)], axis=2)
        overflow = wk.shape[2] - self.window
        if overflow > 0:
            # Quantize from the incoming precision where possible (no fp16 round trip).
            old_k = wk[:, :, :overflow].astype(keys.dtype)
            old_v = wv[:, :, :overflow].astype(values.dtype)
            qk = q.quantize(old_k, self.n_bits, self.group_size)
            qv = q.quantize(old_v, self.n_bits, self.group_size)
            self.qkeys = qk if self.qkeys is None else q.concat([self.qkeys, qk], axis=2)
            self.qvalues = qv if self.qvalues is None else q.concat([self.qvalues, qv], axis=2)
            wk, wv = wk[:, :, overflow:], wv[:, :, overflow:]
        if wk.shape[2]:
            self.win_keys, self.win_values = wk.astype(wdt), wv.astype(wdt)
        else:
            self.win_keys = self.win_values = None
        return keys, values

    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """Transient dense keys/values (dequantized codes followed by the window)."""
        dtype = dtype or self.compute_dtype
        ks, vs = [], []
        if self.qkeys is not None:
            ks.append(q.dequantize(self.qkeys, dtype))
            vs.append(q.dequantize(self.qvalues, dtype))
        if self.win_keys is not None:
            ks.append(self.win_keys.astype(dtype))
            vs.append(self.win_values.astype(dtype))
        if len(ks) == 1:
            return ks[0], vs[0]
        return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)

    def attend(self, queries: mx.array, scale: float, mask=None) -> mx.array:
        keys, values = self.dense_kv(queries.dtype)
        return sdpa(queries, keys, values, scale, mask)

    def held_arrays(self) -> list[mx.array]:
        out = [self.win_keys, self.win_values]
        for part in (self.qkeys, self.qvalues):
            if part is not None:
                out.extend(part.arrays)
        return [a for a in out if a is not None]

    def accounted_bytes(self) -> int:
        B, H = max(self.batch_size, 1), self.layer.n_kv_heads
        n_win = 0 if self.win_keys is None else self.win_keys.shape[2]
        n_q = self.offset - n_win
        per_tok_q = sum(q.quantized_bytes(d, self.n_bits, self.group_size)
                        for d in (self.layer.head_dim, self.layer.v_head_dim))
        itemsize = 2 if self.win_keys is None else self.win_keys.itemsize
        per_tok_w = (self.layer.head_dim + self.layer.v_head_dim) * itemsize
        return B * H * (n_q * per_tok_q + n_win * per_tok_w)

    @property
    def state(self):
        arrays = [self.win_keys, self.win_values]
        for part in (self.qkeys, self.qvalues):
            arrays.extend(part.arrays if part is not None else [None, None, None])
        return arrays

    @state.setter
    def state(self, v) -> None:
        self.win_keys, self.win_values = v[0], v[1]
        self._codes = list(v[2:8])
        if hasattr(self, "n_bits"):
            self._build_quantized()

    def _build_quantized(self) -> None:
        c = self._codes
        self.qkeys = None if c[0] is None else q.Quantized(*c[0:3], self.n_bits, self.group_size)
        self.qvalues = None if c[3] is None else q.Quantized(*c[3:6], self.n_bits,
                                                             self.group_size)

    @property
    def meta_state(self):
        return (*super().meta_state, str(self.n_bits), str(self.group_size), str(self.window))

    @meta_state.setter
    def meta_state(self, v) -> None:
        self.offset, self.batch_size = int(v[0]), int(v[1])
        self.n_bits, self.group_size, self.window = int(v[2]), int(v[3]), int(v[4])
        if hasattr(self, "_codes"):
            self._build_quantized()

    # ---- trimming (prompt-cache reuse across chat turns) ----
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (codes are per token, so slicing is exact)."""
        n = max(0, min(self.offset, n))
        keep = self.offset - n
        n_win = 0 if self.win_keys is None else self.win_keys.shape[2]
        n_q = self.offset - n_win
        if keep >= n_q:
            w = keep - n_q
            self.win_keys = self.win_keys[:, :, :w] if w else None
            self.win_values = self.win_values[:, :, :w] if w else None
        else:
            self.win_keys = self.win_values = None
            self.qkeys = _slice_tokens(self.qkeys, keep)
            self.qvalues = _slice_tokens(self.qvalues, keep)
        self.offset = keep
        return n


def _slice_tokens(part: q.Quantized | None, n: int) -> q.Quantized | None:
    if part is None or n == 0:
        return None
    return q.Quantized(*(mx.contiguous(a[:, :, :n]) for a in part.arrays), part.bits,
                       part.group_size)
