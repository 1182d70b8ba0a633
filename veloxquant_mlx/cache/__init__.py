"""Per-layer caches (one file per method) and the cross-layer coordinators."""

from .base import CompressedCache, LayerInfo

__all__ = ["CompressedCache", "LayerInfo"]
