"""``veloxquant tune``: the best config for a memory budget, measured on the user's model.

1. Candidates: every registered method's ``tune_grid`` (option sets spanning its useful
   range of compression, eviction stacked with quantization included), as configs, and
   mixed-precision configs of the quantizing methods (``eval.mixed``): a calibration
   pass on a few hundred tokens of the text, outside every scored window, allocates
   per-layer (and keys vs values) widths to the budget.
2. Bytes: each candidate's real retained bytes (``adapter.retained.measure_retained``: the
   allocator, after a prefill of ``context`` tokens and a few decode steps) over the
   fp16-equivalent bytes of the same tokens. Candidates above the budget are dropped.
3. Quality: of the survivors, the ``per_method`` largest of each family (a method,
   with its store, rotation or per-layer widths: within one family more bytes means
   better quality, so its best candidate is among them) are
   scored together, paired against dense on the same windows
   (``eval.quality.evaluate_quality``: KL, top-1 agreement, ppl ratio with intervals).
4. Choice: the lowest KL; candidates whose KL intervals overlap the best are reported as
   ties, and the cheapest of those wins.

Every measurement is appended to ``<out>.partial.json`` as it completes, keyed by what
determines it (spec, model, context, text, seeds), so an interrupted run resumes. The
result file holds ``{"config": ...}`` for ``KVCacheConfig.from_file`` / ``--config``,
with every measurement and the frontier. ``run_frontier`` runs several budgets on one
journal (a candidate is measured once for all of them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.nn as nn

from veloxquant_mlx.adapter.builder import KVCacheBuilder
from veloxquant_mlx.adapter.retained import measure_retained
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.eval import mixed
from veloxquant_mlx.eval.quality import evaluate_quality
from veloxquant_mlx.eval.text import encode, load_text, token_windows
from veloxquant_mlx.registry import get_method, methods

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
    mixed: bool = True  # add calibrated mixed-precision candidates
    calib_tokens: int = 512  # tokens of the calibration pass
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


def family(config: KVCacheConfig) -> str:
    """The method with what changes its bytes-to-quality curve: its ``curve_tags`` (a
    quantized store, another quantizer), rotation, per-layer widths (candidates are
    shortlisted per family)."""
    tags = [config.method, *get_method(config.method).curve_tags(config.options)]
    if config.rotate:
        tags.append("rotate")
    if config.layers:
        tags.append("mixed")
    return "+".join(tags)


def calibration_tokens(tokens: list[int], params: TuneParams) -> list[int]:
    """``calib_tokens`` tokens of the text outside every scored window (the start of the
    first window slot that ``text.token_windows`` does not pick; the text's start when
    it picks them all)."""
    length = params.context + params.predict
    slots = len(tokens) // length
    picked = set(random.Random(params.seed).sample(range(slots), min(params.windows, slots)))
    free = next((s for s in range(slots) if s not in picked), None)
    start = 0 if free is None else free * length
    return tokens[start:start + params.calib_tokens]


def mixed_candidates(model: nn.Module, tokens: list[int], params: TuneParams,
                     journal: Journal) -> list[KVCacheConfig]:
    """Calibrated per-layer widths for the budget (and a little under it, as real bytes
    carry buffers the allocation cannot see), one ladder per quantizing method."""
    out: list[KVCacheConfig] = []
    for name, ladder in mixed.ladders().items():
        if params.only and ladder.method not in params.only:
            continue
        key = f"calibration:{name}:{params.calib_tokens}"
        cal = journal.get(key)
        if cal is None:
            got = mixed.calibrate(model, calibration_tokens(tokens, params), ladder,
                                  params.context)
            cal = {"slots": got.slots, "costs": got.costs, "nbytes": got.nbytes,
                   "fp16_bytes": got.fp16_bytes, "fixed_bytes": got.fixed_bytes}
            journal.put(key, cal)
        got = mixed.Calibration(ladder, **cal)
        for margin in (1.0, 0.96, 0.92):
            out.append(got.config(params.budget * margin))
    return list({c.to_string(): c for c in out}.values())


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
    """Within budget, the ``per_method`` largest candidates of each family."""
    by_method: dict[str, list[KVCacheConfig]] = {}
    for cfg in configs:
        if ratios[cfg.to_string()] <= params.budget:
            by_method.setdefault(family(cfg), []).append(cfg)
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
            if row["method"] != KVCacheConfig().method:  # the dense reference row
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


def _candidates(model: nn.Module, tokens: list[int], params: TuneParams,
                journal: Journal) -> list[KVCacheConfig]:
    configs = candidate_configs(params.context, params.only)
    if params.mixed:
        configs += mixed_candidates(model, tokens, params, journal)
    return list({c.to_string(): c for c in configs}.values())


def tune_budget(model: nn.Module, tokenizer: Any, params: TuneParams, tokens: list[int],
                journal: Journal, progress: bool = True) -> dict[str, Any]:
    """Measure (what the journal lacks) and choose for ``params.budget``."""
    from tqdm.auto import tqdm

    configs = _candidates(model, tokens, params, journal)
    with tqdm(total=len(configs), desc="tune: bytes", disable=not progress) as bar:
        ratios = measure_bytes(model, configs, tokens, params, journal, bar)
    picks = shortlist(configs, ratios, params)
    if not picks:
        cheapest = min(ratios, key=ratios.get)
        raise ValueError(f"tune: no candidate fits budget={params.budget}; the cheapest, "
                         f"{cheapest}, holds {ratios[cheapest]:.3f} of fp16")
    quality = measure_quality(model, tokenizer, picks, tokens, params, journal, progress)
    chosen, ties = choose(quality, ratios)
    return {
        "config": KVCacheConfig.from_string(chosen).to_dict(),
        "chosen": chosen,
        "ties": ties,
        "params": {k: v for k, v in vars(params).items() if k != "extra"},
        "candidates": [{"spec": s, "family": family(KVCacheConfig.from_string(s)),
                        "real_over_fp16": r, **(quality.get(s) or {})}
                       for s, r in sorted(ratios.items(), key=lambda kv: kv[1])],
    }


def run_tune(model: nn.Module, tokenizer: Any, params: TuneParams, out: str | Path,
             text: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Measure, choose and write the result file; returns its content."""
    out = Path(out)
    tokens = encode(tokenizer, load_text() if text is None else text)
    journal = Journal(out.with_suffix(".partial.json"), fingerprint(model, tokens, params))
    result = tune_budget(model, tokenizer, params, tokens, journal, progress)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def run_frontier(model: nn.Module, tokenizer: Any, params: TuneParams,
                 budgets: Sequence[float], out: str | Path, text: str | None = None,
                 progress: bool = True) -> dict[str, Any]:
    """``tune`` at every budget on one journal; writes ``{"frontier": [...]}`` to ``out``
    (one result per budget, as ``run_tune`` writes them; budgets nothing fits are
    reported with the error)."""
    out = Path(out)
    tokens = encode(tokenizer, load_text() if text is None else text)
    journal = Journal(out.with_suffix(".partial.json"), fingerprint(model, tokens, params))
    frontier = []
    for budget in budgets:
        p = dataclasses.replace(params, budget=budget)
        try:
            frontier.append(tune_budget(model, tokenizer, p, tokens, journal, progress))
        except ValueError as exc:
            frontier.append({"params": {"budget": budget}, "error": str(exc)})
    result = {"frontier": frontier}
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


def frontier_markdown(result: dict[str, Any]) -> str:
    """One row per budget: the chosen config, its real bytes and quality (95% CIs)."""
    lines = ["| budget | chosen | real/fp16 | ppl/dense [95% CI] | KL [95% CI] | top-1 [95% CI] |",
             "|---:|---|---:|---|---|---|"]
    for res in result["frontier"]:
        budget = res["params"]["budget"]
        if "error" in res:
            lines.append(f"| {budget} | {res['error']} | - | - | - | - |")
            continue
        c = next(c for c in res["candidates"] if c["spec"] == res["chosen"])
        cis = [c.get(k) or [c[k.removesuffix("_ci")]] * 2
               for k in ("ppl_ratio_ci", "kl_ci", "top1_ci")]
        lines.append(
            f"| {budget} | `{res['chosen']}` | {c['real_over_fp16']:.3f} | "
            f"{c['ppl_ratio']:.4f} [{cis[0][0]:.4f}, {cis[0][1]:.4f}] | {c['kl']:.4f} "
            f"[{cis[1][0]:.4f}, {cis[1][1]:.4f}] | {c['top1']:.3f} "
            f"[{cis[2][0]:.3f}, {cis[2][1]:.3f}] |")
    return "\n".join(lines)
