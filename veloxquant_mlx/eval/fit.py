"""The longest context that fits a memory budget, measured (``veloxquant bench --fit``).

For a model and a budget over the weights, every method (and mlx_lm's dense and 4-bit
caches) runs on mlx_lm's own path (``adapter.retained.measure_user_path``: the prompt
at mlx_lm's prompt step, then a few greedy tokens). The peak is modelled as
``a + b * context`` from a few short runs and extrapolated to the budget; the end
point is then verified by a run, and the search goes on between the longest context
that fitted and the shortest that did not until they are one ``step`` apart (or the
cap is reached): the answer is always a measured run, and so is one step beyond it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.nn as nn

from veloxquant_mlx.adapter.retained import USER_PREFILL_STEP, CacheSource, measure_user_path
from veloxquant_mlx.config import ConfigError
from veloxquant_mlx.eval.bench import PEAK_DECODE_STEPS, with_mlx_lm
from veloxquant_mlx.eval.perplexity import Spec, model_max_context
from veloxquant_mlx.eval.report import _mib, markdown_table, run_record, write_json

PROBES = (256, 512, 1024)  # the short runs the line is fitted to (cut to the cap)
MAX_RUNS = 12  # runs per method and budget after the probes

FIT_COLUMNS = [
    ("budget MiB", "budget_bytes", _mib),
    ("method", "method", None),
    ("longest context verified", "context", None),
    ("peak MiB at it", "peak_bytes", _mib),
    ("retained MiB at it", "retained_bytes", _mib),
    ("one step beyond", None, lambda r: "cap" if r["cap_reached"] else
     f"{r['beyond_context']} ({_mib(r['beyond_peak_bytes'])} MiB)"),
]


def line_fit(points: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """Least squares ``(a, b)`` of ``peak = a + b * context`` through ``points``."""
    n = len(points)
    mx_ = sum(c for c, _ in points) / n
    my = sum(p for _, p in points) / n
    var = sum((c - mx_) ** 2 for c, _ in points)
    b = sum((c - mx_) * (p - my) for c, p in points) / var if var else 0.0
    return my - b * mx_, b


def _next(lo: tuple[int, int] | None, hi: tuple[int, int] | None, budget: int,
          fit: tuple[float, float], step: int, cap: int) -> int:
    """The next context to run: extrapolated above the longest fit, interpolated
    between it and the shortest miss, halved below the shortest miss."""
    if lo is None:
        return max(1, hi[0] // 2 // step * step) if hi[0] > step else max(1, hi[0] // 2)
    if hi is None:
        a, b = fit
        guess = cap if b <= 0 else int((budget - a) / b)
        # At least a quarter further: a line through short runs can stall the search.
        least = lo[0] + max(step, lo[0] // 4 // step * step)
        return min(cap, max(least, guess // step * step))
    frac = (budget - lo[1]) / max(hi[1] - lo[1], 1)
    guess = int(lo[0] + frac * (hi[0] - lo[0])) // step * step
    return min(hi[0] - step, max(lo[0] + step, guess))


def fit_method(model: nn.Module, tokens: Sequence[int], source: CacheSource, budget: int,
               step: int = 256, cap: int | None = None, probes: Sequence[int] = PROBES,
               decode_steps: int = PEAK_DECODE_STEPS, prefill_step: int = USER_PREFILL_STEP,
               on_run: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The longest context (a multiple of ``step``, or ``cap``) whose measured peak over
    the weights stays within ``budget`` bytes; ``context`` 0 if not even one step fits."""
    cap = min(len(tokens), cap or len(tokens))
    runs: dict[int, dict[str, Any]] = {}

    def run(context: int) -> dict[str, Any]:
        if on_run:
            on_run(context)
        runs[context] = measure_user_path(model, source, tokens[:context], decode_steps,
                                          prefill_step)
        return runs[context]

    for c in sorted({min(p, cap) for p in probes}):
        run(c)
    for _ in range(MAX_RUNS):
        fit = _line(runs, prefill_step)
        fits = [c for c, r in runs.items() if r["peak_bytes"] <= budget]
        misses = [c for c, r in runs.items() if r["peak_bytes"] > budget and
                  (not fits or c > max(fits))]
        lo = (max(fits), runs[max(fits)]["peak_bytes"]) if fits else None
        hi = (min(misses), runs[min(misses)]["peak_bytes"]) if misses else None
        if (lo and lo[0] >= cap) or (lo and hi and hi[0] - lo[0] <= step) or \
                (not lo and hi[0] <= 1):
            break
        run(_next(lo, hi, budget, fit, step, cap))
    return _result(runs, budget, cap, _line(runs, prefill_step))


def _line(runs: dict[int, dict[str, Any]], prefill_step: int) -> tuple[float, float]:
    """The peak's line through the runs of at least one prompt step (below it the whole
    prompt is one step and the working set grows with it), or through all of them."""
    long = [(c, r["peak_bytes"]) for c, r in runs.items() if c >= prefill_step]
    return line_fit(long if len(long) >= 2 else [(c, r["peak_bytes"]) for c, r in runs.items()])


def _result(runs: dict[int, dict[str, Any]], budget: int, cap: int,
            fit: tuple[float, float]) -> dict[str, Any]:
    fits = [c for c, r in runs.items() if r["peak_bytes"] <= budget]
    best = max(fits, default=0)
    beyond = min((c for c in runs if c > best), default=None)
    at = runs.get(best, {"peak_bytes": 0, "retained_bytes": 0})
    return {"budget_bytes": budget, "context": best, "peak_bytes": at["peak_bytes"],
            "retained_bytes": at["retained_bytes"], "cap": cap, "cap_reached": best >= cap,
            "beyond_context": beyond,
            "beyond_peak_bytes": runs[beyond]["peak_bytes"] if beyond else None,
            "fit_a_bytes": fit[0], "fit_b_bytes_per_token": fit[1],
            "runs": [{"context": c, "peak_bytes": r["peak_bytes"],
                      "retained_bytes": r["retained_bytes"], "seconds": r["seconds"]}
                     for c, r in sorted(runs.items())]}


def fit_contexts(model: nn.Module, tokens: Sequence[int], specs: Sequence[Spec] | str,
                 budgets: Sequence[int], step: int = 256, cap: int | None = None,
                 progress: bool = True, **kw: Any) -> list[dict[str, Any]]:
    """One row per (budget, method): :func:`fit_method` for every method, mlx_lm's dense
    and 4-bit caches included; a progress bar with a time estimate."""
    from tqdm.auto import tqdm

    if step < 1 or any(b <= 0 for b in budgets):
        raise ConfigError(f"fit: step={step}, budgets={list(budgets)}: a step >= 1 and "
                         "budgets > 0 bytes are needed")
    limit = model_max_context(model)
    if limit is not None:
        cap = min(cap or limit, limit - kw.get("decode_steps", PEAK_DECODE_STEPS))
    methods = with_mlx_lm(specs, model)
    rows = []
    bar = tqdm(total=len(budgets) * len(methods), disable=not progress, desc="fit",
               unit="method")
    for budget in budgets:
        for m in methods:
            def show(context: int, label: str = m.label) -> None:
                bar.set_postfix_str(f"{label} at {context} tokens")
            rows.append({"method": m.label, **fit_method(
                model, tokens, m.source, budget, step, cap, on_run=show, **kw)})
            bar.update(1)
    bar.close()
    return rows


def fit_markdown(rows: list[dict[str, Any]], command: str = "") -> str:
    """The table: budget, method, longest context verified, peak and retained at it."""
    head = [f"Command: `{command}`", ""] if command else []
    return "\n".join(head + [
        "Longest context whose measured peak over the weights (mlx_lm's own path, "
        "prompt and greedy tokens) stays within the budget; one step beyond it was "
        "measured over the budget, or the cap (model limit or text length) was reached.",
        "", markdown_table(rows, FIT_COLUMNS), ""])


def run_fit(model: nn.Module, tokens: Sequence[int], specs: Sequence[Spec] | str,
            budgets: Sequence[int], out_dir: str | Path = "bench-out", step: int = 256,
            cap: int | None = None, argv: list[str] | None = None,
            progress: bool = True) -> dict[str, Any]:
    """:func:`fit_contexts`, written to ``out_dir`` as ``fit.json`` and ``fit.md``."""
    rows = fit_contexts(model, tokens, specs, budgets, step, cap, progress)
    record = run_record(argv, budgets=list(budgets), step=step, cap=cap, fit=rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "fit.json", record)
    (out / "fit.md").write_text(fit_markdown(rows, record["command"]))
    record["files"] = {"json": str(out / "fit.json"), "md": str(out / "fit.md")}
    return record
