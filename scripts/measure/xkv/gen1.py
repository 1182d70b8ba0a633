"""Design points (JSON lines) for scripts/measure/xkv/offline.py: block 512 and 2048 modes.

    python scripts/measure/xkv/gen1.py | python scripts/measure/xkv/offline.py
"""

import json

rows = []
for st in ["kp", "v", "k"]:
    for G in [4, 1]:
        for r in [64, 128, 256] if G == 4 else [32, 64, 128]:
            for bits in [8, 4]:
                rows.append(dict(stream=st, G=G, block=512, r=r, bits=bits))  # project after 512
                if bits == 8:
                    # SVD per 512 block, and one SVD over all 2048 tokens
                    rows.append(dict(stream=st, G=G, block=512, r=r, bits=bits, reuse=512))
                    rows.append(dict(stream=st, G=G, block=2048, r=r, bits=bits, reuse=2048))
for x in rows:
    print(json.dumps(x))
