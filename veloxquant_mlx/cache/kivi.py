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
does not copy them. ``use_quantized_matmul = True`` multiplies the packed codes with
``mx.quantized_matmul`` instead (slower on the CPU; docs/cpu-performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from veloxquant_mlx.cache.base import CompressedCache, LayerInfo, require_group_divides
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.attention import Slot, attend_parts, slot_parts
from veloxquant_mlx.ops.buffers import TokenBuffer
from veloxquant_mlx.options import MethodOptions
from veloxquant_mlx.registry import register

KIVI_BITS = (2, 4)


@dataclass(frozen=True)
class KIVIOptions(MethodOptions):
    """KIVI (Liu et al., ICML 2024, https://arxiv.org/abs/2402.02750).

    bits: code width of keys and values; group_size: tokens per key group (per
    channel) and channels per value group (per token); window: the full-precision
    residual R, a multiple of ``group_size``.
    """

    bits: int = 2
    group_size: int = 32
    window: int = 128

    def __post_init__(self) -> None:
        self.check_int("bits", KIVI_BITS)
        self.check_int("group_size", q.AFFINE_GROUP_SIZES)
        self.check_int("window", minimum=0)
        if self.window == 0 or self.window % self.group_size:
            raise self.error("window", f"a positive multiple of group_size={self.group_size} "
                             "(KIVI quantizes the key residual in blocks of window tokens)")


@register
class KIVICache(CompressedCache):
    """Per-channel key codes, per-token value codes, and a full-precision residual."""

    method = "kivi"
    family = "quantization"
    paper = "KIVI, Liu et al., ICML 2024 (arXiv 2402.02750)"
    stores = "K per-channel / V per-token packed codes + fp residual window"
    Options = KIVIOptions
    attends = True
    rotatable = True
    meta_fields = ("offset", "batch_size", "n_bits", "group_size", "window")
    # Attend on the packed codes (mx.quantized_matmul) instead of a dequantized transient.
    use_quantized_matmul = False

    @classmethod
    def tune_grid(cls, context: int) -> list[dict[str, Any]]:
        # The paper's 2 and 4 bits with residual windows of 32 to 128 tokens.
        return [dict(bits=b, group_size=32, window=w) for b in (4, 2) for w in (128, 32)]

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.n_bits = self.opts.bits
        self.group_size = self.opts.group_size
        self.window = self.opts.window
        self.qkeys: q.Quantized | None = None  # [B, H, D, Tk * bits / 32], packed along tokens
        self.vbuf = TokenBuffer()  # value codes, scales, biases: [B, H, Tv, ...]
        self.res_keys: mx.array | None = None
        self.res_values: mx.array | None = None
        self.compute_dtype = mx.float32
        require_group_divides(self.layer, self.group_size, self.method)

    @property
    def qvalues(self) -> q.Quantized | None:
        """The quantized values ``[B, H, Tv, Dv * bits / 32]`` (views of the buffer)."""
        used = self.vbuf.used()
        return None if used is None else q.Quantized(*used, self.n_bits, self.group_size)

    # ---- storage ----
    def _flush(self) -> bool:
        """Quantize what has left the residual (keys: whole blocks of R; values: > R).

        Returns whether a key block was quantized."""
        R = self.window
        block = False
        if self.res_keys is not None:
            n = self.res_keys.shape[2]
            n_q = n - n % R
            if n_q:
                # Quantize in float32: float16 scales are computed from exact min/max.
                qk = q.quantize_tokens(self.res_keys[:, :, :n_q].astype(mx.float32),
                                       self.n_bits, self.group_size)
                self.qkeys = qk if self.qkeys is None else q.concat_packed([self.qkeys, qk])
                # Only a multi-token chunk leaves a remainder: copy it, or the slice
                # would pin the whole residual it was cut from.
                self.res_keys = mx.contiguous(self.res_keys[:, :, n_q:]) if n_q < n else None
                block = True
        if self.res_values is not None:
            n = self.res_values.shape[2]
            if n > R:
                qv = q.quantize(self.res_values[:, :, : n - R].astype(mx.float32),
                                self.n_bits, self.group_size)
                self.vbuf.append(qv.arrays)  # in place: a decode step copies nothing
                self.res_values = self.res_values[:, :, n - R:]
                if n - R > 1:
                    # The slice pins its parent (residual + chunk): copy it. A decode step
                    # pins one token more than R, no copy.
                    self.res_values = mx.contiguous(self.res_values)
        return block

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.check_input(keys, values)
        self._flush()  # a previous step that did not attend leaves its tokens unflushed
        self.batch_size = keys.shape[0]
        self.compute_dtype = keys.dtype
        self.offset += keys.shape[2]
        wdt = self.window_dtype(keys.dtype)
        k, v = keys.astype(wdt), values.astype(wdt)
        self.res_keys = k if self.res_keys is None else mx.concatenate([self.res_keys, k], axis=2)
        self.res_values = v if self.res_values is None else mx.concatenate(
            [self.res_values, v], axis=2)
        return keys, values

    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """Transient dense keys/values: dequantized codes followed by the residual."""
        dtype = dtype or self.compute_dtype
        ks = [] if self.qkeys is None else [q.dequantize_tokens(self.qkeys, dtype)]
        vs = [] if self.qvalues is None else [q.dequantize(self.qvalues, dtype)]
        if self.res_keys is not None:
            ks.append(self.res_keys.astype(dtype))
        if self.res_values is not None:
            vs.append(self.res_values.astype(dtype))
        k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
        v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
        return k, v

    # ---- attention ----
    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        out = self._attend_split(queries, scale, mask, packed=self.use_quantized_matmul)
        # As the reference: the new tokens were attended in full precision.
        if self._flush() and queries.shape[2] == 1:
            # A decode step completed a key block (once per R steps): evaluate the codes
            # now. Left lazy (the step's logits do not need them), their graph would keep
            # the old codes and the block's full-precision keys alive until the next step.
            mx.eval(*self.held_arrays())
        return out

    def attention_slots(self, packed: bool = False) -> tuple[list[Slot], list[Slot]]:
        """Key slots and value slots (codes, then the residual) in token order; keys and
        values are cut at different tokens."""
        meta = (self.n_bits, self.group_size)
        qk, qv = self.qkeys, self.qvalues
        n_kq = 0 if qk is None else qk.scales.shape[-1] * self.group_size
        n_vq = 0 if qv is None else qv.codes.shape[2]
        out = []
        for kind, part, n, res in (("channel", qk, n_kq, self.res_keys),
                                   ("token", qv, n_vq, self.res_values)):
            out.append([Slot(kind, part.arrays if part else [], n, meta, packed),
                        Slot("dense", [] if res is None else [res],
                             0 if res is None else res.shape[2])])
        return out[0], out[1]

    def _attend_split(self, queries: mx.array, scale: float, mask: Any,
                      packed: bool = False) -> mx.array:
        """Attention over the quantized part and the residual, kept apart (keys and
        values are cut at different tokens: only the small scores are joined).
        ``packed`` multiplies on the codes with ``mx.quantized_matmul``."""
        keys, values = self.attention_slots(packed)
        return attend_parts(queries, slot_parts(keys), slot_parts(values), scale, mask)

    # ---- accounting ----
    def held_arrays(self) -> list[mx.array]:
        out = [self.res_keys, self.res_values, *(self.vbuf.arrays or [])]
        if self.qkeys is not None:
            out.extend(self.qkeys.arrays)
        return [a for a in out if a is not None]

    def accounted_bytes(self) -> int:
        B, H = max(self.batch_size, 1), self.layer.n_kv_heads
        D, Dv = self.layer.head_dim, self.layer.v_head_dim
        n_kr = 0 if self.res_keys is None else self.res_keys.shape[2]
        n_vr = 0 if self.res_values is None else self.res_values.shape[2]
        itemsize = self.window_dtype(self.compute_dtype).size
        n_kq = self.offset - n_kr
        # Keys: D channels, each a row of n_kq tokens; values: the buffer's token slots
        # (the used ones and a reserve of about 3%), Dv each.
        key_q = D * q.quantized_bytes(n_kq, self.n_bits, self.group_size) if n_kq else 0
        val_q = self.vbuf.slots * q.quantized_bytes(Dv, self.n_bits, self.group_size)
        return B * H * (key_q + val_q + (n_kr * D + n_vr * Dv) * itemsize)

    # ---- trimming (speculative decoding, prompt-cache reuse) ----
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens. Residual tokens and per-token value codes are cut
        exactly; whole key groups are dropped, and the kept tokens of a key group cut in
        the middle return to the residual as their dequantized values (what attention
        already read for them) until the next key block is quantized."""
        n = max(0, min(self.offset, n))
        if n:
            self._trim_keys(n)
            n_vr = 0 if self.res_values is None else self.res_values.shape[2]
            self.res_values = _cut(self.res_values, n_vr - min(n, n_vr))
            if n > n_vr:
                self.vbuf.truncate(self.vbuf.n - (n - n_vr))
            self.offset -= n
        return n

    def _trim_keys(self, n: int) -> None:
        n_kr = 0 if self.res_keys is None else self.res_keys.shape[2]
        if n <= n_kr:
            self.res_keys = _cut(self.res_keys, n_kr - n)
            return
        keep = self.offset - n  # quantized key tokens that stay
        whole, tail = divmod(keep, self.group_size)
        self.res_keys = None
        if tail:
            group = q.slice_groups(self.qkeys, whole, whole + 1)
            dense = q.dequantize_tokens(group, mx.float32)[:, :, :tail]
            self.res_keys = mx.contiguous(dense.astype(self.window_dtype(self.compute_dtype)))
        self.qkeys = q.slice_groups(self.qkeys, 0, whole) if whole else None

    # ---- save / restore ----
    @property
    def state(self):
        return [self.res_keys, self.res_values, *q.state_arrays(self.qkeys, self.qvalues)]

    @state.setter
    def state(self, v) -> None:
        self.res_keys, self.res_values = v[0], v[1]
        self.qkeys = None if v[2] is None else q.Quantized(*v[2:5], self.n_bits,
                                                           self.group_size)
        self.vbuf.load(None if v[5] is None else list(v[5:8]))


def _cut(x: mx.array | None, keep: int) -> mx.array | None:
    """The first ``keep`` tokens of ``x`` as a copy (a slice would pin the trimmed tail)."""
    if x is None or keep <= 0:
        return None
    return x if keep == x.shape[2] else mx.contiguous(x[:, :, :keep])
