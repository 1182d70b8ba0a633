"""No silent wrong output: every method either matches mlx_lm's own cache or refuses.

Each (architecture, method) cell runs a 40-token prefill and 8 greedy decode steps at
lossless settings and compares the logits with mlx_lm's own cache. A method that cannot
run on an architecture must say so when the caches are built. (Every architecture mlx_lm
ships: tests/test_architectures.py.)
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import pytest
from conftest import PROMPT, lossless_config
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx import ConfigError, KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.adapter.mlx_lm import (
    UnsupportedModelError,
    check_attention_routing,
    probe_model,
    reconstruction_installed,
    uninstall_reconstruction,
)
from veloxquant_mlx.cache.base import CompressedCache
from veloxquant_mlx.errors import Refusal
from veloxquant_mlx.registry import get_method
from veloxquant_mlx.testing.architectures import build_tiny
from veloxquant_mlx.testing.tiny import tiny_model

ARCHITECTURES = ["llama", "qwen2", "qwen3", "gemma3_text", "gemma2", "olmo2", "plamo"]
# Relative logit error allowed at the lossless settings (8-bit codes, fp16 windows).
TOLERANCE = 0.05


def _model(arch: str):
    # plamo needs its own head layout (more KV heads than tiny_model's default allows).
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


def test_gemma2_gets_a_dense_reconstruction_or_a_refusal(method: str) -> None:
    # gemma2 computes soft-capped attention itself: a cache returning only the new chunk
    # would be attended to that chunk alone. Methods that rebuild their keys hand it a
    # transient dense reconstruction (and say so once); the others refuse by name, as
    # do evicting methods (that attention may count positions from the keys it gets).
    model = tiny_model("gemma2")
    cls = get_method(method)
    if (cls.attends and cls.keys_and_values is CompressedCache.keys_and_values) or cls.profile.evicts:
        with pytest.raises(UnsupportedModelError, match="gemma2.*does not call") as exc:
            KVCacheBuilder.for_model(model, lossless_config(method))
        assert exc.value.reason in (Refusal.NO_RECONSTRUCTION, Refusal.EVICTED_POSITIONS)
        return
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        caches = KVCacheBuilder.for_model(model, lossless_config(method))
    want, _ = _generate(model, make_prompt_cache(model))
    got, _ = _generate(model, caches)
    KVCacheBuilder.detach(model)
    assert _rel(got, want) < TOLERANCE, method


def test_a_bypassing_layer_needs_the_hook_and_the_broken_output_is_real(monkeypatch) -> None:
    """The check is what stands between the user and wrong logits: show both sides."""
    import veloxquant_mlx.adapter.mlx_lm as glue

    monkeypatch.setattr(glue, "_WARNED", set())  # the notice comes once per model/method
    model = tiny_model("gemma2")
    with pytest.raises(UnsupportedModelError, match="snapkv"):
        check_attention_routing(model, [0, 1, 2, 3], "snapkv")
    assert not reconstruction_installed(model)
    with pytest.warns(UserWarning, match="transient dense reconstruction"):
        assert check_attention_routing(model, [0, 1, 2, 3], "affine") == [0, 1, 2, 3]
    assert reconstruction_installed(model)
    uninstall_reconstruction(model)
    # Built without the hook, the affine cache is silently wrong on this model.
    from veloxquant_mlx.cache.affine import AffineCache

    infos = KVCacheBuilder.layer_infos(model)
    cfg = KVCacheConfig("affine", bits=8, group_size=32)
    caches = [AffineCache(cfg, info) for info in infos]
    want, _ = _generate(model, make_prompt_cache(model))
    got, _ = _generate(model, caches)
    assert _rel(got, want) > 10 * TOLERANCE


def test_tiled_keys_need_a_reconstruction() -> None:
    # plamo tiles the returned keys across query heads before attention (h mod n_kv, not
    # grouped-query pairing): attending over the stored keys would pair heads wrongly.
    model = _model("plamo")
    with pytest.raises(UnsupportedModelError, match="transforms the cached keys"):
        KVCacheBuilder.for_model(model, KVCacheConfig("snapkv", capacity=1000))


def test_the_probe_finds_layers_by_what_they_hand_their_cache() -> None:
    """No projection names needed: fused QKV (phi3), MLA latents (deepseek_v3), a model
    whose caches are not one per layer (nemotron_h: Mamba, attention, MLP-only)."""
    shapes = {t: [(p.slot, p.shape, type(p.owner).__name__) for p in probe_model(
        build_tiny(t)) if p is not None] for t in ("phi3", "deepseek_v3", "nemotron_h")}
    assert shapes["phi3"] == [(0, (2, 16, 16), "Attention"), (1, (2, 16, 16), "Attention")]
    # MLA caches one latent "head" (kv_lora_rank 32) and the RoPE key part (8).
    assert [s[1] for s in shapes["deepseek_v3"]] == [(1, 32, 8), (1, 32, 8)]
    # Three blocks (Mamba, attention, MLP) but two caches: the attention's is slot 1.
    assert shapes["nemotron_h"] == [(1, (2, 16, 16), "NemotronHAttention")]
    infos = KVCacheBuilder.layer_infos(build_tiny("nemotron_h"))
    assert [i is not None for i in infos] == [False, True] and infos[1].layer_idx == 1


def test_hooks_stack_and_come_off_one_at_a_time() -> None:
    """One hook mechanism for every build: reconstruction and XQuant's X hook can sit on
    the same module, and removing one leaves the other (and the weights) in place."""
    import mlx.nn as nn

    from veloxquant_mlx.cache.module_call import (
        below,
        hook_module,
        hook_names,
        original_class,
        unhook_module,
    )

    lin = nn.Linear(4, 4)
    x = mx.ones((1, 4))
    plain = lin(x)

    def doubled(self, x):
        return 2 * below(self, "Double").__call__(self, x)

    def shifted(self, x):
        return below(self, "Shift").__call__(self, x) + 1

    hook_module(lin, doubled, "Double")
    hook_module(lin, shifted, "Shift")
    assert hook_names(lin) == ["Shift", "Double"] and original_class(lin) is nn.Linear
    assert mx.allclose(lin(x), 2 * plain + 1).item()
    assert unhook_module(lin, "Double") and hook_names(lin) == ["Shift"]
    assert mx.allclose(lin(x), plain + 1).item()
    assert not unhook_module(lin, "Double")
    assert unhook_module(lin) and type(lin) is nn.Linear
    assert mx.allclose(lin(x), plain).item()
