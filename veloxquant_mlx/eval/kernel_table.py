"""``veloxquant bench --kernels`` / ``--calibrate-kernels``: which engine runs attention
in each situation (``ops.dispatch``), and which path each kind of stored codes takes on
this backend within the ``parts`` engine, with the timings behind the choice."""

from __future__ import annotations

from veloxquant_mlx.ops import dispatch, kernels, native


def engine_lines() -> list[str]:
    """The dispatcher's table and its engines, with the extension's state here."""
    return [f"Attention engines (ops.dispatch; the first matching row wins; the fused op "
            f"here: {native.status()}; {dispatch.LOG_ENV}=1 logs each layer's choice)", "",
            dispatch.markdown(), "", dispatch.engines_markdown(), ""]


def render(calibrate: bool = False) -> str:
    """The engine table, then a Markdown table of every default shape class (measured now
    if ``calibrate``)."""
    rows = kernels.calibrate() if calibrate else kernels.table()
    head = [*engine_lines(),
            f"Codes in the parts engine on {kernels.device_key()} (ms per decode step over "
            f"{kernels.MEASURE_TOKENS} tokens x {kernels.HEADS} KV heads; choices cached in "
            f"{kernels._cache_file()}; {kernels.ENV}=floats|packed forces one)", "",
            "| codes | bits | group | head dim | side | path | floats ms | packed ms | decided |",
            "|---|---|---|---|---|---|---|---|---|"]
    for (kind, bits, group, dim, side), c in rows:
        ms = [f"{c.ms[p]:.3f}" if p in c.ms else "-" for p in kernels.PATHS]
        head.append(f"| {kind} | {bits} | {group} | {dim} | {side} | {c.path} | {ms[0]} | {ms[1]} "
                    f"| {c.source} |")
    return "\n".join(head)
