"""``veloxquant serve``: mlx_lm's OpenAI-compatible server with compressed caches.

The HTTP handling, tokenization, batching and streaming are mlx_lm.server's own.
Two pieces are swapped in:

- ``FreshCachePool`` replaces mlx_lm's cross-request ``LRUPromptCache``: every
  request asks it for a cache and gets a brand-new one from
  ``KVCacheBuilder.for_model`` (fresh coordinators included), and finished caches
  are dropped instead of kept, so requests never share state and memory goes back
  after each request.
- ``VeloxModelProvider`` loads models with ``veloxquant_mlx.models.load`` (the
  embedded model when ``--model`` is not given).

Concurrent requests are batched by mlx_lm's ``BatchGenerator`` through
``BatchedCache`` (one compressed cache per sequence).
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import socket
import sys
from typing import Any

import mlx.core as mx

from ..config import KVCacheConfig

LOOPBACK_NAMES = ("localhost",)


class FreshCachePool:
    """Stands in for mlx_lm's ``LRUPromptCache``: never reuses a cache."""

    def __init__(self, model_provider: Any, config: KVCacheConfig) -> None:
        self.model_provider = model_provider
        self.config = config
        self.served = 0

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[list[Any], list[int]]:
        from ..builder import KVCacheBuilder

        self.served += 1
        return KVCacheBuilder.for_model(self.model_provider.model, self.config), tokens

    def insert_cache(self, *args: Any, **kwargs: Any) -> None:
        # A request finished: drop its cache and hand the freed buffers back.
        gc.collect()
        mx.clear_cache()

    def trim_to(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __len__(self) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return 0

    def stats_by_type(self) -> dict[str, Any]:
        return {}


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

    from ..models import load

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


def build_server_args(args: argparse.Namespace) -> argparse.Namespace:
    """mlx_lm.server's options with its defaults, filled from our parsed flags."""
    from mlx_lm.server import DEFAULT_QUANTIZED_KV_START

    return argparse.Namespace(
        model=args.model, adapter_path=None, host=args.host, port=args.port,
        allowed_origins="*", draft_model=None, num_draft_tokens=3,
        trust_remote_code=False, log_level=args.log_level, chat_template="",
        use_default_chat_template=False, temp=args.temp, top_p=1.0, top_k=0, min_p=0.0,
        max_tokens=args.max_tokens, chat_template_args={},
        decode_concurrency=args.decode_concurrency,
        prompt_concurrency=args.prompt_concurrency, prefill_step_size=args.prefill_step_size,
        prompt_cache_size=0, prompt_cache_bytes=None, kv_bits=None, kv_group_size=64,
        quantized_kv_start=DEFAULT_QUANTIZED_KV_START, pipeline=False,
    )


def serve(args: argparse.Namespace, config: KVCacheConfig) -> None:
    """Run the server until interrupted (blocking)."""
    from mlx_lm import server as mlx_server

    check_loopback(args.host)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s - %(levelname)s - %(message)s")
    provider = _provider_class()(build_server_args(args))
    pool = FreshCachePool(provider, config)
    generator = mlx_server.ResponseGenerator(provider, pool)
    logging.info("veloxquant serve: method=%s on %s:%d", config.method, args.host, args.port)
    print(f"[veloxquant] serving method={config.method} on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    mlx_server._run_http_server(args.host, args.port, generator)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` flags besides ``--method`` and the method options."""
    parser.add_argument("--model", default=None,
                        help="model path / repo id / .gguf (default: embedded SmolLM2)")
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to bind")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--max-tokens", type=int, default=512,
                        help="default max tokens per completion")
    parser.add_argument("--temp", type=float, default=0.0, help="default temperature")
    parser.add_argument("--decode-concurrency", type=int, default=32)
    parser.add_argument("--prompt-concurrency", type=int, default=8)
    parser.add_argument("--prefill-step-size", type=int, default=512)
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for tests and scripts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
