"""Offline xKV design study: reconstruction error vs bytes on real K/V (30 layers, numpy).

Reads design points as JSON lines on stdin (``gen1.py`` .. ``gen3.py``) and the dump of
``scripts/measure/xkv/dump.py``; for each point (stream ``kp``/``k``/``v``, layers per
group ``G``, SVD block, rank ``r``, factor bits, ``reuse``) it prints the point with
``err`` (relative Frobenius error against the mean-centred matrices, all layers) and
``ratio`` (bytes held for the stream relative to fp16, the window not included).
Quantization is simulated as in the cache: affine, float16 scale and bias, member
factors in groups of 64 along D, token factors in groups of 32 along tokens.

    python scripts/measure/xkv/gen1.py | OPENBLAS_NUM_THREADS=1 \
        python scripts/measure/xkv/offline.py [--npz /tmp/xkv2/kv.npz]
"""

import argparse
import json
import sys

import numpy as np

NL, T, D = 30, 2048, 192
Z = None  # the dump, loaded in main()


def qbytes(n: int, bits: int, g: int) -> int:
    return -(-n * bits // 8) + -(-n // g) * 4


def quant(x: np.ndarray, bits: int | None, g: int = 64) -> np.ndarray:
    """Affine quantization along the last axis in groups of g."""
    if bits is None:
        return x.astype(np.float16).astype(np.float32)
    sh = x.shape
    y = x.reshape(-1, g)
    lo, hi = y.min(1, keepdims=True), y.max(1, keepdims=True)
    sc = np.maximum((hi - lo) / (2**bits - 1), 1e-12)
    sc = sc.astype(np.float16).astype(np.float32)
    lo = lo.astype(np.float16).astype(np.float32)
    return (np.clip(np.round((y - lo) / sc), 0, 2**bits - 1) * sc + lo).reshape(sh)


def svd(x: np.ndarray, r: int):
    w, v = np.linalg.eigh((x.T @ x).astype(np.float64))
    v = v[:, ::-1][:, :r].astype(np.float32)
    s = np.sqrt(np.maximum(w[::-1][:r], 0)).astype(np.float32)
    a = (x @ v) / np.maximum(s, 1e-12)
    return a, s[:, None] * v.T, v


def run(stream: str, G: int, block: int, r: int, bits: int | None, reuse: int = 0,
        step: int = 32, nomean: bool = False) -> tuple[float, float]:
    """reuse>0: SVD on blocks of `block` only every `reuse` tokens; others project in `step`s."""
    err = nrm = byts = dense = 0.0
    for g0 in range(0, NL, G):
        ls = list(range(g0, min(g0 + G, NL)))
        g = len(ls)
        X = np.concatenate([Z[f"{stream}{lay}"] for lay in ls], 1)
        Xc = X - X.mean(0)
        nrm += (Xc**2).sum()
        dense += 2 * X.size
        t = 0
        basis = None
        while t < T:
            fit = basis is None or (reuse and t % reuse == 0)
            n = block if fit else step
            x = X[t:t + n]
            if fit:
                m = np.zeros((1, x.shape[1]), np.float32) if nomean else x.mean(0, keepdims=True)
                a, b, v = svd(x - m, min(r, n))
                if bits:
                    bq = quant(b.reshape(-1, D), bits).reshape(b.shape)
                else:
                    bq = b.astype(np.float16).astype(np.float32)
                basis = (bq, v, m, np.linalg.pinv(bq))
                byts += (qbytes(b.size, bits, 64) if bits else 2 * b.size) + 2 * g * D
            else:
                bq, v, m, pb = basis
                a = (x - m) @ pb  # least squares token factor on the held B
            aq = quant(a.T, bits, 32).T if bits else a.astype(np.float16).astype(np.float32)
            byts += qbytes(a.size, bits, 32) if bits else 2 * a.size
            xh = aq @ bq + m
            err += ((x - xh) ** 2).sum()
            t += n
    return np.sqrt(err / nrm), byts / dense


def main() -> None:
    global Z
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--npz", default="/tmp/xkv2/kv.npz")
    args = p.parse_args()
    Z = np.load(args.npz)
    for line in sys.stdin:
        kw = json.loads(line)
        e, b = run(**kw)
        print(json.dumps(dict(kw, err=round(float(e), 4), ratio=round(float(b), 4))), flush=True)


if __name__ == "__main__":
    main()
