"""Real (allocator) vs declared bytes of every method, after prefill and after decode.

Usage (from the repository root):

    .venv/bin/python scripts/measure/retained_memory.py [--context 2048] [--steps 16]
        [--methods "none,affine:bits=4,..."] [--json out.json]

Same text and tokens as ``veloxquant bench`` (stdlib docstrings, ``eval.text.encode``),
the same prefill loop (chunks of 512) and teacher-forced decode steps, read through
``eval.memory.measure_retained``. Prints one Markdown row per method: real / declared
right after the prefill and after the decode steps, and real / fp16-equivalent.
"""

from __future__ import annotations

import argparse
import json

from veloxquant_mlx.eval.memory import measure_retained
from veloxquant_mlx.eval.perplexity import resolve_methods
from veloxquant_mlx.eval.text import encode, load_text
from veloxquant_mlx.integration.blas import ensure_fast_blas
from veloxquant_mlx.models import load

README_METHODS = (
    "none,affine:bits=4,affine:bits=8,kivi:bits=2,kivi:bits=4,streaming:window=508,"
    "snapkv:capacity=512,xkv:rank_k=384,rank_v=384,factor_bits=4,block=2048,"
    "xkv:rank_k=256,rank_v=256,factor_bits=4,block=1024,minicache,minicache:start_layer=22,"
    "xquant,xquant_cl"
)
DEFAULT_METHODS = "affine,kivi,streaming,snapkv,xkv"

MIB = 1024 * 1024


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--methods", default=f"{README_METHODS},{DEFAULT_METHODS}")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    ensure_fast_blas()
    methods = resolve_methods(args.methods, add_dense=False)
    model, tok = load()
    tokens = encode(tok, load_text())
    prompt = tokens[:args.context]
    forced = tokens[args.context:args.context + args.steps]
    print("| method | real MiB (prefill) | real/declared (prefill) | real MiB (decode) "
          "| real/declared (decode) | real/fp16 (decode) | residual MiB |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for m in methods:
        r = measure_retained(model, m.source, prompt, args.steps, args.chunk,
                             decode_tokens=forced)
        r["method"] = m.label
        rows.append(r)
        print(f"| {m.label} | {r['real_prefill_bytes'] / MIB:.2f} "
              f"| {r['real_over_declared_prefill']:.3f} | {r['real_decode_bytes'] / MIB:.2f} "
              f"| {r['real_over_declared_decode']:.3f} | {r['real_over_fp16_decode']:.3f} "
              f"| {r['residual_bytes'] / MIB:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
