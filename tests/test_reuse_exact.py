"""A kept cache trimmed for reuse equals a fresh prefill of the prefix it keeps.

The server's pool (``apps.prompt_reuse.CompressedPromptCache``) starts a request from a
kept cache cut to the prefix its prompt shares with it. The cut is made only as far as
``exact_prefix`` allows: the copy must hold what a *fresh prefill* of the kept prefix
holds (its tokens fed to a new cache in the server's prompt chunks, counted from the
first token), so nothing computed over another conversation's tokens survives. These
tests run every method at its compressing ``profile.small`` on a tiny model: P+X and
P+Y each kept, then a prompt P+C served from each; the reused length is the one
docs/usage.md states for the method, and the logits equal a fresh prefill of the reused
prefix followed by the rest of the prompt.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import trim_prompt_cache
from test_server_reuse import KEY, Provider, words

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.apps.prompt_reuse import CompressedPromptCache, exact_prefix
from veloxquant_mlx.cache.base import LayerInfo, code_pending
from veloxquant_mlx.registry import get_method
from veloxquant_mlx.testing.tiny import tiny_model

CHUNK = 16  # the prompt step: a shared prefix of whole chunks rounds as a fresh one
# (shared prefix, kept tail) -> tokens reused, per method, as docs/usage.md states:
# a tail of 30 puts coded tokens past the cut; a tail of 1 cuts inside the residual
# windows; 20 tokens are held uncompressed by every method but affine (window 4),
# MiniCache (8), xKV (sink 4 + window 8) and StreamingLLM (evicted past 18).
CASES = ((48, 30), (48, 1), (16, 4))
REUSED = {
    "none": (48, 48, 16), "xquant": (48, 48, 16), "xquant_cl": (48, 48, 16),
    "kivi": (0, 48, 16), "turboquant": (4, 48, 16), "snapkv": (0, 0, 16),
    "affine": (0, 0, 0), "minicache": (0, 0, 0), "xkv": (0, 0, 0), "streaming": (0, 0, 0),
}




@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("llama", seed=5)


def kept_cache(model: Any, config: KVCacheConfig, tokens: list[int]) -> list[Any]:
    """A finished prompt's caches as the server keeps them (chunks, last token alone)."""
    caches = KVCacheBuilder.for_model(model, config)
    prefill(model, caches, tokens, CHUNK)
    return caches


def fresh_logits(model: Any, config: KVCacheConfig, prefix: list[int],
                 rest: list[int]) -> mx.array:
    """A fresh prefill of ``prefix`` in the prompt chunks, then ``rest`` in one step."""
    caches = KVCacheBuilder.for_model(model, config)
    if prefix:
        prefill(model, caches, prefix, CHUNK, last_alone=False)
    return model(mx.array([rest]), cache=caches)


def served(model: Any, config: KVCacheConfig, kept: list[int],
           prompt: list[int]) -> tuple[int, mx.array]:
    """Tokens the pool reuses for ``prompt`` with only ``kept`` held, and the logits of
    the rest of the prompt through the cache it hands out."""
    pool = CompressedPromptCache(Provider(model), config)
    pool.insert_cache(KEY, kept, kept_cache(model, config, kept))
    cache, rest = pool.fetch_nearest_cache(KEY, prompt)
    return len(prompt) - len(rest), model(mx.array([rest]), cache=cache)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_trimmed_reuse_equals_a_fresh_prefill(model: Any, method: str, case: int,
                                              caplog: pytest.LogCaptureFixture) -> None:
    # A method the docs' table does not list yet (a new one: docs/developing.md) is held
    # to the rule itself: whatever it reuses equals a fresh prefill of that prefix.
    config = KVCacheConfig(method, **get_method(method).profile.small)
    n_shared, n_tail = CASES[case]
    shared, question = words(n_shared, 1), words(5, 9)
    prompt = shared + question
    with caplog.at_level(logging.INFO, logger="root"):
        results = [served(model, config, shared + words(n_tail, seed), prompt)
                   for seed in (2, 3)]
    expected = REUSED[method][case] if method in REUSED else results[0][0]
    fresh = fresh_logits(model, config, prompt[:expected], prompt[expected:])
    # A reused prefix of whole chunks went through the same float operations; a shorter
    # one (TurboQuant's 4 sinks) was rotated in a longer chunk: float rounding only.
    tol = 1e-5 if expected % CHUNK == 0 else 1e-4
    for reused, logits in results:
        assert reused == expected, (method, CASES[case], reused)
        assert mx.allclose(logits, fresh, rtol=0, atol=tol).item(), \
            (method, mx.abs(logits - fresh).max().item())
    if expected < n_shared and all(c.is_trimmable() for c in
                                   kept_cache(model, config, shared + words(n_tail, 2))):
        assert f"{method} cannot be cut to {n_shared}" in caplog.text


def test_the_shared_prefix_of_a_kivi_cache_holds_the_other_conversation(model: Any) -> None:
    """Why KIVI's long tail is refused: cut to the shared prefix, the kept caches of two
    conversations differ (a key group coded over the other tail's tokens) and neither is
    a fresh prefill's."""
    config = KVCacheConfig("kivi", **get_method("kivi").profile.small)
    shared, question = words(48, 1), words(5, 9)
    outs = []
    for seed in (2, 3):
        caches = kept_cache(model, config, shared + words(30, seed))
        assert exact_prefix(caches, 48) == (0, ["kivi"])
        trim_prompt_cache(caches, 30)
        outs.append(model(mx.array([question]), cache=caches))
    fresh = fresh_logits(model, config, shared, question)
    assert mx.abs(outs[0] - outs[1]).max().item() > 1e-3
    assert mx.abs(outs[0] - fresh).max().item() > 1e-3


# ---- the rule against a brute-force comparison of states ----
def _state(cache: Any) -> tuple[list[int], mx.array, mx.array]:
    k, v = cache.keys_and_values(mx.float32)
    return [s.n for s in cache.stored.order], k, v


def _same(a: Any, b: Any) -> bool:
    # A rotation multiplies a chunk at a time: float rounding, far below a code's step.
    (na, ka, va), (nb, kb, vb) = _state(a), _state(b)
    return na == nb and all(mx.allclose(x, y, rtol=0, atol=1e-4).item()
                            for x, y in ((ka, kb), (va, vb)))


def _fed(cls: type, config: KVCacheConfig, k: mx.array, v: mx.array, n: int) -> Any:
    """A fresh layer cache fed the first ``n`` tokens in prompt chunks, each committed
    as after a step that attended."""
    cache = cls(config, LayerInfo(n_kv_heads=2, head_dim=32))
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        cache.update_and_fetch(k[:, :, start:stop], v[:, :, start:stop])
        code_pending(cache)
    return cache


@pytest.mark.parametrize("method, options", [
    ("kivi", dict(bits=4, group_size=32, window=32, block=16)),
    ("kivi", dict(bits=2, group_size=32, window=64, block=1)),
    ("turboquant", dict(sink=4, window=8, block=16)),
    ("affine", dict(bits=4, group_size=32, window=4)),
    ("affine", dict(bits=4, group_size=32)),
])
def test_exact_prefix_is_the_longest_cut_holding_a_fresh_state(method: str,
                                                               options: dict) -> None:
    """For every shared length, ``exact_prefix`` gives the longest cut whose state (the
    coded/held split and every value attention reads) equals a fresh prefill's."""
    config = KVCacheConfig(method, **options)
    cls = get_method(method)
    mx.random.seed(7)
    n_held = 83
    k, v = mx.random.normal((1, 2, n_held, 32)), mx.random.normal((1, 2, n_held, 32))
    held = _fed(cls, config, k, v, n_held)
    equal = [True]  # cutting to nothing is a fresh cache
    for m in range(1, n_held + 1):
        cut = copy.deepcopy(held)
        cut.trim(n_held - m)
        equal.append(_same(cut, _fed(cls, config, k, v, m)))
    assert equal[-1]
    assert not mx.allclose(_state(held)[1], k, atol=1e-3).item()  # tokens were coded
    for keep in range(n_held + 1):
        best = max(m for m in range(keep + 1) if equal[m])
        assert exact_prefix([held], keep)[0] == best, (method, keep)


@pytest.mark.parametrize("method, reproduced", [("kivi", False), ("none", True)])
def test_a_prefix_entry_stays_unless_the_longer_cache_reproduces_it(
        model: Any, method: str, reproduced: bool) -> None:
    """mlx_lm drops the entries of a trimmable cache's prefixes when it is kept; a prefix
    that the longer cache cannot be cut to exactly keeps its own entry, and is reused."""
    config = KVCacheConfig(method, **get_method(method).profile.small)
    shared, question = words(48, 1), words(5, 9)
    pool = CompressedPromptCache(Provider(model), config)
    pool.insert_cache(KEY, shared, kept_cache(model, config, shared))
    longer = shared + words(30, 2)
    pool.insert_cache(KEY, longer, kept_cache(model, config, longer))
    assert len(pool) == (1 if reproduced else 2)
    cache, rest = pool.fetch_nearest_cache(KEY, shared + question)
    assert rest == question
    # The entry's own steps (its last token alone): reused as it was kept.
    fresh = model(mx.array([question]), cache=kept_cache(model, config, shared))
    assert mx.allclose(model(mx.array([rest]), cache=cache), fresh, rtol=0, atol=1e-5).item()


def test_the_docs_table_lists_every_method_of_the_package() -> None:
    # The lengths docs/usage.md states, for every method the package ships (the worked
    # example of docs/developing.md is held to the rule alone).
    from conftest import DOC_EXAMPLE_MODULE

    from veloxquant_mlx.registry import methods

    shipped = {n for n, cls in methods().items() if cls.__module__ != DOC_EXAMPLE_MODULE}
    assert shipped == set(REUSED)
