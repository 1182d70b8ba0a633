"""Per-layer caches (one file per method) and the cross-layer coordinators."""

from veloxquant_mlx.cache.base import CompressedCache, LayerInfo

__all__ = ["CompressedCache", "LayerInfo"]
