"""Sliding-window layers (mlx_lm's ``RotatingKVCache``) with a compressed cache.

Models with local attention layers (Gemma 2/3, Mistral's sliding window, gpt-oss,
Cohere 2, OLMo 3, ...) give those layers mlx_lm's ``RotatingKVCache``: the last ``W``
keys and values, each query attending to the ``W`` most recent positions up to and
including itself. A method compresses such a layer in one of two ways:

- natively: the method bounds what it keeps by ``LayerInfo.sliding_window`` itself
  (its ``supports_layer`` accepts the layer; ``streaming`` keeps a ring of
  ``min(window, W)`` recent tokens and no sinks);
- ``SlidingCache``: a ring over a method's compressed form, for methods whose stored
  form does not depend on token positions and can drop its oldest tokens exactly
  (``drops_front``, ``ring_alignment``, ``drop_oldest``: a stored form's segments drop
  their front, ``cache.segments``): ``affine``, ``kivi``, ``turboquant``. One inner
  cache of the method holds the tokens; once ``block`` tokens older than the window
  have piled up, it drops them (codes sliced, never re-quantized, as a dequantize /
  quantize round trip would move codes by a step); a method may keep some of them
  (TurboQuant never cuts its float16 window), so the ring counts what its inner cache
  dropped. Attention runs through the inner cache's own ``attend``, with the model's own
  sliding mask mapped onto the held tokens (or, without one, a band: every query sees the ``W`` most recent
  positions up to itself), so it sees exactly what mlx_lm's ring would give it.

Methods that do neither leave sliding-window layers on mlx_lm's own cache: the
cross-layer ones (``xkv``, ``minicache``, ``xquant``, ``xquant_cl``), whose stored form
of a layer depends on other layers, and ``snapkv``, whose keep-set is chosen by scores
over every position (docs/models.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import RotatingKVCache

from veloxquant_mlx.cache.base import LAYER_RESTORERS, CompressedCache, LayerInfo

if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig


def sliding_window_of(layer_cache: Any) -> int | None:
    """The window of a sliding-window layer's own cache (``None`` for other caches).

    Only mlx_lm's plain ring (``keep == 0``); a ring that keeps its first tokens
    (``max_kv_size`` caches) is not a model's local attention.
    """
    if type(layer_cache) is RotatingKVCache and layer_cache.keep == 0:
        return int(layer_cache.max_size)
    return None


def sliding_mode(method_cls: type, layer_cache: Any) -> str | None:
    """How ``method_cls`` compresses this sliding-window layer: ``"native"``,
    ``"ring"`` or ``None`` (the layer keeps mlx_lm's own cache)."""
    if sliding_window_of(layer_cache) is None:
        return None
    if method_cls.profile.supports_layer(layer_cache):
        return "native"
    return "ring" if SlidingCache.wraps(method_cls) else None


def band_mask(start: int, n_held: int, first_query: int, n_queries: int,
              window: int) -> mx.array | None:
    """``[L, S]`` boolean: query at t sees held positions p with t - window < p <= t."""
    t = mx.arange(first_query, first_query + n_queries)[:, None]
    p = mx.arange(start, start + n_held)[None]
    if n_queries == 1 and start > first_query - window:
        return None  # every held token is visible
    return (p <= t) & (p > t - window)


class SlidingCache(CompressedCache):
    """A sliding-window layer's ring over one inner cache of a method."""

    attends = True

    def __init__(self, method_cls: type, config: KVCacheConfig,
                 layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        if not self.layer.sliding_window:
            raise ValueError("SlidingCache needs LayerInfo.sliding_window")
        self.method_cls = method_cls
        self.method = method_cls.method
        self.window = int(self.layer.sliding_window)
        self.align = max(1, int(method_cls.profile.ring_alignment(config.options)))
        # Rebuild once this many tokens are older than the window (a multiple of align).
        self.block = -(-max(self.window // 4, self.align) // self.align) * self.align
        self.inner = method_cls(config, self.layer)
        self.start = 0  # position of the inner cache's first token
        self.last_chunk = 0

    @classmethod
    def wraps(cls, method_cls: type) -> bool:
        return method_cls.profile.drops_front and method_cls.attends and not method_cls.profile.cross_layer

    # ---- the ring ----
    def _drop_old(self) -> None:
        """Drop from the inner cache the tokens no future query will see (its
        ``drop_oldest``: codes sliced, never re-quantized)."""
        droppable = self.offset - self.window + 1 - self.start
        if droppable < self.block:
            return
        n = droppable // self.align * self.align
        self.inner.drop_oldest(n)
        # A method may keep some of them (TurboQuant's float16 window): count what went.
        self.start = self.offset - self.inner.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.batch_size = keys.shape[0]
        if self.inner.offset:
            self._drop_old()
        self.inner.update_and_fetch(keys, values)
        self.offset += keys.shape[2]
        self.last_chunk = keys.shape[2]
        return keys, values

    def _commit(self) -> None:
        # A restore feeds chunks without attending: the inner cache codes its last one.
        self.inner._commit()

    def _held_mask(self, mask: Any, L: int) -> mx.array | None:
        """The model's mask over the held tokens, or the band when it gave none.

        mlx_lm's masks are right-aligned to the newest token; held tokens older than a
        mask's first column are outside what the model lets the queries see.
        """
        n = self.inner.offset
        if not isinstance(mask, mx.array) or mask.dtype != mx.bool_:
            return band_mask(self.start, n, self.offset - L, L, self.window)
        width = mask.shape[-1]
        if width >= n:
            return mask[..., width - n:]
        pad = mx.zeros((*mask.shape[:-1], n - width), mx.bool_)
        return mx.concatenate([pad, mask], axis=-1)

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        L = queries.shape[2]
        return self.inner.attend(queries, scale=scale, mask=self._held_mask(mask, L))

    def keys_and_values(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """What mlx_lm's ring returns after the last chunk: the ``W - 1`` tokens before
        it (fewer at the start) and the chunk itself."""
        keys, values = self.inner.keys_and_values(dtype)
        before = self.offset - self.last_chunk
        n = min(before, self.window - 1) + self.last_chunk
        return keys[:, :, -n:], values[:, :, -n:]

    def make_mask(self, N: int, return_array: bool = False,
                  window_size: int | None = None) -> Any:
        # As mlx_lm's RotatingKVCache: a mask over what ``keys_and_values`` will return.
        if N == 1:
            return None
        window_size = window_size or self.window
        offset = min(self.window - 1, self.offset)
        if offset + N > window_size or return_array:
            return create_causal_mask(N, offset, window_size=window_size)
        return "causal"

    # ---- storage ----
    def held_arrays(self) -> list[mx.array]:
        return self.inner.held_arrays()

    def accounted_bytes(self) -> int:
        return self.inner.accounted_bytes()

    @property
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, v: Any) -> None:
        self.inner.state = v

    @property
    def meta_state(self) -> tuple[str, ...]:
        own = (self.offset, self.batch_size, self.start, self.last_chunk)
        return (*map(str, own), *self.inner.meta_state)

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        self.offset, self.batch_size, self.start, self.last_chunk = map(int, v[:4])
        self.inner.meta_state = tuple(v[4:])

    @classmethod
    def restore(cls, method_cls: type, config: KVCacheConfig, layer: LayerInfo,
                state: Any, meta_state: tuple[str, ...]) -> SlidingCache:
        """Rebuild a saved ring (``base.restore_saved`` dispatches here)."""
        cache = cls(method_cls, config, layer)
        cache.meta_state = meta_state
        cache.state = state
        return cache

    # ---- trimming: exact while no token has left the ring ----
    def is_trimmable(self) -> bool:
        return self.start == 0 and self.inner.is_trimmable()

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return super().trim(n)
        n = self.inner.trim(n)
        self.offset -= n
        return n


def _restore(method_cls: type, config: KVCacheConfig, layer: LayerInfo, state: Any,
             meta_state: tuple[str, ...]) -> SlidingCache | None:
    if layer.sliding_window and SlidingCache.wraps(method_cls):
        return SlidingCache.restore(method_cls, config, layer, state, meta_state)
    return None


LAYER_RESTORERS.append(_restore)
