"""Decode time of one attention layer (layer 3 of the embedded model) at 2048 context.

Dense ``KVCache`` vs one spec's cache, both prefilled with the same 2048 random hidden
states in chunks of 512, then one decode call each, interleaved in the same process
(3 x 10 calls, the cache trimmed back after each); prints the median ms of each and the
ratio. The package on PYTHONPATH decides which version is timed.

    python scripts/measure/xquant/layer2.py SPEC          # e.g. xquant
"""

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

import veloxquant_mlx
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.builder import KVCacheBuilder
from veloxquant_mlx.models import load

S, LAYER = 2048, 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", help="a method spec, e.g. xquant or xquant:xquant_latent=false")
    spec = p.parse_args().spec

    model, _ = load()
    attn = model.layers[LAYER].self_attn
    mx.random.seed(0)
    xs = mx.random.normal((1, S + 1, 576))
    dense = KVCache()
    for s in range(0, S, 512):
        mx.eval(attn(xs[:, s:s + 512], mask="causal", cache=dense))
    xc = KVCacheBuilder.for_model(model, KVCacheConfig.from_string(spec))[LAYER]
    for s in range(0, S, 512):
        mx.eval(attn(xs[:, s:s + 512], mask="causal", cache=xc))
    res = {"dense": [], spec: []}
    for _ in range(3):
        for name, c in (("dense", dense), (spec, xc)):
            for _ in range(10):
                t = time.perf_counter()
                mx.eval(attn(xs[:, S:], mask=None, cache=c))
                res[name].append((time.perf_counter() - t) * 1e3)
                c.trim(1)
    d, x = statistics.median(res["dense"]), statistics.median(res[spec])
    where = veloxquant_mlx.__file__.split("/veloxquant_mlx")[0]
    print(f"{where:>16s} {spec:28s} dense {d:6.2f} ms  x {x:7.2f} ms  ratio {x / d:5.2f}")


if __name__ == "__main__":
    main()
