"""Dump the real K/V of every layer of the embedded model for one 2048-token window.

The harness's default text and window (seed 0), dense cache, prefill in chunks of 512;
each layer's keys and values are saved as float32 ``k<i>`` / ``v<i>`` [1, H, 2048, D].
Input of ``scripts/measure/minicache/offline.py``.

    python scripts/measure/minicache/dump.py [--out /tmp/mc2/kv.npz]
"""

import argparse
from pathlib import Path

import mlx.core as mx
import numpy as np

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.eval.text import encode, load_text, token_windows
from veloxquant_mlx.models import load

CTX, PRED = 2048, 256


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/mc2/kv.npz")
    args = p.parse_args()

    model, tok = load()
    toks = token_windows(encode(tok, load_text()), CTX + PRED, 1, 0)[0]
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="none"))
    prompt = mx.array(toks[:CTX])
    for s in range(0, CTX, 512):
        model(prompt[None, s:s + 512], cache=caches)
        mx.eval([c.state for c in caches])
    out = {}
    for i, c in enumerate(caches):
        k, v = c.state[:2] if isinstance(c.state, (list, tuple)) else c.state
        out[f"k{i}"] = np.array(k[..., :CTX, :].astype(mx.float32))
        out[f"v{i}"] = np.array(v[..., :CTX, :].astype(mx.float32))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **out)
    print(out["k0"].shape)


if __name__ == "__main__":
    main()
