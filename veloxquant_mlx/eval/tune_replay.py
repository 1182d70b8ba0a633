"""One dense prefill, replayed into many candidates' caches (``veloxquant tune``'s screens).

A screen needs each candidate's caches to hold the context. Prefilling each through the
model costs a model run per candidate; instead the dense model runs the context once,
through caches that record what every attention layer hands its cache in each call (the
keys and values; the queries, scale and mask of its attention), and :func:`replay` makes
the same calls on a candidate's caches, layer by layer and chunk by chunk: the chunk's
keys and values through ``update_and_fetch``, then ``attend`` with the chunk's last
``QUERIES`` queries only (what a method that chooses or codes at attention time needs,
such as an observation window; all of the chunk's queries would cost the prefill's
attention again), the mask aligned at the end of the keys as ``causal`` is.

What the replay misses: in a real prefill each layer's input carries the error that the
compressed caches of the layers before it put into the chunk's hidden states; here
every layer stores the dense model's keys and values. Caches that take over their
module's call (``hooks_module``: they never see keys and values) and slots the dense run
did not record cannot be replayed (:func:`replayable`); the caller prefills those
through the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from veloxquant_mlx.adapter.builder import KVCacheBuilder
from veloxquant_mlx.adapter.mlx_lm import attention_routing
from veloxquant_mlx.ops.buffers import owned

QUERIES = 64  # queries of a chunk that attend in the replay


@dataclass
class Call:
    """What one layer's attention handed its cache in one model call."""

    keys: mx.array
    values: mx.array
    queries: mx.array | None = None  # the last QUERIES, when the attention was routed
    scale: float = 1.0
    mask: Any = None


class _Recorder(KVCache):
    """mlx_lm's dense cache, attending by itself so that it sees the queries too."""

    attends = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] | None = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.calls is not None:
            self.calls.append(Call(keys, values))
        return super().update_and_fetch(keys, values)

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        if self.calls is not None:
            call = self.calls[-1]
            call.queries, call.scale, call.mask = owned(queries[:, :, -QUERIES:]), scale, mask
        keys, values = self.keys[..., :self.offset, :], self.values[..., :self.offset, :]
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask)

    def held_arrays(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]


@dataclass
class Recording:
    """The dense run of a context: per recorded slot, its calls in order."""

    context: list[int]
    slots: list[int]
    calls: dict[int, list[Call]] | None  # None once dropped
    n_slots: int
    dense: list[Any] = field(repr=False)  # the dense caches, holding the context
    last: mx.array | None = field(default=None, repr=False)  # dense logits after it

    @property
    def n_calls(self) -> int:
        return len(self.calls[self.slots[0]]) if self.slots and self.calls else 0


def record(model: nn.Module, context: Sequence[int], chunk: int = 512) -> Recording:
    """Prefill ``context`` through dense caches that record every layer's calls."""
    infos = KVCacheBuilder.layer_infos(model)
    KVCacheBuilder.detach(model)
    caches = make_prompt_cache(model)
    slots = [i for i, (c, info) in enumerate(zip(caches, infos))
             if info is not None and type(c) is KVCache]
    for i in slots:
        caches[i] = _Recorder()
    with attention_routing(model):
        last = _prefill(model, caches, list(context), chunk, slots)
    calls = {i: caches[i].calls for i in slots}
    for i in slots:
        caches[i].calls = None  # later calls (scoring on these caches) are not recorded
    return Recording(list(context), slots, calls, len(caches), caches, last)


def _prefill(model: nn.Module, caches: list[Any], tokens: list[int], chunk: int,
             slots: list[int]) -> mx.array:
    """``adapter.prefill.prefill``'s chunks (all but the last token, then it alone),
    each chunk's recorded queries evaluated with the caches' state: left lazy, they
    would keep the chunk's graph and be computed again from it."""
    stop = len(tokens) - 1
    pieces = [(s, min(s + chunk, stop)) for s in range(0, stop, chunk)] + [(stop, stop + 1)]
    for start, end in pieces:
        logits = model(mx.array([tokens[start:end]], dtype=mx.int32), cache=caches)
        queries = [caches[i].calls[-1].queries for i in slots]
        mx.eval([c.state for c in caches], [q for q in queries if q is not None])
    last = mx.contiguous(logits[:, -1, :])  # a copy: not a view of the chunk's logits
    mx.eval(last)
    return last


def replayable(rec: Recording, caches: list[Any]) -> bool:
    """Whether every cache gets what it needs from the recording."""
    return rec.calls is not None and len(caches) == rec.n_slots == len(rec.slots) and \
        not any(getattr(getattr(c, "profile", None), "hooks_module", False) for c in caches)


def replay(rec: Recording, caches: list[Any], slots: Sequence[int] | None = None,
           evaluate: bool = True) -> None:
    """Make the recorded calls on ``caches`` (see the module docstring), layer after
    layer as the model makes them, on ``slots`` only when given (layers whose caches do
    not depend on each other). Without ``evaluate`` nothing is computed that the caches'
    code does not compute itself: what they hold is then only shapes, enough for their
    bytes (``nbytes`` needs no data)."""
    if not replayable(rec, caches):
        raise ValueError("tune: these caches cannot be replayed from the dense run")
    slots = rec.slots if slots is None else list(slots)
    for c in range(rec.n_calls):
        outs = [_replay_call(caches[s], rec.calls[s][c]) for s in slots]
        if evaluate:
            mx.eval([o for o in outs if o is not None], [caches[s].state for s in slots])


def _replay_call(cache: Any, call: Call) -> mx.array | None:
    """The call's keys and values, then (for a cache that attends) its last queries:
    with the mask aligned at the end, as ``causal`` is, they see what they saw."""
    cache.update_and_fetch(call.keys, call.values)
    if call.queries is None or not getattr(cache, "attends", False):
        return None
    w = call.queries.shape[2]
    mask = call.mask
    if isinstance(mask, mx.array):
        mask = mask[..., -w:, :]
    elif w == 1:
        mask = None
    return cache.attend(call.queries, scale=call.scale, mask=mask)


def representatives(rec: Recording, caches: list[Any]) -> dict[int, int] | None:
    """One slot per kind of layer cache, with how many slots are of its kind (a kind:
    the cache class, its layer's options, the shapes it receives and whether it holds
    the model's one rotation); ``None`` when a cache shares state across layers
    (``cross_layer``), whose layers must all be replayed."""
    if any(getattr(getattr(c, "profile", None), "cross_layer", False) for c in caches):
        return None
    kinds: dict[tuple[Any, ...], list[int]] = {}
    for s in rec.slots:
        c, call = caches[s], rec.calls[s][0]
        key = (type(c), repr(getattr(c, "opts", None)), tuple(call.keys.shape[1::2]),
               tuple(call.values.shape[1::2]), bool(getattr(c, "owns_rotation", False)))
        kinds.setdefault(key, []).append(s)
    return {group[0]: len(group) for group in kinds.values()}


def _split(cache: Any, call: Call) -> int:
    """Tokens of the call's second pass: its last queries' (0: one pass, no attend)."""
    if call.queries is None or not getattr(cache, "attends", False):
        return 0
    return min(call.queries.shape[2], call.keys.shape[2])


def _head(cache: Any, call: Call) -> None:
    w = _split(cache, call)
    if w < call.keys.shape[2]:
        end = call.keys.shape[2] - w
        cache.update_and_fetch(call.keys[:, :, :end], call.values[:, :, :end])


def _tail(cache: Any, call: Call) -> mx.array | None:
    w = _split(cache, call)
    if not w:
        return None
    cache.update_and_fetch(call.keys[:, :, -w:], call.values[:, :, -w:])
    mask = call.mask
    if isinstance(mask, mx.array):
        mask = mask[..., -w:, :]
    elif w == 1:
        mask = None
    return cache.attend(call.queries[:, :, -w:], scale=call.scale, mask=mask)


def trim_dense(rec: Recording) -> None:
    """Put the dense caches back to the context (after scoring or timing on them)."""
    n = len(rec.context)
    for c in rec.dense:
        extra = getattr(c, "offset", n) - n
        if extra > 0:
            c.trim(extra)
