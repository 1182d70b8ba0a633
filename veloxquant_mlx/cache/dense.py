"""``none``: the dense reference cache (mlx_lm's KVCache layout, with stats)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx

from veloxquant_mlx.cache.profile import Profile
from veloxquant_mlx.cache.segment_kinds import Grown
from veloxquant_mlx.cache.segments import StoredForm
from veloxquant_mlx.cache.stored import StoredFormCache
from veloxquant_mlx.register import register

if TYPE_CHECKING:
    from veloxquant_mlx.cache.base import LayerInfo
    from veloxquant_mlx.config import KVCacheConfig


@register
class DenseCache(StoredFormCache):
    """Full-precision keys and values, grown in steps like mlx_lm's ``KVCache``."""

    method = "none"
    profile = Profile(
        family="reference",
        stores="full-precision K and V (mlx_lm KVCache layout)",
    )
    step = 256
    # mlx_lm's own attention runs on the dense views ``update_and_fetch`` returns.
    attends = False

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.stored = StoredForm([Grown(self.step)], [Grown(self.step)])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.begin(keys, values)
        (k,), (v,) = self.stored.keys, self.stored.values
        k.append(keys)
        v.append(values)
        return k.view(), v.view()

    @property
    def keys(self) -> mx.array | None:
        """The key buffer, under mlx_lm ``KVCache``'s name (tokens ``[..., :offset, :]``)."""
        return self.stored.keys[0].buf

    @property
    def values(self) -> mx.array | None:
        return self.stored.values[0].buf

    def keys_and_values(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """The held keys/values (views of the buffers; cast when ``dtype`` is given)."""
        return self.stored.keys_and_values(dtype)

    @property
    def state(self) -> list[Any]:
        return self.stored.state()

    @state.setter
    def state(self, v: list[Any]) -> None:
        # Files written before the stored form saved an empty cache as no entries.
        StoredFormCache.state.fset(self, v or [None, None])
