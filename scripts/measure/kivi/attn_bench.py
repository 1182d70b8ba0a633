"""Decode-step attention of one KIVI layer at 2048 tokens: the attention paths compared.

Builds one ``KIVICache`` per bit width, prefills 4 x 512 random tokens, then times one
query (9 query heads / 3 KV heads, head_dim 64) through: dequantize + concatenate +
sdpa, the split attention with unpacked dequantization, the split attention on the
packed codes (``mx.quantized_matmul``), and dense sdpa on float32 K/V (reference).
Median of ``steps`` calls, microseconds per layer-step.

    python scripts/measure/kivi/attn_bench.py [--steps N]
"""

import argparse
import statistics
import time

import mlx.core as mx

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.base import LayerInfo
from veloxquant_mlx.cache.kivi import KIVICache
from veloxquant_mlx.integration.mlx_lm import install_attention_routing
from veloxquant_mlx.ops.attention import sdpa


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="timed calls per path")
    args = p.parse_args()

    install_attention_routing()
    mx.random.seed(0)
    for bits in (2, 4):
        c = KIVICache(KVCacheConfig(method="kivi", bits=bits), LayerInfo(n_kv_heads=3, head_dim=64))
        for _ in range(4):
            k, v = mx.random.normal((1, 3, 512, 64)), mx.random.normal((1, 3, 512, 64))
            c.update_and_fetch(k, v)
            c.attend(mx.random.normal((1, 9, 512, 64)), 0.125, "causal")
        mx.eval(c.state)
        q = mx.random.normal((1, 9, 1, 64))
        dk, dv = c.dense_kv()
        mx.eval(dk, dv)
        paths = {
            "dequant+concat+sdpa": lambda c=c, q=q: sdpa(q, *c.dense_kv(q.dtype), 0.125, None),
            "split, unpacked dequant": lambda c=c, q=q: c._attend_split(q, 0.125, None, False),
            "split, packed qmm": lambda c=c, q=q: c._attend_split(q, 0.125, None, True),
            "dense sdpa (fp32 K/V)": lambda q=q, dk=dk, dv=dv: sdpa(q, dk, dv, 0.125, None),
        }
        for name, fn in paths.items():
            for _ in range(20):
                mx.eval(fn())
            ts = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                mx.eval(fn())
                ts.append(time.perf_counter() - t0)
            print(f"bits={bits} {name}: median {statistics.median(ts) * 1e6:.0f} us per layer-step")


if __name__ == "__main__":
    main()
