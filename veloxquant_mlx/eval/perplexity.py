"""Scoring tokens through a compressed cache, and method specs.

Protocol: prefill ``context`` tokens through the caches in chunks of ``chunk``
(:func:`veloxquant_mlx.adapter.prefill.prefill`, as mlx_lm does), then teacher-force the next
``predict`` tokens one decode step at a time. The logits of the last prefill position
score token ``context``; each of the ``predict - 1`` decode steps feeds the true token
and scores the next one. All ``predict`` scored tokens therefore depend on keys and
values read back from the caches. A window holds ``context + predict`` tokens.

:func:`score_window` returns per-token NLL and, against a reference run's
log-probabilities, per-token KL(reference || method) and top-1 agreement; the paired
method table built on it is :func:`veloxquant_mlx.eval.quality.evaluate_quality`
(``evaluate_methods``, its rows only, lives there too).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from veloxquant_mlx.adapter.builder import cache_stats
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.adapter.retained import CacheSource, build_caches
from veloxquant_mlx.config import KVCacheConfig

Spec = str | KVCacheConfig | tuple[str, Callable[[nn.Module], list[Any]]]


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


# ------------------------------------------------------------------ one window
def _score(logits: mx.array, target: int, ref: mx.array | None,
           keep: bool) -> tuple[mx.array, ...]:
    """NLL of ``target``, KL(ref || this), top-1 agreement; log-probs when ``keep``.

    ``logits`` is one position's ``[V]``. Without ``ref`` KL is 0 and agreement 1 (the
    run is its own reference).
    """
    logq = logits.astype(mx.float32)
    logq = logq - mx.logsumexp(logq)
    nll = -logq[target]
    if ref is None:
        kl, agree = mx.array(0.0), mx.array(1.0)
    else:
        kl = mx.sum(mx.exp(ref) * (ref - logq))
        agree = (mx.argmax(ref) == mx.argmax(logq)).astype(mx.float32)
    out = (nll, kl, agree, logq) if keep else (nll, kl, agree)
    mx.eval(*out)
    return out


@dataclass
class WindowScores:
    """Per-token scores of one window read through one method's caches."""

    nll: np.ndarray  # [predict] nats
    kl: np.ndarray  # [predict] KL(reference || method), nats
    agree: np.ndarray  # [predict] 1.0 where the argmax matches the reference's
    prefill_s: float
    decode_s: float
    logp: list[mx.array] | None = None  # per position [V] log-probs (reference runs)


def score_window(model: nn.Module, tokens: Sequence[int], caches: list[Any], context: int,
                 predict: int, chunk: int = 512, reference: list[mx.array] | None = None,
                 keep_logp: bool = False) -> WindowScores:
    """Score ``tokens[context:context+predict]`` through ``caches`` (see module doc).

    ``reference``: the per-position log-probabilities of the dense run of the same
    window (``keep_logp=True`` returns them); with it, KL and top-1 agreement are
    computed against it, without it they are 0 and 1.
    """
    _check_window(tokens, context, predict)
    if reference is not None and len(reference) < predict:
        raise ValueError(f"reference has {len(reference)} positions: predict={predict}")
    targets = list(tokens[context:context + predict])
    t0 = time.perf_counter()
    last = prefill(model, caches, list(tokens[:context]), chunk)
    prefill_s = time.perf_counter() - t0
    ref = reference or [None] * predict
    rows = [_score(last[0], targets[0], ref[0], keep_logp)]
    del last
    t0 = time.perf_counter()
    for i in range(predict - 1):
        logits = model(mx.array([[targets[i]]], dtype=mx.int32), cache=caches)
        rows.append(_score(logits[0, -1], targets[i + 1], ref[i + 1], keep_logp))
    decode_s = time.perf_counter() - t0
    cols = [np.array([r[j].item() for r in rows], dtype=np.float64) for j in range(3)]
    return WindowScores(*cols, prefill_s=prefill_s, decode_s=decode_s,
                        logp=[r[3] for r in rows] if keep_logp else None)


def perplexity_through_cache(model: nn.Module, tokens: Sequence[int],
                             make_caches: Callable[[], list[Any]], context: int,
                             predict: int, chunk: int = 512) -> dict[str, Any]:
    """Perplexity of ``tokens[context:context+predict]`` read through fresh caches.

    Returns ``nll``, ``tokens``, ``ppl``, prefill/decode seconds and tok/s, and the
    caches' declared totals of ``cache_stats`` (held, accounted, fp16 bytes, ratio).
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} is not allowed: an integer >= 1")
    caches = make_caches()
    s = score_window(model, tokens, caches, context, predict, chunk)
    total = float(s.nll.sum())
    out = {
        "nll": total,
        "tokens": predict,
        "ppl": math.exp(total / predict),
        "prefill_s": s.prefill_s,
        "decode_s": s.decode_s,
        "prefill_tok_s": context / s.prefill_s if s.prefill_s > 0 else float("nan"),
        "decode_tok_s": (predict - 1) / s.decode_s if predict > 1 and s.decode_s > 0
        else float("nan"),
    }
    out.update(cache_stats(caches))
    return out


# ------------------------------------------------------------------ method specs
@dataclass(frozen=True)
class Method:
    """A labelled way of building caches: a config, or a function (hand-made caches)."""

    label: str
    source: CacheSource

    @property
    def config(self) -> KVCacheConfig | None:
        return self.source if isinstance(self.source, KVCacheConfig) else None

    @property
    def is_dense(self) -> bool:
        return self.config is not None and self.config.is_reference

    def build(self, model: nn.Module) -> list[Any]:
        return build_caches(model, self.source)

    def config_dict(self) -> dict[str, Any] | None:
        return self.config.to_dict() if self.config is not None else None


def resolve_methods(specs: Sequence[Spec] | str, add_dense: bool = True) -> list[Method]:
    """Parse every spec before anything runs; the dense ``none`` reference goes first.

    A spec is a string (``"affine:bits=4"``), a ``KVCacheConfig``, or a
    ``(label, build_caches(model))`` pair. With ``add_dense`` a ``none`` method is
    inserted when absent, and the first ``none`` is moved to the front.
    """
    if isinstance(specs, str):
        specs = [s for s in specs.split(";") if s.strip()] if ";" in specs else \
            split_method_list(specs)
    out: list[Method] = []
    for spec in specs:
        if isinstance(spec, tuple):
            label, build = spec
            out.append(Method(str(label), build))
        elif isinstance(spec, KVCacheConfig):
            out.append(Method(config_label(spec), spec))
        else:
            out.append(Method(spec.strip(), KVCacheConfig.from_string(spec.strip())))
    if not out:
        raise ValueError("methods: the list of method specs is empty")
    labels = [m.label for m in out]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"methods: {dupes} given more than once; each spec once")
    if add_dense:
        dense = next((m for m in out if m.is_dense), None)
        ref = KVCacheConfig()
        out = [dense or Method(ref.method, ref)] + \
            [m for m in out if m is not dense]
    return out


def parse_specs(specs: Sequence[Spec] | str) -> list[tuple[str, KVCacheConfig]]:
    """``(label, config)`` per config spec, in the order given; all parsed first."""
    return [(m.label, m.config) for m in resolve_methods(specs, add_dense=False)
            if m.config is not None]


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
    return config.to_string()


# ------------------------------------------------------------------ reconstruction
def _rel_error(approx: mx.array, ref: mx.array) -> float:
    approx, ref = approx.astype(mx.float32), ref.astype(mx.float32)
    denom = mx.linalg.norm(ref.reshape(-1)).item()
    return mx.linalg.norm((approx - ref).reshape(-1)).item() / denom if denom else 0.0


def _dense_of(cache: Any) -> tuple[mx.array, mx.array] | None:
    for name in ("keys_and_values", "reconstruct"):
        fn = getattr(cache, name, None)
        if callable(fn):
            return fn()
    return None


def reconstruction_errors(ref_caches: list[Any], caches: list[Any]) -> list[dict[str, Any]]:
    """Per-layer relative Frobenius error of keys and values against dense caches.

    Only layers whose cache exposes ``keys_and_values()`` or ``reconstruct()``. The reference
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
