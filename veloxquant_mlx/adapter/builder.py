"""``KVCacheBuilder.for_model``: one cache per KV cache slot for any mlx_lm model.

It takes four steps, each calling down and none coming back here:

1. ``registry.resolve``: the method's class, looked up once (rotated where the config
   asks, ``cache.rotated``), with the config's options and per-layer overrides.
2. ``probe_model`` (``adapter.mlx_lm``): the model, asked once. A two-token probe with a
   stand-in in every KV slot of ``model.make_cache()`` learns each slot's real shapes,
   the module that updates it and how its attention runs, whatever the projections are
   called.
3. ``plan_slots`` (``adapter.mlx_lm``): plain full-attention slots (mlx_lm's ``KVCache``)
   get the method's cache; sliding-window slots (``RotatingKVCache``) get it natively or
   as a ring over its compressed form (``cache.sliding``) where the method supports
   that; every other slot (recurrent state, chunked or list caches) keeps the model's
   own cache. Layers whose attention does not reach ``attend`` get a transient dense
   reconstruction, or the build is refused (``check_attention_routing``).
4. ``Resolved.build`` makes the caches; ``bind_routing`` takes the model's routing lease.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.adapter.mlx_lm import (
    SlotProbe,
    bind_routing,
    layer_infos,
    model_layers,
    plan_slots,
    probe_model,
    uninstall_attention_routing,
    uninstall_reconstruction,
)
from veloxquant_mlx.cache.base import CompressedCache, LayerInfo
from veloxquant_mlx.cache.step_cost import layer_stats, query_heads
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.registry import methods, resolve


class KVCacheBuilder:
    """Builds the per-slot caches of a model for a ``KVCacheConfig``."""

    @staticmethod
    def layer_infos(model: nn.Module,
                    probes: list[SlotProbe | None] | None = None) -> list[LayerInfo | None]:
        """Shape facts per cache slot of ``model.make_cache()`` (``mlx_lm.layer_infos``;
        the model is probed when no ``probes`` are given)."""
        return layer_infos(model, probe_model(model) if probes is None else probes)

    @classmethod
    def for_model(cls, model: nn.Module, config: KVCacheConfig | None = None,
                  **options: Any) -> list[Any]:
        """One cache per slot; slots the method does not compress keep the model's own.

        ``options`` are ``KVCacheConfig`` fields or method options, a shortcut for
        ``for_model(model, KVCacheConfig(**options))``. Raises ``UnsupportedModelError``
        when the method cannot compress any layer, or when a layer's attention would
        bypass the compressed cache and the method cannot rebuild dense keys for it.
        """
        if config is None:
            config = KVCacheConfig(**options)
        elif options:
            config = config.replace(**options)
        # Each step calls down only: the method once, the model once, then the caches.
        method = resolve(config)
        model_layers(model)  # a clear error for models without transformer blocks
        probes = probe_model(model)
        slots = plan_slots(model, method, probes)
        caches = method.build(make_prompt_cache(model), slots, model)
        bind_routing(model, [info for info, _ in slots.values()])
        return caches

    @staticmethod
    def detach(model: nn.Module) -> None:
        """Remove everything building caches installed on ``model`` (hooks, routing).

        The model then runs exactly as before any cache was built; call it before a
        memory measurement so that state installed by an earlier build is not reused.
        """
        for method_cls in methods().values():
            method_cls.profile.detach(model)
        uninstall_reconstruction(model)
        uninstall_attention_routing(model)  # this model's lease only


def _foreign_fp16(c: Any, nbytes: int) -> int:
    """The model's own cache's tokens in float16, counted as ours are: the tokens it
    attends (a ring's window at most), not its spare capacity or a prefill's overhang."""
    keys, values = getattr(c, "keys", None), getattr(c, "values", None)
    offset = getattr(c, "offset", None)
    if not (isinstance(keys, mx.array) and isinstance(values, mx.array)
            and isinstance(offset, int) and keys.ndim == 4):
        itemsize = keys.itemsize if isinstance(keys, mx.array) else 2
        return nbytes * 2 // itemsize  # e.g. recurrent state: its bytes in float16
    tokens = min(offset, getattr(c, "max_size", None) or offset)
    b, h, _, d = keys.shape
    return b * h * tokens * (d + values.shape[-1]) * 2


def cache_stats(caches: list[Any]) -> dict[str, Any]:
    """Totals over all layers: held, accounted and fp16-equivalent bytes and ratio.

    Layers that keep the model's own cache (e.g. recurrent layers) count their
    ``nbytes`` as held and accounted, and the tokens they attend in float16 as
    fp16-equivalent, as ours do (a sliding layer: its window), so that every method's
    ratio has the same denominator.
    """
    held = accounted = fp16 = flops = 0
    foreign = []
    for c in caches:
        if isinstance(c, CompressedCache) or hasattr(c, "caches"):  # ours, or a batch of ours
            s = c.stats() if hasattr(c, "caches") else layer_stats(c)
            held += s["held_bytes"]
            accounted += s["accounted_bytes"]
            fp16 += s["fp16_bytes"]
            flops += s.get("decode_flops", 0)
        else:
            n = getattr(c, "nbytes", 0) or 0
            held += n
            accounted += n
            foreign.append(_foreign_fp16(c, n))
            fp16 += foreign[-1]
    # The model's own caches attend densely; its query heads per KV head are ours'.
    ours = next((c for c in caches if isinstance(c, CompressedCache)), None)
    rep = query_heads(ours) / ours.layer.n_kv_heads if ours is not None else 1.0
    flops += int(sum(foreign) * rep)  # fp16 bytes: 2 x (d + dv) per token and KV head
    return {
        "held_bytes": held,
        "accounted_bytes": accounted,
        "fp16_bytes": fp16,
        "ratio": held / fp16 if fp16 else 0.0,
        "decode_flops": flops,
    }
