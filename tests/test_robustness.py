"""Property-based robustness: shapes, dtypes, batch and chunk sizes, bad input, long runs."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import small_config
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, cache_stats
from veloxquant_mlx.cache.affine import AffineCache
from veloxquant_mlx.cache.base import LayerInfo
from veloxquant_mlx.cache.dense import DenseCache
from veloxquant_mlx.cache.step_cost import layer_stats
from veloxquant_mlx.config import ConfigError
from veloxquant_mlx.ops.attention import sdpa
from veloxquant_mlx.testing.tiny import tiny_model

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# Attention error allowed at lossless settings (8-bit codes), by compute dtype.
# 8-bit codes of N(0, 1) data have a step of about 6/255 ~ 0.024 per group, so single
# outputs can be off by one half step plus score noise.
TOL = {"float32": 3e-2, "float16": 4e-2, "bfloat16": 8e-2}



@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 3), H=st.integers(1, 3), D=st.sampled_from([32, 64]),
       dtype=st.sampled_from(sorted(DTYPES)), chunks=st.lists(st.integers(1, 40), min_size=1,
                                                               max_size=4),
       window=st.integers(0, 12), n_rep=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_affine_matches_dense(B, H, D, dtype, chunks, window, n_rep, seed) -> None:
    mx.random.seed(seed)  # the data must come from hypothesis too, or shrinking is flaky
    dt = DTYPES[dtype]
    layer = LayerInfo(n_kv_heads=H, head_dim=D)
    cfg = KVCacheConfig(method="affine", bits=8, group_size=32, window=window,
                        window_dtype=None)
    cache, ref = AffineCache(cfg, layer), DenseCache(KVCacheConfig(), layer)
    for L in chunks:
        k = mx.random.normal((B, H, L, D)).astype(dt)
        v = mx.random.normal((B, H, L, D)).astype(dt)
        cache.update_and_fetch(k, v)
        rk, rv = ref.update_and_fetch(k, v)
        q = mx.random.normal((B, H * n_rep, L, D)).astype(dt)
        mask = "causal" if L > 1 else None
        out = cache.attend(q, scale=D ** -0.5, mask=mask)
        want = sdpa(q, rk, rv, D ** -0.5, mask)
        assert out.shape == want.shape and out.dtype == dt
        err = mx.abs(out.astype(mx.float32) - want.astype(mx.float32)).max().item()
        assert err < TOL[dtype], (err, dtype)
    assert cache.offset == sum(chunks)
    held, acc = cache.nbytes, cache.accounted_bytes()
    assert abs(held - acc) <= 0.05 * acc


def test_every_method_survives_random_chunks(method: str) -> None:
    model = tiny_model("llama")
    cfg = small_config(method)

    @settings(max_examples=4, deadline=None)
    @given(B=st.integers(1, 2), chunks=st.lists(st.integers(1, 48), min_size=1, max_size=4))
    def run(B, chunks):
        caches = KVCacheBuilder.for_model(model, cfg)
        for L in chunks:
            tokens = mx.random.randint(1, 120, (B, L))
            logits = model(tokens, cache=caches)
            assert logits.shape == (B, L, 128)
            assert mx.isfinite(logits).all().item()
        s = cache_stats(caches)
        assert s["held_bytes"] > 0
        # "none" grows in 256-token steps like mlx_lm's KVCache (the dense reference).
        for c in caches if method != "none" else []:
            held, acc = c.nbytes, c.accounted_bytes()
            assert abs(held - acc) <= 0.05 * max(acc, 1) + 64, (method, held, acc)

    run()


def test_invalid_input_raises_documented_errors() -> None:
    layer = LayerInfo(n_kv_heads=2, head_dim=32)
    cache = AffineCache(KVCacheConfig(method="affine", bits=8, group_size=32, max_ctx=64),
                        layer)
    k = mx.zeros((1, 2, 4, 32))
    with pytest.raises(ValueError, match=r"\[B, n_kv_heads, L, head_dim\]"):
        cache.update_and_fetch(k[0], k[0])
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        cache.update_and_fetch(mx.zeros((1, 3, 4, 32)), mx.zeros((1, 3, 4, 32)))
    with pytest.raises(ValueError, match="values shape"):
        cache.update_and_fetch(k, mx.zeros((1, 2, 5, 32)))
    cache.update_and_fetch(k, k)
    with pytest.raises(ValueError, match="batch size changed from 1 to 2"):
        cache.update_and_fetch(mx.zeros((2, 2, 4, 32)), mx.zeros((2, 2, 4, 32)))
    with pytest.raises(ValueError, match="max_ctx=64"):
        cache.update_and_fetch(mx.zeros((1, 2, 61, 32)), mx.zeros((1, 2, 61, 32)))
    with pytest.raises(ConfigError, match="affine.bits=7"):
        KVCacheConfig(method="affine", bits=7)
    with pytest.raises(ConfigError, match="affine.group_size=64"):
        AffineCache(KVCacheConfig(method="affine", group_size=64), LayerInfo(head_dim=96))
    with pytest.raises(ConfigError, match="KVCacheConfig.method='nope'"):
        KVCacheConfig(method="nope")


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(["bits", "group_size", "window", "max_ctx"]),
       value=st.one_of(st.just(-1), st.just(0), st.just(1.5), st.just("4"), st.just(True)))
def test_bad_options_name_the_field(name, value) -> None:
    if name == "window" and value == 0:
        return  # window=0 is allowed
    owner = "KVCacheConfig" if name == "max_ctx" else "affine"
    with pytest.raises(ConfigError, match=f"{owner}.{name}="):
        KVCacheConfig(method="affine", **{name: value})


@pytest.mark.parametrize("cfg", [dict(method="affine", bits=4, group_size=32, window=64),
                                 dict(method="none")])
def test_long_run_stays_within_budget(cfg: dict) -> None:
    """20k tokens through update_and_fetch in big chunks: held matches accounted."""
    layer = LayerInfo(n_kv_heads=2, head_dim=32)
    config = KVCacheConfig(**cfg)
    cache = (AffineCache if cfg["method"] == "affine" else DenseCache)(config, layer)
    q = mx.random.normal((1, 4, 1, 32))
    for _ in range(10):
        k = mx.random.normal((1, 2, 2000, 32))
        cache.update_and_fetch(k, k)
        mx.eval(cache.state)
    assert cache.offset == 20000
    held, acc = cache.nbytes, cache.accounted_bytes()
    assert abs(held - acc) <= 0.05 * acc
    if cfg["method"] == "affine":
        assert held < 0.4 * layer_stats(cache)["fp16_bytes"]
        out = cache.attend(q, scale=32 ** -0.5)
        assert mx.isfinite(out).all().item()
