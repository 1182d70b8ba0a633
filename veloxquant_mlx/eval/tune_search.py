"""The measurements of ``veloxquant tune``'s successive halving, cheapest first.

1. :func:`declared_ratio`: what a candidate's caches declare holding after the context,
   over fp16, without a model run of its own: the dense run replayed into its caches
   (``eval.tune_replay``). Caches that cannot be replayed are prefilled through the
   model on a short prefix (four chunks of ``PROBE`` tokens); when the bytes grow by the
   same amount per chunk they are extrapolated to the context, else the whole context
   is prefilled.
2. :func:`screen`: a short paired KL and top-1 against dense: the replayed (or prefilled)
   caches read a few more tokens in teacher-forced decode steps, against the dense
   run's log-probs of the same tokens (read as one chunk: for dense the same thing).
   With ``speed`` each step is timed beside a dense step.
3. :func:`final_group`: the harness protocol of ``eval.quality`` for the finalists:
   each prefills the window itself, then teacher-forced decode steps, each finalist's
   step right before or after the others' and (every ``DENSE_EVERY`` steps) dense's on
   the same token, the order alternating, so that decode speed relative to dense is
   measured side by side (dense's log-probs come from its recorded run; it steps only
   to be timed). The real (allocator) bytes after the prefill are read as
   ``adapter.retained`` does, of the finalist built first; the declared bytes after
   ``BYTES_STEPS`` decode steps beside them. :func:`summarize` turns the per-token
   scores into KL, top-1 and ppl ratio with the harness's paired block-bootstrap
   intervals.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from veloxquant_mlx.adapter.builder import KVCacheBuilder, cache_stats
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.adapter.retained import build_caches, warm_up
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.eval.quality import LEVEL, block_ids, bootstrap_means, percentile_interval
from veloxquant_mlx.eval.tune_replay import (
    Recording,
    replay,
    replayable,
    representatives,
    trim_dense,
)
from veloxquant_mlx.memory import active_bytes, no_buffer_cache

PROBE = 32  # tokens per chunk of the short prefill of caches that cannot be replayed


def _ratio(caches: list[Any]) -> float:
    s = cache_stats(caches)
    return s["held_bytes"] / s["fp16_bytes"]


def fill(model: nn.Module, rec: Recording, caches: list[Any], chunk: int) -> bool:
    """Put the recorded context into ``caches``: replayed when they allow it (True),
    else prefilled through the model."""
    if replayable(rec, caches):
        replay(rec, caches)
        return True
    prefill(model, caches, rec.context, chunk)
    return False


def declared_ratio(model: nn.Module, config: KVCacheConfig, rec: Recording,
                   chunk: int) -> float:
    """Declared bytes over fp16 after the context (see the module docstring). What the
    build installed on the model stays (the next candidate of the same method reuses
    it); ``KVCacheBuilder.detach`` removes it."""
    caches = build_caches(model, config)
    if replayable(rec, caches):
        return _replayed_ratio(rec, caches)
    got = _extrapolated(model, caches, rec.context)
    if got is not None:
        return got
    caches = build_caches(model, config)
    prefill(model, caches, rec.context, chunk)
    return _ratio(caches)


def _replayed_ratio(rec: Recording, caches: list[Any]) -> float:
    """Replayed without computing (bytes are shapes), one layer per kind of layer when
    the layers are independent."""
    reps = representatives(rec, caches)
    if reps is None:
        replay(rec, caches, evaluate=False)
        return _ratio(caches)
    replay(rec, caches, list(reps), evaluate=False)
    stats = {s: cache_stats([caches[s]]) for s in reps}
    held = sum(n * stats[s]["held_bytes"] for s, n in reps.items())
    return held / sum(n * stats[s]["fp16_bytes"] for s, n in reps.items())


def _extrapolated(model: nn.Module, caches: list[Any], context: list[int]) -> float | None:
    """Bytes at the context from four chunks of ``PROBE`` tokens, when they grow
    linearly (the two steps after the second chunk equal); ``None`` otherwise."""
    n = 4
    if len(context) <= n * PROBE:
        return None
    held, fp16 = [], []
    for i in range(n):
        model(mx.array([context[i * PROBE:(i + 1) * PROBE]], dtype=mx.int32), cache=caches)
        mx.eval([c.state for c in caches])
        s = cache_stats(caches)
        held.append(s["held_bytes"])
        fp16.append(s["fp16_bytes"])
    steps = {(b - a, d - c) for a, b, c, d in zip(held[1:], held[2:], fp16[1:], fp16[2:])}
    (dh, df), = steps if len(steps) == 1 else [(0, 0)]
    if dh <= 0 or df <= 0:  # not linear, or grown in steps larger than the probe's
        return None
    more = (len(context) - n * PROBE) / PROBE
    return (held[-1] + more * dh) / (fp16[-1] + more * df)


def log_probs(logits: mx.array) -> mx.array:
    """Log-softmax over the last axis, in float32."""
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def compare(logq: mx.array, ref: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """Per position: KL(ref || q) and whether the top-1 tokens agree."""
    kl = mx.sum(mx.exp(ref) * (ref - logq), axis=-1)
    agree = (mx.argmax(ref, axis=-1) == mx.argmax(logq, axis=-1)).astype(mx.float32)
    mx.eval(kl, agree)
    return np.array(kl, dtype=np.float64).reshape(-1), np.array(agree, np.float64).reshape(-1)


def dense_reference(model: nn.Module, rec: Recording, tokens: Sequence[int]) -> mx.array:
    """Dense log-probs after each of ``tokens`` (read as one chunk after the context)."""
    out = log_probs(model(mx.array([list(tokens)], dtype=mx.int32), cache=rec.dense)[0])
    mx.eval(out)
    trim_dense(rec)
    return out


def screen(model: nn.Module, config: KVCacheConfig, rec: Recording, tokens: Sequence[int],
           ref: mx.array, chunk: int, speed: bool = False) -> dict[str, Any]:
    """Short paired KL / top-1 of one candidate over teacher-forced decode steps on
    ``tokens`` (each step reads what the caches keep of the steps before it, as
    generation does; read as one chunk, the chunk's own tokens would be seen in full
    precision, which flatters the methods that code each new token); with ``speed``,
    each step timed beside a dense step on the same token. The model keeps what the
    build installed, as with ``declared_ratio``."""
    caches = build_caches(model, config)
    replayed = fill(model, rec, caches, chunk)
    kl, agree, seconds = [], [], [0.0, 0.0]
    for i, tok in enumerate(tokens):
        pair = ((0, rec.dense), (1, caches)) if i % 2 else ((1, caches), (0, rec.dense))
        for j, c in pair if speed else ((1, caches),):
            logits, dt = _step(model, c, tok)
            seconds[j] += dt if i else 0.0  # the first step also compiles
            if j:
                got = compare(log_probs(logits), ref[i])
                kl.append(float(got[0][0]))
                agree.append(float(got[1][0]))
    trim_dense(rec)
    out = {"screen_kl": float(np.mean(kl)), "screen_top1": float(np.mean(agree)),
           "kl_tokens": kl, "replayed": replayed}
    if speed and seconds[1] > 0:
        out["screen_decode_ratio"] = seconds[0] / seconds[1]
    return out


def _step(model: nn.Module, caches: list[Any], token: int) -> tuple[mx.array, float]:
    t0 = time.perf_counter()
    logits = model(mx.array([[token]], dtype=mx.int32), cache=caches)[0, -1]
    mx.eval(logits)
    return logits, time.perf_counter() - t0


def _prefill_measured(model: nn.Module, config: KVCacheConfig, context: list[int],
                      chunk: int, measure: bool) -> tuple[list[Any], mx.array, dict]:
    """Build and prefill ``config``'s caches; the real bytes they keep when asked, read
    as ``adapter.retained`` does (after a warm-up, which detaches the model: nothing
    else may be built yet, and nothing else can share a buffer with them)."""
    if not measure:
        caches = build_caches(model, config)
        return caches, prefill(model, caches, context, chunk), {}
    warm_up(model, config, context, chunk)
    with no_buffer_cache():
        base = active_bytes()
        caches = build_caches(model, config)
        last = prefill(model, caches, context, chunk)  # a copy of its own: not counted
        real = active_bytes() - base - last.nbytes
    s = cache_stats(caches)
    return caches, last, {"real_prefill_over_fp16": real / s["fp16_bytes"],
                          "declared_prefill_over_fp16": s["held_bytes"] / s["fp16_bytes"]}


DENSE_EVERY = 4  # finals: a dense step (timed beside the finalists') every this many
# Finals: the bytes after a few decode steps too (what a method adds per new token, at
# about the context; ``adapter.retained``'s reading after decode).
BYTES_STEPS = 4


def final_group(model: nn.Module, configs: Sequence[KVCacheConfig], rec: Recording,
                targets: Sequence[int], ref: mx.array, chunk: int,
                measure: bool) -> dict[str, Any]:
    """The finalists' harness run on one window (see the module docstring): per
    finalist, per-token NLL / KL / top-1 against ``ref`` (dense's log-probs for each
    of ``targets``) and decode seconds; dense's NLL, and its seconds on the steps it
    was timed beside them. With ``measure``, the real bytes of the first finalist,
    built before the others. ``configs`` must not hold two methods that hook the
    model's modules."""
    trim_dense(rec)
    names = ["dense"] + [c.to_string() for c in configs]
    out: dict[str, Any] = {n: {"nll": [], "kl": [], "agree": [], "decode_s": 0.0,
                               "decode_steps": 0} for n in names}
    out["dense"]["nll"] = [-float(ref[i, t].item()) for i, t in enumerate(targets)]
    caches, lasts = [rec.dense], [None]
    for i, c in enumerate(configs):
        got, last, facts = _prefill_measured(model, c, rec.context, chunk, measure and not i)
        caches.append(got)
        lasts.append(last)
        out[c.to_string()].update(facts)
    for i, target in enumerate(targets):
        if i:
            lasts = _interleaved_step(model, names, caches, targets[i - 1], i, out)
        if i == min(BYTES_STEPS, len(targets) - 1):
            for name, got in zip(names[1:], caches[1:]):
                out[name]["declared_decode_over_fp16"] = _ratio(got)
        _score_step(names, lasts, ref[i], target, out)
    del caches, lasts
    KVCacheBuilder.detach(model)
    trim_dense(rec)
    return out


def _interleaved_step(model: nn.Module, names: list[str], caches: list[list[Any]],
                      token: int, i: int, out: dict[str, Any]) -> list[Any]:
    """One decode step of every finalist, and of dense every ``DENSE_EVERY`` steps, in
    alternating order so that a load change hits them alike; step 1 (first use of
    the decode path) is not timed."""
    order = list(range(0 if i % DENSE_EVERY == 0 else 1, len(names)))
    logits: list[Any] = [None] * len(names)
    for j in (order if (i + i // DENSE_EVERY) % 2 else order[::-1]):  # dense alternates too
        logits[j], dt = _step(model, caches[j], token)
        if i > 1:
            out[names[j]]["decode_s"] += dt
            out[names[j]]["decode_steps"] += 1
    return logits


def _score_step(names: list[str], lasts: list[Any], ref: mx.array, target: int,
                out: dict[str, Any]) -> None:
    for name, logits in zip(names[1:], lasts[1:]):
        logq = log_probs(logits.reshape(-1))
        kl, agree = compare(logq, ref)
        out[name]["nll"].append(-float(logq[target].item()))
        out[name]["kl"].append(float(kl[0]))
        out[name]["agree"].append(float(agree[0]))


def final_reference(model: nn.Module, rec: Recording, targets: Sequence[int]) -> mx.array:
    """Dense log-probs for each of ``targets`` (the tokens after the context): the
    prefill's last logits, then the other tokens read as one chunk (for dense the
    same thing as decode steps)."""
    rest = dense_reference(model, rec, targets[:-1]) if len(targets) > 1 else None
    first = log_probs(rec.last.reshape(1, -1))
    return first if rest is None else mx.concatenate([first, rest], axis=0)


def summarize(finals: dict[str, dict[str, Any]], block: int = 32, n_boot: int = 2000,
              level: float = LEVEL, seed: int = 0) -> dict[str, dict[str, Any]]:
    """KL, top-1 and ppl ratio of every finalist with paired block-bootstrap intervals
    against dense on the same tokens, as ``eval.quality`` reports them (one draw of
    blocks for the finalist's rows and dense's), and decode speed relative to dense
    (seconds per step over the windows)."""
    return {s: _summary(entry["windows"], block, n_boot, level, seed)
            for s, entry in finals.items()}


def _summary(wins: list[dict[str, Any]], block: int, n_boot: int, level: float,
             seed: int) -> dict[str, Any]:
    ids = block_ids([len(w["dense_nll"]) for w in wins], block)
    dense, nll, kl, agree = (np.concatenate([w[k] for w in wins])
                             for k in ("dense_nll", "nll", "kl", "agree"))
    boot = bootstrap_means(np.stack([dense, nll, kl, agree]), ids, n_boot, seed)
    ratio = percentile_interval(boot[1] - boot[0], level)
    per_step = [sum(w[f"{k}_s"] for w in wins) / max(1, sum(w[f"{k}_steps"] for w in wins))
                for k in ("dense_decode", "decode")]
    return {"kl": float(kl.mean()), "kl_ci": list(percentile_interval(boot[2], level)),
            "top1": float(agree.mean()), "top1_ci": list(percentile_interval(boot[3], level)),
            "ppl_ratio": float(np.exp(nll.mean() - dense.mean())),
            "ppl_ratio_ci": [float(np.exp(ratio[0])), float(np.exp(ratio[1]))],
            "decode_ratio": per_step[0] / per_step[1] if per_step[1] > 0 else float("nan"),
            "tokens": int(kl.size), "windows": len(wins)}
