"""``veloxquant tune``: candidates within the budget, a measured choice, resumable runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.eval import tune
from veloxquant_mlx.testing.tiny import tiny_model

TEXT = " ".join(f"sentence {i} tells the story of the number {i * 7 % 13}." for i in range(300))


class CharTokenizer:
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 127 + 1 for c in text]


def _params(budget: float, **kw) -> tune.TuneParams:
    kw.setdefault("only", ("turboquant",))
    return tune.TuneParams(budget=budget, context=192, predict=16, windows=2, per_method=2,
                           **kw)


def test_choice_fits_the_budget_and_beats_what_it_passed_over(tmp_path: Path,
                                                              monkeypatch) -> None:
    model = tiny_model("llama", head_dim=64, num_attention_heads=2)
    out = tmp_path / "best.json"
    result = tune.run_tune(model, CharTokenizer(), _params(0.45), out, text=TEXT,
                           progress=False)
    cands = {c["spec"]: c for c in result["candidates"]}
    chosen = cands[result["chosen"]]
    assert chosen["real_over_fp16"] <= 0.45
    scored = [c for c in cands.values() if c.get("kl") is not None]
    assert len(scored) >= 2 and all(c["real_over_fp16"] <= 0.45 for c in scored)
    # No scored candidate is clearly better: the choice is the best or a tie with it.
    assert all(chosen["kl"] <= c["kl_ci"][1] for c in scored)
    # The file loads as a config, with --config semantics.
    assert KVCacheConfig.from_file(out).to_string() == result["chosen"]

    # A second run resumes from the journal: nothing is measured again.
    def boom(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(tune, "measure_retained", boom)
    monkeypatch.setattr(tune, "evaluate_quality", boom)
    again = tune.run_tune(model, CharTokenizer(), _params(0.45), out, text=TEXT,
                          progress=False)
    assert again["chosen"] == result["chosen"]


def test_an_impossible_budget_names_the_cheapest_candidate(tmp_path: Path) -> None:
    model = tiny_model("llama", head_dim=64, num_attention_heads=2)
    with pytest.raises(ValueError, match="no candidate fits budget=0.01; the cheapest"):
        tune.run_tune(model, CharTokenizer(), _params(0.01, mixed=False), tmp_path / "x.json",
                      text=TEXT, progress=False)


def test_budget_from_bytes_and_bad_input() -> None:
    model = tiny_model("llama")  # 4 layers x 2 KV heads x (32 + 32) x 2 bytes per token
    assert tune.budget_for_memory(model, 4 * 2 * 64 * 2 * 100, 400) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="budget=0"):
        tune.TuneParams(budget=0)
    with pytest.raises(ValueError, match="unknown method"):
        tune.candidate_configs(1024, ("nosuch",))


def test_the_journal_is_ignored_for_another_run(tmp_path: Path) -> None:
    path = tmp_path / "j.partial.json"
    tune.Journal(path, "aaa").put("bytes:x", 0.5)
    assert tune.Journal(path, "aaa").get("bytes:x") == 0.5
    assert tune.Journal(path, "bbb").get("bytes:x") is None
    assert json.loads(path.read_text())["fingerprint"] == "aaa"


def test_frontier_shares_measurements_and_mixes_widths_per_budget(tmp_path: Path,
                                                                   monkeypatch) -> None:
    """Several budgets on one journal: a candidate's bytes are measured once; each budget
    gets calibrated mixed-precision candidates that fit it; families are shortlisted
    apart (a stack is not crowded out by its plain method)."""
    model = tiny_model("llama", head_dim=64, num_attention_heads=2)
    measured: list[str] = []
    real = tune.measure_retained

    def counting(model, cfg, *a, **k):
        measured.append(cfg.to_string())
        return real(model, cfg, *a, **k)

    def quality(model, tok, configs, *a, **k):  # cheapest first: a stand-in score
        return {"rows": [{"method": c.to_string(), "ppl_ratio": 1.0, "ppl_ratio_ci": [1, 1],
                          "kl": 1.0 / (1 + i), "kl_ci": [0.9 / (1 + i), 1.1 / (1 + i)],
                          "top1": 0.9, "top1_ci": [0.9, 0.9]} for i, c in enumerate(configs)]}

    grid = ["turboquant:k_bits=4,v_bits=4,window=8", "turboquant:k_bits=2,v_bits=2,window=8",
            "streaming:window=140", "streaming:window=140,store=codebook,k_bits=3,v_bits=3"]
    monkeypatch.setattr(tune, "candidate_configs",
                        lambda *a: [KVCacheConfig.from_string(g) for g in grid])
    monkeypatch.setattr(tune, "measure_retained", counting)
    monkeypatch.setattr(tune, "evaluate_quality", quality)
    params = _params(0.5, only=("turboquant",))
    result = tune.run_frontier(model, CharTokenizer(), params, (0.5, 0.35), tmp_path / "f.json",
                               text=TEXT, progress=False)
    assert len(measured) == len(set(measured))  # nothing measured twice
    fams = []
    for budget, res in zip((0.5, 0.35), result["frontier"]):
        cands = res["candidates"]
        scored = [c for c in cands if c.get("kl") is not None]
        assert scored and all(c["real_over_fp16"] <= budget for c in scored)
        fams.append({c["family"] for c in scored})
    # At 0.5 every width is the widest (a uniform config); at 0.35 widths are mixed.
    mixed = [c for c in result["frontier"][1]["candidates"] if c["family"] == "turboquant+mixed"]
    assert mixed and min(c["real_over_fp16"] for c in mixed) <= 0.35
    # 0.5: the dense window (0.73 of fp16) is out, its codebook stack is in.
    assert "streaming+store=codebook" in fams[0] and "streaming" not in fams[0]
    assert json.loads((tmp_path / "f.json").read_text())["frontier"][1]["params"]["budget"] == 0.35
    table = tune.frontier_markdown(result).splitlines()
    assert len(table) == 4 and table[3].startswith(f"| 0.35 | `{result['frontier'][1]['chosen']}`")


@pytest.mark.parametrize("budget", ["abc", "0.5,x", ","])
def test_cli_refuses_a_bad_budget_list(budget: str, tmp_path: Path, capsys,
                                       monkeypatch) -> None:
    from veloxquant_mlx import cli
    from veloxquant_mlx.apps import blas

    monkeypatch.setattr(blas, "ensure_fast_blas", lambda argv=None: None)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["tune", "--budget", budget, "--out", str(tmp_path / "t.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--budget={budget!r} is not allowed" in err and "Traceback" not in err
