"""mlx_lm's ``BatchGenerator`` for the server: fair prefill, prompt cancellation, no copies.

mlx-lm 0.32's ``BatchGenerator.next()`` already interleaves: one decode step for the
sequences that are generating, then one chunk of ``prefill_step_size`` tokens for
every prompt in the prefill batch. Three things are added on top, each small:

- **Time share.** A chunk of a long prompt can take seconds on a CPU; after a step that
  spent ``t`` seconds on prompts while other sequences were decoding, the next steps are
  decode-only until those sequences had ``t * (1 - share) / share`` seconds of their
  own (``--prefill-share``, default 0.5: prompts get at most about half the time).
- **A token budget per step.** While sequences are generating, the chunk is split
  between the prompts in the prefill batch (``prefill_step_size / rows`` tokens each, at
  least ``MIN_ROW_CHUNK``), so a step costs about one chunk however many prompts run;
  with nothing generating, every prompt gets a whole chunk (fewer, larger steps).
  Prompts that fit in one chunk go first, with an extra prefill slot if all slots hold
  long prompts.
- **Cancellation before the next step.** A request whose client is gone (its ticket
  says so) is removed from every stage before the next step runs, instead of after
  its next chunk; a prompt response is reported for it so that mlx_lm's server loop
  drops its bookkeeping as it does for any stopped request.

Moving to generation does not copy caches: mlx_lm's ``PromptProcessingBatch.split``
deep-copies the whole prefill batch's caches (the long prompts' too) and drops the
originals; ``MovingPromptBatch.split`` moves each sequence's compressed caches instead,
so nothing is duplicated and a ticket's weak references keep following the caches.
"""

from __future__ import annotations

import copy
import gc
import time
import weakref
from collections import deque
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch

from veloxquant_mlx.apps.server_limits import ServerLimits, Ticket
from veloxquant_mlx.cache.batch import BatchedCache, in_cycles

MIN_ROW_CHUNK = 32
SAMPLE_EVERY = 8  # decode steps between two readings of real memory


class MovingPromptBatch(PromptProcessingBatch):
    """``split`` moves the per-sequence caches of ``BatchedCache`` layers (no deep copy)."""

    def split(self, indices: list[int]) -> PromptProcessingBatch:
        indices = sorted(indices)
        left = sorted(set(range(len(self.uids))) - set(indices))
        new = copy.copy(self)
        for name in ("uids", "tokens", "samplers", "logits_processors", "stop_sequences",
                     "max_tokens"):
            setattr(new, name, list(getattr(self, name)))
        # Other layer kinds (mlx_lm's own batch caches) are copied as mlx_lm does.
        new.prompt_cache = [BatchedCache(list(c.caches)) if isinstance(c, BatchedCache)
                            else copy.deepcopy(c) for c in self.prompt_cache]
        self.filter(left)
        new.filter(indices)
        return new


def _prompt_length(sequence: tuple) -> int:
    return sum(len(s) for s in sequence[1])


class ServerBatchGenerator(BatchGenerator):
    """The server's batch generator; ``limits`` is bound by ``bind_batch_generator``."""

    limits: ServerLimits | None = None
    prefill_share: float = 0.5
    live: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, model: Any, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self._prompt_batch = MovingPromptBatch.empty(
            self.model, self.sampler, prefill_step_size=self.prefill_step_size)
        self._tickets: dict[int, Ticket] = {}
        self._decode_credit = 0.0
        self._steps = 0
        # So that the server can close a generator whose loop failed (mlx_lm's is local).
        type(self).live.add(self)

    def insert_segments(self, segments: list, max_tokens: Any = None, caches: Any = None,
                        *args: Any, **kwargs: Any) -> list[int]:
        uids = super().insert_segments(segments, max_tokens, caches, *args, **kwargs)
        for uid, cache in zip(uids, caches or []):
            ticket = getattr(cache, "ticket", None)
            if ticket is not None:
                ticket.uid = uid
                self._tickets[uid] = ticket
        return uids

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict:
        cycles = in_cycles([*(self._prompt_batch.prompt_cache or []),
                            *(self._generation_batch.prompt_cache or []),
                            *(c for seq in self._unprocessed_sequences for c in seq[3] or [])])
        out = super().remove(uids, return_prompt_caches)
        for uid in uids:
            ticket = self._tickets.pop(uid, None)
            if ticket is not None:
                ticket.stop_progress = (ticket.prompt_done, ticket.generated)
        # Cross-layer caches sit in reference cycles: free them now, not at some later GC.
        if cycles:
            gc.collect()
        mx.clear_cache()
        if self.limits is not None:
            self.limits.sample_real()
        return out

    # ---- one step ----
    def _next(self) -> tuple[list, list]:
        dropped = self._drop_cancelled()
        if not self._prompt_work() or not len(self._generation_batch):
            self._decode_credit = 0.0
        if self._decode_credit > 0:
            out = self._decode_only()
        else:
            out = self._fair_step()
        self._after_step(*out)
        return dropped + out[0], out[1]

    def _prompt_work(self) -> bool:
        return bool(len(self._prompt_batch) or self._unprocessed_sequences)

    def _decode_only(self) -> tuple[list, list]:
        start = time.perf_counter()
        # mlx_lm returns right after the decode step when the generation batch is "full".
        saved, self.completion_batch_size = self.completion_batch_size, 0
        try:
            out = super()._next()
        finally:
            self.completion_batch_size = saved
        self._decode_credit -= time.perf_counter() - start
        return out

    def _fair_step(self) -> tuple[list, list]:
        base_step, base_slots = self.prefill_step_size, self.prefill_batch_size
        self._short_prompts_first()
        if len(self._generation_batch):  # nobody waits on a step otherwise
            rows = min(self.prefill_batch_size,
                       len(self._prompt_batch) + len(self._unprocessed_sequences))
            self.prefill_step_size = max(MIN_ROW_CHUNK, base_step // max(rows, 1))
        spent = self._counters.prompt_time
        try:
            out = super()._next()
        finally:
            self.prefill_step_size, self.prefill_batch_size = base_step, base_slots
        spent = self._counters.prompt_time - spent
        if len(self._generation_batch) and 0 < self.prefill_share < 1:
            self._decode_credit += spent * (1 - self.prefill_share) / self.prefill_share
        return out

    def _short_prompts_first(self) -> None:
        """Prompts of at most one chunk go first; one more slot if all slots are taken."""
        waiting = self._unprocessed_sequences
        short = [s for s in waiting if _prompt_length(s) <= self.prefill_step_size]
        if not short:
            return
        self._unprocessed_sequences = deque(
            short + [s for s in waiting if _prompt_length(s) > self.prefill_step_size])
        if len(self._prompt_batch) >= self.prefill_batch_size:
            self.prefill_batch_size = len(self._prompt_batch) + 1

    def _drop_cancelled(self) -> list:
        """Remove sequences whose client is gone; a prompt response for each of them."""
        gone = [uid for uid, t in self._tickets.items() if t.cancelled and t.ctx is not None]
        if not gone:
            return []
        responses = [PromptProcessingBatch.Response(
            uid, (self._tickets[uid].prompt_done, self._tickets[uid].prompt_total or 1),
            False, False) for uid in gone]
        self.remove(gone)
        return responses

    def _after_step(self, prompt_responses: list, generation_responses: list) -> None:
        for r in prompt_responses:
            ticket = self._tickets.get(r.uid)
            if ticket is not None:
                ticket.prompt_done, ticket.prompt_total = r.progress
        for r in generation_responses:
            ticket = self._tickets.get(r.uid)
            if ticket is not None:
                ticket.generated += 1
                if r.finish_reason is not None:
                    ticket.stop_progress = (ticket.prompt_done, ticket.generated)
                    del self._tickets[r.uid]
        self._steps += 1
        # Reading waits for the step mlx_lm computes ahead: every few decode steps only.
        if self.limits is not None and (prompt_responses or self._steps % SAMPLE_EVERY == 0):
            self.limits.sample_real()


def bind_batch_generator(limits: ServerLimits, prefill_share: float) -> type:
    """A ``ServerBatchGenerator`` class bound to one server's limits.

    mlx_lm's server builds its generator itself (``BatchGenerator(model, ...)``), so the
    settings travel on the class.
    """
    return type("BoundServerBatchGenerator", (ServerBatchGenerator,),
                {"limits": limits, "prefill_share": prefill_share,
                 "live": weakref.WeakSet()})
