"""The HTTP side of ``veloxquant serve``: admission, disconnects and ``GET /limits``.

``LimitedAPIHandler`` is mlx_lm's ``APIHandler`` with one step before mlx_lm handles a
completion: the prompt is rendered and counted, checked against ``--max-context`` and
``--max-kv-memory`` and given a KV reservation (``ServerLimits.admit``), possibly after
waiting in the queue; the kept cache it will start from is pinned meanwhile. Refusals
are 400, 429 or 503 (the last two with ``Retry-After``).

``LimitedResponseGenerator`` is mlx_lm's ``ResponseGenerator`` with:

- start-up: the model is loaded and the KV cost measured in the generation thread
  before the HTTP server accepts requests;
- mlx_lm's ``BatchGenerator`` replaced by ``ServerBatchGenerator`` for its lifetime
  (mlx_lm builds it by module-level name, so the name is rebound there);
- a handler thread waiting for tokens also watches its socket: when the client hangs
  up, the request is cancelled (``Ticket.cancel``) and the handler stops waiting;
- a failure inside the generation loop ends the requests it had taken with a 500 (or
  an error event in a stream) and the loop starts again: the next requests are served.

The handler also checks, before anything is queued: the ``Host`` and ``Origin``
headers (``server_requests.HostPolicy``: 403), the body's size (413), its fields
(``server_requests.validate_body``: 400 naming the field). Every refusal has OpenAI's
error shape ``{"error": {"message", "type", "param", "code"}}`` (limits add ``limit``).
``BackloggedHTTPServer`` bounds the handler threads (``--max-connections``: 503 beyond)
and every socket operation times out (``--request-timeout``).
"""

from __future__ import annotations

import gc
import io
import json
import logging
import select
import socket
import threading
import time
import weakref
from queue import Empty, Queue
from types import SimpleNamespace
from typing import Any
from urllib.parse import unquote

import mlx.core as mx
from mlx_lm import server as mlx_server

from veloxquant_mlx.apps.server_batch import bind_batch_generator
from veloxquant_mlx.apps.server_limits import (
    ERROR_TYPES,
    ClientGone,
    LimitError,
    ServerLimits,
    Ticket,
)
from veloxquant_mlx.apps.server_requests import (
    MAX_CONNECTIONS,
    MAX_REQUEST_BYTES,
    REQUEST_TIMEOUT_S,
    HostPolicy,
    validate_body,
)

# The ticket and socket of the request a handler thread is serving.
_handler = threading.local()
_NOTHING = object()


# Seconds of batch steps between two looks at the request queue (mlx_lm's own: 0.5).
INTAKE_BUDGET_S = 0.02
COMPLETION_PATHS = {"/v1/completions": "text", "/v1/chat/completions": "chat",
                    "/chat/completions": "chat"}


class GenerationFailed(BaseException):
    """The generation loop failed while it held this request (the loop goes on).

    Not an ``Exception``: mlx_lm's handler answers any ``Exception`` from ``generate``
    with a 404 of its own; this one reaches ``LimitedAPIHandler``, which answers 500.
    """


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
        self.failures = 0  # generation loops that failed and were started again
        # Response queues of the requests the loop took: told when the loop fails.
        self._taken: weakref.WeakSet[Queue] = weakref.WeakSet()
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
            while not self._generate_once():
                pass
        finally:
            mlx_server.BatchGenerator = previous

    def _generate_once(self) -> bool:
        """mlx_lm's loop; ``False`` when it failed and its requests were told so."""
        try:
            super()._generate()
            return True
        except Exception as e:
            # A failure no request brought in, or one ranks would not agree on, is fatal.
            if self._stop or not self._taken or self._is_distributed:
                raise
            logging.exception("generation loop failed; its requests end with an error, "
                              "the next ones are served")
            failed, self._taken = list(self._taken), weakref.WeakSet()
            message = f"generation failed: {type(e).__name__}: {e}"
        self.failures += 1
        self.prompt_cache.pending_ticket = None
        for generator in list(mlx_server.BatchGenerator.live):
            generator.close()
        for queue in failed:
            queue.put(GenerationFailed(message))
        # The failed loop's caches sit in reference cycles: their reservations end here.
        gc.collect()
        mx.clear_cache()
        return False

    def _next_request(self, timeout: float | None = None) -> Any:
        request = super()._next_request(timeout)
        if request is not None:
            self._taken.add(request[0])
        return request

    def _tokenize(self, tokenizer: Any, request: Any, args: Any) -> Any:
        out = super()._tokenize(tokenizer, request, args)
        if threading.current_thread() is self._generation_thread:
            # mlx_lm fails a request alone when this raises; later, in a batch step, the
            # failure would end the whole batch.
            self._dry_run(tokenizer, args)
            # The pool's next fetch (right after this) builds this request's caches.
            self.prompt_cache.pending_ticket = getattr(request, "veloxquant_ticket", None)
        return out

    def _dry_run(self, tokenizer: Any, args: Any) -> None:
        """Build the request's stop sequences, sampler and logits processors as mlx_lm
        will, and apply them once to zero logits."""
        self._make_state_machine(self.model_provider.model_key, tokenizer, args.stop_words)
        sampler = mlx_server._make_sampler(args, tokenizer)
        logits = mx.zeros((1, max(self.limits.vocab_size, 1)))
        for processor in mlx_server._make_logits_processors(args):
            logits = processor(mx.array([0]), logits)
        mx.eval(sampler(logits))

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
                    raise GenerationFailed("generation thread died") from None
                item = _NOTHING
            if isinstance(item, GenerationFailed):
                raise item
            if isinstance(item, Exception):
                # mlx_lm's loop failed this request alone (its handler would answer 404).
                raise GenerationFailed(f"request failed: {type(item).__name__}: {item}")
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
    """mlx_lm's threading HTTP server: a listen backlog of 128, bounded handler threads.

    With the default backlog of 5, a burst of more than a few simultaneous clients gets
    connections reset by the kernel before any handler sees them (no clear refusal
    possible). Beyond ``max_connections`` open connections, a new one gets a 503 at once
    instead of a thread.
    """

    request_queue_size = 128
    max_connections = MAX_CONNECTIONS
    started: list[Any] = []  # the running instance (``bind_http`` gives each class its own)

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().server_activate()
        self.started.append(self)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _refuse_connection(request, self.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            # Not on an interrupt: it may come after the handler thread started, and that
            # thread releases its slot itself.
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _refuse_connection(sock: socket.socket, limit: int) -> None:
    """A 503 written straight to a connection that gets no handler thread."""
    body = json.dumps({"error": {
        "message": f"server busy: {limit} connections are open (--max-connections); retry "
                   "later", "type": "server_error", "param": None,
        "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Retry-After: 1\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    try:
        sock.settimeout(1.0)
        sock.sendall(head + body)
    except OSError:
        pass


def bind_http(max_connections: int = MAX_CONNECTIONS, policy: HostPolicy | None = None,
              max_request_bytes: int = MAX_REQUEST_BYTES,
              request_timeout: float = REQUEST_TIMEOUT_S) -> tuple[type, type]:
    """The server and handler classes with one server's settings (mlx_lm builds both)."""
    server = type("BoundHTTPServer", (BackloggedHTTPServer,),
                  {"max_connections": max_connections, "started": []})
    handler = type("BoundAPIHandler", (LimitedAPIHandler,),
                   {"policy": policy, "max_request_bytes": max_request_bytes,
                    "timeout": request_timeout})
    return server, handler


class LimitedAPIHandler(mlx_server.APIHandler):
    """mlx_lm's handler with checks and admission in front, ``GET /limits`` and
    ``GET /v1/models``."""

    response_generator: LimitedResponseGenerator
    policy: HostPolicy | None = None  # None: no Host / Origin checks (tests)
    max_request_bytes = MAX_REQUEST_BYTES
    timeout = REQUEST_TIMEOUT_S  # every socket operation (StreamRequestHandler)

    # ---- headers: who may ask ----
    def _foreign(self) -> bool:
        """Refuse (403) a request for another host name or from another site's page."""
        if self.policy is None:
            return False
        refused = self.policy.refusal(self.headers.get("Host"), self.headers.get("Origin"))
        if refused is not None:
            header, why = refused
            self._send_error(LimitError(403, "forbidden_" + header.lower(), why, name=header))
        return refused is not None

    def _set_cors_headers(self) -> None:
        # No CORS header unless --allow-origin names this request's origin.
        origin = self.headers.get("Origin")
        if self.policy is not None and self.policy.cors_allowed(origin):
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "Content-Type, Authorization")
            self.send_header("Access-Control-Max-Age", "600")

    def do_OPTIONS(self) -> None:
        if self._foreign():
            return
        self._set_completion_headers(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        if self._foreign():
            return
        path = self.path.split("?", 1)[0]
        if path == "/limits":
            self._send_json(200, self.response_generator.limits.snapshot())
        elif path == "/v1/models" or path.startswith("/v1/models/"):
            self._models(unquote(path[len("/v1/models/"):]) if path != "/v1/models" else None)
        elif path == "/health":
            super().do_GET()
        else:
            self._send_error(LimitError(404, "not_found", f"no such endpoint: GET {path}",
                                        name="path"))

    def _models(self, wanted: str | None) -> None:
        """The served model (the only one this server loads), whatever the HF cache holds."""
        served = self.response_generator.cli_args.model or "default_model"
        entry = {"id": served, "object": "model", "created": self.created,
                 "owned_by": "veloxquant"}
        if wanted is None:
            self._send_json(200, {"object": "list", "data": [entry]})
        elif wanted in (served, "default_model"):
            self._send_json(200, dict(entry, id=wanted))
        else:
            self._send_error(LimitError(404, "model_not_found", f"model {wanted!r} is not "
                                        f"served here: only {served!r}", name="model"))

    # ---- the body: how much and what ----
    def do_POST(self) -> None:
        if self._foreign():
            return
        limits = self.response_generator.limits
        kind = COMPLETION_PATHS.get(self.path)
        try:
            if kind is None:
                raise LimitError(404, "not_found", f"no such endpoint: POST {self.path}; "
                                 f"one of {', '.join(COMPLETION_PATHS)}", name="path")
            body = validate_body(self._read_json(), kind, limits.vocab_size)
        except LimitError as e:
            limits.record("requests")
            limits.record("bad_request")
            self._send_error(e)
            return
        except (TimeoutError, ConnectionError):
            self.close_connection = True
            return
        # mlx_lm's do_POST reads the body again: it gets the checked one.
        data = json.dumps(body).encode()
        original = self.rfile
        self.rfile = io.BytesIO(data)
        self.headers.replace_header("Content-Length", str(len(data)))
        try:
            super().do_POST()
        finally:
            self.rfile = original

    def _read_json(self) -> Any:
        """The body as JSON: its length declared, within ``max_request_bytes``."""
        declared = self.headers.get("Content-Length")
        if declared is None:
            raise LimitError(411, "length_required", "the Content-Length header is required",
                             name="Content-Length")
        if not declared.strip().isdigit():
            raise LimitError(400, "invalid_header", f"Content-Length={declared!r} is not "
                             "allowed: a number of bytes", name="Content-Length")
        size = int(declared)
        if size > self.max_request_bytes:
            self._drain(size)
            raise LimitError(413, "request_too_large", f"request body of {size} bytes is "
                             f"larger than --max-request-bytes={self.max_request_bytes}",
                             name="Content-Length")
        raw = self._read_exactly(size)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise LimitError(400, "invalid_json", f"the body is not valid JSON: {e}",
                             name="body") from None

    def _read_exactly(self, size: int) -> bytes:
        """``size`` bytes within one ``timeout`` in all (a trickling client is cut off)."""
        deadline = time.monotonic() + self.timeout
        chunks, left = [], size
        while left > 0:
            if time.monotonic() > deadline:
                raise TimeoutError("request body not received in time")
            chunk = self.rfile.read1(min(left, 1 << 16))
            if not chunk:
                raise ConnectionError("client closed before sending its body")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _drain(self, size: int) -> None:
        """Read (and drop) a refused body, briefly: closing on unread bytes would reset
        the connection before the client reads the 413."""
        self.close_connection = True
        try:
            self.connection.settimeout(1.0)
            left, deadline = min(size, 4 * self.max_request_bytes), time.monotonic() + 2.0
            while left > 0 and time.monotonic() < deadline:
                chunk = self.rfile.read1(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass

    # ---- answers ----
    def _send_error(self, error: LimitError) -> None:
        self._send_json(error.status, error.body(), error.retry_after)

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
        except OSError:
            pass

    def _generation_failed(self, error: GenerationFailed, ticket: Ticket) -> None:
        """End a request whose generation loop failed: a 500, or an error event when the
        stream has begun (mlx_lm sends a stream's headers once it has the context)."""
        body = {"error": {"message": str(error), "type": ERROR_TYPES.get(500, "server_error"),
                          "param": None, "code": "generation_failed"}}
        self.close_connection = True
        if not (self.stream and ticket.ctx is not None):
            self._headers_buffer = []  # a 200 mlx_lm may have prepared was never sent
            self._send_json(500, body)
            return
        try:
            self.wfile.write(f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode())
            self.wfile.flush()
        except OSError:
            pass

    def handle_completion(self, request: Any, stop_words: list[str]) -> None:
        limits = self.response_generator.limits
        limits.record("requests")
        try:
            ticket = self._admit(request, limits)
        except LimitError as e:
            self._send_error(e)
            return
        except ClientGone:
            return
        request.veloxquant_ticket = ticket
        _handler.ticket, _handler.connection = ticket, self.connection
        try:
            super().handle_completion(request, stop_words)
        except GenerationFailed as e:
            ticket.failed = True
            self._generation_failed(e, ticket)
        except (ClientGone, BrokenPipeError, ConnectionResetError, TimeoutError):
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
        return limits.admit(n, self.max_tokens, lambda: peer_closed(self.connection), tokens,
                            salt=self.body.get("cache_salt"))

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
