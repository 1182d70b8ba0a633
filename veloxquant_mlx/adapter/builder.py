"""``KVCacheBuilder.for_model``: one cache per KV cache slot for any mlx_lm model.

What a method compresses comes from the model itself. ``probe_model`` runs a two-token
probe with a stand-in in every KV slot of ``model.make_cache()`` (``adapter.mlx_lm``)
and learns each slot's real shapes, the module that updates it and how its attention
runs, whatever the projections are called. Plain full-attention slots (mlx_lm's
``KVCache``) get the method's cache; sliding-window slots (``RotatingKVCache``) get it
natively or as a ring over its compressed form (``cache.sliding``) where the method
supports that; every other slot (recurrent state, chunked or list caches) keeps the
model's own cache. Layers whose attention does not reach ``attend`` get a transient
dense reconstruction, or the build is refused (``check_attention_routing``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.adapter.mlx_lm import (
    SlotProbe,
    bind_routing,
    check_attention_routing,
    method_caps,
    model_layers,
    model_name,
    probe_model,
    rope_params,
    uninstall_attention_routing,
    uninstall_reconstruction,
)
from veloxquant_mlx.cache.base import CompressedCache, LayerInfo
from veloxquant_mlx.cache.rotated import rotated_class, wants_rotation
from veloxquant_mlx.cache.sliding import SlidingCache, sliding_mode
from veloxquant_mlx.config import ConfigError, KVCacheConfig
from veloxquant_mlx.errors import Refusal, UnsupportedModelError
from veloxquant_mlx.registry import get_method, methods


def _blocks_by_member(blocks: list[nn.Module]) -> dict[int, nn.Module]:
    """``id`` of every module inside a transformer block -> the block (the first that
    holds it): one walk of the blocks, not one per slot."""
    out: dict[int, nn.Module] = {}
    for block in blocks:
        for m in (block, *block.modules()):
            out.setdefault(id(m), block)
    return out


def _model_type(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return str(getattr(args, "model_type", "") or "")


def _modes(method_cls: type, probes: list[SlotProbe | None],
           infos: list[LayerInfo | None]) -> dict[int, str]:
    """Slot -> how the method compresses it: ``"full"``, ``"native"`` or ``"ring"``."""
    out: dict[int, str] = {}
    for i, (probe, info) in enumerate(zip(probes, infos)):
        if probe is None or info is None:
            continue
        if probe.window is None:
            if method_cls.supports_layer(probe.cache):
                out[i] = "full"
        elif probe.window_agrees:  # else mlx_lm's own ring: its quirks are the output
            mode = sliding_mode(method_cls, probe.cache)
            if mode is not None:
                out[i] = mode
    return out


def _nothing_to_compress(model: nn.Module, method: str,
                         probes: list[SlotProbe | None]) -> UnsupportedModelError:
    kinds = Counter(type(c).__name__ for c in make_prompt_cache(model))
    have = ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items())) or "none"
    unused = [p.slot for p in probes if p is not None and not p.used]
    extra = f"; KV slot(s) {unused} are never used by the model's attention" if unused else ""
    return UnsupportedModelError(
        f"{model_name(model)} has no plain full-attention layers that method {method!r} "
        f"can compress: its cache slots are {have}{extra}. Compressed: plain KV caches (mlx_lm's "
        "KVCache) and, for some methods, sliding-window ones (RotatingKVCache); "
        "recurrent, chunked, list and model-specific caches keep the model's own.",
        Refusal.NO_KV_LAYERS)


def _check_overrides(config: KVCacheConfig, modes: dict[int, str]) -> None:
    """Per-layer overrides must name slots the method compresses as plain layers (a
    sliding-window ring slices its inner cache by the method's shared options)."""
    bad = sorted(i for i in config.layer_overrides() if modes.get(i) not in ("full", "native"))
    if bad:
        have = sorted(i for i, m in modes.items() if m in ("full", "native"))
        raise ConfigError(
            f"KVCacheConfig.layers overrides layer(s) {bad}, which method "
            f"{config.method!r} does not compress as full layers on this model; the "
            f"layers it does: {have}")


class KVCacheBuilder:
    """Builds the per-slot caches of a model for a ``KVCacheConfig``."""

    @staticmethod
    def layer_infos(model: nn.Module,
                    probes: list[SlotProbe | None] | None = None) -> list[LayerInfo | None]:
        """Shape facts per cache slot of ``model.make_cache()``; ``None`` for slots that
        are not KV caches the model's attention uses.

        ``layer_idx`` is the slot index (the layer index wherever the model gives every
        layer one cache); heads and head dims are what the layer really hands its cache.
        """
        probes = probe_model(model) if probes is None else probes
        try:
            blocks = model_layers(model)
        except ValueError:
            blocks = []
        owner_block = _blocks_by_member(blocks)
        infos: list[LayerInfo | None] = []
        for p in probes:
            if p is None or not p.used:
                infos.append(None)
                continue
            n_kv_heads, head_dim, v_head_dim = p.shape
            infos.append(LayerInfo(
                layer_idx=p.slot, n_layers=len(probes), n_kv_heads=n_kv_heads,
                head_dim=head_dim, v_head_dim=v_head_dim, attention=p.owner,
                block=owner_block.get(id(p.owner)), model_type=_model_type(model),
                sliding_window=p.window, **rope_params(getattr(p.owner, "rope", None)),
            ))
        return infos

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
        method_cls = get_method(config.method)
        if wants_rotation(config):  # rotate=True (checked rotatable by the config)
            method_cls = rotated_class(method_cls)
        model_layers(model)  # a clear error for models without transformer blocks
        probes = probe_model(model)
        infos = cls.layer_infos(model, probes)
        modes = _modes(method_cls, probes, infos)
        if not modes:
            raise _nothing_to_compress(model, config.method, probes)
        _check_overrides(config, modes)
        slots = sorted(modes)
        check_attention_routing(model, slots, config.method, probes, method_caps(method_cls))
        layers = [infos[i] for i in slots]
        # Cross-layer methods assign groups and inject their shared coordinator.
        method_cls.assign_roles(layers, config, model)
        caches = make_prompt_cache(model)
        for i, info in zip(slots, layers):
            caches[i] = SlidingCache(method_cls, config, info) if modes[i] == "ring" \
                else method_cls(config, info)
        method_cls.after_build([caches[i] for i in slots], config, model)
        bind_routing(model, layers)
        return caches

    @staticmethod
    def detach(model: nn.Module) -> None:
        """Remove everything building caches installed on ``model`` (hooks, routing).

        The model then runs exactly as before any cache was built; call it before a
        memory measurement so that state installed by an earlier build is not reused.
        """
        for method_cls in methods().values():
            method_cls.detach(model)
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
            s = c.stats()
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
    rep = ours.query_heads() / ours.layer.n_kv_heads if ours is not None else 1.0
    flops += int(sum(foreign) * rep)  # fp16 bytes: 2 x (d + dv) per token and KV head
    return {
        "held_bytes": held,
        "accounted_bytes": accounted,
        "fp16_bytes": fp16,
        "ratio": held / fp16 if fp16 else 0.0,
        "decode_flops": flops,
    }
