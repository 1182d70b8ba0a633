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


def cmd_serve(args: argparse.Namespace) -> int:
    from .integration.server import serve

    serve(args, config_from_args(args))
    return 0


def add_common_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``eval`` and ``bench``."""
    parser.add_argument("--model", default=None, help="model path / repo id (default: embedded)")
    parser.add_argument("--text", default=None,
                        help="UTF-8 text file to evaluate on (default: stdlib docstrings)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def _eval_specs(args: argparse.Namespace) -> list[Any]:
    from .eval.perplexity import parse_specs

    if args.methods:
        return [label for label, _ in parse_specs(args.methods)]
    return [config_from_args(args)]


def cmd_eval(args: argparse.Namespace) -> int:
    from .eval.perplexity import evaluate_methods
    from .eval.report import markdown_table, run_record, write_json
    from .eval.text import load_text
    from .models import load

    specs = _eval_specs(args)  # bad specs fail before the model loads
    text = load_text(args.text)
    model, tokenizer = load(args.model)
    if args.task == "ppl":
        rows = evaluate_methods(model, tokenizer, specs, args.context, args.predict,
                                args.windows, text=text, seed=args.seed, chunk=args.chunk,
                                recon=args.recon, progress=args.progress)
        print(f"perplexity of {args.predict} tokens after {args.context} tokens of context, "
              f"{args.windows} window(s), seed {args.seed}")
        print(markdown_table(rows))
    else:
        from .eval.report import _fmt
        from .eval.retrieval import evaluate_retrieval

        depths = [float(d) for d in args.depths.split(",") if d.strip()]
        rows = evaluate_retrieval(model, tokenizer, specs, args.task, args.context, depths,
                                  args.samples, args.seed, args.needles, args.max_new_tokens,
                                  args.chunk, text=text, progress=args.progress)
        print(f"task {args.task}, context {args.context}, depths {depths}, "
              f"{args.samples} sample(s) per depth, seed {args.seed}")
        print("| method | accuracy | by depth | held/fp16 |\n|---|---|---|---|")
        for r in rows:
            depth = ", ".join(f"{d}: {a:.2f}" for d, a in r["by_depth"].items())
            print(f"| {r['method']} | {r['accuracy']:.2f} | {depth} | {_fmt(r['mem_ratio'])} |")
    if args.json:
        write_json(args.json, run_record(rows=rows, seed=args.seed, task=args.task))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.matmul:
        from .eval import matmul_bench

        matmul_bench.main([])
        return 0
    from .eval.perplexity import parse_specs
    from .eval.report import write_json
    from .eval.sweep import run_sweep
    from .models import load

    parse_specs(args.methods)  # bad specs fail before the model loads
    contexts = None
    if args.contexts:
        contexts = tuple(int(c) for c in args.contexts.split(",") if c.strip())
    model, tokenizer = load(args.model)
    record = run_sweep(model, tokenizer, args.methods, args.out, quick=args.quick,
                       contexts=contexts, eval_context=args.context, predict=args.predict,
                       windows=args.windows, decode_steps=args.decode_steps,
                       repeats=args.repeats, text_path=args.text, seed=args.seed,
                       chunk=args.chunk, progress=args.progress)
    with open(record["files"]["md"], encoding="utf-8") as f:
        print(f.read())
    print(f"wrote {record['files']['json']}, {record['files']['md']}, {record['files']['png']}")
    if args.json:
        write_json(args.json, record)
    return 0


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
    p = sub.add_parser("eval", help="perplexity / retrieval of methods vs dense")
    p.add_argument("--methods", default=None,
                   help="comma-separated method specs, e.g. 'none,affine:bits=4,xkv:rank_k=64' "
                        "(default: the one given by --method and its option flags)")
    p.add_argument("--task", default="ppl",
                   choices=["ppl", "passkey", "needle", "needle_multi", "kv"])
    p.add_argument("--context", type=int, default=2048, help="tokens of context")
    p.add_argument("--predict", type=int, default=256, help="ppl: tokens scored after it")
    p.add_argument("--windows", type=int, default=2, help="ppl: text windows")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="retrieval: needle depths in [0, 1]")
    p.add_argument("--samples", type=int, default=1, help="retrieval: samples per depth")
    p.add_argument("--needles", type=int, default=4, help="needle_multi / kv: needles / pairs")
    p.add_argument("--max-new-tokens", type=int, default=16, help="retrieval: answer length")
    p.add_argument("--recon", action="store_true",
                   help="ppl: per-layer K/V reconstruction error vs dense")
    add_common_eval_arguments(p)
    add_method_arguments(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("bench", help="memory, speed and quality sweep (JSON, Markdown, PNG)")
    p.add_argument("--methods", default="none,affine:bits=4,affine:bits=8",
                   help="comma-separated method specs")
    p.add_argument("--contexts", default=None, help="bench contexts, e.g. 512,2048,4096")
    p.add_argument("--context", type=int, default=None, help="context of the perplexity part")
    p.add_argument("--predict", type=int, default=None)
    p.add_argument("--windows", type=int, default=None)
    p.add_argument("--decode-steps", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (median)")
    p.add_argument("--quick", action="store_true",
                   help="context 512, 1 window, 16 decode steps (minutes on 2 cores)")
    p.add_argument("--out", default="bench-out", help="output folder")
    p.add_argument("--matmul", action="store_true",
                   help="only compare CPU matmul throughput with / without a fast BLAS")
    add_common_eval_arguments(p)
    p.set_defaults(func=cmd_bench)

    # serve subcommand
    from .integration.server import add_serve_arguments

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (mlx_lm.server) "
                       "with compressed caches")
    add_serve_arguments(p)
    add_method_arguments(p)
    p.set_defaults(func=cmd_serve)

    return parser


def main(argv: list[str] | None = None) -> int:
    from .integration.blas import ensure_fast_blas

    ensure_fast_blas(argv)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
