"""Microseconds of the casts and dequantizations behind a streaming / affine decode step.

Times float16 / bfloat16 -> float32 casts of a [1, 3, 1024, 64] window (196k values)
against a float32 copy, and 4/8-bit dequantization of [1, 3, 2048, 64] keys
(``dequantize``, ``dequantize_unpacked`` and two compiled unpacking variants).

    python scripts/measure/streaming/prims.py [--n N] [--reps R]
"""

import argparse
import statistics
import time

import mlx.core as mx

from veloxquant_mlx.ops import quantize as q


def bench(f, n: int, reps: int) -> float:
    for _ in range(3):
        mx.eval(f())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            mx.eval(f())
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=60, help="calls per repeat")
    p.add_argument("--reps", type=int, default=5, help="repeats (median taken)")
    args = p.parse_args()

    def b(f):
        return bench(f, args.n, args.reps)

    x32 = mx.random.normal((1, 3, 1024, 64))
    x16 = x32.astype(mx.float16)
    xb = x32.astype(mx.bfloat16)
    mx.eval(x16, xb)
    res = {}
    res["f16->f32"] = b(lambda: x16.astype(mx.float32))
    res["bf16->f32"] = b(lambda: xb.astype(mx.float32))
    res["bf16 shift"] = b(lambda: (xb.view(mx.uint16).astype(mx.uint32) << 16).view(mx.float32))
    res["f32 copy"] = b(lambda: x32 + 0)
    cast = mx.compile(lambda a: a.astype(mx.float32), shapeless=True)
    res["f16 compiled"] = b(lambda: cast(x16))
    k32 = mx.random.normal((1, 3, 2048, 64))
    for bits in (4, 8):
        qk = q.quantize(k32, bits, 64)
        mx.eval(qk.arrays)
        shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
        mask = (1 << bits) - 1

        def unpack(codes, s, bias, shifts, mask=mask):
            return ((codes >> shifts) & mask).astype(mx.float32) * s + bias

        def unpack_cast(codes, s, bias, shifts, mask=mask):
            return (((codes >> shifts) & mask).astype(mx.float32) * s.astype(mx.float32)
                    + bias.astype(mx.float32))

        def run(fn, qk=qk, shifts=shifts):
            B, H, n, W = qk.codes.shape
            G = qk.scales.shape[-1]
            c = qk.codes.reshape(B, H, n, G, W // G, 1)
            s = qk.scales.reshape(B, H, n, G, 1, 1)
            bias = qk.biases.reshape(B, H, n, G, 1, 1)
            return fn(c, s, bias, shifts).reshape(B, H, n, 64)

        f = mx.compile(unpack)
        fs = mx.compile(unpack_cast, shapeless=True)
        res[f"deq{bits}"] = b(lambda qk=qk: q.dequantize(qk))
        res[f"unp{bits}"] = b(lambda qk=qk: q.dequantize_unpacked(qk))
        res[f"compiled{bits}"] = b(lambda run=run, f=f: run(f))
        res[f"compiled_shapeless{bits}"] = b(lambda run=run, fs=fs: run(fs))
        assert mx.array_equal(run(fs), q.dequantize(qk)).item()
    for k, v in res.items():
        print(f"{k:22s} {v:8.0f} us")


if __name__ == "__main__":
    main()
