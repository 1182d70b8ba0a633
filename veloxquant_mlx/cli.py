"""The ``veloxquant`` command: generate, methods, demo, eval, bench, serve."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from .config import KVCacheConfig


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """``--method`` and one ``--<option>`` flag per ``KVCacheConfig`` field."""
    parser.add_argument("--method", default="none", help="compression method (see `methods`)")
    for f in dataclasses.fields(KVCacheConfig):
        if f.name in ("method", "extra"):
            continue
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, dest=f.name, default=None, metavar="VALUE",
                            help=f"KVCacheConfig.{f.name} (default: {f.default!r})")


def config_from_args(args: argparse.Namespace) -> KVCacheConfig:
    """Build the config from the flags that were given (others keep their defaults)."""
    from .config import _parse_value

    options: dict[str, Any] = {}
    for f in dataclasses.fields(KVCacheConfig):
        value = getattr(args, f.name, None)
        if f.name in ("method", "extra") or value is None:
            continue
        options[f.name] = _parse_value(value) if isinstance(value, str) else value
    return KVCacheConfig(method=args.method, **options)


def cmd_methods(args: argparse.Namespace) -> int:
    from .registry import list_methods

    rows = list_methods()
    cols = ["name", "family", "status", "paper"]
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in cols))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import mlx_lm

    from .builder import KVCacheBuilder, cache_stats
    from .models import load

    config = config_from_args(args)
    model, tokenizer = load(args.model)
    prompt = args.prompt
    if args.chat or (args.chat is None and tokenizer.chat_template):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    caches = KVCacheBuilder.for_model(model, config)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                           prompt_cache=caches, verbose=args.verbose)
    if not args.verbose:
        print(text)
    s = cache_stats(caches)
    print(f"[veloxquant] method={config.method} held={s['held_bytes']} B "
          f"fp16-equivalent={s['fp16_bytes']} B ratio={s['ratio']:.3f}", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(method=args.method_spec, context=args.context)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="veloxquant", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list the compression methods")
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser("generate", help="generate text with a compressed KV cache")
    p.add_argument("--model", default=None, help="model path / repo id (default: embedded)")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--max-tokens", "-m", type=int, default=100)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: when the tokenizer has one)")
    p.add_argument("--verbose", action="store_true", help="stream tokens and print speeds")
    add_method_arguments(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="dense vs compressed on the embedded model")
    p.add_argument("--method", dest="method_spec", default="affine:bits=4",
                   help="method spec, e.g. 'affine:bits=4' or 'xkv:rank_k=64'")
    p.add_argument("--context", type=int, default=1024, help="tokens of context to measure")
    p.set_defaults(func=cmd_demo)

    # eval / bench subcommands

    # serve subcommand

    return parser


def main(argv: list[str] | None = None) -> int:
    from .integration.blas import ensure_fast_blas

    ensure_fast_blas(argv)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
