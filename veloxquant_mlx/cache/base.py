"""The cache protocol every method implements.

A cache is one object per layer that mlx_lm's models call exactly like its own
``KVCache``: ``update_and_fetch(keys, values)`` with ``[B, n_kv_heads, L, head_dim]``
arrays, ``offset``, ``make_mask``, ``state``/``meta_state``, ``trim``.

Methods that cannot hand back dense keys and values (low-rank factors, eviction)
implement ``attend(queries, scale, mask)``; the attention routing in
``veloxquant_mlx.integration.mlx_lm`` then calls it instead of the dense kernel.
Their ``update_and_fetch`` returns only the new chunk, never a reconstruction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from ..config import KVCacheConfig, config_error

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


@dataclass
class LayerInfo:
    """What a layer's cache knows about its place in the model.

    Filled in by ``KVCacheBuilder.for_model``; tests may build it by hand.
    """

    layer_idx: int = 0
    n_layers: int = 1
    n_kv_heads: int = 1
    head_dim: int = 64
    v_head_dim: int | None = None
    # Cross-layer roles (group id, position in the group, group size).
    group_id: int = 0
    member_idx: int = 0
    group_size: int = 1
    # RoPE of the layer (for caches that store keys before rotation).
    rope_dims: int | None = None
    rope_base: float = 10000.0
    rope_traditional: bool = False
    rope_scale: float = 1.0
    # Not saved: live objects injected by the builder.
    coordinator: Any = field(default=None, repr=False, compare=False)
    attention: Any = field(default=None, repr=False, compare=False)
    model_type: str = ""

    def __post_init__(self) -> None:
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim

    def to_dict(self) -> dict[str, Any]:
        """Serializable part (no live objects)."""
        return {
            k: getattr(self, k)
            for k in self.__dataclass_fields__
            if k not in ("coordinator", "attention")
        }

    def __deepcopy__(self, memo: dict) -> LayerInfo:
        # mlx_lm deep-copies batch caches; share the live attention module (weights)
        # instead of copying it, but copy the coordinator (per-sequence state).
        import copy

        out = copy.copy(self)
        memo[id(self)] = out
        out.coordinator = copy.deepcopy(self.coordinator, memo)
        return out


class CompressedCache(_BaseCache):
    """Base class of every veloxquant cache (one per layer).

    Subclasses set ``method`` and implement ``update_and_fetch``, ``held_arrays``
    and ``accounted_bytes``; ``attend`` when the method runs its own attention.
    """

    method: ClassVar[str] = ""

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        self.config = config
        self.layer = layer or LayerInfo()
        self.offset = 0
        self.batch_size = 0

    # ---- configuration ----
    @classmethod
    def validate_config(cls, config: KVCacheConfig) -> None:
        """Raise ``ConfigError`` for options this method does not allow."""

    @classmethod
    def supports_layer(cls, layer_cache: Any) -> bool:
        """Whether this method replaces the model's own cache of this layer.

        Plain full-attention layers use ``mlx_lm``'s ``KVCache``; sliding-window and
        recurrent layers keep their own cache unless a method overrides this.
        """
        from mlx_lm.models.cache import KVCache

        return type(layer_cache) is KVCache

    @classmethod
    def assign_roles(cls, layers: list[LayerInfo], config: KVCacheConfig, model: Any) -> None:
        """Set group ids / member indices and inject coordinators (cross-layer methods).

        ``layers`` are the layers this method compresses, in model order. The default
        makes every layer its own group of one.
        """
        for i, info in enumerate(layers):
            info.group_id, info.member_idx, info.group_size = i, 0, 1

    @classmethod
    def after_build(cls, caches: list[CompressedCache], config: KVCacheConfig,
                    model: Any) -> None:
        """Hook run once all caches of a model are built (e.g. to link layer pairs)."""

    @classmethod
    def from_saved(cls, config: KVCacheConfig, layer: LayerInfo, state: Any,
                   meta_state: tuple[str, ...]) -> CompressedCache:
        """Rebuild a cache saved by ``save_prompt_cache``.

        ``layer`` already carries the roles and the fresh coordinator that
        ``assign_roles`` injected. ``meta_state`` is applied first: it says how the
        ``state`` list is laid out (bits, ranks, counts).
        """
        cache = cls(config, layer)
        cache.meta_state = meta_state
        cache.state = state
        return cache

    # ---- batches (mlx_lm BatchGenerator) ----
    # Methods that cannot run as a batch of per-sequence caches set this to False.
    supports_batching: ClassVar[bool] = True

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        """One batch cache over per-sequence caches (``mlx_lm``'s ``_merge_caches``).

        The default keeps every sequence's compressed cache (and its coordinator) as
        it is and runs attention per sequence: see ``integration/batch.py``.
        """
        if not cls.supports_batching:
            raise NotImplementedError(
                f"method {cls.method!r} does not support batch merging: generate one "
                "sequence at a time"
            )
        from ..integration.batch import BatchedCache

        return BatchedCache.merge(caches)

    def __deepcopy__(self, memo: dict) -> CompressedCache:
        # mlx_lm deep-copies batch caches; mx.Dtype values cannot be deep-copied.
        import copy

        out = type(self).__new__(type(self))
        memo[id(self)] = out
        for k, v in self.__dict__.items():
            setattr(out, k, v if isinstance(v, mx.Dtype) else copy.deepcopy(v, memo))
        return out

    def _batch_only(self, name: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} ({self.method!r}): {name} is defined on a merged "
            "batch cache; merge per-sequence caches first with merge([...])"
        )

    def extract(self, idx: int) -> Any:
        raise self._batch_only("extract")

    def filter(self, batch_indices: list[int]) -> None:
        raise self._batch_only("filter")

    def extend(self, other: Any) -> None:
        raise self._batch_only("extend")

    def prepare(self, **kwargs: Any) -> None:
        raise self._batch_only("prepare")

    def finalize(self) -> None:
        raise self._batch_only("finalize")

    # ---- storage accounting ----
    def held_arrays(self) -> list[mx.array]:
        """Every array this cache holds (compressed form and window)."""
        raise NotImplementedError

    def accounted_bytes(self) -> int:
        """Bytes the method's own storage formula gives for the tokens held."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays actually held (what memory really costs)."""
        seen: set[int] = set()
        total = 0
        for a in self.held_arrays():
            if a is None or id(a) in seen:
                continue
            seen.add(id(a))
            total += a.nbytes
        return total

    def fp16_bytes(self) -> int:
        """Bytes a dense float16 cache would hold for the same tokens."""
        width = self.layer.n_kv_heads * (self.layer.head_dim + self.layer.v_head_dim)
        return max(self.batch_size, 1) * self.offset * width * 2 if self.offset else 0

    def stats(self) -> dict[str, Any]:
        """Held bytes, accounted bytes, fp16-equivalent bytes, tokens and ratio."""
        held = self.nbytes
        fp16 = self.fp16_bytes()
        return {
            "method": self.method,
            "layer": self.layer.layer_idx,
            "tokens": self.offset,
            "held_bytes": held,
            "accounted_bytes": self.accounted_bytes(),
            "fp16_bytes": fp16,
            "ratio": (held / fp16) if fp16 else 0.0,
        }

    # ---- mlx_lm protocol ----
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        raise NotImplementedError

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise NotImplementedError(
            f"{type(self).__name__} ({self.method!r}) is not trimmable: its compressed "
            "form cannot drop tokens from the end"
        )

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array,
                                     window_size=window_size)

    @property
    def meta_state(self) -> tuple[str, ...]:
        return (str(self.offset), str(self.batch_size))

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        self.offset, self.batch_size = int(v[0]), int(v[1])

    # ---- helpers for subclasses ----
    def window_dtype(self, compute_dtype: mx.Dtype) -> mx.Dtype:
        """Dtype of the full-precision window (config ``window_dtype``)."""
        name = self.config.window_dtype
        return compute_dtype if name is None else DTYPES[name]

    def check_input(self, keys: mx.array, values: mx.array) -> None:
        """Shapes must match the layer this cache was built for."""
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError(
                f"{self.method}: keys/values must be [B, n_kv_heads, L, head_dim], got "
                f"keys {tuple(keys.shape)} and values {tuple(values.shape)}"
            )
        if self.offset == 0 and hasattr(self, "attend"):
            from ..integration.mlx_lm import routing_installed

            if not routing_installed():
                raise RuntimeError(
                    f"{type(self).__name__} runs its own attention, but attention routing "
                    "is not installed: build caches with KVCacheBuilder.for_model or call "
                    "veloxquant_mlx.integration.mlx_lm.install_attention_routing(model)"
                )
        B, H, L, D = keys.shape
        if H != self.layer.n_kv_heads or D != self.layer.head_dim:
            raise ValueError(
                f"{self.method} cache of layer {self.layer.layer_idx}: keys shape "
                f"{tuple(keys.shape)} does not match n_kv_heads={self.layer.n_kv_heads}, "
                f"head_dim={self.layer.head_dim}"
            )
        if values.shape[:3] != (B, H, L) or values.shape[3] != self.layer.v_head_dim:
            raise ValueError(
                f"{self.method} cache of layer {self.layer.layer_idx}: values shape "
                f"{tuple(values.shape)} does not match keys {tuple(keys.shape)} / "
                f"v_head_dim={self.layer.v_head_dim}"
            )
        if self.batch_size and B != self.batch_size:
            raise ValueError(
                f"{self.method}: batch size changed from {self.batch_size} to {B}"
            )
        if L > 1 and not mx.all(mx.isfinite(keys) & mx.isfinite(values)).item():
            # Checked on prompt chunks only: a check per decode step would force a sync
            # in every layer. Compressing NaN/Inf would silently poison the whole cache.
            raise ValueError(
                f"{self.method} cache of layer {self.layer.layer_idx}: keys/values contain "
                "NaN or Inf; only finite values can be cached"
            )
        if self.offset + L > self.config.max_ctx:
            raise ValueError(
                f"{self.method} cache of layer {self.layer.layer_idx}: {self.offset + L} "
                f"tokens exceed KVCacheConfig.max_ctx={self.config.max_ctx}"
            )


def require_group_divides(layer: LayerInfo, group_size: int) -> None:
    """``group_size`` must divide the layer's key and value head dims."""
    for name, d in (("head_dim", layer.head_dim), ("v_head_dim", layer.v_head_dim)):
        if d % group_size:
            divisors = [g for g in (32, 64, 128) if d % g == 0]
            raise config_error(
                "group_size", group_size,
                f"a divisor of {name}={d} of layer {layer.layer_idx} (one of {divisors})",
            )


def require_int(name: str, value: Any, allowed: tuple[int, ...] | None = None,
                minimum: int | None = None) -> None:
    """Shared validation of an integer option."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise config_error(name, value, "an integer")
    if allowed is not None and value not in allowed:
        raise config_error(name, value, f"one of {list(allowed)}")
    if minimum is not None and value < minimum:
        raise config_error(name, value, f"an integer >= {minimum}")
