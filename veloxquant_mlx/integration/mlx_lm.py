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
        if name.startswith("mlx_lm.models.") and mod is not None
        and getattr(mod, "scaled_dot_product_attention", None) is _ORIGINAL_SDPA
    ]


def install_attention_routing(model: nn.Module | None = None) -> list[str]:
    """Route attention through ``cache.attend`` in every loaded mlx_lm model module.

    Returns the names of the modules patched by this call. Idempotent. Caches without
    ``attend`` see no change at all.
    """
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
    for name, original in list(_PATCHED.items()):
        mod = sys.modules.get(name)
        if mod is not None:
            mod.scaled_dot_product_attention = original
        del _PATCHED[name]


def routing_installed(module_name: str | None = None) -> bool:
    """Whether routing is active (in ``module_name``, or anywhere)."""
    if module_name is None:
        return bool(_PATCHED)
    mod = sys.modules.get(module_name)
    return mod is not None and getattr(mod, "scaled_dot_product_attention", None) \
        is routed_scaled_dot_product_attention


@contextmanager
def attention_routing(model: nn.Module | None = None) -> Iterator[None]:
    """``with attention_routing(model): ...`` installs routing and removes it after."""
    was = dict(_PATCHED)
    install_attention_routing(model)
    try:
        yield
    finally:
        if not was:
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
    weight = linear.weight
    if hasattr(linear, "bits"):  # QuantizedLinear keeps packed columns; rows are outputs
        return weight.shape[0]
    return weight.shape[0]


def attention_layout(attn: nn.Module, args: Any = None) -> AttentionLayout:
    """Heads and head dims of ``attn`` from its attributes and projection shapes."""
    n_heads = getattr(attn, "n_heads", None) or getattr(attn, "num_heads", None) or \
        getattr(args, "num_attention_heads", None)
    n_kv_heads = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None) \
        or getattr(args, "num_key_value_heads", None) or n_heads
    k_out = _out_features(attn.k_proj)
    v_out = _out_features(attn.v_proj) if hasattr(attn, "v_proj") else k_out
    head_dim = getattr(attn, "head_dim", None) or k_out // n_kv_heads
    if n_kv_heads * head_dim != k_out:
        head_dim = k_out // n_kv_heads
    return AttentionLayout(int(n_heads), int(n_kv_heads), int(head_dim),
                           int(v_out // n_kv_heads), getattr(attn, "rope", None))


def rope_params(rope: Any) -> dict[str, Any]:
    """dims/base/traditional/scale of an ``nn.RoPE`` (empty for other rope kinds)."""
    if isinstance(rope, nn.RoPE):
        return {"rope_dims": rope.dims, "rope_base": float(rope.base),
                "rope_traditional": bool(rope.traditional), "rope_scale": float(rope.scale)}
    return {}
