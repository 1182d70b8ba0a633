"""``veloxquant tune``: the best config for a memory budget, measured on the user's model.

Successive halving: every candidate gets the cheapest measurement, and only the
survivors of each stage the next, dearer one (``eval.tune_search``).

1. Candidates: every registered method's ``tune_grid`` (option sets spanning its useful
   range of compression, eviction stacked with quantization included), as configs, and
   mixed-precision configs of the quantizing methods (``eval.mixed``): a calibration
   pass on a few hundred tokens of the text, outside every scored window, allocates
   per-layer (and keys vs values) widths to the budget.
2. Bytes, no model run per candidate: one dense prefill of the first window is
   recorded and replayed into each candidate's caches (``eval.tune_replay``); what they
   declare holding over fp16 drops the candidates above the budget. Of the rest, the
   ``per_method`` largest of each family (a method with its store, rotation or
   per-layer widths: within one family more bytes means better quality) go on.
3. Screens: a short paired KL against dense over teacher-forced decode steps after the
   replayed context (the dense run shared by all): ``screen_tokens`` steps on the first
   window, then, round after round on the next window, twice as many for the better
   half, until at most twice ``finalists`` are left (or the windows run out). With
   ``min_decode`` each step is timed beside a dense step, and candidates clearly slower
   than it allows go to the end of the line.
4. Finalists (the best screen and, of the next ``finalists - 1``, those it does not beat
   clearly): the harness protocol of ``eval.quality`` on every window (own prefill,
   teacher-forced decode, paired block-bootstrap intervals of KL, top-1 and ppl
   ratio), decode speed relative to dense measured step by step beside dense's, real
   (allocator) bytes after the prefill. After each window a finalist clearly worse
   than the best eligible one stops. A finalist above the budget, or slower than
   ``min_decode``, is out; when none is left the next finalists are run.
5. Choice: the lowest KL; finalists whose KL intervals overlap the best are reported as
   ties, and the cheapest of those wins.

Every measurement is appended to ``<out>.partial.json`` as it completes, keyed by what
determines it (spec, model, context, text, seeds), so an interrupted run resumes. The
result file holds ``{"config": ...}`` for ``KVCacheConfig.from_file`` / ``--config``,
with every measurement. ``run_frontier`` runs several budgets on one journal (a
candidate is measured once for all of them). Both files are written whole or not at all
(``ops.files``); a journal that is not one (corrupt, foreign) is set aside with a
warning and the run measures again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.nn as nn
import numpy as np

from veloxquant_mlx.adapter.builder import KVCacheBuilder
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.eval import mixed
from veloxquant_mlx.eval import tune_search as search
from veloxquant_mlx.eval.quality import bootstrap_ci
from veloxquant_mlx.eval.text import encode, load_text, token_windows
from veloxquant_mlx.eval.tune_replay import Recording, record
from veloxquant_mlx.ops.files import set_aside, write_text
from veloxquant_mlx.registry import get_method, methods

QUICK = {"context": 1024, "predict": 64, "windows": 2, "per_method": 1, "calib_tokens": 256,
         "screen_tokens": 8}
FULL = {"predict": 128, "windows": 4}
SPEED_SLACK = 0.85  # a screen's few timed steps drop a candidate only this far below


class NoFit(ValueError):
    """No candidate meets the budget (and the decode speed asked)."""


@dataclass
class TuneParams:
    """What a tuning run measures on."""

    budget: float
    context: int = 2048
    predict: int = 128
    windows: int = 4
    per_method: int = 2
    seed: int = 0
    only: tuple[str, ...] = ()  # method names to consider (empty: all with a grid)
    mixed: bool = True  # add calibrated mixed-precision candidates
    calib_tokens: int = 512  # tokens of the calibration pass
    screen_tokens: int = 16  # decode steps of the first screens (doubling per round)
    finalists: int = 2  # candidates measured with the harness at a time
    min_decode: float | None = None  # decode tok/s over dense's, at least
    chunk: int = 512  # prefill chunk, as mlx_lm's
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.budget <= 4.0:
            raise ValueError(f"budget={self.budget} is not allowed: a fraction of the "
                             "fp16-equivalent bytes in (0, 4]")
        for name in ("context", "predict", "windows", "per_method", "screen_tokens",
                     "finalists", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is not allowed: >= 1")
        if self.min_decode is not None and not self.min_decode > 0:
            raise ValueError(f"min_decode={self.min_decode} is not allowed: a ratio > 0 "
                             "of dense's decode tokens/s")

    @property
    def window(self) -> int:
        """Tokens of one window: the context, then what the harness and screens score."""
        return self.context + max(self.predict, self.screen_tokens)


def candidate_configs(context: int, only: Sequence[str] = ()) -> list[KVCacheConfig]:
    """One config per option set of every method's ``tune_grid`` (or of ``only``)."""
    unknown = sorted(set(only) - set(methods()))
    if unknown:
        raise ValueError(f"tune: unknown method(s) {unknown}; known: {sorted(methods())}")
    out = []
    for name, cls in methods().items():
        if only and name not in only:
            continue
        out.extend(KVCacheConfig(name, **opts) for opts in cls.profile.tune_grid(context))
    if not out:
        raise ValueError(f"tune: no method among {list(only) or sorted(methods())} has "
                         "a tune_grid of candidate settings")
    return out


def family(config: KVCacheConfig) -> str:
    """The method with what changes its bytes-to-quality curve: its ``curve_tags`` (a
    quantized store, another quantizer), rotation, per-layer widths (candidates are
    shortlisted per family)."""
    tags = [config.method, *get_method(config.method).profile.curve_tags(config.options)]
    if config.rotate:
        tags.append("rotate")
    if config.layers:
        tags.append("mixed")
    return "+".join(tags)


def calibration_tokens(tokens: list[int], params: TuneParams) -> list[int]:
    """``calib_tokens`` tokens of the text outside every scored window (the start of the
    first window slot that ``text.token_windows`` does not pick; the text's start when
    it picks them all)."""
    length = params.window
    slots = len(tokens) // length
    picked = set(random.Random(params.seed).sample(range(slots), min(params.windows, slots)))
    free = next((s for s in range(slots) if s not in picked), None)
    start = 0 if free is None else free * length
    return tokens[start:start + params.calib_tokens]


def calibrate(model: nn.Module, tokens: Sequence[int], ladders: Sequence[mixed.Ladder],
              context: int) -> list[mixed.Calibration | str]:
    """``mixed.calibrate`` of several ladders on one sensitivity pass: the pass (a
    forward and a backward of the model) is most of a calibration's cost, and the same
    for every ladder; the distortions and bytes of each ladder are cheap. A ladder
    whose settings this model's layers refuse gives the refusal instead."""
    infos = KVCacheBuilder.layer_infos(model)
    KVCacheBuilder.detach(model)
    slots, kv, f = mixed.fisher(model, tokens, infos)
    out: list[mixed.Calibration | str] = []
    for ladder in ladders:
        try:
            costs = [mixed.knob_costs(ladder, infos[s], (kv[2 * j], kv[2 * j + 1]),
                                      (f[2 * j], f[2 * j + 1]))
                     for j, s in enumerate(slots)]
        except ValueError as exc:  # e.g. a quantizer that needs another head size
            out.append(f"{ladder.method}: {exc}")
            continue
        shapes: dict[tuple[int, int, int], dict[str, list[int]]] = {}
        for s in slots:
            info = infos[s]
            shape = (info.n_kv_heads, info.head_dim, info.v_head_dim)
            if shape not in shapes:
                shapes[shape] = mixed.knob_bytes(ladder, info, context)
        nbytes = [shapes[infos[s].n_kv_heads, infos[s].head_dim, infos[s].v_head_dim]
                  for s in slots]
        fp16 = sum(context * infos[s].n_kv_heads * (infos[s].head_dim + infos[s].v_head_dim)
                   * 2 for s in slots)
        out.append(mixed.Calibration(ladder, slots, costs, nbytes, fp16,
                                     mixed._fixed_bytes(ladder, infos[slots[0]])))
    return out


def mixed_candidates(model: nn.Module, tokens: list[int], params: TuneParams,
                     journal: Journal, run: Run | None = None) -> list[KVCacheConfig]:
    """Calibrated per-layer widths for the budget (and a little under it, as real bytes
    carry buffers the allocation cannot see), one ladder per quantizing method."""
    ladders = {n: lad for n, lad in mixed.ladders().items()
               if not params.only or lad.method in params.only}
    key = f"calibration:{{}}:{params.calib_tokens}"
    todo = [n for n in ladders if journal.get(key.format(n)) is None]
    if todo:
        t0 = time.perf_counter()
        if run is not None:
            run.expect("calibration", COST["calibration"])
        got = calibrate(model, calibration_tokens(tokens, params),
                        [ladders[n] for n in todo], params.context)
        if run is not None:
            run.done(COST["calibration"], "calibration", t0)
        for name, cal in zip(todo, got):
            journal.put(key.format(name), {"refused": cal} if isinstance(cal, str) else {
                "slots": cal.slots, "costs": cal.costs, "nbytes": cal.nbytes,
                "fp16_bytes": cal.fp16_bytes, "fixed_bytes": cal.fixed_bytes})
    out: list[KVCacheConfig] = []
    for name, ladder in ladders.items():
        entry = journal.get(key.format(name))
        if "refused" in entry:
            continue  # this model's layers refuse the ladder's settings
        cal = mixed.Calibration(ladder, **entry)
        out += [cal.config(params.budget * margin) for margin in (1.0, 0.96, 0.92)]
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
        data = self._read()
        if data is not None and data["fingerprint"] == fingerprint:
            self.entries = data["entries"]

    def _read(self) -> dict[str, Any] | None:
        """The journal as ``put`` writes it; a corrupt or foreign-shaped file is set aside
        with one warning (the run measures again), never fatal."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError:
            return None  # absent: a fresh run
        try:
            data = json.loads(text)
        except ValueError as exc:
            set_aside(self.path, f"not valid JSON: {exc}")
            return None
        if not (isinstance(data, dict) and isinstance(data.get("fingerprint"), str)
                and isinstance(data.get("entries"), dict)):
            set_aside(self.path, "not a tuner journal ({'fingerprint': str, 'entries': {}})")
            return None
        return data

    def get(self, key: str) -> Any:
        return self.entries.get(key)

    def put(self, key: str, value: Any) -> None:
        self.entries[key] = value
        write_text(self.path, json.dumps({"fingerprint": self.fingerprint,
                                          "entries": self.entries}))


def code_fingerprint() -> str:
    """A hash of the library's own code (its modules and the fused kernel it loaded):
    speed and quality measured by other code are not resumed."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".so") and path.is_file():
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def fingerprint(model: nn.Module, tokens: Sequence[int], params: TuneParams) -> str:
    """What every measurement of a run depends on, hashed (the code included)."""
    infos = [(i.n_kv_heads, i.head_dim) if i else None
             for i in KVCacheBuilder.layer_infos(model)]
    key = json.dumps([type(model).__module__, infos, len(tokens), sum(tokens[:4096]),
                      params.context, params.predict, params.windows, params.seed,
                      params.screen_tokens, params.chunk, code_fingerprint()])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class Run:
    """One tuning run's shared state: the text's windows, their dense recordings (made
    when first needed), the journal and the progress bar."""

    def __init__(self, model: nn.Module, tokens: list[int], params: TuneParams,
                 journal: Journal, progress: bool) -> None:
        from tqdm.auto import tqdm

        self.model, self.tokens, self.journal = model, tokens, journal
        self.windows = token_windows(tokens, params.window, params.windows, params.seed)
        self.context, self.chunk = params.context, params.chunk
        self.recordings: dict[int, Recording] = {}
        self.refs: dict[tuple[Any, ...], Any] = {}
        self.seconds: dict[str, float] = {}
        self.left: dict[str, float] = {}
        self.attached: str | None = None
        # smoothing=0: time left from the mean rate so far, as tasks differ in length
        self.bar = tqdm(total=0, desc="tune", disable=not progress, smoothing=0,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                                   "[{elapsed} elapsed, about {remaining} left]")

    def recording(self, w: int) -> Recording:
        """Window ``w``'s dense run, its calls recorded (made again if they were dropped)."""
        if w not in self.recordings or self.recordings[w].calls is None:
            t0 = time.perf_counter()
            self.expect("recording", max(self.left.get("recording", 0.0), COST["recording"]))
            self.recordings[w] = record(self.model, self.windows[w][:self.context],
                                        self.chunk)
            self.done(COST["recording"], "recording", t0)
        return self.recordings[w]

    def dense(self, w: int) -> Recording:
        """Window ``w``'s dense run, for its caches only."""
        return self.recordings[w] if w in self.recordings else self.recording(w)

    def drop_calls(self) -> None:
        """Free the recorded calls (the finalists need only the dense caches)."""
        for rec in self.recordings.values():
            rec.calls = None

    def reference(self, w: int, n: int) -> Any:
        """Dense log-probs of the ``n`` tokens after window ``w``'s context."""
        if (w, n) not in self.refs:
            self.refs[w, n] = search.dense_reference(self.model, self.recording(w),
                                                     self.scored(w, n))
        return self.refs[w, n]

    def final_reference(self, w: int, n: int) -> Any:
        """Dense log-probs for each of the ``n`` tokens after window ``w``'s context."""
        if ("final", w, n) not in self.refs:
            self.refs["final", w, n] = search.final_reference(self.model, self.dense(w),
                                                              self.scored(w, n))
        return self.refs["final", w, n]

    def scored(self, w: int, n: int) -> list[int]:
        return self.windows[w][self.context:self.context + n]

    def switch(self, config: KVCacheConfig | None) -> None:
        """Detach the model before a candidate of another method (or the finalists:
        ``None``); candidates of one method in a row share what its build installs."""
        method = None if config is None else config.method
        if method is None or method != self.attached:
            KVCacheBuilder.detach(self.model)
        self.attached = method

    def expect(self, stage: str, units: float) -> None:
        """What is left of ``stage``, in ``COST`` units (an estimate until it starts)."""
        self.left[stage] = units
        self.bar.total = self.bar.n + sum(self.left.values())
        self.bar.refresh()

    def done(self, units: float, stage: str, t0: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0
        self.left[stage] = max(0.0, self.left.get(stage, 0.0) - units)
        self.bar.set_description_str(f"tune ({stage})", refresh=False)
        self.bar.update(units)


# About how long one task of each stage takes, relative to the others (for the progress
# bar's estimate of time left): bytes of one candidate, one screen, one finalist on one
# window (its prefill and decode steps), in seconds on the embedded model at 1024 tokens
# (tune --quick, 2026-12-03).
COST = {"calibration": 8.0, "recording": 6.0, "bytes": 0.3, "screen": 2.7, "final": 14.0}


def measure_bytes(run: Run, configs: list[KVCacheConfig]) -> dict[str, float | str]:
    """Declared bytes over fp16 of every candidate after the first window's context (or
    why the candidate cannot run on the model)."""
    todo = [c for c in configs if run.journal.get(f"declared:{c.to_string()}") is None]
    run.expect("bytes", COST["bytes"] * len(todo))
    for cfg in todo:
        t0 = time.perf_counter()
        rec = run.recording(0)
        run.switch(cfg)
        try:
            got: float | str = search.declared_ratio(run.model, cfg, rec, run.chunk)
        except (ValueError, NotImplementedError) as exc:  # refused on this model
            got = f"{type(exc).__name__}: {exc}"
        run.journal.put(f"declared:{cfg.to_string()}", got)
        run.done(COST["bytes"], "bytes", t0)
    run.switch(None)
    return {c.to_string(): run.journal.get(f"declared:{c.to_string()}") for c in configs}


def shortlist(configs: list[KVCacheConfig], ratios: dict[str, float],
              params: TuneParams) -> list[KVCacheConfig]:
    """Within budget, the ``per_method`` largest candidates of each family."""
    by_family: dict[str, list[KVCacheConfig]] = {}
    for cfg in configs:
        if ratios[cfg.to_string()] <= params.budget:
            by_family.setdefault(family(cfg), []).append(cfg)
    out = []
    for group in by_family.values():
        group.sort(key=lambda c: -ratios[c.to_string()])
        out.extend(group[:params.per_method])
    return out


def screen_length(params: TuneParams, w: int) -> int:
    """Decode steps of round ``w``'s screens: twice the last round's (fewer candidates
    are left), at most ``predict``."""
    return min(max(params.predict, params.screen_tokens), params.screen_tokens * 2 ** w)


def _needs_screen(entry: dict[str, Any] | None, speed: bool) -> bool:
    return entry is None or (speed and "screen_decode_ratio" not in entry)


def screen_round(run: Run, configs: list[KVCacheConfig], w: int, params: TuneParams,
                 later: float = 0.0) -> dict[str, dict[str, Any]]:
    """The short paired KL of every candidate on window ``w`` (and, on the first window
    with ``min_decode``, a few decode steps timed beside dense's); ``later``: the
    screens expected after this round (progress)."""
    n, speed = screen_length(params, w), params.min_decode is not None and w == 0
    key = f"screen:{w}:{n}:{{}}"
    todo = [c for c in configs if _needs_screen(run.journal.get(key.format(c.to_string())),
                                                speed)]
    run.expect("screens", COST["screen"] * len(todo) + later)
    for cfg in todo:
        t0 = time.perf_counter()
        rec, ref = run.recording(w), run.reference(w, n)
        run.switch(cfg)
        got = search.screen(run.model, cfg, rec, run.scored(w, n), ref, run.chunk, speed)
        run.journal.put(key.format(cfg.to_string()), got)
        run.done(COST["screen"], "screens", t0)
    run.switch(None)
    return {c.to_string(): run.journal.get(key.format(c.to_string())) for c in configs}


def _too_slow(entries: list[dict[str, Any]], params: TuneParams) -> bool:
    ratio = entries[0].get("screen_decode_ratio")
    return params.min_decode is not None and ratio is not None and \
        ratio < params.min_decode * SPEED_SLACK


def screens(run: Run, pool: list[KVCacheConfig], params: TuneParams
            ) -> tuple[list[KVCacheConfig], list[KVCacheConfig], dict[str, list[dict[str, Any]]]]:
    """Rounds of screens, one window each, halving the pool until at most twice
    ``finalists`` are left; returns the screened candidates ranked (the last round's
    survivors first, by mean screen KL), those too slow for ``min_decode`` apart (in
    the same order), and each one's screen figures per round."""
    figures: dict[str, list[dict[str, Any]]] = {}
    pool = list(pool)
    out: list[KVCacheConfig] = []
    slow: list[KVCacheConfig] = []
    for w in range(len(run.windows)):
        later = COST["screen"] * len(pool) / 2 if w + 1 < len(run.windows) else 0.0
        for spec, entry in screen_round(run, pool, w, params, later).items():
            figures.setdefault(spec, []).append(entry)
        pool.sort(key=lambda c: _screen_kl(figures[c.to_string()]))
        slow += [c for c in pool if _too_slow(figures[c.to_string()], params)]
        pool = [c for c in pool if c not in slow]
        keep = max(2 * params.finalists, (len(pool) + 1) // 2)
        if len(pool) <= 2 * params.finalists or w + 1 == len(run.windows):
            break
        out = pool[keep:] + out
        pool = pool[:keep]
    return pool + out, slow, figures


def _screen_kl(entries: list[dict[str, Any]]) -> float:
    """Mean KL over every token a candidate's screens read."""
    return float(np.mean(np.concatenate([e["kl_tokens"] for e in entries])))


def _screen_top1(entries: list[dict[str, Any]]) -> float:
    return sum(e["screen_top1"] * len(e["kl_tokens"]) for e in entries) / \
        sum(len(e["kl_tokens"]) for e in entries)


def _groups(configs: list[KVCacheConfig]) -> list[list[KVCacheConfig]]:
    """Finalists measured together: at most one method that hooks the model's modules
    per group (each installs its own state on them)."""
    hooked = [[c] for c in configs if get_method(c.method).profile.hooks_module]
    plain = [c for c in configs if not get_method(c.method).profile.hooks_module]
    if not hooked:
        return [plain] if plain else []
    hooked[0] = plain + hooked[0]
    return hooked


def _window_entry(got: dict[str, Any], spec: str) -> dict[str, Any]:
    own, dense = got[spec], got["dense"]
    return {"nll": own["nll"], "kl": own["kl"], "agree": own["agree"],
            "decode_s": own["decode_s"], "decode_steps": own["decode_steps"],
            "dense_nll": dense["nll"], "dense_decode_s": dense["decode_s"],
            "dense_decode_steps": dense["decode_steps"]}


def run_finalists(run: Run, configs: list[KVCacheConfig], params: TuneParams) -> None:
    """The harness run of every finalist the journal lacks, window after window. On the
    first each runs alone beside dense and its real bytes are read (two alive at once
    can share a buffer that one of them would not be charged for); on the others they
    run together (``_groups``), and a finalist clearly worse than the best eligible
    one on the windows so far stops (successive halving once more)."""
    live = [c for c in configs if run.journal.get(f"final:{c.to_string()}") is None]
    run.expect("finalists", COST["final"] * len(live) * len(run.windows))
    per: dict[str, dict[str, Any]] = {c.to_string(): {"windows": []} for c in live}
    for w in range(len(run.windows)):
        targets = run.scored(w, params.predict)
        for group in ([[c] for c in live] if w == 0 else _groups(live)):
            t0 = time.perf_counter()
            got = search.final_group(run.model, group, run.dense(w), targets,
                                     run.final_reference(w, params.predict), run.chunk, w == 0)
            for c in group:
                _add_window(per[c.to_string()], got, c.to_string(), w)
            run.done(COST["final"] * len(group), "finalists", t0)
        stopped = _outclassed(live, per, params)
        for spec, best in stopped.items():
            per[spec]["outclassed_by"] = best
        run.expect("finalists", max(0.0, run.left.get("finalists", 0.0) -
                                    COST["final"] * len(stopped) * (len(run.windows) - w - 1)))
        live = [c for c in live if c.to_string() not in stopped]
    for spec, entry in per.items():
        run.journal.put(f"final:{spec}", entry)


def _outclassed(live: list[KVCacheConfig], per: dict[str, dict[str, Any]],
                params: TuneParams) -> dict[str, str]:
    """The finalists whose KL so far is clearly above the best eligible one's: spec ->
    the best's spec."""
    rows = search.summarize({c.to_string(): per[c.to_string()] for c in live},
                            seed=params.seed)
    for c in live:
        rows[c.to_string()].update(real_over_fp16=per[c.to_string()]["real_over_fp16"])
    ok = [c for c in live if _eligible(rows[c.to_string()], params)]
    if not ok:
        return {}
    best = min(ok, key=lambda c: rows[c.to_string()]["kl"])
    runs = {c.to_string(): [{"kl_tokens": w["kl"]} for w in per[c.to_string()]["windows"]]
            for c in live}
    return {c.to_string(): best.to_string() for c in live if c is not best and
            _clearly_worse(runs[c.to_string()], runs[best.to_string()])}


def _add_window(entry: dict[str, Any], got: dict[str, Any], spec: str, w: int) -> None:
    entry["windows"].append(_window_entry(got, spec))
    if w == 0:  # bytes: read on the first window
        entry.update({k: v for k, v in got[spec].items() if k.endswith("fp16")})
        entry["real_over_fp16"] = max(entry["real_prefill_over_fp16"],
                                      entry["declared_decode_over_fp16"])


def _eligible(row: dict[str, Any], params: TuneParams) -> bool:
    fast = params.min_decode is None or row["decode_ratio"] >= params.min_decode
    return row["real_over_fp16"] <= params.budget and fast


SCREEN_BLOCKS = 8  # resampling blocks of a screen comparison (a screen reads few tokens)


def _clearly_worse(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Whether screen ``a``'s KL is above ``b``'s on the tokens both read: the paired
    block-bootstrap interval of the difference lies above 0."""
    n = min(len(a), len(b))
    diff = np.concatenate([np.subtract(x["kl_tokens"], y["kl_tokens"])
                           for x, y in zip(a[:n], b[:n])])
    return bootstrap_ci(diff, block=max(1, diff.size // SCREEN_BLOCKS))[0] > 0


def contenders(ranking: list[KVCacheConfig], figures: dict[str, list[dict[str, Any]]],
               limit: int) -> list[list[KVCacheConfig]]:
    """Batches of finalists down the ranking: the best screen and, of the next
    ``limit - 1``, those its screen does not beat clearly; then ``limit`` at a time."""
    best = figures[ranking[0].to_string()]
    first = [ranking[0]] + [c for c in ranking[1:limit]
                            if not _clearly_worse(figures[c.to_string()], best)]
    rest = [c for c in ranking if c not in first]
    return [first] + [rest[i:i + limit] for i in range(0, len(rest), limit)]


def finalists(run: Run, batches: list[list[KVCacheConfig]], params: TuneParams
              ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The batches of finalists in turn until one of them is eligible; the summarized
    rows of all measured and the eligible specs."""
    rows: dict[str, dict[str, Any]] = {}
    specs: list[str] = []
    for batch in batches:
        run_finalists(run, batch, params)
        specs += [c.to_string() for c in batch]
        entries = {s: run.journal.get(f"final:{s}") for s in specs}
        rows = search.summarize(entries, seed=params.seed)
        for s, row in rows.items():
            row.update({k: v for k, v in entries[s].items() if k != "windows"})
        # A finalist stopped early lost clearly to an eligible one: not a tie of it.
        ok = [s for s in specs if _eligible(rows[s], params) and "outclassed_by" not in rows[s]]
        if ok:
            return rows, ok
    return rows, []


def choose(quality: dict[str, dict[str, Any]], ratios: dict[str, float]
           ) -> tuple[str, list[str]]:
    """The lowest-KL spec, and the specs whose KL interval overlaps it (ties); among the
    ties the cheapest is chosen."""
    best = min(quality, key=lambda s: quality[s]["kl"])
    hi = (quality[best].get("kl_ci") or [quality[best]["kl"]] * 2)[1]
    ties = [s for s in quality if (quality[s].get("kl_ci") or [quality[s]["kl"]])[0] <= hi]
    chosen = min(ties, key=lambda s: (ratios[s], quality[s]["kl"]))
    return chosen, sorted(ties, key=lambda s: ratios[s])


def _candidates(run: Run, params: TuneParams) -> list[KVCacheConfig]:
    configs = candidate_configs(params.context, params.only)
    if params.mixed:
        configs += mixed_candidates(run.model, run.tokens, params, run.journal, run)
    return list({c.to_string(): c for c in configs}.values())


def _no_fit(ratios: dict[str, float], rows: dict[str, dict[str, Any]],
            params: TuneParams) -> NoFit:
    if not ratios:
        return NoFit("tune: no candidate runs on this model")
    if not rows:
        cheapest = min(ratios, key=ratios.get)
        return NoFit(f"tune: no candidate fits budget={params.budget}; the cheapest, "
                     f"{cheapest}, holds {ratios[cheapest]:.3f} of fp16")
    fits = [s for s in rows if rows[s]["real_over_fp16"] <= params.budget] or list(rows)
    fastest = max(fits, key=lambda s: rows[s]["decode_ratio"])
    return NoFit(f"tune: no candidate fits budget={params.budget} with decode >= "
                      f"{params.min_decode} x dense; the fastest measured, {fastest}, "
                      f"decodes at {rows[fastest]['decode_ratio']:.2f} x dense and holds "
                      f"{rows[fastest]['real_over_fp16']:.3f} of fp16")


def _expect_search(run: Run, configs: list[KVCacheConfig], params: TuneParams) -> None:
    """What is to come, guessed before the bytes say how much: a recording per window,
    the shortlist's bound (``per_method`` per family), half of it again per further
    round of screens, ``finalists`` on every window."""
    todo = [c for c in configs if run.journal.get(f"declared:{c.to_string()}") is None]
    n = min(len(configs), params.per_method * len({family(c) for c in configs}))
    if todo:
        run.expect("recording", COST["recording"] * len(run.windows))
    run.expect("bytes", COST["bytes"] * len(todo))
    run.expect("screens", COST["screen"] * n * (1 + 0.5 * (len(run.windows) > 1)))
    run.expect("finalists", COST["final"] * params.finalists * len(run.windows))


def tune_budget(run: Run, params: TuneParams) -> dict[str, Any]:
    """Measure (what the journal lacks) and choose for ``params.budget``."""
    _expect_search(run, candidate_configs(params.context, params.only), params)
    configs = _candidates(run, params)
    _expect_search(run, configs, params)
    measured = measure_bytes(run, configs)
    refused = {s: r for s, r in measured.items() if isinstance(r, str)}
    ratios = {s: r for s, r in measured.items() if not isinstance(r, str)}
    configs = [c for c in configs if c.to_string() in ratios]
    picks = shortlist(configs, ratios, params)
    if not picks:  # (refused ones are in the result's "refused", with the reason)
        raise _no_fit(ratios, {}, params)
    ranking, slow, figures = screens(run, picks, params)
    run.drop_calls()
    batches = contenders(ranking, figures, params.finalists) if ranking else []
    batches += [slow[i:i + params.finalists] for i in range(0, len(slow), params.finalists)]
    rows, ok = finalists(run, batches, params)
    if not ok:
        raise _no_fit(ratios, rows, params)
    chosen, ties = choose({s: rows[s] for s in ok}, {s: rows[s]["real_over_fp16"] for s in ok})
    return {
        "config": KVCacheConfig.from_string(chosen).to_dict(),
        "chosen": chosen,
        "ties": ties,
        "params": {k: v for k, v in vars(params).items() if k != "extra"},
        "stages": {"candidates": len(configs), "within_budget": sum(
            r <= params.budget for r in ratios.values()), "screened": len(picks),
            "finalists": len(rows), "seconds": dict(run.seconds)},
        "candidates": _candidate_rows(ratios, figures, rows),
        "refused": refused,
    }


def _candidate_rows(ratios: dict[str, float], figures: dict[str, list[dict[str, Any]]],
                    rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for spec, ratio in sorted(ratios.items(), key=lambda kv: kv[1]):
        row: dict[str, Any] = {"spec": spec, "family": family(KVCacheConfig.from_string(spec)),
                               "declared_over_fp16": ratio}
        if spec in figures:
            row.update(screen_kl=_screen_kl(figures[spec]),
                       screen_top1=_screen_top1(figures[spec]),
                       screen_tokens=sum(len(e["kl_tokens"]) for e in figures[spec]))
            speed = figures[spec][0].get("screen_decode_ratio")
            if speed is not None:
                row["screen_decode_ratio"] = speed
        row.update(rows.get(spec, {}))
        out.append(row)
    return out


def _start(model: nn.Module, tokenizer: Any, params: TuneParams, out: Path,
           text: str | None, progress: bool) -> Run:
    tokens = encode(tokenizer, load_text() if text is None else text)
    journal = Journal(out.with_suffix(".partial.json"), fingerprint(model, tokens, params))
    return Run(model, tokens, params, journal, progress)


def run_tune(model: nn.Module, tokenizer: Any, params: TuneParams, out: str | Path,
             text: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Measure, choose and write the result file; returns its content."""
    out = Path(out)
    run = _start(model, tokenizer, params, out, text, progress)
    try:
        result = tune_budget(run, params)
    finally:
        run.bar.close()
    write_text(out, json.dumps(result, indent=2) + "\n")
    return result


def run_frontier(model: nn.Module, tokenizer: Any, params: TuneParams,
                 budgets: Sequence[float], out: str | Path, text: str | None = None,
                 progress: bool = True) -> dict[str, Any]:
    """``tune`` at every budget on one journal; writes ``{"frontier": [...]}`` to ``out``
    (one result per budget, as ``run_tune`` writes them; budgets nothing fits are
    reported with the error)."""
    out = Path(out)
    run = _start(model, tokenizer, params, out, text, progress)
    frontier = []
    try:
        for budget in budgets:
            try:
                frontier.append(tune_budget(run, dataclasses.replace(params, budget=budget)))
            except NoFit as exc:
                frontier.append({"params": {"budget": budget}, "error": str(exc)})
    finally:
        run.bar.close()
    result = {"frontier": frontier}
    write_text(out, json.dumps(result, indent=2) + "\n")
    return result


def _ci(c: dict[str, Any], key: str) -> list[float]:
    return c.get(f"{key}_ci") or [c[key], c[key]]


def tune_markdown(result: dict[str, Any]) -> str:
    """The screened candidates (bytes, screen KL, and the finalists' paired figures)."""
    st = result["stages"]
    lines = [f"budget {result['params']['budget']:.3f} of fp16, context "
             f"{result['params']['context']}: chosen `{result['chosen']}` ({st['candidates']} "
             f"candidates, {st['within_budget']} within the budget by declared bytes, "
             f"{st['screened']} screened, {st['finalists']} finalists)", "",
             "| candidate | declared/fp16 | real/fp16 | screen KL | KL [95% CI] | top-1 | "
             "ppl/dense | decode/dense |", "|---|---:|---:|---:|---|---:|---:|---:|"]
    for c in result["candidates"]:
        if "screen_kl" not in c:
            continue
        head = f"| `{c['spec']}` | {c['declared_over_fp16']:.3f} | "
        if c.get("kl") is None:
            lines.append(head + f"- | {c['screen_kl']:.4f} | - | - | - | - |")
            continue
        ci = _ci(c, "kl")
        lines.append(head + f"{c['real_over_fp16']:.3f} | {c['screen_kl']:.4f} | "
                     f"{c['kl']:.4f} [{ci[0]:.4f}, {ci[1]:.4f}] | {c['top1']:.3f} | "
                     f"{c['ppl_ratio']:.4f} | {c['decode_ratio']:.2f} |")
    took = ", ".join(f"{k} {v:.0f} s" for k, v in st["seconds"].items())
    return "\n".join(lines + ["", f"seconds per stage: {took}"])


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
        cis = [_ci(c, k) for k in ("ppl_ratio", "kl", "top1")]
        lines.append(
            f"| {budget} | `{res['chosen']}` | {c['real_over_fp16']:.3f} | "
            f"{c['ppl_ratio']:.4f} [{cis[0][0]:.4f}, {cis[0][1]:.4f}] | {c['kl']:.4f} "
            f"[{cis[1][0]:.4f}, {cis[1][1]:.4f}] | {c['top1']:.3f} "
            f"[{cis[2][0]:.3f}, {cis[2][1]:.3f}] |")
    return "\n".join(lines)
