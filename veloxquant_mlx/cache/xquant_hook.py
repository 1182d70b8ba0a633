"""The X hook: XQuant's way into mlx_lm attention layers.

XQuant caches a layer's attention input X instead of K and V, but mlx_lm's cache
interface only ever sees K and V. The hook swaps the class of each attention
instance (and of its block's input norm) for a subclass for as long as it is
installed: when the layer's cache has ``update_x`` the attention hands it X and
attends over the K and V rematerialized from it; any other cache falls through to
the original ``__call__``. ``uninstall_x_hook`` restores the original classes. The
parameter tree and weights are untouched, and the hook holds no copy of a weight
where the model's own (float) weight can be read in place.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..ops.attention import masked_softmax, sdpa
from .base import LayerInfo

XQUANT_ATTENTION_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")
_X_SUBCLASSES: dict[type, type] = {}


def weight_in_out(linear: nn.Module) -> mx.array:
    """``[in, out]`` float32 weight of a linear layer.

    A float32 ``nn.Linear`` gives a transposed view of its own weight (no new memory);
    a quantized or half-precision one gives a dequantized float32 copy.
    """
    if isinstance(linear, nn.QuantizedLinear):
        w = mx.dequantize(linear.weight, linear.scales, linear.get("biases"),
                          group_size=linear.group_size, bits=linear.bits,
                          mode=getattr(linear, "mode", "affine"))
    else:
        w = linear.weight
    return w.astype(mx.float32).T


def _bias(linear: nn.Module) -> mx.array | None:
    return linear.get("bias") if "bias" in linear else None


def _principal(w: mx.array) -> tuple[mx.array, mx.array]:
    """``V [out, out]`` and ``S [out]`` of the thin SVD ``w [in, out] = U S V^T``."""
    # The SVD of w^T [out, in] gives V as its (small) left factor; its large right
    # factor is dropped whole, so nothing keeps that buffer alive.
    v, s, _ = mx.linalg.svd(w.T, stream=mx.cpu)
    return v, s


class XProjection:
    """One layer's K/V path as XQuant rematerializes it.

    Without ``latent`` the cache holds X; keys are the model's own ``k_proj(X)``.
    With ``latent`` (GQA models, where X is wider than K and V together) it holds
    ``Z_k = X U_k`` and ``Z_v = X U_v`` of the SVDs ``W = U S V^T``, computed from the
    projections as ``(X W) V / S``; keys are rebuilt as ``(Z_k S) V_k^T + b_k``. Only
    ``V`` [out, out] and ``S`` per stream are held (exact: full rank of ``W``).
    """

    def __init__(self, attn: nn.Module, norm: nn.Module | None, latent: bool) -> None:
        self.attn = attn
        self.norm = norm
        self.n_kv_heads = attn.n_kv_heads
        self.bk, self.bv = _bias(attn.k_proj), _bias(attn.v_proj)
        wk, wv = weight_in_out(attn.k_proj), weight_in_out(attn.v_proj)
        self.in_dim, k_out = wk.shape
        v_out = wv.shape[1]
        self.v_dim = v_out // self.n_kv_heads
        self.residual: mx.array | None = None  # the block input, set by the norm tap
        self.latent_requested = latent
        self.latent = latent and k_out + v_out < self.in_dim
        if self.latent:
            self.vk, self.sk = _principal(wk)
            self.vv, self.sv = _principal(wv)
            self.wv = None
            held = [self.vk, self.sk, self.vv, self.sv]
        else:
            self.wv = wv  # factor-space values need W_v per KV head
            # A view of the model's own float32 weight costs nothing extra.
            held = [] if _is_view(attn.v_proj) else [wv]
            mx.eval(wv)
        # Computed once here: left lazy, the SVD would run inside the first forward pass.
        mx.eval(*held)
        self._held = held

    def held_arrays(self) -> list[mx.array]:
        """Arrays this projection keeps alive beyond the model's own weights."""
        return list(self._held)

    @property
    def widths(self) -> tuple[int, ...]:
        """Widths of the arrays the cache holds per token."""
        if self.latent:
            return (self.vk.shape[0], self.vv.shape[0])
        return (self.in_dim,)

    def encode(self, x: mx.array) -> list[mx.array]:
        """What the cache stores of ``x`` (X itself, or its two latents), float32."""
        x = x.astype(mx.float32)
        if not self.latent:
            return [x]
        k, v = self.attn.k_proj(x).astype(mx.float32), self.attn.v_proj(x).astype(mx.float32)
        if self.bk is not None:
            k = k - self.bk
        if self.bv is not None:
            v = v - self.bv
        return [(k @ self.vk) / self.sk, (v @ self.vv) / self.sv]

    def normalize(self, h: mx.array) -> mx.array:
        """The block's input norm of ``h``, without the residual tap."""
        return getattr(type(self.norm), "_xquant_base", type(self.norm)).__call__(self.norm, h)

    def _heads(self, y: mx.array) -> mx.array:
        B, L, _ = y.shape
        return y.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)

    def _value_factor(self) -> mx.array:
        """``[w, out]`` factor with ``V = Z R_v + b_v``."""
        if not self.latent:
            return self.wv
        return self.sv[:, None] * self.vv.T

    def keys(self, parts: list[mx.array]) -> mx.array:
        """Pre-RoPE ``[B, n_kv_heads, S, head_dim]`` keys from ``encode``'s form."""
        if self.latent:
            k = (parts[0] * self.sk) @ self.vk.T
            k = k if self.bk is None else k + self.bk
        else:
            k = self.attn.k_proj(parts[0].astype(mx.float32)).astype(mx.float32)
        return self._heads(k)

    def values(self, parts: list[mx.array]) -> mx.array:
        """``[B, n_kv_heads, S, v_head_dim]`` values from ``encode``'s form."""
        v = parts[-1] @ self._value_factor()
        return self._heads(v if self.bv is None else v + self.bv)

    def factored_pays(self, n_queries: int) -> bool:
        """Whether ``(P Z) R_v`` costs fewer flops than ``P (Z R_v)`` for ``Z [S, w]``.

        Per held token: ``n_queries * w`` against ``w * H * Dv + n_queries * Dv``.
        True for decode steps, false for long prefill chunks.
        """
        w = self.widths[-1]
        return n_queries * w < w * self.n_kv_heads * self.v_dim + n_queries * self.v_dim

    def attend(self, queries: mx.array, keys: mx.array, parts: list[mx.array],
               scale: float, mask: Any) -> mx.array:
        """Attention of RoPE'd ``queries`` over ``keys`` and the values held in ``parts``.

        Where it pays, the values are never rematerialized: the probabilities multiply
        the stored form ``Z`` first and the small factor ``R_v`` after, and the bias
        passes through unchanged because each row of probabilities sums to one.
        """
        B, Hq, L, D = queries.shape
        if not self.factored_pays(Hq * L):
            return sdpa(queries, keys, self.values(parts), scale, mask)
        H, S = keys.shape[1], keys.shape[2]
        rep = Hq // H
        q = (queries.astype(mx.float32) * scale).reshape(B, H, rep * L, D)
        scores = (q @ keys.astype(mx.float32).swapaxes(-1, -2)).reshape(B, H, rep, L, S)
        probs = masked_softmax(scores, mask)
        mixed = probs.reshape(B, H * rep * L, S) @ parts[-1]
        rv = self._value_factor()
        rv_heads = rv.reshape(rv.shape[0], H, self.v_dim).transpose(1, 0, 2)
        out = mixed.reshape(B, H, rep * L, -1) @ rv_heads
        if self.bv is not None:
            out = out + self.bv.reshape(H, 1, -1)
        return out.reshape(B, Hq, L, -1).astype(queries.dtype)


def _is_view(linear: nn.Module) -> bool:
    """Whether ``weight_in_out(linear)`` is a view of the layer's own weight."""
    return not isinstance(linear, nn.QuantizedLinear) and linear.weight.dtype == mx.float32


def _x_attention(attn: nn.Module, x: mx.array, residual: mx.array | None, cache: Any,
                 mask: Any) -> mx.array:
    """One sequence batch through an X-cache: ``[B, L, n_heads * v_head_dim]``."""
    proj: XProjection = attn._xquant
    B, L, _ = x.shape
    queries = attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    queries = attn.rope(queries, offset=cache.offset)
    old = cache.update_x(x, residual, proj)  # the stored form of the earlier tokens
    parts = proj.encode(x)  # the chunk itself attends with its exact X
    if old is not None:
        parts = [mx.concatenate([o, p], axis=1) for o, p in zip(old, parts)]
    keys = attn.rope(proj.keys(parts))
    out = proj.attend(queries, keys, parts, attn.scale, mask)
    return out.transpose(0, 2, 1, 3).reshape(B, L, -1)


def _x_attention_batched(attn: nn.Module, x: mx.array, residual: mx.array | None,
                         batch: Any) -> mx.array:
    """A ``BatchedCache`` of X-caches: each row attends over its own cache.

    Rows are right-padded; each gets only its real tokens (the batch cache's count)
    and zeros at padded positions, whose outputs are never used.
    """
    B, L, _ = x.shape
    outs = []
    for i, (c, r) in enumerate(zip(batch.caches, batch.take_rows(L))):
        out = None
        if r:
            res = None if residual is None else residual[i:i + 1, :r]
            out = _x_attention(attn, x[i:i + 1, :r], res, c, "causal" if r > 1 else None)
        if r < L:
            width = attn.n_heads * attn._xquant.v_dim
            pad = mx.zeros((1, L - r, width), x.dtype)
            out = pad if out is None else mx.concatenate([out.astype(x.dtype), pad], axis=1)
        outs.append(out)
    return mx.concatenate(outs, axis=0)


def _x_attention_call(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    rows = getattr(cache, "caches", None)  # a BatchedCache of per-sequence caches
    batched = bool(rows) and hasattr(rows[0], "update_x")
    if not batched and getattr(cache, "update_x", None) is None:
        return self._xquant_base.__call__(self, x, mask, cache)
    proj: XProjection = self._xquant
    residual, proj.residual = proj.residual, None
    if batched:
        out = _x_attention_batched(self, x, residual, cache)
    else:
        out = _x_attention(self, x, residual, cache, mask)
    return self.o_proj(out.astype(x.dtype))


def _x_norm_call(self, x: mx.array) -> mx.array:
    self._xquant_target.residual = x  # XQuant-CL caches the block input (residual stream)
    return self._xquant_base.__call__(self, x)


def _x_subclass(cls: type, call: Any) -> type:
    if cls not in _X_SUBCLASSES:
        _X_SUBCLASSES[cls] = type(f"XQuant{cls.__name__}", (cls,),
                                  {"__call__": call, "_xquant_base": cls})
    return _X_SUBCLASSES[cls]


def _check_supported(layers: list[LayerInfo]) -> None:
    for info in layers:
        attn = info.attention
        base = getattr(attn, "_xquant_base", type(attn))
        if base.__module__ not in XQUANT_ATTENTION_MODULES or not all(
            hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "rope")
        ):
            raise ValueError(
                f"XQuant cannot hook layer {info.layer_idx}: attention "
                f"{base.__module__}.{base.__name__} is not supported; supported are llama, "
                f"mistral and qwen2 attention ({', '.join(XQUANT_ATTENTION_MODULES)}) "
                "with q/k/v/o projections")


def install_x_hook(layers: list[LayerInfo], latent: bool = True) -> dict[int, XProjection]:
    """Let each layer's attention hand its X-cache the layer input (reversible).

    ``layers`` carry the live attention module and block (``KVCacheBuilder.layer_infos``).
    Returns one ``XProjection`` per layer index. Supported: llama-, mistral- (mlx_lm
    runs them as llama) and qwen2-style attention; anything else raises ``ValueError``
    naming what is supported. Idempotent.
    """
    _check_supported(layers)
    out: dict[int, XProjection] = {}
    for info in layers:
        attn, block = info.attention, info.block
        if hasattr(attn, "_xquant") and attn._xquant.latent_requested == latent:
            out[info.layer_idx] = attn._xquant
            continue
        norm = getattr(block, "input_layernorm", None)
        if norm is not None and "_xquant_base" in type(norm).__dict__:
            norm.__class__ = type(norm)._xquant_base  # re-hooked with other options
        if "_xquant_base" in type(attn).__dict__:
            attn.__class__ = type(attn)._xquant_base
        proj = XProjection(attn, norm, latent)
        attn._xquant = proj
        attn.__class__ = _x_subclass(type(attn), _x_attention_call)
        if norm is not None:
            norm._xquant_target = proj
            norm.__class__ = _x_subclass(type(norm), _x_norm_call)
        out[info.layer_idx] = proj
    return out


def x_hook_installed(model: nn.Module) -> bool:
    """Whether ``install_x_hook`` is active on some layer of ``model``."""
    return any(hasattr(m, "_xquant") for m in model.modules())


def uninstall_x_hook(model: nn.Module) -> None:
    """Restore the original attention and norm classes of every hooked layer."""
    for mod in model.modules():
        if "_xquant_base" not in type(mod).__dict__:
            continue
        mod.__class__ = type(mod)._xquant_base
        for name in ("_xquant", "_xquant_target"):
            if name in mod.__dict__:
                delattr(mod, name)
