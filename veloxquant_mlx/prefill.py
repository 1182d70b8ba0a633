"""The one prefill loop: a prompt through a model's caches in chunks, as mlx_lm does.

mlx_lm's ``generate_step`` runs all but the last prompt token in chunks of
``prefill_step_size`` tokens, evaluating every cache's ``state`` after each chunk so that
the lazy graph of a long prompt never has to be held at once, and then the last prompt
token alone (the step that yields the first new token). Methods act on that: SnapKV
evicts when the last prompt token comes alone. Every harness, demo and test that
prefills goes through :func:`prefill`, so they all see the caches as a user's
``mlx_lm.generate`` leaves them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn


def _as_batch(tokens: Sequence[int] | mx.array) -> mx.array:
    arr = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.int32)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2:
        raise ValueError(f"tokens must be [T] or [B, T], got shape {tuple(arr.shape)}")
    return arr


def prefill(model: nn.Module, caches: list[Any], tokens: Sequence[int] | mx.array,
            chunk: int = 512) -> mx.array:
    """Run ``tokens`` through ``model`` into ``caches``; the last position's logits.

    ``tokens`` is ``[T]`` (a list or an array) or ``[B, T]``. All but the last token are
    fed in chunks of ``chunk`` tokens, only the caches' state evaluated after each (the
    chunks' logits are never computed), then the last token alone. Returns the logits of the last
    position, ``[B, vocab]``, evaluated together with the caches' state. They are a
    copy, not a view: a view would keep the whole last chunk's ``[B, chunk, vocab]``
    logits buffer alive.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} is not allowed: an integer >= 1")
    batch = _as_batch(tokens)
    length = batch.shape[1]
    if length < 1:
        raise ValueError("tokens is empty: prefill needs at least one token")
    for start in range(0, length - 1, chunk):
        model(batch[:, start:min(start + chunk, length - 1)], cache=caches)
        mx.eval([c.state for c in caches])
    logits = model(batch[:, length - 1:], cache=caches)
    last = mx.contiguous(logits[:, -1, :])
    mx.eval(last, [c.state for c in caches])
    return last
