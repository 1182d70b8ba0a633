"""Which method runs on which mlx_lm architecture: the checks and the table.

``run_cell(model_type, method, options)`` builds the catalogued tiny random model of an
architecture (``eval.architectures``; ``wide``: head dims 32, so quantizers with groups
of 32 apply) and checks a method's caches against mlx_lm's own cache:

- ``decode``: a prompt in two chunks, then teacher-forced decode steps; the logits of
  every position are compared;
- ``saved``: after the first decode step the caches are saved (``save_prompt_cache``),
  loaded onto the model (``load_prompt_cache``) and the rest is decoded from the copy;
- ``trim``: where every cache says it is trimmable, the last prompt tokens are trimmed
  and fed again;
- ``batch``: two prompts of different lengths through ``mlx_lm.batch_generate`` with
  prompt caches, against each prompt alone with mlx_lm's own cache (tokens and their
  log-probabilities).

A cell is ``supported`` (every check within ``tolerance``; a check may also be
``refused`` with a clear error), ``refused`` (building the caches raised a clear error),
``crash`` (any other exception), ``diff`` (logits beyond tolerance: silent wrong
output) or ``n/a`` (mlx_lm's own cache does not run the architecture here).
``models_table_doc`` renders ``docs/models.md`` from the cells (``scripts/models_table.py``
runs them with the test suite's lossless settings).
"""

from __future__ import annotations

import re
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.adapter.mlx_lm import reconstruction_installed
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.apps.prompt_cache import (
    can_trim_prompt_cache,
    load_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from veloxquant_mlx.cache.base import CompressedCache, NotTrimmableError
from veloxquant_mlx.cache.sliding import SlidingCache
from veloxquant_mlx.config import ConfigError
from veloxquant_mlx.errors import UnsupportedModelError
from veloxquant_mlx.memory import active_bytes
from veloxquant_mlx.registry import methods
from veloxquant_mlx.testing.architectures import SURVEY, build_tiny

PROMPT = [(i * 37 + 11) % 120 + 1 for i in range(24)]
CHUNK = 16  # the prompt is fed in chunks of 16 and 8 (a sliding window of 4 is crossed)
DECODE = [5, 17, 33]  # teacher-forced decode tokens
TRIM = 4
BATCH = [PROMPT[:20], [(i * 11 + 3) % 120 + 1 for i in range(13)]]
BATCH_TOKENS = 3
TOLERANCE = 0.05  # relative logit error (max |a - b| / max |b|) at lossless settings
# Added in a 16-bit model: the caches attend in float32 and round their output, mlx_lm's
# reference attends in the model's dtype (measured excess up to 0.033 in bfloat16).
ROUNDING = {"bfloat16": 0.04, "float16": 0.01}
# Build-time errors that are clear refusals; anything else is a crash.
REFUSALS = (UnsupportedModelError, ConfigError)
# Errors of a single check that are clear refusals (batches, trimming).
CHECK_REFUSALS = (UnsupportedModelError, ConfigError, NotImplementedError, NotTrimmableError)


@dataclass
class Cell:
    """One architecture x method result."""

    model_type: str
    method: str
    status: str = "supported"
    reason: str = ""
    checks: dict[str, str] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)  # compressed slots by kind
    errors: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status in ("supported", "refused", "n/a")


class _Tok:
    """What ``batch_generate`` needs of a tokenizer."""

    eos_token_ids: list[int] = []

    def decode(self, tokens: list[int]) -> str:
        return " ".join(map(str, tokens))


def _fine_kv_grid(model: nn.Module) -> None:
    # afm7 rounds K/V to multiples of a learned scale before caching; at the random
    # model's scale of 1 its keys are small integers, and any error upstream moves
    # whole ones. A trained model's scales give a fine grid: so does this one.
    for m in model.modules():
        for name in ("quant_key_scale", "quant_value_scale"):
            if name in m:
                m[name] = mx.array(1.0 / 32)


def _fixed_router(model: nn.Module) -> None:
    # phimoe's sparsemixer thresholds its gates (jitter band), so routing stays discrete
    # with every expert routed; a zero router weighs experts the same for every token.
    for m in model.modules():
        if type(m).__name__ == "PhiMoESparseMoeBlock":
            m.gate.weight = mx.zeros_like(m.gate.weight)


_TUNING = {"afm7": _fine_kv_grid, "phimoe": _fixed_router}


def tiny_model(model_type: str, dtype: mx.Dtype | None = None) -> nn.Module:
    """The catalogued tiny model the table runs: head dims 32, every expert routed;
    its parameters cast to ``dtype`` where given (the precisions users run)."""
    model = build_tiny(model_type, wide=True, all_experts=True)
    if model_type in _TUNING:
        _TUNING[model_type](model)
    if dtype is not None:
        model.set_dtype(dtype)
        mx.eval(model.parameters())
    return model


def _rel(got: mx.array, want: mx.array) -> float:
    """max |got - want| / max |want| over finite logits; inf where the non-finite ones
    (models that mask vocabulary entries with -inf) disagree."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    finite = mx.isfinite(want)
    if not mx.array_equal(finite, mx.isfinite(got)).item() or \
            not mx.array_equal(mx.where(finite, 0, got), mx.where(finite, 0, want),
                               equal_nan=True).item():
        return float("inf")
    diff = mx.where(finite, mx.abs(got - want), 0).max()
    return (diff / mx.maximum(mx.where(finite, mx.abs(want), 0).max(), 1e-6)).item()


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    return f" ({Path(last.filename).name}:{last.lineno})" if last else ""


def _prefill(model: nn.Module, caches: list[Any], tokens: list[int]) -> mx.array:
    """Every position's logits, ``[T, vocab]``: chunks of ``CHUNK``, the last one partial."""
    return prefill(model, caches, tokens, CHUNK, last_alone=False, all_logits=True)[0]


def _decode(model: nn.Module, caches: list[Any], tokens: list[int]) -> mx.array:
    out = [model(mx.array([[t]]), cache=caches)[0, -1] for t in tokens]
    logits = mx.stack(out)
    mx.eval(logits)
    return logits


@dataclass
class Reference:
    """The tiny model, and mlx_lm's own cache on the same inputs."""

    model: nn.Module
    prefill: mx.array
    decode: mx.array
    alone: list[tuple[list[int], list[float]]]  # each batch prompt generated alone
    batch_note: str | None  # why batches cannot be checked on this architecture
    tolerance: float = TOLERANCE


def _generate(model: nn.Module, prompt: list[int], caches: Any = None) -> tuple[list[int],
                                                                            list[float]]:
    toks, lps = [], []
    steps = generate_step(mx.array(prompt), model, max_tokens=BATCH_TOKENS,
                          prompt_cache=caches)
    for token, logprobs in steps:
        toks.append(int(token))
        lps.append(float(logprobs[int(token)].item()))
    return toks, lps


def _batch(model: nn.Module, caches: list[list[Any]]) -> tuple[list[list[int]],
                                                                list[list[float]]]:
    r = batch_generate(model, _Tok(), BATCH, prompt_caches=caches, max_tokens=BATCH_TOKENS,
                       return_token_ids=True, return_logprobs=True)
    return [list(t) for t in r.token_ids], r.logprobs


def _batch_note(model: nn.Module, alone: list[list[int]]) -> str | None:
    """Why mlx_lm's own caches cannot serve as the batch reference here, or None."""
    try:
        tokens, _ = _batch(model, [make_prompt_cache(model) for _ in BATCH])
    except Exception as exc:
        return f"n/a: mlx_lm's own caches fail in a batch with prompt caches ({_short(exc)})"
    if tokens != alone:
        return ("n/a: with mlx_lm's own caches, a batch with prompt caches gives other "
                f"tokens than each prompt alone ({tokens} vs {alone})")
    return None


def reference(model_type: str, dtype: mx.Dtype | None = None) -> Reference:
    """The table's tiny model of ``model_type`` (in ``dtype`` where given) and its
    outputs with mlx_lm's caches."""
    model = tiny_model(model_type, dtype)
    caches = make_prompt_cache(model)
    prefill = _prefill(model, caches, PROMPT)
    decode = _decode(model, caches, DECODE)
    tolerance = TOLERANCE + ROUNDING.get(str(dtype).rsplit(".", 1)[-1], 0.0)
    try:
        alone = [_generate(model, p, make_prompt_cache(model)) for p in BATCH]
    except Exception as exc:
        return Reference(model, prefill, decode, [], f"n/a: mlx_lm cannot generate "
                         f"this model alone here ({_short(exc)})", tolerance)
    return Reference(model, prefill, decode, alone,
                     _batch_note(model, [t for t, _ in alone]), tolerance)


# ------------------------------------------------------------------ the checks
Result = dict[str, "float | str"]


def _build(model: nn.Module, method: str, options: dict[str, Any]) -> list[Any]:
    return KVCacheBuilder.for_model(model, KVCacheConfig(method, **options))


def _check_decode(model: nn.Module, caches: list[Any], ref: Reference) -> Result:
    """Prefill and decode; save after the first decode step and finish from the copy."""
    got_prefill = _prefill(model, caches, PROMPT)
    first = _decode(model, caches, DECODE[:1])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cache.safetensors"
        save_prompt_cache(path, caches)
        rest = _decode(model, caches, DECODE[1:])
        loaded = load_prompt_cache(path, model=model)
    out: Result = {"decode": max(_rel(got_prefill, ref.prefill),
                                 _rel(mx.concatenate([first, rest]), ref.decode))}
    out["saved"] = _rel(_decode(model, loaded, DECODE[1:]), ref.decode[1:])
    return out


def _check_trim(model: nn.Module, caches: list[Any], ref: Reference) -> Result:
    """Trim the last prompt tokens and feed them again, where every cache can."""
    _prefill(model, caches, PROMPT)
    if not can_trim_prompt_cache(caches):
        kinds = sorted({type(c).__name__ for c in caches if not c.is_trimmable()})
        return {"trim": f"n/a: not trimmable ({', '.join(kinds)})"}
    trim_prompt_cache(caches, TRIM)
    got = model(mx.array([PROMPT[-TRIM:]]), cache=caches)[0]
    return {"trim": _rel(got, ref.prefill[-TRIM:])}


def _logprob_error(got: list[list[float]], want: list[list[float]]) -> float:
    return max((abs(a - b) / max(1.0, abs(b)) for g, w in zip(got, want)
                for a, b in zip(g, w)), default=0.0)


def _check_batch(model: nn.Module, method: str, options: dict[str, Any],
                 ref: Reference) -> Result:
    """Two prompts of different lengths in one batch, against each alone with mlx_lm's
    cache; where a token differs, against each alone with the method (a near tie that
    the method's own error flips, not a batching error, gives the same tokens)."""
    if ref.batch_note is not None:
        return {"batch": ref.batch_note}
    tokens, logprobs = _batch(model, [_build(model, method, options) for _ in BATCH])
    want = ref.alone
    if tokens != [t for t, _ in want]:
        want = [_generate(model, p, _build(model, method, options)) for p in BATCH]
        if tokens != [t for t, _ in want]:
            return {"batch": f"diff: tokens {tokens}, alone {[t for t, _ in want]}"}
    return {"batch": _logprob_error(logprobs, [lp for _, lp in want])}


def _run_check(cell: Cell, names: tuple[str, ...], tolerance: float, fn: Any, *args: Any
               ) -> None:
    try:
        result = fn(*args)
    except CHECK_REFUSALS as exc:
        result = dict.fromkeys(names, f"refused: {exc}")
    except Exception as exc:  # a crash is a finding, recorded with where it happened
        result = dict.fromkeys(names, f"crash: {_short(exc)}{_where(exc)}")
    for name, value in result.items():
        if isinstance(value, float):
            cell.errors[name] = value
            value = "ok" if value <= tolerance else f"diff: relative error {value:.3g}"
        cell.checks[name] = value


def _kinds(caches: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in caches:
        if isinstance(c, SlidingCache):
            kind = "sliding (ring)"
        elif isinstance(c, CompressedCache):
            kind = "sliding" if c.layer.sliding_window else "full"
        else:
            continue
        out[kind] = out.get(kind, 0) + 1
    return out


def _settle(cell: Cell) -> None:
    states = cell.checks.values()
    if any(s.startswith("crash") for s in states):
        cell.status = "crash"
    elif any(s.startswith("diff") for s in states):
        cell.status = "diff"
    elif cell.checks.get("decode", "").startswith("refused"):
        cell.status, cell.reason = "refused", cell.checks["decode"][len("refused: "):]
    details = [f"{k}: {v}" for k, v in cell.checks.items() if v != "ok"]
    if cell.status in ("crash", "diff"):
        cell.reason = "; ".join(d for d in details if "crash" in d or "diff" in d)


def run_cell(model_type: str, method: str, options: dict[str, Any],
             ref: Reference | None = None) -> Cell:
    """Every check of one architecture x method (see the module docstring).

    ``ref`` (``reference(model_type)``) may be shared by the cells of one architecture:
    its model is left as it was after each cell.
    """
    cell = Cell(model_type, method)
    survey = SURVEY.get(model_type)
    if survey is not None and not survey.runs.startswith("yes"):
        cell.status, cell.reason = "n/a", survey.runs
        return cell
    ref = ref or reference(model_type)
    model = ref.model
    try:
        try:
            caches = _build(model, method, options)
        except REFUSALS as exc:
            cell.status, cell.reason = "refused", str(exc)
            return cell
        except Exception as exc:
            cell.status, cell.reason = "crash", f"building: {_short(exc)}{_where(exc)}"
            return cell
        cell.kinds = _kinds(caches)
        if reconstruction_installed(model):
            cell.kinds["dense view"] = 1
        tol = ref.tolerance
        _run_check(cell, ("decode", "saved"), tol, _check_decode, model, caches, ref)
        _run_check(cell, ("trim",), tol, lambda: _check_trim(
            model, _build(model, method, options), ref))
        _run_check(cell, ("batch",), tol, _check_batch, model, method, options, ref)
    finally:
        KVCacheBuilder.detach(model)
    _settle(cell)
    return cell


# ------------------------------------------------------------------ the table
# Options the table adds to a method's lossless settings: the catalog's tiny models
# have one or two layers (each method's ``few_layer_options``).
MATRIX_EXTRA: dict[str, dict[str, Any]] = {
    name: cls.profile.few_layer for name, cls in methods().items() if cls.profile.few_layer}

# Refusal reasons, most specific first: (pattern in the message, short label).
REASONS: list[tuple[str, str]] = [
    (r"slots are \d+ x ArraysCache\.", "no KV cache (recurrent layers only)"),
    (r"slots are [^.]*CacheList", "KV caches inside mlx_lm's CacheList (not compressed)"),
    (r"slots are [^.]*LayerCache", "the model's own cache class (not compressed)"),
    (r"slots are [^.]*RotatingKVCache\.", "sliding-window layers only, left to mlx_lm"),
    (r"cache list rather than as an argument", "caches driven by the model's own loop"),
    (r"holds the layer input", "K/V read by other layers (XQuant-CL holds deltas)"),
    (r"takes (\S+) besides its input", "attention takes per-token arguments"),
    (r"attends over its own compressed form only", "needs attend; layers attend by "
     "themselves"),
    (r"evicts tokens", "eviction; layers attend by their own code"),
    (r"a pair needs two layers", "one attention layer: no pair to merge"),
    (r"group_size", "group size does not divide a width"),
]
NO_KV = "no KV cache (recurrent layers only)"


def short_reason(message: str) -> str:
    """The table's label for a refusal message."""
    for pattern, label in REASONS:
        if re.search(pattern, message):
            return label
    return "other (see the message)"


def counts(cells: list[Cell], method: str) -> dict[str, int]:
    """Cells of ``method`` by status; ``runnable``: architectures with a KV cache that
    mlx_lm's own cache runs here (the denominator of the support share)."""
    mine = [c for c in cells if c.method == method]
    out = {k: sum(c.status == k for c in mine) for k in
           ("supported", "refused", "n/a", "crash", "diff")}
    out["no_kv"] = sum(c.status == "refused" and short_reason(c.reason) == NO_KV
                       for c in mine)
    out["runnable"] = len(mine) - out["n/a"] - out["no_kv"]
    return out


def _mark(cell: Cell) -> str:
    if cell.status == "supported":
        tags = "".join(t for t, k in (("d", "dense view"), ("s", "sliding"),
                                      ("r", "sliding (ring)")) if k in cell.kinds)
        return f"yes {tags}".strip()
    if cell.status == "refused":
        return f"no ({REASON_CODES[short_reason(cell.reason)]})"
    return cell.status


REASON_CODES = {label: str(i + 1) for i, (_, label) in enumerate(REASONS)}
REASON_CODES["other (see the message)"] = str(len(REASONS) + 1)


# ------------------------------------------------------------------ bytes of a hybrid
# A Gemma 3 tiny model with a window long enough that the ring matters: layers 0, 2
# slide over 32 tokens, layers 1, 3 attend globally; 256 prompt tokens, 8 decode steps.
HYBRID = ("gemma3_text", {"sliding_window": 32, "num_hidden_layers": 4})
HYBRID_TOKENS = [(i * 29 + 7) % 250 + 1 for i in range(256)]


def _bytes_row(model: nn.Module, name: str, build: Any) -> dict[str, Any]:
    KVCacheBuilder.detach(model)
    base = active_bytes()
    caches = build()
    prefill(model, caches, HYBRID_TOKENS, chunk=64)
    for t in DECODE:
        mx.eval(model(mx.array([[t]]), cache=caches))
    real = active_bytes() - base
    own = make_prompt_cache(model)
    row: dict[str, Any] = {"method": name, "real": real, "sliding": 0, "full": 0,
                           "sliding_kind": ""}
    for c, o in zip(caches, own):
        kind = "sliding" if type(o).__name__ == "RotatingKVCache" else "full"
        row[kind] += c.nbytes
        if kind == "sliding":
            row["sliding_kind"] = type(c).__name__
    del caches
    KVCacheBuilder.detach(model)
    return row


def hybrid_bytes(options: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Bytes held per layer kind of the hybrid tiny model, mlx_lm's cache first.

    ``real``: what the allocator says every cache keeps alive (everything the build
    installed included); ``sliding`` / ``full``: the layers' declared ``nbytes``.
    """
    model = build_tiny(HYBRID[0], wide=True, overrides=HYBRID[1])
    rows = [_bytes_row(model, "mlx_lm (float32)", lambda: make_prompt_cache(model))]
    for method, opts in options.items():
        cfg = KVCacheConfig(method, **opts)
        rows.append(_bytes_row(model, cfg.to_string(),
                               lambda c=cfg: KVCacheBuilder.for_model(model, c)))
    return rows


# ------------------------------------------------------------------ Markdown
def _summary(cells: list[Cell], methods: list[str]) -> list[str]:
    out = ["| method | supported | refused | no KV cache | mlx_lm cannot run | crash | diff "
           "| supported / runnable |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in methods:
        n = counts(cells, m)
        share = f"{n['supported']}/{n['runnable']} = {n['supported'] / n['runnable']:.1%}"
        out.append(f"| `{m}` | {n['supported']} | {n['refused'] - n['no_kv']} | "
                   f"{n['no_kv']} | {n['n/a']} | {n['crash']} | {n['diff']} | {share} |")
    return out


def _grid(cells: list[Cell], methods: list[str]) -> list[str]:
    by = {(c.model_type, c.method): c for c in cells}
    types = sorted({c.model_type for c in cells}, key=str.lower)
    out = ["| model type | " + " | ".join(f"`{m}`" for m in methods) + " | batches |",
           "|---|" + "---|" * len(methods) + "---|"]
    for t in types:
        row = [by[t, m] for m in methods if (t, m) in by]
        batch = sorted({_batch_mark(c) for c in row} - {""})
        out.append(f"| {t} | " + " | ".join(_mark(c) for c in row) + " | "
                   + "; ".join(batch) + " |")
    return out


def _batch_mark(cell: Cell) -> str:
    v = cell.checks.get("batch", "")
    if v.startswith("refused"):
        return "refused: " + v.split(": ", 2)[1].split(" takes ")[0].split(" returns ")[0] \
            .split(" reads ")[0].split(" attends ")[0]
    return "mlx_lm itself differs" if v.startswith("n/a") else ""


def _reasons(cells: list[Cell]) -> list[str]:
    out = []
    for _, label in REASONS + [("", "other (see the message)")]:
        hits = [c for c in cells if c.status == "refused" and short_reason(c.reason) == label]
        if hits:
            ex = hits[0]
            out.append(f"{REASON_CODES[label]}. **{label}** ({len(hits)} cells). For "
                       f"example {ex.model_type} / `{ex.method}`: {ex.reason}")
    return out


def _bytes(rows: list[dict[str, Any]]) -> list[str]:
    base = rows[0]
    half = base["sliding"] / 2  # mlx_lm's float32 ring, as float16
    out = [f"{HYBRID[0]}, every width doubled, {HYBRID[1]['num_hidden_layers']} layers "
           f"(two sliding over {HYBRID[1]['sliding_window']} tokens, two global), "
           f"{len(HYBRID_TOKENS)} prompt tokens and {len(DECODE)} decode steps, float32, "
           "each method at the test suite's compressing settings (`SMALL_OPTIONS`). "
           "Bytes the layers' caches declare (`nbytes`), and what the allocator says all "
           "of them keep alive (`mx.get_active_memory`).", "",
           "| cache | sliding layers | of mlx_lm's ring as float16 | sliding-layer cache "
           "| global layers | all caches, allocator |", "|---|---:|---:|---|---:|---:|"]
    for r in rows:
        out.append(f"| `{r['method']}` | {r['sliding']:,} | {r['sliding'] / half:.2f} | "
                   f"{r['sliding_kind']} | {r['full']:,} | {r['real']:,} |")
    return out


def render(cells: list[Cell], methods: list[str], bytes_rows: list[dict[str, Any]],
           header: str, prose: str) -> str:
    """``docs/models.md``: ``header`` (how it was made), the tables, then ``prose``."""
    parts = [header, "## Summary", "", *_summary(cells, methods), "",
             "## Architectures x methods", "",
             "`yes`: every check passes; `d`: some layers attend by themselves and get a "
             "transient dense reconstruction (see below); `s`: sliding-window layers are "
             "compressed by the method itself, `r`: by a ring over its compressed form; "
             "`no (N)`: refused, reason N below; `n/a`: mlx_lm's own cache does not run "
             "the model here. *Batches*: a batch of compressed caches refused by the "
             "named module, or not checked because mlx_lm's own caches give other tokens "
             "in a batch than alone.", "", *_grid(cells, methods), "",
             "## Refusal reasons", "", *_reasons(cells), "",
             "## Sliding-window layers of a hybrid model", "", *_bytes(bytes_rows), "",
             prose]
    return "\n".join(parts).rstrip() + "\n"
