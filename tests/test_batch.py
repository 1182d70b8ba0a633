"""mlx_lm's batch generation with compressed caches (BatchedCache)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from conftest import small_config
from mlx_lm.generate import batch_generate, generate_step, generation_stream
from test_memory import keep_dense_copy

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, cache_stats
from veloxquant_mlx.cache.base import CompressedCache
from veloxquant_mlx.cache.batch import BatchedCache
from veloxquant_mlx.memory import active_bytes
from veloxquant_mlx.testing.tiny import tiny_model

PROMPTS = [[(i * 13 + 5 * j) % 120 + 1 for i in range(n)] for j, n in enumerate((23, 7, 40))]


class Tok:
    eos_token_ids = [127]

    def decode(self, tokens):
        return " ".join(map(str, tokens))


def single(model, cfg, prompt, n=5):
    caches = KVCacheBuilder.for_model(model, cfg)
    steps = generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=n)
    return [int(t) for (t, _), _ in zip(steps, range(n))]


@pytest.mark.parametrize("cfg", [dict(method="none"),
                                 dict(method="affine", bits=8, group_size=32),
                                 dict(method="affine", bits=4, group_size=32, window=4)])
def test_batch_generate_matches_one_at_a_time(cfg: dict) -> None:
    model = tiny_model("llama", seed=5)
    config = KVCacheConfig(**cfg)
    caches = [KVCacheBuilder.for_model(model, config) for _ in PROMPTS]
    r = batch_generate(model, Tok(), PROMPTS, prompt_caches=caches, max_tokens=5,
                       return_token_ids=True, return_prompt_caches=True,
                       prefill_step_size=16)
    assert r.token_ids == [single(model, config, p) for p in PROMPTS]
    # The caches that come back are the compressed per-sequence caches, never dense.
    for prompt, seq_caches in zip(PROMPTS, r.caches):
        assert all(type(c).method == config.method for c in seq_caches)
        assert seq_caches[0].offset >= len(prompt)


def test_batched_logits_match_per_sequence() -> None:
    model = tiny_model("llama")
    config = KVCacheConfig(method="affine", bits=4, group_size=32)
    per_seq = [KVCacheBuilder.for_model(model, config) for _ in range(2)]
    batch = [BatchedCache.merge([a, b]) for a, b in zip(*per_seq)]
    for c in batch:
        c.prepare(lengths=[9, 4], right_padding=[0, 5])
    tokens = mx.array([list(range(1, 10)), [3, 4, 5, 6, 0, 0, 0, 0, 0]])
    out = model(tokens, cache=batch)
    for c in batch:
        c.finalize()
    ref_a = model(tokens[:1], cache=KVCacheBuilder.for_model(model, config))
    ref_b = model(tokens[1:, :4], cache=KVCacheBuilder.for_model(model, config))
    assert mx.allclose(out[0], ref_a[0], atol=1e-4).item()
    assert mx.allclose(out[1, :4], ref_b[0], atol=1e-4).item()
    assert [c.offset for c in per_seq[1]] == [4] * 4
    step = model(mx.array([[11], [12]]), cache=batch)
    assert step.shape[0] == 2
    assert batch[0].offset.tolist() == [10, 5]
    # filter / extend / extract keep the per-sequence objects.
    other = BatchedCache.merge([per_seq[0][0]])
    batch[0].filter([1])
    assert batch[0].extract(0) is per_seq[1][0]
    batch[0].extend(other)
    assert batch[0].caches == [per_seq[1][0], per_seq[0][0]]
    assert batch[0].nbytes == per_seq[1][0].nbytes + per_seq[0][0].nbytes


def test_batch_errors_are_clear() -> None:
    model = tiny_model("llama")
    c = KVCacheBuilder.for_model(model, KVCacheConfig(method="affine", group_size=32))[0]
    with pytest.raises(NotImplementedError, match="merged batch cache"):
        c.filter([0])
    with pytest.raises(NotImplementedError, match="merged batch cache"):
        c.extract(0)
    b = BatchedCache.merge([c])
    with pytest.raises(NotImplementedError, match="left padding"):
        b.prepare(left_padding=[2])
    with pytest.raises(ValueError, match="batch size 2"):
        b.update_and_fetch(mx.zeros((2, 2, 1, 32)), mx.zeros((2, 2, 1, 32)))

    class NoBatch(type(c)):
        profile = dataclasses.replace(type(c).profile, batching=False)

    with pytest.raises(NotImplementedError, match="does not support batch merging"):
        NoBatch.merge([c])


def test_a_batch_checks_its_prompt_chunk_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One finiteness check (one sync) per layer call for the whole batch, none per
    row; a non-finite chunk is still refused, naming the batch."""
    from veloxquant_mlx.cache import finite

    model = tiny_model("llama")
    cfg = KVCacheConfig(method="affine", group_size=32)
    rows = [KVCacheBuilder.for_model(model, cfg)[0] for _ in range(3)]
    b = BatchedCache.merge(rows)
    calls = []
    real = finite.all_finite
    monkeypatch.setattr(finite, "all_finite", lambda k, v: calls.append(k.shape) or real(k, v))
    H, D = rows[0].layer.n_kv_heads, rows[0].layer.head_dim
    x = mx.random.normal((3, H, 8, D))
    b.update_and_fetch(x, x)
    assert calls == [(3, H, 8, D)]
    assert all(c.offset == 8 for c in rows)
    bad = mx.concatenate([x[:2], mx.full((1, H, 8, D), mx.nan)])
    with pytest.raises(ValueError, match="batch of 3 sequences.*NaN or Inf"):
        b.update_and_fetch(bad, bad)
    assert all(c.offset == 8 for c in rows)  # refused before any row stored it
    with pytest.raises(ValueError, match="NaN or Inf"):  # a row alone still checks
        rows[0].update_and_fetch(bad[2:], bad[2:])


def batch_memory(model, cfg: KVCacheConfig) -> tuple[object, int, int]:
    """``batch_generate`` through fresh per-sequence caches: its result, the bytes the
    caches really keep alive (allocator) and the bytes they declare."""
    KVCacheBuilder.detach(model)
    base = active_bytes()
    caches = [KVCacheBuilder.for_model(model, cfg) for _ in PROMPTS]
    r = batch_generate(model, Tok(), PROMPTS, prompt_caches=caches, max_tokens=3,
                       return_token_ids=True, return_prompt_caches=True)
    del caches
    mx.synchronize(generation_stream)  # work it computed ahead is alive until it ends
    return r, active_bytes() - base, sum(cache_stats(s)["held_bytes"] for s in r.caches)


@pytest.mark.usefixtures("no_buffer_cache")
def test_batch_generate_every_method(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every method batches (per-sequence caches) or refuses clearly; never dense."""
    model = tiny_model("llama")
    cfg = small_config(method)
    caches = [KVCacheBuilder.for_model(model, cfg) for _ in PROMPTS]
    first = next(c for c in caches[0] if isinstance(c, CompressedCache))
    cls = type(first)
    if not cls.profile.batching:
        with pytest.raises(NotImplementedError, match="does not support batch merging"):
            batch_generate(model, Tok(), PROMPTS, prompt_caches=caches, max_tokens=3)
        return
    expected = [single(model, cfg, p, 3) for p in PROMPTS]
    r, real, held = batch_memory(model, cfg)
    assert r.token_ids == expected
    for seq in r.caches:
        assert cache_stats(seq)["held_bytes"] > 0
        assert all(isinstance(c, CompressedCache) for c in seq)
    # What the caches really keep alive is what they declare, give or take the last
    # step (an update still lazy, a window slice pinning one more token): one token of
    # float32 keys and values per layer and sequence.
    info = first.layer
    slack = len(caches[0]) * len(PROMPTS) * info.n_kv_heads * \
        (info.head_dim + info.v_head_dim) * 4
    assert real <= held + slack, (real, held, slack)
    # A cache keeping a dense copy beside its compressed form fails that bound.
    del r
    keep_dense_copy(monkeypatch, cls)
    _, real, held = batch_memory(model, cfg)
    assert real > held + slack, (real, held, slack)
