"""The way in reads downward: ``KVCacheBuilder.for_model`` looks the method up once,
probes the model once and builds, each step calling down (registry, rotation, rings,
config, the mlx_lm glue, the caches); nothing it calls comes back to the builder.

The trace is ``sys.setprofile``'s call events in package modules, in order.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
from conftest import small_config
from mlx_lm.models.cache import RotatingKVCache

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.cache.sliding import SlidingCache
from veloxquant_mlx.testing.tiny import tiny_model

PACKAGE = "veloxquant_mlx"
BUILDER = "veloxquant_mlx.adapter.builder"
REGISTRY = "veloxquant_mlx.registry"
GLUE = "veloxquant_mlx.adapter.mlx_lm"
INLINE = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def _inline(frame: FrameType, module: str) -> bool:
    """A comprehension run by a function of its own module: part of that function's
    body (Python 3.12 inlines them), not a visit."""
    caller = frame.f_back
    return frame.f_code.co_name in INLINE and caller is not None \
        and caller.f_globals.get("__name__") == module


def _calls(build: Callable[[], Any]) -> list[tuple[str, str]]:
    """``(module, function)`` of every package function ``build`` runs, in call order."""
    calls: list[tuple[str, str]] = []

    def record(frame: FrameType, event: str, arg: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith(PACKAGE) and not _inline(frame, module):
            calls.append((module, frame.f_code.co_name))

    previous = sys.getprofile()
    sys.setprofile(record)
    try:
        build()
    finally:
        sys.setprofile(previous)
    return calls


def _stays(calls: list[tuple[str, str]]) -> list[str]:
    """The modules in the order the calls visit them, one entry per run of calls."""
    out: list[str] = []
    for module, _ in calls:
        if not out or out[-1] != module:
            out.append(module)
    return out


def _assert_downward(calls: list[tuple[str, str]]) -> None:
    stays = _stays(calls)
    assert stays[0] == BUILDER and calls[0][1] == "for_model"
    back = [i for i, m in enumerate(stays) if m == BUILDER and i > 0]
    assert not back, (f"for_model came back to the builder after {stays[back[0] - 1]}: "
                      f"{' -> '.join(m.removeprefix(PACKAGE + '.') for m in stays[:back[0] + 1])}")
    # One look-up of the method and one probe of the model, the look-up first.
    looked_up = [i for i, c in enumerate(calls) if c == (REGISTRY, "get_method")]
    probed = [i for i, c in enumerate(calls) if c == (GLUE, "probe_model")]
    assert len(looked_up) == 1, f"the method was looked up {len(looked_up)} times"
    assert len(probed) == 1, f"the model was probed {len(probed)} times"
    assert looked_up[0] < probed[0]


def test_every_method_builds_downward(method: str) -> None:
    model = tiny_model("llama")
    config = small_config(method)
    caches: list[Any] = []
    calls = _calls(lambda: caches.extend(KVCacheBuilder.for_model(model, config)))
    KVCacheBuilder.detach(model)
    assert len(caches) == len(model.layers)
    _assert_downward(calls)


def test_rotated_rings_build_downward() -> None:
    """Rotation (``cache.rotated``) and sliding-window rings (``cache.sliding``), with a
    per-layer override: the calls that came back up before."""
    model = tiny_model("gemma3_text")
    config = KVCacheConfig("affine", bits=8, group_size=32, rotate=True, layers="1:bits=4")
    caches: list[Any] = []
    calls = _calls(lambda: caches.extend(KVCacheBuilder.for_model(model, config)))
    KVCacheBuilder.detach(model)
    rings = [c for c in caches if isinstance(c, SlidingCache)]
    assert rings and all(getattr(c.inner, "rotated", False) for c in rings)
    assert not any(isinstance(c, RotatingKVCache) for c in caches)
    assert caches[1].opts.bits == 4 and caches[3].opts.bits == 8
    _assert_downward(calls)


def test_options_shortcut_builds_downward() -> None:
    """The config made from keywords inside ``for_model`` looks the method up once for
    all its checks (rotation, per-layer overrides), the build once more, and the build
    still never returns to the builder."""
    model = tiny_model("llama")
    calls = _calls(lambda: KVCacheBuilder.for_model(model, method="affine", bits=8,
                                                    group_size=32, layers="1:bits=4",
                                                    rotate=True))
    KVCacheBuilder.detach(model)
    stays = _stays(calls)
    assert stays[0] == BUILDER and BUILDER not in stays[1:]
    assert [c for c in calls if c == (GLUE, "probe_model")] == [(GLUE, "probe_model")]
    assert [c for c in calls if c == (REGISTRY, "get_method")] == [(REGISTRY, "get_method")] * 2


def test_the_trace_sees_a_return_to_the_builder() -> None:
    """The check itself: a builder helper called after a lower module fails it."""
    calls = [(BUILDER, "for_model"), (REGISTRY, "get_method"), (GLUE, "probe_model"),
             (BUILDER, "layer_infos")]
    with pytest.raises(AssertionError, match="came back to the builder after"):
        _assert_downward(calls)
