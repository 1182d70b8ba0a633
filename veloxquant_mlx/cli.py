"""The ``veloxquant`` command: generate, methods, demo, eval, bench, tune, serve, doctor."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from veloxquant_mlx import compat
from veloxquant_mlx.config import SHARED, ConfigError, KVCacheConfig, parse_value


def _user_errors() -> tuple[type[Exception], ...]:
    from veloxquant_mlx.adapter.mlx_lm import UnsupportedModelError
    from veloxquant_mlx.apps.prompt_cache import NotTrimmableError, PromptCacheError
    from veloxquant_mlx.models.gguf import GGUFError

    return (ConfigError, UnsupportedModelError, PromptCacheError, NotTrimmableError,
            FileNotFoundError, GGUFError)


def _option_flags() -> dict[str, tuple[str, set[str], list[str]]]:
    """Option field -> (help, aliases, methods) over every registered method."""
    from veloxquant_mlx.registry import methods

    flags: dict[str, tuple[str, set[str], list[str]]] = {}
    for name, cls in methods().items():
        for f in dataclasses.fields(cls.Options):
            help_, aliases, users = flags.setdefault(f.name, ("", set(), []))
            users.append(f"{name}: {f.default!r}")
        for old, new in compat.flag_aliases(cls.Options).items():  # 0.1's flag names
            flags.setdefault(new, ("", set(), []))[1].add(old)
    taken = set(flags)
    return {k: (h, {a for a in al if a not in taken}, u) for k, (h, al, u) in flags.items()}


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """``--method``, ``--config`` and one flag per method option (from the options classes).

    0.1's prefixed flags (``--xkv-rank-k``) still work as aliases (``compat.flag_aliases``).
    """
    parser.add_argument("--method", default=None,
                        help="compression method, or a spec such as 'kivi:bits=4' "
                             "(default: none; see `veloxquant methods`)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="JSON config file (KVCacheConfig.to_file / veloxquant tune); "
                             "flags given beside it override its values")
    for name in SHARED:
        parser.add_argument("--" + name.replace("_", "-"), dest=f"shared_{name}", default=None,
                            metavar="VALUE", help=f"KVCacheConfig.{name}")
    for field, (_, aliases, users) in _option_flags().items():
        # A subcommand's own flag of the same name wins; the prefixed alias remains.
        names = [flag for flag in ("--" + n.replace("_", "-") for n in [field, *sorted(aliases)])
                 if flag not in parser._option_string_actions]
        if names:
            parser.add_argument(*names, dest=f"opt_{field}", default=None, metavar="VALUE",
                                help="option of " + "; ".join(users))


def config_from_args(args: argparse.Namespace) -> KVCacheConfig:
    """The config from ``--config``, ``--method`` and the option flags that were given."""
    values: dict[str, Any] = {}
    for key, value in vars(args).items():
        if value is None or not key.startswith(("opt_", "shared_")):
            continue
        values[key.partition("_")[2]] = parse_value(value) if isinstance(value, str) else value
    if getattr(args, "config", None):
        base = KVCacheConfig.from_file(args.config)
        if args.method is not None and args.method != base.method:
            base = KVCacheConfig.from_string(args.method)
        return base.replace(**values)
    base = KVCacheConfig.from_string(args.method) if args.method else KVCacheConfig()
    return base.replace(**values) if values else base


def cmd_methods(args: argparse.Namespace) -> int:
    from veloxquant_mlx.registry import list_methods

    rows = list_methods()
    for r in rows:
        r["options"] = ", ".join(r["options"]) or "-"
    cols = ["name", "family", "options", "paper"]
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in cols))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from veloxquant_mlx.apps.generate import run_generate

    return run_generate(args)


def cmd_doctor(args: argparse.Namespace) -> int:
    from veloxquant_mlx.apps.doctor import run_doctor

    return run_doctor(args.model, with_model=args.with_model)


def cmd_demo(args: argparse.Namespace) -> int:
    from veloxquant_mlx.apps.demo import run_demo

    return run_demo(method=args.method_spec, context=args.context)


def cmd_serve(args: argparse.Namespace) -> int:
    from veloxquant_mlx.apps.server import serve
    from veloxquant_mlx.apps.server_flags import kv_config, refuse_unsupported

    refuse_unsupported(args)
    serve(args, kv_config(args, config_from_args(args)))
    return 0


def add_common_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``eval`` and ``bench``."""
    parser.add_argument("--model", default=None, help="model path / repo id (default: embedded)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="activations and weights of a GGUF model (the embedded one "
                             "included); default float32 on a CPU")
    parser.add_argument("--text", default=None,
                        help="UTF-8 text file to evaluate on (default: stdlib docstrings)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--json", default=None,
                        help="also write the full record (per-window / per-block stats, "
                             "command line, versions, seeds) to this JSON file")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes that run in about a minute on the embedded model "
                             "(explicit options still win)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def _eval_specs(args: argparse.Namespace) -> list[Any]:
    from veloxquant_mlx.eval.perplexity import parse_specs

    if args.methods:
        return [label for label, _ in parse_specs(args.methods)]
    return [config_from_args(args)]


def cmd_eval(args: argparse.Namespace) -> int:
    from veloxquant_mlx.apps.distributed import load_for_ranks
    from veloxquant_mlx.eval.sweep import (
        EVAL_FULL,
        EVAL_QUICK,
        eval_markdown,
        run_eval,
        write_eval_outputs,
    )
    from veloxquant_mlx.eval.text import load_text

    specs = _eval_specs(args)  # bad specs fail before the model loads
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()] if args.contexts \
        else None
    params = {"contexts": contexts, "predict": args.predict, "windows": args.windows,
              "block": args.block, "n_boot": args.boot, "samples": args.samples,
              "memory_steps": args.memory_steps}
    defaults = EVAL_QUICK if args.quick else EVAL_FULL
    params = {k: (defaults[k] if v is None else v) for k, v in params.items()}
    depths = [float(d) for d in args.depths.split(",") if d.strip()]
    text = load_text(args.text)
    model, tokenizer = load_for_ranks(args.model, args, specs)  # sharded under mlx.launch
    record = run_eval(model, tokenizer, specs, args.task, params, text=text,
                      text_name=args.text, seed=args.seed, chunk=args.chunk, recon=args.recon,
                      depths=depths, n_needles=args.needles, max_tokens=args.max_new_tokens,
                      progress=args.progress, prompt_format=args.prompt_format,
                      peak=args.peak)
    print(eval_markdown(record))
    for path in write_eval_outputs(record, args.json, args.plot):
        print(f"wrote {path}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.matmul:
        from veloxquant_mlx.eval import matmul_bench

        matmul_bench.main([])
        return 0
    if args.kernels or args.calibrate_kernels:
        from veloxquant_mlx.eval.kernel_table import render

        print(render(calibrate=args.calibrate_kernels))
        return 0
    from veloxquant_mlx.eval.perplexity import parse_specs
    from veloxquant_mlx.eval.report import write_json
    from veloxquant_mlx.eval.sweep import run_sweep
    from veloxquant_mlx.models import load

    parse_specs(args.methods)  # bad specs fail before the model loads
    if args.fit:
        from veloxquant_mlx.eval.fit import run_fit
        from veloxquant_mlx.eval.text import encode, load_text

        try:
            budgets = [_parse_bytes(b) for b in args.fit.split(",") if b.strip()]
        except ConfigError:
            budgets = []
        if not budgets or min(budgets) <= 0:
            raise ConfigError(f"--fit={args.fit!r} is not allowed: budgets over the "
                              "weights such as 256MB or 128MiB,1GB")
        model, tokenizer = load(args.model, dtype=args.dtype)
        rec = run_fit(model, encode(tokenizer, load_text(args.text)), args.methods, budgets,
                      args.out, args.fit_step, args.fit_cap, progress=args.progress)
        with open(rec["files"]["md"], encoding="utf-8") as f:
            print(f.read())
        print(f"wrote {rec['files']['json']}, {rec['files']['md']}")
        return 0
    contexts = None
    if args.contexts:
        contexts = tuple(int(c) for c in args.contexts.split(",") if c.strip())
    model, tokenizer = load(args.model, dtype=args.dtype)
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


def _parse_bytes(text: str) -> int:
    """``"2GB"``, ``"512MiB"``, ``"1e9"`` -> bytes."""
    units = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20,
             "gib": 2**30}
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        if unit not in units:
            raise ValueError(unit)
        return int(float(num) * units[unit])
    except ValueError:
        raise ConfigError(f"--max-memory={text!r} is not allowed: a size such as 2GB, "
                          "512MiB or 1e9") from None


def _parse_budgets(text: str) -> list[float]:
    try:
        out = [float(b) for b in text.split(",") if b.strip()]
    except ValueError:
        out = []
    if not out:
        raise ConfigError(f"--budget={text!r} is not allowed: a fraction of fp16 such as "
                          "0.2, or a comma-separated list such as 0.5,0.25,0.125")
    return out


def cmd_tune(args: argparse.Namespace) -> int:
    from veloxquant_mlx.eval.text import load_text
    from veloxquant_mlx.eval.tune import (
        FULL,
        QUICK,
        NoFit,
        TuneParams,
        budget_for_memory,
        frontier_markdown,
        run_frontier,
        run_tune,
        tune_markdown,
    )
    from veloxquant_mlx.models import load

    if (args.budget is None) == (args.max_memory is None):
        raise ConfigError("tune: give exactly one of --budget (a fraction of fp16) and "
                          "--max-memory (with --context)")
    budgets = _parse_budgets(args.budget) if args.budget is not None else []
    defaults = dict(QUICK if args.quick else FULL)
    context = args.context or defaults.pop("context", 2048)
    defaults.pop("context", None)
    defaults.update({k: getattr(args, k) for k in ("predict", "windows", "per_method",
                                                   "finalists", "min_decode", "chunk")
                     if getattr(args, k) is not None})
    model, tokenizer = load(args.model)
    if not budgets:
        budgets = [budget_for_memory(model, _parse_bytes(args.max_memory), context)]
    try:
        params = TuneParams(budget=budgets[0], context=context, seed=args.seed,
                            only=tuple(m for m in (args.only or "").split(",") if m),
                            **defaults)
    except ValueError as exc:  # an option out of range: the user's to fix
        raise ConfigError(str(exc)) from exc
    text = load_text(args.text)
    if len(budgets) > 1:
        result = run_frontier(model, tokenizer, params, budgets, args.out, text=text,
                              progress=args.progress)
        print(frontier_markdown(result))
        print(f"wrote {args.out} (one result per budget under 'frontier')")
        return 0
    try:
        result = run_tune(model, tokenizer, params, args.out, text=text,
                          progress=args.progress)
    except NoFit as exc:  # an answer about the model, not a failure
        raise ConfigError(str(exc)) from exc
    print(tune_markdown(result))
    print(f"wrote {args.out} (load it with generate --kv-config {args.out}, or eval / "
          f"serve --config {args.out})")
    return 0


def _add_tune_parser(sub: Any) -> None:
    """The ``tune`` subcommand: the best config for a memory budget."""
    p = sub.add_parser("tune", help="measure candidate configs; write the best one for a "
                       "memory budget")
    p.add_argument("--budget", default=None,
                   help="KV bytes allowed, as a fraction of fp16 (e.g. 0.2); a "
                   "comma-separated list prints the frontier (one choice per budget)")
    p.add_argument("--max-memory", default=None,
                   help="KV bytes allowed at --context (e.g. 2GB); instead of --budget")
    p.add_argument("--context", type=int, default=None,
                   help="tokens of context to tune for (default 2048; --quick 1024)")
    p.add_argument("--only", default=None, help="comma-separated methods to consider")
    p.add_argument("--predict", type=int, default=None,
                   help="decode tokens a finalist is scored on per window (default 128; "
                   "--quick 64)")
    p.add_argument("--windows", type=int, default=None,
                   help="text windows: one per round of screens, every one for the "
                   "finalists (default 4; --quick 2)")
    p.add_argument("--per-method", type=int, default=None,
                   help="candidates per family whose quality is screened, the largest "
                   "within the budget (default 2; --quick 1)")
    p.add_argument("--finalists", type=int, default=None,
                   help="best screened candidates measured at a time with paired "
                   "intervals on every window (default 2)")
    p.add_argument("--min-decode", type=float, default=None, metavar="X",
                   help="also require decode tokens/s >= X times dense's at --context, "
                   "measured beside dense's in the same run (e.g. 1.0)")
    p.add_argument("--out", required=True, help="JSON file for the result")
    add_common_eval_arguments(p)
    p.set_defaults(func=cmd_tune)


def _add_eval_parser(sub: Any) -> None:
    """The ``eval`` subcommand and its options."""
    p = sub.add_parser("eval", help="paired quality / retrieval of methods vs dense")
    p.add_argument("--methods", default=None,
                   help="comma-separated method specs, e.g. 'none,affine:bits=4,xkv:rank_k=64' "
                        "(default: the one given by --method and its option flags)")
    p.add_argument("--task", default="ppl",
                   choices=["ppl", "passkey", "needle", "needle_multi", "kv"])
    p.add_argument("--contexts", "--context", dest="contexts", default=None,
                   help="contexts in tokens, e.g. 2048,4096,8192 (default 2048; --quick 512)")
    p.add_argument("--predict", type=int, default=None,
                   help="ppl: tokens scored per window (default 256; --quick 64)")
    p.add_argument("--windows", type=int, default=None,
                   help="ppl: windows per context (default 8 up to 2k, 4 beyond; --quick 2)")
    p.add_argument("--block", type=int, default=None,
                   help="ppl: bootstrap block, in tokens (default 32; --quick 16)")
    p.add_argument("--boot", type=int, default=None, help="ppl: bootstrap resamples")
    p.add_argument("--memory-steps", type=int, default=None,
                   help="decode steps of the real-memory measurement (default 16)")
    p.add_argument("--no-peak", dest="peak", action="store_false",
                   help="leave out the peak table (a run per method and of mlx_lm's dense "
                        "and 4-bit caches at each context: long at long contexts, where "
                        "mlx_lm's 4-bit attention is slow on a CPU)")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9",
                   help="retrieval: needle depths in [0, 1], used round-robin")
    p.add_argument("--samples", type=int, default=None,
                   help="retrieval: samples per method and context (default 20; --quick 6)")
    p.add_argument("--needles", type=int, default=4, help="needle_multi / kv: needles / pairs")
    p.add_argument("--max-new-tokens", type=int, default=16, help="retrieval: answer length")
    p.add_argument("--prompt-format", choices=("auto", "chat", "plain"), default="auto",
                   help="retrieval: the chat template when the tokenizer has one (auto), "
                   "or plain text for a base model that continues text (plain)")
    p.add_argument("--recon", action="store_true",
                   help="ppl: per-layer K/V reconstruction error vs dense")
    p.add_argument("--plot", default=None,
                   help="ppl: write the real-memory vs ppl/KL plot to this PNG "
                        "(one per context, suffixed, when there are several)")
    add_common_eval_arguments(p)
    add_method_arguments(p)
    p.set_defaults(func=cmd_eval)


def _add_bench_parser(sub: Any) -> None:
    """The ``bench`` subcommand and its options."""
    p = sub.add_parser("bench", help="memory, speed and quality sweep (JSON, Markdown, PNG)")
    p.add_argument("--methods", default="none,affine:bits=4,affine:bits=8",
                   help="comma-separated method specs")
    p.add_argument("--contexts", default=None, help="bench contexts, e.g. 512,2048,4096")
    p.add_argument("--context", type=int, default=None, help="context of the perplexity part")
    p.add_argument("--predict", type=int, default=None)
    p.add_argument("--windows", type=int, default=None)
    p.add_argument("--decode-steps", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (median)")
    p.add_argument("--out", default="bench-out", help="output folder")
    p.add_argument("--matmul", action="store_true",
                   help="only compare CPU matmul throughput with / without a fast BLAS")
    p.add_argument("--kernels", action="store_true",
                   help="only print which attention path each kind of codes takes here")
    p.add_argument("--calibrate-kernels", action="store_true",
                   help="measure every attention path now, record the choices, print them")
    p.add_argument("--fit", default=None, metavar="BUDGETS",
                   help="only find, per method, the longest context whose measured peak "
                        "over the weights fits each budget (e.g. 256MB or 128MiB,1GB); "
                        "writes fit.json and fit.md into --out")
    p.add_argument("--fit-step", type=int, default=256,
                   help="--fit: contexts are multiples of this many tokens")
    p.add_argument("--fit-cap", type=int, default=None,
                   help="--fit: longest context tried (default: model limit / text length)")
    add_common_eval_arguments(p)
    p.set_defaults(func=cmd_bench)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that runs its ``checks`` on what it parsed, so that a
    subcommand refuses a command line through its own parser (usage and exit 2)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checks: list[Callable[[argparse.Namespace], str | None]] = []

    def parse_known_args(self, args: Any = None, namespace: Any = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        for check in self.checks:
            problem = check(parsed)
            if problem:
                self.error(problem)
        return parsed, rest


def _add_generate_parser(sub: Any) -> None:
    """``generate``: mlx_lm.generate's own flags, plus ``--kv`` / ``--kv-config``."""
    from veloxquant_mlx.apps.generate import (
        add_generate_arguments,
        generate_parents,
        old_flags_problem,
    )

    p = sub.add_parser("generate", parents=generate_parents(), add_help=False,
                       help="generate text with a compressed KV cache (mlx_lm.generate's "
                       "flags, plus --kv SPEC)",
                       description="mlx_lm.generate over a compressed KV cache: the same "
                       "flags, plus --kv SPEC / --kv-config FILE for the method.")
    add_generate_arguments(p, {field: aliases for field, (_, aliases, _) in
                               _option_flags().items()})
    p.checks.append(old_flags_problem)
    p.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="veloxquant", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list the compression methods")
    p.set_defaults(func=cmd_methods)

    _add_generate_parser(sub)

    p = sub.add_parser("doctor", help="what is active here (versions, extension, BLAS, "
                       "device, attention paths) and what each method does with a model")
    p.add_argument("--model", default=None,
                   help="model whose layers to examine (default: the embedded model)")
    p.add_argument("--no-model", dest="with_model", action="store_false",
                   help="skip the model part (no model is loaded)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("demo", help="dense vs compressed on the embedded model")
    p.add_argument("--method", dest="method_spec", default=None,
                   help="method spec, e.g. 'kivi:bits=2' (default: the recommended method)")
    p.add_argument("--context", type=int, default=2048, help="tokens of context to measure")
    p.set_defaults(func=cmd_demo)

    # eval / bench subcommands
    _add_eval_parser(sub)
    _add_bench_parser(sub)
    _add_tune_parser(sub)

    # serve subcommand
    from veloxquant_mlx.apps.server import add_serve_arguments
    from veloxquant_mlx.apps.server_flags import add_mlx_lm_server_arguments

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (mlx_lm.server) "
                       "with compressed caches")
    add_serve_arguments(p)
    add_mlx_lm_server_arguments(p)
    add_method_arguments(p)
    p.set_defaults(func=cmd_serve)

    return parser


def main(argv: list[str] | None = None) -> int:
    from veloxquant_mlx.apps.blas import ensure_fast_blas

    ensure_fast_blas(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except _user_errors() as exc:
        # What the user asked for is not allowed: say so, without a traceback.
        parser.exit(2, f"veloxquant {args.command}: error: {exc}\n")


if __name__ == "__main__":
    raise SystemExit(main())
