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

The attention itself runs in the X hook (``cache.xquant_hook``), which
``KVCacheBuilder.for_model`` installs through ``after_build`` (``install_x_hook``, here:
which class each layer's attention and input norm take). The storage is a
``cache.layer_inputs`` form: codes of the stored parts, a window, or (XQuant-CL) the
cross-layer deltas; bytes, ``state`` and ``trim`` come from it.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.cache.base import CompressedCache, LayerInfo, check_budget, window_dtype
from veloxquant_mlx.cache.layer_inputs import LayerInputCache, LayerInputForm, Normalized
from veloxquant_mlx.cache.module_call import hook_module, original_class, unhook_module
from veloxquant_mlx.cache.numerics import StoredNumerics, dense_loss
from veloxquant_mlx.cache.profile import Profile
from veloxquant_mlx.cache.step_cost import dense_flops, query_heads
from veloxquant_mlx.cache.xquant_coordinator import XQuantCoordinator
from veloxquant_mlx.cache.xquant_generic import X_HOOK, GenericXPath, x_generic_call
from veloxquant_mlx.cache.xquant_hook import XProjection, x_attention_call, x_norm_call
from veloxquant_mlx.errors import Refusal, UnsupportedModelError
from veloxquant_mlx.ops import quantize as q
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


def _numerics(steps: float) -> Any:
    """Dense: the codes are of the layer input X, K and V are rebuilt from them. The
    loss on the tiny llama is about 2 steps of the code (``2^-bits``): up to 0.13 at
    4 bits, 0.0075 at 8 (bound 4 steps; XQuant-CL: up to 0.062 and 0.0061, bound 3
    steps, its deltas correcting each layer's error)."""
    def numerics(config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
        o = config.layer_options(layer.layer_idx)
        return dense_loss(steps * 2.0 ** -o.bits, lossless_until=getattr(o, "window", 0))
    return numerics


def _replicated_by_tensor_parallelism(opts: Any, kv_width: int, hidden: int
                                     ) -> str | None:
    # The latent mode stores the rank's own K/V latents (sharded) when narrower than X.
    if opts.latent and kv_width < hidden:
        return None
    return f"the layer input X ({hidden} values per token and layer)"


def _tune_grid(context: int) -> list[dict[str, Any]]:
    # From 8 down to 2 bits per cached value (about 0.53 to 0.15 of fp16 with the
    # latent on GQA models); a window of 32 recent tokens costs little beyond 1k.
    grid = [dict(bits=b, group_size=g) for b, g in
            ((8, 64), (6, 64), (4, 64), (4, 32), (3, 64), (3, 32), (2, 32))]
    if context >= 1024:
        grid += [dict(bits=b, group_size=32, window=32) for b in (3, 2)]
    return grid


# ---- installing the X hook: the attention and input-norm classes swapped per layer
XQUANT_ATTENTION_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")
_NORM_NAMES = ("input_layernorm", "attention_norm", "ln_1", "norm1", "attn_norm",
               "pre_attention_layernorm", "input_norm", "ln_attn", "norm_1", "attn_ln")


def _input_norm(block: nn.Module | None, attn: nn.Module) -> nn.Module | None:
    """The block's norm in front of its attention (tapped for the residual stream)."""
    for name in _NORM_NAMES:
        mod = getattr(block, name, None) if block is not None else None
        if isinstance(mod, nn.Module) and mod is not attn:
            return mod
    return None


def _specialized(attn: nn.Module) -> bool:
    base = original_class(attn)
    return base.__module__ in XQUANT_ATTENTION_MODULES and all(
        hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "rope"))


def _unhook(attn: nn.Module, norm: nn.Module | None) -> None:
    """Put back classes an earlier install (of any hook) swapped on this layer."""
    for mod in (norm, attn):
        if mod is None:
            continue
        unhook_module(mod)
        for name in ("_xquant", "_xquant_target"):
            if name in mod.__dict__:
                delattr(mod, name)


def _hook_layer(info: LayerInfo, latent: bool) -> XProjection | GenericXPath:
    attn = info.attention
    norm = _input_norm(info.block, attn)
    _unhook(attn, norm)
    if _specialized(attn):
        proj: XProjection | GenericXPath = XProjection(attn, norm, latent)
        call = x_attention_call
    else:
        proj, call = GenericXPath(attn, norm, latent), x_generic_call
    attn._xquant = proj
    hook_module(attn, call, X_HOOK)
    if norm is not None:
        norm._xquant_target = proj
        hook_module(norm, x_norm_call, X_HOOK)
    return proj


_WARNED_LATENT: set[type] = set()


def _warn_latent(projs: dict[int, Any], latent: bool) -> None:
    """Say once per attention class that ``latent`` storage does not apply to it."""
    generic = {i: p for i, p in projs.items() if isinstance(p, GenericXPath)}
    classes = {original_class(p.attn) for p in generic.values()}
    new = classes - _WARNED_LATENT
    if latent and new:
        _WARNED_LATENT.update(new)
        names = ", ".join(sorted(f"{c.__module__}.{c.__name__}" for c in new))
        warnings.warn(f"xquant: layers {sorted(generic)} ({names}) store their input X "
                      "itself: the latent storage needs llama, mistral or qwen2 attention",
                      stacklevel=6)  # past the builder: the caller of for_model


def install_x_hook(layers: list[LayerInfo], latent: bool = True,
                   model: nn.Module | None = None) -> dict[int, XProjection | GenericXPath]:
    """Let each layer's attention hand its X-cache the layer input (reversible).

    ``layers`` carry the live attention module and block (``KVCacheBuilder.layer_infos``).
    Returns one projection per layer index: ``XProjection`` for llama-, mistral- and
    qwen2-style attention, ``GenericXPath`` for every other. ``model`` lets the generic
    path read its input widths off one uncached token (graph only). Idempotent.
    """
    out: dict[int, XProjection | GenericXPath] = {}
    for info in layers:
        if info.attention is None:
            raise UnsupportedModelError(
                f"XQuant cannot hook layer {info.layer_idx}: no attention module updates "
                "its cache", Refusal.UNUSED_SLOT)
        current = getattr(info.attention, "_xquant", None)
        if current is not None and current.latent_requested == latent:
            out[info.layer_idx] = current
            continue
        out[info.layer_idx] = _hook_layer(info, latent)
    if model is not None and any(isinstance(p, GenericXPath) and not p.in_dim
                                 for p in out.values()):
        model(mx.array([[0]]))  # lazy: the hooked modules see their input shapes
    _warn_latent(out, latent)
    bad = {i: p for i, p in out.items() if isinstance(p, GenericXPath) and p.extra}
    if bad:
        for info in layers:  # leave the model as it was
            _unhook(info.attention, _input_norm(info.block, info.attention))
        i, p = next(iter(bad.items()))
        base = original_class(p.attn)
        raise UnsupportedModelError(
            f"XQuant cannot rebuild the keys and values of layer(s) {sorted(bad)}: their "
            f"attention ({base.__module__}.{base.__name__}) takes {', '.join(p.extra)} "
            "besides its input, which the cached input cannot reproduce for earlier tokens",
            Refusal.EXTRA_ARGUMENTS)
    return out


def x_hook_installed(model: nn.Module) -> bool:
    """Whether ``install_x_hook`` is active on some layer of ``model``."""
    return any(hasattr(m, "_xquant") for m in model.modules())


def uninstall_x_hook(model: nn.Module) -> None:
    """Restore the original attention and norm classes of every hooked layer."""
    for mod in model.modules():
        if not unhook_module(mod, X_HOOK):
            continue
        for name in ("_xquant", "_xquant_target"):
            if name in mod.__dict__:
                delattr(mod, name)


def _hook(latent: Any, name: str) -> Any:
    """``after_build``: install the X hook (of the K/V latents when ``latent(config)``)."""
    def after_build(caches: list[CompressedCache], config: KVCacheConfig, model: Any) -> None:
        if model is None or any(c.layer.attention is None for c in caches):
            raise ValueError(f"{name} caches hook the model's attention: build them "
                             "with the model (load_prompt_cache(path, model))")
        was = x_hook_installed(model)
        projs = install_x_hook([c.layer for c in caches], latent=latent(config),
                               model=model)
        try:
            for c in caches:
                c.bind(projs[c.layer.layer_idx])
        except Exception:
            if not was:
                uninstall_x_hook(model)
            raise
    return after_build


def _form_field(name: str) -> property:
    """A field of the stored form, read and set through the cache."""
    return property(lambda self: getattr(self.stored, name),
                    lambda self, v: setattr(self.stored, name, v))


def _decode_flops(cache: Any) -> int:
    """One query's attention as the X hook runs it: keys rebuilt from the stored
    width ``w_k`` (``n w_k H D``), scores (``Hq n D``), values in the stored space
    then through their factor (``Hq (n w_v + w_v Dv)``); the codes' decoding,
    RoPE and (XQuant-CL) the deltas' sums are element-wise, not counted."""
    if not cache.widths:
        return dense_flops(cache)
    info, hq, n = cache.layer, query_heads(cache), cache.offset
    wk, wv = cache.widths[0], cache.widths[-1]
    total = (n * wk * info.n_kv_heads * info.head_dim + hq * n * info.head_dim
             + hq * (n * wv + wv * info.v_head_dim))
    return 2 * max(cache.batch_size, 1) * total


def _check_restored(cache: Any) -> None:
    """The restored codes and window against the stored widths (known once the hook
    bound this layer) and the offset (``cache.restore_check``: shapes only)."""
    cache.stored.check(cache.batch_size, cache.widths, cache.offset)


def _reusable_prefix(cache: Any, keep: int) -> int:
    """The longest prefix ``<= keep`` that, trimmed to, this cache holds as a fresh
    prefill of it would (server reuse, ``apps.prompt_reuse``): any, as each token's
    codes are its own, unless a window coded tokens a fresh prefill would hold."""
    if keep >= cache.offset or cache.window == 0 or cache.offset <= cache.window:
        return keep
    return 0


@register
class XQuantCache(LayerInputCache):
    """Quantized X (or its K/V latents) per token, plus an optional fp window."""

    method = "xquant"
    Options = XQuantOptions
    profile = Profile(
        reusable_prefix=_reusable_prefix,
        check_restored=_check_restored,
        decode_flops=_decode_flops,
        family="quantization (rematerialize)",
        paper="XQuant, Tomar et al., 2025 (arXiv 2508.10395)",
        stores="quantized attention input X; K and V rematerialized",
        hooks_module=True,  # update_x, called by the X hook of the owning module
        stored_numerics=_numerics(4.0),
        after_build=_hook(lambda config: config.options.latent, "xquant"),
        detach=uninstall_x_hook,
        replicated=_replicated_by_tensor_parallelism,
        small=dict(bits=4, group_size=32),
        lossless=dict(bits=8, group_size=32),
        tune_grid=_tune_grid,
    )
    meta_fields = {"offset": int, "batch_size": int, "n_bits": int, "group_size": int,
                   "window": int, "widths": lambda s: tuple(int(w) for w in s.split(",") if w)}

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.widths: tuple[int, ...] = ()
        self.proj: Any = None  # the layer's XProjection (installed state on the model)
        self.stored = self._new_form()

    def _new_form(self) -> LayerInputForm:
        """Codes of the stored parts, then a window of recent tokens."""
        o = self.opts
        return LayerInputForm(o.bits, o.group_size, getattr(o, "window", 0),
                              window_dtype(self.config, mx.float32))

    # What ``meta_state`` saves of the form (and sets, before ``state``, on a restore).
    n_bits = _form_field("bits")
    group_size = _form_field("group_size")
    window = _form_field("window")

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
        check_budget(self, L)
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
        earlier = self.stored.earlier(joined) if start else (None if joined else [])
        self.stored.append(proj.encode(x))
        return earlier

    def keys_and_values(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """Transient K/V of every held token, rematerialized through the layer's own
        path (models whose other layers read this layer's keys and values)."""
        if self.proj is None or not self.offset:
            raise RuntimeError(f"{self.method}: no tokens held, or the X hook is not "
                               "installed")
        return self.proj.rematerialize(self.stored.dense(mx.float32), dtype or mx.float32)

    # ---- storage ----
    def shared_arrays(self) -> list[mx.array]:
        """What the X hook keeps on the model for this layer (projection factors)."""
        return [] if self.proj is None else self.proj.kept_arrays()


def _cl_replicated(opts: Any, kv_width: int, hidden: int) -> str | None:
    return f"the layer input X ({hidden} values per token and layer)"


def _cl_tune_grid(context: int) -> list[dict[str, Any]]:
    # Delta bits from 4 down to 2 (the residual stream is wider than K and V
    # together, so 4-bit deltas hold about 0.4 of fp16 and 2-bit about 0.23).
    return [dict(bits=b, group_size=g, anchor_bits=a) for b, g, a in
            ((4, 64, 8), (3, 64, 8), (3, 32, 8), (2, 64, 8), (2, 32, 8), (2, 32, 4))]


def _cl_assign_roles(layers: list, config: KVCacheConfig, model: Any) -> None:
    coord = XQuantCoordinator()
    coord.set_anchor(layers[0].layer_idx)
    coord.last_layer = layers[-1].layer_idx
    for i, info in enumerate(layers):
        info.group_id, info.member_idx, info.group_size = 0, i, len(layers)
        info.coordinator = coord


@register
class XQuantCLCache(XQuantCache):
    """XQuant-CL: anchor residual stream + quantized deltas to the previous layer."""

    method = "xquant_cl"
    Options = XQuantCLOptions
    profile = dataclasses.replace(
        XQuantCache.profile,
        family="quantization (cross-layer)",
        paper="XQuant-CL, Tomar et al., 2025 (arXiv 2508.10395)",
        stores="anchor X + quantized cross-layer deltas of X",
        cross_layer=True, stored_numerics=_numerics(3.0), replicated=_cl_replicated,
        # The deltas live on the residual stream, not in a K/V latent.
        after_build=_hook(lambda config: False, "xquant_cl"), assign_roles=_cl_assign_roles,
        tune_grid=_cl_tune_grid)

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.coordinator: XQuantCoordinator | None = self.layer.coordinator
        self.is_anchor = self.layer.member_idx == 0

    def _new_form(self) -> LayerInputForm:
        """The anchor's residual stream in codes of ``anchor_bits``; every later layer's
        deltas to the reconstruction of the layer before it."""
        o = self.opts
        if self.layer.member_idx == 0:
            return LayerInputForm(o.anchor_bits, o.group_size)
        return LayerInputForm(o.bits, o.group_size, deltas=True)

    def bind(self, proj: Any) -> None:
        if proj.norm is None:
            raise ValueError(
                f"xquant_cl: layer {self.layer.layer_idx} has no input_layernorm to tap the "
                "residual stream"
            )
        super().bind(proj)

    # Cross-layer deltas: a layer's input exists only while the model runs through
    # every layer, so nothing else can read its keys (the base class refuses).
    keys_and_values = CompressedCache.keys_and_values

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
            self.stored.append([h])
            acc = self.stored.rows()
            self.coordinator.publish(self.layer.layer_idx, start, end, acc)
        else:
            prev = self.coordinator.read(self.layer.layer_idx, start, end)
            # Delta to the previous layer's reconstruction: its error is corrected here.
            self.stored.append([h - prev[:, start:]])
            acc = self.stored.rows(plus=prev)
            self.coordinator.pass_on(self.layer.layer_idx, acc)
        if not start:
            return None if joined else []
        if joined:
            return [proj.normalize(acc[:, :start])]
        # Normalized where read: a prompt chunk's blocked attention reads a block at a time.
        return [(0, [Normalized(acc, start, proj.normalize)])]
