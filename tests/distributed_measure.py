"""Per-rank memory, speed and quality of compressed caches, in one process or per rank.

    python tests/distributed_measure.py --context 1024 --methods "none;kivi:bits=4"
    mlx.launch --backend ring -n 3 --python .venv/bin/python -- \\
        "$PWD/tests/distributed_measure.py" --context 1024 --methods "none;kivi:bits=4"

For each method (specs separated by ``;``): prefill ``--context`` tokens of the default
evaluation text (chunks of 512), then the bytes MLX keeps alive for the caches (and what
a method installs on the model), the next ``--score`` tokens scored in one chunk (mean
negative log-likelihood), and ``--decode`` single-token steps timed. Every rank writes
its JSON line to stderr; rank 0 prints the table (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

from veloxquant_mlx.apps.blas import ensure_fast_blas

ensure_fast_blas()

import mlx.core as mx  # noqa: E402

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig  # noqa: E402
from veloxquant_mlx.adapter.builder import cache_stats  # noqa: E402
from veloxquant_mlx.adapter.prefill import prefill  # noqa: E402
from veloxquant_mlx.apps import distributed as dist  # noqa: E402
from veloxquant_mlx.eval.text import encode, load_text  # noqa: E402


def quiet_memory() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def measure(model: Any, tokens: list[int], config: KVCacheConfig, context: int, score: int,
            decode: int) -> dict[str, Any]:
    KVCacheBuilder.detach(model)
    base = quiet_memory()
    caches = KVCacheBuilder.for_model(model, config)
    start = time.perf_counter()
    prefill(model, caches, tokens[:context], 512, last_alone=False)
    prefill_s = time.perf_counter() - start
    retained = quiet_memory() - base
    held = cache_stats(caches)["held_bytes"]
    chunk = mx.array([tokens[context:context + score]])
    logits = model(chunk, cache=caches)[0, :-1].astype(mx.float32)
    target = mx.array(tokens[context + 1:context + score])
    nll = (mx.logsumexp(logits, axis=-1) - mx.take_along_axis(
        logits, target[:, None], axis=-1)[:, 0]).mean().item()
    start = time.perf_counter()
    for i in range(decode):
        mx.eval(model(mx.array([[tokens[context + score + i]]]), cache=caches))
    decode_s = time.perf_counter() - start
    out = {"method": config.to_string(), "retained": retained, "held": held, "nll": nll,
           "prefill_tok_s": context / prefill_s, "decode_tok_s": decode / decode_s}
    del caches, logits
    KVCacheBuilder.detach(model)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--methods", default="none;kivi:bits=4")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--score", type=int, default=128)
    p.add_argument("--decode", type=int, default=16)
    args = p.parse_args()
    model, tokenizer = dist.load_for_ranks(args.model, args)
    group = dist.world()
    rank, size = (group.rank(), group.size()) if group else (0, 1)
    tokens = encode(tokenizer, load_text(None))[:args.context + args.score + args.decode]
    rows = []
    for spec in filter(None, (s.strip() for s in args.methods.split(";"))):
        row = measure(model, tokens, KVCacheConfig.from_string(spec), args.context,
                      args.score, args.decode)
        row.update(rank=rank, size=size)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    print(f"| method | ranks | retained KV per rank (MiB) | held (MiB) | NLL next {args.score} "
          "| prefill tok/s | decode tok/s |\n|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| `{r['method']}` | {size} | {r['retained'] / 2**20:.2f} | "
              f"{r['held'] / 2**20:.2f} | {r['nll']:.3f} | {r['prefill_tok_s']:.0f} | "
              f"{r['decode_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
