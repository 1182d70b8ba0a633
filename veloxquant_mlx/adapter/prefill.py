"""The one prefill loop: a prompt through a model's caches in chunks, as mlx_lm does.

mlx_lm's ``generate_step`` runs all but the last prompt token in chunks of
``prefill_step_size`` tokens, evaluating every cache's ``state`` after each chunk so that
the lazy graph of a long prompt never has to be held at once, and then the last prompt
token alone (the step that yields the first new token). Methods act on that: SnapKV
evicts when the last prompt token comes alone. Every harness, demo and test that
prefills goes through :func:`prefill`, so they all see the caches as a user's
``mlx_lm.generate`` leaves them (tests that pin the exact chunks, or compare every
position's logits, say so with its ``last_alone`` and ``all_logits`` flags).
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
            chunk: int = 512, *, last_alone: bool = True,
            all_logits: bool = False) -> mx.array:
    """Run ``tokens`` through ``model`` into ``caches``; the last position's logits.

    ``tokens`` is ``[T]`` (a list or an array) or ``[B, T]``. All but the last token are
    fed in chunks of ``chunk`` tokens, only the caches' state evaluated after each (the
    chunks' logits are never computed), then the last token alone. Returns the logits of the last
    position, ``[B, vocab]``, evaluated together with the caches' state. They are a
    copy, not a view: a view would keep the whole last chunk's ``[B, chunk, vocab]``
    logits buffer alive.

    Two departures from mlx_lm, for checks that pin what a cache sees: with
    ``last_alone=False`` every token goes in fixed chunks of ``chunk`` (the last token
    with the last chunk); with ``all_logits=True`` every position's logits are computed
    and returned, ``[B, T, vocab]`` (each chunk's evaluated with the caches' state).
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} is not allowed: an integer >= 1")
    batch = _as_batch(tokens)
    length = batch.shape[1]
    if length < 1:
        raise ValueError("tokens is empty: prefill needs at least one token")
    stop = length - 1 if last_alone else length
    pieces = [(s, min(s + chunk, stop)) for s in range(0, stop, chunk)]
    if last_alone:
        pieces.append((length - 1, length))
    outs = []
    for start, end in pieces:
        logits = model(batch[:, start:end], cache=caches)
        if all_logits:
            outs.append(logits)
            mx.eval(logits, [c.state for c in caches])
        elif end < length:
            mx.eval([c.state for c in caches])
    if all_logits:
        out = mx.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
        mx.eval(out)
        return out
    last = mx.contiguous(logits[:, -1, :])
    mx.eval(last, [c.state for c in caches])
    return last
