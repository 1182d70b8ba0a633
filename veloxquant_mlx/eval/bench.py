"""Speed and memory of each method at several context lengths, against dense.

For each context length and repeat, every method (order rotated per repeat, so drift
on a shared machine hits all alike) builds fresh caches, prefills ``context`` tokens
of text in chunks, then runs ``decode_steps`` teacher-forced decode steps. Speeds are
medians over repeats, reported as ratios to the dense ``none`` cache of the same
context. Memory: bytes held by the caches (``cache_stats``), the method's own
accounting, the fp16-equivalent, MLX's peak memory and the process RSS.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..builder import KVCacheBuilder, cache_stats
from ..config import KVCacheConfig
from .perplexity import Spec, check_model_context, parse_specs


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def bench_once(model: nn.Module, tokens: Sequence[int], config: KVCacheConfig, context: int,
               decode_steps: int, chunk: int = 512) -> dict[str, Any]:
    """One prefill + decode run through fresh caches; times and memory."""
    mx.reset_peak_memory()
    caches = KVCacheBuilder.for_model(model, config)
    prompt = mx.array(list(tokens[:context]))
    t0 = time.perf_counter()
    for start in range(0, context, chunk):
        logits = model(prompt[None, start:start + chunk], cache=caches)
        mx.eval(logits, [c.state for c in caches])
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(decode_steps):
        mx.eval(model(mx.array([[tokens[context + i]]]), cache=caches))
    decode_s = time.perf_counter() - t0
    out = {
        "prefill_tok_s": context / prefill_s,
        "decode_tok_s": decode_steps / decode_s if decode_steps else float("nan"),
        "peak_mem_bytes": mx.get_peak_memory(),
        "rss_bytes": _rss(),
    }
    out.update(cache_stats(caches))
    return out


def bench_methods(model: nn.Module, tokens: Sequence[int], specs: Sequence[Spec] | str,
                  contexts: Sequence[int] = (512, 2048, 4096), decode_steps: int = 32,
                  repeats: int = 3, chunk: int = 512,
                  progress: bool = False) -> list[dict[str, Any]]:
    """One row per (method, context): memory and speed, with ratios to dense."""
    from tqdm.auto import tqdm

    parsed = parse_specs(specs)
    if not any(cfg.method == "none" for _, cfg in parsed):
        parsed.insert(0, ("none", KVCacheConfig(method="none")))
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is not allowed: an integer >= 1")
    need = max(contexts) + decode_steps
    check_model_context(model, need, "context + decode steps")
    if len(tokens) < need:
        raise ValueError(f"the text has {len(tokens)} tokens: bench needs {need} "
                         "(largest context + decode steps); pass a longer --text")
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(contexts) * repeats * len(parsed), disable=not progress,
               desc="bench", leave=False)
    for context in contexts:
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in parsed}
        for rep in range(repeats):
            k = rep % len(parsed)
            for label, cfg in parsed[k:] + parsed[:k]:
                runs[label].append(bench_once(model, tokens, cfg, context, decode_steps, chunk))
                bar.update(1)
        block = [_summarize(label, cfg, context, decode_steps, runs[label])
                 for label, cfg in parsed]
        ref = next(r for r in block if r["config"]["method"] == "none")
        for r in block:
            r["prefill_ratio"] = r["prefill_tok_s"] / ref["prefill_tok_s"]
            r["decode_ratio"] = r["decode_tok_s"] / ref["decode_tok_s"]
        rows.extend(block)
    bar.close()
    return rows


def _summarize(label: str, cfg: KVCacheConfig, context: int, decode_steps: int,
               runs: list[dict[str, Any]]) -> dict[str, Any]:
    last = runs[-1]
    held = last["held_bytes"]
    return {
        "method": label,
        "config": cfg.to_dict(),
        "context": context,
        "decode_steps": decode_steps,
        "repeats": len(runs),
        "held_bytes": held,
        "accounted_bytes": last["accounted_bytes"],
        "fp16_bytes": last["fp16_bytes"],
        "mem_ratio": last["ratio"],
        "accounted_over_held": last["accounted_bytes"] / held if held else float("nan"),
        "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in runs),
        "rss_bytes": max(r["rss_bytes"] for r in runs),
    }
