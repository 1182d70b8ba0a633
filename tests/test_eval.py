"""The evaluation harness: perplexity through caches, tables, retrieval, sweep, errors."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import pytest
from tiny_models import tiny_model

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.config import ConfigError
from veloxquant_mlx.eval.perplexity import (
    evaluate_methods,
    forward_perplexity,
    parse_specs,
    perplexity_through_cache,
    split_method_list,
)
from veloxquant_mlx.eval.report import markdown_table, pareto_front
from veloxquant_mlx.eval.retrieval import TASKS, evaluate_retrieval, make_sample
from veloxquant_mlx.eval.text import stdlib_text, token_windows

AFFINE4 = "affine:bits=4,group_size=32"
AFFINE8 = "affine:bits=8,group_size=32"


class CharTokenizer:
    """One token per character (vocab 128): enough to drive the harness on tiny models."""

    chat_template = None
    eos_token_ids = [0]

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 127 + 1 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i - 1) for i in ids)


TEXT = " ".join(f"sentence {i} tells the story of the number {i * 7 % 13}." for i in range(200))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _tokens(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(n)]


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_dense_cache_perplexity_equals_forward_pass(model_type):
    m = tiny_model(model_type)
    toks = _tokens(300)
    ref = forward_perplexity(m, toks, 200, 100)
    # chunk 64 < context: the prefill crosses several chunks, then 99 decode steps.
    got = perplexity_through_cache(
        m, toks, lambda: KVCacheBuilder.for_model(m, KVCacheConfig()), 200, 100, chunk=64)
    assert got["tokens"] == 100
    assert abs(got["ppl"] - ref["ppl"]) / ref["ppl"] < 1e-3
    assert got["held_bytes"] > 0 and got["fp16_bytes"] > 0


def test_compression_changes_perplexity(model):
    toks = _tokens(300)
    ref = forward_perplexity(model, toks, 200, 100)["ppl"]
    got = perplexity_through_cache(
        model, toks, lambda: KVCacheBuilder.for_model(model, KVCacheConfig.from_string(
            "affine:bits=2,group_size=32")), 200, 100)
    # The scored tokens really read the compressed cache.
    assert abs(got["ppl"] - ref) / ref > 1e-3


def test_evaluate_methods_table(model):
    rows = evaluate_methods(model, CharTokenizer(), f"none,{AFFINE4},{AFFINE8}", context=120,
                            predict=24, windows=2, text=TEXT, recon=True)
    by = {r["method"]: r for r in rows}
    assert list(by) == ["none", AFFINE4, AFFINE8]
    assert by["none"]["ppl_ratio"] == 1.0 and by["none"]["decode_ratio"] == 1.0
    assert by[AFFINE4]["mem_ratio"] < by[AFFINE8]["mem_ratio"] < by["none"]["mem_ratio"]
    assert abs(by[AFFINE4]["accounted_over_held"] - 1.0) < 0.05
    assert by[AFFINE8]["k_rel_err"] < by[AFFINE4]["k_rel_err"]
    assert abs(by[AFFINE8]["ppl_ratio"] - 1.0) < 0.02
    assert all(len(r["window_ppl"]) == 2 for r in rows)
    table = markdown_table(rows)
    assert table.count("\n") == 4 and AFFINE4 in table


def test_same_windows_for_every_method(model):
    # The dense reference is added when absent and scores the same windows as a
    # separate run of the same settings.
    a = evaluate_methods(model, CharTokenizer(), [AFFINE8], 100, 16, 2, text=TEXT, seed=3)
    b = evaluate_methods(model, CharTokenizer(), ["none", AFFINE8], 100, 16, 2, text=TEXT,
                         seed=3)
    assert [r["method"] for r in a] == ["none", AFFINE8]
    assert a[1]["window_ppl"] == pytest.approx(b[1]["window_ppl"], rel=1e-5)
    c = evaluate_methods(model, CharTokenizer(), [AFFINE8], 100, 16, 2, text=TEXT, seed=4)
    assert c[1]["window_ppl"] != pytest.approx(a[1]["window_ppl"], rel=1e-5)


def test_token_windows_deterministic_and_disjoint():
    toks = list(range(1000))
    w1 = token_windows(toks, 100, 3, seed=5)
    assert w1 == token_windows(toks, 100, 3, seed=5)
    starts = [w[0] for w in w1]
    assert starts == sorted(starts) and all(s % 100 == 0 for s in starts)
    assert all(len(w) == 100 for w in w1)


def test_split_method_list():
    assert split_method_list("none,affine:bits=4,window=32,xkv:rank_k=64,group_size=4") == [
        "none", "affine:bits=4,window=32", "xkv:rank_k=64,group_size=4"]


def test_stdlib_text_is_prose_and_deterministic():
    text = stdlib_text(20_000)
    assert len(text) >= 20_000 and text == stdlib_text(20_000)
    letters = sum(c.isalpha() or c.isspace() for c in text)
    assert letters / len(text) > 0.9 and ">>>" not in text


# ------------------------------------------------------------------ bad input
def test_unknown_method_is_named(model):
    with pytest.raises(ConfigError, match=r"method='nosuch'.*one of"):
        evaluate_methods(model, CharTokenizer(), "none,nosuch:bits=4", 64, 8, 1, text=TEXT)


def test_duplicate_spec_rejected():
    with pytest.raises(ValueError, match="more than once"):
        parse_specs(["none", "none"])


def test_context_beyond_model_limit():
    m = tiny_model("llama", max_position_embeddings=128)
    with pytest.raises(ValueError, match=r"context \+ predict=160.*max_position_embeddings=128"):
        evaluate_methods(m, CharTokenizer(), "none", 128, 32, 1, text=TEXT)


def test_text_too_short(model):
    with pytest.raises(ValueError, match="too short for 2 window"):
        evaluate_methods(model, CharTokenizer(), "none", 100, 20, 2, text="short text " * 15)


@pytest.mark.parametrize("kwargs, match", [
    ({"windows": 0}, "windows=0"),
    ({"predict": 0}, "predict=0"),
])
def test_bad_counts(model, kwargs, match):
    args = {"context": 64, "predict": 8, "windows": 1} | kwargs
    with pytest.raises(ValueError, match=match):
        evaluate_methods(model, CharTokenizer(), "none", text=TEXT, **args)


def test_missing_text_file(tmp_path):
    from veloxquant_mlx.eval.text import load_text

    with pytest.raises(FileNotFoundError, match="no such file"):
        load_text(str(tmp_path / "missing.txt"))


# ------------------------------------------------------------------ retrieval
@pytest.mark.parametrize("task", TASKS)
def test_retrieval_sample_deterministic_with_answer(task):
    tok = CharTokenizer()
    a = make_sample(tok, task, 600, depth=0.3, seed=7, text=TEXT)
    b = make_sample(tok, task, 600, depth=0.3, seed=7, text=TEXT)
    c = make_sample(tok, task, 600, depth=0.3, seed=8, text=TEXT)
    assert a == b
    assert a.answer != c.answer
    assert a.answer in a.prompt
    assert 500 < len(a.prompt_tokens) <= 600


def test_retrieval_depth_places_needle():
    tok = CharTokenizer()
    early = make_sample(tok, "passkey", 1000, depth=0.0, seed=1)
    late = make_sample(tok, "passkey", 1000, depth=1.0, seed=1)
    assert early.prompt.index(early.answer) < 300 < late.prompt.index(late.answer)


def test_retrieval_bad_input():
    with pytest.raises(ValueError, match="task='riddle'"):
        make_sample(CharTokenizer(), "riddle", 500)
    with pytest.raises(ValueError, match="depth=1.5"):
        make_sample(CharTokenizer(), "passkey", 500, depth=1.5)
    with pytest.raises(ValueError, match="too short"):
        make_sample(CharTokenizer(), "passkey", 50)


def test_evaluate_retrieval_runs(model):
    rows = evaluate_retrieval(model, CharTokenizer(), f"none,{AFFINE4}", "needle", 500,
                              depths=(0.2, 0.8), max_tokens=4, text=TEXT)
    assert [r["method"] for r in rows] == ["none", AFFINE4]
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and len(r["samples"]) == 2
        assert r["samples"][0]["correct"] == (r["samples"][0]["answer"]
                                              in r["samples"][0]["output"])


# ------------------------------------------------------------------ sweep / report
def test_pareto_front():
    pts = [(1.0, 0.0), (0.5, 1.0), (0.6, 2.0), (0.25, 5.0)]
    assert pareto_front(pts) == [3, 1, 0]


def test_sweep_writes_json_md_png(model, tmp_path):
    from veloxquant_mlx.eval.sweep import run_sweep

    rec = run_sweep(model, CharTokenizer(), f"none,{AFFINE4}", tmp_path, contexts=(64,),
                    eval_context=64, predict=8, windows=1, decode_steps=4, repeats=1,
                    text=TEXT, argv=["bench", "--quick"], progress=False)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["command"] == "veloxquant bench --quick"
    assert data["versions"]["mlx"] and data["seed"] == 0
    assert [r["method"] for r in data["speed"]] == ["none", AFFINE4]
    assert data["speed"][1]["mem_ratio"] < data["speed"][0]["mem_ratio"]
    md = (tmp_path / "bench.md").read_text()
    assert AFFINE4 in md and "bench.png" in md
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "bench.png").ndim == 3
    assert rec["files"]["png"].endswith("bench.png")


def test_cli_rejects_bad_method_before_loading(monkeypatch):
    from veloxquant_mlx import cli

    def no_load(*a, **k):
        raise AssertionError("model loaded before the specs were checked")

    monkeypatch.setattr("veloxquant_mlx.models.load", no_load)
    for argv in (["eval", "--methods", "none,bogus"], ["bench", "--methods", "none,bogus"]):
        args = cli.build_parser().parse_args(argv)
        with pytest.raises(ConfigError, match="bogus"):
            args.func(args)


# ------------------------------------------------------------------ real model
@pytest.mark.slow
def test_real_model_cache_perplexity_equals_forward():
    from veloxquant_mlx.eval.text import encode, load_text
    from veloxquant_mlx.models import load

    m, tok = load()
    toks = encode(tok, load_text())[:288]
    ref = forward_perplexity(m, toks, 256, 32)
    got = perplexity_through_cache(
        m, toks, lambda: KVCacheBuilder.for_model(m, KVCacheConfig()), 256, 32, chunk=128)
    assert abs(got["ppl"] - ref["ppl"]) / ref["ppl"] < 1e-3
    assert 1.0 < ref["ppl"] < 200.0  # the model reads English
    mx.clear_cache()
