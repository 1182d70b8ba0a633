"""Markdown tables, JSON run records, and the memory-vs-quality plot.

Memory columns: ``real`` is what MLX's allocator says the caches keep alive (see
``adapter/retained.py``), the memory figure; ``declared`` is what the caches say they hold
(``cache_stats``), shown beside it as a second opinion.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from collections.abc import Callable
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


def _with_ci(key: str, digits: int) -> Callable[[dict[str, Any]], str]:
    """A cell ``value [lo, hi]`` from ``row[key]`` and ``row[key + '_ci']``."""
    def cell(row: dict[str, Any]) -> str:
        v, ci = row.get(key), row.get(key + "_ci")
        if v is None:
            return "-"
        if not ci:
            return _fmt(float(v), digits)
        return f"{v:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"
    return cell


def _apart(row: dict[str, Any]) -> str:
    same = row.get("indistinguishable_from")
    return ", ".join(same) if same else "-"


# A column: (header, row key, formatter of the value) or (header, None, formatter of
# the whole row).
Column = tuple[str, str | None, Any]

EVAL_COLUMNS: list[Column] = [
    ("method", "method", None),
    ("real MiB", "real_bytes", _mib),
    ("real MiB after decode", "real_decode_bytes", _mib),
    ("real/fp16", "mem_ratio", None),
    ("declared MiB", "held_bytes", _mib),
    ("real/declared", "real_over_declared", None),
    ("ppl", "ppl", None),
    ("ppl/dense [95% CI]", None, _with_ci("ppl_ratio", 4)),
    ("KL nats [95% CI]", None, _with_ci("kl", 4)),
    ("top-1 [95% CI]", None, _with_ci("top1", 3)),
    ("vs dense", "verdict", None),
    ("cannot be told apart from", None, _apart),
    ("decode/dense", "decode_ratio", lambda v: _fmt(v, 2)),
]

RETRIEVAL_COLUMNS: list[Column] = [
    ("method", "method", None),
    ("correct", None, lambda r: f"{r['correct']}/{r['n']}"),
    ("accuracy [95% Wilson]", None, _with_ci("accuracy", 2)),
    ("by depth", "by_depth", lambda d: ", ".join(f"{k}: {v:.2f}" for k, v in d.items())),
    ("disagree with dense (method / dense right)", None,
     lambda r: f"{r['disagree_with_dense']} ({r['only_method_right']} / "
               f"{r['only_dense_right']})"),
    ("McNemar p", "mcnemar_p", None),
    ("vs dense", "verdict", None),
    ("real MiB", "real_bytes", _mib),
    ("real/fp16", "mem_ratio", None),
    ("declared/fp16", "declared_ratio", None),
]


def markdown_table(rows: list[dict[str, Any]], columns: list[Column] | None = None) -> str:
    """A Markdown table of ``rows`` (missing values print as ``-``)."""
    columns = columns or EVAL_COLUMNS
    if any("k_rel_err" in r for r in rows) and columns is EVAL_COLUMNS:
        columns = columns + [("K rel err", "k_rel_err", None), ("V rel err", "v_rel_err", None)]
    lines = ["| " + " | ".join(c[0] for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        cells = []
        for _, key, fmt in columns:
            if key is None:
                cells.append(fmt(r))
                continue
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
        from veloxquant_mlx._version import __version__

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


def _panel(ax: Any, rows: list[dict[str, Any]], key: str, scale: float, shift: float,
           ylabel: str) -> None:
    """One panel: real memory ratio vs ``key`` with its interval as error bars."""
    markers = "osD^v<>ph*X"
    pts = []
    for i, r in enumerate(rows):
        x, y = r["mem_ratio"], scale * (r[key] - shift)
        ci = r.get(key + "_ci") or [r[key], r[key]]
        err = [[y - scale * (ci[0] - shift)], [scale * (ci[1] - shift) - y]]
        ax.errorbar([x], [y], yerr=err, fmt=markers[i % len(markers)], ms=7, capsize=3,
                    label=r["method"])
        pts.append((x, y))
    front = pareto_front(pts)
    if len(front) > 1:
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "k--", lw=1,
                label="Pareto front")
    ax.set_xlabel("real bytes / fp16-equivalent bytes (allocator; lower is smaller)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def plot_tradeoff(rows: list[dict[str, Any]], path: str | Path,
                  title: str = "memory vs quality") -> Path:
    """PNG: real memory ratio vs ppl change (%) and vs mean KL, 95% intervals as bars.

    Rows without a real memory figure are left out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("mem_ratio") is not None
            and not math.isnan(r["mem_ratio"])]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    _panel(axes[0], rows, "ppl_ratio", 100.0, 1.0, "perplexity change vs dense (%)")
    _panel(axes[1], rows, "kl", 1.0, 0.0, "mean KL(dense || method), nats/token")
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
