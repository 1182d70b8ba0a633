"""``none``: the dense reference cache (mlx_lm's KVCache layout, with stats)."""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.cache.base import CompressedCache
from veloxquant_mlx.register import register


@register
class DenseCache(CompressedCache):
    """Full-precision keys and values, grown in steps like mlx_lm's ``KVCache``."""

    method = "none"
    family = "reference"
    stores = "full-precision K and V (mlx_lm KVCache layout)"
    step = 256

    def __init__(self, config, layer=None) -> None:
        super().__init__(config, layer)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.check_input(keys, values)
        B, H, L, _ = keys.shape
        self.batch_size = B
        prev = self.offset
        if self.keys is None or prev + L > self.keys.shape[2]:
            n = (self.step + L - 1) // self.step * self.step
            new_k = mx.zeros((B, H, n, keys.shape[3]), keys.dtype)
            new_v = mx.zeros((B, H, n, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.offset += L
        self.keys[..., prev:self.offset, :] = keys
        self.values[..., prev:self.offset, :] = values
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """The held keys/values (views of the buffers; cast when ``dtype`` is given)."""
        k, v = self.keys[..., :self.offset, :], self.values[..., :self.offset, :]
        return (k, v) if dtype is None else (k.astype(dtype), v.astype(dtype))

    def held_arrays(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    def accounted_bytes(self) -> int:
        if self.keys is None:
            return 0
        per_token = self.keys.shape[0] * self.keys.shape[1] * (
            self.keys.shape[3] * self.keys.itemsize + self.values.shape[3] * self.values.itemsize
        )
        return self.offset * per_token

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def state(self):
        if self.keys is None:
            return []
        return [self.keys[..., :self.offset, :], self.values[..., :self.offset, :]]

    @state.setter
    def state(self, v) -> None:
        if not v:
            self.keys = self.values = None
            return
        self.keys, self.values = v
        self.offset, self.batch_size = self.keys.shape[2], self.keys.shape[0]
