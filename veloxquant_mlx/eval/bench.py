"""Speed and memory of each method at several context lengths, against dense.

For each context length and repeat, every method (order rotated per repeat, so drift
on a shared machine hits all alike) builds fresh caches, prefills ``context`` tokens
of text in chunks, then runs ``decode_steps`` teacher-forced decode steps, inside
:func:`veloxquant_mlx.eval.memory.measure_retained`. Speeds are medians over repeats,
reported as ratios to the dense ``none`` cache of the same context.

Memory: the real bytes the caches keep alive (MLX's allocator, after prefill and after
the decode steps) is the memory figure; the caches' declared ``held`` bytes, the
fp16-equivalent, MLX's peak memory and the process RSS are beside it. The real figure
is read at every repeat; ``real_spread_bytes`` (max - min over repeats) shows whether
it is stable.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .memory import CacheSource, measure_retained
from .perplexity import Method, Spec, check_model_context, resolve_methods


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def bench_once(model: nn.Module, tokens: Sequence[int], method: Method | CacheSource,
               context: int, decode_steps: int, chunk: int = 512) -> dict[str, Any]:
    """One prefill + decode run through fresh caches; times and memory."""
    source = method.source if isinstance(method, Method) else method
    mx.reset_peak_memory()
    out = measure_retained(model, source, tokens[:context], decode_steps, chunk,
                           decode_tokens=tokens[context:context + decode_steps])
    out.update(
        prefill_tok_s=context / out["prefill_s"],
        decode_tok_s=decode_steps / out["decode_s"] if decode_steps else float("nan"),
        peak_mem_bytes=mx.get_peak_memory(),
        rss_bytes=_rss(),
    )
    return out


def bench_methods(model: nn.Module, tokens: Sequence[int], specs: Sequence[Spec] | str,
                  contexts: Sequence[int] = (512, 2048, 4096), decode_steps: int = 32,
                  repeats: int = 3, chunk: int = 512,
                  progress: bool = False) -> list[dict[str, Any]]:
    """One row per (method, context): real and declared memory, speed, ratios to dense."""
    from tqdm.auto import tqdm

    methods = resolve_methods(specs)
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is not allowed: an integer >= 1")
    need = max(contexts) + decode_steps
    check_model_context(model, need, "context + decode steps")
    if len(tokens) < need:
        raise ValueError(f"the text has {len(tokens)} tokens: bench needs {need} "
                         "(largest context + decode steps); pass a longer --text")
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(contexts) * repeats * len(methods), disable=not progress,
               desc="bench", leave=False)
    for context in contexts:
        runs: dict[str, list[dict[str, Any]]] = {m.label: [] for m in methods}
        for rep in range(repeats):
            k = rep % len(methods)
            for m in methods[k:] + methods[:k]:
                runs[m.label].append(bench_once(model, tokens, m, context, decode_steps,
                                                chunk))
                bar.update(1)
        block = [_summarize(m, context, decode_steps, runs[m.label]) for m in methods]
        for r in block:
            r["prefill_ratio"] = r["prefill_tok_s"] / block[0]["prefill_tok_s"]
            r["decode_ratio"] = r["decode_tok_s"] / block[0]["decode_tok_s"]
        rows.extend(block)
    bar.close()
    return rows


def _summarize(method: Method, context: int, decode_steps: int,
               runs: list[dict[str, Any]]) -> dict[str, Any]:
    last = runs[-1]
    real = [r["real_decode_bytes"] for r in runs]
    return {
        "method": method.label,
        "config": method.config_dict(),
        "context": context,
        "decode_steps": decode_steps,
        "repeats": len(runs),
        "real_bytes": last["real_prefill_bytes"],
        "real_decode_bytes": last["real_decode_bytes"],
        "real_spread_bytes": max(real) - min(real),
        "held_bytes": last["declared_prefill_bytes"],
        "held_decode_bytes": last["declared_decode_bytes"],
        "accounted_bytes": last["accounted_prefill_bytes"],
        "fp16_bytes": last["fp16_prefill_bytes"],
        "mem_ratio": last["real_over_fp16_prefill"],
        "mem_ratio_decode": last["real_over_fp16_decode"],
        "declared_ratio": last["declared_over_fp16_prefill"],
        "real_over_declared": last["real_over_declared_prefill"],
        "real_over_declared_decode": last["real_over_declared_decode"],
        "residual_bytes": max(r["residual_bytes"] for r in runs),
        "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in runs),
        "rss_bytes": max(r["rss_bytes"] for r in runs),
        "runs": runs,
    }
