import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, cache_stats
from veloxquant_mlx.adapter.mlx_lm import install_attention_routing
from veloxquant_mlx.cache import LayerInfo
from veloxquant_mlx.cache.base import restore_saved
from veloxquant_mlx.cache.step_cost import layer_stats
from veloxquant_mlx.cache.streaming import StreamingCache
from veloxquant_mlx.config import ConfigError
from veloxquant_mlx.testing.tiny import tiny_model

install_attention_routing()


def _kv(n, batch=1, heads=2, dim=16, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    shape = (batch, heads, n, dim)
    q = mx.random.normal((batch, 2 * heads, n, dim), key=k3)
    return q, mx.random.normal(shape, key=k1), mx.random.normal(shape, key=k2)


def _cache(**opts):
    opts.setdefault("window_dtype", "float32")
    return StreamingCache(KVCacheConfig(method="streaming", **opts),
                          LayerInfo(n_kv_heads=2, head_dim=16))


def _keys(c):
    """The held keys in time order (the stored form's dense view)."""
    return c.stored.keys_and_values(mx.float32)[0]


def _reference(q, k, v, sink, window, scale=0.25):
    """Dense attention where query t sees positions < sink and (t - window, t]."""
    n = k.shape[2]
    t = mx.arange(n)[:, None]
    p = mx.arange(n)[None]
    mask = (p <= t) & ((p < sink) | (p > t - window))
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _run(cache, q, k, v, chunks):
    outs, i = [], 0
    for n in chunks:
        cache.update_and_fetch(k[:, :, i:i + n], v[:, :, i:i + n])
        outs.append(cache.attend(q[:, :, i:i + n], scale=0.25, mask="causal"))
        i += n
    return mx.concatenate(outs, axis=2)


@pytest.mark.parametrize("chunks", [[60], [25, 25, 10], [20] + [1] * 40, [1] * 60,
                                    [10] + [1] * 23 + [20, 1, 6]])
def test_attention_matches_sinks_plus_band_reference_for_any_chunking(chunks):
    q, k, v = _kv(60)
    out = _run(_cache(sink=3, window=12), q, k, v, chunks)
    ref = _reference(q, k, v, sink=3, window=12)
    assert mx.abs(out - ref).max().item() < 1e-5


def test_without_eviction_it_is_dense_causal_attention():
    q, k, v = _kv(30)
    out = _run(_cache(sink=4, window=40), q, k, v, [17, 13])
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert mx.abs(out - ref).max().item() < 1e-5


def test_zero_sinks_is_a_plain_sliding_window():
    q, k, v = _kv(40)
    out = _run(_cache(sink=0, window=8), q, k, v, [16, 16] + [1] * 8)
    ref = _reference(q, k, v, sink=0, window=8)
    assert mx.abs(out - ref).max().item() < 1e-5


def test_held_bytes_stop_growing_and_match_accounting():
    q, k, v = _kv(200, batch=2)
    c = _cache(sink=4, window=28, window_dtype="float16")
    sizes = []
    for i in range(200):
        c.update_and_fetch(k[:, :, i:i + 1], v[:, :, i:i + 1])
        c.attend(q[:, :, i:i + 1], scale=0.25)
        sizes.append(c.nbytes)
    full = 2 * 2 * 32 * (16 + 16) * 2  # B * H * (sink + window) * (D + Dv) * fp16
    assert sizes[31] == full and sizes[-1] == full and sizes[100] == full
    assert sizes[10] < full
    s = layer_stats(c)
    assert s["tokens"] == 200 and s["held_bytes"] == s["accounted_bytes"]
    assert s["ratio"] == pytest.approx(32 / 200)
    # The sinks are the first tokens, the rest the most recent ones.
    held_k = c.state[0]  # in time order (the window part is a ring buffer)
    assert mx.array_equal(held_k[:, :, :4], k[:, :, :4].astype(mx.float16)).item()
    assert mx.array_equal(held_k[:, :, 4:], k[:, :, -28:].astype(mx.float16)).item()


def test_batch_of_two_gives_each_row_its_own_result():
    q, k, v = _kv(50, batch=2, seed=3)
    both = _run(_cache(sink=2, window=10), q, k, v, [30, 1, 19])
    for b in range(2):
        one = _run(_cache(sink=2, window=10), q[b:b + 1], k[b:b + 1],
                   v[b:b + 1], [50])
        assert mx.abs(both[b:b + 1] - one).max().item() < 1e-5


def test_tiny_model_matches_dense_until_the_window_fills():
    model = tiny_model("llama")
    tokens = mx.random.randint(0, 128, (2, 40), key=mx.random.key(1))
    dense = KVCacheBuilder.for_model(model, KVCacheConfig(method="none"))
    ref = model(tokens, cache=dense)
    caches = KVCacheBuilder.for_model(
        model, KVCacheConfig(method="streaming", window=64, window_dtype="float32"))
    out = model(tokens[:, :24], cache=caches)
    out = mx.concatenate([out, model(tokens[:, 24:], cache=caches)], axis=1)
    assert all(isinstance(c, StreamingCache) for c in caches)
    assert mx.abs(out - ref).max().item() < 1e-4
    # Past the window the output differs (tokens were evicted) but stays finite.
    small = KVCacheBuilder.for_model(model, KVCacheConfig(method="streaming", window=8,
                                                          sink=2))
    out = model(tokens, cache=small)
    assert mx.isfinite(out).all().item() and mx.abs(out - ref).max().item() > 1e-3
    assert cache_stats(small)["held_bytes"] == 4 * 2 * 2 * 10 * 64 * 2


def test_trimmable_only_until_a_token_is_evicted():
    q, k, v = _kv(60)
    c = _cache(sink=2, window=10)
    _run(c, q, k, v, [12])  # sink + window: nothing evicted yet
    assert c.is_trimmable() and c.trim(3) == 3 and c.offset == 9
    assert _keys(c).shape[2] == 9
    _run(c, q, k, v, [4])  # 13 tokens: one evicted
    assert not c.is_trimmable()
    with pytest.raises(NotImplementedError, match="not trimmable: it evicted the tokens between its"):
        c.trim(1)
    assert c.offset == 13 and _keys(c).shape[2] == 12


def test_state_round_trip():
    q, k, v = _kv(60)
    c = _cache(sink=2, window=10)
    _run(c, q, k, v, [50])
    d = restore_saved(StreamingCache, c.config, c.layer, c.state, c.meta_state)
    assert d.offset == 50 and d.sink == 2 and d.window == 10
    assert mx.array_equal(_keys(d), _keys(c)).item()
    # After ring steps the saved state is in time order and the loaded cache continues
    # exactly like the original one.
    for i in range(50, 57):
        c.update_and_fetch(k[:, :, i:i + 1], v[:, :, i:i + 1])
        c.attend(q[:, :, i:i + 1], scale=0.25)
    d = restore_saved(StreamingCache, c.config, c.layer, c.state, c.meta_state)
    assert c.ring[0].start == 7 and d.ring[0].start == 0
    assert mx.array_equal(_keys(d)[:, :, 2:], k[:, :, 47:57]).item()
    c.update_and_fetch(k[:, :, 57:60], v[:, :, 57:60])
    d.update_and_fetch(k[:, :, 57:60], v[:, :, 57:60])
    a = c.attend(q[:, :, 57:60], scale=0.25)
    b = d.attend(q[:, :, 57:60], scale=0.25)
    assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("opts,match", [
    (dict(sink=-1), r"sink=-1.*>= 0"),
    (dict(sink=2.5), r"sink=2.5.*integer"),
    (dict(window=0), r"window=0.*>= 1"),
])
def test_bad_options_name_field_value_and_allowed(opts, match):
    with pytest.raises(ConfigError, match=match):
        KVCacheConfig(method="streaming", **opts)


def test_default_holds_1024_tokens():
    c = StreamingCache(KVCacheConfig(method="streaming"), LayerInfo())
    assert c.sink + c.window == 1024


@pytest.mark.slow
def test_generate_on_embedded_model():
    import mlx_lm

    from veloxquant_mlx import models

    model, tokenizer = models.load()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="streaming", window=24))
    out = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=20,
                          prompt_cache=caches)
    assert "Paris" in out
    assert all(_keys(c).shape[2] == 28 for c in caches)  # 4 sinks + 24 recent


def test_a_layer_that_attends_by_itself_reads_every_held_token():
    # Such a layer never calls ``attend``: a chunk's band must not outlive the chunk.
    q, k, v = _kv(24)
    c = _cache(sink=2, window=30)
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])
    assert c.keys_and_values()[0].shape[2] == 20 and c.make_mask(4) is not None
    for i in range(20, 24):
        c.update_and_fetch(k[:, :, i:i + 1], v[:, :, i:i + 1])
        keys, values = c.keys_and_values()
        assert mx.array_equal(keys, k[:, :, :i + 1]).item()
        assert mx.array_equal(values, v[:, :, :i + 1]).item()
