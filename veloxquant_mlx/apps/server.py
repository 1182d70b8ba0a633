"""``veloxquant serve``: mlx_lm's OpenAI-compatible server with compressed caches.

The HTTP handling, tokenization, batching and streaming are mlx_lm.server's own.
Swapped in or added:

- ``CompressedPromptCache`` (``prompt_reuse``) replaces mlx_lm's ``LRUPromptCache``:
  it is that class, keeping finished (and system-prompt) caches compressed and starting
  each request from the longest exactly shared prefix, with copies that carry their
  own cross-layer coordinators; kept caches count in ``--max-kv-memory`` and give way
  to admitted requests. ``--prompt-cache-size 0`` gives every request brand-new caches
  from ``KVCacheBuilder.for_model``. Each request's caches carry its KV reservation
  (``Ticket``).
- ``VeloxModelProvider`` loads models with ``veloxquant_mlx.models.load`` (the
  embedded model when ``--model`` is not given).
- Limits (``server_limits``): ``--max-context``, a measured ``--max-kv-memory`` budget
  shared by all requests, a bounded queue; admission and disconnects (``server_http``);
  fair chunked prefill and cancellation inside mlx_lm's batch generator
  (``server_batch``).
- Edges (``server_requests``, ``server_http``): every request field checked before it
  is queued, a body-size cap, socket timeouts, bounded handler threads; only loopback
  ``Host`` names and no other site's ``Origin`` (no CORS unless ``--allow-origin``);
  ``cache_salt`` keeps a client's kept caches to itself (``server_salt``).
- ``--prompt-cache-dir`` (``disk_tier``): kept caches evicted from RAM, and all of them
  at shutdown and periodically, go to files there; a later request (after a restart
  too) whose prompt shares a longer prefix with a file than with RAM loads it.

Concurrent requests are batched by mlx_lm's ``BatchGenerator`` through
``BatchedCache`` (one compressed cache per sequence).
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

import mlx.core as mx

from veloxquant_mlx.apps.prompt_reuse import (
    DEFAULT_ENTRIES,
    CompressedPromptCache,
    RequestCaches,
)
from veloxquant_mlx.apps.server_requests import (
    MAX_CONNECTIONS,
    MAX_REQUEST_BYTES,
    REQUEST_TIMEOUT_S,
)
from veloxquant_mlx.config import KVCacheConfig

__all__ = ["RequestCaches", "add_serve_arguments", "check_loopback", "free_port", "serve"]

LOOPBACK_NAMES = ("localhost",)


def check_loopback(host: str) -> None:
    """Only loopback addresses: mlx_lm.server has only basic security checks."""
    if host in LOOPBACK_NAMES:
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"--host={host!r} is not allowed: a loopback address "
                     "(127.0.0.1, ::1 or localhost)")


def _provider_class() -> type:
    from mlx_lm import server as mlx_server

    from veloxquant_mlx.models import load

    class VeloxModelProvider(mlx_server.ModelProvider):
        """Loads through ``veloxquant_mlx.models.load`` (GGUF, embedded, mlx folders)."""

        def _load(self, model_path: Any, adapter_path: Any = None,
                  draft_model_path: Any = None) -> None:
            if adapter_path is not None or draft_model_path is not None:
                raise ValueError("veloxquant serve does not support adapters or draft models")
            self.reset()
            gc.collect()
            mx.clear_cache()
            model, tokenizer = load(model_path)
            self.model_key = (model_path, None, None)
            self.model, self.tokenizer = model, tokenizer
            self.processor = None
            self.draft_model = None
            self.is_batchable = True

        def load(self, model_path: Any, adapter_path: Any = None,
                 draft_model_path: Any = None) -> Any:
            # Serve only the model given on the command line, never a client's path.
            if model_path not in ("default_model", self.cli_args.model):
                raise ValueError(f"model {model_path!r} is not served here; use "
                                 "'default_model'")
            return super().load("default_model", None, "default_model")

    return VeloxModelProvider


def allowed_origins(args: argparse.Namespace) -> list[str]:
    """The origins given by ``--allow-origin`` and mlx_lm's ``--allowed-origins``."""
    return [*(getattr(args, "allow_origin", None) or []),
            *(getattr(args, "allowed_origins", None) or [])]


def build_server_args(args: argparse.Namespace) -> argparse.Namespace:
    """mlx_lm.server's options with its defaults, filled from our parsed flags."""
    from mlx_lm.server import DEFAULT_QUANTIZED_KV_START

    return argparse.Namespace(
        model=args.model, adapter_path=None, host=args.host, port=args.port,
        # Not read: the handler's own CORS (only --allow-origin's origins) replaces it.
        allowed_origins=allowed_origins(args),
        draft_model=None, num_draft_tokens=3,
        trust_remote_code=getattr(args, "trust_remote_code", False),
        log_level=args.log_level, chat_template=getattr(args, "chat_template", ""),
        use_default_chat_template=getattr(args, "use_default_chat_template", False),
        temp=args.temp, top_p=getattr(args, "top_p", 1.0), top_k=getattr(args, "top_k", 0),
        min_p=getattr(args, "min_p", 0.0), max_tokens=args.max_tokens,
        chat_template_args=getattr(args, "chat_template_args", {}),
        decode_concurrency=args.decode_concurrency,
        prompt_concurrency=args.prompt_concurrency, prefill_step_size=args.prefill_step_size,
        # mlx_lm trims its cache to --prompt-cache-bytes minus the running requests'
        # bytes; ours bounds the kept caches itself (within --max-kv-memory).
        prompt_cache_size=args.prompt_cache_size, prompt_cache_bytes=None, kv_bits=None,
        kv_group_size=64,
        quantized_kv_start=DEFAULT_QUANTIZED_KV_START, pipeline=False,
    )


def serve(args: argparse.Namespace, config: KVCacheConfig) -> None:
    """Run the server until interrupted (blocking)."""
    from mlx_lm import server as mlx_server

    from veloxquant_mlx.apps.server_http import LimitedResponseGenerator, bind_http
    from veloxquant_mlx.apps.server_limits import ServerLimits, format_bytes
    from veloxquant_mlx.apps.server_requests import HostPolicy
    from veloxquant_mlx.apps.server_salt import SaltedPromptCache

    check_loopback(args.host)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s - %(levelname)s - %(message)s")
    limits = ServerLimits(config, max_context=args.max_context,
                          max_kv_memory=args.max_kv_memory, max_queue=args.max_queue,
                          queue_timeout=args.queue_timeout, probe=args.kv_probe_tokens,
                          chunk=args.prefill_step_size)
    provider = _provider_class()(build_server_args(args))
    pool = SaltedPromptCache(provider, config, limits, max_size=_reused_entries(args),
                             max_bytes=args.prompt_cache_bytes)
    from veloxquant_mlx.apps.distributed import (
        response_generator,  # under mlx.launch: shards; rank 0 returns
    )

    generator = response_generator(LimitedResponseGenerator, provider, pool, limits,
                                   args.prefill_share)
    # The model loads and the KV cost is measured before the first request is accepted.
    limits.ready.wait()
    if generator.start_error is not None:
        generator.join()
        _exit_with(generator.start_error)
    assert limits.cost is not None
    _open_disk(args, pool, provider, config)
    logging.info("veloxquant serve: method=%s on %s:%d", config.method, args.host, args.port)
    print(f"[veloxquant] serving method={config.to_string()} on http://{args.host}:{args.port}"
          f"\n[veloxquant] max context {limits.max_context} ({limits.context_source}); KV "
          f"budget {format_bytes(limits.budget.budget)} ({limits.memory_source}), "
          f"{limits.cost.tokens_within(limits.budget.budget)} tokens; "
          f"{limits.cost.describe()}\n[veloxquant] {_describe_reuse(pool)}",
          file=sys.stderr, flush=True)
    server_class, handler_class = bind_http(
        max_connections=getattr(args, "max_connections", MAX_CONNECTIONS),
        policy=HostPolicy.local(args.host, args.port, allowed_origins(args)),
        max_request_bytes=getattr(args, "max_request_bytes", MAX_REQUEST_BYTES),
        request_timeout=getattr(args, "request_timeout", REQUEST_TIMEOUT_S))
    _stop_on_signals(server_class)
    try:
        mlx_server._run_http_server(args.host, args.port, generator,
                                    server_class=server_class, handler_class=handler_class)
    finally:
        # The loop ends after the step it is in, whose finished requests' caches it hands
        # to the pool; then every kept cache goes to disk before the process ends.
        generator.stop_and_join()
        pool.close_disk()


def _open_disk(args: argparse.Namespace, pool: CompressedPromptCache, provider: Any,
               config: KVCacheConfig) -> None:
    """The disk tier under the pool, once the model is loaded (its identity is part of
    every file's name check)."""
    folder = getattr(args, "prompt_cache_dir", None)
    if folder is None or pool.entry_limit <= 0:
        return
    from veloxquant_mlx.apps.disk_tier import AtRestCodec, DiskTier, model_identity

    identity = model_identity(provider.model, str(args.model or "embedded"))
    bits = getattr(args, "prompt_cache_at_rest", None)
    codec = None if bits is None else AtRestCodec(provider.model, bits)
    pool.disk = DiskTier(folder, getattr(args, "prompt_cache_disk_bytes", None), identity,
                         config.to_string(), codec)
    pool.disk.periodic = pool.persist_kept


def _stop_on_signals(server_class: type) -> None:
    """SIGTERM (a service manager) and the first Ctrl-C stop the HTTP server from another
    thread, so its loop returns between requests; an interrupt raised wherever the main
    thread happens to be can be swallowed by the code it lands in (a handler thread's
    start), leaving a server that a later SIGKILL ends before its caches are saved. A
    second Ctrl-C interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if not server_class.started:
            raise KeyboardInterrupt  # not serving yet: nothing to drain
        logging.info("veloxquant serve: signal %d, stopping", signum)
        for httpd in server_class.started:
            threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def _reused_entries(args: argparse.Namespace) -> int:
    """``--prompt-cache-size``, or 0 under mlx.launch: there only rank 0 admits requests
    (and evicts for them), so the ranks' kept caches would not stay the same."""
    from veloxquant_mlx.apps.distributed import world

    if args.prompt_cache_size and world() is not None:
        logging.warning("prompt-cache reuse is off under mlx.launch (--prompt-cache-size "
                        "%d ignored)", args.prompt_cache_size)
        return 0
    return args.prompt_cache_size


def _describe_reuse(pool: CompressedPromptCache) -> str:
    from veloxquant_mlx.apps.server_limits import format_bytes

    if pool.entry_limit <= 0:
        return "prompt cache off: every request is prefilled from scratch"
    room = "within the KV budget" if pool.byte_limit is None else \
        f"at most {format_bytes(pool.byte_limit)} (--prompt-cache-bytes), within the KV budget"
    disk = "" if pool.disk is None else (
        f"; evicted ones go to {str(pool.disk.folder)!r} (--prompt-cache-dir, "
        f"{len(pool.disk.entries)} there, " + (
            "no size limit" if pool.disk.max_bytes is None else
            f"at most {format_bytes(pool.disk.max_bytes)}")
        + (f", at rest at {pool.disk.codec.bits:g} bits per value"
           if hasattr(pool.disk.codec, "bits") else "") + ")")
    return (f"prompt cache: up to {pool.entry_limit} kept caches (--prompt-cache-size), "
            f"{room}; requests start from the longest shared prefix{disk}")


def _exit_with(error: Exception) -> None:
    """Report a start-up error and leave at once.

    The CLI would print it and return; but MLX 0.32 can abort the interpreter's exit
    ("terminate called without an active exception") once a thread that ran the model
    has ended, so the process ends here, with the CLI's message and exit status.
    """
    from veloxquant_mlx.adapter.mlx_lm import UnsupportedModelError
    from veloxquant_mlx.apps.server_limits import ConfigError

    user_error = isinstance(error, (ConfigError, UnsupportedModelError, FileNotFoundError))
    if not user_error:
        logging.error("veloxquant serve could not start", exc_info=error)
    print(f"veloxquant serve: error: {error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2 if user_error else 1)


def _checked(kind: type, name: str, minimum: float, maximum: float | None = None) -> Any:
    """An argparse type: ``kind`` within [minimum, maximum], else an error naming the flag."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            allowed = f"{kind.__name__} >= {minimum}" + (
                f" and <= {maximum}" if maximum is not None else "")
            raise argparse.ArgumentTypeError(f"{name}={text!r} is not allowed: {allowed}")
        return value
    return parse


def _size(flag: str) -> Any:
    """An argparse type: a positive size, else an error naming ``flag``."""
    from veloxquant_mlx.apps.server_limits import parse_size

    def parse(text: str) -> int:
        try:
            return parse_size(text, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _folder(flag: str) -> Any:
    """An argparse type: a folder that exists or can be made, else an error naming
    ``flag``."""
    def parse(text: str) -> str:
        try:
            os.makedirs(text, exist_ok=True)
        except OSError as e:
            raise argparse.ArgumentTypeError(
                f"{flag}={text!r} is not allowed: a folder this process can create and "
                f"write ({e.strerror or e})") from None
        if not os.access(text, os.W_OK):
            raise argparse.ArgumentTypeError(
                f"{flag}={text!r} is not allowed: the folder is not writable")
        return text
    return parse


def _add_reuse_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt-cache flags: kept caches in RAM and on disk."""
    parser.add_argument("--prompt-cache-size", type=_checked(int, "--prompt-cache-size", 0),
                        default=DEFAULT_ENTRIES, help="most caches kept for reuse by later "
                        "requests (finished conversations, system prompts), compressed; "
                        "0: every request is prefilled from scratch")
    parser.add_argument("--prompt-cache-bytes", type=_size("--prompt-cache-bytes"),
                        default=None, help="most bytes the kept caches may hold, e.g. 1GB "
                        "(default: any part of --max-kv-memory that requests leave free)")
    parser.add_argument("--prompt-cache-dir", type=_folder("--prompt-cache-dir"),
                        default=None, metavar="DIR", help="a folder where kept caches "
                        "evicted from RAM, and all of them at shutdown, are saved and found "
                        "again (after a restart too). Default: none, evicted caches are lost")
    parser.add_argument("--prompt-cache-disk-bytes", type=_size("--prompt-cache-disk-bytes"),
                        default=None, help="most bytes of files in --prompt-cache-dir, e.g. "
                        "20GB; least recently used go first (default: no limit)")
    parser.add_argument("--prompt-cache-at-rest", nargs="?", const=3.0, default=None,
                        type=_checked(float, "--prompt-cache-at-rest", 0.0, 8.0),
                        metavar="BITS", help="write --prompt-cache-dir files transform-coded "
                        "(docs/methods/at-rest.md): BITS per value (default 3; lossy: a "
                        "restored cache is close to, not equal to, the evicted one). "
                        "Default: off, files hold the caches as kept")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` flags besides ``--method`` and the method options."""
    parser.add_argument("--model", default=None,
                        help="model path / repo id / .gguf (default: embedded SmolLM2)")
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to bind")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--max-tokens", type=_checked(int, "--max-tokens", 1), default=512,
                        help="default max tokens per completion")
    parser.add_argument("--temp", type=float, default=0.0, help="default temperature")
    parser.add_argument("--decode-concurrency", type=_checked(int, "--decode-concurrency", 1),
                        default=32)
    parser.add_argument("--prompt-concurrency", type=_checked(int, "--prompt-concurrency", 1),
                        default=8)
    parser.add_argument("--prefill-step-size", type=_checked(int, "--prefill-step-size", 32),
                        default=512, help="prompt tokens per batch step (split between the "
                        "prompts being prefilled)")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    parser.add_argument("--max-context", type=_checked(int, "--max-context", 1), default=None,
                        help="most tokens (prompt + max_tokens) per request "
                        "(default: the model's maximum)")
    parser.add_argument("--max-kv-memory", type=_size("--max-kv-memory"), default=None,
                        help="KV cache bytes shared by all requests, e.g. 2GB or 512MiB "
                        "(default: half of the memory available at start)")
    parser.add_argument("--max-queue", type=_checked(int, "--max-queue", 0), default=16,
                        help="requests that may wait for KV memory; more get 429")
    parser.add_argument("--queue-timeout", type=_checked(float, "--queue-timeout", 0.1),
                        default=120.0, help="seconds a request may wait for KV memory; "
                        "then 503")
    parser.add_argument("--prefill-share", type=_checked(float, "--prefill-share", 0.05, 1.0),
                        default=0.5, help="most of the time prompt processing may take "
                        "while other requests decode (1: no limit)")
    _add_reuse_arguments(parser)
    parser.add_argument("--max-request-bytes", type=_size("--max-request-bytes"),
                        default=MAX_REQUEST_BYTES, help="largest request body; larger ones "
                        "get 413 (default 4 MiB)")
    parser.add_argument("--request-timeout", type=_checked(float, "--request-timeout", 1.0),
                        default=REQUEST_TIMEOUT_S, help="seconds any one read or write on a "
                        "connection may take, and a whole request body")
    parser.add_argument("--max-connections", type=_checked(int, "--max-connections", 1),
                        default=MAX_CONNECTIONS, help="open connections (handler threads); "
                        "more get 503")
    parser.add_argument("--allow-origin", action="append", default=None, metavar="ORIGIN",
                        help="a web origin (e.g. http://localhost:3000) whose pages may call "
                        "the server (CORS); repeatable. Default: none, other sites' pages "
                        "are refused")
    parser.add_argument("--kv-probe-tokens", type=_checked(int, "--kv-probe-tokens", 16),
                        default=256, help="tokens of the start-up KV measurement (prefills "
                        "of N and 2N tokens)")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for tests and scripts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
