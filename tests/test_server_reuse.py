"""``veloxquant serve``'s prompt cache: kept compressed caches reused across requests.

The pool (``apps.prompt_reuse.CompressedPromptCache``) is driven in process exactly as
mlx_lm.server's generation loop drives it: ``fetch_nearest_cache``, the batch
generator's segments (a system prompt's cache is inserted when its segment ends), and
``insert_cache`` of the finished sequence. Models are tiny random llamas; prompts stay
within the tokens that each method's ``profile.lossless`` keep whole. At compressing
settings a trimmed reuse must equal a fresh prefill of the prefix it keeps, or be cut
shorter: tests/test_reuse_exact.py.

Run as a script on the embedded model, it prints the paired KL of the reused path
against a fresh prefill at compressing settings::

    python tests/test_server_reuse.py --method kivi:bits=4 --method turboquant
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.apps.prompt_reuse import CompressedPromptCache
from veloxquant_mlx.apps.server_batch import ServerBatchGenerator, bind_batch_generator
from veloxquant_mlx.apps.server_limits import KVCost, ServerLimits
from veloxquant_mlx.registry import get_method, methods

KEY = ("tiny", None, None)  # mlx_lm's model key
SYSTEM = [(i * 7 + 3) % 120 + 1 for i in range(8)]


class Provider:
    """What the pool reads of mlx_lm's model provider."""

    def __init__(self, model: Any) -> None:
        self.model, self.model_key = model, KEY


@pytest.fixture(scope="module")
def model() -> Any:
    from veloxquant_mlx.testing.tiny import tiny_model

    return tiny_model("llama", seed=5)


def words(n: int, seed: int) -> list[int]:
    return [(i * 31 + seed * 17) % 120 + 1 for i in range(n)]


def pool_for(model: Any, config: KVCacheConfig, **kwargs: Any) -> CompressedPromptCache:
    return CompressedPromptCache(Provider(model), config, **kwargs)


def generator(model: Any, limits: ServerLimits | None = None) -> ServerBatchGenerator:
    cls = bind_batch_generator(limits, 0.5) if limits is not None else ServerBatchGenerator
    return cls(model, completion_batch_size=8, prefill_batch_size=4, prefill_step_size=16)


def _cut(segments: list[list[int]], types: list[str], n: int) -> None:
    """Drop the first ``n`` tokens of the segments (mlx_lm's loop, after a fetch)."""
    while n > 0:
        if n >= len(segments[0]):
            n -= len(segments.pop(0))
            types.pop(0)
        else:
            segments[0] = segments[0][n:]
            break


def turn(pool: CompressedPromptCache, gen: Any, segments: list[list[int]],
         max_tokens: int = 6, ticket: Any = None) -> tuple[list[int], int, list[int]]:
    """One request as mlx_lm.server serves it: (tokens generated, prompt tokens reused,
    tokens of the cache kept at the end)."""
    prompt = [t for s in segments for t in s]
    types = ["system", "user"][-len(segments):]
    pool.pending_ticket = ticket
    cache, rest = pool.fetch_nearest_cache(KEY, prompt)
    reused = len(prompt) - len(rest)
    segments = [list(s) for s in segments]
    _cut(segments, types, reused)
    (uid,) = gen.insert_segments([segments], max_tokens=[max_tokens], caches=[cache],
                                 all_tokens=[prompt[:reused]])
    del cache
    types = types[::-1]
    out: list[int] = []
    while True:
        prompt_r, gen_r = gen.next()
        for r in prompt_r:
            if r.uid == uid and r.end_of_segment and not r.end_of_prompt and types:
                caches, tokens = gen.extract_cache([uid])[uid]
                pool.insert_cache(KEY, tokens[:], caches, cache_type=types.pop())
        for r in gen_r:
            out.append(r.token)
            if r.finish_reason is not None:
                kept = r.all_tokens[:]
                pool.insert_cache(KEY, kept, r.prompt_cache, cache_type="assistant")
                return out, reused, kept


def fresh_tokens(model: Any, config: KVCacheConfig, segments: list[list[int]],
                 max_tokens: int = 6) -> list[int]:
    return turn(pool_for(model, config, max_size=0), generator(model), segments, max_tokens)[0]


# ---- (a), (b): reused caches give the tokens of fresh caches ----
def test_reused_turns_and_conversations_match_fresh_caches(model: Any, method: str) -> None:
    config = KVCacheConfig(method, **get_method(method).profile.lossless)
    pool, gen = pool_for(model, config), generator(model)
    first = [SYSTEM, words(10, 1)]
    answer, reused, kept = turn(pool, gen, first)
    assert reused == 0 and answer == fresh_tokens(model, config, first)
    # The next turn extends the kept cache exactly: only the question is prefilled.
    second = [SYSTEM, kept[len(SYSTEM):] + words(6, 2)]
    answer2, reused2, _ = turn(pool, gen, second)
    assert reused2 == len(kept)
    assert answer2 == fresh_tokens(model, config, second)
    # Another conversation with the same system prompt and its own history: it starts
    # from the system prompt only (exactly shared), never from the other history.
    other = [SYSTEM, words(12, 3)]
    answer3, reused3, _ = turn(pool, gen, other)
    assert len(SYSTEM) <= reused3 < len(SYSTEM) + 2, reused3
    assert answer3 == fresh_tokens(model, config, other)
    # A branch of the first conversation (another question after the first answer).
    branch = [SYSTEM, kept[len(SYSTEM):] + words(5, 4)]
    answer4, reused4, _ = turn(pool, gen, branch)
    assert reused4 >= len(kept)
    assert answer4 == fresh_tokens(model, config, branch)
    assert pool.counters["reused"] == 3


def test_a_copy_does_not_share_coordinator_state(model: Any) -> None:
    cross = [m for m, c in methods().items() if c.profile.cross_layer]
    assert cross
    for method in cross:
        config = KVCacheConfig(method, **get_method(method).profile.lossless)
        pool = pool_for(model, config)
        _, _, kept = turn(pool, generator(model), [SYSTEM, words(10, 1)])
        entry = pool._trie.get(KEY, kept).prompt_cache
        copied, _ = pool.fetch_nearest_cache(KEY, kept + [5])
        for layers in (entry, copied):
            coordinators = {id(c.layer.coordinator) for c in layers
                            if getattr(c.layer, "coordinator", None) is not None}
            assert len(coordinators) == 1, method  # one per sequence, shared by its layers
        assert {id(c.layer.coordinator) for c in entry} != \
            {id(c.layer.coordinator) for c in copied}, method


# ---- (c): the byte budget, LRU order, pinned entries ----
def limits_for(config: KVCacheConfig, budget: int) -> ServerLimits:
    limits = ServerLimits(config, max_kv_memory=budget, max_queue=0, queue_timeout=1.0)
    # 100 kB a token (no growth step): charges far above the tiny caches' own bytes.
    limits.cost = KVCost(config.to_string(), per_token=100_000.0, fixed=0, step=0)
    limits.max_context = 4096
    return limits


def admitted_turn(limits: ServerLimits, pool: CompressedPromptCache, gen: Any,
                  segments: list[list[int]]) -> tuple[list[int], int, list[int]]:
    prompt = [t for s in segments for t in s]
    ticket = limits.admit(len(prompt), 4, lambda: False, prompt)
    try:
        return turn(pool, gen, segments, 4, ticket)
    finally:
        limits.finished(ticket)


def kept_keys(pool: CompressedPromptCache) -> list[int]:
    """The first token of every kept entry (each conversation starts differently)."""
    return sorted(tokens[0] for _, tokens in pool._lru._lrus["assistant"])


def test_eviction_is_lru_within_the_budget_and_spares_pinned_entries(model: Any) -> None:
    config = KVCacheConfig("kivi", bits=4, group_size=32)
    limits = limits_for(config, 9_000_000)  # three kept entries and a request: not four
    pool, gen = pool_for(model, config, limits=limits), generator(model, limits)
    convs = {c: [[c] + words(19, c)] for c in (1, 2, 3, 4)}
    kept = {c: admitted_turn(limits, pool, gen, convs[c])[2] for c in (1, 2, 3)}
    budget = limits.budget
    gc.collect()
    # Each finished request handed its entry's share over: nothing reserved twice.
    assert budget.reserved == 0 and budget.kept == 3 * 2_400_000 == pool.nbytes
    # A fourth conversation needs room for itself: the least recently used goes.
    admitted_turn(limits, pool, gen, convs[4])
    gc.collect()
    assert kept_keys(pool) == [2, 3, 4]
    assert budget.peak_held <= budget.budget
    # Conversation 2 (now the oldest) is admitted for its next turn: pinned until it
    # has copied its entry, so a new conversation that needs room evicts 3 instead.
    budget.budget = 10_600_000
    nxt = [kept[2] + words(4, 9)]
    waiting = limits.admit(len(nxt[0]), 4, lambda: False, nxt[0])
    assert waiting.pinned and pool.snapshot()["pinned"] == 1
    limits.admit(24, 1, lambda: False, [7] + words(23, 7)).handler_done()
    assert kept_keys(pool) == [2, 4]
    _, reused, _ = turn(pool, gen, nxt, 4, waiting)
    limits.finished(waiting)
    assert reused == len(kept[2]) and not waiting.pinned
    gc.collect()
    assert budget.reserved == 0 and budget.peak_held <= budget.budget


def test_entry_and_byte_limits_evict_least_recently_used(model: Any) -> None:
    config = KVCacheConfig("kivi", bits=4, group_size=32)
    limits = limits_for(config, 10**9)
    pool = pool_for(model, config, limits=limits, max_size=2)
    gen = generator(model, limits)
    kept = {c: admitted_turn(limits, pool, gen, [[c] + words(19, c)])[2] for c in (1, 2)}
    # Reusing 1 makes it the most recent: the third conversation evicts 2.
    pool.fetch_nearest_cache(KEY, kept[1] + [9])
    admitted_turn(limits, pool, gen, [[3] + words(19, 3)])
    assert kept_keys(pool) == [1, 3]
    by_bytes = pool_for(model, config, limits=limits_for(config, 10**9),
                        max_bytes=5_000_000)
    for c in (1, 2, 3):
        turn(by_bytes, gen, [[c] + words(19, c)], 4)
    assert kept_keys(by_bytes) == [2, 3] and by_bytes.nbytes <= 5_000_000
    off = pool_for(model, config, max_size=0)
    _, _, kept_off = turn(off, gen, [[1] + words(19, 1)], 4)
    assert len(off) == 0 and turn(off, gen, [kept_off + [5]], 4)[1] == 0


# ---- (d): a cache that cannot trim is reused only on an exact extension ----
def test_non_trimmable_cache_is_reused_only_on_exact_extension(model: Any) -> None:
    # StreamingLLM with a 16-token window: past it, the cache has evicted tokens.
    config = KVCacheConfig("streaming", **get_method("streaming").profile.small)
    pool, gen = pool_for(model, config), generator(model)
    prompt = [1] + words(39, 1)
    _, _, kept = turn(pool, gen, [prompt])
    entry = pool._trie.get(KEY, kept).prompt_cache
    assert not any(c.is_trimmable() for c in entry)
    assert turn(pool, gen, [prompt[:30] + words(5, 2)])[1] == 0  # a branch: not reused
    # The same tokens again: the last one must be recomputed, which this entry cannot
    # drop; the prompt's own segment entry (all but its last token) is an exact prefix.
    assert turn(pool, gen, [kept])[1] == len(prompt) - 1
    assert turn(pool, gen, [kept + words(3, 3)])[1] == len(kept)  # an exact extension
    # The model's own sliding-window layers (mlx_lm's RotatingKVCache, 16 tokens) past
    # their window: their trim() would only move the offset back, so never called.
    from veloxquant_mlx.testing.tiny import tiny_model

    gemma, config = tiny_model("gemma3_text", seed=1), KVCacheConfig("none")
    mixed = pool_for(gemma, config)
    _, _, kept = turn(mixed, generator(gemma), [prompt])
    assert turn(mixed, generator(gemma), [prompt[:30] + words(5, 2)])[1] == 0
    extension = [kept + words(3, 3)]
    tokens, reused, _ = turn(mixed, generator(gemma), extension)
    assert reused == len(kept) and tokens == fresh_tokens(gemma, config, extension)
    trimmable = pool_for(model, KVCacheConfig("kivi", bits=4, group_size=32))
    _, _, kept = turn(trimmable, gen, [prompt])
    assert turn(trimmable, gen, [prompt[:30] + words(5, 2)])[1] == 30
    assert trimmable.counters["trimmed"] == 1


# ---- through the HTTP server ----
def test_chat_turns_reuse_through_the_server_and_kept_caches_give_way(tmp_path: Any) -> None:
    from test_server import VOCAB, write_tiny_model

    from veloxquant_mlx.eval import loadtest

    write_tiny_model(tmp_path)
    extra = ["--prefill-step-size", "32", "--max-queue", "0", "--queue-timeout", "5"]
    with loadtest.ServerProcess("kivi:bits=4", "1.2MB", str(tmp_path), extra,
                                tmp_path / "serve.log") as server:
        port = server.port
        history = [{"role": "system", "content": loadtest.words(20, VOCAB, 1)},
                   {"role": "user", "content": loadtest.words(60, VOCAB, 2)}]
        status, first = loadtest.post_json(port, {"messages": history, "max_tokens": 8})
        assert status == 200, first
        history += [first["choices"][0]["message"],
                    {"role": "user", "content": loadtest.words(6, VOCAB, 3)}]
        status, second = loadtest.post_json(port, {"messages": history, "max_tokens": 8})
        assert status == 200, second
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert first["usage"]["prompt_tokens"] <= cached < second["usage"]["prompt_tokens"]
        snap = loadtest.get_json(port, "/limits")[1]
        kept = snap["prompt_cache"]
        assert kept["entries"] >= 1 and snap["kept_bytes"] == kept["kept_bytes"] > 0
        assert snap["reserved_bytes"] == 0 and kept["counters"]["reused"] == 1
        assert snap["kv_real_bytes"] <= snap["max_kv_memory"]
        # A request that needs nearly the whole budget: the kept caches make room.
        big = snap["fits_tokens"] - 8 - 20
        status, reply = loadtest.post_json(port, loadtest.chat(loadtest.words(big, VOCAB), 8))
        assert status == 200, reply
        after = loadtest.get_json(port, "/limits")[1]
        assert after["prompt_cache"]["counters"]["evicted"] >= 1
        assert after["peak_reserved_and_kept_bytes"] <= after["max_kv_memory"]


# ---- the paired KL at compressing settings (a script on the embedded model) ----
def _logits(model: Any, caches: list[Any], tokens: list[int], chunk: int) -> mx.array:
    from veloxquant_mlx.adapter.prefill import prefill

    return prefill(model, caches, mx.array(tokens, dtype=mx.int32), chunk)


def _forced(model: Any, caches: list[Any], first: mx.array, tokens: list[int]) -> mx.array:
    """Log-probabilities at every position of ``tokens`` fed one at a time."""
    out = [first.reshape(1, -1)]
    for t in tokens[:-1]:
        out.append(model(mx.array([[t]], dtype=mx.int32), cache=caches)[0, -1:])
    return mx.concatenate(out, axis=0).astype(mx.float32)


def _paths(model: Any, config: KVCacheConfig, first: list[int], answer: list[int],
           second: list[int], probe: list[int], chunk: int) -> tuple[mx.array, mx.array]:
    """Log-probabilities over ``probe`` (teacher-forced after turn two): fresh, reused.

    Reused: ``first`` prefilled, ``answer`` decoded one token at a time (what a kept
    cache holds), then ``second`` prefilled on it. Fresh: the same tokens in one prefill.
    """
    from veloxquant_mlx import KVCacheBuilder

    reused = KVCacheBuilder.for_model(model, config)
    _logits(model, reused, first, chunk)
    for t in answer:
        model(mx.array([[t]], dtype=mx.int32), cache=reused)
    r = _forced(model, reused, _logits(model, reused, second, chunk), probe)
    fresh = KVCacheBuilder.for_model(model, config)
    f = _forced(model, fresh, _logits(model, fresh, first + answer + second, chunk), probe)
    return tuple(x - mx.logsumexp(x, axis=-1, keepdims=True) for x in (f, r))


def _kl(p: mx.array, q: mx.array) -> float:
    """Mean KL(p || q) over positions, from log-probabilities."""
    return float(mx.mean(mx.sum(mx.exp(p) * (p - q), axis=-1)))


def paired_kl(model: Any, config: KVCacheConfig, first: list[int], answer: list[int],
              second: list[int], probe: list[int], chunk: int = 512) -> float:
    """Mean KL(fresh || reused) over ``probe`` (see ``_paths``)."""
    return _kl(*_paths(model, config, first, answer, second, probe, chunk))


def test_paired_kl_is_zero_at_lossless_settings(model: Any) -> None:
    config = KVCacheConfig("affine", **get_method("affine").profile.lossless)
    kl = paired_kl(model, config, words(12, 1), words(4, 2), words(6, 3), words(5, 4), 8)
    assert abs(kl) < 1e-6
    lossy = paired_kl(model, KVCacheConfig("kivi", **{**get_method("kivi").profile.small,
                                                       "bits": 2}),
                      words(40, 1), words(4, 2), words(6, 3), words(5, 4), 16)
    assert lossy > 1e-6  # the measurement sees a difference where there is one


def _main(argv: list[str]) -> None:
    import argparse

    from veloxquant_mlx.models import load

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", action="append", default=None)
    p.add_argument("--history", type=int, default=3000, help="tokens of the first turn")
    args = p.parse_args(argv)
    model, tok = load()
    text = open(__file__.replace("test_server_reuse.py", "../README.md")).read()
    ids = tok.encode(text * (1 + args.history * 5 // max(len(text), 1)))
    first, answer = ids[:args.history], ids[args.history:args.history + 64]
    second = ids[args.history + 64:args.history + 96]
    probe = ids[args.history + 96:args.history + 160]
    dense = _paths(model, KVCacheConfig(), first, answer, second, probe, 512)[0]
    for spec in args.method or ["kivi:bits=4", "turboquant", "none"]:
        fresh, reused = _paths(model, KVCacheConfig.from_string(spec), first, answer, second,
                               probe, 512)
        print(f"{spec}: over {len(probe)} tokens, KL(fresh || reused) = "
              f"{_kl(fresh, reused):.3e}; against dense: fresh {_kl(dense, fresh):.3e}, "
              f"reused {_kl(dense, reused):.3e}", flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
