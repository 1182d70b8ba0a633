"""The one prefill loop: a prompt through a model's caches in chunks, as mlx_lm does.

mlx_lm's ``generate_step`` runs the prompt in chunks of ``prefill_step_size`` tokens and
evaluates every cache's ``state`` after each chunk, so that the lazy graph of a long
prompt never has to be held at once. Every harness, demo and test that prefills goes
through :func:`prefill`, so they all see the caches in the same condition.
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

    ``tokens`` is ``[T]`` (a list or an array) or ``[B, T]``. It is fed in chunks of
    ``chunk`` tokens; after every chunk but the last, only the caches' state is
    evaluated (the chunk's logits are never computed). Returns the logits of the last
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
    logits = None
    for start in range(0, length, chunk):
        logits = model(batch[:, start:start + chunk], cache=caches)
        if start + chunk < length:
            mx.eval([c.state for c in caches])
    last = mx.contiguous(logits[:, -1, :])
    mx.eval(last, [c.state for c in caches])
    return last
