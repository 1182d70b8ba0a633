"""``veloxquant bench --kernels`` / ``--calibrate-kernels``: which attention path each kind
of stored codes takes on this backend, with the timings behind the choice."""

from __future__ import annotations

from veloxquant_mlx.ops import kernels, native


def render(calibrate: bool = False) -> str:
    """A Markdown table of every default shape class (measured now if ``calibrate``)."""
    rows = kernels.calibrate() if calibrate else kernels.table()
    head = [f"Attention paths on {kernels.device_key()} (ms per decode step over "
            f"{kernels.MEASURE_TOKENS} tokens x {kernels.HEADS} KV heads; choices cached in "
            f"{kernels._cache_file()}; {kernels.ENV}=floats|packed forces one)", "",
            "| codes | bits | group | head dim | side | path | floats ms | packed ms | decided |",
            "|---|---|---|---|---|---|---|---|---|"]
    head[2:2] = [f"Decode attention of one sequence (no mask): {native.status()}; the paths "
                 "below serve the rest (batches, masks, prompt chunks) and other backends.",
                 ""]
    for (kind, bits, group, dim, side), c in rows:
        ms = [f"{c.ms[p]:.3f}" if p in c.ms else "-" for p in kernels.PATHS]
        head.append(f"| {kind} | {bits} | {group} | {dim} | {side} | {c.path} | {ms[0]} | {ms[1]} "
                    f"| {c.source} |")
    return "\n".join(head)
