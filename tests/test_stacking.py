"""Eviction stacked with quantization (``store``), and trimming of snapkv / streaming."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from conftest import run_prefill

from veloxquant_mlx import (
    KVCacheBuilder,
    KVCacheConfig,
    cache_stats,
    load_prompt_cache,
    save_prompt_cache,
)
from veloxquant_mlx.adapter.retained import measure_retained
from veloxquant_mlx.apps.prompt_cache import trim_prompt_cache
from veloxquant_mlx.cache import kept as kp
from veloxquant_mlx.cache.base import NotTrimmableError
from veloxquant_mlx.cache.segments import CodebookCodes
from veloxquant_mlx.config import ConfigError
from veloxquant_mlx.testing.tiny import tiny_model

TOKENS = [(i * 37 + 11) % 120 + 1 for i in range(120)]
FOLLOW = (5, 9, 17, 33)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", head_dim=64, num_attention_heads=4)


def _run(model, spec: str, tokens=TOKENS[:100], follow=FOLLOW, chunk: int = 16):
    caches = KVCacheBuilder.for_model(model, KVCacheConfig.from_string(spec))
    out = [run_prefill(model, caches, tokens, chunk)]
    out += [model(mx.array([[t]]), cache=caches)[:, -1] for t in follow]
    return mx.concatenate(out, axis=0), caches


@pytest.mark.parametrize("base", ["streaming:sink=4,window=40",
                                  "snapkv:capacity=40,window=8,sink=4"])
def test_a_quantized_store_keeps_what_eviction_keeps_in_fewer_bytes(model, base: str) -> None:
    dense, d_caches = _run(model, base)
    near, n_caches = _run(model, base + ",store=affine,k_bits=8,v_bits=8")
    coded, c_caches = _run(model, base + ",store=codebook,k_bits=3,v_bits=3")
    # 8-bit codes of the same kept tokens: the same attention up to rounding.
    assert mx.abs(near - dense).max().item() < 0.03
    assert mx.abs(coded - dense).max().item() < 1.0  # 3-bit codes, the same tokens
    held = [cache_stats(c)["held_bytes"] for c in (d_caches, n_caches, c_caches)]
    # Codebook 3 bits: 26 bytes per head vector against 128, + fp16 sinks (and the
    # rotation, 16 KiB, large beside this tiny cache); 8-bit affine: 72.
    assert held[2] - 64 * 64 * 4 < 0.3 * held[0] and held[1] < 0.65 * held[0], held
    assert type(c_caches[0]).__name__.startswith("Rotated")  # codebook codes: rotated
    for caches in (n_caches, c_caches):  # the storage formula is what is held
        assert [c.accounted_bytes() for c in caches] == [c.nbytes for c in caches]


def test_streaming_store_chunking_and_band(model) -> None:
    # Prefill in one chunk, in chunks larger and smaller than the window, and token by
    # token: the band (sinks + last `window`) is respected in every path.
    spec = "streaming:sink=4,window=24,store=affine,k_bits=8,v_bits=8"
    dense_spec = "streaming:sink=4,window=24"
    for chunk in (100, 30, 7, 1):
        ref, _ = _run(model, dense_spec, chunk=chunk)
        got, caches = _run(model, spec, chunk=chunk)
        assert mx.abs(got - ref).max().item() < 0.03, chunk
        c = caches[0]
        assert c.sinks[0].n == 4 and c.ring[0].n == 24 and c.fresh[0].n == 0


def test_sinks_stay_exact_and_the_rest_is_coded(model) -> None:
    _, caches = _run(model, "streaming:sink=4,window=40,store=codebook,k_bits=2,v_bits=2")
    c = caches[1]
    assert c.sinks[0].x.dtype == mx.float16 and c.sinks[0].n == 4
    assert c.ring[0].held[0].dtype == mx.uint8  # codes
    _, caches = _run(model, "snapkv:capacity=40,window=8,store=affine,k_bits=4,v_bits=4")
    c = caches[1]
    assert c.sinks[0].n == 4 and c.codes[0].n == 40 + 8 + len(FOLLOW) - 1
    assert c.codes[0].buf.arrays[0].dtype == mx.uint32 and c.held[0].n == 0


def test_real_bytes_of_stacks_within_declared(model) -> None:
    previous = mx.set_cache_limit(0)
    try:
        for spec in ("streaming:sink=4,window=40,store=codebook,k_bits=3,v_bits=3",
                     "snapkv:capacity=40,window=8,store=affine,k_bits=4,v_bits=4"):
            m = measure_retained(model, KVCacheConfig.from_string(spec), TOKENS[:100], 8)
            for when in ("prefill", "decode"):
                # The measurement warms the method up first, so the codebook kernels'
                # process-wide constants are not counted. A kept slice pinning one
                # 16-token chunk would add ~32 KiB here.
                real, declared = m[f"real_{when}_bytes"], m[f"declared_{when}_bytes"]
                assert real <= 1.05 * declared, (spec, m)
    finally:
        mx.set_cache_limit(previous)


@pytest.mark.parametrize("spec", ["streaming:sink=4,window=40,store=codebook,k_bits=3,v_bits=3",
                                  "snapkv:capacity=40,window=8,store=affine,k_bits=4,v_bits=4"])
def test_saved_stack_continues_exactly(model, tmp_path: Path, spec: str) -> None:
    _, caches = _run(model, spec, follow=(5,))
    save_prompt_cache(tmp_path / "s.safetensors", caches)
    loaded = load_prompt_cache(tmp_path / "s.safetensors", model=model)
    for tok in (9, 17):
        a = model(mx.array([[tok]]), cache=caches)
        b = model(mx.array([[tok]]), cache=loaded)
        assert mx.allclose(a, b, atol=1e-5).item()


PLANES_SPECS = ["streaming:sink=4,window=40,store=codebook,k_bits=4,v_bits=2",
                "snapkv:capacity=40,window=8,sink=4,store=codebook,k_bits=4,v_bits=2"]


def _coded_ranks(caches) -> set[int]:
    """ndim of every code array held (bit planes of a 4- or 2-bit width: 5, bytes: 4)."""
    return {a.ndim for c in caches for a in c.stored.arrays() if a.dtype == mx.uint8}


@pytest.mark.parametrize("spec", PLANES_SPECS)
def test_a_codebook_store_codes_in_bytes(model, spec: str) -> None:
    """Bytes, not bit planes: planes made a streaming step's attention over 764 coded
    tokens 6x slower (3.6 ms against 0.6 per layer)."""
    _, caches = _run(model, spec)
    assert _coded_ranks(caches) == {4}


@pytest.mark.parametrize("spec", PLANES_SPECS)
def test_a_store_saved_in_bit_planes_loads_and_goes_on_in_planes(
        model, tmp_path: Path, spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Caches saved before byte packing: loaded, they code new tokens as they were
    coded (a mix would not concatenate) and continue as the cache that saved them."""
    with monkeypatch.context() as m:
        m.setattr(kp, "store_codes", lambda opts, bits, dim: CodebookCodes(
            bits, dim, packing="planes"))
        _, caches = _run(model, spec, follow=(5,))
    assert _coded_ranks(caches) == {5}
    save_prompt_cache(tmp_path / "p.safetensors", caches)
    loaded = load_prompt_cache(tmp_path / "p.safetensors", model=model)
    for tok in (9, 17, 33):
        a = model(mx.array([[tok]]), cache=caches)
        b = model(mx.array([[tok]]), cache=loaded)
        assert mx.allclose(a, b, atol=1e-5).item()
    assert _coded_ranks(loaded) == {5}


@pytest.mark.parametrize("store", ["", ",store=affine,k_bits=4,v_bits=4"])
def test_snapkv_trims_exactly_after_the_keep_set(model, store: str) -> None:
    spec = "snapkv:capacity=40,window=8" + store
    follow = (5, 9, 17, 33, 40)
    _, caches = _run(model, spec, follow=follow)
    assert trim_prompt_cache(caches, 3) == 3
    _, fresh = _run(model, spec, follow=follow[:2])
    for tok in (61, 62):
        a = model(mx.array([[tok]]), cache=caches)
        b = model(mx.array([[tok]]), cache=fresh)
        assert mx.array_equal(a, b).item()
    # The observation window (its last query is the first decode step's) and the 4
    # tokens after it, less 3 trimmed, plus 2: 11 tokens are trimmable, not more.
    with pytest.raises(NotTrimmableError, match="only its last 11 tokens"):
        trim_prompt_cache(caches, 13)


@pytest.mark.parametrize("store", ["", ",store=codebook,k_bits=3,v_bits=3"])
def test_streaming_trims_exactly_until_it_evicts(model, store: str) -> None:
    spec = "streaming:sink=4,window=100" + store
    _, caches = _run(model, spec, follow=(5, 9))  # 102 tokens: nothing evicted
    assert trim_prompt_cache(caches, 7) == 7
    _, fresh = _run(model, spec, tokens=TOKENS[:95], follow=())
    a = model(mx.array([[61]]), cache=caches)
    b = model(mx.array([[61]]), cache=fresh)
    assert mx.allclose(a, b, atol=1e-4).item()
    _, full = _run(model, spec, follow=(5, 9, 17, 33, 40))  # 105 tokens: one evicted
    with pytest.raises(NotTrimmableError, match="not trimmable"):
        trim_prompt_cache(full, 1)
    with pytest.raises(NotTrimmableError, match="not trimmable"):
        full[0].trim(1)


def test_stack_config_syntax_and_errors() -> None:
    cfg = KVCacheConfig.from_string("snapkv:capacity=512,store=codebook,k_bits=3.5,v_bits=3")
    assert (cfg.options.store, cfg.options.k_bits, cfg.options.sinks) == ("codebook", 3.5, 4)
    assert KVCacheConfig.from_string(cfg.to_string()) == cfg
    assert KVCacheConfig("snapkv").options.sinks == 0  # the paper's, with a dense store
    with pytest.raises(ConfigError, match=r"k_bits=5.*for store='codebook'"):
        KVCacheConfig("streaming", store="codebook", k_bits=5)
    with pytest.raises(ConfigError, match=r"v_bits=2.5.*for store='affine'"):
        KVCacheConfig("streaming", store="affine", v_bits=2.5)
    with pytest.raises(ConfigError, match=r"store='zip'"):
        KVCacheConfig("snapkv", store="zip")
    model = tiny_model("llama")  # head_dim 32: affine groups of 64 do not fit
    with pytest.raises(ConfigError, match=r"group_size.*divisor of head_dim=32"):
        KVCacheBuilder.for_model(model, KVCacheConfig("streaming", store="affine",
                                                      group_size=64))
