"""The evaluation harness: prefill, real memory, paired quality, intervals, retrieval."""

from __future__ import annotations

import json
import math
import random
import statistics

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.adapter.retained import measure_retained
from veloxquant_mlx.config import ConfigError
from veloxquant_mlx.eval.perplexity import (
    Method,
    forward_perplexity,
    parse_specs,
    perplexity_through_cache,
    split_method_list,
)
from veloxquant_mlx.eval.quality import bootstrap_ci, evaluate_quality
from veloxquant_mlx.eval.report import pareto_front
from veloxquant_mlx.eval.retrieval import (
    TASKS,
    _retrieval_row,
    evaluate_retrieval,
    make_sample,
    make_samples,
    mcnemar_exact,
    wilson_interval,
)
from veloxquant_mlx.eval.text import stdlib_text, token_windows
from veloxquant_mlx.memory import active_bytes
from veloxquant_mlx.testing.tiny import tiny_model

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


class Amnesiac(KVCache):
    """Attends to nothing earlier: each call sees only the keys/values it was given."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.offset += keys.shape[2]
        return keys, values

    @property
    def state(self) -> list:
        return []


class Leaky(KVCache):
    """A dense cache that also keeps an undeclared copy of every key it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.shadow: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        copy = mx.contiguous(keys)
        self.shadow = copy if self.shadow is None else mx.concatenate([self.shadow, copy], 2)
        mx.eval(self.shadow)
        return super().update_and_fetch(keys, values)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _tokens(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(n)]


# ------------------------------------------------------------------ prefill
def test_prefill_matches_forward_and_returns_a_copy(model):
    toks = _tokens(300)
    ref = mx.contiguous(model(mx.array(toks)[None])[0, -1])
    mx.eval(ref)
    caches = make_prompt_cache(model)
    base = active_bytes()
    got = prefill(model, caches, toks, chunk=128)  # 3 chunks, the last one partial
    assert got.shape == (1, 128)
    assert mx.allclose(got[0], ref, atol=1e-4).item()
    assert all(c.offset == 300 for c in caches)
    del caches
    # A view of the last chunk's logits would pin all 44 x 128 of them (22 KiB).
    assert active_bytes() - base <= got.nbytes + 64
    with pytest.raises(ValueError, match="chunk=0"):
        prefill(model, make_prompt_cache(model), toks, chunk=0)


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


def test_compression_changes_perplexity(model):
    toks = _tokens(300)
    ref = forward_perplexity(model, toks, 200, 100)["ppl"]
    got = perplexity_through_cache(
        model, toks, lambda: KVCacheBuilder.for_model(model, KVCacheConfig.from_string(
            "affine:bits=2,group_size=32")), 200, 100)
    # The scored tokens really read the compressed cache.
    assert abs(got["ppl"] - ref) / ref > 1e-3


# ------------------------------------------------------------------ real memory
def test_measure_retained_dense_matches_expected_bytes(model):
    toks = _tokens(512)
    r = measure_retained(model, KVCacheConfig(), toks, decode_steps=4, chunk=128)
    # 4 layers x (K + V) x 2 KV heads x 512 tokens x 32 dims x float32.
    expected = 4 * 2 * 2 * 512 * 32 * 4
    assert abs(r["real_prefill_bytes"] - expected) <= 0.05 * expected
    assert abs(r["real_over_declared_prefill"] - 1.0) <= 0.05
    assert r["real_decode_bytes"] >= r["real_prefill_bytes"]
    assert r["fp16_prefill_bytes"] == expected // 2
    assert r["residual_bytes"] == 0


def test_measure_retained_catches_an_undeclared_array(model):
    r = measure_retained(model, lambda m: [Leaky() for _ in m.layers], _tokens(512),
                         decode_steps=2, chunk=128)
    assert r["declared_prefill_bytes"] == 4 * 2 * 2 * 512 * 32 * 4
    # The shadow copy of the keys is half as large again as the declared K + V.
    assert r["real_prefill_bytes"] > 1.05 * r["declared_prefill_bytes"]
    assert 1.4 < r["real_over_declared_prefill"] < 1.6


def test_measure_retained_counts_state_installed_at_build(model):
    installed: list[mx.array] = []

    def build(m):  # like a method that installs a hook with its own arrays
        installed.append(mx.zeros((256, 1024)))  # 1 MiB
        mx.eval(installed[-1])
        return KVCacheBuilder.for_model(m, KVCacheConfig())

    r = measure_retained(model, build, _tokens(512), decode_steps=0, chunk=256)
    dense = 4 * 2 * 2 * 512 * 32 * 4
    assert abs(r["real_prefill_bytes"] - dense - 2**20) <= 0.02 * dense
    assert r["residual_bytes"] == 2**20  # still installed: detach does not know it
    installed.clear()


# ------------------------------------------------------------------ paired quality
def _specs(extra: list) -> list:
    return ["none", ("dense again", lambda m: KVCacheBuilder.for_model(m, KVCacheConfig())),
            *extra]


def test_kl_against_dense(model):
    rec = evaluate_quality(
        model, CharTokenizer(),
        _specs([AFFINE8, ("amnesiac", lambda m: [Amnesiac() for _ in m.layers])]),
        context=128, predict=32, windows=3, text=TEXT, block=8, memory_steps=None)
    by = {r["method"]: r for r in rec["rows"]}
    assert list(by) == ["none", "dense again", AFFINE8, "amnesiac"]
    again = by["dense again"]
    assert again["kl"] == 0.0 and again["top1"] == 1.0 and again["ppl_ratio"] == 1.0
    assert again["kl_ci"] == [0.0, 0.0] and again["verdict"] == "cannot be told apart"
    # A near-lossless cache stays far under the bound; one that forgets the context
    # is far above it, and its top-1 rarely matches.
    bound = 0.05
    assert by[AFFINE8]["kl"] < bound / 100 and by[AFFINE8]["top1"] > 0.9
    assert by["amnesiac"]["kl"] > 4 * bound and by["amnesiac"]["top1"] < 0.5
    assert by["amnesiac"]["kl_ci"][0] > bound
    assert not by["amnesiac"]["ppl_ratio_ci"][0] <= 1.0 <= by["amnesiac"]["ppl_ratio_ci"][1]
    assert by["amnesiac"]["verdict"] != "cannot be told apart"
    assert "dense again" not in by["amnesiac"]["indistinguishable_from"]
    # Per-window and per-block records are there to re-plot and re-bootstrap.
    assert len(again["per_window"]) == 3 and sum(again["per_block"]["tokens"]) == 96
    assert len(again["per_block"]["tokens"]) == 12  # 3 windows x 32 tokens / 8


def test_same_windows_for_every_method(model):
    # The dense reference is added when absent and scores the same windows as a
    # separate run of the same settings.
    kw = dict(context=100, predict=16, windows=2, text=TEXT, memory_steps=None)
    a = evaluate_quality(model, CharTokenizer(), [AFFINE8], seed=3, **kw)["rows"]
    b = evaluate_quality(model, CharTokenizer(), ["none", AFFINE8], seed=3, **kw)["rows"]
    assert [r["method"] for r in a] == ["none", AFFINE8]
    assert a[1]["window_ppl"] == pytest.approx(b[1]["window_ppl"], rel=1e-5)
    c = evaluate_quality(model, CharTokenizer(), [AFFINE8], seed=4, **kw)["rows"]
    assert c[1]["window_ppl"] != pytest.approx(a[1]["window_ppl"], rel=1e-5)


def test_bootstrap_iid_width_and_coverage():
    rng = np.random.default_rng(1)
    x = rng.normal(0.3, 1.0, 4096)
    lo, hi = bootstrap_ci(x, n_boot=2000)
    assert lo < 0.3 < hi
    assert abs((hi - lo) / (2 * 1.96 / math.sqrt(4096)) - 1.0) < 0.1
    covered = sum(lo <= 0.3 <= hi for lo, hi in (
        bootstrap_ci(rng.normal(0.3, 1.0, 256), n_boot=400, seed=s) for s in range(100)))
    assert 88 <= covered <= 100


def test_block_bootstrap_widens_for_correlated_tokens():
    # AR(1) with unit innovations: the sd of the mean is 1 / ((1 - phi) sqrt(n)).
    phi, n = 0.5, 16384
    rng = np.random.default_rng(2)
    e = rng.normal(0.0, 1.0, n)
    y = np.empty(n)
    y[0] = e[0]
    for i in range(1, n):
        y[i] = phi * y[i - 1] + e[i]
    truth = 2 * 1.96 / ((1 - phi) * math.sqrt(n))
    lo, hi = bootstrap_ci(y, block=64)
    assert lo < 0.0 < hi and abs((hi - lo) / truth - 1.0) < 0.15
    lo1, hi1 = bootstrap_ci(y, block=1, n_boot=500)  # token level: too narrow, sqrt(1/3)
    assert (hi1 - lo1) / truth < 0.7


# ------------------------------------------------------------------ small helpers
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


def test_pareto_front():
    pts = [(1.0, 0.0), (0.5, 1.0), (0.6, 2.0), (0.25, 5.0)]
    assert pareto_front(pts) == [3, 1, 0]


# ------------------------------------------------------------------ bad input
def test_unknown_method_is_named(model):
    with pytest.raises(ConfigError, match="nosuch"):
        evaluate_quality(model, CharTokenizer(), "none,nosuch:bits=4", 64, 8, 1, text=TEXT)


def test_duplicate_spec_rejected():
    with pytest.raises(ValueError, match="more than once"):
        parse_specs(["none", "none"])


def test_context_beyond_model_limit():
    m = tiny_model("llama", max_position_embeddings=128)
    with pytest.raises(ValueError, match=r"context \+ predict=160.*max_position_embeddings=128"):
        evaluate_quality(m, CharTokenizer(), "none", 128, 32, 1, text=TEXT)


def test_text_too_short(model):
    with pytest.raises(ValueError, match="too short for 2 window"):
        evaluate_quality(model, CharTokenizer(), "none", 100, 20, 2, text="short text " * 15)


@pytest.mark.parametrize("kwargs, match", [
    ({"windows": 0}, "windows=0"),
    ({"predict": 0}, "predict=0"),
    ({"block": 0}, "block=0"),
])
def test_bad_counts(model, kwargs, match):
    args = {"context": 64, "predict": 8, "windows": 1, "memory_steps": None} | kwargs
    with pytest.raises(ValueError, match=match):
        evaluate_quality(model, CharTokenizer(), "none", text=TEXT, **args)


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


def test_retrieval_samples_spread_over_depths():
    items = make_samples(CharTokenizer(), "passkey", 400, [0.1, 0.5, 0.9], 20, seed=3)
    assert [s.depth for s in items[:4]] == [0.1, 0.5, 0.9, 0.1]
    assert len({s.answer for s in items}) == 20  # 20 distinct pass keys


def test_retrieval_bad_input():
    with pytest.raises(ValueError, match="task='riddle'"):
        make_sample(CharTokenizer(), "riddle", 500)
    with pytest.raises(ValueError, match="depth=1.5"):
        make_sample(CharTokenizer(), "passkey", 500, depth=1.5)
    with pytest.raises(ValueError, match="too short"):
        make_sample(CharTokenizer(), "passkey", 50)
    with pytest.raises(ValueError, match="samples=0"):
        make_samples(CharTokenizer(), "passkey", 500, [0.5], 0)


def test_wilson_and_mcnemar_known_values():
    lo, hi = wilson_interval(10, 20)
    assert lo == pytest.approx(0.2993, abs=1e-3) and hi == pytest.approx(0.7007, abs=1e-3)
    lo, hi = wilson_interval(20, 20)  # no zero-width interval at 20/20
    assert hi == 1.0 and lo == pytest.approx(0.8389, abs=1e-3)
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)
    assert mcnemar_exact(1, 5) == pytest.approx(2 * 7 / 64)
    assert mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(0, 0) == 1.0


def test_retrieval_pairs_methods_on_the_same_samples(model):
    rows = evaluate_retrieval(model, CharTokenizer(), _specs([AFFINE8]), "passkey", 300,
                              depths=(0.2, 0.8), samples=3, max_tokens=2, text=TEXT)
    assert [r["method"] for r in rows] == ["none", "dense again", AFFINE8]
    keys = [[(s["seed"], s["depth"], s["answer"]) for s in r["samples"]] for r in rows]
    assert keys[0] == keys[1] == keys[2] and len({k[2] for k in keys[0]}) == 3
    again = rows[1]
    assert [s["output"] for s in again["samples"]] == [s["output"] for s in rows[0]["samples"]]
    assert again["disagree_with_dense"] == 0 and again["mcnemar_p"] == 1.0
    assert again["verdict"] == "cannot be told apart" and rows[0]["verdict"] == "reference"
    assert again["real_bytes"] == rows[0]["real_bytes"] > 0


def test_retrieval_row_counts_discordant_pairs():
    def res(flags: str) -> list[dict]:
        return [{"depth": 0.5, "correct": f == "1"} for f in flags]

    dense = res("11111111110000000000")
    meth = res("00000000000000000011")  # 10 lost, 2 gained
    row = _retrieval_row(Method("m", KVCacheConfig()), "passkey", 100, meth, dense, {}, None,
                         0.95)
    assert (row["correct"], row["n"]) == (2, 20)
    assert (row["only_method_right"], row["only_dense_right"]) == (2, 10)
    assert row["disagree_with_dense"] == 12
    assert row["mcnemar_p"] == pytest.approx(2 * (1 + 12 + 66) / 4096)
    assert row["verdict"] == "worse"
    assert row["accuracy_ci"][0] == pytest.approx(0.0279, abs=1e-3)


# ------------------------------------------------------------------ sweep / CLI
def test_sweep_writes_json_md_png(model, tmp_path):
    from veloxquant_mlx.eval.sweep import run_sweep

    rec = run_sweep(model, CharTokenizer(), f"none,{AFFINE4}", tmp_path, contexts=(64,),
                    eval_context=64, predict=16, windows=2, decode_steps=4, repeats=1,
                    text=TEXT, argv=["bench", "--quick"], progress=False)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["command"] == "veloxquant bench --quick"
    assert data["versions"]["mlx"] and data["seed"] == 0
    assert [r["method"] for r in data["speed"]] == ["none", AFFINE4]
    speed = {r["method"]: r for r in data["speed"]}
    assert speed[AFFINE4]["real_bytes"] < speed["none"]["real_bytes"]
    # The steady speed is the median step's: one slow step (a block compressed) moves
    # the mean, not the median.
    steps = speed[AFFINE4]["runs"][0]["step_s"]
    assert len(steps) == 4
    assert speed[AFFINE4]["steady_tok_s"] == pytest.approx(1 / statistics.median(steps))
    assert speed["none"]["steady_ratio"] == 1.0
    q = data["quality"][1]
    assert q["mem_ratio"] == speed[AFFINE4]["mem_ratio"] and len(q["ppl_ratio_ci"]) == 2
    assert len(q["per_window"]) == 2 and sum(q["per_block"]["tokens"]) == 32
    md = (tmp_path / "bench.md").read_text()
    assert AFFINE4 in md and "bench.png" in md and "real MiB" in md and "steady/dense" in md
    # The peak on mlx_lm's path, beside mlx_lm's dense cache (its 4-bit cache needs a key
    # width of a multiple of 64: this model's is 32).
    peak = {r["method"]: r for r in data["peak"]}
    assert list(peak) == ["none", AFFINE4, "mlx_lm:dense"]
    assert all(r["peak_bytes"] >= r["retained_bytes"] > 0 for r in peak.values())
    assert peak[AFFINE4]["retained_bytes"] < peak["mlx_lm:dense"]["retained_bytes"]
    assert peak["mlx_lm:dense"]["peak_over_dense"] == 1.0
    assert "Peak on mlx_lm's own path" in md and "peak/mlx_lm:dense" in md
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


def test_cli_eval_quick_defaults_and_context_alias(monkeypatch, tmp_path):
    from veloxquant_mlx import cli

    seen = {}

    def fake_run_eval(model, tok, specs, task, params, **kw):
        seen.update(params, task=task, peak=kw["peak"])
        return {"command": "x", "task": task, "seed": 0, "results": []}

    monkeypatch.setattr("veloxquant_mlx.models.load", lambda *a, **k: (None, None))
    monkeypatch.setattr("veloxquant_mlx.eval.sweep.run_eval", fake_run_eval)
    args = cli.build_parser().parse_args(
        ["eval", "--methods", "none", "--context", "4096,8192", "--quick", "--windows", "5",
         "--text", str(tmp_path / "t.txt")])
    (tmp_path / "t.txt").write_text(TEXT)
    assert args.func(args) == 0
    # --quick sizes, except what was given explicitly.
    assert seen["contexts"] == [4096, 8192] and seen["windows"] == 5
    assert seen["predict"] == 64 and seen["block"] == 16 and seen["task"] == "ppl"
    assert seen["peak"] is True
    args = cli.build_parser().parse_args(
        ["eval", "--methods", "none", "--no-peak", "--text", str(tmp_path / "t.txt")])
    assert args.func(args) == 0 and seen["peak"] is False


# ------------------------------------------------------------------ real model
@pytest.mark.slow
def test_real_model_cache_perplexity_and_memory():
    from veloxquant_mlx.eval.text import encode, load_text
    from veloxquant_mlx.models import load

    m, tok = load()
    toks = encode(tok, load_text())[:288]
    ref = forward_perplexity(m, toks, 256, 32)
    got = perplexity_through_cache(
        m, toks, lambda: KVCacheBuilder.for_model(m, KVCacheConfig()), 256, 32, chunk=128)
    assert abs(got["ppl"] - ref["ppl"]) / ref["ppl"] < 1e-3
    assert 1.0 < ref["ppl"] < 200.0  # the model reads English
    r = measure_retained(m, KVCacheConfig(), toks[:256], decode_steps=0)
    # 30 layers x (K + V) x 3 KV heads x 256 tokens x 64 dims x float32.
    expected = 30 * 2 * 3 * 256 * 64 * 4
    assert abs(r["real_prefill_bytes"] - expected) <= 0.05 * expected
    assert r["real_over_declared_prefill"] == pytest.approx(1.0, abs=0.05)
    mx.clear_cache()


def test_retrieval_prompt_format_plain_skips_the_chat_template():
    class Templated(CharTokenizer):
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return "<user>" + messages[0]["content"] + "<assistant>"

    tok = Templated()
    chat = make_sample(tok, "passkey", 600, seed=2)
    plain = make_sample(tok, "passkey", 600, seed=2, prompt_format="plain")
    assert tok.decode(chat.prompt_tokens).startswith("<user>")
    text = tok.decode(plain.prompt_tokens)
    assert "<user>" not in text and text.endswith(" is") and plain.answer in text
    assert len(plain.prompt_tokens) <= 600
    with pytest.raises(ValueError, match="prompt_format='chat': this tokenizer has no"):
        make_sample(CharTokenizer(), "passkey", 600, prompt_format="chat")
    with pytest.raises(ValueError, match="prompt_format='text' is not allowed"):
        make_sample(tok, "passkey", 600, prompt_format="text")
