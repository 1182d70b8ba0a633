"""``mlx_lm.server``'s own flags on ``veloxquant serve``, with their meaning.

A user who runs ``mlx_lm.server`` keeps their command line: its sampling defaults and
chat-template flags pass through to mlx_lm's handler, ``--allowed-origins`` names the
origins that get CORS headers (as ``--allow-origin``), and ``--kv SPEC`` /
``--kv-config FILE`` choose the compressed cache as in ``veloxquant generate``. Flags
whose feature the compressed server does not offer are accepted by the parser and
refused at start with what to use instead, never ignored.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
from typing import Any

from veloxquant_mlx.apps.generate import generate_config
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.options import ConfigError

# Flag -> why it is refused and what to use (a value other than mlx_lm's default).
REFUSED: dict[str, tuple[str, str]] = {
    "adapter_path": ("--adapter-path", "merge the adapter into the model first "
                     "(mlx_lm.fuse) and serve the fused model"),
    "draft_model": ("--draft-model", "speculative decoding is not offered by veloxquant "
                    "serve; use veloxquant generate --draft-model"),
    "kv_bits": ("--kv-bits", "mlx_lm's quantized KV cache is replaced here: use --kv "
                "affine:bits=N,group_size=G"),
    "pipeline": ("--pipeline", "run under mlx.launch with VELOXQUANT_SHARD=pipeline "
                 "(docs/distributed.md)"),
}
DEFAULTS = {"adapter_path": None, "draft_model": None, "kv_bits": None, "pipeline": False}


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--chat-template-args={text!r}: not JSON ({e})") \
            from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--chat-template-args={text!r}: a JSON object "
                                         "is expected")
    return value


def add_mlx_lm_server_arguments(parser: argparse.ArgumentParser) -> None:
    """mlx_lm.server's flags that ``add_serve_arguments`` does not define itself."""
    parser.add_argument("--kv", default=None, metavar="SPEC",
                        help="the compressed cache, e.g. 'turboquant' or 'kivi:bits=4' "
                        "(as veloxquant generate; --method and its option flags too)")
    parser.add_argument("--kv-config", default=None, metavar="FILE",
                        help="a KVCacheConfig JSON file (veloxquant tune --out)")
    parser.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                        help="mlx_lm's spelling of --allow-origin")
    parser.add_argument("--top-p", type=float, default=1.0, help="default top-p")
    parser.add_argument("--top-k", type=int, default=0, help="default top-k")
    parser.add_argument("--min-p", type=float, default=0.0, help="default min-p")
    parser.add_argument("--chat-template", default="", help="a chat template to use")
    parser.add_argument("--use-default-chat-template", action="store_true",
                        help="the tokenizer's default chat template")
    parser.add_argument("--chat-template-args", type=_json_object, default={},
                        help="JSON object of arguments for the chat template")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let the tokenizer run code from the model folder")
    parser.add_argument("--num-draft-tokens", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--kv-group-size", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--quantized-kv-start", type=int, default=0, help=argparse.SUPPRESS)
    for name, (flag, _) in REFUSED.items():
        kind = {"action": "store_true"} if name == "pipeline" else {}
        parser.add_argument(flag, dest=name, default=DEFAULTS[name], help=argparse.SUPPRESS,
                            **kind)


def refuse_unsupported(args: argparse.Namespace) -> None:
    """A ``ConfigError`` naming the first mlx_lm flag set that this server does not offer."""
    for name, (flag, why) in REFUSED.items():
        if getattr(args, name, DEFAULTS[name]) != DEFAULTS[name]:
            raise ConfigError(f"{flag} is not supported by veloxquant serve: {why}")


def kv_config(args: argparse.Namespace, fallback: KVCacheConfig) -> KVCacheConfig:
    """``--kv`` / ``--kv-config`` as ``veloxquant generate`` reads them, else ``fallback``
    (``--method`` and its option flags)."""
    return generate_config(args) or fallback


def mlx_lm_server_flags() -> list[str]:
    """Every option string the installed ``mlx_lm.server`` defines (read from its
    ``main``, which builds its parser inline)."""
    from mlx_lm import server

    tree = ast.parse(inspect.getsource(server.main))
    return [a.value for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "add_argument"
            for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
