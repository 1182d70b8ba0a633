"""XQuant / XQuant-CL: the X hook, the caches, the coordinator, and bad input."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import prefill, prefill_then_decode
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.adapter.builder import KVCacheBuilder, cache_stats
from veloxquant_mlx.cache.layer_inputs import CrossLayerDeltas, LayerInputForm
from veloxquant_mlx.cache.step_cost import layer_stats
from veloxquant_mlx.cache.xquant import (
    XQuantCache,
    XQuantCLCache,
    install_x_hook,
    uninstall_x_hook,
    x_hook_installed,
)
from veloxquant_mlx.cache.xquant_coordinator import XQuantCoordinator
from veloxquant_mlx.cache.xquant_hook import _rope_run
from veloxquant_mlx.config import ConfigError, KVCacheConfig
from veloxquant_mlx.memory import transient_peak
from veloxquant_mlx.ops import factors as fr
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops import rope
from veloxquant_mlx.testing.tiny import tiny_model


def hook(model, latent: bool = True):
    """Install the X hook on every attention layer of ``model``."""
    return install_x_hook([i for i in KVCacheBuilder.layer_infos(model) if i is not None],
                          latent)


def stored_bytes(caches) -> int:
    """Bytes of the per-token storage (without the hook's fixed projection factors)."""
    return sum(a.nbytes for c in caches for a in c.stored.arrays())


def _rel_err(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


@pytest.fixture
def llama():
    model = tiny_model("llama")
    yield model
    uninstall_x_hook(model)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("method", ["xquant", "xquant_cl"])
def test_8bit_close_to_dense_and_2bit_is_not(model_type, method):
    model = tiny_model(model_type)  # mistral: mlx_lm's llama module
    tokens = mx.random.randint(0, 128, (2, 24), key=mx.random.key(1))
    ref = model(tokens, cache=make_prompt_cache(model))
    errs = {}
    for bits in (8, 2):
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, bits=bits))
        errs[bits] = _rel_err(prefill_then_decode(model, caches, tokens, 9), ref)
    uninstall_x_hook(model)
    assert errs[8] < 0.02
    assert errs[2] > 5 * errs[8]


def test_held_matches_accounted_and_no_full_size_copy(llama):
    tokens = mx.random.randint(0, 128, (2, 70), key=mx.random.key(2))
    for cfg in (KVCacheConfig(method="xquant", bits=4, window=8),
                KVCacheConfig(method="xquant_cl", bits=3)):
        caches = KVCacheBuilder.for_model(llama, cfg)
        prefill_then_decode(llama, caches, tokens, 40)
        for c in caches:
            s = layer_stats(c)
            assert s["tokens"] == 70
            assert abs(s["held_bytes"] - s["accounted_bytes"]) <= 0.05 * s["accounted_bytes"]
            # Only uint32 codes, fp16 scales/biases and the small window are held.
            for a in c.stored.arrays():
                assert a.dtype in (mx.uint32, mx.float16)
        st = cache_stats(caches)
        assert st["held_bytes"] < 0.6 * st["fp16_bytes"]


def test_window_keeps_recent_tokens_in_full_precision(llama):
    tokens = mx.random.randint(0, 128, (1, 30), key=mx.random.key(3))
    caches = KVCacheBuilder.for_model(llama, KVCacheConfig(method="xquant", window=8))
    prefill_then_decode(llama, caches, tokens, 20)
    c = caches[0]
    assert c.stored.n_recent == 8 and c.stored.codes[0].qt.codes.shape[1] == 22
    ref = llama(tokens, cache=make_prompt_cache(llama))
    err_w = _rel_err(prefill_then_decode(llama, KVCacheBuilder.for_model(
        llama, KVCacheConfig(method="xquant", bits=2, window=32)), tokens, 20), ref)
    err_q = _rel_err(prefill_then_decode(llama, KVCacheBuilder.for_model(
        llama, KVCacheConfig(method="xquant", bits=2, window=0)), tokens, 20), ref)
    assert err_w < 1e-3 < err_q  # everything inside the window: exact up to fp16


def test_latent_space_for_gqa():
    # 1 KV head x 32: K and V together (64) are narrower than X (128).
    model = tiny_model("llama", num_key_value_heads=1)
    tokens = mx.random.randint(0, 128, (1, 20), key=mx.random.key(4))
    ref = model(tokens, cache=make_prompt_cache(model))
    lat = KVCacheBuilder.for_model(model, KVCacheConfig(method="xquant", bits=8, group_size=32))
    err_lat = _rel_err(prefill_then_decode(model, lat, tokens, 8), ref)
    assert lat[0].widths == (32, 32)
    # Building again with other options re-hooks: XQuant-CL works on the full X.
    cl = KVCacheBuilder.for_model(model, KVCacheConfig(method="xquant_cl", group_size=32))
    assert cl[0].widths == (128,)
    uninstall_x_hook(model)
    full = KVCacheBuilder.for_model(model, KVCacheConfig(method="xquant", bits=8, group_size=32,
                                                         latent=False))
    prefill_then_decode(model, full, tokens, 8)
    uninstall_x_hook(model)
    assert full[0].widths == (128,)
    assert err_lat < 0.02
    # Per token the latents hold half of what X takes; the hook's projection factors
    # (V and S of each stream, 2 x (32 x 32 + 32) float32 per layer) are counted apart.
    assert stored_bytes(lat) < 0.6 * stored_bytes(full)
    assert all(sum(a.nbytes for a in c.shared_arrays()) == 2 * (32 * 32 + 32) * 4
               for c in lat)
    assert all(not c.shared_arrays() for c in full)  # views of the model's weights


def test_two_settings_on_one_model_each_attend_their_own_form():
    # Caches built later with another setting re-hook the model (latents against the full
    # X); the earlier caches keep reading their own stored form, step by step in turn.
    model = tiny_model("llama", num_key_value_heads=1)
    tokens = mx.random.randint(0, 128, (1, 20), key=mx.random.key(14))
    configs = [KVCacheConfig(method="xquant", bits=8, group_size=32),
               KVCacheConfig(method="xquant_cl", group_size=32)]
    alone = []
    for config in configs:
        alone.append(prefill_then_decode(model, KVCacheBuilder.for_model(model, config),
                                         tokens, 8))
        uninstall_x_hook(model)
    both = [KVCacheBuilder.for_model(model, config) for config in configs]
    assert both[0][0].widths == (32, 32) and both[1][0].widths == (128,)
    outs = [[prefill(model, c, tokens[:, :8], 8, last_alone=False, all_logits=True)]
            for c in both]
    for t in range(8, tokens.shape[1]):
        for out, caches in zip(outs, both):
            out.append(model(tokens[:, t:t + 1], cache=caches))
    uninstall_x_hook(model)
    for out, ref in zip(outs, alone):
        assert _rel_err(mx.concatenate(out, axis=1), ref) < 1e-5


def test_hook_is_reversible_and_falls_through(llama):
    tokens = mx.random.randint(0, 128, (1, 12), key=mx.random.key(5))
    cls = type(llama.layers[0].self_attn)
    ref = llama(tokens, cache=make_prompt_cache(llama))
    params = sorted(llama.layers[0].self_attn.parameters())
    hook(llama)
    assert x_hook_installed(llama) and type(llama.layers[0].self_attn) is not cls
    # Plain KVCache: the hooked layers run the original attention.
    assert mx.array_equal(llama(tokens, cache=make_prompt_cache(llama)), ref).item()
    assert sorted(llama.layers[0].self_attn.parameters()) == params  # weights untouched
    XQuantCache.profile.detach(llama)
    assert not x_hook_installed(llama) and type(llama.layers[0].self_attn) is cls
    assert mx.array_equal(llama(tokens, cache=make_prompt_cache(llama)), ref).item()


def test_without_hook_is_a_clear_error(llama):
    caches = KVCacheBuilder.for_model(llama, KVCacheConfig(method="xquant"))
    uninstall_x_hook(llama)
    with pytest.raises(RuntimeError, match="X hook is not installed"):
        llama(mx.array([[1, 2, 3]]), cache=caches)


def test_trim_and_state_roundtrip(llama):
    tokens = mx.random.randint(0, 128, (1, 30), key=mx.random.key(6))
    caches = KVCacheBuilder.for_model(llama, KVCacheConfig(method="xquant", window=4))
    prefill_then_decode(llama, caches, tokens, 20)
    c = caches[1]
    clone = XQuantCache(c.config, c.layer)
    clone.state, clone.meta_state = c.state, c.meta_state
    assert clone.offset == 30 and clone.nbytes == c.nbytes and clone.stored.n_recent == 4
    assert c.trim(6) == 6 and c.offset == 24 and c.stored.n_recent == 0
    assert c.stored.codes[0].qt.codes.shape[1] == 24


@pytest.mark.parametrize("method,kwargs", [("xquant", {}), ("xquant", {"window": 8}),
                                           ("xquant", {"latent": False}),
                                           ("xquant_cl", {})])
@pytest.mark.parametrize("cut", [3, 10])
def test_trim_continues_as_a_fresh_cache(llama, method, kwargs, cut):
    """Each token's X (or latents, or CL delta) is coded on its own: dropping the last
    tokens leaves the others' codes (and window) as they were. Without a window the
    cache then goes on exactly as one that only saw the kept tokens, fed the same way
    (a chunk of 20, then one at a time); with one, the kept tokens stay as held (those
    that had left the window stay coded, where a fresh cache would hold them in it)."""
    tokens = mx.random.randint(0, 128, (1, 40), key=mx.random.key(7))
    cfg = KVCacheConfig(method=method, **kwargs)
    caches = KVCacheBuilder.for_model(llama, cfg)
    prefill_then_decode(llama, caches, tokens[:, :30], 20)
    held = [c.stored.arrays() for c in caches]
    dense = [c.keys_and_values() for c in caches] if method == "xquant" else None
    assert all(c.is_trimmable() and c.trim(cut) == cut for c in caches)
    keep = 30 - cut
    for i, (c, before) in enumerate(zip(caches, held)):
        after = c.stored.arrays()
        assert c.offset == keep and sum(a.nbytes for a in after) < sum(a.nbytes for a in before)
        codes = c.stored.codes[0].qt.codes
        assert mx.array_equal(codes, before[0][:, :codes.shape[1]]).item()
        if dense is not None:
            # Rebuilt from the same codes; a matmul over fewer rows may round differently.
            k, v = c.keys_and_values()
            assert mx.allclose(k, dense[i][0][:, :, :keep], rtol=1e-6, atol=1e-6).item()
            assert mx.allclose(v, dense[i][1][:, :, :keep], rtol=1e-6, atol=1e-6).item()
    st = cache_stats(caches)
    assert st["held_bytes"] == st["accounted_bytes"]
    if kwargs.get("window"):
        return
    fresh = KVCacheBuilder.for_model(llama, cfg)
    prefill_then_decode(llama, fresh, tokens[:, :keep], 20)
    more = tokens[:, 30:]
    assert _rel_err(prefill_then_decode(llama, caches, more, 1),
                    prefill_then_decode(llama, fresh, more, 1)) < 1e-4


def test_unsupported_architecture_is_a_clear_error():
    from veloxquant_mlx.testing.architectures import build_tiny

    # hunyuan's attention also reads another layer's kv_states, which the cached input
    # of this layer cannot reproduce.
    model = build_tiny("hunyuan", wide=True)
    with pytest.raises(ValueError, match="XQuant cannot rebuild.*kv_states"):
        KVCacheBuilder.for_model(model, KVCacheConfig(method="xquant"))


@pytest.mark.parametrize("method,kwargs,field", [
    ("xquant", {"bits": 7}, "bits"), ("xquant", {"bits": 1}, "bits"),
    ("xquant", {"group_size": 48}, "group_size"), ("xquant", {"window": -1}, "window"),
    ("xquant", {"latent": "yes"}, "latent"), ("xquant_cl", {"bits": 7}, "bits"),
    ("xquant_cl", {"group_size": 48}, "group_size"),
    ("xquant_cl", {"xquant_anchor_bits": 9}, "anchor_bits"),
])
def test_bad_config_names_the_field(method, kwargs, field):
    with pytest.raises(ConfigError, match=f"{method}.{field}="):
        KVCacheConfig(method=method, **kwargs)


def test_cl_window_and_group_size_errors(llama):
    # Deltas chain every token through all layers: XQuant-CL has no window.
    with pytest.raises(ConfigError, match="unknown option 'window' for method 'xquant_cl'"):
        KVCacheConfig(method="xquant_cl", window=8)
    # hidden 128 is fine with 128; a latent of 32 per K/V is not.
    model = tiny_model("llama", num_key_value_heads=1)
    with pytest.raises(ConfigError, match="xquant.group_size=64"):
        KVCacheBuilder.for_model(model, KVCacheConfig(method="xquant", group_size=64))
    assert not x_hook_installed(model)  # a failed build leaves the model as it was


def test_cl_roles_and_anchor_bits(llama):
    caches = KVCacheBuilder.for_model(llama, KVCacheConfig(method="xquant_cl", bits=2,
                                                           xquant_anchor_bits=8))
    assert all(isinstance(c, XQuantCLCache) for c in caches)
    coord = caches[0].coordinator
    assert all(c.coordinator is coord for c in caches)
    assert [c.is_anchor for c in caches] == [True, False, False, False]
    assert caches[0].n_bits == 8 and caches[1].n_bits == 2
    llama(mx.array([[1, 2, 3, 4]]), cache=caches)
    assert coord._x is None  # the transient accumulator is dropped after the last layer


# ---------------------------------------------------------------- coordinator
def test_coordinator_publish_read_pass_on():
    c = XQuantCoordinator()
    c.set_anchor(0)
    c.last_layer = 2
    x0 = mx.ones((1, 5, 8))
    c.publish(0, 3, 5, x0)
    assert c.read(1, 3, 5) is x0
    x1 = x0 * 2
    c.pass_on(1, x1)
    assert c.read(2, 3, 5) is x1
    c.pass_on(2, x1 + 1)
    with pytest.raises(ValueError, match="before the anchor layer 0 published"):
        c.read(1, 5, 6)


def test_coordinator_errors():
    c = XQuantCoordinator()
    with pytest.raises(ValueError, match="no anchor layer"):
        c.publish(0, 0, 2, mx.ones((1, 2, 4)))
    c.set_anchor(0)
    c.set_anchor(0)  # the same anchor again is fine
    with pytest.raises(ValueError, match="second anchor"):
        c.set_anchor(3)
    with pytest.raises(ValueError, match="before the anchor"):
        c.read(1, 0, 2)
    with pytest.raises(ValueError, match="only the anchor layer 0 publishes"):
        c.publish(1, 0, 2, mx.ones((1, 2, 4)))
    with pytest.raises(ValueError, match=r"expected \[B, 2, D\]"):
        c.publish(0, 0, 2, mx.ones((1, 3, 4)))
    c.publish(0, 0, 2, mx.ones((1, 2, 4)))
    with pytest.raises(ValueError, match=r"reads tokens \[0, 3\) but tokens \[0, 2\)"):
        c.read(1, 0, 3)
    with pytest.raises(ValueError, match="model order"):
        c.read(0, 0, 2)


# ---------------------------------------------------------------- real model
@pytest.mark.slow
@pytest.mark.parametrize("method", ["xquant", "xquant_cl"])
def test_paris_on_embedded_model(method):
    from mlx_lm import generate

    from veloxquant_mlx.models import load

    model, tokenizer = load()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False,
    )
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method))
    try:
        text = generate(model, tokenizer, prompt, max_tokens=16, prompt_cache=caches)
    finally:
        uninstall_x_hook(model)
    assert "Paris" in text
    st = cache_stats(caches)
    assert stored_bytes(caches) < 0.5 * st["fp16_bytes"]


# ---------------------------------------------------------------- decode path and batches
@pytest.mark.parametrize("model_type,latent", [("llama", False), ("qwen2", False),
                                               ("llama", True)])
def test_factored_values_match_rematerialized(model_type, latent):
    """``(P Z) R_v + b_v`` equals ``P (Z R_v + b_v)`` for every mask kind."""
    kw = {"num_key_value_heads": 1} if latent else {}
    model = tiny_model(model_type, **kw)
    attn = model.layers[1].self_attn
    projs = hook(model, latent=latent)
    proj = projs[1]
    assert proj.latent == latent
    if model_type == "qwen2":
        assert proj.bv is not None  # the bias path is exercised
    H, D = attn.n_heads, 128 // attn.n_heads
    S = 19
    parts = proj.encode(mx.random.normal((2, S, 128), key=mx.random.key(7)))
    keys = attn.rope(proj.keys(parts))
    ref_v = proj.values(parts)
    arr = mx.random.uniform(shape=(3, S), key=mx.random.key(9)) > 0.3
    arr[:, -1] = True
    for L, mask in ((1, None), (3, "causal"), (3, arr), (3, mx.where(arr, 0.0, -1e9))):
        q = mx.random.normal((2, H, L, D), key=mx.random.key(8))
        assert proj.factored_pays(H * L)
        ref = mx.fast.scaled_dot_product_attention(q, keys, ref_v, scale=0.3, mask=mask)
        out = proj.attend(q, [(0, parts)], 0.3, mask)
        assert mx.allclose(out, ref, atol=1e-5).item(), (L, mask)
        # Held as segments (coded tokens, window, chunk): keys rotated per segment.
        split = [(a, [p[:, a:b] for p in parts]) for a, b in ((0, 7), (7, 16), (16, S))]
        assert mx.allclose(proj.attend(q, split, 0.3, mask), ref, atol=1e-5).item()
    # Long prefill chunks rematerialize V (with one KV head the factor always pays).
    assert proj.factored_pays(H * 512) == latent
    uninstall_x_hook(model)


# ---------------------------------------------------------------- prompt chunks in key blocks
def _held(proj, n: int, chunk: int, window: int = 40) -> list:
    """Segments of ``n`` coded tokens, a float window and a chunk's exact form."""
    x = mx.random.normal((1, n + window + chunk, proj.in_dim), key=mx.random.key(n))
    coded = [q.quantize(p, 4, 32) for p in proj.encode(x[:, :n])]
    segments = [(0, coded), (n, proj.encode(x[:, n:n + window])),
                (n + window, proj.encode(x[:, n + window:]))]
    mx.eval([c.arrays for c in coded], segments[1:])
    return segments


@pytest.mark.parametrize("latent", [False, True])
def test_prompt_chunk_attends_in_key_blocks(latent):
    """A prompt chunk over coded tokens, a window and itself runs the blocked path (the
    values rebuilt, or in factor space where that pays) and matches attention over every
    held token's rematerialized keys and values; its transient peak does not grow with
    the held tokens: no key or value of all of them exists at once."""
    model = tiny_model("llama", **({"num_key_value_heads": 1} if latent else {}))
    attn = model.layers[1].self_attn
    proj = hook(model, latent=latent)[1]
    assert proj.latent == latent
    L, H, D = 256, attn.n_heads, 128 // attn.n_heads
    queries = mx.random.normal((1, H, L, D), key=mx.random.key(3))
    segments = _held(proj, 700, L)
    assert proj._in_blocks(queries, segments)
    assert proj.factored_pays(H * L) == latent
    dense = [(s, [fr.load_rows(p) for p in parts]) for s, parts in segments]
    keys = mx.concatenate([rope.apply(attn.rope, proj.keys(p), s) for s, p in dense], axis=2)
    values = mx.concatenate([proj.values(p) for _, p in dense], axis=2)
    ref = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.2,
                                               mask="causal")
    out = proj.attend(queries, segments, 0.2, "causal")
    assert mx.allclose(out, ref, atol=2e-5).item()
    peaks = {}
    for n in (1024, 4096):
        held = _held(proj, n, L)
        peaks[n] = transient_peak(lambda h=held: proj.attend(queries, h, 0.2, "causal"))
    # One float32 copy of the extra tokens' keys is more than the blocks may grow by.
    assert peaks[4096] - peaks[1024] < 4 * 3072 * attn.n_kv_heads * D, peaks
    uninstall_x_hook(model)


@pytest.mark.parametrize("n", [40, 300, 1000])
def test_blocks_are_rotated_as_the_whole_segment(n):
    """Keys rotated a block at a time are bit for bit those rotated over the whole
    segment: RoPE's path and its grid of angles depend on a run's length and start,
    and the run rotated for a block is chosen to match (a block rotated on its own is
    not, past 64 tokens)."""
    module = nn.RoPE(32, base=10000)
    k = mx.random.normal((1, 2, n, 32), key=mx.random.key(n))
    whole = rope.apply(module, k, 17)
    for a, b in [(0, 5), (3, 70), (100, 130), (n - 7, n), (512, 1000)]:
        if b > n:
            continue
        lo, hi = _rope_run(a, b, n)
        assert lo <= a and b <= hi <= n
        block = rope.apply(module, k[:, :, lo:hi], 17 + lo)[:, :, a - lo:b - lo]
        assert mx.array_equal(block, whole[:, :, a:b]).item(), (a, b)


def test_no_transient_is_left_behind(llama):
    caches = KVCacheBuilder.for_model(llama, KVCacheConfig(method="xquant_cl", bits=4))
    prefill_then_decode(llama, caches,
                        mx.random.randint(0, 128, (1, 12), key=mx.random.key(10)), 8)
    # Neither the projections nor the coordinator keep the residual stream around.
    assert all(b.self_attn._xquant.residual is None for b in llama.layers)
    assert caches[0].coordinator._x is None


@pytest.mark.parametrize("method", ["xquant", "xquant_cl"])
def test_batched_rows_match_single_sequences(llama, method):
    from veloxquant_mlx.cache.batch import BatchedCache

    cfg = KVCacheConfig(method=method, bits=4, group_size=32)
    per_seq = [KVCacheBuilder.for_model(llama, cfg) for _ in range(2)]
    batch = [BatchedCache.merge([a, b]) for a, b in zip(*per_seq)]
    for c in batch:
        c.prepare(lengths=[9, 4], right_padding=[0, 5])
    tokens = mx.array([list(range(1, 10)), [3, 4, 5, 6, 0, 0, 0, 0, 0]])
    out = llama(tokens, cache=batch)
    for c in batch:
        c.finalize()
    step = llama(mx.array([[11], [12]]), cache=batch)
    ref_a, ref_b = (KVCacheBuilder.for_model(llama, cfg) for _ in range(2))
    a0, a1 = llama(tokens[:1], cache=ref_a), llama(mx.array([[11]]), cache=ref_a)
    b0, b1 = llama(tokens[1:, :4], cache=ref_b), llama(mx.array([[12]]), cache=ref_b)
    assert mx.allclose(out[0], a0[0], atol=1e-4).item()
    assert mx.allclose(out[1, :4], b0[0], atol=1e-4).item()
    assert mx.allclose(step[0], a1[0], atol=1e-4).item()
    assert mx.allclose(step[1], b1[0], atol=1e-4).item()
    assert [c.offset for c in per_seq[1]] == [5] * 4


@pytest.mark.parametrize("cls", [XQuantCache, XQuantCLCache])
def test_tune_grid_spans_the_compression_range(cls):
    # 2 KV heads x 64 in a 512-wide model: the latent (256) is narrower than X (512).
    model = tiny_model("llama", hidden_size=512, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=64)
    tokens = mx.random.randint(0, 128, (1, 64), key=mx.random.key(11))
    ratios = []
    for opts in cls.profile.tune_grid(2048):
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(cls.method, **opts))
        model(tokens, cache=caches)
        ratios.append(stored_bytes(caches) / cache_stats(caches)["fp16_bytes"])
    uninstall_x_hook(model)
    # XQuant-CL stores the residual stream, twice as wide as K and V here (1.5x on
    # SmolLM2): its grid spans 8-bit anchor + 4-bit deltas down to 2-bit deltas.
    low, high = (0.3, 0.4) if cls is XQuantCache else (0.45, 0.65)
    assert min(ratios) < low and max(ratios) > high, ratios


@pytest.mark.parametrize("scale,dtype", [(1.0, mx.float16), (1e5, mx.float32)])
def test_values_past_float16_get_float32_scales(scale: float, dtype: mx.Dtype) -> None:
    # Gemma 3's residual stream reaches about 1e5: with float16 biases (group minima)
    # the codes decode to inf and the logits to NaN. The first values a cache codes
    # decide its scale dtype; its declared bytes follow.
    form = LayerInputForm(8, 32)
    x = mx.random.normal((1, 8, 64), key=mx.random.key(0)) * scale
    form.append([x])
    codes = form.codes[0].qt
    assert codes.scales.dtype == dtype
    back = form.rows()
    assert mx.isfinite(back).all().item()
    assert (mx.abs(back - x).max() / mx.abs(x).max()).item() < 0.01
    assert form.accounted(1) == 8 * q.quantized_bytes(64, 8, 32, dtype.size)
    # Later values keep the dtype the first ones decided (one scale dtype per layer).
    form.append([mx.ones((1, 2, 64)) * (1e5 if scale == 1.0 else 1.0)])
    assert form.codes[0].qt.scales.dtype == dtype


# ---------------------------------------------------------------- the stored form
def test_form_moves_tokens_from_window_to_codes_in_order() -> None:
    """Chunks pass through the window; what leaves it is coded, oldest first, and the
    hook reads the coded tokens as codes and the window as floats at their positions."""
    form = LayerInputForm(8, 32, window=5, window_dtype=mx.float16)
    x = mx.random.normal((2, 13, 64), key=mx.random.key(3))
    y = mx.random.normal((2, 13, 32), key=mx.random.key(4))
    for a, b in ((0, 7), (7, 8), (8, 13)):
        form.append([x[:, a:b], y[:, a:b]])
    assert (form.n_coded, form.n_recent, form.n) == (8, 5, 13)
    assert form.recent[0].x.dtype == mx.float16
    assert mx.array_equal(form.recent[1].x, y[:, 8:].astype(mx.float16)).item()
    (p0, coded), (p1, recent) = form.earlier(joined=False)
    assert (p0, p1) == (0, 8) and isinstance(coded[0], q.Quantized)
    joined = form.earlier(joined=True)
    assert [j.shape for j in joined] == [(2, 13, 64), (2, 13, 32)]
    assert mx.allclose(joined[0], x, atol=0.05).item()
    assert mx.array_equal(joined[0][:, 8:], recent[0]).item()
    # Bytes: codes with their float16 scales per token and part, the window as held.
    coded_bytes = sum(q.quantized_bytes(w, 8, 32) for w in (64, 32))
    assert form.accounted(2) == 2 * (8 * coded_bytes + 5 * 96 * 2)
    assert form.accounted(2) == sum(a.nbytes for a in form.arrays())


def test_form_state_layout_and_trim() -> None:
    """``state``: every part's code triple, then every part's window (what saved files
    hold); an empty segment is left out. Trim cuts the window first, then the codes."""
    form = LayerInputForm(4, 32, window=4)
    form.append([mx.random.normal((1, 10, 64), key=mx.random.key(5)),
                 mx.random.normal((1, 10, 32), key=mx.random.key(6))])
    st = form.state()
    assert [a.dtype for a in st] == [mx.uint32, mx.float16, mx.float16] * 2 + [mx.float32] * 2
    back = LayerInputForm(4, 32)
    back.load(st)
    assert (back.n_coded, back.n_recent) == (6, 4)
    assert all(mx.array_equal(a, b).item() for a, b in zip(back.state(), st))
    back.check(1, (64, 32), 10)
    with pytest.raises(ValueError, match="hold 10 tokens; the saved offset is 11"):
        back.check(1, (64, 32), 11)
    with pytest.raises(ValueError, match="2 stored codes parts, expected 1"):
        back.check(1, (64,), 10)
    # A front drop slices the oldest codes (never re-coded).
    codes = back.codes[1]
    codes.drop_front(2)
    assert codes.n == 4 and mx.array_equal(codes.qt.codes, st[3][:, 2:]).item()
    codes.drop_front(4)
    assert codes.n == 0 and codes.arrays() == []
    form.trim(3)
    assert (form.n_coded, form.n_recent) == (6, 1)
    form.trim(4)
    assert (form.n_coded, form.n_recent) == (3, 0) and len(form.state()) == 6
    assert mx.array_equal(form.codes[0].qt.codes, st[0][:, :3]).item()
    form.trim(3)
    assert form.n == 0 and form.state() == [] and form.arrays() == []


def test_cross_layer_deltas_decode_only_on_the_previous_reconstruction() -> None:
    form = LayerInputForm(8, 32, deltas=True)
    prev = mx.random.normal((1, 6, 64), key=mx.random.key(8))
    delta = mx.random.normal((1, 6, 64), key=mx.random.key(9)) * 0.01
    form.append([delta])
    assert isinstance(form.codes[0], CrossLayerDeltas)
    assert mx.allclose(form.rows(plus=prev), prev + delta, atol=1e-3).item()
    with pytest.raises(ValueError, match="previous layer's reconstruction"):
        form.codes[0].dense(mx.float32)
    with pytest.raises(NotImplementedError, match="X hook rebuilds"):
        form.codes[0].slot()


def test_mlx_lm_from_state_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="XQuantCache needs its config and layer"):
        XQuantCache.from_state([mx.zeros((1, 2, 4), mx.uint32)])
