"""Design points (JSON lines) for scripts/measure/xkv/offline.py: one SVD over 2048 tokens.

    python scripts/measure/xkv/gen3.py | python scripts/measure/xkv/offline.py
"""

import json

for st in ["kp", "v"]:
    for G, rs in [(4, [128, 192, 256, 384]), (2, [64, 96, 128, 192]), (1, [32, 48, 64, 96])]:
        for r in rs:
            for bits in [4, 8]:
                print(json.dumps(dict(stream=st, G=G, block=2048, r=r, bits=bits, reuse=2048)))
