"""The FLOP-and-byte model of a decode step that ``veloxquant bench`` prints beside the
measured speed: what each cache declares it costs, and the limits derived from it."""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn
import pytest

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, cache_stats
from veloxquant_mlx.cache.step_cost import layer_stats
from veloxquant_mlx.eval import bench
from veloxquant_mlx.testing.tiny import tiny_model


def _filled(model: nn.Module, spec: str, n: int) -> list:
    caches = KVCacheBuilder.for_model(model, KVCacheConfig.from_string(spec))
    vocab = model.model.embed_tokens.weight.shape[0]
    mx.eval(model((mx.arange(1, n + 1) % vocab)[None], cache=caches))
    mx.eval(model(mx.array([[3]]), cache=caches))  # methods that code after attention
    return caches


def test_dense_attention_costs_two_flops_per_multiply_add() -> None:
    model = tiny_model("llama")
    attn = model.layers[0].self_attn
    caches = _filled(model, "none", 40)
    info = caches[0].layer
    one = 2 * attn.n_heads * 41 * (info.head_dim + info.v_head_dim)
    assert attn.n_heads > info.n_kv_heads  # query heads count, not KV heads
    assert layer_stats(caches[0])["decode_flops"] == one
    assert cache_stats(caches)["decode_flops"] == len(model.layers) * one


def test_evicting_caches_attend_only_what_they_keep() -> None:
    model = tiny_model("llama")
    dense = layer_stats(_filled(model, "none", 60)[0])["decode_flops"]
    kept = layer_stats(_filled(model, "streaming:sink=2,window=14", 60)[0])["decode_flops"]
    assert kept == dense * 16 // 61


@pytest.mark.parametrize("pre_rope", [False, True])
def test_factor_space_attention_costs_rank_over_head_dim(pre_rope: bool) -> None:
    """xKV at rank r attends in factor space: about r / head_dim of dense attention's
    multiplies (keys stored before RoPE are rebuilt first, which costs more)."""
    model = tiny_model("llama")
    n, r = 1024, 8
    dense = cache_stats(_filled(model, "none", n))["decode_flops"]
    spec = (f"xkv:group_layers=2,block=64,rank_k={r},rank_v={r},window=0,sink=0,"
            f"pre_rope={pre_rope}")
    caches = _filled(model, spec, n)
    got = cache_stats(caches)["decode_flops"]
    d = caches[0].layer.head_dim
    if not pre_rope:
        assert got == pytest.approx(dense * r / d, rel=0.05)
    else:
        rebuild = len(model.layers) * 2 * n * r * caches[0].layer.n_kv_heads * d
        assert got == pytest.approx(dense * (r / d) / 2 + dense / 2 + rebuild, rel=0.05)


def test_xquant_rebuilds_keys_from_the_stored_width() -> None:
    model = tiny_model("llama")
    n = 64
    dense = cache_stats(_filled(model, "none", n))["decode_flops"]
    caches = _filled(model, "xquant:bits=8", n)
    c = caches[0]
    wk = c.widths[0]
    rebuild = 2 * (n + 1) * wk * c.layer.n_kv_heads * c.layer.head_dim
    assert layer_stats(c)["decode_flops"] > rebuild
    assert cache_stats(caches)["decode_flops"] > dense + len(model.layers) * rebuild * 0.9


def test_weight_flops_count_the_tied_head_once() -> None:
    model = tiny_model("llama", tie_word_embeddings=True)
    linear = sum(m.weight.size for _, m in model.named_modules() if isinstance(m, nn.Linear))
    vocab, width = model.model.embed_tokens.weight.shape
    assert bench.weight_flops(model) == 2 * (linear + vocab * width)
    untied = tiny_model("llama", tie_word_embeddings=False)
    linear = sum(m.weight.size for _, m in untied.named_modules() if isinstance(m, nn.Linear))
    assert bench.weight_flops(untied) == 2 * linear  # lm_head is a Linear


def test_the_limit_is_set_by_bytes_or_by_flops_whichever_binds() -> None:
    rates = {"read_bytes_per_s": 1e9, "matmul_flops_per_s": 1e10}
    dense = {"accounted_bytes": 400, "decode_flops": 1000, "decode_ratio": 1.0,
             "steady_ratio": 1.0}
    small = {"accounted_bytes": 100, "decode_flops": 1000, "decode_ratio": 1.2,
             "steady_ratio": 1.3}
    heavy = {"accounted_bytes": 100, "decode_flops": 20_000, "decode_ratio": 0.5,
             "steady_ratio": 0.4}
    for r in (dense, small, heavy):
        bench._roofline(r, dense, 600, 2000, rates)
    assert dense["roofline_limit"] == pytest.approx(1.0)
    # Fewer bytes, same FLOPs: the byte limit, (600 + 400) / (600 + 100).
    assert small["roofline_limit"] == pytest.approx(1000 / 700) == small["bytes_limit"]
    # 22,000 FLOPs at 1e10/s (2.2 us) outweigh its 700 bytes at 1e9/s (0.7 us).
    assert heavy["roofline_limit"] == pytest.approx(1.0 / 2.2)
    assert heavy["of_limit"] == pytest.approx(0.5 * 2.2)
    assert heavy["steady_of_limit"] == pytest.approx(0.4 * 2.2)
    # One phase after the other: weights 0.6 us, then dense's attention 0.4 us against
    # the heavy one's 2.0 us of FLOPs.
    assert heavy["serial_limit"] == pytest.approx(1.0 / 2.6)
    assert small["serial_limit"] == pytest.approx(1.0 / 0.7)
    assert heavy["of_serial"] == pytest.approx(0.5 * 2.6)
    # Absolute: the serial bound in seconds, and its share of a measured step.
    assert heavy["bound_step_s"] == pytest.approx(2.6e-6)
    heavy["decode_tok_s"] = 1e5  # 10 us a step
    bench._roofline(heavy, dense, 600, 2000, rates)
    assert heavy["of_bound"] == pytest.approx(0.26)


def test_the_read_rate_is_no_slower_than_a_real_read() -> None:
    """A bound must not be slower than what it bounds: a decode step reads its weights
    through a vector-matrix product, so the read rate is at least that product's (MLX's
    sum alone read at a third of it: every byte limit came out too low)."""
    rates = bench.machine_rates(repeats=2)
    a, v = mx.random.normal((4096, 4096)), mx.random.normal((1, 4096))
    mx.eval(a, v)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        mx.eval(v @ a)
        times.append(time.perf_counter() - t0)
    product = a.nbytes / min(times[1:])
    assert rates["read_bytes_per_s"] >= 0.8 * product
    assert rates["read_bytes_per_s"] >= rates["mlx_read_bytes_per_s"]
    assert rates["matmul_flops_per_s"] > 1e8


def test_the_profile_takes_the_specs_as_every_benchmark_does() -> None:
    """``--profile --methods a,b:x=1,y=2`` parses as the other benchmarks parse it (one
    parser: a comma inside a method's options stays with that method)."""
    model = tiny_model("llama", seed=2)
    rows = bench.profile_decode(model, "kivi:bits=4,group_size=32,turboquant", context=48,
                                rounds=1)
    assert [r["method"] for r in rows] == ["none", "kivi:bits=4,group_size=32",
                                           "turboquant"]
    assert all(r["step_ms"] > 0 and r["attention_ms"] > 0 for r in rows)
    # A step allocates at least its logits (vocabulary x float32).
    assert all(r["step_peak_mib"] * 2**20 >= model.args.vocab_size * 4 for r in rows)


def test_the_profile_refuses_methods_it_cannot_fill_naming_them() -> None:
    # The profile fills caches with random keys and values; XQuant caches the layers'
    # input instead, so it is refused by name rather than failing deep inside the cache.
    model = tiny_model("llama", seed=2)
    with pytest.raises(ValueError, match="'xquant' caches the layers' input"):
        bench.profile_decode(model, "xquant", context=48, rounds=1)
