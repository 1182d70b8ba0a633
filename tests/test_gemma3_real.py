"""The real Gemma 3 270M (Q4_K_M GGUF, installed by ``make models``).

It answers a factual prompt with and without 4-bit KV caches, and every registered
method, at its lossless settings, gives the logits of mlx_lm's own cache on its real
layers (sliding-window and global), or refuses a layer by name.

Without the model every test here is skipped with the reason (and a warning, so the
reason shows in the default test summary): run ``make models``.
"""

from __future__ import annotations

import warnings
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, models
from veloxquant_mlx.adapter.builder import cache_stats
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.config import ConfigError
from veloxquant_mlx.errors import UnsupportedModelError
from veloxquant_mlx.registry import get_method, methods

MODEL = "gemma3-270m"
# A base model: it answers in the format of a few examples (none of them the answer).
PROMPT = (
    "Q: What is the capital of Italy?\nA: The capital of Italy is Rome.\n"
    "Q: What is the capital of Japan?\nA: The capital of Japan is Tokyo.\n"
    "Q: What is the capital of Spain?\nA: The capital of Spain is Madrid.\n"
    "Q: What is the capital of Egypt?\nA: The capital of Egypt is Cairo.\n"
    "Q: What is the capital of France?\nA:"
)
# KIVI keeps its last `window` tokens in full precision: 32 of the prompt's 93, so
# most of it is held in 4 bits (measured ratio 0.44); affine holds every token in 4 bits
# (0.28).
FOUR_BIT = ["kivi:bits=4,window=32", "affine:bits=4"]
# Plain English, about 45 tokens: within every method's lossless settings.
TEXT = (
    "Water is one of the most important substances on Earth. All living things need "
    "water to survive. Plants use water to make their own food through a process "
    "called photosynthesis, and animals drink it to stay healthy."
)
DECODE = 4  # teacher-forced decode steps after the prefill
CHUNK = 16
TOLERANCE = 0.05  # max |a - b| / max |b| over the logits: the architecture table's bound
# The model's own window (512) and one the prompt crosses, so that the sliding layers'
# ring buffers wrap on real weights.
WINDOWS = [None, 16]
# Known wrong output on this model, to be fixed in the method (strict: a fix fails the
# mark, which then goes).
# Cells that find a bug not fixed yet (strict: a fix makes them fail until removed).
KNOWN_WRONG: dict[str, str] = {}


@pytest.fixture(scope="module")
def gemma() -> tuple[nn.Module, Any]:
    try:
        return models.load(MODEL)
    except FileNotFoundError as e:
        reason = f"the real Gemma 3 270M is not installed: {e}"
        warnings.warn(reason, stacklevel=1)
        pytest.skip(reason)


def _greedy(model: nn.Module, tokenizer: Any, spec: str) -> tuple[str, float]:
    caches = KVCacheBuilder.for_model(model, KVCacheConfig.from_string(spec))
    text = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=8, prompt_cache=caches)
    return text, cache_stats(caches)["ratio"]


@pytest.mark.parametrize("spec", ["none", *FOUR_BIT])
def test_answers_the_capital_of_france(gemma, spec: str):
    model, tokenizer = gemma
    text, ratio = _greedy(model, tokenizer, spec)
    # Measured at float32 with each spec: " The capital of France is Paris.\n".
    assert "Paris" in text.strip().splitlines()[0], (spec, text)
    if spec != "none":
        assert ratio < 0.6, (spec, ratio)  # the 4 bits really hold most of the prompt


def test_tokenizer_and_chat_template(gemma):
    _, tokenizer = gemma
    ids = tokenizer.encode("The capital of France is")
    # Gemma 3's ids: <bos>, "The", "▁capital", "▁of", "▁France", "▁is".
    assert ids == [2, 818, 5279, 529, 7001, 563]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert set(tokenizer.eos_token_ids) == {1, 106}  # <eos> and <end_of_turn>


def _with_window(model: nn.Module, window: int | None) -> int:
    """Set the sliding layers' window (mask and mlx_lm's ring buffer); the old one."""
    old = model.args.sliding_window
    if window is not None:
        model.args.sliding_window = model.model.window_size = window
    return old


def _logits(model: nn.Module, caches: list[Any], tokens: list[int]) -> mx.array:
    """Every position's logits: the prompt in chunks, then one decode step per token."""
    n = len(tokens) - DECODE
    out = [prefill(model, caches, tokens[:n], CHUNK, last_alone=False, all_logits=True)[0]]
    out += [model(mx.array([[t]]), cache=caches)[0] for t in tokens[n:]]
    logits = mx.concatenate(out).astype(mx.float32)
    mx.eval(logits)
    return logits


def _rel(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


@pytest.fixture(scope="module")
def references(gemma) -> dict[int | None, mx.array]:
    model, tokenizer = gemma
    tokens = tokenizer.encode(TEXT)
    out = {}
    for window in WINDOWS:
        old = _with_window(model, window)
        try:
            out[window] = _logits(model, make_prompt_cache(model), tokens)
        finally:
            _with_window(model, old)
    return out


def _marked(method: str) -> Any:
    if method in KNOWN_WRONG:
        return pytest.param(method, marks=pytest.mark.xfail(reason=KNOWN_WRONG[method],
                                                            strict=True))
    return method


@pytest.mark.parametrize("window", WINDOWS, ids=["window512", "window16"])
@pytest.mark.parametrize("method", [_marked(m) for m in methods()])
def test_lossless_equals_mlx_lm_cache(gemma, references, method: str, window: int | None):
    model, tokenizer = gemma
    config = KVCacheConfig(method, **get_method(method).profile.lossless)
    old = _with_window(model, window)
    try:
        try:
            caches = KVCacheBuilder.for_model(model, config)
        except (UnsupportedModelError, ConfigError) as e:
            # A refusal by design names the layer (turboquant's affine quantizer takes
            # head_dim up to 128; Gemma's is 256).
            assert "layer" in str(e), e
            return
        got = _logits(model, caches, tokenizer.encode(TEXT))
    finally:
        _with_window(model, old)
    want = references[window]
    err = _rel(got, want)
    assert err <= TOLERANCE, (method, window, err)
    # The greedy choice agrees wherever mlx_lm's top two are not a near tie.
    top2 = mx.topk(want, 2, axis=-1)
    clear = (top2.max(axis=-1) - top2.min(axis=-1)) > 0.5
    agree = mx.argmax(got, axis=-1) == mx.argmax(want, axis=-1)
    assert mx.all(agree | ~clear).item(), (method, window)
