"""The prompt's working set on mlx_lm's own path does not grow with the context.

``measure_user_path`` runs a prompt through mlx_lm's ``generate_step`` (what
``stream_generate`` runs) with the caches as ``prompt_cache`` and a fixed prompt step,
then a few greedy tokens; the working set is MLX's peak minus what stays alive after,
both over the reading before the caches existed. For every method it must stay within
``memory.prompt_working_bound`` (the formula of docs/cpu-performance.md, "What the
library adds to the peak") over the model's own need for one prompt step (mlx_lm's
dense cache over one step), at a short and a four times longer context; and between the
two it may grow only by the decode term's part below ``kernels.BLOCK`` tokens. mlx_lm's
dense ``KVCache`` (its score rows span the whole context) fails the same check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import small_config

from veloxquant_mlx.adapter.retained import MLX_LM_CACHES, measure_user_path
from veloxquant_mlx.memory import held_prompt_bytes, prompt_working_bound
from veloxquant_mlx.ops.kernels import BLOCK
from veloxquant_mlx.registry import methods
from veloxquant_mlx.testing.tiny import tiny_model

STEP = 256  # the prompt step: fixed, as a user's prefill_step_size is
SHORT, LONG = 1024, 4096
DECODE = 2
NOISE = 1 << 20  # allocator readings of one run against another: within a MiB
TOKENS = [(i * 37 + 11) % 120 + 1 for i in range(LONG)]


@pytest.fixture(scope="module")
def model() -> Any:
    # head_dim 64: mlx_lm's 4-bit cache quantizes in groups of 64.
    return tiny_model("llama", head_dim=64, num_hidden_layers=3)


@pytest.fixture(scope="module")
def own_need(model: Any) -> int:
    """The model's own working set for one prompt step: mlx_lm's dense cache over it."""
    return measure_user_path(model, MLX_LM_CACHES["mlx_lm:dense"], TOKENS[:STEP + 1],
                             DECODE, STEP)["working_bytes"]


def bound(model: Any) -> int:
    a = model.args
    return prompt_working_bound(STEP, a.num_attention_heads, a.num_key_value_heads,
                                a.head_dim, a.head_dim, a.num_hidden_layers)


def growth_allowance(model: Any) -> int:
    """The decode term's growth from ``SHORT`` to ``LONG`` tokens (flat past ``BLOCK``)."""
    a = model.args
    tokens = min(LONG, BLOCK) - min(SHORT, BLOCK)
    return 4 * a.num_hidden_layers * tokens * a.num_key_value_heads * 2 * a.head_dim


def held_prompt(model: Any, holds: bool) -> Callable[[int], int]:
    """What a method that keeps the prompt until it ends may add at ``n`` tokens."""
    a = model.args
    return lambda n: held_prompt_bytes(n, a.num_key_value_heads, a.head_dim, a.head_dim,
                                       a.num_hidden_layers) if holds else 0


def check_working_set(model: Any, source: Any, own: int,
                      held: Callable[[int], int] | None = None
                      ) -> list[str]:
    """What is wrong with ``source``'s working sets at the two contexts (empty: none)."""
    held = held or (lambda n: 0)
    work = {n: measure_user_path(model, source, TOKENS[:n], DECODE, STEP)["working_bytes"]
            for n in (SHORT, LONG)}
    mib, allowed = 2**20, growth_allowance(model) + held(LONG) - held(SHORT)
    faults = [f"{n} tokens: working set {w / mib:.2f} MiB over the bound "
              f"{(own + bound(model) + held(n)) / mib:.2f}"
              for n, w in work.items() if w > own + bound(model) + held(n)]
    if work[LONG] - work[SHORT] > allowed + NOISE:
        faults.append(f"grew {(work[LONG] - work[SHORT]) / mib:.2f} MiB from {SHORT} to "
                      f"{LONG} tokens (allowed {allowed / mib:.2f})")
    return faults


def test_working_set_does_not_grow(model: Any, own_need: int, method: str) -> None:
    if method == "none":
        pytest.skip("the dense reference: test_the_dense_reference_is_mlx_lm_s_cache")
    holds = methods()[method].profile.holds_prompt
    assert check_working_set(model, small_config(method), own_need,
                             held_prompt(model, holds)) == []


def test_the_dense_reference_is_mlx_lm_s_cache(model: Any) -> None:
    """``none`` is the reference every figure is read against: mlx_lm's ``KVCache``
    layout under mlx_lm's own attention, so its working set is mlx_lm's (growing with
    the context, as the next test shows), within the allocator's noise."""
    for n in (SHORT, LONG):
        ours, theirs = (measure_user_path(model, source, TOKENS[:n], DECODE, STEP)
                        for source in (small_config("none"), MLX_LM_CACHES["mlx_lm:dense"]))
        assert abs(ours["working_bytes"] - theirs["working_bytes"]) <= NOISE, n
        assert abs(ours["retained_bytes"] - theirs["retained_bytes"]) <= NOISE, n


def test_dense_kvcache_fails_the_check(model: Any, own_need: int) -> None:
    """The check tells a growing working set: mlx_lm's dense cache fails it."""
    faults = check_working_set(model, MLX_LM_CACHES["mlx_lm:dense"], own_need)
    assert any("grew" in f for f in faults), faults


# ------------------------------------------------------------------ bench --fit
def test_fit_finds_the_longest_context_that_fits(model: Any) -> None:
    """The verified end point fits the budget and one step beyond does not, re-measured
    here (mlx_lm's dense cache, whose peak grows with the context)."""
    from veloxquant_mlx.eval.fit import fit_method

    budget, step, dense = 12 << 20, 256, MLX_LM_CACHES["mlx_lm:dense"]
    row = fit_method(model, TOKENS, dense, budget, step, cap=LONG, probes=(256, 512),
                     decode_steps=DECODE, prefill_step=STEP)
    end = row["context"]
    assert 512 < end < LONG and not row["cap_reached"] and row["beyond_context"] == end + step
    assert row["peak_bytes"] <= budget < row["beyond_peak_bytes"]
    again = {n: measure_user_path(model, dense, TOKENS[:n], DECODE, STEP)["peak_bytes"]
             for n in (end, end + step)}
    assert again[end] <= budget + NOISE and again[end + step] > budget - NOISE


def test_cli_fit_parses_budgets_before_loading(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Any) -> None:
    from veloxquant_mlx import cli
    from veloxquant_mlx.config import ConfigError

    def no_load(*a: Any, **k: Any) -> None:
        raise AssertionError("model loaded before the budgets were checked")

    monkeypatch.setattr("veloxquant_mlx.models.load", no_load)
    for bad in ("lots", ",", "0MB"):
        args = cli.build_parser().parse_args(["bench", "--fit", bad])
        with pytest.raises(ConfigError, match=f"--fit='{bad}' is not allowed"):
            args.func(args)
    seen: dict[str, Any] = {}

    def fake_fit(model: Any, tokens: Any, specs: Any, budgets: Any, out: Any, step: int,
                 cap: Any, progress: bool) -> dict[str, Any]:
        seen.update(budgets=budgets, step=step, cap=cap)
        (tmp_path / "fit.md").write_text("table")
        return {"files": {"json": "fit.json", "md": str(tmp_path / "fit.md")}}

    monkeypatch.setattr("veloxquant_mlx.models.load", lambda path, dtype=None: (None, None))
    monkeypatch.setattr("veloxquant_mlx.eval.fit.run_fit", fake_fit)
    monkeypatch.setattr("veloxquant_mlx.eval.text.encode", lambda tok, text: [1, 2])
    args = cli.build_parser().parse_args(["bench", "--fit", "256MB,1MiB", "--fit-step",
                                          "128", "--fit-cap", "2048"])
    assert args.func(args) == 0
    assert seen == {"budgets": [256_000_000, 2**20], "step": 128, "cap": 2048}


def test_eval_reports_the_peak_beside_mlx_lm() -> None:
    from test_eval import TEXT, CharTokenizer

    from veloxquant_mlx.eval.sweep import eval_markdown, run_eval

    spec = "affine:bits=4,group_size=32"
    rec = run_eval(tiny_model("llama"), CharTokenizer(), f"none,{spec}", "ppl",
                   {"contexts": [64], "predict": 8, "windows": 1, "block": 8,
                    "n_boot": 100, "memory_steps": 2}, text=TEXT, progress=False)
    peak = {r["method"]: r for r in rec["results"][0]["peak"]}
    assert list(peak) == ["none", spec, "mlx_lm:dense"]  # head width 32: no mlx_lm:q4
    assert peak[spec]["retained_bytes"] < peak["mlx_lm:dense"]["retained_bytes"] / 4
    assert all(r["peak_bytes"] >= r["retained_bytes"] > 0 for r in peak.values())
    assert "| mlx_lm:dense | 64 |" in eval_markdown(rec)
    rec = run_eval(tiny_model("llama"), CharTokenizer(), "none", "ppl",
                   {"contexts": [64], "predict": 8, "windows": 1, "block": 8,
                    "n_boot": 100, "memory_steps": 2}, text=TEXT, progress=False, peak=False)
    assert "peak" not in rec["results"][0]


def test_fit_reaches_a_flat_working_set_s_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peak that climbs over the short probes (one prompt step holds the whole prompt)
    and then stays flat: the search must not creep a step at a time from the probes'
    line; it verifies the cap within a handful of runs."""
    from veloxquant_mlx.eval import fit

    step_tokens, seen = 2048, []

    def fake(model: Any, source: Any, tokens: Any, decode: int, prefill: int) -> dict:
        n = len(tokens)
        seen.append(n)
        peak = 60_000 * min(n, step_tokens) + 20 * n  # bytes: steep, then nearly flat
        return {"peak_bytes": peak, "retained_bytes": 20 * n, "seconds": 0.0}

    monkeypatch.setattr(fit, "measure_user_path", fake)
    row = fit.fit_method(None, list(range(32768)), None, 256 << 20, 256,
                         prefill_step=step_tokens)
    assert row["cap_reached"] and row["context"] == 32768
    assert len(seen) <= 8, seen
