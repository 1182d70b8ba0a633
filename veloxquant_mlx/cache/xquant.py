"""``xquant`` and ``xquant_cl``: cache the quantized layer input X, rematerialize K and V.

XQuant (Tomar et al., 2025, arXiv 2508.10395) stores, per layer and token, the
quantized attention input X (the normalized hidden state) instead of K and V, and
rebuilds ``K = X W_k (+ b_k, then RoPE)`` and ``V = X W_v (+ b_v)`` when attending.
For GQA models, where X is wider than K and V together, ``xquant_latent`` stores
``X U_k`` and ``X U_v`` from the SVD of the projection weights instead.

XQuant-CL stores the first layer's input (the anchor) and, for every later layer,
the quantized delta of its input to the previous layer's *reconstruction*, so each
layer's quantization error is corrected by the next delta instead of piling up.
It works on the residual stream (the block input before its norm), where layer-to-
layer changes are small; each layer applies its own norm when it rematerializes.

The attention itself runs in the X hook (``cache.xquant_hook``),
which ``KVCacheBuilder.for_model`` installs through ``after_build``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from veloxquant_mlx.cache.base import CompressedCache, LayerInfo
from veloxquant_mlx.cache.numerics import StoredNumerics, dense_loss
from veloxquant_mlx.cache.restore_check import check_arrays
from veloxquant_mlx.cache.xquant_coordinator import XQuantCoordinator
from veloxquant_mlx.cache.xquant_hook import install_x_hook, uninstall_x_hook, x_hook_installed
from veloxquant_mlx.ops import factors as fr
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.buffers import owned
from veloxquant_mlx.options import MethodOptions, config_error
from veloxquant_mlx.register import register

if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig


@dataclass(frozen=True)
class XQuantOptions(MethodOptions):
    """XQuant (Tomar et al., 2025, https://arxiv.org/abs/2508.10395).

    bits / group_size: affine codes of the cached X; window: recent tokens kept in
    full precision; latent: for GQA models cache X in the latent space of the SVD of
    the K/V projection weights (narrower than X).
    """

    bits: int = 4
    group_size: int = 64
    window: int = 0
    latent: bool = True

    def __post_init__(self) -> None:
        self.check_int("bits", q.AFFINE_BITS)
        self.check_int("group_size", q.AFFINE_GROUP_SIZES)
        self.check_int("window", minimum=0)
        self.check_bool("latent")


@dataclass(frozen=True)
class XQuantCLOptions(MethodOptions):
    """XQuant-CL (same paper): anchor X + quantized cross-layer deltas.

    bits / group_size: affine codes of the deltas; anchor_bits: codes of the anchor
    layer, which carries every later layer's reconstruction.
    """

    bits: int = 4
    group_size: int = 64
    anchor_bits: int = 8

    def __post_init__(self) -> None:
        self.check_int("bits", q.AFFINE_BITS)
        self.check_int("group_size", q.AFFINE_GROUP_SIZES)
        self.check_int("anchor_bits", q.AFFINE_BITS)


# Beyond this magnitude a group's minimum (its bias) is too close to float16's 65504.
F16_SAFE = 16384.0


@register
class XQuantCache(CompressedCache):
    """Quantized X (or its K/V latents) per token, plus an optional fp window."""

    method = "xquant"
    family = "quantization (rematerialize)"
    paper = "XQuant, Tomar et al., 2025 (arXiv 2508.10395)"
    stores = "quantized attention input X; K and V rematerialized"
    Options = XQuantOptions
    meta_fields = ("offset", "batch_size", "n_bits", "group_size", "window", "widths")
    meta_types = {"widths": lambda s: tuple(int(w) for w in s.split(",") if w)}
    hooks_module = True  # update_x, called by the X hook of the owning module
    # Scales and biases of the codes (``_quantize``); class defaults for instances that
    # mlx_lm's ``from_state`` builds without __init__.
    scale_dtype = mx.float16
    _range_checked = True

    @classmethod
    def stored_numerics(cls, config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
        """Dense: the codes are of the layer input X, K and V are rebuilt from them. The
        loss on the tiny llama is about 2 steps of the code (``2^-bits``): up to 0.13 at
        4 bits, 0.0075 at 8 (bound 4 steps; XQuant-CL: up to 0.062 and 0.0061, bound 3
        steps, its deltas correcting each layer's error)."""
        o = config.layer_options(layer.layer_idx)
        steps = 3.0 if cls.cross_layer else 4.0
        return dense_loss(steps * 2.0 ** -o.bits, lossless_until=getattr(o, "window", 0))

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.n_bits = self.opts.bits
        self.group_size = self.opts.group_size
        self.window = getattr(self.opts, "window", 0)
        self.widths: tuple[int, ...] = ()
        self.codes: list[q.Quantized] | None = None  # one per stored part
        self.win: list[mx.array] | None = None
        self.proj: Any = None  # the layer's XProjection (installed state on the model)
        self._range_checked = False

    @classmethod
    def latent(cls, config: KVCacheConfig) -> bool:
        return config.options.latent

    @classmethod
    def replicated_by_tensor_parallelism(cls, opts: Any, kv_width: int, hidden: int
                                         ) -> str | None:
        # The latent mode stores the rank's own K/V latents (sharded) when narrower than X.
        if opts.latent and kv_width < hidden:
            return None
        return f"the layer input X ({hidden} values per token and layer)"

    @classmethod
    def small_options(cls) -> dict[str, Any]:
        return dict(bits=4, group_size=32)

    @classmethod
    def lossless_options(cls) -> dict[str, Any]:
        return dict(bits=8, group_size=32)

    @classmethod
    def tune_grid(cls, context: int) -> list[dict[str, Any]]:
        # From 8 down to 2 bits per cached value (about 0.53 to 0.15 of fp16 with the
        # latent on GQA models); a window of 32 recent tokens costs little beyond 1k.
        grid = [dict(bits=b, group_size=g) for b, g in
                ((8, 64), (6, 64), (4, 64), (4, 32), (3, 64), (3, 32), (2, 32))]
        if context >= 1024:
            grid += [dict(bits=b, group_size=32, window=32) for b in (3, 2)]
        return grid

    @classmethod
    def after_build(cls, caches: list[CompressedCache], config: KVCacheConfig,
                    model: Any) -> None:
        if model is None or any(c.layer.attention is None for c in caches):
            raise ValueError(f"{cls.method} caches hook the model's attention: build them "
                             "with the model (load_prompt_cache(path, model))")
        was = x_hook_installed(model)
        projs = install_x_hook([c.layer for c in caches], latent=cls.latent(config),
                               model=model)
        try:
            for c in caches:
                c.bind(projs[c.layer.layer_idx])
        except Exception:
            if not was:
                uninstall_x_hook(model)
            raise

    @classmethod
    def detach(cls, model: Any) -> None:
        """Remove the X hook from ``model`` (its attention runs as before)."""
        uninstall_x_hook(model)

    def bind(self, proj: Any) -> None:
        """Check the stored widths against ``group_size`` (known once the hook is in)."""
        self.proj = proj
        self.widths = proj.widths
        for d in self.widths:
            if d % self.group_size:
                raise config_error(
                    "group_size", self.group_size,
                    f"a divisor of the cached width {d} of layer {self.layer.layer_idx} "
                    f"(one of {[g for g in q.AFFINE_GROUP_SIZES if d % g == 0]})",
                    self.method)

    # ---- the X protocol (called by the hook) ----
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        raise RuntimeError(
            f"{type(self).__name__} caches the layer input X, not K and V, but the model's "
            "attention called update_and_fetch: the X hook is not installed. Build caches "
            "with KVCacheBuilder.for_model")

    def _begin(self, x: mx.array) -> int:
        if x.ndim != 3:
            raise ValueError(f"{self.method}: X must be [B, L, hidden], got {tuple(x.shape)}")
        B, L, _ = x.shape
        if self.batch_size and B != self.batch_size:
            raise ValueError(f"{self.method}: batch size changed from {self.batch_size} to {B}")
        self.check_budget(L)
        self.batch_size = B
        start = self.offset
        self.offset += L
        return start

    def update_x(self, x: mx.array, residual: mx.array | None, proj: Any,
                 joined: bool = True) -> Any:
        """Store the chunk's X; return the transient stored form of the earlier tokens.

        That is ``proj.encode``'s form (X, or its two latents) in float32 for tokens
        ``[0, start)``, or ``None`` when the cache was empty. With ``joined=False``, a
        list of segments ``(first position, parts)`` instead (the coded tokens as their
        codes, the window), never joined into one full-size copy.
        """
        start = self._begin(x)
        segments = []
        if start and self.codes is not None:
            # Codes as they are (read where needed): only a joined form is decoded here.
            segments.append((0, list(self.codes) if not joined else
                             [fr.load_rows(c) for c in self.codes]))
        if start and self.win is not None:
            segments.append((start - self.n_window(), [w.astype(mx.float32) for w in self.win]))
        self._store(proj.encode(x))
        if not joined:
            return segments
        if not segments:
            return None
        per_part = zip(*(parts for _, parts in segments))  # each stored part's pieces
        return [p[0] if len(p) == 1 else mx.concatenate(p, axis=1) for p in per_part]

    def _store(self, new: list[mx.array]) -> None:
        """Append a chunk's stored form; what leaves the window is coded."""
        wdt = self.window_dtype(mx.float32)
        win = new if self.win is None else [
            mx.concatenate([w, n.astype(wdt)], axis=1) for w, n in zip(self.win, new)
        ]
        overflow = win[0].shape[1] - self.window
        if overflow > 0:
            qs = [self._quantize(w[:, :overflow].astype(mx.float32)) for w in win]
            self.codes = qs if self.codes is None else [
                q.concat([a, b], axis=1) for a, b in zip(self.codes, qs)
            ]
            win = [w[:, overflow:] for w in win]
        win = [w.astype(wdt) for w in win]
        if overflow > 1:
            # A kept slice pins its parent (window + chunk): copy it (a no-op after a
            # cast). A decode step pins one token more than the window, no copy.
            win = [owned(w) for w in win]
        self.win = win if win[0].shape[1] else None

    def _parts(self, dtype: mx.Dtype) -> list[mx.array]:
        """Transient dequantized parts of every held token (codes, then window)."""
        out = []
        for i in range(len(self.widths)):
            pieces = []
            if self.codes is not None:
                pieces.append(fr.load_rows(self.codes[i]).astype(dtype))
            if self.win is not None:
                pieces.append(self.win[i].astype(dtype))
            out.append(pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1))
        return out

    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """Transient K/V of every held token, rematerialized through the layer's own
        path (models whose other layers read this layer's keys and values)."""
        if self.proj is None or not self.offset:
            raise RuntimeError(f"{self.method}: no tokens held, or the X hook is not "
                               "installed")
        return self.proj.rematerialize(self._parts(mx.float32), dtype or mx.float32)

    def decode_flops(self) -> int:
        """One query's attention as the X hook runs it: keys rebuilt from the stored
        width ``w_k`` (``n w_k H D``), scores (``Hq n D``), values in the stored space
        then through their factor (``Hq (n w_v + w_v Dv)``); the codes' decoding,
        RoPE and (XQuant-CL) the deltas' sums are element-wise, not counted."""
        if not self.widths:
            return super().decode_flops()
        info, hq, n = self.layer, self.query_heads(), self.offset
        wk, wv = self.widths[0], self.widths[-1]
        total = (n * wk * info.n_kv_heads * info.head_dim + hq * n * info.head_dim
                 + hq * (n * wv + wv * info.v_head_dim))
        return 2 * max(self.batch_size, 1) * total

    # ---- storage ----
    def stored_arrays(self) -> list[mx.array]:
        """The per-token storage: codes, then the window."""
        out: list[mx.array] = []
        for part in self.codes or []:
            out.extend(part.arrays)
        out.extend(self.win or [])
        return out

    def installed_arrays(self) -> list[mx.array]:
        """What the X hook keeps on the model for this layer (projection factors)."""
        return [] if self.proj is None else self.proj.held_arrays()

    def held_arrays(self) -> list[mx.array]:
        return self.stored_arrays() + self.installed_arrays()

    def n_window(self) -> int:
        return 0 if self.win is None else self.win[0].shape[1]

    def accounted_bytes(self) -> int:
        B = max(self.batch_size, 1)
        n_win = self.n_window()
        n_q = self.offset - n_win
        per_q = sum(q.quantized_bytes(d, self.n_bits, self.group_size, self._scale_bytes())
                    for d in self.widths)
        itemsize = self.win[0].itemsize if self.win is not None else 2
        installed = sum(a.nbytes for a in self.installed_arrays())
        return B * (n_q * per_q + n_win * sum(self.widths) * itemsize) + installed

    def _quantize(self, x: mx.array) -> q.Quantized:
        """Codes of ``x`` with float16 scales and biases, or float32 ones for a layer
        whose values pass float16's range (Gemma 3's residual stream reaches 1e5: the
        group minima, stored as biases, would be inf). Decided once per cache, from the
        first values it codes (one small read back); saved caches keep their dtype."""
        if self.codes is None and not self._range_checked:
            self._range_checked = True
            if mx.abs(x).max().item() > F16_SAFE:
                self.scale_dtype = mx.float32
        return q.quantize(x, self.n_bits, self.group_size, self.scale_dtype)

    def _scale_bytes(self) -> int:
        if self.codes:
            return self.codes[0].scales.itemsize
        return self.scale_dtype.size

    # ---- save / restore / trim ----
    @property
    def state(self) -> list[mx.array]:
        return self.stored_arrays()

    @state.setter
    def state(self, v: list[mx.array]) -> None:
        # Codes come as (uint32 codes, scales, biases) triples, then the window parts.
        codes, i = [], 0
        while i < len(v) and v[i].dtype == mx.uint32:
            codes.append(q.Quantized(*v[i:i + 3], self.n_bits, self.group_size))
            i += 3
        self.codes = codes or None
        self.win = list(v[i:]) or None

    def check_state(self) -> None:
        """The restored codes and window against the stored widths (known once the hook
        bound this layer) and the offset (``cache.restore_check``: shapes only)."""
        B, n_parts = self.batch_size, len(self.widths)
        for name, parts in (("codes", self.codes), ("window", self.win)):
            if parts is not None and len(parts) != n_parts:
                raise ValueError(f"{len(parts)} stored {name} parts, expected {n_parts} "
                                 f"(widths {list(self.widths)})")
        n_codes = self.codes[0].scales.shape[1] if self.codes else 0
        for i, d in enumerate(self.widths):
            if self.codes:
                zeros = mx.zeros((B, n_codes, d), mx.float32)
                check_arrays(f"codes of part {i}", self.codes[i].arrays,
                             q.quantize(zeros, self.n_bits, self.group_size).arrays)
            if self.win is not None:
                check_arrays(f"window of part {i}", [self.win[i]],
                             [mx.zeros((B, self.n_window(), d), mx.float16)])
        if n_codes + self.n_window() != self.offset:
            raise ValueError(f"the saved arrays hold {n_codes + self.n_window()} tokens; "
                             f"the saved offset is {self.offset}")

    def is_trimmable(self) -> bool:
        return True

    def reusable_prefix(self, keep: int) -> int:
        """The longest prefix ``<= keep`` that, trimmed to, this cache holds as a fresh
        prefill of it would (server reuse, ``apps.prompt_reuse``): any, as each token's
        codes are its own, unless a window coded tokens a fresh prefill would hold."""
        if keep >= self.offset or self.window == 0 or self.offset <= self.window:
            return keep
        return 0

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (window first, then per-token codes)."""
        n = min(self.offset, n)
        keep = self.offset - n
        n_codes = self.offset - self.n_window()
        if self.win is not None:
            w_keep = max(keep - n_codes, 0)
            # Copies: a kept slice would pin the trimmed tail.
            self.win = [owned(w[:, :w_keep]) for w in self.win] if w_keep else None
        if self.codes is not None and keep < n_codes:
            self.codes = [_slice_tokens(c, keep) for c in self.codes] if keep else None
        self.offset = keep
        return n


def _slice_tokens(c: q.Quantized, n: int) -> q.Quantized:
    # Copies: slices would pin the trimmed codes.
    return q.Quantized(*(owned(a[:, :n]) for a in c.arrays), c.bits, c.group_size)


@register
class XQuantCLCache(XQuantCache):
    """XQuant-CL: anchor residual stream + quantized deltas to the previous layer."""

    method = "xquant_cl"
    family = "quantization (cross-layer)"
    paper = "XQuant-CL, Tomar et al., 2025 (arXiv 2508.10395)"
    stores = "anchor X + quantized cross-layer deltas of X"
    cross_layer = True
    Options = XQuantCLOptions

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.coordinator: XQuantCoordinator | None = self.layer.coordinator
        self.is_anchor = self.layer.member_idx == 0
        if self.is_anchor:
            self.n_bits = self.opts.anchor_bits

    @classmethod
    def latent(cls, config: KVCacheConfig) -> bool:
        return False  # the deltas live on the residual stream, not in a K/V latent

    @classmethod
    def replicated_by_tensor_parallelism(cls, opts: Any, kv_width: int, hidden: int
                                         ) -> str | None:
        return f"the layer input X ({hidden} values per token and layer)"

    @classmethod
    def tune_grid(cls, context: int) -> list[dict[str, Any]]:
        # Delta bits from 4 down to 2 (the residual stream is wider than K and V
        # together, so 4-bit deltas hold about 0.4 of fp16 and 2-bit about 0.23).
        return [dict(bits=b, group_size=g, anchor_bits=a) for b, g, a in
                ((4, 64, 8), (3, 64, 8), (3, 32, 8), (2, 64, 8), (2, 32, 8), (2, 32, 4))]

    @classmethod
    def assign_roles(cls, layers: list, config: KVCacheConfig, model: Any) -> None:
        coord = XQuantCoordinator()
        coord.set_anchor(layers[0].layer_idx)
        coord.last_layer = layers[-1].layer_idx
        for i, info in enumerate(layers):
            info.group_id, info.member_idx, info.group_size = 0, i, len(layers)
            info.coordinator = coord

    def bind(self, proj: Any) -> None:
        if proj.norm is None:
            raise ValueError(
                f"xquant_cl: layer {self.layer.layer_idx} has no input_layernorm to tap the "
                "residual stream"
            )
        super().bind(proj)

    # Cross-layer deltas: a layer's input exists only while the model runs through
    # every layer, so nothing else can read its keys (the base class refuses).
    dense_kv = CompressedCache.dense_kv

    def update_x(self, x: mx.array, residual: mx.array | None, proj: Any,
                 joined: bool = True) -> Any:
        if residual is None:
            raise RuntimeError(
                f"xquant_cl layer {self.layer.layer_idx}: the block input was not tapped "
                "(the X hook's norm tap is missing)"
            )
        if self.coordinator is None:
            raise RuntimeError("xquant_cl: no XQuantCoordinator (build with KVCacheBuilder)")
        start = self._begin(x)
        end = self.offset
        h = residual.astype(mx.float32)
        if self.is_anchor:
            self._append(h)
            acc = fr.load_rows(self.codes[0])
            self.coordinator.publish(self.layer.layer_idx, start, end, acc)
        else:
            prev = self.coordinator.read(self.layer.layer_idx, start, end)
            # Delta to the previous layer's reconstruction: its error is corrected here.
            self._append(h - prev[:, start:])
            acc = fr.load_rows(self.codes[0], plus=prev)
            self.coordinator.pass_on(self.layer.layer_idx, acc)
        if not start:
            return None if joined else []
        old = [proj.normalize(acc[:, :start])]
        return old if joined else [(0, old)]

    def _append(self, x: mx.array) -> None:
        new = self._quantize(x)
        self.codes = [new] if self.codes is None else [q.concat([self.codes[0], new], axis=1)]
