"""``veloxquant doctor``: what this installation runs with, and what each method would do
with a model's layers.

It reports the Python / MLX / mlx-lm versions against the ranges the installed package
declares (``importlib.metadata``), whether the fused CPU extension is built (and why
not), the BLAS MLX's CPU backend uses, the default device, the attention path each kind
of stored codes takes, and, for a model, its cache slots and, per registered method,
whether ``KVCacheBuilder.for_model`` compresses them, leaves them to the model's own
cache, or refuses the model (with the refusal's message).
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
import warnings
from collections import Counter
from collections.abc import Iterable
from typing import Any

PACKAGE = "veloxquant_mlx"
CHECKED = ("python", "mlx", "mlx-lm")
OUTSIDE = "OUTSIDE the supported range"


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-")


def declared_ranges(requires: Iterable[str] | None = None,
                    requires_python: str | None = None) -> dict[str, str | None]:
    """Name -> version specifier the package declares for this platform (``CHECKED``
    names only; None where it declares none). Read from the installed metadata unless
    ``requires`` / ``requires_python`` are given."""
    if requires is None:
        try:
            requires = importlib.metadata.requires(PACKAGE) or []
            requires_python = importlib.metadata.metadata(PACKAGE)["Requires-Python"]
        except importlib.metadata.PackageNotFoundError:
            requires = []
    out: dict[str, str | None] = dict.fromkeys(CHECKED)
    out["python"] = requires_python or None
    try:
        from packaging.requirements import Requirement
    except ImportError:  # mlx-lm's transformers needs it; without it nothing is read
        return out
    for line in requires:
        req = Requirement(line)
        name = _canonical(req.name)
        if name in out and (req.marker is None or req.marker.evaluate({"extra": ""})):
            out[name] = str(req.specifier) or None
    return out


def installed_versions() -> dict[str, str]:
    import mlx.core as mx

    try:
        mlx_lm = importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        import mlx_lm as module

        mlx_lm = str(getattr(module, "__version__", "unknown"))
    return {"python": platform.python_version(), "mlx": mx.__version__, "mlx-lm": mlx_lm}


def verdict(version: str, specifier: str | None) -> str:
    """``ok``, ``OUTSIDE the supported range``, or why it cannot tell."""
    if specifier is None:
        return "no declared range"
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return "cannot check (the packaging module is not installed)"
    try:
        inside = SpecifierSet(specifier).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return f"cannot check ({version!r} is not a version)"
    return "ok" if inside else OUTSIDE


def version_lines(ranges: dict[str, str | None] | None = None,
                  versions: dict[str, str] | None = None) -> list[str]:
    ranges = declared_ranges() if ranges is None else ranges
    versions = installed_versions() if versions is None else versions
    try:
        own = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        own = "not installed: no declared ranges"
    lines = [f"versions (ranges declared by {PACKAGE} {own}):"]
    for name in CHECKED:
        spec = ranges.get(name)
        lines.append(f"  {name:<7} {versions[name]:<10} requires {spec or '-':<16} "
                     f"{verdict(versions[name], spec)}")
    return lines


def _recorded_paths(kind: str) -> Counter[str]:
    """Paths recorded on disk for this device, per default class of ``kind``."""
    from veloxquant_mlx.ops import kernels

    found: Counter[str] = Counter()
    for cls in kernels.DEFAULT_CLASSES:
        if cls[0] == kind:
            choice = kernels._MEMO.get(kernels._class_key(*cls)) or \
                kernels._recorded(kernels._class_key(*cls))
            found[choice.path if choice is not None else "not measured yet"] += 1
    return found


def platform_lines() -> list[str]:
    """The extension, the BLAS, the device and the attention path per kind of codes."""
    import mlx.core as mx

    from veloxquant_mlx.apps.blas import INSTALL_HINT, blas_status
    from veloxquant_mlx.ops import dispatch, kernels, native

    blas = blas_status()
    if blas["active"] is None:
        blas_line = "none mapped (MLX's CPU backend is not in use)"
    else:
        blas_line = f"{blas['active']} ({'optimized' if blas['fast'] else 'SLOW: ' + INSTALL_HINT})"
    lines = [f"fused extension: {native.status()}", f"BLAS: {blas_line}",
             f"device: {mx.default_device()}",
             f"attention engines: ops.dispatch's table (veloxquant bench --kernels; "
             f"{dispatch.LOG_ENV}=1 logs each layer's)",
             f"  one sequence, codes the op reads: {native.status()}",
             "  codes in the parts engine:"]
    try:
        force = kernels.forced()
    except ValueError as exc:  # a bad VELOXQUANT_KERNELS: attention would raise the same
        return [*lines, f"    {exc}"]
    for kind in kernels.KINDS:
        if force is not None:
            how = f"{force} (forced by {kernels.ENV})"
        elif kernels.on_gpu():
            how = "packed (the GPU default) unless a calibration recorded otherwise"
        else:
            found = _recorded_paths(kind)
            how = f"{', '.join(f'{p} x {n}' for p, n in sorted(found.items()))} of " \
                  f"{sum(found.values())} shape classes"
        lines.append(f"    {kind} codes: {how}")
    if force is None and not kernels.on_gpu():
        lines.append("    (a class not measured yet is measured on first use; `veloxquant "
                     "bench --calibrate-kernels` measures them all)")
    return lines


def _ranges(slots: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for i in slots:
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def slot_kinds(model: Any, probes: list[Any]) -> dict[int, str]:
    """Cache slot -> what it is (its cache class, window, and how attention uses it)."""
    from mlx_lm.models.cache import make_prompt_cache

    out = {}
    for i, (cache, probe) in enumerate(zip(make_prompt_cache(model), probes)):
        kind = type(cache).__name__
        if probe is None:
            kind += " (not a KV cache: the model's own)"
        elif not probe.used:
            kind += " (never used by the model's attention)"
        else:
            kind += f" (sliding window {probe.window})" if probe.window else " (full attention)"
            if probe.problems:
                kind += f"; its attention {probe.describe()}"
        out[i] = kind
    return out


def _grouped(per_slot: dict[int, str]) -> list[str]:
    by_text: dict[str, list[int]] = {}
    for i, text in per_slot.items():
        by_text.setdefault(text, []).append(i)
    return [f"slot{'s' if len(slots) > 1 else ''} {_ranges(slots)}: {text}"
            for text, slots in by_text.items()]


def _reconstructed(caught: list[warnings.WarningMessage]) -> list[str]:
    """The layers a build's warnings say get a dense reconstruction."""
    found = [re.search(r"layer\(s\) (\[[\d, ]*\])", str(w.message)) for w in caught
             if "reconstruction" in str(w.message)]
    return [f"layer(s) {m.group(1)} get a transient dense reconstruction at every step "
            "(their attention reads the cache by itself; docs/models.md)" for m in found if m]


def _plan(model: Any, method: str, kinds: dict[int, str]) -> tuple[str, str]:
    """What building ``method``'s caches does on ``model``: (action, why)."""
    from veloxquant_mlx.adapter.builder import KVCacheBuilder
    from veloxquant_mlx.config import ConfigError, KVCacheConfig
    from veloxquant_mlx.errors import UnsupportedModelError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = KVCacheConfig(method)
            caches = KVCacheBuilder.for_model(model, config)
        except (UnsupportedModelError, ConfigError) as exc:
            return "refuse", str(exc)
        except Exception as exc:  # a diagnosis reports a failure, it does not stop on it
            return "error", f"{type(exc).__name__}: {exc}"
        finally:
            KVCacheBuilder.detach(model)
    ours = [i for i, c in enumerate(caches) if type(c).__module__.startswith(PACKAGE + ".")]
    kept = {i: kinds[i] for i in range(len(caches)) if i not in ours}
    action = "dense" if config.is_reference else "compress"
    why = [f"{'holds' if config.is_reference else 'compresses'} slots {_ranges(ours)}"]
    why += [f"leaves {text} to the model's own cache"
            + (" (no sliding-window form: docs/models.md)" if "sliding window" in text else "")
            for text in _grouped(kept)]
    return action, "; ".join(why + _reconstructed(caught))


def model_lines(model: Any) -> list[str]:
    """The model's cache slots and, per registered method, what it would do with them."""
    from veloxquant_mlx.adapter.mlx_lm import model_name, probe_model
    from veloxquant_mlx.errors import UnsupportedModelError
    from veloxquant_mlx.registry import methods

    lines = [f"model: {model_name(model)}"]
    try:
        probes = probe_model(model)
    except UnsupportedModelError as exc:
        return [*lines, f"  refused by every method: {exc}"]
    kinds = slot_kinds(model, probes)
    lines += [f"  {text}" for text in _grouped(kinds)]
    lines.append("methods (what KVCacheBuilder.for_model does at default options):")
    width = max(len(m) for m in methods())
    for name in methods():
        action, why = _plan(model, name, kinds)
        lines.append(f"  {name:<{width}}  {action:<8}  {why}")
    return lines


def run_doctor(model_path: str | None = None, with_model: bool = True) -> int:
    """Print the report; 1 when a version is outside the declared range, else 0."""
    lines = version_lines()
    lines += platform_lines()
    if with_model:
        from veloxquant_mlx.models import load

        model, _ = load(model_path)
        lines += model_lines(model)
    print("\n".join(lines))
    return 1 if any(line.rstrip().endswith(OUTSIDE) for line in lines) else 0
