"""Paired quality of methods against the dense model, with bootstrap intervals.

Per window the dense ``none`` cache runs first and its per-position log-probabilities
are kept (for that window only). Every other method then reads the same window through
its caches, and for each predicted token we record its NLL, KL(dense || method) of
the next-token distributions, and whether its top-1 token is dense's. Figures:

- ppl = exp(mean NLL); ppl ratio = exp(mean NLL(method) - mean NLL(dense));
- mean KL (nats per token); top-1 agreement (fraction of tokens);
- each with a 95% percentile bootstrap interval; for every pair of methods the
  interval of their paired ppl ratio says whether they can be told apart.

Resampling unit (:func:`block_ids`): blocks of ``block`` consecutive predicted tokens
(default 32) inside a window, pooled over all windows and drawn with replacement; one
draw serves every method and the dense reference, so intervals of ratios are paired.
Why blocks: neighbouring tokens share a passage and a lost fact hurts several of them,
so per-token losses are correlated and a token bootstrap gives intervals that are too
narrow (by ``sqrt((1 - r) / (1 + r))`` for a lag-1 correlation ``r``); a window
bootstrap is valid but has only 4 units at 4k/8k (35 distinct resamples), too few
for a 95% interval. Blocks of 32 tokens hold the short-range correlation inside a
unit and leave 8 units per 256-token window. Correlation between blocks of the same
window is ignored, so the intervals can be somewhat narrow on text with long-range
structure; ``per_window`` in the result gives the window-level spread to check.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import mlx.nn as nn
import numpy as np

from veloxquant_mlx.adapter.retained import measure_retained
from veloxquant_mlx.eval.perplexity import (
    Method,
    Spec,
    WindowScores,
    check_model_context,
    reconstruction_errors,
    resolve_methods,
    score_window,
)
from veloxquant_mlx.eval.text import encode, load_text, token_windows

LEVEL = 0.95


# ------------------------------------------------------------------ bootstrap
def block_ids(tokens_per_window: Sequence[int], block: int) -> np.ndarray:
    """Block index of every token: consecutive ``block`` tokens of one window.

    A window's last block is shorter when ``block`` does not divide its length.
    """
    if block < 1:
        raise ValueError(f"block={block} is not allowed: an integer >= 1")
    ids, offset = [], 0
    for n in tokens_per_window:
        per = np.arange(n) // block
        ids.append(per + offset)
        offset += int(per[-1]) + 1 if n else 0
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)


def bootstrap_means(values: np.ndarray, ids: np.ndarray, n_boot: int = 2000,
                    seed: int = 0) -> np.ndarray:
    """Resampled means of each row of ``values`` [K, N], one block draw for all rows.

    Returns ``[K, n_boot]``. Blocks (``ids`` [N]) are drawn with replacement, as many
    as there are; a resample's mean is its tokens' sum over its token count.
    """
    values = np.atleast_2d(np.asarray(values, dtype=np.float64))
    n_blocks = int(ids.max()) + 1
    sums = np.zeros((values.shape[0], n_blocks))
    for k in range(values.shape[0]):
        sums[k] = np.bincount(ids, weights=values[k], minlength=n_blocks)
    counts = np.bincount(ids, minlength=n_blocks).astype(np.float64)
    rng = np.random.default_rng(seed)
    # How many times each block is drawn, per resample: [n_boot, n_blocks].
    draws = rng.multinomial(n_blocks, np.full(n_blocks, 1.0 / n_blocks), size=n_boot)
    return (draws @ sums.T).T / (draws @ counts)[None, :]


def percentile_interval(samples: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The central ``level`` percentile interval of bootstrap ``samples``."""
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(samples, [tail, 100.0 - tail])
    return float(lo), float(hi)


def bootstrap_ci(x: Sequence[float] | np.ndarray, block: int = 1, n_boot: int = 2000,
                 level: float = LEVEL, seed: int = 0) -> tuple[float, float]:
    """Block-bootstrap percentile interval of the mean of the series ``x``."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap_ci: the sample is empty")
    ids = block_ids([x.size], block)
    return percentile_interval(bootstrap_means(x[None], ids, n_boot, seed)[0], level)


# ------------------------------------------------------------------ windows
def _run_windows(model: nn.Module, methods: list[Method], wins: list[list[int]], context: int,
                 predict: int, chunk: int, recon: bool,
                 progress: bool) -> tuple[dict[str, list[WindowScores]], dict[str, list]]:
    """Score every window with every method; dense first, the others rotated."""
    from tqdm.auto import tqdm

    dense, others = methods[0], methods[1:]
    scores: dict[str, list[WindowScores]] = {m.label: [] for m in methods}
    recons: dict[str, list] = {m.label: [] for m in others}
    bar = tqdm(total=len(wins) * len(methods), disable=not progress, desc=f"ppl {context}",
               leave=False)
    for w, win in enumerate(wins):
        ref_caches = dense.build(model)
        ref = score_window(model, win, ref_caches, context, predict, chunk, keep_logp=True)
        logp, ref.logp = ref.logp, None
        scores[dense.label].append(ref)
        bar.update(1)
        k = w % max(len(others), 1)
        for m in others[k:] + others[:k]:
            caches = m.build(model)
            scores[m.label].append(score_window(model, win, caches, context, predict, chunk,
                                                reference=logp))
            if recon:
                recons[m.label].append(reconstruction_errors(ref_caches, caches))
            del caches
            bar.update(1)
        del logp, ref_caches
    bar.close()
    return scores, recons


def _memory(model: nn.Module, methods: list[Method], prompt: list[int], follow: list[int],
            steps: int, chunk: int, progress: bool) -> dict[str, dict[str, Any]]:
    """Real memory of every method after prefilling ``prompt`` and ``steps`` decodes."""
    from tqdm.auto import tqdm

    # Teacher-forced decode where the window has the tokens: the same for every method.
    forced = follow[:steps] if len(follow) >= steps else None
    out = {}
    for m in tqdm(methods, disable=not progress, desc=f"memory {len(prompt)}", leave=False):
        out[m.label] = measure_retained(model, m.source, prompt, steps, chunk,
                                        decode_tokens=forced)
    return out


# ------------------------------------------------------------------ summaries
def _interval(samples: np.ndarray, level: float, fn: Any = None) -> list[float]:
    lo, hi = percentile_interval(samples, level)
    return [fn(lo), fn(hi)] if fn else [lo, hi]


def _verdict(lo: float, hi: float) -> str:
    if lo <= 1.0 <= hi:
        return "cannot be told apart"
    return "worse" if lo > 1.0 else "better"


def _pairs(labels: list[str], boot_nll: np.ndarray, level: float) -> list[dict[str, Any]]:
    """Paired ppl ratio interval for every pair of non-reference methods."""
    out = []
    for i in range(1, len(labels)):
        for j in range(i + 1, len(labels)):
            lo, hi = _interval(boot_nll[i] - boot_nll[j], level, math.exp)
            out.append({"a": labels[i], "b": labels[j], "ppl_ratio_ci": [lo, hi],
                        "verdict": _verdict(lo, hi)})
    return out


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def _window_stats(s: WindowScores, ref: WindowScores, context: int) -> dict[str, Any]:
    n = len(s.nll)
    return {"ppl": math.exp(s.nll.mean()), "ppl_ratio": math.exp(s.nll.mean() - ref.nll.mean()),
            "kl": float(s.kl.mean()), "top1": float(s.agree.mean()),
            "prefill_tok_s": context / s.prefill_s if s.prefill_s > 0 else float("nan"),
            "decode_tok_s": (n - 1) / s.decode_s if n > 1 and s.decode_s > 0 else float("nan")}


def _block_stats(nll: np.ndarray, kl: np.ndarray, agree: np.ndarray,
                 ids: np.ndarray) -> dict[str, list[float]]:
    """Per-block token counts and sums: enough to redo the bootstrap from the JSON."""
    nb = int(ids.max()) + 1
    return {"tokens": np.bincount(ids, minlength=nb).tolist(),
            "nll_sum": np.bincount(ids, nll, nb).tolist(),
            "kl_sum": np.bincount(ids, kl, nb).tolist(),
            "top1_sum": np.bincount(ids, agree, nb).tolist()}


def _memory_fields(mem: dict[str, Any] | None) -> dict[str, Any]:
    """The row's memory columns: the real (allocator) figure first, declared beside it."""
    if not mem:
        return {}
    return {
        "real_bytes": mem["real_prefill_bytes"],
        "real_decode_bytes": mem["real_decode_bytes"],
        "held_bytes": mem["declared_prefill_bytes"],
        "accounted_bytes": mem["accounted_prefill_bytes"],
        "fp16_bytes": mem["fp16_prefill_bytes"],
        "mem_ratio": mem["real_over_fp16_prefill"],
        "mem_ratio_decode": mem["real_over_fp16_decode"],
        "declared_ratio": mem["declared_over_fp16_prefill"],
        "real_over_declared": mem["real_over_declared_prefill"],
        "accounted_over_held": (mem["accounted_prefill_bytes"] / mem["declared_prefill_bytes"]
                                if mem["declared_prefill_bytes"] else float("nan")),
        "memory": mem,
    }


def _quality_fields(i: int, nll: np.ndarray, kl: np.ndarray, agree: np.ndarray,
                    boot: np.ndarray, level: float) -> dict[str, Any]:
    """ppl, ppl ratio, KL and top-1 of method ``i`` with their intervals."""
    m = nll.shape[0]
    ratio_ci = _interval(boot[i] - boot[0], level, math.exp)
    return {
        "ppl": math.exp(nll[i].mean()),
        "ppl_ci": _interval(boot[i], level, math.exp),
        "ppl_ratio": math.exp(nll[i].mean() - nll[0].mean()),
        "ppl_ratio_ci": ratio_ci,
        "kl": float(kl[i].mean()),
        "kl_ci": _interval(boot[m + i], level),
        "top1": float(agree[i].mean()),
        "top1_ci": _interval(boot[2 * m + i], level),
        "verdict": "reference" if i == 0 else _verdict(*ratio_ci),
    }


def _summarize(methods: list[Method], scores: dict[str, list[WindowScores]],
               recons: dict[str, list], memory: dict[str, dict[str, Any]],
               context: int, predict: int, block: int, n_boot: int, level: float,
               seed: int) -> dict[str, Any]:
    labels = [m.label for m in methods]
    cols = [np.stack([np.concatenate([getattr(s, f) for s in scores[lb]]) for lb in labels])
            for f in ("nll", "kl", "agree")]
    ids = block_ids([len(s.nll) for s in scores[labels[0]]], block)
    boot = bootstrap_means(np.concatenate(cols), ids, n_boot, seed)
    pairs = _pairs(labels, boot[:len(labels)], level)
    ref_windows = scores[labels[0]]
    rows = []
    for i, m in enumerate(methods):
        wins = [_window_stats(s, r, context) for s, r in zip(scores[m.label], ref_windows)]
        row: dict[str, Any] = {"method": m.label, "config": m.config_dict(),
                               "context": context, "predict": predict, "windows": len(wins),
                               "tokens": int(cols[0].shape[1]), "seed": seed}
        row.update(_memory_fields(memory.get(m.label)))
        row.update(_quality_fields(i, *cols, boot, level))
        row["indistinguishable_from"] = [
            p["b"] if p["a"] == m.label else p["a"] for p in pairs
            if m.label in (p["a"], p["b"]) and p["verdict"] == "cannot be told apart"]
        row["decode_tok_s"] = _median([w["decode_tok_s"] for w in wins])
        row["prefill_tok_s"] = _median([w["prefill_tok_s"] for w in wins])
        row["window_ppl"] = [w["ppl"] for w in wins]
        row["per_window"] = wins
        row["per_block"] = _block_stats(cols[0][i], cols[1][i], cols[2][i], ids)
        _add_recon(row, recons.get(m.label))
        rows.append(row)
    for r in rows:
        r["decode_ratio"] = r["decode_tok_s"] / rows[0]["decode_tok_s"]
        r["prefill_ratio"] = r["prefill_tok_s"] / rows[0]["prefill_tok_s"]
    return {"context": context, "predict": predict, "windows": len(ref_windows),
            "block": block, "n_boot": n_boot, "level": level, "seed": seed,
            "rows": rows, "pairs": pairs}


def _add_recon(row: dict[str, Any], recons: list | None) -> None:
    layers = [e for window in (recons or []) for e in window]
    if layers:
        row["k_rel_err"] = statistics.mean(e["k_rel_err"] for e in layers)
        row["v_rel_err"] = statistics.mean(e["v_rel_err"] for e in layers)
        row["recon_layers"] = recons[-1]


def default_windows(context: int) -> int:
    """Windows that resolve about 1% at 256 predicted tokens: 8 up to 2k, 4 beyond."""
    return 8 if context <= 2048 else 4


def evaluate_quality(model: nn.Module, tokenizer: Any, specs: Sequence[Spec] | str,
                     context: int = 2048, predict: int = 256, windows: int | None = None,
                     *, text: str | None = None, tokens: list[int] | None = None,
                     seed: int = 0, chunk: int = 512, block: int = 32, n_boot: int = 2000,
                     level: float = LEVEL, memory_steps: int | None = 16,
                     recon: bool = False, progress: bool = False) -> dict[str, Any]:
    """Paired quality (and real memory) of every method at one context; see module doc.

    Every method is scored on the same ``windows`` token windows (chosen by ``seed``;
    default :func:`default_windows`) of ``tokens`` (or of ``text`` encoded, default the
    standard-library docstrings). The dense ``none`` reference is added when missing.
    ``memory_steps``: decode steps of the real-memory measurement on the first window's
    context (``None``: no measurement). Returns ``rows`` (one per method, the reference
    first), ``pairs`` (paired ppl-ratio intervals between methods) and the parameters.
    """
    methods = resolve_methods(specs)
    windows = default_windows(context) if windows is None else windows
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level} is not allowed: a number in (0, 1)")
    check_model_context(model, context + predict, "context + predict")
    if tokens is None:
        tokens = encode(tokenizer, load_text() if text is None else text)
    wins = token_windows(tokens, context + predict, windows, seed)
    scores, recons = _run_windows(model, methods, wins, context, predict, chunk, recon,
                                  progress)
    memory = {} if memory_steps is None else _memory(
        model, methods, wins[0][:context], wins[0][context:], memory_steps, chunk, progress)
    return _summarize(methods, scores, recons, memory, context, predict, block, n_boot,
                      level, seed)


def evaluate_methods(model: nn.Module, tokenizer: Any, specs: Sequence[Spec] | str,
                     context: int = 2048, predict: int = 256, windows: int | None = None,
                     text: str | None = None, seed: int = 0, chunk: int = 512,
                     recon: bool = False, progress: bool = False,
                     **options: Any) -> list[dict[str, Any]]:
    """The rows of :func:`evaluate_quality` (one per method, the dense reference first)."""
    return evaluate_quality(model, tokenizer, specs, context, predict, windows, text=text,
                            seed=seed, chunk=chunk, recon=recon, progress=progress,
                            **options)["rows"]
