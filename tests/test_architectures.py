"""Every model type the installed mlx_lm ships x every registered method.

Each cell (``veloxquant_mlx.testing.models_table.run_cell``: prefill + decode, a saved-cache
round trip, trimming where the caches say they can, a batch of two) either matches
mlx_lm's own cache at the method's lossless settings or refuses with a clear error. The
expected refusals follow from facts about each model (data below) and the capabilities
each method's class declares, so a cell that goes from supported to refused (or back)
fails until the data or the declaration says so; a crash or a silent difference always
fails. The same cells make docs/models.md (``scripts/models_table.py --write``).
"""

from __future__ import annotations

import re
import warnings
from functools import cache

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.adapter.mlx_lm import install_reconstruction, method_caps, probe_model
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.cache.sliding import SlidingCache, sliding_mode
from veloxquant_mlx.registry import methods
from veloxquant_mlx.testing.architectures import (
    SURVEY,
    build_tiny,
    list_model_types,
    uncatalogued_model_types,
)
from veloxquant_mlx.testing.models_table import Reference, reference, run_cell

TYPES = list_model_types()

# ---------------------------------------------------------------- expected refusals
# Facts about each model type's tiny build (docs/architecture-survey.md), none about a
# method: a method's expected refusals follow from what its class declares
# (``expected_refusal``), so a new method needs no edit here.
# mlx_lm's own cache does not run these on this CPU build (the survey says why).
NO_MLX_LM = {t for t, s in SURVEY.items() if not s.runs.startswith("yes")}
# What the model caches is not a KV cache any method takes: refused by every method.
NO_KV_CACHE = {
    **dict.fromkeys(("mamba", "mamba2", "rwkv7"), r"slots are 2 x ArraysCache\."),
    **dict.fromkeys(("baichuan_m1", "deepseek_v32", "falcon_h1", "glm_moe_dsa",
                     "longcat_flash", "longcat_flash_ngram", "minimax_m3_vl"), "CacheList"),
    "deepseek_v41": "LayerCache",
    # Its two-pass loop updates the caches itself, taking them from the cache list.
    "iquestloopcoder": "cache list rather than as an argument",
}
# Only sliding-window attention layers.
SLIDING_ONLY = {"recurrent_gemma"}
# Layers whose attention does not reach ``attend`` (see docs/models.md).
BYPASSES_ATTEND = {"afm7", "bailing_hybrid", "bailing_moe_v3", "deepseek_v3", "gemma2",
                   "gemma3n", "gemma4", "gemma4_text", "glm4_moe_lite", "gpt_oss", "kimi_k25",
                   "kimi_k3", "kimi_linear", "kimi_vl", "mistral4", "phi3small", "plamo",
                   "plamo2"}
# ... of which these compute attention by their own code (not mlx_lm's function).
ATTENTION_BY_HAND = {"gemma2", "phi3small", "plamo2"}
# The module that owns attention takes per-token arguments besides the layer input
# (hunyuan's shared kv_states): a hook on that module cannot reproduce them.
EXTRA_ATTENTION_ARGS = {"hunyuan"}
# Layers that read another layer's cache (``keys_and_values()``).
READS_OTHER_LAYERS = {"afm7", "gemma3n"}
# One attention layer in all.
ONE_LAYER = {"nemotron-nas"}


def expected_refusal(method: str, model_type: str) -> str | None:
    """The pattern of the refusal ``method`` must give on ``model_type``, or ``None``:
    from the model's facts above and the capabilities the method's class declares."""
    cls = methods()[method]
    caps = method_caps(cls)
    attends, rebuilds, hooks = caps.attends, caps.rebuilds, caps.hooks
    if model_type in NO_KV_CACHE:
        return NO_KV_CACHE[model_type]
    if model_type in SLIDING_ONLY and sliding_mode(cls, RotatingKVCache(max_size=8)) is None:
        return r"RotatingKVCache\."  # it leaves sliding-window layers to mlx_lm
    if hooks and model_type in EXTRA_ATTENTION_ARGS:
        return "takes kv_states besides its input"
    if hooks and not rebuilds and model_type in READS_OTHER_LAYERS:
        return "cannot rebuild the keys and values"
    if attends and not rebuilds and not hooks and model_type in BYPASSES_ATTEND:
        return "attends over its own compressed form only"
    if caps.evicts and not hooks and model_type in ATTENTION_BY_HAND | READS_OTHER_LAYERS:
        return "evicts tokens"
    if cls.profile.min_layers > 1 and model_type in ONE_LAYER:
        return r"\blayers\b"  # the method's own words for needing more layers
    return None


# A batch of compressed caches refused on these models: the module that attends by
# itself takes per-row arguments besides its input (or returns more than one array),
# or the model reads layers' caches itself. Every method that runs, or those that
# hook the owning module (whose per-row arguments that hook cannot split).
EVERY = "every"
BATCH_REFUSED: dict[str, tuple[str, str]] = {
    "afm7": ("reads layers' caches itself", EVERY),
    "gemma3n": ("takes other per-row arguments", EVERY),
    "gemma4": ("returns tuple", EVERY),
    "gemma4_text": ("returns tuple", EVERY),
    "mistral4": ("takes other per-row arguments", EVERY),  # attn_scale, per row
    "ministral3": ("takes other per-row arguments", "hooks_module"),
}


def expected_batch_refusal(method: str, model_type: str) -> str | None:
    pattern, who = BATCH_REFUSED.get(model_type, ("", EVERY))
    if not pattern or (who != EVERY and not getattr(methods()[method].profile, who)):
        return None
    return pattern


def options(method: str) -> dict:
    cls = methods()[method]
    return {**cls.profile.lossless, **cls.profile.few_layer}


@cache
def _reference(model_type: str, dtype: mx.Dtype | None = None) -> Reference:
    return reference(model_type, dtype)


# ---------------------------------------------------------------- the matrix
def test_every_installed_model_type_is_catalogued() -> None:
    # A model type a newer mlx_lm adds has no tiny model here: add it to ARCHITECTURES
    # (and SURVEY) in veloxquant_mlx/testing/architectures.py.
    assert uncatalogued_model_types() == [], "not in the catalogue"


def test_model_facts_name_catalogued_model_types() -> None:
    facts = [NO_KV_CACHE, SLIDING_ONLY, BYPASSES_ATTEND, ATTENTION_BY_HAND, EXTRA_ATTENTION_ARGS,
             READS_OTHER_LAYERS, ONE_LAYER, BATCH_REFUSED]
    named = set().union(*map(set, facts))
    assert named <= set(TYPES) and not named & NO_MLX_LM


@pytest.mark.parametrize("model_type", TYPES)
def test_architecture(model_type: str, method: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dense-view notice, once per model
        ref = None if model_type in NO_MLX_LM else _reference(model_type)
        cell = run_cell(model_type, method, options(method), ref)
    where = f"{model_type} / {method}: {cell.status}: {cell.reason} {cell.checks}"
    assert cell.status not in ("crash", "diff"), where
    want = expected_refusal(method, model_type)
    if model_type in NO_MLX_LM:
        assert cell.status == "n/a", where
    elif want is None:
        assert cell.status == "supported", where
    else:
        assert cell.status == "refused" and re.search(want, cell.reason), where
    batch = cell.checks.get("batch", "")
    pattern = expected_batch_refusal(method, model_type)
    if pattern and cell.status == "supported":
        assert batch.startswith("refused") and pattern in batch, where
    else:
        assert not batch.startswith("refused"), where


# The dtype axis: the precisions users run, on architectures whose attention differs
# (plain; sliding and global layers with q/k norms; fused QKV). mlx_lm's mixtures of
# experts gather in float32 only on this CPU build.
DTYPE_TYPES = ["llama", "gemma3_text", "phi3"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("model_type", DTYPE_TYPES)
def test_architecture_in_16_bits(model_type: str, dtype: str, method: str) -> None:
    """Every method in a 16-bit tiny model against mlx_lm's caches in the same dtype,
    within the table's bound plus the dtype's rounding (``models_table.ROUNDING``);
    logits must stay finite (a non-finite one is a diff)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = _reference(model_type, getattr(mx, dtype))
        cell = run_cell(model_type, method, options(method), ref)
    where = f"{model_type} / {method} / {dtype}: {cell.status}: {cell.reason} {cell.checks}"
    assert cell.status == "supported", where
    assert mx.isfinite(ref.prefill).all().item() and mx.isfinite(ref.decode).all().item()


# ---------------------------------------------------------------- the mechanisms
def _prefill(model, caches, tokens) -> mx.array:
    """Every position's logits, the prompt in fixed chunks of 16."""
    return prefill(model, caches, tokens, 16, last_alone=False, all_logits=True)


# Methods with a dense reconstruction of their own form (not a hook on the module).
RECONSTRUCTING = [m for m, cls in methods().items()
                  if method_caps(cls).rebuilds and not method_caps(cls).hooks]


@pytest.mark.parametrize("method", RECONSTRUCTING)
def test_dense_view_gives_what_attend_gives(method: str) -> None:
    """A layer served a transient dense reconstruction attends as ``attend`` would, at
    settings that compress, evict and merge within the prompt."""
    model = build_tiny("llama", wide=True)
    cls = methods()[method]
    cfg = KVCacheConfig(method, **{**cls.profile.small, **cls.profile.few_layer})
    tokens = [(i * 37 + 11) % 200 + 1 for i in range(56)]
    want = _prefill(model, KVCacheBuilder.for_model(model, cfg), tokens)
    caches = KVCacheBuilder.for_model(model, cfg)
    install_reconstruction([p.owner for p in probe_model(model)])
    got = _prefill(model, caches, tokens)
    KVCacheBuilder.detach(model)
    assert (mx.abs(got - want).max() / mx.abs(want).max()).item() < 1e-4, method


def _hybrid(window: int = 32):
    return build_tiny("gemma3_text", wide=True,
                      overrides={"sliding_window": window, "num_hidden_layers": 4})


@pytest.mark.parametrize("method,opts,bound", [
    ("affine", dict(bits=8, group_size=32), 0.3),
    ("kivi", dict(bits=4, group_size=32, window=32), None),
    ("streaming", dict(window=1000), 0.02),
])
def test_sliding_layers_compress_and_attend_over_their_window(method, opts, bound) -> None:
    """Gemma-style local layers over 160 tokens and a window of 32: held tokens stay
    bounded by the window, fewer bytes than mlx_lm's ring, and dropping the old tokens
    changes nothing (the same cache that never drops gives the same logits). Against
    mlx_lm: StreamingLLM within float16 rounding; 8-bit codes on this random model
    (whose 4 gemma layers amplify any error) move its logits by up to ~0.2, 4-bit KIVI
    by more: quantization, not the ring, as the never-dropping twin shows."""
    model = _hybrid()
    tokens = [(i * 29 + 7) % 250 + 1 for i in range(160)]
    own = make_prompt_cache(model)
    want = _prefill(model, own, tokens)
    cfg = KVCacheConfig(method, **opts)
    caches = KVCacheBuilder.for_model(model, cfg)
    got = _prefill(model, caches, tokens)
    if bound is not None:
        assert (mx.abs(got - want).max() / mx.abs(want).max()).item() < bound
    sliding = [(c, o) for c, o in zip(caches, own) if isinstance(o, RotatingKVCache)]
    assert sliding and all(c is not o for c, o in sliding)
    for c, o in sliding:
        held = c.inner.offset if isinstance(c, SlidingCache) else c.stored.tokens()[0]
        assert held <= 32 + 32 + 16  # window + rebuild block + chunk, not 160
        assert c.nbytes < o.nbytes * (0.6 if method != "streaming" else 0.51)
    if method != "streaming":
        never = KVCacheBuilder.for_model(model, cfg)
        for c in never:
            if isinstance(c, SlidingCache):
                c.block = 10 ** 9
        same = _prefill(model, never, tokens)
        # Equal up to float sums over more (masked) keys: at a few positions that moves a
        # 4-bit code across a rounding boundary, which this model amplifies (up to ~0.07);
        # a ring that kept the wrong tokens is off by ~0.2 at every position after it.
        per_pos = mx.abs(same - got).max(axis=-1)[0] / mx.abs(got).max()
        assert per_pos.max().item() < 0.1
        assert (per_pos < 1e-3).mean().item() > 0.8
        assert all(c.start > 0 for c in caches if isinstance(c, SlidingCache))
    KVCacheBuilder.detach(model)


@pytest.mark.parametrize("method,opts", [
    ("affine", dict(bits=4, group_size=32, window=3)),
    ("kivi", dict(bits=2, group_size=32, window=32)),
])
def test_a_ring_drops_old_tokens_exactly(method: str, opts: dict) -> None:
    """The ring's inner cache, rebuilt from its sliced saved state, holds exactly the
    codes a cache that never drops holds for the same tokens, and attends alike."""
    from veloxquant_mlx.cache.base import LayerInfo
    from veloxquant_mlx.registry import get_method

    cfg = KVCacheConfig(method, **opts)
    info = LayerInfo(n_kv_heads=2, head_dim=32, sliding_window=40)
    ring = SlidingCache(get_method(method), cfg, info)
    twin = SlidingCache(get_method(method), cfg, info)
    twin.block = 10 ** 9
    for step, n in enumerate([37, 1, 1, 50, 1, 29, 1, 1]):
        k, v = mx.random.normal((2, 1, 2, n, 32), key=mx.random.key(step))
        q = mx.random.normal((1, 4, n, 32), key=mx.random.key(100 + step))
        outs = []
        for c in (ring, twin):
            c.update_and_fetch(k, v)
            outs.append(c.attend(q, scale=0.2, mask="causal" if n > 1 else None))
        assert mx.allclose(outs[0], outs[1], atol=1e-5).item(), step
    assert ring.start > 0 and ring.inner.offset < twin.inner.offset
    got, want = ring.inner.keys_and_values(), twin.inner.keys_and_values()
    for a, b in zip(got, want):
        assert mx.array_equal(a, b[:, :, ring.start:]).item()


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
@pytest.mark.parametrize("method", ["xquant", "xquant_cl"])
def test_xquant_matches_dense_at_8_bits(model_type: str, method: str) -> None:
    """XQuant through the model's own projections and norms (q/k norms of Qwen 3, Gemma
    3's scaled norms and local layers) gives mlx_lm's logits at 8 bits."""
    model = build_tiny(model_type, wide=True,
                       overrides={"num_hidden_layers": 4} if model_type == "qwen3" else
                       {"num_hidden_layers": 4, "sliding_window": 8})
    tokens = [(i * 37 + 11) % 200 + 1 for i in range(48)]
    want = _prefill(model, make_prompt_cache(model), tokens)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method, bits=8, group_size=32))
    got = _prefill(model, caches, tokens)
    KVCacheBuilder.detach(model)
    assert (mx.abs(got - want).max() / mx.abs(want).max()).item() < 0.05  # lossless
    xs = [c for c in caches if getattr(c, "method", "") == method]
    assert len(xs) == (4 if model_type == "qwen3" else 2)
    assert all(type(c.proj).__name__ == "GenericXPath" for c in xs)


def test_cross_layer_groups_skip_other_kinds_and_shapes() -> None:
    # qwen3_next: a recurrent layer, then attention; four layers give attention 1 and 3.
    model = build_tiny("qwen3_next", wide=True, all_experts=True,
                       overrides={"num_hidden_layers": 4})
    xkv = KVCacheBuilder.for_model(model, KVCacheConfig("xkv", group_layers=2))
    members = [c.layer for c in xkv if getattr(c, "method", "") == "xkv"]
    assert [(i.layer_idx, i.group_id, i.member_idx) for i in members] == [(1, 0, 0),
                                                                           (3, 0, 1)]
    mc = KVCacheBuilder.for_model(model, KVCacheConfig("minicache", start_layer=0))
    pair = [c.layer for c in mc if getattr(c, "method", "") == "minicache"]
    assert [(i.layer_idx, i.group_size) for i in pair] == [(1, 2), (3, 2)]
    KVCacheBuilder.detach(model)
    # gemma4_text: global layers with head_dim 64, local ones 32: never one group.
    model = build_tiny("gemma4_text", wide=True)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig("xkv", group_layers=4))
    groups = {}
    for c in caches:
        if getattr(c, "method", "") == "xkv":
            groups.setdefault(c.layer.group_id, set()).add(c.layer.head_dim)
    assert all(len(dims) == 1 for dims in groups.values())
    KVCacheBuilder.detach(model)
