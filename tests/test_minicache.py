"""MiniCache: SLERP merge, the pairwise coordinator contract, storage and generation."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from conftest import prefill_then_decode

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, cache_stats
from veloxquant_mlx.cache.base import LayerInfo, NotTrimmableError
from veloxquant_mlx.cache.minicache import MiniCacheCache
from veloxquant_mlx.cache.minicache_coordinator import MiniCacheCoordinator, slerp_merge
from veloxquant_mlx.cache.step_cost import layer_stats
from veloxquant_mlx.config import ConfigError
from veloxquant_mlx.testing.tiny import tiny_model

B, H, D = 2, 2, 32


def rand_kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((B, H, n, D), key=mx.random.key(seed))
    v = mx.random.normal((B, H, n, D), key=mx.random.key(seed + 1000))
    return k, v


def close(a: mx.array, b: mx.array, tol: float = 2e-2) -> bool:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item() < tol


# ---------------------------------------------------------------- SLERP
def test_slerp_endpoints_and_midpoint():
    x0 = mx.random.normal((3, 5, 16), key=mx.random.key(1))
    x1 = mx.random.normal((3, 5, 16), key=mx.random.key(2))
    u0 = x0 / mx.linalg.norm(x0, axis=-1, keepdims=True)
    u1 = x1 / mx.linalg.norm(x1, axis=-1, keepdims=True)
    d, n0, n1, dist = slerp_merge(x0, x1, 0.0)
    assert close(d, u0, 1e-5)
    assert close(n0, mx.linalg.norm(x0, axis=-1), 1e-5)
    assert close(n1, mx.linalg.norm(x1, axis=-1), 1e-5)
    assert close(slerp_merge(x0, x1, 1.0)[0], u1, 1e-5)
    mid = slerp_merge(x0, x1, 0.5)[0]
    # Unit length and equal angles to both endpoints.
    assert close(mx.linalg.norm(mid, axis=-1), mx.ones((3, 5)), 1e-5)
    assert close(mx.sum(mid * u0, -1), mx.sum(mid * u1, -1), 1e-5)
    cos = mx.clip(mx.sum(u0 * u1, -1), -1, 1)
    assert close(dist, mx.arccos(cos) / math.pi, 1e-5)


def test_slerp_parallel_and_opposite_vectors():
    x = mx.array([[1.0, 2.0, 3.0]])
    d, _, _, dist = slerp_merge(x, 3 * x, 0.5)
    assert close(d, x / mx.linalg.norm(x), 1e-5) and dist.item() < 1e-3
    d, _, _, dist = slerp_merge(x, -x, 0.5)
    assert abs(dist.item() - 1.0) < 1e-3 and bool(mx.all(mx.isfinite(d)).item())


# ---------------------------------------------------------------- coordinator contract
def test_consume_before_publish_is_an_error():
    c = MiniCacheCoordinator()
    k, v = rand_kv(4, 0)
    with pytest.raises(RuntimeError, match="before the primary published"):
        c.consume(0, 5, 0, k, v)


def test_second_consumer_is_an_error():
    c = MiniCacheCoordinator()
    k, v = rand_kv(4, 0)
    c.publish(0, 0, k, v)
    c.consume(0, 5, 0, k, v)
    c.publish(0, 4, k, v)
    with pytest.raises(RuntimeError, match="already its merge partner"):
        c.consume(0, 6, 4, k, v)


def test_second_consume_of_a_range_is_an_error():
    c = MiniCacheCoordinator()
    k, v = rand_kv(4, 0)
    c.publish(0, 0, k, v)
    c.consume(0, 5, 0, k, v)
    with pytest.raises(RuntimeError, match="already consumed"):
        c.consume(0, 5, 0, k, v)


def test_mismatched_ranges_are_errors():
    c = MiniCacheCoordinator()
    k, v = rand_kv(4, 0)
    c.publish(0, 0, k, v)
    with pytest.raises(ValueError, match="does not match the published range"):
        c.consume(0, 5, 0, k[:, :, :3], v[:, :, :3])
    with pytest.raises(RuntimeError, match="before its partner consumed"):
        c.publish(0, 4, k, v)
    c2 = MiniCacheCoordinator()
    with pytest.raises(ValueError, match="expected 0"):
        c2.publish(0, 3, k, v)


def test_primary_attends_on_its_chunk_before_the_merge():
    c = MiniCacheCoordinator(window=0)
    k0, v0 = rand_kv(6, 0)
    c.publish(0, 0, k0, v0)
    rk, rv = c.reconstruct(0, 0, mx.float32)
    assert rk.shape == (B, H, 6, D) and close(rk, k0, 5e-3) and close(rv, v0, 5e-3)
    k1, v1 = rand_kv(6, 1)
    c.consume(0, 1, 0, k1, v1)
    s = c.store(0)
    assert s.n_merged == 6 and s.pending == [None, None]


@pytest.mark.parametrize("member,t", [(0, 0.0), (1, 1.0)])
def test_endpoint_t_reconstructs_that_member(member, t):
    c = MiniCacheCoordinator(t=t, retention=0.0)
    k0, v0 = rand_kv(10, 0)
    k1, v1 = rand_kv(10, 1)
    c.publish(0, 0, k0, v0)
    c.consume(0, 1, 0, k1, v1)
    rk, rv = c.reconstruct(0, member, mx.float32)
    want_k, want_v = (k0, v0) if member == 0 else (k1, v1)
    assert close(rk, want_k) and close(rv, want_v)
    # The other member only gets the shared direction: clearly not exact.
    other = c.reconstruct(0, 1 - member, mx.float32)[0]
    assert not close(other, k1 if member == 0 else k0, 0.1)


def test_merged_tokens_keep_each_layers_magnitude():
    c = MiniCacheCoordinator(t=0.5, retention=0.0)
    k0, v0 = rand_kv(8, 0)
    k1, v1 = 3.0 * k0, 0.5 * v0  # same directions, other lengths
    c.publish(0, 0, k0, v0)
    c.consume(0, 1, 0, k1, v1)
    for m, (k, v) in enumerate(((k0, v0), (k1, v1))):
        rk, rv = c.reconstruct(0, m, mx.float32)
        assert close(rk, k, 3e-2) and close(rv, v, 3e-2)


def test_retention_keeps_the_most_distant_tokens_exact():
    c = MiniCacheCoordinator(t=0.5, retention=0.25)
    n = 16
    k0, v0 = rand_kv(n, 0)
    # Tokens 3 and 11 of the partner point elsewhere; the others nearly agree.
    k1 = k0 + 0.01 * rand_kv(n, 5)[0]
    flip = mx.array([-1.0 if i in (3, 11) else 1.0 for i in range(n)])[None, None, :, None]
    k1 = k1 * flip
    v1 = v0
    c.publish(0, 0, k0, v0)
    c.consume(0, 1, 0, k1, v1)
    s = c.store(0)
    idx = s.keys.retained_idx
    assert idx.shape == (B, H, 4)
    for b in range(B):
        for h in range(H):
            assert {3, 11} <= set(idx[b, h].tolist())
    rk0, _ = c.reconstruct(0, 0, mx.float32)
    rk1, _ = c.reconstruct(0, 1, mx.float32)
    assert close(rk0, k0, 3e-2) and close(rk1, k1, 3e-2)


def test_paper_rule_retains_tokens_below_the_threshold():
    c = MiniCacheCoordinator(t=0.5, retention=0.1, rule="paper")
    n = 12
    k0, v0 = rand_kv(n, 0)
    # Token 4 nearly agrees in both layers, 9 is opposite, the rest are unrelated:
    # d_min ~ 0 (token 4), d_max ~ 1 (token 9), so only token 4 is below 0.1.
    k1 = rand_kv(n, 7)[0]
    k1 = mx.where((mx.arange(n) == 4)[None, None, :, None], k0 + 1e-3, k1)
    k1 = mx.where((mx.arange(n) == 9)[None, None, :, None], -k0, k1)
    c.publish(0, 0, k0, v0)
    c.consume(0, 1, 0, k1, v0)
    s = c.store(0)
    idx = s.keys.retained_idx
    assert idx.shape[2] >= 1 and 9 not in set(idx.reshape(-1).tolist())
    for b in range(B):
        for h in range(H):
            assert 4 in set(idx[b, h].tolist())
    # Unlike the "fraction" rule, the most distant token (9) is merged, so far off.
    rk1 = c.reconstruct(0, 1, mx.float32)[0]
    assert close(rk1[:, :, 4], k1[:, :, 4], 3e-2)
    assert not close(rk1[:, :, 9], k1[:, :, 9], 0.5)


def test_window_merges_in_blocks():
    c = MiniCacheCoordinator(window=4)
    k, v = rand_kv(10, 0)
    c.publish(0, 0, k, v)
    c.consume(0, 1, 0, k, v)
    s = c.store(0)
    assert (s.n_merged, s.n_pending(0), s.n_pending(1)) == (6, 4, 4)
    for i in range(4):  # pending 5..8: the block merges when 2 * window are pending
        kk, vv = rand_kv(1, 10 + i)
        c.publish(0, 10 + i, kk, vv)
        c.consume(0, 1, 10 + i, kk, vv)
    assert (s.n_merged, s.n_pending(1)) == (10, 4)
    assert c.reconstruct(0, 0, mx.float32)[0].shape == (B, H, 14, D)


# ---------------------------------------------------------------- roles and config
def infos(n_layers: int) -> list[LayerInfo]:
    return [LayerInfo(layer_idx=i, n_layers=n_layers, n_kv_heads=2, head_dim=32)
            for i in range(n_layers)]


def test_assign_roles_pairs_the_middle_to_deep_layers():
    layers = infos(7)
    MiniCacheCache.profile.assign_roles(layers, KVCacheConfig(method="minicache"), None)
    roles = [(i.group_size, i.member_idx) for i in layers]
    assert roles == [(1, 0)] * 3 + [(2, 0), (2, 1), (2, 0), (2, 1)]
    assert layers[3].group_id == layers[4].group_id != layers[5].group_id
    coords = {id(i.coordinator) for i in layers[3:]}
    assert len(coords) == 1 and layers[0].coordinator is None


def test_assign_roles_custom_range_and_odd_tail():
    layers = infos(8)
    cfg = KVCacheConfig(method="minicache", start_layer=1, end_layer=5)
    MiniCacheCache.profile.assign_roles(layers, cfg, None)
    assert [i.group_size for i in layers] == [1, 2, 2, 2, 2, 1, 1, 1]


@pytest.mark.parametrize("kwargs,field", [
    (dict(start_layer=9), "start_layer"),
    (dict(end_layer=8), "end_layer"),
    (dict(start_layer=7), "end_layer"),
])
def test_merge_range_outside_the_model_is_an_error(kwargs, field):
    cfg = KVCacheConfig(method="minicache", **kwargs)
    with pytest.raises(ConfigError, match=f"minicache.{field}=.*8 layers|{field}"):
        MiniCacheCache.profile.assign_roles(infos(8), cfg, None)


@pytest.mark.parametrize("kwargs,field", [
    (dict(t=1.5), "t"),
    (dict(t=-0.1), "t"),
    (dict(t=float("nan")), "t"),
    (dict(bits=7), "bits"),
    (dict(bits=1), "bits"),
    (dict(retention_threshold=1.0), "retention_threshold"),
    (dict(retention_threshold=-0.5), "retention_threshold"),
    (dict(start_layer=-1), "start_layer"),
    (dict(start_layer=4, end_layer=4), "end_layer"),
    (dict(group_size=48), "group_size"),
    (dict(retention="top"), "retention"),
])
def test_bad_options_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"minicache.{field}="):
        KVCacheConfig(method="minicache", **kwargs)


def test_build_with_range_beyond_the_model_fails():
    model = tiny_model("llama")  # 4 layers
    with pytest.raises(ConfigError, match="end_layer=10"):
        KVCacheBuilder.for_model(model, KVCacheConfig(method="minicache",
                                                      end_layer=10))


# ---------------------------------------------------------------- on a model
@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=6)


@pytest.mark.parametrize("bits", [None, 4])
def test_storage_is_real_and_counted_once(model, bits):
    cfg = KVCacheConfig(method="minicache", bits=bits, window=4)
    caches = KVCacheBuilder.for_model(model, cfg)
    tokens = mx.random.randint(0, 128, (2, 40), key=mx.random.key(3))
    out = prefill_then_decode(model, caches, tokens, 32)
    assert bool(mx.all(mx.isfinite(out)).item())
    for c in caches:
        assert c.offset == 40 and c.batch_size == 2
        assert abs(c.nbytes - c.accounted_bytes()) <= 0.05 * c.accounted_bytes()
    primary, partner = caches[3], caches[4]
    assert (primary.layer.member_idx, partner.layer.member_idx) == (0, 1)
    # The partner holds no shared direction and no token-length [.., D] copy except its window.
    store = primary.layer.coordinator.store(primary.layer.group_id)
    n_win = store.n_pending(1)
    for a in partner.held_arrays():
        assert a.ndim == 3 or a.shape[2] in (n_win, store.n_retained()[0])
    assert partner.nbytes < 0.25 * layer_stats(partner)["fp16_bytes"]
    ids = {id(a) for a in primary.held_arrays()}
    assert not ids & {id(a) for a in partner.held_arrays()}
    stats = cache_stats(caches)
    assert stats["held_bytes"] < stats["fp16_bytes"]


def test_merged_store_keeps_the_primarys_magnitudes(model):
    tokens = mx.random.randint(0, 128, (1, 24), key=mx.random.key(4))
    dense = KVCacheBuilder.for_model(model, KVCacheConfig(method="none"))
    mini = KVCacheBuilder.for_model(model, KVCacheConfig(method="minicache", window=0,
                                                         retention_threshold=0.0))
    model(tokens, cache=dense)
    model(tokens, cache=mini)
    # Layer 3 (the primary) sees the same input as in the dense run (up to the fp16
    # storage of layers 0-2), so its per-token key norms must survive the merge.
    norms = mx.linalg.norm(dense[3].keys[..., :24, :], axis=-1)
    store = mini[3].layer.coordinator.store(mini[3].layer.group_id)
    assert store.n_merged == 24
    tol = 0.02 * norms.max().item()
    assert close(store.keys.magnitude[0], norms, tol)
    rk, _ = mini[3].keys_and_values(mx.float32)
    assert rk.shape == (1, 2, 24, 32)
    assert close(mx.linalg.norm(rk, axis=-1), norms, tol)


def test_batch_rows_are_independent(model):
    tokens = mx.random.randint(0, 128, (2, 30), key=mx.random.key(5))
    cfg = KVCacheConfig(method="minicache", retention_threshold=0.1, window=4)
    both = prefill_then_decode(model, KVCacheBuilder.for_model(model, cfg), tokens, 24)
    for b in range(2):
        one = prefill_then_decode(model, KVCacheBuilder.for_model(model, cfg),
                                  tokens[b:b + 1], 24)
        assert close(both[b], one[0], 1e-3)


@pytest.mark.parametrize("bits", [None, 4])
def test_save_load_round_trip_with_merged_tokens(model, bits, tmp_path):
    from veloxquant_mlx import load_prompt_cache, save_prompt_cache

    cfg = KVCacheConfig(method="minicache", bits=bits, window=4,
                        retention_threshold=0.2)
    caches = KVCacheBuilder.for_model(model, cfg)
    tokens = mx.random.randint(0, 128, (1, 30), key=mx.random.key(6))
    prefill_then_decode(model, caches, tokens, 24)
    store = caches[3].layer.coordinator.store(caches[3].layer.group_id)
    assert store.n_merged > 0 and store.n_retained()[0] > 0
    path = tmp_path / "mc.safetensors"
    save_prompt_cache(path, caches)
    # Each layer saves only its own share: the file is the held bytes, not a dense copy.
    saved = sum(a.nbytes for a in mx.load(str(path)).values())
    assert saved == cache_stats(caches)["held_bytes"]
    loaded = load_prompt_cache(path, model=model)
    new = loaded[3].layer.coordinator
    assert new is not caches[3].layer.coordinator and new is loaded[4].layer.coordinator
    before = store.n_merged
    assert new.counters(loaded[3].layer.group_id) == (before, 30, 30)
    assert [c.nbytes for c in loaded] == [c.nbytes for c in caches]
    for tok in (5, 9, 17, 40, 2, 8):  # crosses a block merge after loading
        a = model(mx.array([[tok]]), cache=caches)
        b = model(mx.array([[tok]]), cache=loaded)
        assert mx.allclose(a, b, atol=1e-5).item()
    assert new.store(loaded[3].layer.group_id).n_merged == store.n_merged > before


def test_loading_quantized_state_without_bits_is_an_error(model, tmp_path):
    from veloxquant_mlx.cache.minicache_coordinator import MiniCacheCoordinator

    c = MiniCacheCoordinator(bits=4, group_size=32, window=0)
    k, v = rand_kv(4, 0)
    c.publish(0, 0, k, v)
    c.consume(0, 1, 0, k, v)
    with pytest.raises(ValueError, match="bits=None"):
        MiniCacheCoordinator().load_share(0, 0, 0, c.share_state(0, 0, 0))


def test_pair_sides_are_the_stored_form(model):
    """Each layer's bytes, state and dense view come from its stored form: a paired
    layer's two sides of the pair store add up to what the store holds for it, and its
    saved state keeps the layout of earlier files (keys share, values share, window)."""
    cfg = KVCacheConfig(method="minicache", window=4)
    caches = KVCacheBuilder.for_model(model, cfg)
    tokens = mx.random.randint(0, 128, (1, 30), key=mx.random.key(4))
    prefill_then_decode(model, caches, tokens, 20)
    primary, partner = caches[3], caches[4]
    coord, pair = primary.layer.coordinator, primary.layer.group_id
    store = coord.store(pair)
    assert store.n_merged > 0 and [s.kind for s in primary.stored.order] == ["merged"] * 2
    for c, m in ((primary, 0), (partner, 1)):
        assert [s.n for s in c.stored.order] == [c.offset] * 2
        share_k, share_v, window = c.state
        assert len(share_k) == len(share_v) == (4 if m == 0 else 2)
        assert window is not None and window[0].shape[2] == store.n_pending(m)
        k, v = c.keys_and_values(mx.float32)
        want = coord.reconstruct(pair, m, mx.float32)
        assert mx.array_equal(k, want[0]).item() and mx.array_equal(v, want[1]).item()
    held = {id(a) for c in (primary, partner) for a in c.held_arrays()}
    assert held == {id(a) for a in coord.pair_arrays(pair)}
    assert [s.kind for s in caches[0].stored.order] == ["dense"] * 2  # outside the pairs


def test_unmodified_mlx_lm_generate(model):
    from mlx_lm.generate import generate_step

    cfg = KVCacheConfig(method="minicache", bits=4, window=2)
    caches = KVCacheBuilder.for_model(model, cfg)
    prompt = mx.array([1, 5, 9, 20, 7, 3, 11, 2])
    toks = [t for t, _ in zip(generate_step(prompt, model, prompt_cache=caches,
                                            max_tokens=6), range(6))]
    assert len(toks) == 6
    # generate_step runs one step ahead of what it yields.
    assert {c.offset for c in caches} <= {len(prompt) + 5, len(prompt) + 6}
    assert len({c.offset for c in caches}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 16])
def test_real_model_answers_paris(window):
    from mlx_lm import generate

    from veloxquant_mlx.models import load

    model, tokenizer = load()
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="minicache", window=window))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=24, prompt_cache=caches)
    assert "paris" in text.lower()
    paired = [c for c in caches if c.paired]
    assert len(paired) == 2 * (15 // 2)  # layers 15..28 in pairs, 29 alone
    if window == 16:  # the 37-token prompt is long enough that tokens were merged
        store = paired[0].layer.coordinator.store(paired[0].layer.group_id)
        assert store.n_merged > 0
        stats = cache_stats(caches)
        assert stats["held_bytes"] < stats["fp16_bytes"]


# ---------------------------------------------------------------- trimming
def _continue(model, caches, toks: mx.array) -> mx.array:
    return mx.concatenate([model(toks[:, i:i + 1], cache=caches)
                           for i in range(toks.shape[1])], axis=1)


def test_trim_within_the_window_continues_as_a_fresh_cache(model):
    cfg = KVCacheConfig(method="minicache", window=16)
    tokens = mx.random.randint(0, 128, (1, 44), key=mx.random.key(8))
    caches = KVCacheBuilder.for_model(model, cfg)
    prefill_then_decode(model, caches, tokens[:, :40], 24)  # merged: 16 tokens; window: 24
    store = caches[3].layer.coordinator.store(caches[3].layer.group_id)
    assert store.n_merged == 16 and store.n_pending(0) == 24
    assert all(c.is_trimmable() and c.trim(6) == 6 and c.offset == 34 for c in caches)
    assert store.n_pending(0) == store.n_pending(1) == 18 and store.published_end == 34
    fresh = KVCacheBuilder.for_model(model, cfg)
    prefill_then_decode(model, fresh, tokens[:, :34], 24)
    a, b = _continue(model, caches, tokens[:, 40:]), _continue(model, fresh, tokens[:, 40:])
    assert close(a, b, 1e-4)


@pytest.mark.parametrize("bits", [None, 4])
def test_trim_into_merged_tokens_keeps_the_rest_exactly(model, bits):
    # window 4 (blocks of 4 merged), no retained tokens: any cut is exact.
    cfg = KVCacheConfig(method="minicache", window=4, bits=bits, retention_threshold=0.0)
    tokens = mx.random.randint(0, 128, (2, 40), key=mx.random.key(9))
    caches = KVCacheBuilder.for_model(model, cfg)
    prefill_then_decode(model, caches, tokens[:, :36], 24)
    before = [c.keys_and_values(mx.float32) for c in caches]
    held = cache_stats(caches)["held_bytes"]
    assert all(c.trim(15) == 15 for c in caches)  # 36 -> 21: into the merged store
    store = caches[3].layer.coordinator.store(caches[3].layer.group_id)
    assert store.n_merged == 21 and store.n_pending(0) == store.n_pending(1) == 0
    for c, (k, v) in zip(caches, before):
        got_k, got_v = c.keys_and_values(mx.float32)
        assert mx.array_equal(got_k, k[:, :, :21]).item()
        assert mx.array_equal(got_v, v[:, :, :21]).item()
    st = cache_stats(caches)
    assert st["held_bytes"] < held
    assert abs(st["held_bytes"] - st["accounted_bytes"]) <= 0.05 * st["accounted_bytes"]
    out = _continue(model, caches, tokens[:, 21:30])  # merging goes on from there
    assert bool(mx.all(mx.isfinite(out)).item()) and caches[3].offset == 30


def test_trim_of_retained_tokens(model):
    """Retained tokens beyond the cut leave with it when every head loses as many;
    a cut that would leave heads with different counts is refused, store unchanged."""
    cfg = KVCacheConfig(method="minicache", window=8, retention_threshold=0.5)
    tokens = mx.random.randint(0, 128, (1, 40), key=mx.random.key(10))
    caches = KVCacheBuilder.for_model(model, cfg)
    # merged: [0, 16) and [16, 24), half retained
    prefill_then_decode(model, caches, tokens[:, :39], 24)
    coord, pair = caches[3].layer.coordinator, caches[3].layer.group_id
    store = coord.store(pair)
    assert store.n_merged == 24 and store.n_retained() == (12, 12)
    ragged = next(cut for cut in range(17, 24) if len({int(x) for x in (
        store.keys.retained_idx >= cut).sum(axis=-1).reshape(-1).tolist()}) > 1)
    before = caches[3].keys_and_values(mx.float32)
    with pytest.raises(NotTrimmableError, match="inside a merged block"):
        caches[3].trim(39 - ragged)
    assert store.n_merged == 24 and mx.array_equal(caches[3].keys_and_values(mx.float32)[0],
                                                    before[0]).item()
    # Back to a block boundary (16): 4 retained of each head go with it.
    assert all(c.trim(39 - 16) == 23 for c in caches)
    assert store.n_merged == 16 and store.n_retained() == (8, 8)
    assert mx.array_equal(caches[3].keys_and_values(mx.float32)[0], before[0][:, :, :16]).item()


def test_tune_grid_spans_the_compression_range(model):
    tokens = mx.random.randint(0, 128, (1, 200), key=mx.random.key(12))
    ratios = []
    for opts in MiniCacheCache.profile.tune_grid(2048):
        caches = KVCacheBuilder.for_model(model, KVCacheConfig("minicache", **opts))
        prefill_then_decode(model, caches, tokens, 199)
        ratios.append(cache_stats(caches)["ratio"])
    # The merge alone keeps about 0.8 of fp16 (plus the float16 windows of 64-127 tokens,
    # a large share of 200); with 2-bit codes on every layer about a third of that.
    assert min(ratios) < 0.3 and max(ratios) > 0.8, ratios


# ---------------------------------------------------------------- attention in ranges
@pytest.mark.parametrize("bits", [None, 4])
def test_a_merged_range_holds_the_whole_rebuild_s_values(bits):
    """A token range of a merged run, rebuilt alone, is that range of the whole rebuild
    bit for bit: retained tokens inside it put back, those outside it nowhere."""
    from veloxquant_mlx.cache.merged import MergedRun

    c = MiniCacheCoordinator(retention=0.25, window=0, bits=bits, group_size=32)
    (k0, v0), (k1, v1) = rand_kv(24, 1), rand_kv(24, 2)
    c.publish(0, 0, k0, v0)
    c.consume(0, 1, 0, k1, v1)
    store = c.store(0)
    assert store.n_retained() == (6, 6)
    for m in (0, 1):
        whole = c.reconstruct(0, m, mx.float32)
        for side, part in enumerate((store.keys, store.values)):
            run = MergedRun(part.direction, part.magnitude[m], part.retained[m],
                            part.retained_idx)
            for a, b in ((0, 24), (0, 5), (5, 17), (17, 24), (23, 24)):
                assert mx.array_equal(run.read(a, b, mx.float32),
                                      whole[side][:, :, a:b]).item(), (m, side, a, b)


@pytest.mark.parametrize("bits", [None, 4])
def test_attention_reads_ranges_not_the_dense_view(model, bits, monkeypatch):
    """On the library's engine (float32, CPU) every layer attends without its dense
    view: a prompt chunk bit for bit as attention over that view, a decode step past
    ``kernels.BLOCK`` tokens (read in blocks) within float32 rounding."""
    from veloxquant_mlx.cache.stored import StoredFormCache
    from veloxquant_mlx.ops.attention import sdpa
    from veloxquant_mlx.ops.kernels import BLOCK, on_gpu

    if on_gpu():
        pytest.skip("on a GPU the dispatcher picks mx.fast over the dense view")
    cfg = KVCacheConfig(method="minicache", bits=bits, window=4, retention_threshold=0.1)
    caches = KVCacheBuilder.for_model(model, cfg)
    n = BLOCK + 100
    tokens = mx.random.randint(0, 128, (1, n), key=mx.random.key(8))
    for s in range(0, n, 512):
        model(tokens[:, s:s + 512], cache=caches)
    assert caches[3].layer.coordinator.store(caches[3].layer.group_id).n_retained()[0]
    chunk = mx.random.normal((1, 4, 64, 32), key=mx.random.key(9))
    step = mx.random.normal((1, 4, 1, 32), key=mx.random.key(10))
    want = [[sdpa(q, *c.keys_and_values(mx.float32), 0.2, mask)
             for q, mask in ((chunk, "causal"), (step, None))] for c in caches]
    mx.eval(want)

    def no_dense_view(*a, **k):
        raise AssertionError("attention built the dense view")

    monkeypatch.setattr(MiniCacheCoordinator, "reconstruct", no_dense_view)
    monkeypatch.setattr(StoredFormCache, "keys_and_values", no_dense_view)
    for c, (want_chunk, want_step) in zip(caches, want):
        assert mx.array_equal(c.attend(chunk, 0.2, "causal"), want_chunk).item()
        assert mx.allclose(c.attend(step, 0.2), want_step, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("bits", [None, 4])
def test_merged_pairs_working_set_does_not_grow(bits):
    """On mlx_lm's own path, a model whose layers are all paired keeps the prompt's
    working set flat from 1024 to 4096 tokens (a dense view of every layer grew it by
    13 MiB here), within the decode blocks' growth and the allocator's noise."""
    from veloxquant_mlx.adapter.retained import measure_user_path
    from veloxquant_mlx.ops.kernels import BLOCK

    model = tiny_model("llama", head_dim=64, num_hidden_layers=2)
    cfg = KVCacheConfig(method="minicache", start_layer=0, window=8, bits=bits)
    tokens = [(i * 37 + 11) % 120 + 1 for i in range(4096)]
    work = [measure_user_path(model, cfg, tokens[:n], 2, 256)["working_bytes"]
            for n in (1024, 4096)]
    decode_growth = 4 * 2 * (BLOCK - 1024) * 2 * 2 * 64  # two layers' decode blocks
    assert work[1] - work[0] <= decode_growth + (1 << 20), [w / 2**20 for w in work]
