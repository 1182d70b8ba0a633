"""Perplexity / memory / decode-speed table of method specs over ``evaluate_methods``.

The small script used before the ``eval`` command existed: one call of
``evaluate_methods(model, tok, specs, context, predict, windows)`` on the embedded model,
printed as a markdown table.

    python scripts/measure/minicache/mc_eval.py CONTEXT PREDICT WINDOWS SPEC [SPEC ...]
"""

import argparse

from veloxquant_mlx.eval.perplexity import evaluate_methods
from veloxquant_mlx.models import load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("context", type=int)
    p.add_argument("predict", type=int)
    p.add_argument("windows", type=int)
    p.add_argument("specs", nargs="+", help='e.g. none "minicache:window=64"')
    args = p.parse_args()

    model, tok = load()
    rows = evaluate_methods(model, tok, args.specs, context=args.context,
                            predict=args.predict, windows=args.windows)
    print("| method | held MB | mem ratio | acc/held | ppl | ppl ratio | decode tok/s "
          "| decode ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['held_bytes'] / 1e6:.2f} | {r['mem_ratio']:.3f} | "
              f"{r['accounted_over_held']:.3f} | {r['ppl']:.3f} | {r['ppl_ratio']:.3f} | "
              f"{r['decode_tok_s']:.2f} | {r['decode_ratio']:.2f} |")


if __name__ == "__main__":
    main()
