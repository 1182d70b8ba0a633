"""Dump real keys (before and after RoPE) and values of all layers for one 2048-token window.

The harness's default text and window (seed 0), prefilled in chunks of 512 through
mlx_lm's dense cache. Per layer ``l`` it saves [2048, H * D] float32 matrices: ``k<l>``
(keys as cached, after RoPE), ``kp<l>`` (RoPE undone) and ``v<l>``. Input of
``scripts/measure/xkv/offline.py``.

    python scripts/measure/xkv/dump.py [--out /tmp/xkv2/kv.npz]
"""

import argparse
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx import models
from veloxquant_mlx.builder import KVCacheBuilder
from veloxquant_mlx.eval.text import encode, load_text, token_windows
from veloxquant_mlx.ops.rope import unrotate

CTX, PRED = 2048, 256


def tokens_by_features(a: mx.array) -> np.ndarray:
    # [1, H, T, D] -> [T, H * D]: one row per token, heads side by side.
    return np.array(a[0].transpose(1, 0, 2).reshape(a.shape[2], -1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/xkv2/kv.npz")
    args = p.parse_args()

    model, tok = models.load()
    win = token_windows(encode(tok, load_text(None)), CTX + PRED, 1, seed=0)[0]
    caches = make_prompt_cache(model)
    x = mx.array(win[:CTX])[None]
    for i in range(0, CTX, 512):
        model(x[:, i:i + 512], cache=caches)
        mx.eval([c.keys for c in caches])
    infos = KVCacheBuilder.layer_infos(model)
    out = {}
    for lay, (c, info) in enumerate(zip(caches, infos)):
        k = c.keys[:, :, :CTX].astype(mx.float32)
        v = c.values[:, :, :CTX].astype(mx.float32)
        kp = unrotate(k, info.rope_dims, info.rope_base, info.rope_traditional,
                      info.rope_scale, 0)
        out[f"k{lay}"] = tokens_by_features(k)
        out[f"kp{lay}"] = tokens_by_features(kp)
        out[f"v{lay}"] = tokens_by_features(v)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **out)
    print("done", len(caches), out["k0"].shape)


if __name__ == "__main__":
    main()
