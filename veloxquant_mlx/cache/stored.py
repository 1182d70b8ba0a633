"""``StoredFormCache``: a cache whose storage is one declared ``StoredForm``.

A method that subclasses it builds its form in ``__init__`` (``self.stored``: key and
value segments in token order, ``cache.segments``) and writes ``update_and_fetch``
(which segment each new token goes to) and, if it codes tokens only after they were
attended in full precision, ``commit``. Everything else comes from the form: held and
accounted bytes, ``state`` (the form's state order is the saved layout), attention over
the segments without a dense copy (``ops.attention.attend_parts``), the dense view for
layers that attend by themselves, exact ``trim`` and ring drops of the oldest tokens.

"Code the new tokens after they are attended" is one mechanism: ``attend`` runs over the
form, then calls ``commit``; ``begin`` (the start of every ``update_and_fetch``) commits
what a step that never attended left behind, so a layer that bypasses ``attend`` or a
harness that only updates leaves the cache consistent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import mlx.core as mx

from veloxquant_mlx.cache.base import CompressedCache
from veloxquant_mlx.cache.segments import StoredForm
from veloxquant_mlx.ops.attention import attend_parts
from veloxquant_mlx.ops.parts import Slot, slot_parts

if TYPE_CHECKING:
    from veloxquant_mlx.cache.base import LayerInfo
    from veloxquant_mlx.config import KVCacheConfig


class StoredFormCache(CompressedCache):
    """Bytes, state, attention, dense view, trim and ring drops from ``self.stored``."""

    attends = True
    # Multiply packed codes with ``mx.quantized_matmul`` instead of reading them as
    # floats (the CPU is faster without; see docs/cpu-performance.md).
    use_quantized_matmul: ClassVar[bool] = False
    compute_dtype = mx.float32

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.stored = StoredForm([], [])

    # ---- what a method writes ----
    def commit(self) -> None:
        """Code what the last step attended in full precision (default: nothing)."""

    def begin(self, keys: mx.array, values: mx.array) -> None:
        """Start of ``update_and_fetch``: checks, the previous step's pending tokens
        committed, and the bookkeeping of the new chunk."""
        self.check_input(keys, values)
        self.commit()
        self.batch_size = keys.shape[0]
        self.compute_dtype = keys.dtype
        self.offset += keys.shape[2]

    # ---- derived from the form ----
    def held_arrays(self) -> list[mx.array]:
        return self.stored.arrays()

    def accounted_bytes(self) -> int:
        return self.stored.accounted(max(self.batch_size, 1), self.layer.n_kv_heads)

    @property
    def state(self) -> list[Any]:
        return self.stored.state()

    @state.setter
    def state(self, v: list[Any]) -> None:
        if "stored" not in self.__dict__:  # mlx_lm's ``from_state`` skips ``__init__``
            raise TypeError(
                f"{type(self).__name__} needs its config and layer to adopt a saved state: "
                "rebuild it with from_saved(config, layer, state, meta_state) or "
                "veloxquant_mlx.load_prompt_cache")
        self.stored.load(v)

    def attention_slots(self) -> tuple[list[Slot], list[Slot]]:
        return self.stored.slots(self.use_quantized_matmul)

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        keys, values = self.attention_slots()
        out = attend_parts(queries, slot_parts(keys), slot_parts(values), scale, mask)
        self.commit()  # the new tokens were attended in full precision: code them now
        return out

    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """Transient dense keys/values: every segment decoded, in token order."""
        return self.stored.dense_kv(dtype or self.compute_dtype)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens; kept tokens stay exactly as held. A method whose
        ``is_trimmable`` says no (e.g. after evicting) gets ``NotTrimmableError``."""
        if not self.is_trimmable():
            return super().trim(n)
        n = max(0, min(self.offset, n))
        if n:
            self.commit()
            self.stored.trim(n)
            self.offset -= n
        return n

    def drop_oldest(self, n: int) -> None:
        """Forget the ``n`` oldest tokens (a multiple of ``ring_alignment``): codes are
        sliced, never re-quantized (sliding-window rings, ``cache.sliding``)."""
        self.commit()
        self.stored.drop_front(n)
        self.offset -= n
