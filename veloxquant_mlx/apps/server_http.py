"""The HTTP side of ``veloxquant serve``: admission, disconnects and ``GET /limits``.

``LimitedAPIHandler`` is mlx_lm's ``APIHandler`` with one step before mlx_lm handles a
completion: the prompt is rendered and counted, checked against ``--max-context`` and
``--max-kv-memory`` and given a KV reservation (``ServerLimits.admit``), possibly after
waiting in the queue; the kept cache it will start from is pinned meanwhile. Refusals are JSON ``{"error", "code", "limit"}`` with 400, 429 or
503 (the last two with ``Retry-After``).

``LimitedResponseGenerator`` is mlx_lm's ``ResponseGenerator`` with:

- start-up: the model is loaded and the KV cost measured in the generation thread
  before the HTTP server accepts requests;
- mlx_lm's ``BatchGenerator`` replaced by ``ServerBatchGenerator`` for its lifetime
  (mlx_lm builds it by module-level name, so the name is rebound there);
- a handler thread waiting for tokens also watches its socket: when the client hangs
  up, the request is cancelled (``Ticket.cancel``) and the handler stops waiting.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
from queue import Empty, Queue
from types import SimpleNamespace
from typing import Any

from mlx_lm import server as mlx_server

from veloxquant_mlx.apps.server_batch import bind_batch_generator
from veloxquant_mlx.apps.server_limits import ClientGone, LimitError, ServerLimits, Ticket

# The ticket and socket of the request a handler thread is serving.
_handler = threading.local()
_NOTHING = object()


# Seconds of batch steps between two looks at the request queue (mlx_lm's own: 0.5).
INTAKE_BUDGET_S = 0.02


def peer_closed(sock: socket.socket) -> bool:
    """Whether the client closed its end (readable with nothing to read)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class LimitedResponseGenerator(mlx_server.ResponseGenerator):
    """mlx_lm's generation loop with measured limits and the server's batch generator."""

    def __init__(self, model_provider: Any, prompt_cache: Any, limits: ServerLimits,
                 prefill_share: float = 0.5) -> None:
        self.limits = limits
        self.prefill_share = prefill_share
        self.start_error: Exception | None = None
        super().__init__(model_provider, prompt_cache)  # starts the generation thread

    def _generate(self) -> None:
        # Measured here, where mlx_lm runs every model call (under mlx.launch every rank
        # measures its own shard in step), before the HTTP server accepts requests.
        try:
            self.limits.calibrate(*self.model_provider.load("default_model"))
        except Exception as e:
            self.start_error = e  # serve() reports it; no HTTP server starts
            return
        finally:
            self.limits.ready.set()
        if hasattr(mlx_server, "TimeBudget"):
            # mlx_lm steps its batch for half a second before it takes new requests: a
            # short request would wait out a long prompt's prefill that fits in it.
            self._time_budget = mlx_server.TimeBudget(budget=INTAKE_BUDGET_S)
        previous = mlx_server.BatchGenerator
        mlx_server.BatchGenerator = bind_batch_generator(self.limits, self.prefill_share)
        try:
            super()._generate()
        finally:
            mlx_server.BatchGenerator = previous

    def _tokenize(self, tokenizer: Any, request: Any, args: Any) -> Any:
        if threading.current_thread() is self._generation_thread:
            # The pool's next fetch (right after this) builds this request's caches.
            self.prompt_cache.pending_ticket = getattr(request, "veloxquant_ticket", None)
        return super()._tokenize(tokenizer, request, args)

    def prompt_tokens(self, request: Any, chat_template_kwargs: Any) -> list[int]:
        """The prompt exactly as the generation thread will tokenize it."""
        args = SimpleNamespace(chat_template_kwargs=chat_template_kwargs)
        return list(self._tokenize(self.model_provider.tokenizer, request, args)[0])

    def _await_response(self, response_queue: Queue) -> Any:
        ticket: Ticket | None = getattr(_handler, "ticket", None)
        conn = getattr(_handler, "connection", None)
        while True:
            try:
                item = response_queue.get(timeout=0.2)
            except Empty:
                if not self.generation_available():
                    raise RuntimeError("generation thread died") from None
                item = _NOTHING
            if ticket is None:
                if item is not _NOTHING:
                    return item
                continue
            if isinstance(item, mlx_server.GenerationContext):
                ticket.ctx = item
                if ticket.cancelled:
                    item.stop()
            if conn is not None and not ticket.cancelled and peer_closed(conn):
                ticket.cancel()
            # Keep waiting for the context of a cancelled request: it must be stopped.
            if ticket.cancelled and ticket.ctx is not None:
                raise ClientGone("client disconnected")
            if item is not _NOTHING:
                return item


class BackloggedHTTPServer(mlx_server.ThreadingHTTPServer):
    """mlx_lm's threading HTTP server with a listen backlog of 128 instead of 5.

    With the default, a burst of more than a few simultaneous clients gets connections
    reset by the kernel before any handler sees them (no clear refusal possible).
    """

    request_queue_size = 128


class LimitedAPIHandler(mlx_server.APIHandler):
    """mlx_lm's handler with admission in front and ``GET /limits``."""

    response_generator: LimitedResponseGenerator

    def do_GET(self) -> None:
        if self.path == "/limits":
            self._send_json(200, self.response_generator.limits.snapshot())
            return
        super().do_GET()

    def _send_json(self, status: int, body: dict, retry_after: int | None = None) -> None:
        data = json.dumps(body).encode()
        try:
            self._set_completion_headers(status)
            if retry_after is not None:
                self.send_header("Retry-After", str(retry_after))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def handle_completion(self, request: Any, stop_words: list[str]) -> None:
        limits = self.response_generator.limits
        limits.record("requests")
        try:
            ticket = self._admit(request, limits)
        except LimitError as e:
            self._send_json(e.status, e.body(), e.retry_after)
            return
        except ClientGone:
            return
        request.veloxquant_ticket = ticket
        _handler.ticket, _handler.connection = ticket, self.connection
        try:
            super().handle_completion(request, stop_words)
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            # mlx_lm's finally already stopped the context; drop it before the next step.
            ticket.cancel()
            logging.info("client disconnected: request cancelled (%s)", ticket.progress())
        finally:
            _handler.ticket = _handler.connection = None
            limits.finished(ticket)

    def _admit(self, request: Any, limits: ServerLimits) -> Ticket:
        self._check_batchable(limits)
        try:
            tokens = self.response_generator.prompt_tokens(request, self.chat_template_kwargs)
        except Exception as e:
            limits.record("bad_request")
            raise LimitError(400, "bad_prompt", f"the request cannot be made into a prompt: "
                             f"{type(e).__name__}: {e}", name="messages/prompt") from e
        n = len(tokens)
        if "max_tokens" not in self.body and "max_completion_tokens" not in self.body:
            self.max_tokens = limits.default_max_tokens(n, self.max_tokens)
        return limits.admit(n, self.max_tokens, lambda: peer_closed(self.connection), tokens)

    def _check_batchable(self, limits: ServerLimits) -> None:
        """Refuse what would make mlx_lm drain the batch and serve one request alone."""
        served = ("default_model", self.response_generator.cli_args.model)
        bad = None
        if self.requested_model not in served:
            bad = (f"model={self.requested_model!r} is not allowed: only the served model "
                   f"({served[-1] or 'the embedded one'}) or 'default_model'", "model")
        elif self.adapter is not None:
            bad = (f"adapters={self.adapter!r} is not allowed: adapters are not supported "
                   "(omit the field)", "adapters")
        elif self.seed is not None and self.temperature > 0:
            bad = (f"seed={self.seed!r} is not allowed with temperature {self.temperature}: "
                   "requests are batched, so a per-request seed cannot be honoured (omit it; "
                   "at temperature 0 it is ignored)", "seed")
        if bad is not None:
            limits.record("bad_request")
            raise LimitError(400, "invalid_field", bad[0], name=bad[1])
        # One model description for every request, so mlx_lm never drains the batch.
        self.requested_model = self.requested_draft_model = "default_model"
        self.seed = None
