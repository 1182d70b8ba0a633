import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.adapter.mlx_lm import install_attention_routing
from veloxquant_mlx.cache import LayerInfo
from veloxquant_mlx.cache.base import restore_saved
from veloxquant_mlx.cache.snapkv import SnapKVCache, pool_scores, select_tokens
from veloxquant_mlx.cache.step_cost import layer_stats
from veloxquant_mlx.config import ConfigError
from veloxquant_mlx.testing.tiny import tiny_model

install_attention_routing()


def _qkv(n, batch=1, heads=2, dim=16, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((batch, 2 * heads, n, dim), key=k3)
    k = mx.random.normal((batch, heads, n, dim), key=k1)
    return q, k, mx.random.normal((batch, heads, n, dim), key=k2)


def _cache(**opts):
    opts.setdefault("window_dtype", "float32")
    return SnapKVCache(KVCacheConfig(method="snapkv", **opts),
                       LayerInfo(n_kv_heads=2, head_dim=16))


def _keys(c):
    """The held keys in token order (the stored form's dense view)."""
    return c.stored.keys_and_values(mx.float32)[0]


def _prefill_then_decode(c, q, k, v, chunks, n_decode=1):
    """Multi-token prefill chunks, then single-token steps (as mlx_lm feeds them)."""
    i, outs = 0, []
    for n in chunks + [1] * n_decode:
        c.update_and_fetch(k[:, :, i:i + n], v[:, :, i:i + n])
        outs.append(c.attend(q[:, :, i:i + n], scale=0.25, mask="causal" if n > 1 else None))
        i += n
    return mx.concatenate(outs, axis=2)


def _numpy_selection(q, k, window, capacity, kernel, pooling, scale=0.25):
    """Brute-force reference: scores of the last `window` queries, GQA mean, pooling."""
    q, k = np.array(q, np.float64), np.array(k, np.float64)
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    rep = Hq // Hkv
    keep = np.zeros((B, Hkv, capacity), np.int64)
    prefix = n - window
    for b in range(B):
        for h in range(Hkv):
            votes = np.zeros(prefix)
            for r in range(rep):
                for i in range(n - window, n):
                    s = q[b, h * rep + r, i] @ k[b, h, :i + 1].T * scale
                    p = np.exp(s - s.max())
                    votes += (p / p.sum())[:prefix] / rep
            pad = kernel // 2
            fill = -np.inf if pooling == "max" else 0.0
            padded = np.concatenate([np.full(pad, fill), votes, np.full(pad, fill)])
            win = np.stack([padded[j:j + prefix] for j in range(kernel)])
            pooled = win.max(0) if pooling == "max" else win.sum(0) / kernel
            keep[b, h] = np.sort(np.argsort(-pooled, kind="stable")[:capacity])
    return keep


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_pooling_matches_numpy(pooling):
    x = mx.random.uniform(shape=(2, 3, 20), key=mx.random.key(2))
    out = np.array(pool_scores(x, 5, pooling))
    xn = np.pad(np.array(x), [(0, 0), (0, 0), (2, 2)],
                constant_values=-np.inf if pooling == "max" else 0.0)
    win = np.stack([xn[..., j:j + 20] for j in range(5)])
    ref = win.max(0) if pooling == "max" else win.sum(0) / 5
    assert np.abs(out - ref).max() < 1e-6


@pytest.mark.parametrize("pooling,kernel", [("max", 7), ("avg", 3), ("max", 1)])
def test_kept_tokens_are_the_top_scoring_ones(pooling, kernel):
    q, k, v = _qkv(81, batch=2)
    c = _cache(window=8, capacity=20, kernel=kernel, pooling=pooling)
    _prefill_then_decode(c, q, k, v, [50, 30], n_decode=1)
    ref = _numpy_selection(q, k, window=8, capacity=20, kernel=kernel, pooling=pooling)
    kept = _keys(c)[:, :, :20]
    expect = np.take_along_axis(np.array(k[:, :, :73]), ref[..., None], axis=2)
    assert np.abs(np.array(kept) - expect).max() < 1e-6
    # The observation window (the last 8 prompt tokens incl. the current) is kept whole.
    assert mx.array_equal(_keys(c)[:, :, 20:], k[:, :, 73:]).item()


def test_eviction_is_real_and_decode_tokens_are_appended():
    q, k, v = _qkv(140)
    c = _cache(window=8, capacity=32, window_dtype="float16")
    _prefill_then_decode(c, q, k, v, [64, 63], n_decode=0)
    before = c.nbytes
    assert c.obs.x.shape == (1, 4, 8, 16)  # only the window of queries is kept
    _prefill_then_decode_from(c, q, k, v, start=127, n=13)
    s = layer_stats(c)
    assert c.compressed and c.obs.x is None
    assert _keys(c).shape[2] == 32 + 8 + 12 and s["tokens"] == 140
    assert s["held_bytes"] == s["accounted_bytes"] < before
    # Decode steps write into a buffer with a reserve of at most 1/32 of the tokens.
    slots = c.held[0].buf.slots
    assert 52 <= slots <= 52 + 52 // 32 + 1
    assert s["held_bytes"] == 1 * 2 * slots * 32 * 2
    assert c.evicted == 127 + 1 - 8 - 32


def _prefill_then_decode_from(c, q, k, v, start, n):
    for i in range(start, start + n):
        c.update_and_fetch(k[:, :, i:i + 1], v[:, :, i:i + 1])
        c.attend(q[:, :, i:i + 1], scale=0.25)


def test_short_prompt_is_not_compressed_and_equals_dense():
    q, k, v = _qkv(40)
    c = _cache(window=8, capacity=64)
    out = _prefill_then_decode(c, q, k, v, [20, 15], n_decode=5)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert _keys(c).shape[2] == 40 and c.evicted == 0
    assert mx.abs(out - ref).max().item() < 1e-5


def test_short_last_chunk_borrows_window_queries_from_the_previous_one():
    q, k, v = _qkv(71)
    c = _cache(window=8, capacity=16, kernel=1)
    _prefill_then_decode(c, q, k, v, [66, 4], n_decode=1)
    ref = _numpy_selection(q, k, window=8, capacity=16, kernel=1, pooling="max")
    expect = np.take_along_axis(np.array(k[:, :, :63]), ref[..., None], axis=2)
    assert np.abs(np.array(_keys(c)[:, :, :16]) - expect).max() < 1e-6


def test_select_tokens_gqa_groups_vote_together():
    # KV head 0 serves query heads 0, 1; head 1 serves 2, 3. Put all the weight of
    # head 0's group on token 3 and of head 1's group on token 5.
    w = mx.zeros((1, 4, 2, 10))
    w[:, 0:2, :, 3] = 1.0
    w[:, 2:4, :, 5] = 1.0
    idx = select_tokens(w, n_kv_heads=2, capacity=1, kernel=1, pooling="max")
    assert idx.tolist() == [[[3], [5]]]


def test_tiny_model_under_generate_step_batch_and_compression():
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 128, (60,), key=mx.random.key(4))
    caches = KVCacheBuilder.for_model(
        model, KVCacheConfig(method="snapkv", window=4, capacity=16))
    toks = [t for t, _ in zip(generate_step(prompt, model, prompt_cache=caches,
                                            prefill_step_size=32), range(5))]
    assert len(toks) == 5
    for c in caches:  # 16 selected + 4 window + what was decoded after the prompt
        assert isinstance(c, SnapKVCache) and c.offset >= 64
        assert _keys(c).shape[2] == 16 + 4 + c.offset - 60
    # Batch of two: with room for the whole prompt it is dense attention.
    tokens = mx.random.randint(0, 128, (2, 30), key=mx.random.key(5))
    dense = model(tokens, cache=KVCacheBuilder.for_model(model, method="none"))
    big = KVCacheBuilder.for_model(model, KVCacheConfig(method="snapkv", window=4,
                                                        capacity=64,
                                                        window_dtype="float32"))
    out = mx.concatenate([model(tokens[:, :29], cache=big),
                          model(tokens[:, 29:], cache=big)], axis=1)
    assert mx.abs(out - dense).max().item() < 1e-4


def test_trimming_into_the_keep_set_is_refused_and_state_round_trip():
    q, k, v = _qkv(60)
    c = _cache(window=4, capacity=20)
    _prefill_then_decode(c, q, k, v, [59], n_decode=1)
    # Only the observation window (4 tokens) follows the per-head keep-set.
    with pytest.raises(NotImplementedError, match="only its last 4 tokens"):
        c.trim(5)
    d = restore_saved(SnapKVCache, c.config, c.layer, c.state, c.meta_state)
    assert d.compressed and d.capacity == 20 and d.offset == 60
    assert mx.array_equal(_keys(d), _keys(c)).item()
    with pytest.raises(NotImplementedError, match="only its last 4 tokens"):
        d.trim(5)


@pytest.mark.parametrize("opts,match", [
    (dict(window=64, capacity=32), r"window=64.*capacity=32"),
    (dict(kernel=4), r"kernel=4.*odd"),
    (dict(kernel=0), r"kernel=0.*>= 1"),
    (dict(pooling="mean"), r"pooling='mean'.*\['max', 'avg'\]"),
    (dict(capacity=0), r"capacity=0.*>= 1"),
    (dict(window=0), r"window=0.*>= 1"),
])
def test_bad_options_name_field_value_and_allowed(opts, match):
    with pytest.raises(ConfigError, match=match):
        KVCacheConfig(method="snapkv", **opts)


@pytest.mark.slow
def test_generate_on_embedded_model():
    import mlx_lm

    from veloxquant_mlx import models

    model, tokenizer = models.load()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    caches = KVCacheBuilder.for_model(
        model, KVCacheConfig(method="snapkv", window=4, capacity=16))
    out = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=20,
                          prompt_cache=caches)
    assert "Paris" in out
    assert all(c.evicted == len(prompt) - 4 - 16 for c in caches)
