"""The README's main job: one prompt answered with the dense and a compressed cache,
and the cache bytes each one really holds at a longer context."""

from __future__ import annotations

import time

import mlx.core as mx
import mlx_lm

from .builder import KVCacheBuilder, cache_stats
from .config import KVCacheConfig

QUESTION = "What is the capital of France?"


def prefill(model, tokens: mx.array, caches: list, chunk: int = 512) -> None:
    """Run ``tokens`` [T] through the model into ``caches`` in chunks, as mlx_lm does."""
    for start in range(0, tokens.shape[0], chunk):
        model(tokens[None, start:start + chunk], cache=caches)
        mx.eval([c.state for c in caches])


def answer(model, tokenizer, config: KVCacheConfig, question: str = QUESTION,
           max_tokens: int = 40) -> str:
    """Greedy chat answer through caches built for ``config``."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True, tokenize=False)
    caches = KVCacheBuilder.for_model(model, config)
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens,
                           prompt_cache=caches).strip()


def memory_table(model, tokenizer, configs: list[KVCacheConfig], context: int) -> list[dict]:
    """Held / accounted / fp16-equivalent bytes of every config after ``context`` tokens."""
    from .eval.text import stdlib_text

    # About 4 characters per token: encode only a prefix that surely covers the context.
    tokens = mx.array(tokenizer.encode(stdlib_text()[: context * 12])[:context])
    if tokens.shape[0] < context:
        raise ValueError(f"the demo text has only {tokens.shape[0]} tokens, fewer than "
                         f"context={context}")
    rows = []
    for config in configs:
        caches = KVCacheBuilder.for_model(model, config)
        t0 = time.perf_counter()
        prefill(model, tokens, caches)
        s = cache_stats(caches)
        s.update(method=describe(config), prefill_s=time.perf_counter() - t0)
        rows.append(s)
    return rows


def describe(config: KVCacheConfig) -> str:
    """Short label: the method and the options that differ from the defaults."""
    defaults = KVCacheConfig().to_dict()
    opts = [f"{k}={v}" for k, v in config.to_dict().items()
            if k != "method" and v != defaults[k]]
    return config.method + (":" + ",".join(opts) if opts else "")


def run_demo(method: str = "affine:bits=4", context: int = 1024) -> int:
    from .models import load

    config = KVCacheConfig.from_string(method)
    dense = KVCacheConfig()
    print("Loading the embedded model (SmolLM2-135M-Instruct)...", flush=True)
    model, tokenizer = load()
    print(f"\nQ: {QUESTION}")
    for cfg in (dense, config):
        print(f"[{describe(cfg)}] A: {answer(model, tokenizer, cfg)}", flush=True)

    print(f"\nKV-cache bytes after {context} tokens of context (all {len(model.layers)} layers):")
    rows = memory_table(model, tokenizer, [dense, config], context)
    print("| method | held bytes | accounted bytes | fp16-equivalent bytes | held / fp16 |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['held_bytes']:,} | {r['accounted_bytes']:,} | "
              f"{r['fp16_bytes']:,} | {r['ratio']:.3f} |")
    print("\n(held = bytes of the arrays each cache really holds; the dense reference keeps "
          "float32 on CPU, hence a ratio above 1)")
    return 0
