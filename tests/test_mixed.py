"""Per-layer option overrides (``KVCacheConfig.layers``) and the mixed-precision
calibration (``eval.mixed``)."""

from __future__ import annotations

import itertools
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
from veloxquant_mlx.config import ConfigError, layers_to_string, parse_layers
from veloxquant_mlx.eval import mixed
from veloxquant_mlx.testing.tiny import tiny_model

TEXT = [(i * 37 + 11) % 120 + 1 for i in range(96)]


def test_layer_overrides_forms_round_trip() -> None:
    cfg = KVCacheConfig.from_string("turboquant:k_bits=3,layers=0-1:k_bits=4+v_bits=3/3:v_bits=2")
    assert cfg.layer_overrides() == {0: {"k_bits": 4, "v_bits": 3},
                                     1: {"k_bits": 4, "v_bits": 3}, 3: {"v_bits": 2}}
    assert cfg.layer_options(1).k_bits == 4 and cfg.layer_options(2).k_bits == 3
    assert KVCacheConfig.from_string(cfg.to_string()) == cfg
    assert KVCacheConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["layers"] == {"0": {"k_bits": 4, "v_bits": 3},
                                       "1": {"k_bits": 4, "v_bits": 3}, "3": {"v_bits": 2}}
    assert "layers" not in KVCacheConfig("kivi").to_dict()  # as configs were written
    overrides = parse_layers("2-4:bits=4/9:bits=2+window=64")
    assert layers_to_string(overrides) == "2-4:bits=4/9:bits=2+window=64"
    assert KVCacheConfig("kivi", layers={"5": {"bits": 4}}).layer_options(5).bits == 4


@pytest.mark.parametrize("layers,match", [
    ("0:bits=3", r"layers\[0\]: kivi.bits=3 is not allowed"),
    ("0:rank=3", r"unknown option 'rank' for method 'kivi' \(layer 0\)"),
    ("3-1:bits=4", r"increasing range"),
    ("x:bits=4", r"not a layer index"),
    ("0 bits=4", r"LAYERS:key=value"),
])
def test_bad_overrides_name_what_is_wrong(layers: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KVCacheConfig("kivi", layers=layers)


def test_cross_layer_methods_and_missing_layers_are_refused() -> None:
    with pytest.raises(ConfigError, match="per-layer overrides apply to methods whose"):
        KVCacheConfig("minicache", layers={0: {"window": 8}})
    model = tiny_model("llama")  # 4 layers
    with pytest.raises(ConfigError, match=r"overrides layer\(s\) \[7\].*\[0, 1, 2, 3\]"):
        KVCacheBuilder.for_model(model, KVCacheConfig("kivi", layers={7: {"bits": 4}}))


def test_each_layer_gets_its_options_built_and_loaded(tmp_path: Path) -> None:
    model = tiny_model("llama")
    cfg = KVCacheConfig("kivi", bits=2, window=32, layers={1: {"bits": 4}})
    caches = KVCacheBuilder.for_model(model, cfg)
    run_prefill(model, caches, PROMPT * 3)
    assert [c.n_bits for c in caches] == [2, 4, 2, 2]
    held = [c.nbytes for c in caches]
    assert held[1] > held[0] == held[2]  # 4-bit codes are larger
    save_prompt_cache(tmp_path / "m.safetensors", caches)
    loaded = load_prompt_cache(tmp_path / "m.safetensors", model=model)
    assert [c.n_bits for c in loaded] == [2, 4, 2, 2]
    a = model(mx.array([[3]]), cache=caches)
    b = model(mx.array([[3]]), cache=loaded)
    assert mx.allclose(a, b, atol=1e-5).item()


def test_fisher_gradient_matches_a_finite_difference() -> None:
    model = tiny_model("llama", head_dim=64, num_attention_heads=4)
    infos = KVCacheBuilder.layer_infos(model)
    slots, kv, f = mixed.fisher(model, TEXT[:24], infos)
    assert slots == [0, 1, 2, 3] and kv[2].shape == (1, 2, 23, 64)
    x = mx.array(TEXT[:23])[None]
    y = mx.array(TEXT[1:24])

    def loss(eps: float) -> float:
        deltas = [mx.zeros_like(a) for a in kv]
        deltas[3] = deltas[3].at[0, 1, 5, 7].add(eps)  # one value of layer 1
        logits = model(x, cache=mixed._caches(model, slots, deltas))
        return mx.sum(mx.logsumexp(logits[0], -1) - logits[0, mx.arange(23), y]).item()

    # A step large enough that float32 rounding of the summed loss (~1e-5) stays well
    # under the difference; the loss is smooth, so the O(eps^2) error is small too.
    fd = (loss(5e-2) - loss(-5e-2)) / 1e-1
    assert f[3][0, 1, 5, 7].item() == pytest.approx(fd ** 2, rel=0.05)


def test_costs_fall_with_width_and_the_allocation_meets_the_budget() -> None:
    model = tiny_model("llama", head_dim=64, num_attention_heads=4)
    ladder = mixed.ladders()["turboquant"]
    cal = mixed.calibrate(model, TEXT, ladder, context=256)
    for costs in cal.costs:
        for knob in ("k_bits", "v_bits"):
            assert costs[knob] == sorted(costs[knob], reverse=True), costs
    # At 256 tokens the narrowest config (1 bit; 4 sinks and 28 window tokens in float16,
    # the window being 16 plus what is left of a 16-token block) is 0.227.
    budgets = (0.35, 0.29, 0.24)
    configs = [cal.config(budget) for budget in budgets]
    assert len({c.to_string() for c in configs}) == 3
    for budget, cfg in zip(budgets, configs):
        caches = KVCacheBuilder.for_model(model, cfg)
        run_prefill(model, caches, [(i * 7) % 120 + 1 for i in range(256)], chunk=256)
        q = mx.zeros((1, 4, 1, 64))
        for c in caches:  # code what the last step left in full precision
            c.attend(q, scale=1.0)
        s = cache_stats(caches)
        assert s["accounted_bytes"] <= budget * s["fp16_bytes"] * 1.01, (budget, cfg)


def test_the_allocation_is_the_best_within_the_budget_on_a_small_case() -> None:
    # Three layers, two knobs of three widths each: against every allocation.
    ladder = mixed.Ladder("turboquant", {}, {"k_bits": (2, 3, 4), "v_bits": (2, 3, 4)})
    costs = [{"k_bits": [9.0, 3.0, 1.0], "v_bits": [2.0, 1.0, 0.5]},
             {"k_bits": [30.0, 8.0, 2.0], "v_bits": [1.0, 0.6, 0.4]},
             {"k_bits": [4.0, 2.0, 1.5], "v_bits": [6.0, 2.0, 0.5]}]
    nbytes = [{"base": [100], "k_bits": [0, 10, 20], "v_bits": [0, 10, 20]}] * 3
    cal = mixed.Calibration(ladder, [0, 1, 2], costs, nbytes, fp16_bytes=1000)
    for budget in (0.34, 0.37, 0.4):
        pick = cal.allocate(budget)
        spent = cal._bytes(pick)
        assert 300 + spent <= budget * 1000
        cost = sum(c[k][j] for c, p in zip(costs, pick.values()) for k, j in p.items())
        best = min(
            sum(c["k_bits"][a] + c["v_bits"][b] for c, (a, b) in zip(costs, combo))
            for combo in itertools.product(itertools.product(range(3), repeat=2), repeat=3)
            if 300 + sum(10 * (a + b) for a, b in combo) <= budget * 1000)
        assert cost <= best * 1.25, (budget, cost, best)


def test_a_ladder_the_layers_refuse_is_left_out_not_fatal() -> None:
    """Head dim 256 (Gemma 3): the affine quantizer's ladder is refused by name, the
    codebook ladder still calibrates."""
    from veloxquant_mlx.eval import tune

    model = tiny_model("llama", head_dim=256, num_attention_heads=4)
    ladders = mixed.ladders()
    got = tune.calibrate(model, TEXT[:64], [ladders["turboquant-affine"],
                                            ladders["turboquant"]], context=64)
    assert isinstance(got[0], str) and "head_dim" in got[0] and "256" in got[0]
    assert isinstance(got[1], mixed.Calibration)
