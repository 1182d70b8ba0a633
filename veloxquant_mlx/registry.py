"""Method registry: a name maps to the cache class that implements it.

Classes are imported lazily, so a method's module is only loaded when it is used
and ``veloxquant methods`` stays fast.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class MethodInfo:
    """What the registry knows about one method."""

    name: str
    family: str  # "reference", "quantization", "low-rank", "eviction", "merging", ...
    paper: str
    stores: str
    target: str  # "module:ClassName"
    cross_layer: bool = False
    status: str = "implemented"


_METHODS: dict[str, MethodInfo] = {}


def register(info: MethodInfo) -> None:
    """Add a method; a second method under the same name is an error."""
    if info.name in _METHODS:
        raise ValueError(f"method {info.name!r} is registered twice")
    _METHODS[info.name] = info


for _info in (
    MethodInfo("none", "reference", "-", "full-precision K and V (mlx_lm KVCache layout)",
               "veloxquant_mlx.cache.dense:DenseCache"),
    MethodInfo("affine", "quantization", "MLX affine quantization (mx.quantize)",
               "K and V codes + per-group scale/bias, optional fp window",
               "veloxquant_mlx.cache.affine:AffineCache"),
    MethodInfo("kivi", "quantization",
               "KIVI, Liu et al., ICML 2024 (arXiv 2402.02750)",
               "K per-channel / V per-token packed codes + fp residual window",
               "veloxquant_mlx.cache.kivi:KIVICache"),
    MethodInfo("streaming", "eviction",
               "StreamingLLM, Xiao et al., ICLR 2024 (arXiv 2309.17453)",
               "sink tokens + recent window (fixed size)",
               "veloxquant_mlx.cache.streaming:StreamingCache"),
    MethodInfo("snapkv", "eviction", "SnapKV, Li et al., 2024 (arXiv 2404.14469)",
               "top-capacity prompt tokens per KV head + observation window",
               "veloxquant_mlx.cache.snapkv:SnapKVCache"),
    MethodInfo("xkv", "low-rank (cross-layer)",
               "xKV, Chang et al., 2025 (arXiv 2503.18893)",
               "shared token factor per layer group + per-layer factors + fp window",
               "veloxquant_mlx.cache.xkv:XKVCache", cross_layer=True),
    MethodInfo("minicache", "merging (cross-layer)",
               "MiniCache, Liu et al., NeurIPS 2024 (arXiv 2405.14366)",
               "one SLERP direction per token per layer pair + magnitudes + retained tokens",
               "veloxquant_mlx.cache.minicache:MiniCacheCache", cross_layer=True),
    MethodInfo("xquant", "quantization (rematerialize)",
               "XQuant, Tomar et al., 2025 (arXiv 2508.10395)",
               "quantized attention input X; K and V rematerialized",
               "veloxquant_mlx.cache.xquant:XQuantCache", cross_layer=False),
    MethodInfo("xquant_cl", "quantization (cross-layer)",
               "XQuant-CL, Tomar et al., 2025 (arXiv 2508.10395)",
               "anchor X + quantized cross-layer deltas of X",
               "veloxquant_mlx.cache.xquant:XQuantCLCache", cross_layer=True),
):
    register(_info)


def method_info(name: str) -> MethodInfo:
    """The registry entry of ``name``; unknown names list the known ones."""
    try:
        return _METHODS[name]
    except KeyError:
        from .config import config_error

        raise config_error("method", name, f"one of {sorted(_METHODS)}") from None


def get_method(name: str) -> type:
    """The cache class of method ``name`` (imported on first use)."""
    info = method_info(name)
    module_name, _, class_name = info.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise NotImplementedError(
                f"method {name!r} is registered but its module {module_name} is not "
                "available in this build"
            ) from exc
        raise
    return getattr(module, class_name)


def list_methods() -> list[dict[str, str]]:
    """Each method's name, family, paper, what it stores and status."""
    rows = []
    for info in _METHODS.values():
        try:
            importlib.import_module(info.target.partition(":")[0])
            status = info.status
        except ModuleNotFoundError:
            status = "planned"
        rows.append(
            {
                "name": info.name,
                "family": info.family,
                "paper": info.paper,
                "stores": info.stores,
                "cross_layer": "yes" if info.cross_layer else "no",
                "status": status,
            }
        )
    return rows
