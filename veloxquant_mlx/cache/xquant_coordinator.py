"""``XQuantCoordinator``: the cross-layer hand-off of XQuant-CL.

A single anchor publishes; reusers read (no fan-in, no joint computation). In each
forward pass the anchor layer (the first XQuant-CL layer) publishes the
reconstruction of its residual stream for every token held, ``[0, end)``, together
with the token range ``[start, end)`` of the chunk being written. Each later layer
reads the reconstruction of the layer before it, rebuilds its own by adding its
dequantized deltas, and hands that on to the next layer with ``pass_on``.

Only the current forward pass is held: a transient accumulator, never stored as
part of any cache. ``release`` drops it after the last layer has read.
Single-threaded by construction (mlx_lm runs the layers in order).
"""

from __future__ import annotations

import mlx.core as mx


class XQuantCoordinator:
    """Hands the running reconstruction of the residual stream from layer to layer."""

    def __init__(self) -> None:
        self.anchor: int | None = None
        self.last_layer: int | None = None
        self._range: tuple[int, int] | None = None
        self._layer: int | None = None
        self._x: mx.array | None = None

    def set_anchor(self, layer_idx: int) -> None:
        """Declare the anchor layer; a model has exactly one."""
        if self.anchor is not None and self.anchor != layer_idx:
            raise ValueError(
                f"XQuantCoordinator already has anchor layer {self.anchor}; layer "
                f"{layer_idx} cannot be a second anchor"
            )
        self.anchor = layer_idx

    def publish(self, layer_idx: int, start: int, end: int, x: mx.array) -> None:
        """The anchor publishes its reconstruction ``x`` of tokens ``[0, end)``."""
        if self.anchor is None:
            raise ValueError("XQuantCoordinator: no anchor layer set; call set_anchor first")
        if layer_idx != self.anchor:
            raise ValueError(
                f"XQuantCoordinator: layer {layer_idx} cannot publish; only the anchor "
                f"layer {self.anchor} publishes"
            )
        self._check_shape(x, start, end)
        self._range, self._layer, self._x = (start, end), layer_idx, x

    def read(self, layer_idx: int, start: int, end: int) -> mx.array:
        """The reconstruction of the layer before ``layer_idx`` for tokens ``[0, end)``."""
        if self._x is None:
            raise ValueError(
                f"XQuantCoordinator: layer {layer_idx} reads tokens [{start}, {end}) before "
                f"the anchor layer {self.anchor} published them"
            )
        if (start, end) != self._range:
            raise ValueError(
                f"XQuantCoordinator: layer {layer_idx} reads tokens [{start}, {end}) but "
                f"tokens [{self._range[0]}, {self._range[1]}) were published"
            )
        if layer_idx <= self._layer:
            raise ValueError(
                f"XQuantCoordinator: layer {layer_idx} reads after layer {self._layer}; "
                "layers must run in model order"
            )
        return self._x

    def pass_on(self, layer_idx: int, x: mx.array) -> None:
        """A reuser hands its own reconstruction to the next layer."""
        start, end = self._range
        self._check_shape(x, start, end)
        self._layer, self._x = layer_idx, x
        if layer_idx == self.last_layer:
            self.release()

    def release(self) -> None:
        """Drop the transient accumulator (the end of a forward pass)."""
        self._range = self._layer = self._x = None

    @staticmethod
    def _check_shape(x: mx.array, start: int, end: int) -> None:
        if not 0 <= start < end:
            raise ValueError(f"XQuantCoordinator: bad token range [{start}, {end})")
        if x.ndim != 3 or x.shape[1] != end:
            raise ValueError(
                f"XQuantCoordinator: expected [B, {end}, D] for tokens [0, {end}), got "
                f"{tuple(x.shape)}"
            )
