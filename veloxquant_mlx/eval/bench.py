"""Speed and memory of each method at several context lengths, against dense.

For each context length and repeat, every method (order rotated per repeat, so drift
on a shared machine hits all alike) builds fresh caches, prefills ``context`` tokens
of text in chunks, then runs ``decode_steps`` teacher-forced decode steps, inside
:func:`veloxquant_mlx.adapter.retained.measure_retained`. Speeds are medians over repeats,
reported as ratios to the dense ``none`` cache of the same context.

Memory: the real bytes the caches keep alive (MLX's allocator, after prefill and after
the decode steps) is the memory figure; the caches' declared ``held`` bytes, the
fp16-equivalent, MLX's peak memory and the process RSS are beside it. The real figure
is read at every repeat; ``real_spread_bytes`` (max - min over repeats) shows whether
it is stable. ``peak_over_base_bytes`` is MLX's peak minus what was alive before the
caches were built (the weights): the caches plus every transient of prefill and decode.

Roofline: a decode step reads every weight once and every byte the cache holds
(``accounted_bytes``), and does the model's matmuls (2 FLOPs per weight) and each
layer's attention (``decode_flops``: dense attention's, or what a method that rebuilds
keys or attends in a factor space declares). With this machine's measured streaming
read rate and matmul rate (``machine_rates``), a step takes at least
``max(bytes / read rate, FLOPs / matmul rate)``; ``roofline_limit`` is dense's bound
over the method's, the most decode/dense could be, beside the measured
``decode_ratio`` and ``of_limit`` (their quotient). ``bytes_limit`` counts bytes only
(docs/cpu-performance.md). The max assumes the weights' reading overlaps the attention's
arithmetic; a CPU runs one op after the other, so ``serial_limit`` bounds the weights'
matmuls and the attention each by its own max and adds them (``of_serial``: how close
the measured step came to that). Those are ratios against dense, so a method whose
attention runs nearer its bound than dense's model does can pass 1; ``bound_step_s`` (the
serial bound in seconds) and ``of_bound`` (that bound over the measured mean step) say
how close each row, dense included, came to the machine's own limit.

Decode speed is the mean over the steps (``decode_ratio``: every step counted, a method's
occasional compression step included) and the median step (``steady_ratio``, and
``steady_of_limit`` against the roofline): a method that compresses a block of tokens at
once (xKV) pays it in one step, which a short run weighs as much as a long one.

Peak (``peak_rows``): what a user runs out of memory on is the peak during the prompt,
not the retained bytes. Every method, and mlx_lm's dense ``KVCache`` and 4-bit
``QuantizedKVCache`` (rows ``mlx_lm:dense``, ``mlx_lm:q4``), runs the prompt and
``PEAK_DECODE_STEPS`` greedy tokens on mlx_lm's own path (``generate_step``, what
``stream_generate`` runs, at its default prompt step, the caches as ``prompt_cache``):
``peak_bytes`` over the weights, ``retained_bytes`` after, and the prompt's working set
(their difference) beside them (``adapter.retained.measure_user_path``).

``profile_decode`` (``python -m veloxquant_mlx.eval.bench --profile``): where the time of
one decode step goes, per method (whole step, the model without KV, attention, decoding
the codes, building the graph in Python).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from veloxquant_mlx.adapter.builder import KVCacheBuilder
from veloxquant_mlx.adapter.mlx_lm import attention_routing
from veloxquant_mlx.adapter.retained import (
    MLX_LM_CACHES,
    USER_PREFILL_STEP,
    CacheSource,
    build_caches,
    measure_retained,
    measure_user_path,
)
from veloxquant_mlx.cache.stored import StoredFormCache
from veloxquant_mlx.eval.perplexity import Method, Spec, check_model_context, resolve_methods
from veloxquant_mlx.memory import active_bytes, transient_peak
from veloxquant_mlx.ops.attention import sdpa, split_attention
from veloxquant_mlx.ops.parts import slot_parts


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def bench_once(model: nn.Module, tokens: Sequence[int], method: Method | CacheSource,
               context: int, decode_steps: int, chunk: int = 512) -> dict[str, Any]:
    """One prefill + decode run through fresh caches; times and memory."""
    source = method.source if isinstance(method, Method) else method
    KVCacheBuilder.detach(model)
    base = active_bytes()
    mx.reset_peak_memory()
    out = measure_retained(model, source, tokens[:context], decode_steps, chunk,
                           decode_tokens=tokens[context:context + decode_steps])
    peak = mx.get_peak_memory()
    out.update(
        prefill_tok_s=context / out["prefill_s"],
        decode_tok_s=decode_steps / out["decode_s"] if decode_steps else float("nan"),
        steady_tok_s=1 / statistics.median(out["step_s"]) if decode_steps else float("nan"),
        peak_mem_bytes=peak,
        peak_over_base_bytes=peak - base,
        rss_bytes=_rss(),
    )
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters: what a decode step reads besides the KV cache."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def roofline_limit(weights: int, dense_kv: int, method_kv: int) -> float:
    """Decode speed-up over dense if a step were bound by the bytes it reads."""
    return (weights + dense_kv) / (weights + method_kv)


def weight_flops(model: nn.Module) -> int:
    """FLOPs of one token through the model's matmuls (2 per multiply-add): its linear
    layers, and the embedding where it is also the output head (no ``lm_head``)."""
    total, embeddings, head = 0, [], False
    for name, m in model.named_modules():
        head = head or name.split(".")[-1] == "lm_head"
        if isinstance(m, nn.QuantizedLinear):
            total += m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits
        elif isinstance(m, nn.Linear):
            total += m.weight.size
        elif isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
            out, width = m.weight.shape
            embeddings.append(out * (width * 32 // m.bits if hasattr(m, "bits") else width))
    return 2 * (total + (0 if head or not embeddings else max(embeddings)))


def machine_rates(repeats: int = 5) -> dict[str, float]:
    """This machine's float32 streaming read rate (bytes/s) and matmul rate (FLOP/s,
    ``[2048, 1024] x [1024, 1024]``), the best of ``repeats``.

    The read rate is the fastest of three reads of one 64 MiB matrix: MLX's sum, NumPy's
    sum, and NumPy's vector-matrix product (BLAS on every core). MLX's CPU sum alone
    reads at a fraction of what the memory streams (4.7 GB/s here, against 24 for
    NumPy's sum and 41 for the product): a bound from it was slower than the dense model
    it bounds. ``mlx_read_bytes_per_s`` keeps MLX's own figure beside it."""
    import numpy as np

    a = mx.random.normal((4096, 4096))
    x, w = mx.random.normal((2048, 1024)), mx.random.normal((1024, 1024))
    mx.eval(a, x, w)
    a_np, v_np = np.asarray(a), np.ones((1, a.shape[0]), np.float32)
    x_np, w_np = np.asarray(x), np.asarray(w)

    def best(f: Callable[[], Any]) -> float:
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            out = f()
            if isinstance(out, mx.array):
                mx.eval(out)
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    mlx_read = a.nbytes / best(lambda: a.sum())
    reads = [mlx_read, a.nbytes / best(lambda: a_np.sum()), a.nbytes / best(lambda: v_np @ a_np)]
    flops = 2 * 2048 * 1024 * 1024
    matmuls = [flops / best(lambda: x @ w), flops / best(lambda: x_np @ w_np)]
    return {"read_bytes_per_s": max(reads), "mlx_read_bytes_per_s": mlx_read,
            "matmul_flops_per_s": max(matmuls)}


def step_bound(nbytes: float, flops: float, rates: dict[str, float]) -> float:
    """Seconds a decode step takes at least: bound by its bytes or by its FLOPs."""
    return max(nbytes / rates["read_bytes_per_s"], flops / rates["matmul_flops_per_s"])


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
    weights, flops, rates = weight_bytes(model), weight_flops(model), None
    for context in contexts:
        runs: dict[str, list[dict[str, Any]]] = {m.label: [] for m in methods}
        for rep in range(repeats):
            k = rep % len(methods)
            for m in methods[k:] + methods[:k]:
                runs[m.label].append(bench_once(model, tokens, m, context, decode_steps,
                                                chunk))
                bar.update(1)
        block = [_summarize(m, context, decode_steps, runs[m.label]) for m in methods]
        rates = rates or machine_rates()
        for r in block:
            r["prefill_ratio"] = r["prefill_tok_s"] / block[0]["prefill_tok_s"]
            r["decode_ratio"] = r["decode_tok_s"] / block[0]["decode_tok_s"]
            r["steady_ratio"] = r["steady_tok_s"] / block[0]["steady_tok_s"]
            _roofline(r, block[0], weights, flops, rates)
        rows.extend(block)
    bar.close()
    return rows


def _roofline(r: dict[str, Any], dense: dict[str, Any], weights: int, flops: int,
              rates: dict[str, float]) -> None:
    """A row's bytes and FLOPs per step, its limits and how close it came."""
    r.update(weight_bytes=weights, weight_flops=flops, **rates,
             step_flops=flops + r["decode_flops"],
             bytes_limit=roofline_limit(weights, dense["accounted_bytes"],
                                        r["accounted_bytes"]))
    dense_t = step_bound(weights + dense["accounted_bytes"], flops + dense["decode_flops"],
                         rates)
    r["roofline_limit"] = dense_t / step_bound(weights + r["accounted_bytes"],
                                               r["step_flops"], rates)
    r["of_limit"] = r["decode_ratio"] / r["roofline_limit"]
    r["steady_of_limit"] = r["steady_ratio"] / r["roofline_limit"]
    weights_t = step_bound(weights, flops, rates)
    # The serial bound in seconds; against the measured step it says how close the row
    # came to the machine's own limit, not to dense's.
    r["bound_step_s"] = weights_t + step_bound(r["accounted_bytes"], r["decode_flops"], rates)
    r["serial_limit"] = (
        (weights_t + step_bound(dense["accounted_bytes"], dense["decode_flops"], rates))
        / r["bound_step_s"])
    r["of_serial"] = r["decode_ratio"] / r["serial_limit"]
    r["of_bound"] = r["bound_step_s"] * r.get("decode_tok_s", float("nan"))


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
        "decode_flops": last["decode_flops_prefill"],
        "mem_ratio": last["real_over_fp16_prefill"],
        "mem_ratio_decode": last["real_over_fp16_decode"],
        "declared_ratio": last["declared_over_fp16_prefill"],
        "real_over_declared": last["real_over_declared_prefill"],
        "real_over_declared_decode": last["real_over_declared_decode"],
        "residual_bytes": max(r["residual_bytes"] for r in runs),
        "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "steady_tok_s": statistics.median(r["steady_tok_s"] for r in runs),
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in runs),
        "peak_over_base_bytes": max(r["peak_over_base_bytes"] for r in runs),
        "rss_bytes": max(r["rss_bytes"] for r in runs),
        "runs": runs,
    }


# ------------------------------------------------------------------ peak, user's path
PEAK_DECODE_STEPS = 8


def with_mlx_lm(specs: Sequence[Spec] | str, model: nn.Module | None = None) -> list[Method]:
    """``specs``' methods, then mlx_lm's dense and 4-bit caches (the 4-bit one only
    where the model's key width is a multiple of its group of 64)."""
    methods = resolve_methods(specs)
    args = getattr(model, "args", None)
    width = getattr(args, "head_dim", None) or (
        args.hidden_size // args.num_attention_heads
        if hasattr(args, "hidden_size") and hasattr(args, "num_attention_heads") else None)
    extra = [Method(label, build) for label, build in MLX_LM_CACHES.items()
             if label not in {m.label for m in methods}
             and not (label == "mlx_lm:q4" and width and width % 64)]
    return methods + extra


def peak_rows(model: nn.Module, tokens: Sequence[int], specs: Sequence[Spec] | str,
              contexts: Sequence[int], decode_steps: int = PEAK_DECODE_STEPS,
              prefill_step: int = USER_PREFILL_STEP, progress: bool = False
              ) -> list[dict[str, Any]]:
    """One row per (method, context) on mlx_lm's path: peak, retained and working bytes
    over the weights, and the peak over ``mlx_lm:dense``'s at the same context."""
    from tqdm.auto import tqdm

    methods = with_mlx_lm(specs, model)
    need = max(contexts) + decode_steps
    check_model_context(model, need, "context + decode steps")
    if len(tokens) < max(contexts):
        raise ValueError(f"the text has {len(tokens)} tokens: the peak table needs "
                         f"{max(contexts)} (largest context); pass a longer --text")
    rows = []
    bar = tqdm(total=len(contexts) * len(methods), disable=not progress, desc="peak",
               leave=False)
    for context in contexts:
        block = []
        for m in methods:
            r = measure_user_path(model, m.source, tokens[:context], decode_steps,
                                  prefill_step)
            block.append({"method": m.label, **r})
            bar.update(1)
        dense = next(r["peak_bytes"] for r in block if r["method"] == "mlx_lm:dense")
        for r in block:
            r["peak_over_dense"] = r["peak_bytes"] / dense if dense else float("nan")
        rows.extend(block)
    bar.close()
    return rows


# ------------------------------------------------------------------ decode profile
def fill_caches(model: nn.Module, source: CacheSource, context: int,
                chunk: int = 512) -> list[Any]:
    """Caches of ``source`` holding ``context`` tokens of random keys/values (timings do not
    depend on the values), filled in chunks, each chunk attended by one query as a step
    would, so that methods which code after attention have coded it."""
    caches = build_caches(model, source)
    hooked = [c.method for c in caches if getattr(getattr(c, "profile", None), "hooks_module", False)]
    if hooked:
        raise ValueError(
            f"bench --profile: method {hooked[0]!r} caches the layers' input, not keys and "
            "values, so it cannot be filled with random ones; measure it with veloxquant "
            "bench (a real prefill) instead")
    mx.random.seed(0)
    for c in caches:
        info = c.layer
        q1 = mx.random.normal((1, info.n_kv_heads, 1, info.head_dim))
        for start in range(0, context, chunk):
            n = min(chunk, context - start)
            c.update_and_fetch(mx.random.normal((1, info.n_kv_heads, n, info.head_dim)),
                               mx.random.normal((1, info.n_kv_heads, n, info.v_head_dim)))
            if getattr(c, "attends", False):
                c.attend(q1, info.head_dim ** -0.5, None)
            mx.eval(c.state)
    return caches


def _layer_attention(c: Any, q: mx.array) -> mx.array:
    """One layer's decode attention alone: the cache's own, or mlx_lm's dense kernel."""
    if getattr(c, "attends", False):
        return c.attend(q, q.shape[-1] ** -0.5, None)
    k, v = c.keys_and_values()
    return sdpa(q, k, v, q.shape[-1] ** -0.5)


def _layer_codes(c: Any) -> list[mx.array]:
    """One layer's codes as the floats its decode attention multiplies (nothing for dense
    parts)."""
    if not isinstance(c, StoredFormCache):  # mlx_lm's own caches, forms without parts
        return []
    keys, values = c.attention_slots()
    return [f for p in slot_parts(keys) + slot_parts(values) for f in p.floats()]


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t


def _profile_round(model: nn.Module, caches: list[Any], token: mx.array,
                   queries: list[mx.array]) -> dict[str, float]:
    """One of each timing, in ms; the step's token is trimmed off again when possible."""
    out = {"step_ms": _timed(lambda: model(token, cache=caches))}
    t = time.perf_counter()
    logits = model(token, cache=caches)
    out["graph_ms"] = time.perf_counter() - t
    mx.eval(logits)
    # The step's transients: decoded codes, scores, the model's own.
    peak = transient_peak(lambda: model(token, cache=caches))
    for c in caches:
        if c.is_trimmable():
            c.trim(3)
    out["no_kv_ms"] = _timed(lambda: model(token))
    out["attention_ms"] = _timed(lambda: [_layer_attention(c, q)
                                          for c, q in zip(caches, queries)])
    # Layer by layer, as in a step (all layers' floats at once would be fresh memory).
    out["codes_ms"] = sum(_timed(lambda c=c: _layer_codes(c)) for c in caches)
    if not getattr(caches[0], "attends", False):  # dense keys through the shared kernel
        out["shared_ms"] = _timed(lambda: [
            split_attention(q, [c.keys_and_values()], q.shape[-1] ** -0.5)
            for c, q in zip(caches, queries)])
    return {**{k: v * 1e3 for k, v in out.items()}, "step_peak_mib": peak / 2**20}


def profile_decode(model: nn.Module, specs: Sequence[Spec] | str, context: int,
                   rounds: int = 10) -> list[dict[str, Any]]:
    """Where one decode step's time goes at ``context`` tokens, per method (medians of
    ``rounds`` interleaved rounds, ms): ``step_ms`` (a whole step), ``no_kv_ms`` (the
    model on one token without a cache: weight matmuls, norms and per-op overhead),
    ``attention_ms`` (every layer's attention alone), ``codes_ms`` (decoding every layer's
    codes to floats alone, part of attention), ``graph_ms`` (building the step's lazy
    graph in Python, part of the step); ``step_peak_mib`` (the most one step allocated
    beyond what was alive before it, MiB, the largest of the rounds)."""
    methods = resolve_methods(specs)
    caches = {m.label: fill_caches(model, m.source, context) for m in methods}
    token = mx.array([[1]], dtype=mx.int32)
    queries = [mx.random.normal((1, model.args.num_attention_heads, 1, c.layer.head_dim))
               for c in caches[methods[0].label]]
    runs: dict[str, list[dict[str, float]]] = {m.label: [] for m in methods}
    with attention_routing(model):
        for r in range(rounds + 1):  # the first round warms up (compiles kernels)
            for m in methods[r % len(methods):] + methods[:r % len(methods)]:
                one = _profile_round(model, caches[m.label], token, queries)
                if r:
                    runs[m.label].append(one)
    rows = []
    for m in methods:
        row = {"method": m.label, "context": context}
        row.update({k: (max if k == "step_peak_mib" else statistics.median)(
            x[k] for x in runs[m.label]) for k in runs[m.label][0]})
        row["other_ms"] = row["step_ms"] - row["no_kv_ms"] - row["attention_ms"]
        rows.append(row)
    return rows


PROFILE_COLUMNS = ("step_ms", "no_kv_ms", "attention_ms", "codes_ms", "other_ms", "graph_ms",
                   "step_peak_mib")


def profile_markdown(rows: list[dict[str, Any]]) -> str:
    """The profile as a Markdown table."""
    cols = PROFILE_COLUMNS + (("shared_ms",) if any("shared_ms" in r for r in rows) else ())
    lines = ["| method | context | " + " | ".join(cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r[k]:.1f}" if k in r else "-" for k in cols]
        lines.append(f"| {r['method']} | {r['context']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m veloxquant_mlx.eval.bench --profile --context 4096 --methods ...``."""
    p = argparse.ArgumentParser(prog="python -m veloxquant_mlx.eval.bench")
    p.add_argument("--profile", action="store_true", help="profile one decode step")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--methods", default="none,affine:bits=4,kivi:bits=2,turboquant")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)
    from veloxquant_mlx.models import load

    model, _ = load()
    rows = profile_decode(model, args.methods, args.context, args.rounds)
    print(profile_markdown(rows))


if __name__ == "__main__":
    from veloxquant_mlx.apps.blas import ensure_fast_blas

    ensure_fast_blas()
    main()
