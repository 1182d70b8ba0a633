"""Errors shared by the caches and the mlx_lm integration (imports nothing)."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """A method cannot run on this model (or layer) without giving wrong output."""
