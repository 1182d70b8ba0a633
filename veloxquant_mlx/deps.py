"""The mlx and mlx-lm versions this package supports, checked when it is imported.

The server and the caches subclass mlx_lm's classes and use its private members
(``veloxquant_mlx.mlx_lm_private``); mlx-lm 0.32.0 is the first release with all of
them (``LRUPromptCache``, ``PromptProcessingBatch``, ``BatchGenerator._counters``,
``ResponseGenerator._await_response``, ...), and a new minor may rename any. mlx 0.30
is the first with ``mx.depends`` and the ``nvfp4``/``mxfp8`` modes; mlx-lm 0.32 itself
needs mlx 0.32.2. ``SUPPORTED`` is the one place these ranges live: pyproject.toml
states the same ones (a test holds them equal).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from importlib import metadata

SUPPORTED: dict[str, str] = {"mlx": ">=0.32.2,<0.33", "mlx-lm": ">=0.32.0,<0.33"}
# Set to 1 to import with other versions anyway (a warning instead of the error).
ENV_ALLOW = "VELOXQUANT_ALLOW_UNSUPPORTED"

_CLAUSE = re.compile(r"^\s*(>=|<|==)\s*(\d+(?:\.\d+)*)\s*$")


def parse_version(text: str) -> tuple[int, ...]:
    """The leading numeric release of a version (``"0.32.4.dev1"`` -> ``(0, 32, 4)``)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    if m is None:
        raise ValueError(f"version {text!r} does not start with a release number like 0.32.4")
    return tuple(int(p) for p in m.group(1).split("."))


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = max(len(a), len(b))
    return a + (0,) * (n - len(a)), b + (0,) * (n - len(b))


def in_range(version: str, spec: str) -> bool:
    """Whether ``version`` meets every ``>=``/``<``/``==`` clause of ``spec``."""
    v = parse_version(version)
    for clause in spec.split(","):
        m = _CLAUSE.match(clause)
        if m is None:
            raise ValueError(f"version clause {clause!r} of {spec!r} is not '>=X', '<X' or '==X'")
        a, b = _padded(v, parse_version(m.group(2)))
        ok = {">=": a >= b, "<": a < b, "==": a == b}[m.group(1)]
        if not ok:
            return False
    return True


def installed_versions() -> dict[str, str | None]:
    """The installed version of each supported distribution (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in SUPPORTED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def version_problems(versions: Mapping[str, str | None]) -> list[str]:
    """One sentence per distribution outside its supported range."""
    out = []
    for name, spec in SUPPORTED.items():
        have = versions.get(name)
        if have is None:
            out.append(f"{name} is not installed (supported: {name}{spec})")
        elif not in_range(have, spec):
            out.append(f"{name} {have} is installed; supported: {name}{spec}")
    return out


def check_versions(versions: Mapping[str, str | None] | None = None,
                   environ: Mapping[str, str] | None = None) -> None:
    """Raise ImportError naming the installed and supported versions when mlx or mlx-lm
    is outside ``SUPPORTED``; only warn when ``$VELOXQUANT_ALLOW_UNSUPPORTED=1``."""
    problems = version_problems(installed_versions() if versions is None else versions)
    if not problems:
        return
    env = os.environ if environ is None else environ
    fix = " ".join(f"'{n}{s}'" for n, s in SUPPORTED.items())
    text = "; ".join(problems)
    if env.get(ENV_ALLOW, "") not in ("", "0"):
        warnings.warn(f"veloxquant_mlx: {text}. Running anyway ({ENV_ALLOW} is set): mlx_lm's "
                      "private names it relies on may differ.", RuntimeWarning, stacklevel=2)
        return
    raise ImportError(f"veloxquant_mlx: {text}. Install supported versions (pip install "
                      f"{fix}), or set {ENV_ALLOW}=1 to try these anyway with a warning.")
