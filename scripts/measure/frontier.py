"""The memory/quality frontier of every tuned method on the embedded model.

``veloxquant tune`` at several budgets on one journal (``eval.tune.run_frontier``): each
candidate's real bytes and paired quality are measured once for all budgets; the
result (one tune result per budget) goes to ``--out`` and a Markdown table to stdout.

    .venv/bin/python scripts/measure/frontier.py --out /tmp/frontier.json \
        --budgets 0.5,0.35,0.25,0.18,0.125,0.10 --context 2048 --predict 128 --windows 2 \
        --only turboquant,streaming,xkv
"""

from __future__ import annotations

import argparse

from veloxquant_mlx.integration.blas import ensure_fast_blas


def main() -> None:
    ensure_fast_blas()
    from veloxquant_mlx import models
    from veloxquant_mlx.eval.text import load_text
    from veloxquant_mlx.eval.tune import TuneParams, frontier_markdown, run_frontier

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budgets", default="0.5,0.35,0.25,0.18,0.125,0.10")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--predict", type=int, default=128)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--per-method", type=int, default=2)
    ap.add_argument("--only", default="")
    ap.add_argument("--text", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, tokenizer = models.load()
    params = TuneParams(budget=1.0, context=args.context, predict=args.predict,
                        windows=args.windows, per_method=args.per_method, seed=args.seed,
                        only=tuple(m for m in args.only.split(",") if m))
    budgets = [float(b) for b in args.budgets.split(",")]
    result = run_frontier(model, tokenizer, params, budgets, args.out,
                          text=load_text(args.text), progress=False)
    print(frontier_markdown(result))


if __name__ == "__main__":
    main()
