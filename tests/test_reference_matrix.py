"""Every architecture x every method at compressing settings, against the same-numerics
reference (``veloxquant_mlx.testing.reference``).

``tests/test_architectures.py`` checks each cell at lossless settings against mlx_lm's
own cache (and pins which cells refuse). Here each method runs with the settings that
make it compress within the table's 24-token prompt (``small_config``, plus the options
a few-layer model needs), and every position's logits of the prefill and of three
teacher-forced decode steps must stay within the method's declared bound around mlx_lm's
caches holding what the method's stored form gives: what is left is the method's
routing on that architecture (sliding windows, attention sinks, shared K/V, MoE), not
its loss. A method that cannot run a model refuses with ``UnsupportedModelError``,
naming the method.
"""

from __future__ import annotations

import warnings
from functools import cache

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import small_config

from veloxquant_mlx import KVCacheBuilder
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.errors import UnsupportedModelError
from veloxquant_mlx.options import ConfigError
from veloxquant_mlx.testing.architectures import SURVEY, list_model_types
from veloxquant_mlx.testing.models_table import (
    CHUNK,
    DECODE,
    MATRIX_EXTRA,
    PROMPT,
    tiny_model,
)
from veloxquant_mlx.testing.reference import (
    reference_bound,
    reference_caches,
    relative_error,
)

# The architectures mlx_lm's own cache runs on this build (the others have no reference).
TYPES = [t for t in list_model_types() if t in SURVEY and SURVEY[t].runs.startswith("yes")]


@cache
def _model(model_type: str) -> nn.Module:
    return tiny_model(model_type)


def _logits(model: nn.Module, caches: list) -> mx.array:
    """Every position's logits: the prompt in the table's chunks, then decode steps."""
    out = [prefill(model, caches, PROMPT, CHUNK, last_alone=False, all_logits=True)[0]]
    out += [model(mx.array([[t]]), cache=caches)[0] for t in DECODE]
    logits = mx.concatenate(out, axis=0)
    mx.eval(logits)
    return logits


@pytest.mark.parametrize("model_type", TYPES)
def test_compressing_settings_match_the_reference(model_type: str, method: str) -> None:
    model = _model(model_type)
    config = small_config(method, **MATRIX_EXTRA.get(method, {}))
    KVCacheBuilder.detach(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dense-view notice, once per model
        try:
            caches = KVCacheBuilder.for_model(model, config)
        except (UnsupportedModelError, ConfigError) as exc:
            # Refused, saying which method or which part of the model (a one-layer
            # model has no MiniCache pair: ConfigError on its layer range).
            words = (method, method.split("_")[0], model_type, "layer")
            assert any(w in str(exc).lower() for w in words), exc
            return
        try:
            got = _logits(model, caches)
            want = _logits(model, reference_caches(model, caches))
        finally:
            KVCacheBuilder.detach(model)
    bound = reference_bound(caches, len(PROMPT) + len(DECODE))
    err = relative_error(got, want)
    assert err <= bound, f"{model_type} / {config}: {err:.3g} > {bound:.3g}"
