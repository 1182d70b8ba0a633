"""The glue to mlx_lm: attention routing and model introspection.

mlx_lm's attention layers call a module-level ``scaled_dot_product_attention``
imported by name from ``mlx_lm.models.base`` into each model module. Routing
replaces that name in the loaded model modules with a wrapper that hands the
call to ``cache.attend(queries, scale, mask)`` when the cache has one, and to the
original function otherwise, so models, ``generate``, ``stream_generate`` and
``batch_generate`` run unmodified. ``uninstall_attention_routing`` puts the
original back.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_base

_ORIGINAL_SDPA = mlx_base.scaled_dot_product_attention
_PATCHED: dict[str, Any] = {}
_ACTIVE = False


def routed_scaled_dot_product_attention(
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """Drop-in for mlx_lm's ``scaled_dot_product_attention`` that honours ``attend``."""
    attend = getattr(cache, "attend", None)
    if attend is not None:
        if sinks is not None:
            raise NotImplementedError(
                f"{type(cache).__name__} does not support attention sinks (gpt-oss style)"
            )
        return attend(queries, scale=scale, mask=mask)
    return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask,
                          sinks=sinks)


def _model_modules() -> list[str]:
    return [
        name for name, mod in list(sys.modules.items())
        # Not base itself: modules imported later would copy the wrapper from it, and
        # uninstalling could not find them.
        if name.startswith("mlx_lm.models.") and name != "mlx_lm.models.base"
        and mod is not None
        and getattr(mod, "scaled_dot_product_attention", None) is _ORIGINAL_SDPA
    ]


def install_attention_routing(model: nn.Module | None = None) -> list[str]:
    """Route attention through ``cache.attend`` in every loaded mlx_lm model module.

    Returns the names of the modules patched by this call. Idempotent. Caches without
    ``attend`` see no change at all.
    """
    global _ACTIVE
    _ACTIVE = True
    names = _model_modules()
    if model is not None:
        for m in (type(model), *(type(x) for _, x in model.named_modules())):
            mod_name = m.__module__
            mod = sys.modules.get(mod_name)
            if mod is not None and getattr(mod, "scaled_dot_product_attention", None) \
                    is _ORIGINAL_SDPA and mod_name not in names:
                names.append(mod_name)
    for name in names:
        mod = sys.modules[name]
        _PATCHED[name] = mod.scaled_dot_product_attention
        mod.scaled_dot_product_attention = routed_scaled_dot_product_attention
    return names


def uninstall_attention_routing() -> None:
    """Put mlx_lm's original attention function back everywhere it was replaced."""
    global _ACTIVE
    _ACTIVE = False
    for name, original in list(_PATCHED.items()):
        mod = sys.modules.get(name)
        if mod is not None:
            mod.scaled_dot_product_attention = original
        del _PATCHED[name]


def routing_installed(module_name: str | None = None) -> bool:
    """Whether routing is active (in ``module_name``, or anywhere)."""
    if module_name is None:
        return _ACTIVE
    mod = sys.modules.get(module_name)
    return mod is not None and getattr(mod, "scaled_dot_product_attention", None) \
        is routed_scaled_dot_product_attention


@contextmanager
def attention_routing(model: nn.Module | None = None) -> Iterator[None]:
    """``with attention_routing(model): ...`` installs routing and removes it after."""
    was_active = _ACTIVE
    install_attention_routing(model)
    try:
        yield
    finally:
        if not was_active:
            uninstall_attention_routing()


# ---------------------------------------------------------------- introspection
@dataclass
class AttentionLayout:
    """Shape facts of one attention layer, read from the model itself."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    rope: Any  # the layer's RoPE module (or None)


def model_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an mlx_lm model."""
    layers = getattr(model, "layers", None)
    if layers is None and hasattr(model, "model"):
        layers = getattr(model.model, "layers", None)
    if layers is None:
        raise ValueError(
            f"model {type(model).__module__}.{type(model).__name__} has no 'layers': "
            "KVCacheBuilder needs an mlx_lm model with transformer blocks"
        )
    return list(layers)


def attention_module(block: nn.Module) -> nn.Module | None:
    """The self-attention module of a block, or None (recurrent / MLP-only blocks)."""
    for name in ("self_attn", "attention", "attn", "mixer"):
        mod = getattr(block, name, None)
        if isinstance(mod, nn.Module) and hasattr(mod, "k_proj"):
            return mod
    return None


def _out_features(linear: nn.Module) -> int:
    # Rows are the outputs for Linear and QuantizedLinear alike (only columns are packed).
    return linear.weight.shape[0]


def attention_layout(attn: nn.Module, args: Any = None) -> AttentionLayout:
    """Heads and head dims of ``attn`` from its attributes and projection shapes."""
    n_heads = getattr(attn, "n_heads", None) or getattr(attn, "num_heads", None) or \
        getattr(args, "num_attention_heads", None)
    n_kv_heads = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None) \
        or getattr(args, "num_key_value_heads", None) or n_heads
    k_out = _out_features(attn.k_proj)
    v_out = _out_features(attn.v_proj) if hasattr(attn, "v_proj") else k_out
    # The projection's width is the ground truth (some models keep an unrelated head_dim).
    head_dim = k_out // n_kv_heads
    return AttentionLayout(int(n_heads), int(n_kv_heads), int(head_dim),
                           int(v_out // n_kv_heads), getattr(attn, "rope", None))


def rope_params(rope: Any) -> dict[str, Any]:
    """dims/base/traditional/scale of an ``nn.RoPE`` (empty for other rope kinds)."""
    if isinstance(rope, nn.RoPE):
        return {"rope_dims": rope.dims, "rope_base": float(rope.base),
                "rope_traditional": bool(rope.traditional), "rope_scale": float(rope.scale)}
    return {}


# ================================================================ XQuant X hook
# XQuant caches a layer's attention input X instead of K and V, but mlx_lm's cache
# interface only ever sees K and V. The hook patches the class of each attention
# instance (and of its block's input norm) to a subclass for as long as it is
# installed: when the layer's cache has ``update_x`` the attention hands it X and
# attends over the K and V rematerialized from it; any other cache falls through to
# the original ``__call__``. ``uninstall_x_hook`` restores the original classes. The
# parameter tree and weights are untouched.

XQUANT_ATTENTION_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")
_X_SUBCLASSES: dict[type, type] = {}


def linear_weight(linear: nn.Module) -> tuple[mx.array, mx.array | None]:
    """Float32 ``[in, out]`` weight and bias of a (possibly quantized) linear layer."""
    if isinstance(linear, nn.QuantizedLinear):
        w = mx.dequantize(linear.weight, linear.scales, linear.get("biases"),
                          group_size=linear.group_size, bits=linear.bits,
                          mode=getattr(linear, "mode", "affine"))
    else:
        w = linear.weight
    bias = linear.get("bias") if "bias" in linear else None
    return w.astype(mx.float32).T, None if bias is None else bias.astype(mx.float32)


class XProjection:
    """One layer's K/V projections in float32, as XQuant rematerializes them.

    With ``latent`` (GQA models where X is wider than K and V together) the cache
    holds ``X U_k`` and ``X U_v`` from the SVD ``W_k = U_k S_k V_k^T``; K is rebuilt
    as ``(X U_k)(S_k V_k^T) + b_k``. The SVD is exact (full rank of ``W_k``).
    """

    def __init__(self, attn: nn.Module, norm: nn.Module | None, latent: bool) -> None:
        self.wk, self.bk = linear_weight(attn.k_proj)
        self.wv, self.bv = linear_weight(attn.v_proj)
        self.n_kv_heads = attn.n_kv_heads
        self.in_dim = self.wk.shape[0]
        self.norm = norm
        self.residual: mx.array | None = None  # the block input, set by the norm tap
        self.latent_requested = latent
        self.latent = latent and self.wk.shape[1] + self.wv.shape[1] < self.in_dim
        if self.latent:
            self.uk, self.rk = _svd_factors(self.wk)
            self.uv, self.rv = _svd_factors(self.wv)
        else:
            self.rk, self.rv = self.wk, self.wv
        # The value factor per KV head, [H, w, Dv], for attention that applies it after
        # the probabilities.
        w, out = self.rv.shape
        self.v_dim = out // self.n_kv_heads
        self.rv_heads = self.rv.reshape(w, self.n_kv_heads, self.v_dim).transpose(1, 0, 2)
        self.bv_heads = None if self.bv is None else self.bv.reshape(self.n_kv_heads, 1, -1)
        # Computed once here: left lazy, the SVD would run inside the first forward pass.
        mx.eval(self.wk, self.wv, self.rk, self.rv, self.rv_heads,
                *(a for a in (self.bk, self.bv) if a is not None),
                *((self.uk, self.uv) if self.latent else ()))

    @property
    def widths(self) -> tuple[int, ...]:
        """Widths of the arrays the cache holds per token."""
        if self.latent:
            return (self.uk.shape[1], self.uv.shape[1])
        return (self.in_dim,)

    def encode(self, x: mx.array) -> list[mx.array]:
        """What the cache stores of ``x`` (X itself, or its two latents)."""
        x = x.astype(mx.float32)
        return [x @ self.uk, x @ self.uv] if self.latent else [x]

    def normalize(self, h: mx.array) -> mx.array:
        """The block's input norm of ``h``, without the residual tap."""
        return getattr(type(self.norm), "_xquant_base", type(self.norm)).__call__(self.norm, h)

    def _heads(self, y: mx.array) -> mx.array:
        B, L, _ = y.shape
        return y.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)

    def keys(self, parts: list[mx.array]) -> mx.array:
        """Pre-RoPE ``[B, n_kv_heads, S, head_dim]`` keys from ``encode``'s form."""
        k = parts[0] @ self.rk
        return self._heads(k if self.bk is None else k + self.bk)

    def values(self, parts: list[mx.array]) -> mx.array:
        """``[B, n_kv_heads, S, v_head_dim]`` values from ``encode``'s form."""
        v = parts[-1] @ self.rv
        return self._heads(v if self.bv is None else v + self.bv)

    def kv(self, parts: list[mx.array]) -> tuple[mx.array, mx.array]:
        """Pre-RoPE keys and values from ``encode``'s form."""
        return self.keys(parts), self.values(parts)

    def factored_pays(self, n_queries: int) -> bool:
        """Whether ``(P Z) R_v`` costs fewer flops than ``P (Z R_v)`` for ``Z [S, w]``.

        Per held token: ``n_queries * w`` against ``w * H * Dv + n_queries * Dv``.
        True for decode steps, false for long prefill chunks.
        """
        w = self.rv.shape[0]
        return n_queries * w < w * self.rv.shape[1] + n_queries * self.v_dim

    def attend(self, queries: mx.array, keys: mx.array, parts: list[mx.array],
               scale: float, mask: Any) -> mx.array:
        """Attention of RoPE'd ``queries`` over ``keys`` and the values held in ``parts``.

        Where it pays, the values are never rematerialized: the probabilities multiply
        the stored form ``Z`` first and the small factor ``R_v`` after, and the bias
        passes through unchanged because each row of probabilities sums to one.
        """
        from ..ops.attention import masked_softmax, sdpa

        B, Hq, L, D = queries.shape
        if not self.factored_pays(Hq * L):
            return sdpa(queries, keys, self.values(parts), scale, mask)
        H, S = keys.shape[1], keys.shape[2]
        rep = Hq // H
        q = (queries.astype(mx.float32) * scale).reshape(B, H, rep * L, D)
        scores = (q @ keys.astype(mx.float32).swapaxes(-1, -2)).reshape(B, H, rep, L, S)
        probs = masked_softmax(scores, mask)
        mixed = probs.reshape(B, H * rep * L, S) @ parts[-1]
        out = mixed.reshape(B, H, rep * L, -1) @ self.rv_heads
        if self.bv_heads is not None:
            out = out + self.bv_heads
        return out.reshape(B, Hq, L, -1).astype(queries.dtype)


def _svd_factors(w: mx.array) -> tuple[mx.array, mx.array]:
    """``w [in, out] = U @ R`` with orthonormal ``U [in, r]`` (r = out)."""
    u, s, vt = mx.linalg.svd(w, stream=mx.cpu)
    r = w.shape[1]
    return u[:, :r], s[:r, None] * vt[:r]


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
    real = batch._take(L)
    outs = []
    for i, (c, r) in enumerate(zip(batch.caches, real)):
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


def x_hook_installed(model: nn.Module) -> bool:
    """Whether ``install_x_hook`` is active on ``model``."""
    return any(hasattr(attention_module(b), "_xquant") for b in model_layers(model)
               if attention_module(b) is not None)


def install_x_hook(model: nn.Module, latent: bool = True) -> list[XProjection | None]:
    """Let each attention layer hand its X-cache the layer input (reversible).

    Returns one ``XProjection`` per block (``None`` for blocks without attention).
    Supported: llama-, mistral- (mlx_lm runs them as llama) and qwen2-style attention;
    anything else raises ``ValueError`` naming what is supported. Idempotent.
    """
    blocks = model_layers(model)
    attns = [attention_module(b) for b in blocks]
    for i, attn in enumerate(attns):
        if attn is None:
            continue
        base = getattr(attn, "_xquant_base", type(attn))
        if base.__module__ not in XQUANT_ATTENTION_MODULES or not all(
            hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "rope")
        ):
            raise ValueError(
                f"XQuant cannot hook layer {i}: attention {base.__module__}.{base.__name__} "
                f"is not supported; supported are llama, mistral and qwen2 attention "
                f"({', '.join(XQUANT_ATTENTION_MODULES)}) with q/k/v/o projections"
            )
    out: list[XProjection | None] = []
    for block, attn in zip(blocks, attns):
        if attn is None:
            out.append(None)
            continue
        if hasattr(attn, "_xquant") and attn._xquant.latent_requested == latent:
            out.append(attn._xquant)
            continue
        norm = getattr(block, "input_layernorm", None)
        if norm is not None and "_xquant_base" in type(norm).__dict__:
            norm.__class__ = type(norm)._xquant_base  # re-hooked with other options
        proj = XProjection(attn, norm, latent)
        if hasattr(attn, "_xquant"):
            attn._xquant = proj
            attn.__class__ = type(attn)._xquant_base
        attn._xquant = proj
        attn.__class__ = _x_subclass(type(attn), _x_attention_call)
        if norm is not None:
            norm._xquant_target = proj
            norm.__class__ = _x_subclass(type(norm), _x_norm_call)
        out.append(proj)
    return out


def uninstall_x_hook(model: nn.Module) -> None:
    """Restore the original attention and norm classes of every hooked layer."""
    for block in model_layers(model):
        for mod in (attention_module(block), getattr(block, "input_layernorm", None)):
            if mod is None or "_xquant_base" not in type(mod).__dict__:
                continue
            mod.__class__ = type(mod)._xquant_base
            for name in ("_xquant", "_xquant_target"):
                if name in mod.__dict__:
                    delattr(mod, name)
