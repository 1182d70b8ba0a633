"""Errors shared by the caches and the mlx_lm integration (imports nothing)."""

from __future__ import annotations

from enum import Enum


class Refusal(str, Enum):
    """Why a method cannot run on a model or layer (``UnsupportedModelError.reason``)."""

    NO_KV_LAYERS = "no_kv_layers"  # nothing the method takes: recurrent, list caches, ...
    PROBE_FAILED = "probe_failed"  # the two-token probe through the caches raised
    UNUSED_SLOT = "unused_slot"  # a cache slot the model's attention never uses
    UNHOOKABLE = "unhookable"  # the code that attends takes the cache from the model's list
    NO_RECONSTRUCTION = "no_reconstruction"  # a layer attends by itself; no dense view
    EVICTED_POSITIONS = "evicted_positions"  # eviction under a layer that attends by itself
    EXTRA_ARGUMENTS = "extra_arguments"  # the hooked module takes more than its input
    LAYER_FORM = "layer_form"  # a layer's structure the method's numerics do not fit
    TOO_FEW_LAYERS = "too_few_layers"


class UnsupportedModelError(ValueError):
    """A method cannot run on this model (or layer) without giving wrong output.

    ``reason``: a :class:`Refusal`, for callers (and tests) that act on why.
    """

    def __init__(self, message: str, reason: Refusal = Refusal.LAYER_FORM) -> None:
        super().__init__(message)
        self.reason = Refusal(reason)


class GGUFError(ValueError):
    """A GGUF file cannot be read or converted: malformed or truncated header, a value
    of the wrong type, an unsupported architecture, tokenizer or tensor type. The
    message names the file (or the metadata key) and what was expected."""


class PromptCacheError(ValueError):
    """A prompt-cache file is corrupt, truncated or does not fit the model."""
