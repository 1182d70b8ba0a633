"""``KVCacheConfig.rotate``: any rotatable method over keys/values rotated per head."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from conftest import PROMPT, run_prefill

from veloxquant_mlx import (
    KVCacheBuilder,
    KVCacheConfig,
    cache_stats,
    load_prompt_cache,
    save_prompt_cache,
)
from veloxquant_mlx.adapter.retained import measure_retained
from veloxquant_mlx.cache import rotated
from veloxquant_mlx.cache.base import CompressedCache, LayerInfo
from veloxquant_mlx.cache.sliding import SlidingCache
from veloxquant_mlx.config import ConfigError
from veloxquant_mlx.testing.tiny import tiny_model

ROT_BYTES = 64 * 64 * 4  # one float32 rotation of 64-wide heads


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", head_dim=64, num_attention_heads=4)


def _logits(model, config: KVCacheConfig, tokens=PROMPT, follow=(5, 9, 17)):
    caches = KVCacheBuilder.for_model(model, config)
    out = [run_prefill(model, caches, tokens)]
    out += [model(mx.array([[t]]), cache=caches)[:, -1] for t in follow]
    return mx.concatenate(out, axis=0), caches


@pytest.mark.parametrize("spec", [
    "streaming:window=1000", "snapkv:capacity=1000", "minicache:window=1000",
    "xkv:pre_rope=false,group_layers=2,block=16,rank_k=16,rank_v=16,window=32",
])
def test_rotation_leaves_exact_attention_exact(model, spec: str) -> None:
    # Lossless storage: rotated keys/queries and the output rotated back give the same
    # logits (float32 rounding only), while what is stored really is rotated.
    cfg = KVCacheConfig.from_string(spec).replace(window_dtype="float32")
    plain, _ = _logits(model, cfg)
    turned, caches = _logits(model, cfg.replace(rotate=True))
    assert type(caches[0]).__name__.startswith("Rotated")
    assert mx.abs(turned - plain).max().item() < 2e-4
    a, b = _logits(model, cfg)[1][0], caches[0]
    held = getattr(b, "keys", None)
    if held is not None:  # stored in the rotated basis, not as given
        assert mx.abs(held - a.keys).max().item() > 1e-2
    if type(b).keys_and_values is not CompressedCache.keys_and_values:
        # A reconstruction is handed back in the model's basis.
        assert mx.abs(b.keys_and_values()[0] - a.keys_and_values()[0]).max().item() < 2e-4


def test_rotation_spreads_an_outlier_channel_so_affine_codes_lose_less() -> None:
    # Per-token 4-bit groups: one large channel sets the scale of its whole group.
    info = LayerInfo(n_kv_heads=2, head_dim=64)
    x = mx.random.normal((1, 2, 64, 64), key=mx.random.key(1))
    x = x + mx.zeros((64,)).at[3].add(30.0)
    errors = {}
    for rot in (False, True):
        cfg = KVCacheConfig("affine", bits=4, group_size=64, rotate=rot, window_dtype="float32")
        cls = rotated.rotated_class(type_of(cfg)) if rot else type_of(cfg)
        c = cls(cfg, info)
        c.update_and_fetch(x, x)
        k, _ = c.keys_and_values(mx.float32)
        errors[rot] = (mx.linalg.norm(k - x) / mx.linalg.norm(x)).item()
    assert errors[True] < errors[False] / 2, errors  # measured 0.058 against 0.157


def type_of(cfg: KVCacheConfig) -> type:
    from veloxquant_mlx.registry import get_method

    return get_method(cfg.method)


def test_one_rotation_per_model_declared_by_one_layer(model) -> None:
    base = KVCacheConfig("kivi", bits=4, group_size=32, window=32)
    _, plain = _logits(model, base)
    _, turned = _logits(model, base.replace(rotate=True))
    assert [c.owns_rotation for c in turned] == [True, False, False, False]
    assert turned[0].rot_k is turned[3].rot_k  # shared, not one per layer
    assert cache_stats(turned)["held_bytes"] == cache_stats(plain)["held_bytes"] + ROT_BYTES


def test_real_bytes_of_rotated_caches_within_declared(model) -> None:
    previous = mx.set_cache_limit(0)  # allocator slack is not what a cache keeps
    try:
        for spec in ("kivi:bits=2,group_size=32,window=32,rotate=true",
                     "affine:bits=4,group_size=64,rotate=true"):
            m = measure_retained(model, KVCacheConfig.from_string(spec), PROMPT * 4, 8)
            assert m["real_over_declared_prefill"] <= 1.05, (spec, m)
            assert m["real_over_declared_decode"] <= 1.05, (spec, m)
    finally:
        mx.set_cache_limit(previous)


def test_saved_rotated_cache_continues_exactly(model, tmp_path: Path) -> None:
    cfg = KVCacheConfig("affine", bits=4, group_size=32, window=8, rotate=True)
    caches = KVCacheBuilder.for_model(model, cfg)
    run_prefill(model, caches, PROMPT)
    save_prompt_cache(tmp_path / "c.safetensors", caches)
    loaded = load_prompt_cache(tmp_path / "c.safetensors", model=model)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    assert [c.owns_rotation for c in loaded] == [True, False, False, False]
    assert sum(r.nbytes for c in loaded for r in c._rotations()) == ROT_BYTES
    for tok in (5, 9):
        a = model(mx.array([[tok]]), cache=caches)
        b = model(mx.array([[tok]]), cache=loaded)
        assert mx.allclose(a, b, atol=1e-5).item()


def test_sliding_window_rings_hold_a_rotated_cache() -> None:
    model = tiny_model("gemma3_text", head_dim=64, num_attention_heads=4)
    cfg = KVCacheConfig("affine", bits=8, group_size=32, window_dtype="float32")
    dense, _ = _logits(model, KVCacheConfig("none"), PROMPT * 2)
    plain, _ = _logits(model, cfg, PROMPT * 2)
    turned, caches = _logits(model, cfg.replace(rotate=True), PROMPT * 2)
    rings = [c for c in caches if isinstance(c, SlidingCache)]
    assert rings and all(type(c.inner).__name__ == "RotatedAffineCache" for c in rings)
    assert rings[0].start > 0  # the ring has dropped tokens (a rebuilt inner cache)
    assert rings[0].inner.owns_rotation  # ... which kept the declaration
    # 8-bit codes move this random model's logits by about 0.28 either way; a rotation
    # missing on either side of attention moves them by several units.
    err = [mx.abs(x - dense).max().item() for x in (plain, turned)]
    assert err[1] < 1.5 * err[0] + 0.05, err


def test_refusals_and_the_config_forms() -> None:
    with pytest.raises(ConfigError, match="xquant.*does not attend by dot products"):
        KVCacheConfig("xquant", rotate=True)
    with pytest.raises(ConfigError, match="pre_rope=True.*does not commute with RoPE"):
        KVCacheConfig("xkv", rotate=True)
    cfg = KVCacheConfig.from_string("kivi:bits=2,rotate=true")
    assert cfg.rotate and cfg.to_string() == "kivi:rotate=True"
    assert KVCacheConfig.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in cfg.to_dict().items() if k != "rotate"}  # saved before rotate
    assert KVCacheConfig.from_dict(old).rotate is False
    # turboquant rotates by itself: the keyword is its own option.
    tq = KVCacheConfig.from_string("turboquant:rotate=false")
    assert tq.options.rotate is False and tq.rotate is False
    assert "rotate" not in tq.to_dict() and KVCacheConfig.from_dict(tq.to_dict()) == tq
