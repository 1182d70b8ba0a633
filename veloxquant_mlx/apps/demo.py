"""The README's main job: one prompt answered with the dense and a compressed cache,
and the cache bytes each one really holds at a longer context.

An application on the adapter alone (not a tool of ``eval``): the bytes a cache keeps
depend on how many tokens it holds, not on their text, so the memory table prefills
fixed token ids (as the server's memory probe does) instead of the evaluation corpus.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
import mlx_lm

from veloxquant_mlx.adapter.builder import KVCacheBuilder
from veloxquant_mlx.adapter.retained import measure_retained
from veloxquant_mlx.apps.server_limits import probe_tokens
from veloxquant_mlx.config import KVCacheConfig

QUESTION = "What is the capital of France?"


def answer(model: nn.Module, tokenizer: Any, config: KVCacheConfig,
           question: str = QUESTION, max_tokens: int = 40) -> str:
    """Greedy chat answer through caches built for ``config``."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True, tokenize=False)
    caches = KVCacheBuilder.for_model(model, config)
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens,
                           prompt_cache=caches).strip()


def memory_table(model: nn.Module, configs: list[KVCacheConfig],
                 context: int) -> list[dict[str, Any]]:
    """Real (allocator) and declared bytes of every config after ``context`` tokens."""
    tokens = probe_tokens(model, context)
    rows = []
    for config in configs:
        m = measure_retained(model, config, tokens, decode_steps=0)
        rows.append({"method": config.to_string(), "real_bytes": m["real_prefill_bytes"],
                     "held_bytes": m["declared_prefill_bytes"],
                     "fp16_bytes": m["fp16_prefill_bytes"],
                     "ratio": m["real_over_fp16_prefill"], "prefill_s": m["prefill_s"]})
    return rows


def run_demo(method: str = "affine:bits=4", context: int = 1024) -> int:
    """Print the answers and the memory table of dense and ``method``."""
    from veloxquant_mlx.models import load

    config = KVCacheConfig.from_string(method)
    dense = KVCacheConfig()
    print("Loading the embedded model (SmolLM2-135M-Instruct)...", flush=True)
    model, tokenizer = load()
    print(f"\nQ: {QUESTION}")
    for cfg in (dense, config):
        print(f"[{cfg.to_string()}] A: {answer(model, tokenizer, cfg)}", flush=True)

    print(f"\nKV-cache bytes after {context} tokens of context (all {len(model.layers)} layers):")
    rows = memory_table(model, [dense, config], context)
    print("| method | real bytes | declared bytes | fp16-equivalent bytes | real / fp16 |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['real_bytes']:,} | {r['held_bytes']:,} | "
              f"{r['fp16_bytes']:,} | {r['ratio']:.3f} |")
    print("\n(real = bytes MLX's allocator keeps alive for the caches after the prefill; "
          "declared = what the caches report; the dense reference keeps float32 on CPU, "
          "hence a ratio above 1)")
    return 0
