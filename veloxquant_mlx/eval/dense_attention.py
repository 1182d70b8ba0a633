"""Attention over dense arrays: ``mx.fast.scaled_dot_product_attention`` against the
library's kernels (``ops.attention.attend_parts``), side by side in one run.

``python -m veloxquant_mlx.eval.dense_attention`` times both on the embedded model's
head shapes (9 query heads, 3 KV heads, head dim 64, float32) for decode steps and
prompt chunks, and says which one ``ops.attention.sdpa`` takes for each shape. This is
the measurement behind ``ops.attention.FAST_DECODE_KEYS``: on a CPU, MLX's softmax exponent is a
scalar loop, so its kernel loses wherever there are many scores.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from veloxquant_mlx.ops.attention import attend_parts, sdpa_on_own_kernels
from veloxquant_mlx.ops.parts import DensePart

# (queries, keys): decode steps around the threshold, a chat turn's prompt chunk over
# its history, whole prompt chunks.
SHAPES = ((1, 700), (1, 1024), (1, 2048), (1, 4096), (80, 780), (512, 512), (512, 3000))


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    mx.eval(fn())  # warm-up (compiles the exponent)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def compare(shapes: Sequence[tuple[int, int]] = SHAPES, heads: tuple[int, int] = (9, 3),
            head_dim: int = 64, layers: int = 8, repeats: int = 9) -> list[dict[str, Any]]:
    """Per ``(queries, keys)`` shape: ms per layer of each kernel (``layers`` independent
    layers per timed call, so the call's fixed cost is shared), their error and the
    kernel ``ops.attention.sdpa`` picks here."""
    Hq, H = heads
    rows = []
    for L, S in shapes:
        mask = "causal" if L > 1 else None
        qs = [mx.random.normal((1, Hq, L, head_dim)) for _ in range(layers)]
        kv = [(mx.random.normal((1, H, S, head_dim)), mx.random.normal((1, H, S, head_dim)))
              for _ in range(layers)]
        mx.eval(qs, kv)

        def fast(qs=qs, kv=kv, mask=mask) -> list[mx.array]:
            return [mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
                    for q, (k, v) in zip(qs, kv)]

        def own(qs=qs, kv=kv, mask=mask) -> list[mx.array]:
            return [attend_parts(q, [DensePart(k)], [DensePart(v)], 0.125, mask)
                    for q, (k, v) in zip(qs, kv)]

        a, b = _median_ms(fast, repeats) / layers, _median_ms(own, repeats) / layers
        err = mx.abs(fast()[0] - own()[0]).max().item()
        picks = sdpa_on_own_kernels(mx.float32, L, S)
        rows.append({"queries": L, "keys": S, "mx_fast_ms": a, "library_ms": b,
                     "speedup": a / b, "max_abs_err": err,
                     "sdpa_takes": "library" if picks else "mx.fast"})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| queries | keys | mx.fast ms | library ms | mx.fast / library | max abs err "
           "| sdpa takes |", "|---:|---:|---:|---:|---:|---:|---|"]
    out += [f"| {r['queries']} | {r['keys']} | {r['mx_fast_ms']:.3f} | {r['library_ms']:.3f} "
            f"| {r['speedup']:.2f} | {r['max_abs_err']:.1e} | {r['sdpa_takes']} |"
            for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: a whole number of timed calls >= 1")
    print(markdown(compare(repeats=args.repeats)))


if __name__ == "__main__":
    from veloxquant_mlx.apps.blas import ensure_fast_blas

    ensure_fast_blas()  # re-executes with a fast BLAS preloaded, before any work
    main()
