"""The worked example of docs/developing.md works as written: a method in one module.

Registered before collection (``VELOXQUANT_DOC_EXAMPLE``, see ``tests/conftest.py``),
the example runs every test that is parametrized over the registry: the contract, the
architecture matrix (its refusals derived from what it declares), real memory, the
differential machine. None of them names it: adding a method touches no other file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import DOC_EXAMPLE_ENV, DOC_EXAMPLE_MODULE, PROMPT, load_doc_example, run_prefill

from veloxquant_mlx import (
    KVCacheBuilder,
    KVCacheConfig,
    load_prompt_cache,
    registry,
    save_prompt_cache,
)
from veloxquant_mlx.apps.generate import generate_config
from veloxquant_mlx.cli import build_parser, config_from_args
from veloxquant_mlx.register import REGISTERED
from veloxquant_mlx.testing.architectures import list_model_types
from veloxquant_mlx.testing.tiny import tiny_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def example_module():
    yield load_doc_example()
    REGISTERED.pop("int8", None)
    sys.modules.pop(DOC_EXAMPLE_MODULE, None)


def test_the_example_method_is_picked_up_everywhere(example_module, tmp_path: Path) -> None:
    assert "int8" in registry.methods()
    cfg = KVCacheConfig.from_string("int8:window=24")
    assert cfg.options.window == 24
    args = build_parser().parse_args(["generate", "--kv", "int8:window=24"])
    assert generate_config(args) == cfg
    args = build_parser().parse_args(["eval", "--method", "int8", "--window", "24"])
    assert config_from_args(args) == cfg
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, cfg)
    run_prefill(model, caches, PROMPT)
    # The window holds 24 tokens, the codes the rest; bytes follow from the form.
    assert all(c.window[0].n == 24 and c.codes[0].n == len(PROMPT) - 24 for c in caches)
    assert all(c.nbytes == c.accounted_bytes() for c in caches)
    save_prompt_cache(tmp_path / "c.safetensors", caches)
    loaded = load_prompt_cache(tmp_path / "c.safetensors", model=model)
    a = model(mx.array([[3]]), cache=caches)
    b = model(mx.array([[3]]), cache=loaded)
    assert mx.allclose(a, b, atol=1e-5).item()


def test_every_registry_test_runs_the_example_with_no_edit_elsewhere() -> None:
    # Its docs page is step 2 of the example (prose, not written here).
    select = "int8 and not docs_page"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "-k", select, "tests"],
        cwd=ROOT, env={**os.environ, DOC_EXAMPLE_ENV: "1"}, capture_output=True, text=True,
        timeout=900)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|error)", tail))
    # One cell per mlx_lm model type, and the contract's checks besides.
    assert counts.get("passed", 0) > len(list_model_types()) + 3, tail
