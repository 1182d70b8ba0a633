"""``veloxquant tune``: the replayed screens agree with real prefills, the choice fits
the budget (and the speed asked) and beats what it passed over, runs resume."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.adapter.builder import KVCacheBuilder, cache_stats
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.adapter.retained import build_caches
from veloxquant_mlx.eval import tune, tune_replay, tune_search
from veloxquant_mlx.testing.tiny import tiny_model

TEXT = " ".join(f"sentence {i} tells the story of the number {i * 7 % 13}." for i in range(300))
TOKENS = [ord(c) % 127 + 1 for c in TEXT]
CONTEXT = 192


class CharTokenizer:
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 127 + 1 for c in text]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", head_dim=64, num_attention_heads=2)


def _params(budget: float, **kw) -> tune.TuneParams:
    kw.setdefault("only", ("turboquant",))
    return tune.TuneParams(budget=budget, context=CONTEXT, predict=16, windows=2,
                           per_method=2, screen_tokens=32, **kw)


def _prefilled(model, cfg: KVCacheConfig, n: int) -> tuple[float, mx.array]:
    """Declared bytes over fp16 after a real prefill of the context, and the log-probs
    of ``n`` teacher-forced decode steps after it."""
    caches = build_caches(model, cfg)
    prefill(model, caches, TOKENS[:CONTEXT])
    s = cache_stats(caches)
    logp = mx.stack([tune_search.log_probs(model(mx.array([[t]]), cache=caches)[0, -1])
                     for t in TOKENS[CONTEXT:CONTEXT + n]])
    mx.eval(logp)
    del caches
    KVCacheBuilder.detach(model)
    return s["held_bytes"] / s["fp16_bytes"], logp


SPECS = ["affine:bits=4,group_size=32,window=8", "turboquant:k_bits=2,v_bits=2,window=8",
         "snapkv:capacity=48,store=codebook", "xkv:rank_k=64,rank_v=64,factor_bits=4,block=64",
         "minicache:bits=4,window=8", "streaming:window=60", "kivi:bits=2,window=32",
         "xquant:bits=4,group_size=32", "xquant_cl:bits=2,group_size=32"]


# Methods whose one-chunk prefill attends over the exact keys and values: the replay's
# KL is theirs. The others attend over their codes or a window already in the prefill,
# an error of later layers' inputs that the replay does not reproduce.
EXACT_PREFILL = ("turboquant", "snapkv", "xkv", "kivi", "xquant")


def test_replayed_screens_agree_with_real_prefills(model) -> None:
    """Bytes declared after the replay equal those after a real prefill, for layers,
    stores, evictions, cross-layer pairs and groups and (extrapolated) X caches; the
    replay's KL is the real prefill's where the prefill attends over exact keys and
    values, at most it elsewhere, and tells a bad setting from a good one."""
    rec = tune_replay.record(model, TOKENS[:CONTEXT])
    n = 32
    ref = tune_search.dense_reference(model, rec, TOKENS[CONTEXT:CONTEXT + n])
    kls = {}
    for spec in SPECS:
        cfg = KVCacheConfig.from_string(spec)
        real_ratio, logp = _prefilled(model, cfg, n)
        assert tune_search.declared_ratio(model, cfg, rec, 512) == pytest.approx(
            real_ratio, rel=1e-9), spec
        got = tune_search.screen(model, cfg, rec, TOKENS[CONTEXT:CONTEXT + n], ref, 512)
        real_kl = float(tune_search.compare(logp, ref)[0].mean())
        if spec.startswith(EXACT_PREFILL):
            assert got["screen_kl"] == pytest.approx(real_kl, rel=0.05, abs=1e-6), spec
        else:
            assert 0 < got["screen_kl"] <= 1.1 * real_kl, spec
        assert got["replayed"] == (not spec.startswith("xquant")), spec
        kls[spec] = got["screen_kl"]
    assert kls["turboquant:k_bits=2,v_bits=2,window=8"] > \
        3 * kls["affine:bits=4,group_size=32,window=8"]


def test_choice_fits_the_budget_and_beats_what_it_passed_over(tmp_path: Path, model,
                                                              monkeypatch) -> None:
    from veloxquant_mlx import cli

    out = tmp_path / "best.json"
    monkeypatch.setattr(tune, "_clearly_worse", lambda a, b: False)  # two finalists
    result = tune.run_tune(model, CharTokenizer(), _params(0.45), out, text=TEXT,
                           progress=False)
    cands = {c["spec"]: c for c in result["candidates"]}
    chosen = cands[result["chosen"]]
    assert chosen["real_over_fp16"] <= 0.45
    screened = [c for c in cands.values() if "screen_kl" in c]
    final = [c for c in screened if c.get("kl") is not None]
    assert len(screened) >= 4 and all(c["declared_over_fp16"] <= 0.45 for c in screened)
    assert not any("screen_kl" in c for c in cands.values() if c["declared_over_fp16"] > 0.45)
    # Finalists are the best screens, and none of them is clearly better than the choice.
    assert chosen["screen_kl"] <= sorted(c["screen_kl"] for c in screened)[len(final) - 1]
    assert all(chosen["kl"] <= c["kl_ci"][1] for c in final)
    assert all(c["kl_ci"][0] <= c["kl"] <= c["kl_ci"][1] and 0 < c["decode_ratio"]
               for c in final)
    # Each finalist's allocator reading is its own (none shares a buffer with another).
    assert len(final) == 2 and all(c["real_prefill_over_fp16"] == pytest.approx(
        c["declared_prefill_over_fp16"], rel=0.01) for c in final)
    table = tune.tune_markdown(result)
    assert f"chosen `{result['chosen']}`" in table and "seconds per stage: " in table
    # The file loads as a config, with --config semantics.
    assert KVCacheConfig.from_file(out).to_string() == result["chosen"]
    args = argparse.Namespace(config=str(out), method=None)
    assert cli.config_from_args(args).to_string() == result["chosen"]

    # A second run resumes from the journal: nothing is measured again.
    def boom(*a, **k):
        raise AssertionError("measured again")

    for name in ("declared_ratio", "screen", "final_group", "dense_reference"):
        monkeypatch.setattr(tune_search, name, boom)
    monkeypatch.setattr(tune, "record", boom)
    monkeypatch.setattr(tune.mixed, "fisher", boom)
    again = tune.run_tune(model, CharTokenizer(), _params(0.45), out, text=TEXT,
                          progress=False)
    assert again["chosen"] == result["chosen"]


def test_min_decode_is_measured_beside_dense(tmp_path: Path, model, monkeypatch) -> None:
    """With the decode steps of the choice made twenty times slower, --min-decode at a
    sixth of its speed rules it out from its speed measured beside dense's, and the
    next finalist is chosen; an impossible speed names the fastest finalist."""
    params, out = _params(0.45, mixed=False, finalists=1), tmp_path / "t.json"
    plain = tune.run_tune(model, CharTokenizer(), params, out, text=TEXT, progress=False)
    real_step = tune_search._step

    def slow_choice(model, caches, token):
        logits, dt = real_step(model, caches, token)
        cfg = getattr(caches[0], "config", None)
        if cfg is not None and cfg.to_string() == plain["chosen"]:
            time.sleep(19 * dt)  # twenty times slower, as a slow kernel would be
            dt *= 20
        return logits, dt

    monkeypatch.setattr(tune_search, "_step", slow_choice)
    monkeypatch.setattr(tune, "SPEED_SLACK", 0.0)  # the screens let every speed through
    journal = out.with_suffix(".partial.json")  # the finalists are measured again
    data = json.loads(journal.read_text())
    data["entries"] = {k: v for k, v in data["entries"].items() if not k.startswith("final:")}
    journal.write_text(json.dumps(data))
    speed = next(c for c in plain["candidates"] if c["spec"] == plain["chosen"])["decode_ratio"]
    need = speed / 6  # the others decode at about its speed: far above this
    fast = tune.run_tune(model, CharTokenizer(), dataclasses.replace(params, min_decode=need),
                         out, text=TEXT, progress=False)
    rows = {c["spec"]: c for c in fast["candidates"]}
    assert fast["chosen"] != plain["chosen"] and rows[fast["chosen"]]["decode_ratio"] >= need
    assert rows[plain["chosen"]]["decode_ratio"] < need
    # With the screens' own speed check on, the slow one is no longer a finalist at all.
    monkeypatch.setattr(tune, "SPEED_SLACK", 0.85)
    again = tune.run_tune(model, CharTokenizer(), dataclasses.replace(params, min_decode=need),
                          out, text=TEXT, progress=False)
    rows = {c["spec"]: c for c in again["candidates"]}
    assert rows[plain["chosen"]]["screen_decode_ratio"] < need and "kl" not in rows[plain["chosen"]]
    with pytest.raises(ValueError, match="decode >= 1000.0 x dense; the fastest measured"):
        tune.run_tune(model, CharTokenizer(), dataclasses.replace(params, min_decode=1000.0),
                      out, text=TEXT, progress=False)


def test_finalists_are_the_screens_that_the_best_does_not_beat_clearly() -> None:
    rng = np.random.default_rng(0)
    base = rng.exponential(0.01, 128)
    def noisy(scale: float) -> list[float]:  # mean scale x base: another method, same tokens
        return (base * scale * rng.lognormal(-0.125, 0.5, base.size)).tolist()

    figs = {"a": [{"kl_tokens": base.tolist()}], "b": [{"kl_tokens": noisy(1.0)}],
            "c": [{"kl_tokens": noisy(3.0)}], "d": [{"kl_tokens": noisy(1.0)}]}
    cfgs = {k: KVCacheConfig.from_string(s) for k, s in
            zip("abcd", ("turboquant", "kivi", "affine", "snapkv"))}
    batches = tune.contenders([cfgs[k] for k in "abcd"],
                              {cfgs[k].to_string(): v for k, v in figs.items()}, limit=3)
    # c is clearly worse than a: not a finalist with it (but next, if a and b fail).
    assert [[c.method for c in b] for b in batches] == \
        [["turboquant", "kivi"], ["affine", "snapkv"]]


def test_a_finalist_clearly_worse_than_an_eligible_one_stops() -> None:
    rng = np.random.default_rng(1)
    base = rng.exponential(0.01, 64)

    def entry(kl: np.ndarray, real: float) -> dict:
        win = {"nll": (1 + kl).tolist(), "kl": kl.tolist(), "agree": [1.0] * 64,
               "decode_s": 1.0, "decode_steps": 10, "dense_nll": [1.0] * 64,
               "dense_decode_s": 1.0, "dense_decode_steps": 10}
        return {"windows": [win], "real_over_fp16": real}

    live = [KVCacheConfig.from_string(s) for s in ("turboquant", "kivi", "affine")]
    per = {"turboquant": entry(base, 0.2), "kivi": entry(base * 3 + 0.01, 0.2),
           "affine": entry(base * 0.5, 0.3)}  # the best KL, but above the budget
    params = _params(0.25)
    # kivi lost clearly to turboquant, the best within the budget; affine is over it.
    assert tune._outclassed(live, per, params) == {"kivi": "turboquant"}


def test_an_impossible_budget_names_the_cheapest_candidate(tmp_path: Path, model) -> None:
    with pytest.raises(ValueError, match="no candidate fits budget=0.01; the cheapest"):
        tune.run_tune(model, CharTokenizer(), _params(0.01, mixed=False), tmp_path / "x.json",
                      text=TEXT, progress=False)


def test_budget_from_bytes_and_bad_input() -> None:
    model = tiny_model("llama")  # 4 layers x 2 KV heads x (32 + 32) x 2 bytes per token
    assert tune.budget_for_memory(model, 4 * 2 * 64 * 2 * 100, 400) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="budget=0"):
        tune.TuneParams(budget=0)
    with pytest.raises(ValueError, match="min_decode=0"):
        tune.TuneParams(budget=0.2, min_decode=0)
    with pytest.raises(ValueError, match="unknown method"):
        tune.candidate_configs(1024, ("nosuch",))


def test_the_journal_is_ignored_for_another_run(tmp_path: Path) -> None:
    path = tmp_path / "j.partial.json"
    tune.Journal(path, "aaa").put("bytes:x", 0.5)
    assert tune.Journal(path, "aaa").get("bytes:x") == 0.5
    assert tune.Journal(path, "bbb").get("bytes:x") is None
    assert json.loads(path.read_text())["fingerprint"] == "aaa"


def test_the_journal_of_other_code_is_not_resumed(model, monkeypatch) -> None:
    # A journal kept from an earlier version would hand its speeds and KLs to this one.
    params = tune.TuneParams(budget=0.3, context=64)
    tokens = list(range(200))
    before = tune.fingerprint(model, tokens, params)
    assert tune.fingerprint(model, tokens, params) == before
    monkeypatch.setattr(tune, "code_fingerprint", lambda: "other code")
    assert tune.fingerprint(model, tokens, params) != before


def test_frontier_shares_measurements_and_mixes_widths_per_budget(tmp_path: Path, model,
                                                                   monkeypatch) -> None:
    """Several budgets on one journal: a candidate's bytes are measured once; each budget
    gets calibrated mixed-precision candidates that fit it; families are shortlisted
    apart (a stack is not crowded out by its plain method)."""
    measured: list[str] = []
    real = tune_search.declared_ratio

    def counting(model, cfg, *a, **k):
        measured.append(cfg.to_string())
        return real(model, cfg, *a, **k)

    grid = ["turboquant:k_bits=4,v_bits=4,window=8", "turboquant:k_bits=2,v_bits=2,window=8",
            "streaming:window=140", "streaming:window=140,store=codebook,k_bits=3,v_bits=3"]
    monkeypatch.setattr(tune, "candidate_configs",
                        lambda *a: [KVCacheConfig.from_string(g) for g in grid])
    monkeypatch.setattr(tune_search, "declared_ratio", counting)
    params = _params(0.5, only=("turboquant",), finalists=1)
    result = tune.run_frontier(model, CharTokenizer(), params, (0.5, 0.35), tmp_path / "f.json",
                               text=TEXT, progress=False)
    assert len(measured) == len(set(measured))  # nothing measured twice
    fams = []
    for budget, res in zip((0.5, 0.35), result["frontier"]):
        scored = [c for c in res["candidates"] if "screen_kl" in c]
        assert scored and all(c["declared_over_fp16"] <= budget for c in scored)
        fams.append({c["family"] for c in scored})
    # At 0.5 every width is the widest (a uniform config); at 0.35 widths are mixed.
    mixed = [c for c in result["frontier"][1]["candidates"] if c["family"] == "turboquant+mixed"]
    assert mixed and min(c["declared_over_fp16"] for c in mixed) <= 0.35
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


def test_cli_passes_the_search_options(monkeypatch, tmp_path: Path) -> None:
    from veloxquant_mlx import cli, models
    from veloxquant_mlx.apps import blas
    from veloxquant_mlx.eval import text

    got = {}
    monkeypatch.setattr(blas, "ensure_fast_blas", lambda argv=None: None)
    monkeypatch.setattr(models, "load", lambda name: (tiny_model("llama"), CharTokenizer()))
    monkeypatch.setattr(text, "load_text", lambda path=None: TEXT)

    def fake(model, tok, params, out, text=None, progress=True):
        got["params"] = params
        raise SystemExit(0)

    monkeypatch.setattr(tune, "run_tune", fake)
    with pytest.raises(SystemExit):
        cli.main(["tune", "--budget", "0.22", "--quick", "--min-decode", "1.0",
                  "--finalists", "3", "--out", str(tmp_path / "t.json")])
    p = got["params"]
    assert (p.min_decode, p.finalists, p.context, p.per_method) == (1.0, 3, 1024, 1)


def test_bytes_are_extrapolated_only_where_they_grow_linearly() -> None:
    """Bytes that grow per token are extrapolated from a short prefix to the context;
    bytes that grow in steps (a buffer of 256 tokens, a block of 64) are not."""

    class Grows:  # stands for a model: each call adds its tokens to every cache
        def __call__(self, x, cache):
            for c in cache:
                c.offset += x.shape[1]

    class Cache:  # what cache_stats reads of a cache of ours (``stats``)
        caches, state = (), []

        def __init__(self, held) -> None:
            self.offset, self.held = 0, held

        def stats(self) -> dict:
            return {"held_bytes": self.held(self.offset), "accounted_bytes": 0,
                    "fp16_bytes": 4 * self.offset}

    context = list(range(1000))
    per_token = [Cache(lambda n: 100 + 3 * n) for _ in range(2)]
    got = tune_search._extrapolated(Grows(), per_token, context)
    assert got == pytest.approx((100 + 3 * 1000) / (4 * 1000))  # not 128 tokens' 0.95
    stepped = [Cache(lambda n: 1000 * (n // 256 + 1)) for _ in range(2)]
    assert tune_search._extrapolated(Grows(), stepped, context) is None
    lumpy = [Cache(lambda n: 100 + 3 * n + 500 * (n // 64)) for _ in range(2)]
    assert tune_search._extrapolated(Grows(), lumpy, context) is None
