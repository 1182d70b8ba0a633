"""The README's main job: one prompt answered with the dense and the recommended
compressed cache, then what each really holds at a longer context, and its peak.

An application on the adapter alone (not a tool of ``eval``): the bytes a cache keeps
depend on how many tokens it holds, not on their text, so the memory table prefills
fixed token ids (as the server's memory probe does) instead of the evaluation corpus.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
import mlx_lm

from veloxquant_mlx.adapter.builder import KVCacheBuilder
from veloxquant_mlx.adapter.retained import (
    MLX_LM_CACHES,
    CacheSource,
    measure_retained,
    measure_user_path,
)
from veloxquant_mlx.apps.server_limits import probe_tokens
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.registry import recommended

QUESTION = "What is the capital of France?"


def answer(model: nn.Module, tokenizer: Any, config: KVCacheConfig,
           question: str = QUESTION, max_tokens: int = 40) -> str:
    """Greedy chat answer through caches built for ``config``."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True, tokenize=False)
    caches = KVCacheBuilder.for_model(model, config)
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens,
                           prompt_cache=caches).strip()


def memory_table(model: nn.Module, configs: list[CacheSource],
                 context: int) -> list[dict[str, Any]]:
    """Per config: real (allocator) and declared bytes after ``context`` tokens, and the
    peak over the weights on mlx_lm's own path (its 2048-token prompt step, 4 decode
    steps). A config is a ``KVCacheConfig`` or one of mlx_lm's own caches by name
    (``adapter.retained.MLX_LM_CACHES``)."""
    tokens = probe_tokens(model, context)
    rows = []
    for config in configs:
        source = MLX_LM_CACHES[config] if isinstance(config, str) else config
        name = config if isinstance(config, str) else config.to_string()
        m = measure_retained(model, source, tokens, decode_steps=0)
        peak = measure_user_path(model, source, tokens, decode_steps=4)
        rows.append({"method": name, "real_bytes": m["real_prefill_bytes"],
                     "held_bytes": m["declared_prefill_bytes"],
                     "fp16_bytes": m["fp16_prefill_bytes"],
                     "ratio": m["real_over_fp16_prefill"], "peak_bytes": peak["peak_bytes"],
                     "prefill_s": m["prefill_s"]})
    return rows


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2 ** 20:,.1f}"


def print_memory_table(rows: list[dict[str, Any]]) -> None:
    print("| cache | real MiB | declared MiB | real / fp16 | peak over the weights, MiB |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {_mib(r['real_bytes'])} | {_mib(r['held_bytes'])} | "
              f"{r['ratio']:.2f} | {_mib(r['peak_bytes'])} |")
    print("\n(real = bytes MLX's allocator keeps alive for the caches after the prompt; "
          "declared = what the caches report; peak = mx.get_peak_memory() over the prompt "
          "and 4 decode steps through mlx_lm's generate_step, minus the weights. Dense "
          "caches are float32 on a CPU, hence real/fp16 = 2.)")


def run_demo(method: str | None = None, context: int = 2048) -> int:
    """Print the answers of dense and ``method`` (default: the recommended one), then
    the memory table."""
    from veloxquant_mlx.models import load

    config = KVCacheConfig.from_string(method or recommended())
    dense = KVCacheConfig()
    print("Loading the embedded model (SmolLM2-135M-Instruct)...", flush=True)
    model, tokenizer = load()
    print(f"\nQ: {QUESTION}")
    for cfg in (dense, config):
        print(f"[{cfg.to_string()}] A: {answer(model, tokenizer, cfg)}", flush=True)

    print(f"\nKV-cache memory at {context} tokens of context (all {len(model.layers)} "
          "layers; two or three minutes on a CPU)...", flush=True)
    print_memory_table(memory_table(model, [dense, config], context))
    return 0
