"""One layer's decode step (update_and_fetch + attend) at 2048 tokens, as a ratio to dense.

Builds one cache per spec with ``LayerInfo(n_kv_heads=3, head_dim=64)``, prefills 2048
random tokens in chunks of 512 (``update_and_fetch`` + ``attend`` with ``"causal"``),
then times single-token steps, rotating the order of the caches every repeat.

Run from the repository root (the package on PYTHONPATH decides which version is timed):
    PYTHONPATH=. python scripts/measure/decode/micro.py [reps] [steps] [names,...]
"""

import argparse
import statistics
import time

import mlx.core as mx

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import LayerInfo
from veloxquant_mlx.integration.mlx_lm import install_attention_routing
from veloxquant_mlx.registry import get_method

B, H, HQ, D, CTX = 1, 3, 9, 64, 2048
SCALE = D**-0.5

SPECS = {
    "dense": "none",
    "affine4": "affine:bits=4",
    "affine8": "affine:bits=8",
    "affine4_w64": "affine:bits=4,window=64",
    "affine4_qmm": "affine:bits=4",
    "affine8_qmm": "affine:bits=8",
    "streaming": "streaming",
    "streaming_bf16": "streaming:window_dtype=bfloat16",
    "streaming_f32": "streaming:window_dtype=float32",
    "snapkv": "snapkv",
    "snapkv_f32": "snapkv:window_dtype=float32",
}


def attend(c, q, k, v, mask):
    rk, rv = c.update_and_fetch(k, v)
    if hasattr(c, "attend"):
        return c.attend(q, SCALE, mask)
    return mx.fast.scaled_dot_product_attention(q, rk, rv, scale=SCALE, mask=mask)


def make(name: str, spec: str):
    cfg = KVCacheConfig.from_string(spec)
    c = get_method(cfg.method)(cfg, LayerInfo(n_kv_heads=H, head_dim=D))
    # The "_qmm" rows time the packed quantized-matmul path of the affine cache.
    if name.endswith("_qmm"):
        c.use_quantized_matmul = True
    elif name.startswith("affine"):
        c.use_quantized_matmul = False
    for _ in range(0, CTX, 512):
        k = mx.random.normal((B, H, 512, D))
        v = mx.random.normal((B, H, 512, D))
        q = mx.random.normal((B, HQ, 512, D))
        mx.eval(attend(c, q, k, v, "causal"), c.state)
    return c


def step(c, k, v, q) -> None:
    mx.eval(attend(c, q, k, v, None))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reps", nargs="?", type=int, default=5)
    p.add_argument("steps", nargs="?", type=int, default=40)
    p.add_argument("names", nargs="?", default=None,
                   help=f"comma-separated subset of {','.join(SPECS)} (dense is always run)")
    args = p.parse_args()
    specs = SPECS
    if args.names:
        specs = {k: v for k, v in SPECS.items() if k == "dense" or k in args.names.split(",")}

    install_attention_routing()
    caches = {name: make(name, spec) for name, spec in specs.items()}
    ks = mx.random.normal((args.steps, B, H, 1, D))
    vs = mx.random.normal((args.steps, B, H, 1, D))
    qs = mx.random.normal((args.steps, B, HQ, 1, D))
    mx.eval(ks, vs, qs)
    for c in caches.values():  # warm up (snapkv compresses here)
        step(c, ks[0], vs[0], qs[0])
    names = list(caches)
    times = {n: [] for n in names}
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for n in order:
            c = caches[n]
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(c, ks[i], vs[i], qs[i])
            times[n].append((time.perf_counter() - t0) / args.steps)
    ref = statistics.median(times["dense"])
    for n in names:
        med = statistics.median(times[n])
        c = caches[n]
        print(f"{n:12s} {med * 1e6:8.0f} us/step  ratio(dense/this)={ref / med:5.2f}  "
              f"held={c.nbytes} acc={c.accounted_bytes()} tokens={c.offset}")


if __name__ == "__main__":
    main()
