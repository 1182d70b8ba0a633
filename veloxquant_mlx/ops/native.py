"""The fused CPU decode attention (``csrc/parts.cpp``), when it is built.

On a CPU, the decode path of :func:`ops.attention.attend_parts` costs about a hundred
MLX ops per layer over a compressed cache, each a few microseconds and a pass over
memory. The extension does the whole decode attention of a layer in one op: scores of
every key part, softmax, product with every value part, the codes unpacked a few words
at a time (no float copy of a store). ``scripts/build_native.sh`` builds it (``make
test`` and ``make demo`` do, through ``scripts/setup.sh``); without it, or with
``VELOXQUANT_NATIVE=0``, attention runs on MLX's ops as before: the same results within
float tolerance, slower on a CPU. It is a CPU kernel: on a GPU backend MLX's ops run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from veloxquant_mlx.ops.kernels import on_gpu

ENV = "VELOXQUANT_NATIVE"
# Threads of one op over a long store (heads split between them): 2 measured 2-4% faster
# per decode step of the embedded model at 4096 tokens on 2 cores; short stores keep one
# (starting a thread costs tens of microseconds).
THREADS = min(2, os.cpu_count() or 1)
THREADED_KEYS = 2048

KIND = {"dense": 0, "token": 1, "channel": 2}


def _load() -> tuple[Any, str]:
    """The extension and why it is not usable (empty when it is)."""
    try:  # built in place by scripts/build_native.sh
        from veloxquant_mlx.ops import _native as ext  # type: ignore[attr-defined]
    except ImportError:
        return None, "not built: bash scripts/build_native.sh"
    # An MLX built with another nanobind ABI would refuse mx.array arguments.
    try:
        one = mx.ones((1, 1, 1, 4))
        codes = mx.zeros((1, 1, 1, 1), dtype=mx.uint32)
        mx.eval(ext.decode_attention(one, [codes, one[..., :1], one[..., :1], one], [
            KIND["token"], 8, 4, 1, 0, KIND["dense"], 0, 0, 0, 0], 1, 1))
    except (TypeError, ValueError, RuntimeError) as e:
        return None, f"built for another MLX ({e.__class__.__name__}): rebuild with " \
                     "bash scripts/build_native.sh"
    return ext, ""


_native, _why = _load()


def available() -> bool:
    """Whether the extension is built and not switched off (``VELOXQUANT_NATIVE=0``)."""
    return _native is not None and os.environ.get(ENV, "1") != "0"


def status() -> str:
    """One line for reports: whether decode attention runs fused, and why not."""
    if _native is None:
        return f"MLX ops (the fused CPU kernel is {_why})"
    if not available():
        return f"MLX ops ({ENV}=0)"
    return "fused CPU kernel (csrc/parts.cpp)"


def _described(parts: Sequence[Any]) -> tuple[list[int], list[mx.array]] | None:
    spec: list[int] = []
    arrays: list[mx.array] = []
    for p in parts:
        stored = getattr(p, "stored", None)
        form = stored() if stored is not None else None
        if form is None:
            return None
        kind, bits, group, arrs, biases, table = form
        spec += [KIND[kind], bits, group, int(biases is not None), int(table is not None)]
        arrays += [*arrs, *([biases] if biases is not None else []),
                   *([table] if table is not None else [])]
    return spec, arrays


def usable(dtype: mx.Dtype) -> bool:
    """Whether the kernel can run for queries of ``dtype`` here: built, on, a CPU,
    float32."""
    return available() and dtype == mx.float32 and not on_gpu()


def reads(dtype: mx.Dtype, keys: Sequence[Any], values: Sequence[Any]) -> bool:
    """Whether every part's stored form is one the kernel reads, for queries of
    ``dtype`` on this backend (:func:`decode` still leaves dense-only parts to MLX)."""
    return (usable(dtype) and _described(keys) is not None
            and _described(values) is not None)


def _plan(dtype: mx.Dtype, keys: Sequence[Any], values: Sequence[Any]
          ) -> tuple[tuple[list[int], list[mx.array]], tuple[list[int], list[mx.array]]] | None:
    if not usable(dtype):
        return None
    k, v = _described(keys), _described(values)
    # Over dense parts only, MLX's matmuls (BLAS) are faster.
    if k is None or v is None or all(kind == KIND["dense"] for kind in k[0][::5]):
        return None
    return k, v


def decode(q: mx.array, keys: Sequence[Any], values: Sequence[Any]) -> mx.array | None:
    """Softmax attention of scaled queries ``q`` ``[B, H, rows, D]`` (float32) over the
    key and value parts, normalized, ``[B, H, rows, Dv]``; ``None`` where the extension
    is off or a part's stored form is not one it reads (then MLX's ops run)."""
    plan = _plan(q.dtype, keys, values)
    if plan is None:
        return None
    k, v = plan
    long = q.shape[0] * q.shape[1] > 1 and sum(p.n for p in keys) >= THREADED_KEYS
    return _native.decode_attention(q, k[1] + v[1], k[0] + v[0], len(keys),
                                    THREADS if long else 1)
