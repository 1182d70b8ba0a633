"""``KVCacheBuilder.for_model``: one cache per layer for any mlx_lm model."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .cache.base import CompressedCache, LayerInfo
from .config import KVCacheConfig
from .integration.mlx_lm import (
    attention_layout,
    attention_module,
    check_attention_routing,
    install_attention_routing,
    model_layers,
    probe_layers,
    rope_params,
    uninstall_attention_routing,
)
from .registry import get_method, methods


class KVCacheBuilder:
    """Builds the per-layer caches of a model for a ``KVCacheConfig``."""

    @staticmethod
    def layer_infos(model: nn.Module) -> list[LayerInfo | None]:
        """Per-layer shape facts; ``None`` for blocks without self-attention."""
        args = getattr(model, "args", None)
        infos: list[LayerInfo | None] = []
        blocks = model_layers(model)
        for idx, block in enumerate(blocks):
            attn = attention_module(block)
            if attn is None:
                infos.append(None)
                continue
            lay = attention_layout(attn, args)
            infos.append(LayerInfo(
                layer_idx=idx, n_layers=len(blocks), n_kv_heads=lay.n_kv_heads,
                head_dim=lay.head_dim, v_head_dim=lay.v_head_dim, attention=attn, block=block,
                model_type=str(getattr(args, "model_type", "")), **rope_params(lay.rope),
            ))
        return infos

    @classmethod
    def eligible_layers(cls, model: nn.Module, method_cls: type) -> tuple[list[Any], list[int],
                                                                          list[LayerInfo]]:
        """The model's own caches, and the indices / infos of the layers to compress."""
        infos = cls.layer_infos(model)
        default_caches = make_prompt_cache(model)
        if len(default_caches) != len(infos):
            raise ValueError(
                f"model.make_cache() gave {len(default_caches)} caches for {len(infos)} layers")
        eligible = [i for i, (info, c) in enumerate(zip(infos, default_caches))
                    if info is not None and method_cls.supports_layer(c)]
        if not eligible:
            raise ValueError(
                f"model {type(model).__module__}.{type(model).__name__} has no plain "
                f"full-attention layers that method {method_cls.method!r} can compress")
        return default_caches, eligible, [infos[i] for i in eligible]

    @classmethod
    def for_model(cls, model: nn.Module, config: KVCacheConfig | None = None,
                  **options: Any) -> list[Any]:
        """One cache per layer; layers the method does not support keep the model's own.

        ``options`` are ``KVCacheConfig`` fields or method options, a shortcut for
        ``for_model(model, KVCacheConfig(**options))``. Raises ``UnsupportedModelError``
        when the model's attention would bypass the compressed caches.
        """
        if config is None:
            config = KVCacheConfig(**options)
        elif options:
            config = config.replace(**options)
        method_cls = get_method(config.method)
        default_caches, eligible, layers = cls.eligible_layers(model, method_cls)
        probes = probe_layers(model, eligible)
        for info in layers:
            # What the layer really hands its cache wins over what its attributes say.
            shape = probes[info.layer_idx].shape
            if shape is not None:
                info.n_kv_heads, info.head_dim, info.v_head_dim = shape
        if method_cls.attends:
            check_attention_routing(model, eligible, config.method, probes)
        # Cross-layer methods assign groups and inject their shared coordinator.
        method_cls.assign_roles(layers, config, model)
        caches = list(default_caches)
        for i, info in zip(eligible, layers):
            caches[i] = method_cls(config, info)
        method_cls.after_build([caches[i] for i in eligible], config, model)
        install_attention_routing(model)
        return caches

    @staticmethod
    def detach(model: nn.Module) -> None:
        """Remove everything building caches installed on ``model`` (hooks, routing).

        The model then runs exactly as before any cache was built; call it before a
        memory measurement so that state installed by an earlier build is not reused.
        """
        for method_cls in methods().values():
            method_cls.detach(model)
        uninstall_attention_routing()


def cache_stats(caches: list[Any]) -> dict[str, Any]:
    """Totals over all layers: held, accounted and fp16-equivalent bytes and ratio.

    Layers that keep the model's own cache (e.g. sliding-window layers) count their
    ``nbytes`` as held and accounted, and the same tokens in float16 as fp16-equivalent.
    """
    held = accounted = fp16 = 0
    for c in caches:
        if isinstance(c, CompressedCache) or hasattr(c, "caches"):  # ours, or a batch of ours
            s = c.stats()
            held += s["held_bytes"]
            accounted += s["accounted_bytes"]
            fp16 += s["fp16_bytes"]
        else:
            n = getattr(c, "nbytes", 0) or 0
            held += n
            accounted += n
            # The same tokens in float16 (the model's own cache may hold float32).
            keys = getattr(c, "keys", None)
            itemsize = keys.itemsize if isinstance(keys, mx.array) else 2
            fp16 += n * 2 // itemsize
    return {
        "held_bytes": held,
        "accounted_bytes": accounted,
        "fp16_bytes": fp16,
        "ratio": held / fp16 if fp16 else 0.0,
    }
