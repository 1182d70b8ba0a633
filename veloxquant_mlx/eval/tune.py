"""``veloxquant tune``: the best config for a memory budget, measured on the user's model.

1. Candidates: every registered method's ``tune_grid`` (option sets spanning its useful
   range of compression), as configs.
2. Bytes: each candidate's real retained bytes (``eval.memory.measure_retained``: the
   allocator, after a prefill of ``context`` tokens and a few decode steps) over the
   fp16-equivalent bytes of the same tokens. Candidates above the budget are dropped.
3. Quality: of the survivors, the ``per_method`` largest of each method (within one
   method more bytes means better quality, so its best candidate is among them) are
   scored together, paired against dense on the same windows
   (``eval.quality.evaluate_quality``: KL, top-1 agreement, ppl ratio with intervals).
4. Choice: the lowest KL; candidates whose KL intervals overlap the best are reported as
   ties, and the cheapest of those wins.

Every measurement is appended to ``<out>.partial.json`` as it completes, keyed by what
determines it (spec, model, context, text, seeds), so an interrupted run resumes. The
result file holds ``{"config": ...}`` for ``KVCacheConfig.from_file`` / ``--config``,
with every measurement and the frontier.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.nn as nn

from ..builder import KVCacheBuilder
from ..config import KVCacheConfig
from ..registry import methods
from .memory import measure_retained
from .quality import evaluate_quality
from .text import encode, load_text, token_windows

QUICK = {"context": 1024, "predict": 64, "windows": 2}
FULL = {"predict": 128, "windows": 4}


@dataclass
class TuneParams:
    """What a tuning run measures on."""

    budget: float
    context: int = 2048
    predict: int = 128
    windows: int = 4
    per_method: int = 2
    seed: int = 0
    decode_steps: int = 4
    only: tuple[str, ...] = ()  # method names to consider (empty: all with a grid)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.budget <= 4.0:
            raise ValueError(f"budget={self.budget} is not allowed: a fraction of the "
                             "fp16-equivalent bytes in (0, 4]")
        for name in ("context", "predict", "windows", "per_method"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is not allowed: >= 1")


def candidate_configs(context: int, only: Sequence[str] = ()) -> list[KVCacheConfig]:
    """One config per option set of every method's ``tune_grid`` (or of ``only``)."""
    unknown = sorted(set(only) - set(methods()))
    if unknown:
        raise ValueError(f"tune: unknown method(s) {unknown}; known: {sorted(methods())}")
    out = []
    for name, cls in methods().items():
        if only and name not in only:
            continue
        out.extend(KVCacheConfig(name, **opts) for opts in cls.tune_grid(context))
    if not out:
        raise ValueError(f"tune: no method among {list(only) or sorted(methods())} has "
                         "a tune_grid of candidate settings")
    return out


def budget_for_memory(model: nn.Module, max_bytes: int, context: int) -> float:
    """The fraction of fp16-equivalent KV bytes that ``max_bytes`` allows at ``context``."""
    per_token = sum(2 * i.n_kv_heads * (i.head_dim + i.v_head_dim)
                    for i in KVCacheBuilder.layer_infos(model) if i is not None)
    return max_bytes / (per_token * context)


class Journal:
    """Measurements on disk, keyed by what determines them (resumable runs)."""

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path, self.fingerprint = path, fingerprint
        self.entries: dict[str, Any] = {}
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("fingerprint") == fingerprint:
                self.entries = data.get("entries", {})

    def get(self, key: str) -> Any:
        return self.entries.get(key)

    def put(self, key: str, value: Any) -> None:
        self.entries[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "entries": self.entries}),
                       encoding="utf-8")
        tmp.replace(self.path)


def fingerprint(model: nn.Module, tokens: Sequence[int], params: TuneParams) -> str:
    """What every measurement of a run depends on, hashed."""
    infos = [(i.n_kv_heads, i.head_dim) if i else None
             for i in KVCacheBuilder.layer_infos(model)]
    key = json.dumps([type(model).__module__, infos, len(tokens), sum(tokens[:4096]),
                      params.context, params.predict, params.windows, params.seed,
                      params.decode_steps])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def measure_bytes(model: nn.Module, configs: list[KVCacheConfig], tokens: list[int],
                  params: TuneParams, journal: Journal, bar: Any) -> dict[str, float]:
    """Real retained bytes over fp16 (the larger of after prefill / after decode)."""
    window = token_windows(tokens, params.context + params.decode_steps, 1, params.seed)[0]
    ratios = {}
    for cfg in configs:
        spec = cfg.to_string()
        got = journal.get(f"bytes:{spec}")
        if got is None:
            m = measure_retained(model, cfg, window[:params.context], params.decode_steps,
                                 decode_tokens=window[params.context:])
            got = max(m["real_over_fp16_prefill"], m["real_over_fp16_decode"])
            journal.put(f"bytes:{spec}", got)
        ratios[spec] = got
        bar.update(1)
    return ratios


def shortlist(configs: list[KVCacheConfig], ratios: dict[str, float],
              params: TuneParams) -> list[KVCacheConfig]:
    """Within budget, the ``per_method`` largest candidates of each method."""
    by_method: dict[str, list[KVCacheConfig]] = {}
    for cfg in configs:
        if ratios[cfg.to_string()] <= params.budget:
            by_method.setdefault(cfg.method, []).append(cfg)
    out = []
    for group in by_method.values():
        group.sort(key=lambda c: -ratios[c.to_string()])
        out.extend(group[:params.per_method])
    return out


def measure_quality(model: nn.Module, tokenizer: Any, configs: list[KVCacheConfig],
                    tokens: list[int], params: TuneParams, journal: Journal,
                    progress: bool) -> dict[str, dict[str, Any]]:
    """Quality rows of the shortlist, paired against dense (cached per spec)."""
    todo = [c for c in configs if journal.get(f"quality:{c.to_string()}") is None]
    if todo:
        result = evaluate_quality(model, tokenizer, todo, params.context, params.predict,
                                  params.windows, tokens=tokens, seed=params.seed,
                                  memory_steps=None, progress=progress)
        for row in result["rows"]:
            if row["method"] != "none":
                journal.put(f"quality:{row['method']}", _quality_fields(row))
    return {c.to_string(): journal.get(f"quality:{c.to_string()}") for c in configs}


def _quality_fields(row: dict[str, Any]) -> dict[str, Any]:
    keys = ("ppl_ratio", "ppl_ratio_ci", "kl", "kl_ci", "top1", "top1_ci")
    return {k: row.get(k) for k in keys}


def choose(quality: dict[str, dict[str, Any]], ratios: dict[str, float]
           ) -> tuple[str, list[str]]:
    """The lowest-KL spec, and the specs whose KL interval overlaps it (ties); among the
    ties the cheapest is chosen."""
    best = min(quality, key=lambda s: quality[s]["kl"])
    hi = (quality[best].get("kl_ci") or [quality[best]["kl"]] * 2)[1]
    ties = [s for s in quality if (quality[s].get("kl_ci") or [quality[s]["kl"]])[0] <= hi]
    chosen = min(ties, key=lambda s: (ratios[s], quality[s]["kl"]))
    return chosen, sorted(ties, key=lambda s: ratios[s])


def run_tune(model: nn.Module, tokenizer: Any, params: TuneParams, out: str | Path,
             text: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Measure, choose and write the result file; returns its content."""
    from tqdm.auto import tqdm

    out = Path(out)
    tokens = encode(tokenizer, load_text() if text is None else text)
    configs = candidate_configs(params.context, params.only)
    journal = Journal(out.with_suffix(".partial.json"), fingerprint(model, tokens, params))
    with tqdm(total=len(configs), desc="tune: bytes", disable=not progress) as bar:
        ratios = measure_bytes(model, configs, tokens, params, journal, bar)
    picks = shortlist(configs, ratios, params)
    if not picks:
        cheapest = min(ratios, key=ratios.get)
        raise ValueError(f"tune: no candidate fits budget={params.budget}; the cheapest, "
                         f"{cheapest}, holds {ratios[cheapest]:.3f} of fp16")
    quality = measure_quality(model, tokenizer, picks, tokens, params, journal, progress)
    chosen, ties = choose(quality, ratios)
    result = {
        "config": KVCacheConfig.from_string(chosen).to_dict(),
        "chosen": chosen,
        "ties": ties,
        "params": {k: v for k, v in vars(params).items() if k != "extra"},
        "candidates": [{"spec": s, "real_over_fp16": r, **(quality.get(s) or {})}
                       for s, r in sorted(ratios.items(), key=lambda kv: kv[1])],
    }
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def tune_markdown(result: dict[str, Any]) -> str:
    """The candidates table (real bytes, and quality where measured)."""
    lines = [f"budget {result['params']['budget']:.3f} of fp16, context "
             f"{result['params']['context']}: chosen `{result['chosen']}`", "",
             "| candidate | real/fp16 | KL [95% CI] | top-1 | ppl/dense |",
             "|---|---:|---|---:|---:|"]
    for c in result["candidates"]:
        if c.get("kl") is None:
            lines.append(f"| `{c['spec']}` | {c['real_over_fp16']:.3f} | - | - | - |")
            continue
        ci = c.get("kl_ci") or [c["kl"], c["kl"]]
        lines.append(f"| `{c['spec']}` | {c['real_over_fp16']:.3f} | {c['kl']:.4f} "
                     f"[{ci[0]:.4f}, {ci[1]:.4f}] | {c['top1']:.3f} | "
                     f"{c['ppl_ratio']:.4f} |")
    return "\n".join(lines)
