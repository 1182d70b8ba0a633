"""Perplexity through a compressed cache, and the method table built on it.

Protocol: prefill ``context`` tokens through the caches in chunks of ``chunk`` (as
mlx_lm does), then teacher-force the next ``predict`` tokens one decode step at a
time. The logits of the last prefill position score token ``context``; each of the
``predict - 1`` decode steps feeds the true token and scores the next one. All
``predict`` scored tokens therefore depend on keys and values read back from the
caches. A window holds ``context + predict`` tokens.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..builder import KVCacheBuilder, cache_stats
from ..config import KVCacheConfig
from .text import encode, load_text, token_windows

Spec = str | KVCacheConfig


def _nll(logits: mx.array, targets: mx.array) -> mx.array:
    """Negative log-likelihood of each target under ``logits`` [L, V] (float32)."""
    logits = logits.astype(mx.float32)
    picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return mx.logsumexp(logits, axis=-1) - picked


def _check_window(tokens: Sequence[int], context: int, predict: int) -> None:
    if context < 1:
        raise ValueError(f"context={context} is not allowed: an integer >= 1")
    if predict < 1:
        raise ValueError(f"predict={predict} is not allowed: an integer >= 1")
    if len(tokens) < context + predict:
        raise ValueError(
            f"window has {len(tokens)} tokens: needs context + predict = {context + predict}"
        )


def model_max_context(model: nn.Module) -> int | None:
    """The model's position limit (``max_position_embeddings``), if it declares one."""
    args = getattr(model, "args", None)
    value = getattr(args, "max_position_embeddings", None)
    return int(value) if value else None


def check_model_context(model: nn.Module, tokens_needed: int, what: str = "context") -> None:
    """Error when ``tokens_needed`` exceeds the model's position limit."""
    limit = model_max_context(model)
    if limit is not None and tokens_needed > limit:
        raise ValueError(
            f"{what}={tokens_needed} tokens is not allowed: the model's limit is "
            f"max_position_embeddings={limit} tokens"
        )


def forward_perplexity(model: nn.Module, tokens: Sequence[int], context: int,
                       predict: int) -> dict[str, float]:
    """Reference: one full-sequence forward pass, no cache, same scored tokens."""
    _check_window(tokens, context, predict)
    x = mx.array(list(tokens[:context + predict - 1]))[None]
    logits = model(x)[0, context - 1:]
    nll = _nll(logits, mx.array(list(tokens[context:context + predict]))).sum().item()
    return {"nll": nll, "tokens": predict, "ppl": math.exp(nll / predict)}


def _run_window(model: nn.Module, tokens: Sequence[int], caches: list[Any], context: int,
                predict: int, chunk: int) -> dict[str, Any]:
    _check_window(tokens, context, predict)
    if chunk < 1:
        raise ValueError(f"chunk={chunk} is not allowed: an integer >= 1")
    prompt = mx.array(list(tokens[:context]))
    targets = list(tokens[context:context + predict])
    t0 = time.perf_counter()
    for start in range(0, context, chunk):
        logits = model(prompt[None, start:start + chunk], cache=caches)
        if start + chunk < context:
            mx.eval([c.state for c in caches])
    nlls = [_nll(logits[0, -1:], mx.array(targets[:1]))]
    mx.eval(nlls[0])
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(predict - 1):
        step = mx.array([[targets[i]]])
        nll = _nll(model(step, cache=caches)[0], mx.array(targets[i + 1:i + 2]))
        mx.eval(nll)
        nlls.append(nll)
    decode_s = time.perf_counter() - t0
    total = mx.concatenate(nlls).sum().item()
    out = {
        "nll": total,
        "tokens": predict,
        "ppl": math.exp(total / predict),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prefill_tok_s": context / prefill_s if prefill_s > 0 else float("nan"),
        "decode_tok_s": (predict - 1) / decode_s if predict > 1 and decode_s > 0
        else float("nan"),
    }
    out.update(cache_stats(caches))
    return out


def perplexity_through_cache(model: nn.Module, tokens: Sequence[int],
                             make_caches: Callable[[], list[Any]], context: int,
                             predict: int, chunk: int = 512) -> dict[str, Any]:
    """Perplexity of ``tokens[context:context+predict]`` read through fresh caches.

    Returns ``nll``, ``tokens``, ``ppl``, prefill/decode seconds and tok/s, and the
    cache totals of ``cache_stats`` (held, accounted, fp16-equivalent bytes, ratio).
    """
    return _run_window(model, tokens, make_caches(), context, predict, chunk)


# ------------------------------------------------------------------ method table
def parse_specs(specs: Sequence[Spec] | str) -> list[tuple[str, KVCacheConfig]]:
    """``(label, config)`` per spec; all are parsed before anything runs."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(";") if s.strip()] if ";" in specs else \
            split_method_list(specs)
    out = []
    for spec in specs:
        if isinstance(spec, KVCacheConfig):
            out.append((config_label(spec), spec))
        else:
            out.append((spec.strip(), KVCacheConfig.from_string(spec.strip())))
    if not out:
        raise ValueError("methods: the list of method specs is empty")
    labels = [label for label, _ in out]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"methods: {dupes} given more than once; each spec once")
    return out


def split_method_list(text: str) -> list[str]:
    """Split ``"none,affine:bits=4,window=32,xkv:rank_k=64"`` into method specs.

    A comma starts a new spec when the next item has no ``=`` (a method name) or is
    of the form ``name:...``; otherwise it continues the previous spec's options.
    """
    specs: list[str] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        head = item.split("=", 1)[0]
        if specs and "=" in item and ":" not in head:
            specs[-1] += "," + item
        else:
            specs.append(item)
    return specs


def config_label(config: KVCacheConfig) -> str:
    """``method:key=value,...`` with the fields that differ from the defaults."""
    base = KVCacheConfig(method=config.method).to_dict()
    changed = [f"{k}={v}" for k, v in config.to_dict().items()
               if k != "method" and v != base[k]]
    return config.method + (":" + ",".join(changed) if changed else "")


def _rel_error(approx: mx.array, ref: mx.array) -> float:
    approx, ref = approx.astype(mx.float32), ref.astype(mx.float32)
    denom = mx.linalg.norm(ref.reshape(-1)).item()
    return mx.linalg.norm((approx - ref).reshape(-1)).item() / denom if denom else 0.0


def _dense_of(cache: Any) -> tuple[mx.array, mx.array] | None:
    for name in ("dense_kv", "reconstruct"):
        fn = getattr(cache, name, None)
        if callable(fn):
            return fn()
    return None


def reconstruction_errors(ref_caches: list[Any], caches: list[Any]) -> list[dict[str, Any]]:
    """Per-layer relative Frobenius error of keys and values against dense caches.

    Only layers whose cache exposes ``dense_kv()`` or ``reconstruct()``. The reference
    is the dense cache of the same tokens, so deeper layers also carry the error that
    earlier layers' compression propagated into their inputs.
    """
    rows = []
    for idx, (ref, c) in enumerate(zip(ref_caches, caches)):
        got = _dense_of(c)
        state = getattr(ref, "state", None)
        if got is None or not state:
            continue
        rk, rv = state[0], state[1]
        k, v = got
        n = min(k.shape[2], rk.shape[2])
        rows.append({"layer": idx,
                     "k_rel_err": _rel_error(k[..., -n:, :], rk[..., -n:, :]),
                     "v_rel_err": _rel_error(v[..., -n:, :], rv[..., -n:, :])})
    return rows


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def _progress(total: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, leave=False)


def evaluate_methods(model: nn.Module, tokenizer: Any, specs: Sequence[Spec] | str,
                     context: int = 2048, predict: int = 256, windows: int = 2,
                     text: str | None = None, seed: int = 0, chunk: int = 512,
                     recon: bool = False, progress: bool = False) -> list[dict[str, Any]]:
    """One row per method spec: memory, accounting, perplexity and speed vs dense.

    Every method is scored on the same token windows (chosen by ``seed``). Methods
    run interleaved (the order rotates per window) and speeds are medians over the
    windows, so shared-machine noise hits all methods alike. The dense ``none``
    reference is added when missing. ``text`` is the evaluation text (default: the
    standard-library docstrings corpus).
    """
    parsed = parse_specs(specs)
    if not any(cfg.method == "none" for _, cfg in parsed):
        parsed.insert(0, ("none", KVCacheConfig(method="none")))
    ref_label = next(label for label, cfg in parsed if cfg.method == "none")
    check_model_context(model, context + predict, "context + predict")
    tokens = encode(tokenizer, load_text() if text is None else text)
    wins = token_windows(tokens, context + predict, windows, seed)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in parsed}
    recons: dict[str, list[list[dict[str, Any]]]] = {label: [] for label, _ in parsed}
    bar = _progress(len(wins) * len(parsed), progress, "eval")
    for w, win in enumerate(wins):
        order = parsed[w % len(parsed):] + parsed[:w % len(parsed)]
        kept: dict[str, list[Any]] = {}
        for label, cfg in order:
            caches = KVCacheBuilder.for_model(model, cfg)
            runs[label].append(_run_window(model, win, caches, context, predict, chunk))
            if recon:
                kept[label] = caches
            del caches
            bar.update(1)
        if recon:
            for label, caches in kept.items():
                if label != ref_label:
                    recons[label].append(reconstruction_errors(kept[ref_label], caches))
        kept.clear()
    bar.close()
    rows = [_summarize(label, cfg, runs[label], recons[label], context, predict, seed)
            for label, cfg in parsed]
    ref = next(r for r in rows if r["method"] == ref_label)
    for r in rows:
        r["ppl_ratio"] = r["ppl"] / ref["ppl"]
        r["decode_ratio"] = r["decode_tok_s"] / ref["decode_tok_s"]
        r["prefill_ratio"] = r["prefill_tok_s"] / ref["prefill_tok_s"]
    return rows


def _summarize(label: str, cfg: KVCacheConfig, runs: list[dict[str, Any]],
               recons: list[list[dict[str, Any]]], context: int, predict: int,
               seed: int) -> dict[str, Any]:
    nll = sum(r["nll"] for r in runs)
    n = sum(r["tokens"] for r in runs)
    held = statistics.mean(r["held_bytes"] for r in runs)
    accounted = statistics.mean(r["accounted_bytes"] for r in runs)
    fp16 = statistics.mean(r["fp16_bytes"] for r in runs)
    row: dict[str, Any] = {
        "method": label,
        "config": cfg.to_dict(),
        "context": context,
        "predict": predict,
        "windows": len(runs),
        "seed": seed,
        "held_bytes": int(held),
        "accounted_bytes": int(accounted),
        "fp16_bytes": int(fp16),
        "mem_ratio": held / fp16 if fp16 else float("nan"),
        "accounted_over_held": accounted / held if held else float("nan"),
        "ppl": math.exp(nll / n),
        "window_ppl": [r["ppl"] for r in runs],
        "decode_tok_s": _median([r["decode_tok_s"] for r in runs]),
        "prefill_tok_s": _median([r["prefill_tok_s"] for r in runs]),
    }
    if recons and any(recons):
        layers = [e for window in recons for e in window]
        row["k_rel_err"] = statistics.mean(e["k_rel_err"] for e in layers)
        row["v_rel_err"] = statistics.mean(e["v_rel_err"] for e in layers)
        row["recon_layers"] = recons[-1]
    return row
