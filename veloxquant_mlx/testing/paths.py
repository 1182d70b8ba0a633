"""Every computing path on the same cache state: a shadow run per transformer block.

A cache's attention can be computed by the fused CPU extension (``ops.native``), by
MLX's ops reading packed codes with ``mx.quantized_matmul`` (what Metal and CUDA run)
or by MLX's ops reading codes as float blocks. Comparing whole-model outputs of two
paths mixes two things: the paths' own difference (float rounding, ~1e-6) and the
method's sensitivity to it, since a method that codes the tokens it attends re-rounds
every later layer's keys from slightly different inputs (a 4-bit code flips on a 1e-6
change; measured on the embedded model, a 2^-20 relative change of the embeddings moved
``affine:bits=4`` by 5.6 nats on MLX's ops alone).

``shadow_paths`` separates them: each block of the model runs on deep copies of its
cache under every other path, then on the real cache under the primary path, so all
paths see the same stored codes and the same input; the largest relative difference of
each block's output is recorded. A path that reads a code, a scale or a mask wrongly
shows up at once, in the block where it happens.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.adapter.mlx_lm import model_layers
from veloxquant_mlx.ops import dispatch

# Each path as the environment that selects it (``ops.dispatch.FORCING``).
PATHS: dict[str, dict[str, str]] = dispatch.FORCING


def on_path(name: str) -> AbstractContextManager[None]:
    """Run the body on path ``name`` (its environment set, then restored)."""
    return dispatch.forcing(name)


@dataclass
class Shadow:
    """Per block call: the query length and each other path's relative difference."""

    primary: str
    others: list[str]
    calls: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    def worst(self) -> float:
        return max((d for _, ds in self.calls for d in ds.values()), default=0.0)


def _relative(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-30)).item()


@contextmanager
def shadow_paths(model: nn.Module, primary: str = "fused",
                 others: tuple[str, ...] = ("packed", "floats")) -> Iterator[Shadow]:
    """While active, every call of ``model``'s transformer blocks also runs on copies of
    its cache under ``others``; the model's output is the ``primary`` path's."""
    shadow = Shadow(primary, list(others))
    block_types = {type(b) for b in model_layers(model)}
    originals = {t: t.__call__ for t in block_types}

    def call(self: nn.Module, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        base = originals[type(self)]
        outs = {}
        for name in others:
            args_c, kwargs_c = copy.deepcopy((args, kwargs))
            with on_path(name):
                outs[name] = base(self, x, *args_c, **kwargs_c)
                mx.eval(outs[name])
        with on_path(primary):
            out = base(self, x, *args, **kwargs)
            mx.eval(out)
        shadow.calls.append((x.shape[1], {n: _relative(o, out) for n, o in outs.items()}))
        return out

    for t in block_types:
        t.__call__ = call
    try:
        yield shadow
    finally:
        for t, f in originals.items():
            t.__call__ = f
