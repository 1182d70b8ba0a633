"""XKVCache on tiny random models (and one short check on the embedded model)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import tiny_model

from veloxquant_mlx.builder import KVCacheBuilder, cache_stats
from veloxquant_mlx.cache.xkv import XKVCache, link_groups
from veloxquant_mlx.config import ConfigError, KVCacheConfig

BLOCK = 32


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=5)


def _cfg(**kw):
    base = dict(method="xkv", xkv_block=BLOCK, xkv_group_size=2, xkv_energy_threshold=1.0)
    base.update(kw)
    return KVCacheConfig(**base)


def _run(model, caches, tokens, prompt, chunk=32):
    """Chunked prefill of ``prompt`` tokens, then one decode step per token."""
    outs = []
    for i in range(0, prompt, chunk):
        outs.append(model(tokens[:, i:min(i + chunk, prompt)], cache=caches))
    for t in range(prompt, tokens.shape[1]):
        outs.append(model(tokens[:, t:t + 1], cache=caches))
    return mx.concatenate(outs, axis=1)


def _tokens(batch=1, n=110, seed=1):
    mx.random.seed(seed)
    return mx.random.randint(0, 128, (batch, n))


# ---- configuration ----
@pytest.mark.parametrize("field,value,match", [
    ("xkv_group_size", 0, ">= 1"),
    ("xkv_rank_k", 0, ">= 1"),
    ("xkv_rank_v", BLOCK + 1, "xkv_block"),
    ("xkv_block", 0, ">= 1"),
    ("xkv_factor_bits", 7, "one of"),
    ("xkv_pre_rope", "yes", "True or False"),
    ("xkv_grouping", "random", "'contiguous' or 'cka'"),
    ("window", -1, "positive|>= 0"),
])
def test_bad_config_names_field(field, value, match):
    with pytest.raises(ConfigError, match=rf"KVCacheConfig\.{field}=.*{match}"):
        _cfg(**{field: value})


def test_block_must_fit_factor_quantization():
    with pytest.raises(ConfigError, match="xkv_block=48.*multiple of 32"):
        _cfg(xkv_block=48, xkv_factor_bits=4)


def test_rank_larger_than_group_width(model):
    # tiny llama: 2 KV heads x 32 = 64 features per layer; G=1 allows rank <= 64.
    with pytest.raises(ConfigError, match=r"xkv_rank_k=100.*1\*64"):
        KVCacheBuilder.for_model(model, _cfg(xkv_group_size=1, xkv_block=128,
                                             xkv_rank_k=100))


def test_cka_grouping_not_in_this_build(model):
    with pytest.raises(NotImplementedError, match="cka"):
        KVCacheBuilder.for_model(model, _cfg(xkv_grouping="cka"))


# ---- roles ----
def test_contiguous_groups_one_coordinator(model):
    caches = KVCacheBuilder.for_model(model, _cfg(xkv_group_size=2))
    roles = [(c.layer.group_id, c.layer.member_idx, c.layer.group_size) for c in caches]
    assert roles == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2), (2, 0, 1)]
    assert len({id(c.layer.coordinator) for c in caches}) == 1
    assert [c.leader is caches[2 * (i // 2)] for i, c in enumerate(caches)] == [True] * 5


# ---- behaviour ----
@pytest.mark.parametrize("pre_rope", [True, False])
@pytest.mark.parametrize("batch", [1, 2])
def test_full_energy_matches_dense(model, pre_rope, batch):
    tokens = _tokens(batch)
    ref = _run(model, make_prompt_cache(model), tokens, 90)
    caches = KVCacheBuilder.for_model(model, _cfg(xkv_pre_rope=pre_rope))
    out = _run(model, caches, tokens, 90)
    assert all(len(c.blocks) == 3 for c in caches)  # 110 tokens -> 3 blocks of 32
    assert mx.abs(out - ref).max().item() < 2e-2  # float16 factors


def test_low_rank_compresses_and_accounting_matches(model):
    tokens = _tokens(2, n=140)
    caches = KVCacheBuilder.for_model(model, _cfg(xkv_rank_k=8, xkv_rank_v=8,
                                                  xkv_factor_bits=8))
    ref = _run(model, make_prompt_cache(model), tokens, 128)
    out = _run(model, caches, tokens, 128)
    st = cache_stats(caches)
    assert abs(st["held_bytes"] / st["accounted_bytes"] - 1) < 0.05
    assert st["ratio"] < 0.5
    assert mx.abs(out - ref).max().item() < 5.0  # degraded, but still a model output
    for c in caches:
        # Nothing full-size: the window holds only tokens not yet compressed.
        assert c.win_k.shape[2] == c.offset - c.win_start < BLOCK
        assert all(a.shape[-2] <= max(BLOCK, 64) for a in c.held_arrays() if a.ndim >= 2)


def test_shared_token_factor_held_once(model):
    tokens = _tokens(1, n=70)
    caches = KVCacheBuilder.for_model(model, _cfg(xkv_rank_k=8, xkv_rank_v=8))
    _run(model, caches, tokens, 64)
    leader, member = caches[0], caches[1]
    assert leader.shared and not member.shared
    ids_leader = {id(a) for a in leader.held_arrays()}
    assert not ids_leader & {id(a) for a in member.held_arrays()}
    # The member's bytes are its own factors + means + window only.
    assert member.nbytes < leader.nbytes


def test_blocks_move_only_after_all_members_published(model):
    tokens = _tokens(1, n=BLOCK + 1)
    caches = KVCacheBuilder.for_model(model, _cfg())
    model(tokens[:, :BLOCK], cache=caches)
    assert all(not c.blocks and c.pending for c in caches)  # published, still in window
    assert caches[0].layer.coordinator.svd_calls == 0
    model(tokens[:, BLOCK:], cache=caches)
    assert all(len(c.blocks) == 1 and not c.pending for c in caches)
    # 3 groups x (keys, values): one SVD each.
    assert caches[0].layer.coordinator.svd_calls == 6


def test_one_token_prompt(model):
    tokens = _tokens(1, n=5)
    ref = _run(model, make_prompt_cache(model), tokens, 1)
    out = _run(model, KVCacheBuilder.for_model(model, _cfg()), tokens, 1)
    assert mx.allclose(out, ref, atol=1e-2).item()


@pytest.mark.parametrize("bits,tol", [(8, 0.1), (4, 1.0)])
def test_quantized_factors(model, bits, tol):
    tokens = _tokens(1, n=100)
    ref = _run(model, make_prompt_cache(model), tokens, 96)
    caches = KVCacheBuilder.for_model(model, _cfg(xkv_factor_bits=bits))
    out = _run(model, caches, tokens, 96)
    assert mx.abs(out - ref).max().item() < tol
    full = KVCacheBuilder.for_model(model, _cfg())
    _run(model, full, tokens, 96)
    assert cache_stats(caches)["held_bytes"] < cache_stats(full)["held_bytes"]


def test_window_keeps_recent_tokens(model):
    tokens = _tokens(1, n=80)
    caches = KVCacheBuilder.for_model(model, _cfg(window=20))
    _run(model, caches, tokens, 64)
    for c in caches:
        assert c.offset - c.win_start >= 20


def test_state_roundtrip(model):
    tokens = _tokens(1, n=75)
    cfg = _cfg(xkv_rank_k=16, xkv_rank_v=16, xkv_factor_bits=8)
    caches = KVCacheBuilder.for_model(model, cfg)
    _run(model, caches, tokens, 64)
    fresh = KVCacheBuilder.for_model(model, cfg)
    for old, new in zip(caches, fresh):
        new.meta_state = old.meta_state
        new.state = old.state
    link_groups(fresh)
    q = mx.random.normal((1, 4, 1, 32))
    for old, new in zip(caches, fresh):
        assert mx.allclose(old.attend(q, 0.2), new.attend(q, 0.2), atol=1e-5).item()


def test_wrong_shape_input(model):
    c = XKVCache(_cfg())
    with pytest.raises(ValueError, match="head_dim"):
        c.update_and_fetch(mx.zeros((1, 1, 2, 8)), mx.zeros((1, 1, 2, 8)))


# ---- embedded model ----
@pytest.mark.slow
def test_embedded_model_short_context():
    from veloxquant_mlx import models
    from veloxquant_mlx.eval.perplexity import perplexity_through_cache
    from veloxquant_mlx.eval.text import encode, load_text

    model, tok = models.load()
    tokens = encode(tok, load_text(None))[:300]
    dense = perplexity_through_cache(model, tokens, lambda: make_prompt_cache(model), 256, 32)
    cfg = KVCacheConfig(method="xkv", xkv_block=128, xkv_rank_k=96, xkv_rank_v=96,
                        xkv_factor_bits=8)
    got = perplexity_through_cache(model, tokens,
                                   lambda: KVCacheBuilder.for_model(model, cfg), 256, 32)
    assert got["ratio"] < 0.9
    assert abs(got["held_bytes"] / got["accounted_bytes"] - 1) < 0.05
    assert got["ppl"] < dense["ppl"] * 1.3
