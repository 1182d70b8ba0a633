"""Shared test settings: method settings for tiny models, a prefill, and the method list.

A test that takes an argument named ``method`` and does not parametrize it itself runs
once per registered method, so a new method is picked up with no edit here.
"""

import importlib.util
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.apps.blas import preload_for_pytest
from veloxquant_mlx.ops import kernels
from veloxquant_mlx.registry import get_method, methods

# Unit tests import the tiny in-process models from this folder.
sys.path.insert(0, os.path.dirname(__file__))

DOCS = Path(__file__).resolve().parent.parent / "docs"
# Set (to anything): the worked example of docs/developing.md ("Adding a method") is
# registered before the tests are collected, so every test parametrized over the
# registry runs it too (tests/test_developing.py).
DOC_EXAMPLE_ENV = "VELOXQUANT_DOC_EXAMPLE"
DOC_EXAMPLE_MODULE = "veloxquant_mlx.cache.int8_example"


def load_doc_example() -> ModuleType:
    """The example method's module (docs/developing.md's first Python block), imported
    as if it were ``veloxquant_mlx/cache/int8_example.py``: that registers it."""
    doc = DOCS / "developing.md"
    code = re.search(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), re.S).group(1)
    spec = importlib.util.spec_from_loader(DOC_EXAMPLE_MODULE, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "veloxquant_mlx.cache"
    sys.modules[DOC_EXAMPLE_MODULE] = module
    exec(compile(code, str(doc), "exec"), module.__dict__)
    return module


if os.environ.get(DOC_EXAMPLE_ENV):
    methods()  # the package's own methods first, then the example
    load_doc_example()

# Each method declares the options under which a tiny model (head_dim 32, 4 layers)
# compresses something within a few dozen tokens (``profile.small``) and those under
# which it keeps (nearly) everything of a 40-token prompt (``profile.lossless``: 8-bit
# codes, eviction that evicts nothing, full-rank factors, merging that merges nothing);
# a method that declares none runs with its defaults.
SMALL_OPTIONS: dict[str, dict[str, Any]] = {
    name: cls.profile.small for name, cls in methods().items() if cls.profile.small}
LOSSLESS_OPTIONS: dict[str, dict[str, Any]] = {
    name: cls.profile.lossless for name, cls in methods().items() if cls.profile.lossless}

PROMPT = [(i * 37 + 11) % 120 + 1 for i in range(40)]


def pytest_configure(config):
    # Re-run pytest with an optimized BLAS preloaded (MLX's Linux CPU wheel bundles the
    # slow reference BLAS); a no-op on macOS and where none is installed.
    preload_for_pytest(config)
    # One attention path for the whole suite, so no result depends on a timing; the
    # measured choice and every path are tested in tests/test_kernels.py.
    os.environ.setdefault(kernels.ENV, "floats")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "method" not in metafunc.fixturenames:
        return
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        if "method" in (names.replace(" ", "").split(",") if isinstance(names, str) else names):
            return
    metafunc.parametrize("method", list(methods()))


@pytest.fixture(scope="session")
def memory_model() -> Any:
    """The allocator tests' model: 2 KV heads x 64, so a chunk's full-precision keys are
    far larger than their codes (a chunk kept alive shows), and K and V together are
    narrower than the layer input (XQuant installs its latent projections)."""
    from veloxquant_mlx.testing.tiny import tiny_model

    return tiny_model("llama", hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=64)


@pytest.fixture()
def no_buffer_cache() -> Iterator[None]:
    """MLX's buffer cache off, so freed buffers leave the allocator's reading."""
    previous = mx.set_cache_limit(0)
    yield
    mx.set_cache_limit(previous)


def small_config(method: str, **extra: Any) -> KVCacheConfig:
    """``method`` with its ``profile.small``; a method that cannot be built fails the test."""
    return KVCacheConfig(method, **{**get_method(method).profile.small, **extra})


def lossless_config(method: str, **extra: Any) -> KVCacheConfig:
    """``method`` with its ``profile.lossless``."""
    return KVCacheConfig(method, **{**get_method(method).profile.lossless, **extra})


def run_prefill(model: Any, caches: list[Any], tokens: list[int], chunk: int = 16) -> mx.array:
    """The package's prefill with ``tokens`` in fixed chunks of ``chunk`` (the last token
    with the last chunk, not alone as mlx_lm feeds it); the last position's logits."""
    return prefill(model, caches, tokens, chunk, last_alone=False)


def prefill_then_decode(model: Any, caches: list[Any], tokens: mx.array, n: int,
                        chunk: int | None = None) -> mx.array:
    """Every position's logits: the first ``n`` of ``tokens`` (``[B, T]``) in chunks of
    ``chunk`` (default: one chunk), then one decode step per remaining token."""
    outs = [prefill(model, caches, tokens[:, :n], chunk or n, last_alone=False,
                    all_logits=True)]
    outs += [model(tokens[:, t:t + 1], cache=caches) for t in range(n, tokens.shape[1])]
    return mx.concatenate(outs, axis=1)
