"""Markdown tables, JSON run records, and the memory-vs-quality plot."""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path
from typing import Any


def _fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


EVAL_COLUMNS = [
    ("method", "method", None),
    ("held MiB", "held_bytes", _mib),
    ("fp16 MiB", "fp16_bytes", _mib),
    ("held/fp16", "mem_ratio", None),
    ("accounted/held", "accounted_over_held", None),
    ("ppl", "ppl", None),
    ("ppl/dense", "ppl_ratio", lambda v: _fmt(v, 4)),
    ("decode tok/s", "decode_tok_s", lambda v: _fmt(v, 1)),
    ("decode/dense", "decode_ratio", lambda v: _fmt(v, 2)),
]


def markdown_table(rows: list[dict[str, Any]],
                   columns: list[tuple[str, str, Any]] | None = None) -> str:
    """A Markdown table of ``rows`` (missing values print as ``-``)."""
    columns = columns or EVAL_COLUMNS
    if any("k_rel_err" in r for r in rows) and columns is EVAL_COLUMNS:
        columns = columns + [("K rel err", "k_rel_err", None), ("V rel err", "v_rel_err", None)]
    lines = ["| " + " | ".join(c[0] for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        cells = []
        for _, key, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else (fmt(v) if fmt else _fmt(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_record(argv: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """Command line, library versions and platform, for a JSON result file."""
    import importlib.metadata as md

    versions = {}
    for pkg in ("veloxquant_mlx", "mlx", "mlx-lm", "numpy"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    if versions["veloxquant_mlx"] is None:
        from .. import __version__

        versions["veloxquant_mlx"] = __version__
    return {
        "command": " ".join(["veloxquant", *(sys.argv[1:] if argv is None else argv)]),
        "versions": versions,
        "python": platform.python_version(),
        "platform": platform.platform(),
        **extra,
    }


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (NaN becomes null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(data), indent=2) + "\n")
    return path


def _clean(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower is better)."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (x2 <= x and y2 <= y) and (x2 < x or y2 < y)
            for j, (x2, y2) in enumerate(points) if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def plot_tradeoff(rows: list[dict[str, Any]], path: str | Path,
                  title: str = "memory vs perplexity") -> Path:
    """PNG: memory ratio (held / fp16) vs perplexity change (%), Pareto front drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r["mem_ratio"], 100.0 * (r["ppl_ratio"] - 1.0)) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = "osD^v<>ph*X"
    for i, (r, (x, y)) in enumerate(zip(rows, pts)):
        ax.scatter([x], [y], marker=markers[i % len(markers)], s=60, label=r["method"])
    front = pareto_front(pts)
    if len(front) > 1:
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "k--", lw=1,
                label="Pareto front")
    ax.set_xlabel("held bytes / fp16-equivalent bytes (lower is smaller)")
    ax.set_ylabel("perplexity change vs dense (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
