"""Design points (JSON lines) for scripts/measure/xkv/offline.py: basis on 1024, rest projected.

    python scripts/measure/xkv/gen2.py | python scripts/measure/xkv/offline.py
"""

import json

for st in ["kp", "v", "k"]:
    for G in [4, 2, 1]:
        for r in {4: [96, 128, 192], 2: [64, 96, 128], 1: [32, 48, 64]}[G]:
            for bits in [8, 4]:
                print(json.dumps(dict(stream=st, G=G, block=1024, r=r, bits=bits)))
