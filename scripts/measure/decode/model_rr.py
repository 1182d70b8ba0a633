"""Whole-model decode speed, round-robin: after vs before (a renamed old package) vs dense.

2048 tokens of the repository's README.md (repeated; only speed is measured) are
prefilled in chunks of 512 through each cache set; then every round each set decodes one
teacher-forced step (order rotated per round). Prints median step ms, the ratio to
dense, and held / accounted bytes.

The "before" package is the tree of the commit before the change (facd286) with the
package renamed to ``vq_before`` (``git archive facd286``, then ``veloxquant_mlx.`` ->
``vq_before.`` in its registry and imports), placed in ``--before-dir``; without it only
the current caches run.

    PYTHONPATH=. python scripts/measure/decode/model_rr.py [rounds] [--before-dir DIR]
"""

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

import veloxquant_mlx as new
from veloxquant_mlx import models

CTX = 2048
SPECS = ["none", "affine:bits=4", "affine:bits=8", "streaming", "snapkv"]
README = Path(__file__).resolve().parents[3] / "README.md"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rounds", nargs="?", type=int, default=30)
    p.add_argument("--before-dir", default="/tmp/beforepkg",
                   help="folder holding the renamed old package vq_before")
    args = p.parse_args()
    rounds = args.rounds

    pkgs = [(new, "after")]
    if (Path(args.before_dir) / "vq_before").is_dir():
        sys.path.insert(0, args.before_dir)
        old = importlib.import_module("vq_before")
        pkgs.append((old, "before"))
    else:
        old = None
        print(f"no vq_before under {args.before_dir}: timing the current caches only")

    model, tok = models.load()
    new.integration.mlx_lm.install_attention_routing(model)
    if old is not None:
        old.integration.mlx_lm._ACTIVE = True  # the old package's routing switch
    ids = tok.encode(README.read_text() * 20)[:CTX + rounds + 2]
    assert len(ids) >= CTX + rounds + 1, len(ids)
    sets = {}
    for pkg, tag in pkgs:
        for spec in SPECS:
            if spec == "none" and tag == "before":
                continue
            caches = pkg.KVCacheBuilder.for_model(model, pkg.KVCacheConfig.from_string(spec))
            prompt = mx.array(ids[:CTX])
            for s in range(0, CTX, 512):
                mx.eval(model(prompt[None, s:s + 512], cache=caches), [c.state for c in caches])
            sets[f"{spec} ({tag})" if spec != "none" else "none"] = caches
            print("prefilled", spec, tag, flush=True)
    names = list(sets)
    times = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            mx.eval(model(mx.array([[ids[CTX + r]]]), cache=sets[n]))
            times[n].append(time.perf_counter() - t0)
    ref = statistics.median(times["none"])
    for n in names:
        med = statistics.median(times[n])
        st = old.cache_stats(sets[n]) if "(before)" in n else new.cache_stats(sets[n])
        print(f"| {n} | {med * 1e3:.1f} | {ref / med:.2f} | {st['held_bytes']} | "
              f"{st['accounted_bytes']} |")


if __name__ == "__main__":
    main()
