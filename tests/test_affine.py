import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.adapter.mlx_lm import install_attention_routing
from veloxquant_mlx.cache import LayerInfo
from veloxquant_mlx.cache.affine import AffineCache
from veloxquant_mlx.cache.base import restore_saved
from veloxquant_mlx.cache.step_cost import layer_stats
from veloxquant_mlx.ops import quantize as qz
from veloxquant_mlx.testing.tiny import tiny_model

install_attention_routing()


def _kv(n, heads=3, dim=64, seed=0):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((1, heads, n, dim), key=k1), mx.random.normal((1, heads, n, dim),
                                                                         key=k2)


def _cache(**opts):
    return AffineCache(KVCacheConfig(method="affine", **opts), LayerInfo(n_kv_heads=3,
                                                                         head_dim=64))


@pytest.mark.parametrize("bits,tol", [(8, 0.03), (4, 0.4), (2, 2.0)])
def test_round_trip_error_shrinks_with_bits(bits, tol):
    k, v = _kv(100)
    c = _cache(bits=bits, group_size=32)
    c.update_and_fetch(k, v)
    dk, dv = c.keys_and_values()
    assert dk.shape == k.shape
    assert mx.abs(dk - k).max().item() < tol
    assert mx.abs(dv - v).max().item() < tol


def test_window_keeps_recent_tokens_exact_and_quantizes_the_rest():
    k, v = _kv(50)
    c = _cache(bits=4, group_size=64, window=16, window_dtype="float32")
    for i in range(0, 50, 7):  # chunked like prefill + decode
        c.update_and_fetch(k[:, :, i:i + 7], v[:, :, i:i + 7])
    assert c.offset == 50
    assert c.win[0].n == 16 and c.codes[0].n == 34
    dk, _ = c.keys_and_values()
    assert mx.array_equal(dk[:, :, -16:], k[:, :, -16:]).item()
    assert not mx.array_equal(dk[:, :, :34], k[:, :, :34]).item()


def test_held_bytes_match_accounting_and_4bit_ratio_at_1024_tokens():
    k, v = _kv(1024)
    c = _cache(bits=4, group_size=64)
    for i in range(0, 1024, 256):
        c.update_and_fetch(k[:, :, i:i + 256], v[:, :, i:i + 256])
    s = layer_stats(c)
    assert s["held_bytes"] == s["accounted_bytes"]
    assert s["fp16_bytes"] == 1024 * 3 * 128 * 2
    assert s["ratio"] <= 0.30


@pytest.mark.parametrize("group_size", [32, 64])  # dequantized / scales folded in
def test_attention_matches_dense_at_8_bits(group_size):
    k, v = _kv(40)
    q = mx.random.normal((1, 9, 40, 64), key=mx.random.key(5))
    c = _cache(bits=8, group_size=group_size)
    c.update_and_fetch(k, v)
    out = c.attend(q, scale=0.125, mask="causal")
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert mx.abs(out - ref).max().item() < 0.02


def test_state_round_trip():
    k, v = _kv(70)
    c = _cache(bits=4, group_size=32, window=8)
    c.update_and_fetch(k, v)
    d = restore_saved(AffineCache, c.config, c.layer, c.state, c.meta_state)
    a, b = c.keys_and_values(), d.keys_and_values()
    assert d.offset == 70 and mx.array_equal(a[0], b[0]).item()
    with pytest.raises(TypeError, match="restore_saved"):
        AffineCache.from_state(c.state)  # mlx_lm's way has no config to build from


def test_wrong_shapes_are_rejected():
    c = _cache()
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        c.update_and_fetch(mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 4, 64)))
    with pytest.raises(ValueError, match=r"\[B, n_kv_heads, L, head_dim\]"):
        c.update_and_fetch(mx.zeros((3, 4, 64)), mx.zeros((3, 4, 64)))
    c = AffineCache(KVCacheConfig(method="affine", max_ctx=8), LayerInfo(n_kv_heads=3,
                                                                         head_dim=64))
    with pytest.raises(ValueError, match="max_ctx=8"):
        c.update_and_fetch(*_kv(9))


def test_generate_step_runs_unmodified_and_tracks_dense_at_8_bits():
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 128, (30,), key=mx.random.key(3))
    dense = [t for t, _ in zip(generate_step(prompt, model, prompt_cache=make_prompt_cache(model)),
                               range(6))]
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="affine", bits=8,
                                                           group_size=32))
    quant = [t for t, _ in zip(generate_step(prompt, model, prompt_cache=caches), range(6))]
    assert [int(t) for t, _ in quant] == [int(t) for t, _ in dense]
    assert caches[0].offset >= 30 + 5


def test_non_finite_prompt_chunk_is_rejected():
    c = _cache()
    k, v = _kv(8)
    bad = mx.where(mx.arange(8)[None, None, :, None] == 3, mx.nan, k)
    with pytest.raises(ValueError, match="NaN or Inf"):
        c.update_and_fetch(bad, v)
    with pytest.raises(ValueError, match="NaN or Inf"):
        c.update_and_fetch(k, v * mx.inf)
    assert c.offset == 0


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_code_values_rebuild_the_dequantized_array(bits):
    k, _ = _kv(20)
    part = qz.quantize(k, bits, 64)
    codes = qz.code_values(part)
    assert codes.min().item() >= 0 and codes.max().item() <= 2 ** bits - 1
    rebuilt = codes * part.scales.astype(mx.float32) + part.biases.astype(mx.float32)
    assert mx.allclose(rebuilt, qz.dequantize(part), atol=1e-5).item()
    with pytest.raises(ValueError, match="bits dividing 32"):
        qz.code_values(qz.quantize(k, 3, 64))


@pytest.mark.parametrize("bits,group_size,window", [(4, 64, 0), (4, 32, 5), (8, 64, 3)])
def test_decode_steps_write_in_place_and_match_one_shot(bits, group_size, window):
    k, v = _kv(300)
    qs = mx.random.normal((1, 9, 300, 64), key=mx.random.key(7))
    one = _cache(bits=bits, group_size=group_size, window=window, window_dtype="float32")
    one.update_and_fetch(k, v)
    c = _cache(bits=bits, group_size=group_size, window=window, window_dtype="float32")
    c.update_and_fetch(k[:, :, :200], v[:, :, :200])
    slots = c.codes[0].buf.slots
    for i in range(200, 300):
        c.update_and_fetch(k[:, :, i:i + 1], v[:, :, i:i + 1])
        out = c.attend(qs[:, :, i:i + 1], scale=0.125)
    # The buffer grew only a few times (not per step) and keeps a small reserve.
    buf = c.codes[0].buf
    assert buf.slots > slots and buf.slots - buf.n <= buf.n // 32 + 1
    s = layer_stats(c)
    assert s["held_bytes"] == s["accounted_bytes"]
    assert mx.array_equal(c.codes[0].codes().codes, one.codes[0].codes().codes).item()
    ref = one.attend(qs[:, :, 299:300], scale=0.125)
    assert mx.abs(out - ref).max().item() < 1e-5
    # Trimming into the codes releases the reserve.
    c.trim(c.offset - 100)
    assert c.codes[0].buf.slots == c.codes[0].n == 100


@pytest.mark.slow
def test_generate_on_embedded_model():
    import mlx_lm

    from veloxquant_mlx import cache_stats, models

    model, tokenizer = models.load()
    # Dense leads its first token by 0.53 logits on this question; on "What is the
    # capital of France?" by 0.10 ("The" over "L"), where which BLAS kernel the CPU gets
    # already decides the answer of an 8-bit cache.
    messages = [{"role": "user",
                 "content": "What is the capital city of France? Answer in English."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="affine", bits=8))
    out = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=20,
                          prompt_cache=caches)
    assert "Paris" in out
    s = cache_stats(caches)
    assert s["held_bytes"] == s["accounted_bytes"] and s["ratio"] < 0.6
