"""No silent wrong output: every method either matches mlx_lm's own cache or refuses.

Each (architecture, method) cell runs a 40-token prefill and 8 greedy decode steps at
lossless settings and compares the logits with mlx_lm's own cache. A method that cannot
run on an architecture must say so when the caches are built.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import LOSSLESS_OPTIONS, PROMPT, lossless_config
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import tiny_model

from veloxquant_mlx import ConfigError, KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.eval.architectures import build_tiny
from veloxquant_mlx.integration.mlx_lm import UnsupportedModelError, check_attention_routing

ARCHITECTURES = ["llama", "qwen2", "qwen3", "gemma3_text", "gemma2", "olmo2", "plamo"]
# Relative logit error allowed at the lossless settings (8-bit codes, fp16 windows).
TOLERANCE = 0.05


def _model(arch: str):
    # plamo needs its own head layout (more KV heads than tiny_models' default allows).
    return build_tiny(arch) if arch == "plamo" else tiny_model(arch)


def _generate(model, caches, steps: int = 8) -> tuple[mx.array, list[int]]:
    logits = model(mx.array([PROMPT]), cache=caches)[:, -1]
    outs, tokens = [logits], []
    for _ in range(steps):
        tok = int(mx.argmax(outs[-1], axis=-1).item())
        tokens.append(tok)
        outs.append(model(mx.array([[tok]]), cache=caches)[:, -1])
    return mx.concatenate(outs, axis=0), tokens


def _rel(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_matches_mlx_lm_or_refuses(arch: str, method: str) -> None:
    model = _model(arch)
    want, want_tokens = _generate(model, make_prompt_cache(model))
    try:
        caches = KVCacheBuilder.for_model(model, lossless_config(method))
    except (UnsupportedModelError, ConfigError, ValueError) as exc:
        # A refusal names what is not supported; an empty message would not help anyone.
        assert arch in str(exc) or "model" in str(exc) or "layer" in str(exc), exc
        return
    got, got_tokens = _generate(model, caches)
    KVCacheBuilder.detach(model)
    err = _rel(got, want)
    assert err < TOLERANCE, f"{arch} / {method}: relative logit error {err:.3g}"
    assert got_tokens == want_tokens


@pytest.mark.parametrize("method", [m for m in LOSSLESS_OPTIONS if m != "xquant"
                                    and m != "xquant_cl"])
def test_gemma2_attention_is_refused_not_bypassed(method: str) -> None:
    # gemma2 computes soft-capped attention itself: a cache returning only the new chunk
    # would be attended to that chunk alone.
    model = tiny_model("gemma2")
    with pytest.raises(UnsupportedModelError, match="gemma2.*does not call"):
        KVCacheBuilder.for_model(model, lossless_config(method))


def test_a_bypassing_layer_fails_the_check_and_the_broken_output_is_real() -> None:
    """The check is what stands between the user and wrong logits: show both sides."""
    model = tiny_model("gemma2")
    with pytest.raises(UnsupportedModelError):
        check_attention_routing(model, [0, 1, 2, 3], "affine")
    # Built without the check, the affine cache is silently wrong on this model.
    from veloxquant_mlx.cache.affine import AffineCache

    infos = KVCacheBuilder.layer_infos(model)
    cfg = KVCacheConfig("affine", bits=8, group_size=32)
    caches = [AffineCache(cfg, info) for info in infos]
    want, _ = _generate(model, make_prompt_cache(model))
    got, _ = _generate(model, caches)
    assert _rel(got, want) > 10 * TOLERANCE


def test_tiled_keys_are_refused() -> None:
    # plamo tiles the returned keys across query heads before attention (h mod n_kv, not
    # grouped-query pairing): attending over the stored keys would pair heads wrongly.
    model = _model("plamo")
    with pytest.raises(UnsupportedModelError, match="transforms the cached keys"):
        KVCacheBuilder.for_model(model, KVCacheConfig("streaming", window=1000))
