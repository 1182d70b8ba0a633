"""The cache contract, checked for every registered method (new methods included).

One test per method walks the whole life of its caches on a tiny model: build from the
registry name, prefill, decode, state / meta_state round trip through a saved file,
trim (or a clear NotTrimmableError), a batch of two, and the allocator's reading
against what the caches declare. Prompt caches saved by 0.1.0 still load.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import PROMPT, run_prefill, small_config
from mlx_lm.generate import batch_generate

from veloxquant_mlx import (
    KVCacheBuilder,
    KVCacheConfig,
    cache_stats,
    load_prompt_cache,
    save_prompt_cache,
)
from veloxquant_mlx.adapter.retained import warm_up
from veloxquant_mlx.apps.prompt_cache import PromptCacheError
from veloxquant_mlx.cache.base import CompressedCache, NotTrimmableError
from veloxquant_mlx.memory import active_bytes, no_buffer_cache
from veloxquant_mlx.registry import get_method, methods
from veloxquant_mlx.testing.tiny import tiny_model

LEGACY = Path(__file__).parent / "data" / "saved-v0.1"


class Tok:
    eos_token_ids = [127]

    def decode(self, tokens: list[int]) -> str:
        return " ".join(map(str, tokens))


def _decode(model, caches, tokens: list[int]) -> mx.array:
    return mx.concatenate([model(mx.array([[t]]), cache=caches)[:, -1] for t in tokens])


def test_registry_entry_is_complete(method: str) -> None:
    cls = get_method(method)
    assert issubclass(cls, CompressedCache) and cls.method == method
    assert cls.profile.family and cls.profile.paper and cls.profile.stores
    assert cls.Options.method == method
    # mlx_lm sends any cache with a ``bits`` attribute down its quantized attention path.
    cache = cls(KVCacheConfig(method), None) if not cls.profile.cross_layer else None
    assert cache is None or not hasattr(cache, "bits")


def test_life_of_a_cache(method: str, tmp_path: Path) -> None:
    model = tiny_model("llama")
    cfg = small_config(method)
    with no_buffer_cache():
        warm_up(model, cfg, PROMPT, 16)  # process-wide constants are not cache bytes
        base = active_bytes()
        caches = KVCacheBuilder.for_model(model, cfg)
        run_prefill(model, caches, PROMPT)
        _decode(model, caches, [5, 9])
        real, declared = active_bytes() - base, cache_stats(caches)["held_bytes"]
    assert real <= 1.05 * declared, (real, declared)
    assert all(c.offset == len(PROMPT) + 2 for c in caches)

    save_prompt_cache(tmp_path / "c.safetensors", caches)
    loaded = load_prompt_cache(tmp_path / "c.safetensors", model=model)
    assert [c.meta_state for c in loaded] == [c.meta_state for c in caches]
    # A loaded ring starts in time order: sums run in another order (float32 rounding).
    assert mx.allclose(_decode(model, caches, [3, 4]), _decode(model, loaded, [3, 4]),
                       atol=1e-4).item()

    if all(c.is_trimmable() for c in loaded):
        assert loaded[0].trim(3) == 3 and loaded[0].offset == len(PROMPT) + 1
    else:
        with pytest.raises(NotTrimmableError, match="not trimmable"):
            next(c for c in loaded if not c.is_trimmable()).trim(1)


def test_a_batch_of_two(method: str) -> None:
    model = tiny_model("llama", seed=5)
    cfg = small_config(method)
    prompts = [PROMPT[:23], PROMPT[3:40]]
    caches = [KVCacheBuilder.for_model(model, cfg) for _ in prompts]
    out = batch_generate(model, Tok(), prompts, prompt_caches=caches, max_tokens=3,
                         return_token_ids=True, prefill_step_size=16)
    assert [len(t) for t in out.token_ids] == [3, 3]


# Methods whose stored form changed since 0.1: their old files are refused, clearly.
REFUSED_0_1 = {"xkv": "earlier veloxquant"}


@pytest.mark.parametrize("name", sorted(json.loads((LEGACY / "expected.json").read_text())))
def test_caches_saved_by_0_1_still_load(name: str) -> None:
    """Files written before the options refactor load and continue as 0.1 did, or (for a
    method whose stored form changed) are refused with an error saying so."""
    expected = json.loads((LEGACY / "expected.json").read_text())[name]
    model = tiny_model("llama")
    if name in REFUSED_0_1:
        with pytest.raises(PromptCacheError, match=REFUSED_0_1[name]):
            load_prompt_cache(LEGACY / f"{name}.safetensors", model=model)
        return
    caches = load_prompt_cache(LEGACY / f"{name}.safetensors", model=model)
    assert caches[0].config == KVCacheConfig(name, **expected["options"])
    logits = model(mx.array([[7]]), cache=caches)[0, -1]
    want = mx.array(expected["next_logits"])
    assert mx.abs(logits - want).max().item() < 2e-3 * mx.abs(want).max().item() + 1e-4
    KVCacheBuilder.detach(model)


def test_every_method_has_a_docs_page(method: str) -> None:
    docs = Path(__file__).resolve().parent.parent / "docs" / "methods"
    pages = {p.stem: p.read_text(encoding="utf-8") for p in docs.glob("*.md")}
    shared = {"xquant_cl": "xquant"}  # XQuant-CL is described on XQuant's page
    assert method == "none" or shared.get(method, method) in pages


def test_the_list_is_what_the_registry_holds() -> None:
    assert "none" in methods() and len(methods()) >= 9


# ---------------------------------------------------------------- a contract to hold
DEVELOPING = Path(__file__).parent.parent / "docs" / "developing.md"
TABLE_START, TABLE_END = "<!-- profile table: start -->", "<!-- profile table: end -->"


def _public(cls: type) -> list[str]:
    return sorted(name for name in dir(cls) if not name.startswith("_"))


def test_the_capability_table_is_generated_from_the_profiles() -> None:
    """docs/developing.md's table equals ``capability_table`` of the registry (regenerate
    with ``scripts/profile_table.py``)."""
    from veloxquant_mlx.cache.profile import capability_table

    text = DEVELOPING.read_text()
    doc = text[text.index(TABLE_START) + len(TABLE_START):text.index(TABLE_END)].strip()
    assert doc == capability_table(methods())


def test_the_contract_is_small_and_documented() -> None:
    """``CompressedCache``'s public members are the list docs/developing.md prints, and
    few: what mlx_lm calls, the stored form's hooks, the profile and the options."""
    members = _public(CompressedCache)
    text = DEVELOPING.read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("Public members ("))
    count = int(line[len("Public members ("):line.index(")")])
    assert count == len(members), members
    assert all(f"`{m}`" in line for m in members), members
    assert len(members) <= 20  # a ceiling: the contract may shrink, never grow unnoticed
