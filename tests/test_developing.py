"""The worked example of docs/developing.md works as written: a method in one module."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import PROMPT, run_prefill
from tiny_models import tiny_model

from veloxquant_mlx import (
    KVCacheBuilder,
    KVCacheConfig,
    load_prompt_cache,
    registry,
    save_prompt_cache,
)
from veloxquant_mlx.cli import build_parser, config_from_args

DOC = Path(__file__).resolve().parent.parent / "docs" / "developing.md"


@pytest.fixture()
def topk_module():
    code = re.search(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S).group(1)
    name = "veloxquant_mlx.cache.topk_example"
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "veloxquant_mlx.cache"
    sys.modules[name] = module
    exec(compile(code, str(DOC), "exec"), module.__dict__)
    yield module
    registry._METHODS.pop("topk", None)
    sys.modules.pop(name, None)


def test_the_example_method_is_picked_up_everywhere(topk_module, tmp_path: Path) -> None:
    assert "topk" in registry.methods()
    cfg = KVCacheConfig.from_string("topk:capacity=24")
    assert cfg.options.capacity == 24
    args = build_parser().parse_args(["generate", "--method", "topk", "--capacity", "24"])
    assert config_from_args(args) == cfg
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, cfg)
    run_prefill(model, caches, PROMPT)
    assert all(c.keys.shape[2] == 24 for c in caches)
    save_prompt_cache(tmp_path / "c.safetensors", caches)
    loaded = load_prompt_cache(tmp_path / "c.safetensors", model=model)
    a = model(mx.array([[3]]), cache=caches)
    b = model(mx.array([[3]]), cache=loaded)
    assert mx.allclose(a, b, atol=1e-5).item()
