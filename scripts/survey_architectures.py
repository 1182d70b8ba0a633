"""Survey how each mlx_lm architecture's attention reaches its KV cache.

For every model type in ``veloxquant_mlx.testing.architectures.ARCHITECTURES`` this builds
the tiny random model and

1. probes one 4-token prefill and one decode step with ``make_prompt_cache`` caches
   while counting calls to each loaded mlx_lm module's ``scaled_dot_product_attention``
   name, to ``mx.fast.scaled_dot_product_attention`` made outside it, and to
   attention-shaped ``mx.softmax`` made outside both (attention computed by hand);
   every call is attributed to the decoder layer running and to the cache it was
   handed, and checked against the keys that cache's ``update_and_fetch`` returned;
2. runs an 8-token prefill and 4 greedy decode steps with mlx_lm's own cache, and
   compares the cached logits with one uncached forward pass over the same tokens.

Everything patched is put back after each model. The observations are checked against
the hand-written ``SURVEY`` and, with ``--write``, rendered to
``docs/architecture-survey.md``.

    .venv/bin/python scripts/survey_architectures.py [--write] [--json out.json] [TYPE ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.testing.architectures import (
    ARCHITECTURES,
    FEATURES,
    NOT_ARCHITECTURES,
    PATHS,
    SURVEY,
    Survey,
    build_tiny,
    cache_kinds,
    list_model_types,
)

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture-survey.md"


# ------------------------------------------------------------------ instrumentation
@dataclass
class Call:
    """One attention call seen during the probe."""

    kind: str  # "module" (the module-level name), "fast" (mx.fast directly), "softmax"
    phase: str  # "prefill" or "decode"
    layer: int | None  # decoder layer running, when a layer's __call__ is on the stack
    where: str  # the mlx_lm module whose name was called ("" for fast / softmax)
    cache: str | None  # label of the cache handed over ("none": cache=None)
    q: tuple[int, ...] = ()
    k: tuple[int, ...] = ()
    mask: str = ""
    sinks: bool = False
    own_keys: bool = True  # keys are the array this cache last returned


@dataclass
class Probe:
    """What one probe saw, and where the forward pass is."""

    calls: list[Call] = field(default_factory=list)
    updates: Counter = field(default_factory=Counter)  # (cache label, layer) -> count
    reads: Counter = field(default_factory=Counter)  # keys_and_values: (label, layer)
    returned: dict[str, Any] = field(default_factory=dict)  # label -> keys last returned
    phase: str = "prefill"
    q_len: int = 0  # tokens in the forward pass running
    layer_stack: list[int] = field(default_factory=list)
    inside: int = 0  # > 0 while the module-level function runs

    @property
    def layer(self) -> int | None:
        return self.layer_stack[-1] if self.layer_stack else None


def _flatten(caches: list[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for i, c in enumerate(caches):
        label = f"{prefix}{i}"
        yield label, c
        sub = getattr(c, "caches", None)
        if isinstance(sub, (list, tuple)):
            yield from _flatten(list(sub), label + ".")


def _mask_kind(mask: Any) -> str:
    if mask is None:
        return "none"
    if isinstance(mask, str):
        return mask
    return f"{'bool' if mask.dtype == mx.bool_ else 'float'}{tuple(mask.shape)}"


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, mx.array) else ()


def _same(keys: Any, cached: Any) -> bool:
    """Whether ``keys`` are the keys the cache returned (a dtype cast allowed)."""
    if keys is cached:
        return True
    if not isinstance(keys, mx.array) or not isinstance(cached, mx.array) or \
            keys.shape != cached.shape:
        return False
    return bool(mx.array_equal(keys.astype(cached.dtype), cached).item())


@contextmanager
def instrumented(model: nn.Module, caches: list[Any], probe: Probe) -> Iterator[None]:
    """Count attention calls and cache updates; restore everything on exit."""
    labels = {id(c): label for label, c in _flatten(caches)}
    original = mlx_base.scaled_dot_product_attention
    fast, softmax = mx.fast.scaled_dot_product_attention, mx.softmax
    undo: list[Callable[[], None]] = []

    def label_of(cache: Any) -> str | None:
        return "none" if cache is None else labels.get(id(cache), type(cache).__name__)

    def module_sdpa(where: str) -> Callable[..., mx.array]:
        def wrapper(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
                    mask: Any, sinks: mx.array | None = None) -> mx.array:
            label = label_of(cache)
            probe.calls.append(Call("module", probe.phase, probe.layer, where, label,
                                    _shape(queries), _shape(keys), _mask_kind(mask),
                                    sinks is not None,
                                    _same(keys, probe.returned.get(label))))
            probe.inside += 1
            try:
                return original(queries, keys, values, cache=cache, scale=scale,
                                mask=mask, sinks=sinks)
            finally:
                probe.inside -= 1
        return wrapper

    def fast_sdpa(q: mx.array, k: mx.array, v: mx.array, *args: Any,
                  **kwargs: Any) -> mx.array:
        if not probe.inside:
            probe.calls.append(Call("fast", probe.phase, probe.layer, "", None, _shape(q),
                                    _shape(k), _mask_kind(kwargs.get("mask")),
                                    kwargs.get("sinks") is not None))
        return fast(q, k, v, *args, **kwargs)

    def counting_softmax(x: Any, *args: Any, **kwargs: Any) -> mx.array:
        # Attention scores are [..., queries, keys] (4-D or more) normalized over the
        # keys; routers and gates softmax 2-D / 3-D logits, poolers and mixers other
        # axes or shapes.
        axis = kwargs.get("axis", args[0] if args else None)
        if not probe.inside and isinstance(x, mx.array) and x.ndim >= 4 and \
                axis in (-1, x.ndim - 1) and x.shape[-2] == probe.q_len and \
                x.shape[-1] >= probe.q_len:
            probe.calls.append(Call("softmax", probe.phase, probe.layer, "", None,
                                    _shape(x)))
        return softmax(x, *args, **kwargs)

    for name, mod in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and mod is not None and \
                getattr(mod, "scaled_dot_product_attention", None) is original:
            mod.scaled_dot_product_attention = module_sdpa(name[14:])
            undo.append(lambda mod=mod: setattr(mod, "scaled_dot_product_attention",
                                                original))
    mx.fast.scaled_dot_product_attention = fast_sdpa
    mx.softmax = counting_softmax
    undo.append(lambda: setattr(mx.fast, "scaled_dot_product_attention", fast))
    undo.append(lambda: setattr(mx, "softmax", softmax))

    # Attribute calls to decoder layers by wrapping their classes' __call__.
    index = {id(layer): i for i, layer in enumerate(model.layers)}
    for cls in {type(layer) for layer in model.layers}:
        call = cls.__call__

        def layer_call(self: nn.Module, *args: Any, __call: Callable = call,
                       **kwargs: Any) -> Any:
            i = index.get(id(self))
            if i is not None:
                probe.layer_stack.append(i)
            try:
                return __call(self, *args, **kwargs)
            finally:
                if i is not None:
                    probe.layer_stack.pop()
        cls.__call__ = layer_call
        undo.append(lambda cls=cls, call=call: setattr(cls, "__call__", call))

    # Count cache writes and whole-cache reads per layer, on the instances only.
    for label, c in _flatten(caches):
        for meth, counter in (("update_and_fetch", probe.updates),
                              ("update_window", probe.updates),
                              ("keys_and_values", probe.reads)):
            fn = getattr(c, meth, None)
            if fn is None:
                continue

            def counted(*args: Any, __fn: Callable = fn, __label: str = label,
                        __counter: Counter = counter, **kwargs: Any) -> Any:
                __counter[(__label, probe.layer)] += 1
                out = __fn(*args, **kwargs)
                if isinstance(out, tuple) and out and isinstance(out[0], mx.array):
                    probe.returned[__label] = out[0]
                return out
            setattr(c, meth, counted)
            undo.append(lambda c=c, meth=meth: c.__dict__.pop(meth, None))
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


# ------------------------------------------------------------------ per model
@dataclass
class Observed:
    model_type: str
    build_s: float = 0.0
    layers: int = 0
    caches: list[str] = field(default_factory=list)
    path: str = ""  # observed attention path
    calls: dict[str, int] = field(default_factory=dict)
    layers_by_kind: dict[str, list[int]] = field(default_factory=dict)
    cache_none_calls: int = 0  # module calls handed cache=None
    foreign_keys: list[str] = field(default_factory=list)  # keys not from the cache
    float_masks: int = 0  # module calls whose mask is a float score bias (MLA)
    routable: bool = False  # every attention call could go to its cache's attend
    shared_reads: list[str] = field(default_factory=list)  # layers reading others' caches
    sinks: bool = False
    mask_kinds: list[str] = field(default_factory=list)
    probe_error: str = ""
    runs: str = ""  # "yes" or the error of the 8 + 4 token run
    max_rel_diff: float | None = None  # cached vs uncached logits


def _error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    frame = traceback.extract_tb(e.__traceback__)[-1]
    where = f"{Path(frame.filename).name}:{frame.lineno}"
    return f"{type(e).__name__}: {msg[:160]} ({where})"


def observe_path(calls: list[Call]) -> str:
    kinds = {c.kind for c in calls}
    if not kinds:
        return "none"
    if len(kinds) > 1:
        return "mixed"
    return {"module": "module", "fast": "fast", "softmax": "manual"}[kinds.pop()]


def probe_model(model_type: str) -> Observed:
    obs = Observed(model_type)
    t = time.perf_counter()
    model = build_tiny(model_type)
    obs.build_s = time.perf_counter() - t
    obs.layers = len(model.layers)
    caches = make_prompt_cache(model)
    obs.caches = cache_kinds(caches)
    probe = Probe()
    try:
        with instrumented(model, caches, probe):
            probe.q_len = 4
            mx.eval(model(mx.array([[5, 6, 7, 8]]), cache=caches))
            probe.phase, probe.q_len = "decode", 1
            mx.eval(model(mx.array([[9]]), cache=caches))
    except Exception as e:  # a model mlx_lm cannot run still gets its calls reported
        obs.probe_error = _error(e)
        # Prefill may fail where single tokens pass (olmo): see those calls at least.
        probe = Probe(phase="decode", q_len=1)
        caches = make_prompt_cache(model)
        try:
            with instrumented(model, caches, probe):
                for token in (5, 6):
                    mx.eval(model(mx.array([[token]]), cache=caches))
        except Exception:
            pass
    calls = probe.calls
    obs.path = observe_path(calls)
    obs.calls = dict(Counter(f"{c.kind}:{c.phase}" for c in calls))
    for kind in ("module", "fast", "softmax"):
        layers = sorted({c.layer for c in calls if c.kind == kind and c.layer is not None})
        if layers:
            obs.layers_by_kind[kind] = layers
    module = [c for c in calls if c.kind == "module"]
    obs.cache_none_calls = sum(c.cache == "none" for c in module)
    obs.foreign_keys = sorted({f"{c.phase} layer {c.layer} cache {c.cache}"
                               for c in module if c.cache != "none" and not c.own_keys})
    obs.float_masks = sum(c.mask.startswith("float") for c in module)
    obs.sinks = any(c.sinks for c in calls)
    obs.mask_kinds = sorted({f"{c.phase}:{c.mask}" for c in calls if c.kind != "softmax"})
    # A layer attending through a cache it never wrote shares another layer's K/V.
    writers: dict[str, set[int | None]] = {}
    for (label, layer), _ in probe.updates.items():
        writers.setdefault(label, set()).add(layer)
    shared = set()
    for c in calls:
        if c.cache not in (None, "none") and c.layer is not None and \
                c.cache in writers and c.layer not in writers[c.cache]:
            shared.add(f"layer {c.layer} attends through cache {c.cache}")
    for (label, layer), _ in probe.reads.items():
        if layer is not None and layer not in writers.get(label, set()):
            shared.add(f"layer {layer} reads cache {label}")
    obs.shared_reads = sorted(shared)
    obs.routable = obs.path == "module" and not (
        obs.cache_none_calls or obs.foreign_keys or obs.float_masks or obs.sinks
        or obs.shared_reads or obs.probe_error)
    return obs


def run_generation(model_type: str, obs: Observed) -> None:
    """8-token prefill + 4 greedy steps with mlx_lm's cache, vs one uncached pass."""
    model = build_tiny(model_type)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    try:
        cache = make_prompt_cache(model)
        logits = model(mx.array([prompt]), cache=cache)[0]
        steps = [logits]
        tokens = list(prompt)
        for _ in range(4):
            tokens.append(int(mx.argmax(steps[-1][-1]).item()))
            steps.append(model(mx.array([tokens[-1:]]), cache=cache)[0])
        cached = mx.concatenate(steps, axis=0)
        mx.eval(cached)
        obs.runs = "yes"
    except Exception as e:
        obs.runs = _error(e)
        return
    try:
        full = model(mx.array([tokens]))[0]
        # Some models write -inf into fixed logits (phi3small): compare finite ones.
        ok = mx.isfinite(full) & mx.isfinite(cached)
        full, cached = mx.where(ok, full, 0.0), mx.where(ok, cached, 0.0)
        scale = max(float(mx.abs(full).max().item()), 1e-6)
        obs.max_rel_diff = float(mx.abs(full - cached).max().item()) / scale
    except Exception:  # uncached forward unsupported: nothing to compare
        obs.max_rel_diff = None


# ------------------------------------------------------------------ checks and report
def check(obs: Observed, s: Survey) -> list[str]:
    """Where the observation contradicts the hand-written survey entry."""
    problems = []
    if obs.path != s.path and not (obs.probe_error and obs.path == "none"):
        problems.append(f"path: observed {obs.path}, catalogued {s.path}")
    if sorted(set(obs.caches)) != sorted(s.caches):
        problems.append(f"caches: observed {sorted(set(obs.caches))}, catalogued "
                        f"{sorted(s.caches)}")
    if obs.sinks != ("sinks" in s.features):
        problems.append(f"sinks: observed {obs.sinks}")
    if (obs.cache_none_calls > 0 or bool(obs.shared_reads)) and "kv_shared" not in \
            s.features:
        problems.append("observed K/V read across layers but 'kv_shared' not catalogued")
    if obs.routable != s.routable and not obs.probe_error:
        problems.append(f"routable: observed {obs.routable}, catalogued {s.routable}")
    ran = obs.runs == "yes"
    if ran != (s.runs == "yes"):
        problems.append(f"runs: observed {obs.runs!r}, catalogued {s.runs!r}")
    return problems


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# Why a type that calls the module-level name still cannot be routed, by feature.
_BLOCKERS = {
    "mla_latent_cache": "MLA latent cache: keys are the latent (or rebuilt from it) and "
                        "the mask is a float score bias carrying the RoPE part",
    "kv_shared": "some layers attend over K/V another layer or pass cached",
    "sinks": "attention sinks (sinks=), which attend(queries, scale, mask) never sees",
    "kv_tiled": "K/V heads tiled after the cache, not grouped",
}


def _classes(kind: str) -> list[str]:
    """Cache classes in a kind string, CacheList parts included."""
    return [k.strip() for k in kind.replace("(", ",").replace(")", "").split(",") if k]


def _counts(counter: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items(), key=lambda kv: -kv[1]))


def render(observed: dict[str, Observed]) -> str:
    """The Markdown survey: summary, one table row per type, the bypass lists."""
    types = list_model_types()
    rows = [t for t in types if t in SURVEY]
    running = [t for t in rows if t in observed and observed[t].runs == "yes"]
    routable = [t for t in rows if SURVEY[t].routable]
    classes = Counter(c for t in rows for c in {c for k in SURVEY[t].caches
                                                for c in _classes(k)})
    lines = [
        "# How each mlx_lm architecture's attention reaches its KV cache",
        "",
        "Generated by `scripts/survey_architectures.py --write` from the catalog in "
        "`veloxquant_mlx/testing/architectures.py` (`ARCHITECTURES`, `SURVEY`), with mlx "
        f"{mx.__version__} (CPU build) and mlx-lm {_mlx_lm_version()}. The "
        "classification was written from the model sources; the script checks it "
        "against what each tiny random model does in a 4-token prefill and one decode "
        "step with `make_prompt_cache` caches (calls to every loaded module's "
        "`scaled_dot_product_attention` name, to `mx.fast.scaled_dot_product_attention` "
        "outside it, to attention-shaped `mx.softmax` outside both, and each cache's "
        "`update_and_fetch`), then runs an 8-token prefill and 4 greedy decode steps "
        "with mlx_lm's own cache and compares the logits with one uncached forward pass.",
        "",
        f"- model types installed: **{len(types)}**; catalogued: **{len(rows)}**; "
        f"running prefill + decode with mlx_lm's own cache: **{len(running)}**; "
        f"routable by replacing the module-level name: **{len(routable)}**",
        f"- skipped, not architectures: {', '.join(sorted(NOT_ARCHITECTURES))}",
        "- attention path: " + _counts(Counter(SURVEY[t].path for t in rows)),
        "- projections: " + _counts(Counter(SURVEY[t].projections for t in rows)),
        "- cache classes (types using each, CacheList parts included): "
        + _counts(classes),
        "- cache layouts (types using each): "
        + _counts(Counter(k for t in rows for k in SURVEY[t].caches)),
        "- features (types with each): "
        + _counts(Counter(f for t in rows for f in SURVEY[t].features)),
        "",
        "Attention path: " + "; ".join(f"`{k}` {v}" for k, v in PATHS.items()) + ".",
        "",
        "Routable: every attention call goes through the module-level name, with the "
        "calling layer's own cache, over the keys and values that cache returned, with a "
        "None / causal / boolean mask and no sinks, so a cache's `attend(queries, scale, "
        "mask)` has all it needs. Feature tags: "
        + "; ".join(f"`{k}` {v}" for k, v in FEATURES.items()) + ".",
        "",
        "| model type | attention path | routable | projections | cache kinds | "
        "special features | notes | runs with mlx_lm's cache |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in rows:
        s, o = SURVEY[t], observed.get(t)
        run = s.runs
        if o is not None and o.runs == "yes" and o.max_rel_diff is not None and \
                o.max_rel_diff > 1e-3:
            run += f"; cached and uncached logits differ (rel. {o.max_rel_diff:.1e})"
        lines.append(
            f"| {t} | {s.path} | {'yes' if s.routable else 'no'} | {s.projections} | "
            f"{', '.join(s.caches)} | {', '.join(s.features)} | {_cell(s.note)} | "
            f"{_cell(run)} |")
    lines += ["", "## Types whose attention bypasses the module-level function", ""]
    for t in rows:
        s = SURVEY[t]
        if s.path in ("fast", "manual", "mixed"):
            lines.append(f"- **{t}** ({s.path}): {s.note}")
        elif "softcap (optional)" in s.features:
            lines.append(f"- **{t}** (module, manual when configured): {s.note}")
    lines += ["", "## Types that call the module-level function but are not routable", ""]
    for t in rows:
        s = SURVEY[t]
        if s.routable or s.path != "module":
            continue
        why = "; ".join(v for k, v in _BLOCKERS.items() if k in s.features)
        lines.append(f"- **{t}**: " + "; ".join(x for x in (why, s.note) if x))
    lines += ["", "## Types without attention", ""]
    lines.append(", ".join(t for t in rows if SURVEY[t].path == "none"))
    problems = {t: check(observed[t], SURVEY[t]) for t in rows if t in observed}
    problems = {t: p for t, p in problems.items() if p}
    failed = {t: observed[t].runs for t in rows if t in observed and observed[t].runs != "yes"}
    missing = [t for t in types if t not in SURVEY]
    lines += ["", "## Checks", ""]
    lines.append("- not in the catalog: " + (", ".join(missing) if missing else "none"))
    lines.append("- errors seen running with mlx_lm's own cache: "
                 + ("none" if not failed else
                    "; ".join(f"{t}: `{e}`" for t, e in failed.items())))
    lines.append("- observations disagreeing with the catalog: "
                 + ("none" if not problems else
                    "; ".join(f"{t}: {', '.join(p)}" for t, p in problems.items())))
    return "\n".join(lines) + "\n"


def _mlx_lm_version() -> str:
    from importlib.metadata import version
    return version("mlx-lm")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*", help="model types (default: the whole catalog)")
    ap.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(ROOT)}")
    ap.add_argument("--json", type=Path, help="also dump the raw observations here")
    ns = ap.parse_args(argv)
    types = ns.types or list(ARCHITECTURES)
    observed: dict[str, Observed] = {}
    n_bad = 0
    for t in types:
        obs = probe_model(t)
        run_generation(t, obs)
        observed[t] = obs
        problems = check(obs, SURVEY[t]) if t in SURVEY else ["not in SURVEY"]
        n_bad += bool(problems)
        diff = "" if obs.max_rel_diff is None else f" diff={obs.max_rel_diff:.1e}"
        print(f"{t:22s} path={obs.path:7s} calls={obs.calls} layers={obs.layers_by_kind} "
              f"caches={obs.caches} none={obs.cache_none_calls} shared={obs.shared_reads} "
              f"foreign={obs.foreign_keys} floatmask={obs.float_masks} "
              f"routable={obs.routable} "
              f"sinks={obs.sinks} masks={obs.mask_kinds} runs={obs.runs}{diff}"
              + (f" probe_error={obs.probe_error}" if obs.probe_error else "")
              + (f"\n    MISMATCH: {'; '.join(problems)}" if problems else ""))
    if ns.json:
        ns.json.write_text(json.dumps({t: asdict(o) for t, o in observed.items()}, indent=1))
    if ns.write:
        DOC.write_text(render(observed), encoding="utf-8")
        print(f"wrote {DOC}")
    print(f"{len(types)} surveyed, {n_bad} disagreeing with the catalog")
    return 1 if n_bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
