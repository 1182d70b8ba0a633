"""Limits of ``veloxquant serve``: context length, a KV memory budget and admission.

- ``KVCost``: the bytes a request's caches keep alive, as a function of its tokens. It
  is measured at server start on the loaded model (``measure_kv_cost``): fresh caches
  are prefilled with ``probe`` and ``2 * probe`` tokens and MLX's allocator is read
  before and after each prefill (``adapter.retained.measure_retained``). The line
  through the two readings gives bytes per token and a fixed part; a request of ``T``
  tokens reserves ``fixed + per_token * (T + 256)``: dense caches (mlx_lm's
  ``KVCache``, ``none``) grow in 256-token steps beyond the tokens they hold, wherever
  the server's chunks end. No storage formula is involved.
- ``KVBudget``: concurrent requests share ``--max-kv-memory``. A request reserves its
  bytes before it reaches the batch generator and gives them back when its caches are
  really gone (weak references on the cache objects). A request that does not fit now
  waits in a bounded FIFO queue; past the queue or the wait it is refused with 429/503
  and a ``Retry-After`` estimate. Caches kept for reuse (``apps.prompt_reuse``, the
  budget's ``keeper``) count too; the request at the head of the queue evicts them
  (least recently used first) before it waits.
- ``ServerLimits``: the settings, the counters ``GET /limits`` reports and the errors
  (``LimitError``) that name the limit, the request's size and the measured cost.
"""

from __future__ import annotations

import math
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from veloxquant_mlx.config import ConfigError, KVCacheConfig

# Dense caches (mlx_lm's KVCache and ``none``) grow in steps of this many tokens.
TOKEN_STEP = 256
# Attribute names under which mlx_lm model args give the trained context length.
CONTEXT_FIELDS = ("max_position_embeddings", "max_seq_len", "max_sequence_length",
                  "n_positions", "seq_length", "n_ctx")
_SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6,
               "G": 10**9, "GB": 10**9, "T": 10**12, "TB": 10**12, "KIB": 2**10,
               "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str, flag: str = "--max-kv-memory") -> int:
    """Bytes from ``"2GB"``, ``"512MiB"``, ``"1.5G"`` or a plain number of bytes."""
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"{flag}={text!r} is not allowed: a positive size such as 2GB, "
                          "512MB, 1.5GiB or a number of bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_bytes(n: float) -> str:
    """``1234567`` -> ``"1.2 MB"`` (decimal units, like the flag accepts)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def model_context_limit(model: Any, tokenizer: Any = None) -> tuple[int | None, str]:
    """The model's own maximum context and where it was read (``(None, "")`` if unknown)."""
    args = getattr(model, "args", None)
    for name in CONTEXT_FIELDS:
        value = getattr(args, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"model config {name}"
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    value = getattr(inner, "model_max_length", None)
    # Tokenizers without a limit report a huge sentinel (int(1e30)).
    if isinstance(value, int) and 0 < value < 10**8:
        return value, "tokenizer model_max_length"
    return None, ""


@dataclass(frozen=True)
class KVCost:
    """Measured bytes of one request's caches: ``fixed + per_token * tokens``."""

    method: str
    per_token: float
    fixed: int
    probe_tokens: tuple[int, int] = (0, 0)
    probe_bytes: tuple[int, int] = (0, 0)
    dense_per_token: float | None = None
    step: int = TOKEN_STEP

    def bytes_for(self, tokens: int) -> int:
        # One growth step of slack: a growing buffer holds up to step - 1 unused tokens.
        return int(math.ceil(self.fixed + self.per_token * (max(tokens, 0) + self.step)))

    def tokens_within(self, budget: int) -> int:
        """The most tokens one request may have for its bytes to fit in ``budget``."""
        if self.per_token <= 0:
            return 10**12 if budget >= self.fixed else 0
        return max(int((budget - self.fixed) // self.per_token) - self.step, 0)

    def dense_ratio(self) -> float | None:
        """How many times the tokens of a dense cache fit in the same bytes."""
        if not self.dense_per_token or self.per_token <= 0:
            return None
        return self.dense_per_token / self.per_token

    def describe(self) -> str:
        text = (f"{self.method} keeps {format_bytes(self.per_token)} of KV per token "
                f"(+{format_bytes(self.fixed)} per request), measured at start")
        ratio = self.dense_ratio()
        if ratio is not None and self.method != KVCacheConfig().to_string():
            text += (f"; {self.method} fits {ratio:.1f}x the tokens of dense "
                     f"({format_bytes(self.dense_per_token or 0)} per token)")
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "bytes_per_token": self.per_token,
                "fixed_bytes": self.fixed, "token_step": self.step,
                "probe_tokens": list(self.probe_tokens), "probe_bytes": list(self.probe_bytes),
                "dense_bytes_per_token": self.dense_per_token,
                "fits_x_dense": self.dense_ratio()}


def probe_tokens(model: Any, n: int) -> list[int]:
    """``n`` fixed token ids spread over the vocabulary (memory does not depend on text)."""
    vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 32000)
    return [(i * 7919 + 13) % vocab for i in range(n)]


def _line(model: Any, config: KVCacheConfig, probe: int, chunk: int
          ) -> tuple[float, int, tuple[int, int]]:
    from veloxquant_mlx.adapter.retained import measure_retained

    real = tuple(measure_retained(model, config, probe_tokens(model, n), decode_steps=0,
                                  chunk=chunk)["real_prefill_bytes"] for n in (probe, 2 * probe))
    per_token = max((real[1] - real[0]) / probe, 0.0)
    # The line must cover both readings (a reading below the line would be under-counted).
    fixed = max(real[0] - per_token * probe, real[1] - per_token * 2 * probe, 0)
    return per_token, int(math.ceil(fixed)), (int(real[0]), int(real[1]))


def measure_kv_cost(model: Any, config: KVCacheConfig, probe: int = TOKEN_STEP,
                    chunk: int = 512) -> KVCost:
    """Bytes per token and per request of ``config``'s caches, from MLX's allocator.

    Prefills fresh caches with ``probe`` and ``2 * probe`` tokens (and the same for the
    dense ``none`` cache, for the comparison in error messages); ``probe`` should be a
    multiple of ``TOKEN_STEP`` so that dense growth steps fall on the readings.
    """
    per_token, fixed, real = _line(model, config, probe, chunk)
    dense = per_token
    if not config.is_reference:
        dense = _line(model, KVCacheConfig(), probe, chunk)[0]
    return KVCost(method=config.to_string(), per_token=per_token, fixed=fixed,
                  probe_tokens=(probe, 2 * probe), probe_bytes=real, dense_per_token=dense)


# OpenAI's error ``type`` for each status the server answers with.
ERROR_TYPES = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
               411: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class LimitError(Exception):
    """A request refused by a limit: HTTP status, message and machine-readable facts."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None,
                 **facts: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.retry_after = retry_after
        self.facts = facts

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape; ``limit``: the facts of a limit (sizes, measured cost)."""
        error = {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                 "param": self.facts.get("name"), "code": self.code}
        return {"error": error, **({"limit": self.facts} if set(self.facts) - {"name"} else {})}


class ClientGone(ConnectionError):
    """The client closed its connection while its request waited or ran."""


@dataclass(eq=False)
class Ticket:
    """One request's KV reservation, from admission until its caches are gone."""

    need: int
    prompt_tokens: int
    max_tokens: int
    budget: KVBudget | None = field(default=None, repr=False)
    state: str = "new"  # new -> queued -> admitted -> released
    cancelled: bool = False
    ctx: Any = field(default=None, repr=False)  # mlx_lm's GenerationContext
    uid: int | None = None
    prompt_done: int = 0
    prompt_total: int = 0
    generated: int = 0
    cancel_progress: tuple[int, int] | None = None
    stop_progress: tuple[int, int] | None = None
    admitted_at: float = 0.0
    # The kept cache it means to start from, and whether admission pinned it.
    reuse_key: Any = field(default=None, repr=False)
    pinned: bool = False
    salt: str | None = field(default=None, repr=False)  # the request's cache_salt
    failed: bool = False  # it failed in the generation thread (answered 500)
    _live: int = 0
    _handler_done: bool = False

    def track(self, caches: Sequence[Any]) -> None:
        """Hold the reservation until every one of ``caches`` is garbage."""
        if self.budget is None:
            return
        with self.budget.lock:
            for c in caches:
                self._live += 1
                weakref.finalize(c, self._freed)

    def _freed(self) -> None:
        if self.budget is None:
            return
        with self.budget.lock:
            self._live -= 1
            self._maybe_release()

    def handler_done(self) -> None:
        if self.budget is None:
            return
        with self.budget.lock:
            self._handler_done = True
            self._maybe_release()

    def _maybe_release(self) -> None:
        if self._handler_done and self._live <= 0 and self.state == "admitted":
            self.budget.release(self)

    def cancel(self) -> None:
        """The client is gone: stop the generation (mlx_lm's flag) and let the
        batch generator drop the sequence before its next step."""
        if self.ctx is not None:
            self.ctx.stop()
        if not self.cancelled:
            self.cancelled = True
            self.cancel_progress = (self.prompt_done, self.generated)

    def progress(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_total or self.prompt_tokens,
                "prefilled_at_cancel": (self.cancel_progress or (None, None))[0],
                "prefilled_at_stop": (self.stop_progress or (None, None))[0],
                "generated_at_cancel": (self.cancel_progress or (None, None))[1],
                "generated_at_stop": (self.stop_progress or (None, None))[1]}


class QueueFull(Exception):
    """More requests already wait than ``--max-queue`` allows."""


class QueueTimeout(Exception):
    """The request waited ``--queue-timeout`` seconds without its bytes coming free."""


class KVBudget:
    """Reservations against a byte budget, with a bounded FIFO queue of waiters."""

    def __init__(self, budget: int, max_queue: int, queue_timeout: float) -> None:
        self.budget, self.max_queue, self.queue_timeout = budget, max_queue, queue_timeout
        # Re-entrant: a cache's finalizer may run (garbage collection) while a thread
        # of this module already holds the lock.
        self.lock = threading.RLock()
        self._cond = threading.Condition(self.lock)
        self._queue: deque[Ticket] = deque()
        self.active: set[Ticket] = set()
        self.reserved = self.peak_reserved = self.peak_active = self.peak_queued = 0
        self.peak_held = 0  # requests' reservations and kept caches together
        self._durations: deque[float] = deque(maxlen=32)
        # The prompt cache: ``nbytes``, ``make_room(ticket)``, ``pin(ticket)``.
        self.keeper: Any = None

    @property
    def kept(self) -> int:
        """Bytes of the caches kept for reuse (evictable, not reserved by requests)."""
        return self.keeper.nbytes if self.keeper is not None else 0

    def note_held(self) -> None:
        with self.lock:
            self.peak_held = max(self.peak_held, self.reserved + self.kept)

    def transfer(self, ticket: Ticket, n: int) -> int:
        """Move ``n`` bytes of ``ticket``'s reservation to a kept cache (negative: back)."""
        with self.lock:
            if ticket.state != "admitted":
                return 0
            n = min(n, ticket.need)
            ticket.need -= n
            self.reserved -= n
            return n

    @property
    def queued(self) -> int:
        return len(self._queue)

    def _fits_now(self, ticket: Ticket) -> bool:
        if self._queue[0] is not ticket:
            return False
        if self.keeper is not None and self.reserved + self.kept + ticket.need > self.budget:
            self.keeper.make_room(ticket)
        return self.reserved + self.kept + ticket.need <= self.budget

    def acquire(self, ticket: Ticket, gone: Callable[[], bool]) -> None:
        """Reserve ``ticket.need`` bytes, waiting in line if needed.

        Raises ``QueueFull``, ``QueueTimeout`` or ``ClientGone`` (``gone()`` is polled
        while waiting, so a client that hangs up leaves the queue).
        """
        with self._cond:
            if self._queue or self.reserved + ticket.need > self.budget:
                if len(self._queue) >= self.max_queue:
                    raise QueueFull()
            ticket.budget, ticket.state = self, "queued"
            self._queue.append(ticket)
            self.peak_queued = max(self.peak_queued, len(self._queue))
            deadline = time.monotonic() + self.queue_timeout
            try:
                while not self._fits_now(ticket):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise QueueTimeout()
                    if gone():
                        raise ClientGone("client disconnected while queued")
                    self._cond.wait(min(0.2, left))
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
            ticket.state, ticket.admitted_at = "admitted", time.monotonic()
            self.reserved += ticket.need
            self.active.add(ticket)
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            self.peak_held = max(self.peak_held, self.reserved + self.kept)
            self.peak_active = max(self.peak_active, len(self.active))
            if self.keeper is not None:
                self.keeper.pin(ticket)  # before the lock goes: nothing evicts it first

    def release(self, ticket: Ticket) -> None:
        with self._cond:
            if ticket.state != "admitted":
                return
            ticket.state = "released"
            self.reserved -= ticket.need
            self.active.discard(ticket)
            self._durations.append(time.monotonic() - ticket.admitted_at)
            self._cond.notify_all()

    def retry_after(self) -> int:
        """Seconds until a retry may succeed: about one typical request per queued one."""
        with self.lock:
            typical = sum(self._durations) / len(self._durations) if self._durations else 5.0
            waves = 1 + len(self._queue) / max(len(self.active), 1)
        return int(min(max(math.ceil(typical * waves), 1), 600))


COUNTERS = ("requests", "admitted", "completed", "cancelled", "refused_context",
            "refused_memory", "refused_busy", "refused_timeout", "bad_request", "failed")


class ServerLimits:
    """Settings, measured cost, admission and counters of one server."""

    def __init__(self, config: KVCacheConfig, max_context: int | None = None,
                 max_kv_memory: int | None = None, max_queue: int = 16,
                 queue_timeout: float = 120.0, probe: int = TOKEN_STEP,
                 chunk: int = 512) -> None:
        self.config = config
        self.requested_context, self.requested_memory = max_context, max_kv_memory
        self.max_queue, self.queue_timeout = max_queue, queue_timeout
        self.probe, self.chunk = probe, chunk
        self.max_context = 0
        self.context_source = ""
        self.memory_source = "--max-kv-memory"
        self.cost: KVCost | None = None
        self.budget = KVBudget(max_kv_memory or 0, max_queue, queue_timeout)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.cancels: deque[Ticket] = deque(maxlen=16)
        self.baseline = 0
        self.kv_real = self.kv_real_peak = 0
        self.real_over_reserved_peak: int | None = None
        self.ready = threading.Event()  # set once calibrate() ran (or failed)
        self.vocab_size = 0  # the width of the model's logits, read at start

    # ---- start-up (generation thread) ----
    def set_context(self, model: Any, tokenizer: Any) -> None:
        """``--max-context``, checked against the model's own maximum."""
        own, source = model_context_limit(model, tokenizer)
        cap = self.config.max_ctx
        if self.requested_context is None:
            if own is None:
                raise ConfigError("--max-context is needed: the model's maximum context "
                                  "is not in its config")
            self.max_context = min(own, cap)
            self.context_source = f"the model's maximum, {source}"
            return
        limit = min(own or cap, cap)
        if self.requested_context > limit:
            where = f"the model's maximum ({source})" if own else "KVCacheConfig.max_ctx"
            raise ConfigError(f"--max-context={self.requested_context} is not allowed: at "
                              f"most {limit}, {where}")
        self.max_context, self.context_source = self.requested_context, "--max-context"

    def calibrate(self, model: Any, tokenizer: Any) -> None:
        """Context limit, default budget and the measured KV cost, on the loaded model."""
        import gc

        import mlx.core as mx
        import psutil

        self.set_context(model, tokenizer)
        # Read, not taken from the config: logit_bias and top_k index these logits.
        self.vocab_size = int(model(mx.array([[0]])).shape[-1])
        if self.requested_memory is None:
            self.budget.budget = psutil.virtual_memory().available // 2
            self.memory_source = "default: half of the memory available at start"
        self.cost = measure_kv_cost(model, self.config, self.probe, self.chunk)
        gc.collect()
        mx.clear_cache()
        self.baseline = mx.get_active_memory()
        mx.reset_peak_memory()

    # ---- per request (handler threads) ----
    def record(self, name: str) -> None:
        with self.budget.lock:
            self.counters[name] += 1

    def default_max_tokens(self, prompt_tokens: int, default: int) -> int:
        """A client that gave no max_tokens gets the default, cut to the context left."""
        left = self.max_context - prompt_tokens
        return min(default, left) if left > 0 else default

    def check(self, prompt_tokens: int, max_tokens: int) -> int:
        """Bytes the request must reserve; ``LimitError`` (400) if it can never run."""
        assert self.cost is not None, "calibrate() runs before the first request"
        total = prompt_tokens + max_tokens
        if prompt_tokens < 1:
            self.record("bad_request")
            raise LimitError(400, "empty_prompt", "the prompt is empty: it must render to at "
                             "least one token", name="prompt_tokens", prompt_tokens=0)
        if total > self.max_context:
            self.record("refused_context")
            room = self.max_context - prompt_tokens
            hint = f"lower max_tokens to at most {room}" if room > 0 else "shorten the prompt"
            raise LimitError(
                400, "context_length_exceeded",
                f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} = {total} "
                f"tokens exceeds --max-context={self.max_context} ({self.context_source}); "
                f"{hint}", name="max_context", max_context=self.max_context,
                prompt_tokens=prompt_tokens, max_tokens=max_tokens, requested_tokens=total)
        need = self.cost.bytes_for(total)
        if need > self.budget.budget:
            self.record("refused_memory")
            fits = self.cost.tokens_within(self.budget.budget)
            raise LimitError(
                400, "kv_memory_exceeded",
                f"request of {total} tokens (prompt {prompt_tokens} + max_tokens "
                f"{max_tokens}) needs {format_bytes(need)} of KV cache, more than the whole "
                f"--max-kv-memory={format_bytes(self.budget.budget)} (at most {fits} tokens "
                f"per request); {self.cost.describe()}", **self._memory_facts(total, need))
        return need

    def _memory_facts(self, total: int, need: int) -> dict[str, Any]:
        assert self.cost is not None
        return dict(name="max_kv_memory", max_kv_memory=self.budget.budget,
                    requested_tokens=total, required_bytes=need,
                    free_bytes=self.budget.budget - self.budget.reserved,
                    fits_tokens=self.cost.tokens_within(self.budget.budget),
                    **{k: v for k, v in self.cost.to_dict().items() if k != "probe_bytes"})

    def admit(self, prompt_tokens: int, max_tokens: int, gone: Callable[[], bool],
              tokens: Sequence[int] | None = None, salt: str | None = None) -> Ticket:
        """Check the limits, then wait for the bytes; ``LimitError`` when refused.

        ``tokens`` (the prompt) names the kept cache the request will start from, so
        that making room for it evicts other entries first; ``salt`` (``cache_salt``)
        keeps it to the caches of requests with the same salt."""
        need = self.check(prompt_tokens, max_tokens)
        ticket = Ticket(need=need, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                        salt=salt)
        if tokens is not None and self.budget.keeper is not None:
            ticket.reuse_key = (self.budget.keeper.match(tokens) if salt is None
                                else self.budget.keeper.match(tokens, salt=salt))
        total = prompt_tokens + max_tokens
        try:
            self.budget.acquire(ticket, gone)
        except QueueFull:
            self.record("refused_busy")
            wait = self.budget.retry_after()
            raise LimitError(
                429, "kv_memory_busy",
                f"server busy: {self.budget.queued} requests already wait for KV memory "
                f"(--max-queue={self.max_queue}); this request needs {format_bytes(need)} "
                f"of --max-kv-memory={format_bytes(self.budget.budget)}, "
                f"{format_bytes(self.budget.budget - self.budget.reserved)} free now; "
                f"retry after {wait} s", retry_after=wait,
                **self._memory_facts(total, need)) from None
        except QueueTimeout:
            self.record("refused_timeout")
            wait = self.budget.retry_after()
            raise LimitError(
                503, "kv_memory_timeout",
                f"waited {self.queue_timeout:g} s (--queue-timeout) for {format_bytes(need)} "
                f"of KV memory; {format_bytes(self.budget.budget - self.budget.reserved)} of "
                f"--max-kv-memory={format_bytes(self.budget.budget)} free; retry after "
                f"{wait} s", retry_after=wait, **self._memory_facts(total, need)) from None
        self.record("admitted")
        return ticket

    def finished(self, ticket: Ticket) -> None:
        """The handler is done with ``ticket`` (answered, failed or cancelled)."""
        self.record("failed" if ticket.failed else "cancelled" if ticket.cancelled
                    else "completed")
        if ticket.cancelled:
            with self.budget.lock:
                self.cancels.append(ticket)
        if self.budget.keeper is not None:
            self.budget.keeper.unpin(ticket)  # refused or cancelled before its fetch
        ticket.handler_done()

    # ---- generation thread ----
    def sample_real(self) -> None:
        """Read MLX's allocator between batch steps: what the live caches hold.

        mlx_lm starts computing the next decode step before returning the current one;
        its temporaries (activations, not caches) are waited for before reading.
        """
        import mlx.core as mx

        mx.synchronize()
        real = mx.get_active_memory() - self.baseline
        with self.budget.lock:
            self.kv_real = real
            self.kv_real_peak = max(self.kv_real_peak, real)
            over = real - self.budget.reserved - self.budget.kept
            if self.real_over_reserved_peak is None or over > self.real_over_reserved_peak:
                self.real_over_reserved_peak = over

    def snapshot(self) -> dict[str, Any]:
        """What ``GET /limits`` returns."""
        import mlx.core as mx

        b = self.budget
        with b.lock:
            return {
                "method": self.config.to_string(), "max_context": self.max_context,
                "max_context_source": self.context_source, "max_kv_memory": b.budget,
                "max_kv_memory_source": self.memory_source, "max_queue": self.max_queue,
                "queue_timeout_s": self.queue_timeout,
                "kv_cost": self.cost.to_dict() if self.cost else None,
                "fits_tokens": self.cost.tokens_within(b.budget) if self.cost else None,
                "reserved_bytes": b.reserved, "kept_bytes": b.kept,
                "free_bytes": b.budget - b.reserved,  # kept caches give way on demand
                "peak_reserved_and_kept_bytes": b.peak_held,
                "prompt_cache": b.keeper.snapshot() if b.keeper is not None else None,
                "active_requests": len(b.active), "queued_requests": b.queued,
                "peak_reserved_bytes": b.peak_reserved, "peak_active_requests": b.peak_active,
                "peak_queued_requests": b.peak_queued,
                "kv_real_bytes": self.kv_real, "kv_real_peak_bytes": self.kv_real_peak,
                "kv_real_over_reserved_peak_bytes": self.real_over_reserved_peak,
                "process_peak_over_baseline_bytes":
                    max(mx.get_peak_memory(), self.baseline) - self.baseline,
                "counters": dict(self.counters), "cancelled_recent": [t.progress() for t in self.cancels],
            }
