import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, cache_stats
from veloxquant_mlx.adapter import mlx_lm as glue
from veloxquant_mlx.cache.affine import AffineCache
from veloxquant_mlx.cache.dense import DenseCache
from veloxquant_mlx.cache.step_cost import layer_stats
from veloxquant_mlx.config import ConfigError
from veloxquant_mlx.testing.tiny import tiny_model


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_one_cache_per_layer_with_shapes_from_the_model(model_type):
    model = tiny_model(model_type)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="affine", bits=8,
                                                           group_size=32))
    assert len(caches) == len(model.layers)
    assert all(isinstance(c, AffineCache) for c in caches)
    infos = [c.layer for c in caches]
    assert [i.layer_idx for i in infos] == list(range(len(model.layers)))
    assert all(i.n_kv_heads == 2 and i.head_dim == 32 for i in infos)


def test_gemma3_sliding_layers_get_a_compressed_ring():
    from veloxquant_mlx.cache.sliding import SlidingCache

    model = tiny_model("gemma3_text")
    own = make_prompt_cache(model)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="affine", bits=8,
                                                           group_size=32))
    for mine, theirs in zip(caches, own):
        if isinstance(theirs, RotatingKVCache):
            assert isinstance(mine, SlidingCache)
        else:
            assert isinstance(theirs, KVCache) and isinstance(mine, AffineCache)
    # A method with no ring of its own leaves sliding layers on mlx_lm's cache.
    caches = KVCacheBuilder.for_model(model, KVCacheConfig("snapkv"))
    assert any(isinstance(c, RotatingKVCache) for c in caches)


def test_options_shortcut_and_group_size_must_divide_head_dim():
    model = tiny_model("llama", head_dim=32)
    caches = KVCacheBuilder.for_model(model, method="none")
    assert all(isinstance(c, DenseCache) for c in caches)
    with pytest.raises(ConfigError, match="group_size=64.*head_dim=32"):
        KVCacheBuilder.for_model(model, KVCacheConfig(method="affine", group_size=64))


def test_model_without_attention_layers_is_an_error():
    import mlx.nn as nn

    class NoAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(4, 4) for _ in range(2)]

    with pytest.raises(ValueError, match="no plain full-attention layers"):
        KVCacheBuilder.for_model(NoAttention(), KVCacheConfig(method="affine"))

    class NoLayers(nn.Module):
        pass

    with pytest.raises(ValueError, match="has no 'layers'"):
        KVCacheBuilder.for_model(NoLayers(), KVCacheConfig())


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text"])
def test_dense_method_matches_mlx_lm_exactly(model_type):
    model = tiny_model(model_type)
    tokens = mx.random.randint(0, 128, (1, 40), key=mx.random.key(1))
    ref = model(tokens, cache=make_prompt_cache(model))
    caches = KVCacheBuilder.for_model(model, KVCacheConfig())
    out = mx.concatenate([model(tokens[:, :25], cache=caches),
                          model(tokens[:, 25:], cache=caches)], axis=1)
    assert mx.allclose(out, ref, atol=1e-4).item()


def test_cache_stats_sums_layers():
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="affine", bits=4,
                                                           group_size=32))
    model(mx.zeros((1, 64), dtype=mx.int32), cache=caches)
    s = cache_stats(caches)
    assert s["held_bytes"] == sum(c.nbytes for c in caches)
    assert s["fp16_bytes"] == 4 * 64 * 2 * 2 * 32 * 2
    assert 0.2 < s["ratio"] < 0.35


def test_routing_is_reversible():
    import mlx_lm.models.llama as llama

    tiny_model("llama")
    glue.install_attention_routing()
    assert llama.scaled_dot_product_attention is glue.routed_scaled_dot_product_attention
    glue.uninstall_attention_routing(everything=True)  # other tests' leases too
    assert llama.scaled_dot_product_attention is glue._ORIGINAL_SDPA
    with glue.attention_routing():
        assert glue.routing_installed("mlx_lm.models.llama")
    assert not glue.routing_installed("mlx_lm.models.llama")
    glue.install_attention_routing()


def test_routing_is_leased_per_model():
    """Detaching one model leaves another model's routing (and its caches) working."""
    import mlx_lm.models.llama as llama

    glue.uninstall_attention_routing(everything=True)
    a, b = tiny_model("llama"), tiny_model("llama", seed=1)
    caches_a = KVCacheBuilder.for_model(a, KVCacheConfig("affine", bits=8, group_size=32))
    caches_b = KVCacheBuilder.for_model(b, KVCacheConfig("affine", bits=8, group_size=32))
    KVCacheBuilder.detach(b)
    assert llama.scaled_dot_product_attention is glue.routed_scaled_dot_product_attention
    a(mx.array([[1, 2, 3]]), cache=caches_a)  # still routed: no error
    with pytest.raises(RuntimeError, match="detached"):
        b(mx.array([[1, 2, 3]]), cache=caches_b)  # loud, not silently wrong
    KVCacheBuilder.detach(a)
    assert llama.scaled_dot_product_attention is glue._ORIGINAL_SDPA
    glue.install_attention_routing()  # the process lease the module-level tests took


def test_cache_stats_counts_foreign_float32_layers_at_float16():
    from veloxquant_mlx.cache.snapkv import SnapKVCache

    model = tiny_model("gemma3_text")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig("snapkv", capacity=16, window=4))
    model(mx.zeros((1, 40), dtype=mx.int32), cache=caches)
    sliding = [c for c in caches if isinstance(c, RotatingKVCache)]
    assert sliding and sliding[0].keys.dtype == mx.float32
    s = cache_stats(caches)
    ours = sum(layer_stats(c)["fp16_bytes"] for c in caches if isinstance(c, SnapKVCache))
    # The ring's window (16 tokens) in float16, not the 40 the prefill left it holding.
    assert sliding[0].keys.shape[2] == 40 and sliding[0].max_size == 16
    assert s["fp16_bytes"] == ours + sum(c.nbytes // 2 * 16 // 40 for c in sliding)


@pytest.mark.parametrize("method", ["none", "streaming:sink=2,window=6", "snapkv:capacity=16,window=4",
                                    "kivi:bits=4,window=32,group_size=32"])
def test_the_fp16_basis_is_the_models_own_cache_whatever_the_method(method):
    """What a method's ratio divides by is the same for every method: the model's own
    caches in float16, so a sliding layer counts its window, never the tokens it dropped."""
    model = tiny_model("gemma3_text")
    x = mx.zeros((1, 40), dtype=mx.int32)
    own = make_prompt_cache(model)
    model(x, cache=own)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig.from_string(method))
    model(x, cache=caches)
    windows = [getattr(c, "max_size", 40) for c in own]
    assert min(windows) < 40  # the sliding layers did drop tokens
    want = sum(min(w, 40) * c.keys.shape[1] * (c.keys.shape[3] + c.values.shape[3]) * 2
               for w, c in zip(windows, own))
    assert cache_stats(caches)["fp16_bytes"] == cache_stats(own)["fp16_bytes"] == want
