"""Saving / loading compressed prompt caches, and trimming for chat reuse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from conftest import PROMPT, small_config
from conftest import run_prefill as prefill
from mlx_lm.generate import generate_step

from veloxquant_mlx import (
    KVCacheBuilder,
    KVCacheConfig,
    cache_stats,
    can_trim_prompt_cache,
    load_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from veloxquant_mlx.apps.prompt_cache import (
    NotTrimmableError,
    PromptCacheError,
    read_prompt_cache_header,
)
from veloxquant_mlx.registry import list_methods
from veloxquant_mlx.testing.tiny import tiny_model


def test_round_trip_every_method(method: str, tmp_path: Path) -> None:
    model = tiny_model("llama")
    cfg = small_config(method)
    caches = KVCacheBuilder.for_model(model, cfg)
    prefill(model, caches, PROMPT)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches, {"note": "hi"})
    loaded, meta = load_prompt_cache(path, model=model, return_metadata=True)
    assert meta == {"note": "hi"}
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    assert [c.offset for c in loaded] == [c.offset for c in caches]
    # Compressed form on disk: the saved arrays are no bigger than what is held.
    arrays = mx.load(str(path))
    saved = sum(a.nbytes for a in arrays.values())
    assert saved <= cache_stats(caches)["held_bytes"] * 1.05 + 1024
    header = read_prompt_cache_header(path)
    assert header["method"] == method and header["config"] == cfg.to_dict()
    assert header["model"]["n_layers"] == 4
    assert header["layers"][0]["class"].endswith(type(caches[0]).__name__)
    # Continuing from the loaded cache is exactly continuing from the original.
    for tok in (5, 9, 17):
        a = model(mx.array([[tok]]), cache=caches)
        b = model(mx.array([[tok]]), cache=loaded)
        assert mx.allclose(a, b, atol=1e-5).item(), method


def test_cross_layer_roles_and_fresh_coordinator(tmp_path: Path) -> None:
    names = [r["name"] for r in list_methods() if r["cross_layer"] == "yes"]
    assert names
    model = tiny_model("llama")
    for name in names:
        caches = KVCacheBuilder.for_model(model, small_config(name))
        prefill(model, caches, PROMPT)
        save_prompt_cache(tmp_path / f"{name}.safetensors", caches)
        loaded = load_prompt_cache(tmp_path / f"{name}.safetensors", model=model)
        roles = [(c.layer.group_id, c.layer.member_idx, c.layer.group_size) for c in loaded]
        assert roles == [(c.layer.group_id, c.layer.member_idx, c.layer.group_size)
                         for c in caches]
        coords = {id(c.layer.coordinator) for c in loaded if c.layer.coordinator is not None}
        old = {id(c.layer.coordinator) for c in caches if c.layer.coordinator is not None}
        assert not coords & old, f"{name}: loaded caches share the original coordinator"


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen2"])
def test_round_trip_mixed_layers(model_type: str, tmp_path: Path) -> None:
    model = tiny_model(model_type)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="affine", bits=8,
                                                           group_size=32))
    prefill(model, caches, PROMPT)
    save_prompt_cache(tmp_path / "g.safetensors", caches)
    loaded = load_prompt_cache(tmp_path / "g.safetensors", model=model)
    assert [type(c).__name__ for c in loaded] == [type(c).__name__ for c in caches]
    a = model(mx.array([[3]]), cache=caches)
    b = model(mx.array([[3]]), cache=loaded)
    assert mx.allclose(a, b, atol=1e-5).item()


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[Path, Any]:
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="affine", bits=4,
                                                           group_size=32, window=4))
    prefill(model, caches, PROMPT)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches)
    return path, model


def test_mismatched_model_is_an_error(saved: tuple[Path, Any]) -> None:
    path, _ = saved
    with pytest.raises(PromptCacheError, match="n_layers=4 in the file, 6"):
        load_prompt_cache(path, model=tiny_model("llama", num_hidden_layers=6))
    with pytest.raises(PromptCacheError, match="n_kv_heads=2 in the file, 4"):
        load_prompt_cache(path, model=tiny_model("llama", num_key_value_heads=4))


def test_truncated_file_is_an_error(saved: tuple[Path, Any], tmp_path: Path) -> None:
    path, _ = saved
    data = path.read_bytes()
    bad = tmp_path / "t.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(PromptCacheError, match="truncated or corrupt"):
        load_prompt_cache(bad)
    bad.write_bytes(b"\x00" * 7)
    with pytest.raises(PromptCacheError, match="truncated or corrupt"):
        load_prompt_cache(bad)
    with pytest.raises(FileNotFoundError):
        load_prompt_cache(tmp_path / "missing.safetensors")


def _rewrite(path: Path, out: Path, edit_header=None, edit_arrays=None) -> None:
    arrays, meta = mx.load(str(path), return_metadata=True)
    header = json.loads(meta["veloxquant"])
    if edit_header:
        edit_header(header)
    if edit_arrays:
        edit_arrays(arrays)
    mx.save_safetensors(str(out), arrays, {"veloxquant": json.dumps(header)})


def test_corrupt_contents_are_errors(saved: tuple[Path, Any], tmp_path: Path) -> None:
    path, model = saved
    out = tmp_path / "x.safetensors"
    first = next(iter(mx.load(str(path))))

    _rewrite(path, out, edit_arrays=lambda a: a.pop(first))
    with pytest.raises(PromptCacheError, match="missing from the file"):
        load_prompt_cache(out, model=model)

    def reshape(a):
        a[first] = a[first][:, :, :1]
    _rewrite(path, out, edit_arrays=reshape)
    with pytest.raises(PromptCacheError, match="the header says"):
        load_prompt_cache(out, model=model)

    def flip(a):
        a[first] = a[first] + 1
    _rewrite(path, out, edit_arrays=flip)
    with pytest.raises(PromptCacheError, match="checksum"):
        load_prompt_cache(out, model=model)

    _rewrite(path, out, edit_header=lambda h: h.update(format_version=99))
    with pytest.raises(PromptCacheError, match="format version 99"):
        load_prompt_cache(out)

    _rewrite(path, out, edit_header=lambda h: h.pop("layers"))
    with pytest.raises(PromptCacheError, match="malformed header"):
        load_prompt_cache(out)

    arrays, _ = mx.load(str(path), return_metadata=True)
    mx.save_safetensors(str(out), arrays, {"veloxquant": "{not json"})
    with pytest.raises(PromptCacheError, match="corrupt header"):
        load_prompt_cache(out)
    mx.save_safetensors(str(out), arrays)
    with pytest.raises(PromptCacheError, match="not a veloxquant prompt cache"):
        load_prompt_cache(out)


def test_save_without_compressed_layers_is_an_error(tmp_path: Path) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    with pytest.raises(ValueError, match="no veloxquant cache"):
        save_prompt_cache(tmp_path / "x.safetensors", make_prompt_cache(tiny_model()))


# ---------------------------------------------------------------- trimming
def greedy(model: Any, caches: list[Any], prompt: list[int], n: int) -> list[int]:
    out = []
    for (tok, _), _ in zip(generate_step(mx.array(prompt), model, prompt_cache=caches,
                                         max_tokens=n), range(n)):
        out.append(int(tok))
    return out


@pytest.mark.parametrize("cfg", [dict(method="none"),
                                 dict(method="affine", bits=8, group_size=32),
                                 dict(method="affine", bits=8, group_size=32, window=6)])
def test_trim(cfg: dict) -> None:
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(**cfg))
    prefill(model, caches, PROMPT)
    assert can_trim_prompt_cache(caches)
    held = cache_stats(caches)["held_bytes"]
    assert trim_prompt_cache(caches, 15) == 15
    assert all(c.offset == len(PROMPT) - 15 for c in caches)
    if cfg["method"] == "affine":
        assert cache_stats(caches)["held_bytes"] < held
    # The trimmed cache continues exactly as a fresh prefill of the kept tokens.
    fresh = KVCacheBuilder.for_model(model, KVCacheConfig(**cfg))
    prefill(model, fresh, PROMPT[:-15])
    a = model(mx.array([[7]]), cache=caches)
    b = model(mx.array([[7]]), cache=fresh)
    # Dense: exact; 8-bit codes: chunking changes float rounding, so a code may flip.
    tol = 1e-4 if cfg["method"] == "none" else 1e-2
    assert mx.allclose(a, b, atol=tol).item()
    assert trim_prompt_cache(caches, 10**6) == len(PROMPT) - 15 + 1
    with pytest.raises(ValueError, match="num_tokens=-1"):
        trim_prompt_cache(caches, -1)


def test_not_trimmable_is_a_clear_error(method: str) -> None:
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, small_config(method))
    prefill(model, caches, PROMPT)
    if can_trim_prompt_cache(caches):
        assert trim_prompt_cache(caches, 1) == 1
        return
    with pytest.raises(NotTrimmableError, match="not trimmable"):
        trim_prompt_cache(caches, 1)


@pytest.mark.parametrize("cfg", [dict(method="none"),
                                 dict(method="affine", bits=8, group_size=32)])
def test_two_turn_chat_reuses_the_cache(cfg: dict) -> None:
    model = tiny_model("llama", seed=3)
    config = KVCacheConfig(**cfg)
    turn1 = PROMPT[:24]
    cache = KVCacheBuilder.for_model(model, config)
    reply1 = greedy(model, cache, turn1, 6)
    # generate_step runs one step ahead, so the cache holds the whole reply.
    cached = (turn1 + reply1)[:cache[0].offset]
    assert len(cached) >= len(turn1) + len(reply1) - 1
    # Turn 2 re-renders the history with a different tail (like a chat template
    # dropping the last reply token), then adds the new user message.
    turn2 = turn1 + reply1[:3] + [60, 61, 62, 63, 64]
    common = next((i for i, (a, b) in enumerate(zip(cached, turn2)) if a != b),
                  min(len(cached), len(turn2)))
    trim_prompt_cache(cache, len(cached) - common)
    reused = greedy(model, cache, turn2[common:], 6)
    fresh = greedy(model, KVCacheBuilder.for_model(model, config), turn2, 6)
    assert reused == fresh
