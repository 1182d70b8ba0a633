"""Per-pair reconstruction error of MiniCache's merge on real K/V (offline, seconds).

Reads the dump of ``scripts/measure/minicache/dump.py``; merges every adjacent layer
pair through ``MiniCacheCoordinator`` (t=0.5, gamma=0.05, one block of 2048 tokens,
no window) with the ``fraction`` and ``paper`` retention rules and prints a markdown
table: mean normalized angular distance, relative error ||x_hat - x|| / ||x|| averaged
over the pair's two layers, and the share of tokens the paper rule retains.

    python scripts/measure/minicache/offline.py [--npz /tmp/mc2/kv.npz]
"""

import argparse

import mlx.core as mx
import numpy as np

from veloxquant_mlx.cache.minicache_coordinator import MiniCacheCoordinator, slerp_merge

CTX = 2048


def rel(a: mx.array, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.array(a) - b) / np.linalg.norm(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--npz", default="/tmp/mc2/kv.npz")
    args = p.parse_args()

    d = np.load(args.npz)
    print("| pair | mean d (K) | mean d (V) | K err, fraction | V err, fraction "
          "| K err, paper | V err, paper | paper retained K/V |")
    print("|---|---|---|---|---|---|---|---|")
    for lay in range(0, 29, 2):
        row = [f"{lay}-{lay + 1}"]
        x = {n: mx.array(d[f"{n}{lay}"]) for n in "kv"}
        y = {n: mx.array(d[f"{n}{lay + 1}"]) for n in "kv"}
        for n in "kv":
            row.append(f"{slerp_merge(x[n], y[n], 0.5)[3].mean().item():.3f}")
        res = {}
        for rule in ("fraction", "paper"):
            c = MiniCacheCoordinator(window=0, rule=rule)  # gamma 0.05, t 0.5, whole window
            c.publish(0, 0, x["k"], x["v"])
            c.consume(0, 1, 0, y["k"], y["v"])
            k0, v0 = c.reconstruct(0, 0, mx.float32)
            k1, v1 = c.reconstruct(0, 1, mx.float32)
            res[rule] = (
                (rel(k0, d[f"k{lay}"]) + rel(k1, d[f"k{lay + 1}"])) / 2,
                (rel(v0, d[f"v{lay}"]) + rel(v1, d[f"v{lay + 1}"])) / 2,
                c.store(0).n_retained())
        for rule in ("fraction", "paper"):
            row += [f"{res[rule][0]:.3f}", f"{res[rule][1]:.3f}"]
        rk, rv = res["paper"][2]
        row.append(f"{rk / CTX:.1%} / {rv / CTX:.1%}")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
