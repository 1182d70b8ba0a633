"""What one decode step over a cache costs in arithmetic (the roofline's FLOPs).

A mixin of ``CompressedCache``: the defaults are dense attention's over the tokens a
query attends; a method that rebuilds keys or attends in a factor space overrides
``decode_flops``, one that evicts overrides ``attended_tokens``.
"""

from __future__ import annotations

from typing import Any


class StepCost:
    """``layer`` (a ``LayerInfo``), ``offset`` and ``batch_size`` come from the cache."""

    layer: Any
    offset: int
    batch_size: int

    def window_tokens(self) -> int:
        """Tokens within the layer's own attention window (a local layer's at most):
        what a dense cache of this layer attends, whatever the method keeps."""
        return min(self.offset, self.layer.sliding_window or self.offset)

    def attended_tokens(self) -> int:
        """Tokens a decode query attends here (a method that evicts: what it keeps)."""
        return self.window_tokens()

    def query_heads(self) -> int:
        """Query heads of the layer's attention (its KV heads if it does not say)."""
        return int(getattr(self.layer.attention, "n_heads", 0) or self.layer.n_kv_heads)

    def decode_flops(self) -> int:
        """FLOPs (2 per multiply-add) of one decode query's attention here: dense
        attention's over the attended tokens unless the method says otherwise."""
        d = self.layer.head_dim + self.layer.v_head_dim
        return 2 * max(self.batch_size, 1) * self.query_heads() * self.attended_tokens() * d
