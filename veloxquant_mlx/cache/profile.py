"""What a method declares beside its cache class: its ``Profile``.

A cache object does the per-layer work (mlx_lm's protocol, its stored form, attention).
Everything else that code around a method needs to know — the registry's facts, what the
builder may do with it, the options tests and the tuner try, mixed precision's ladders,
what tensor parallelism replicates — is data, declared once per method as
``profile = Profile(...)`` on the class. Options-dependent facts are plain functions of
the method's options. Unset fields keep the defaults of a plain per-layer method.
``tests/test_contract.py`` writes docs/developing.md's capability table from these fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from mlx_lm.models.cache import KVCache

from veloxquant_mlx.cache.step_cost import dense_flops


def _never(opts: Any) -> bool:
    return False


def _no_reason(opts: Any) -> str | None:
    return None


def _one(opts: Any) -> int:
    return 1


def _no_tags(opts: Any) -> list[str]:
    return []


def _no_grid(context: int) -> list[dict[str, Any]]:
    return []


def _per_head(opts: Any, kv_width: int, hidden: int) -> str | None:
    return None


def plain_layer(layer_cache: Any) -> bool:
    """mlx_lm's plain ``KVCache``: sliding-window and recurrent layers keep their own."""
    return type(layer_cache) is KVCache


def _one_group_each(layers: list[Any], config: Any, model: Any) -> None:
    for i, info in enumerate(layers):
        info.group_id, info.member_idx, info.group_size = i, 0, 1


def _nothing(*args: Any) -> None:
    return None


def _held(cache: Any) -> list[Any]:
    return cache.held_arrays()


def _no_check(cache: Any) -> None:
    return None


def _from_the_end(cache: Any) -> str:
    return "its compressed form cannot drop tokens from the end"


def _by_numerics(cache: Any, keep: int) -> int | None:
    return None


def _plain_numerics(config: Any, layer: Any) -> Any:
    from veloxquant_mlx.cache.numerics import StoredNumerics  # numerics imports the base

    return StoredNumerics()


def _says(default: Any, what: str, *, factory: bool = False) -> Any:
    """A field with what it declares (the capability table prints ``what``)."""
    if factory:
        return field(default_factory=default, metadata={"says": what})
    return field(default=default, metadata={"says": what})


@dataclass(frozen=True)
class Profile:
    """A method's declared facts, grouped by who reads them: the registry (``veloxquant
    methods``), the builder, the tests, the tuner and mixed precision, tensor parallelism.
    Options-dependent facts are functions of the options (``opts``)."""

    family: str = _says("", "its family in `veloxquant methods`")
    paper: str = _says("-", "the paper it follows")
    stores: str = _says("", "what it keeps, in words")
    recommended: bool = _says(False, "the near-lossless method the demo and README show "
                                     "(one method declares it)")
    cross_layer: bool = _says(False, "layers share state in groups (`assign_roles`); the "
                                     "server collects cycles after such caches")
    rotatable: bool = _says(False, "attention meets the stored K/V only in dot products: "
                                   "`rotate=True` is exact")
    needs_rotation: Callable[[Any], bool] = _says(
        _never, "`(opts)`: the stored codes assume rotated vectors, so the builder rotates")
    rotation_refusal: Callable[[Any], str | None] = _says(
        _no_reason, "`(opts)`: why `rotate=True` is wrong with these options")
    evicts: bool = _says(False, "holds fewer tokens than it saw: layers whose attention "
                                "is code of their own are refused")
    drops_front: bool = _says(False, "drops its oldest tokens exactly (`drop_oldest`): a "
                                     "ring serves sliding-window layers")
    ring_alignment: Callable[[Any], int] = _says(
        _one, "`(opts)`: the unit, in tokens, a ring drops in")
    hooks_module: bool = _says(False, "takes over its module's call with a hook of its own")
    holds_prompt: bool = _says(False, "keeps the whole prompt until its first decode step: "
                                      "its prompt working set grows by "
                                      "`memory.held_prompt_bytes`")
    min_layers: int = _says(1, "fewest layers it compresses")
    batching: bool = _says(True, "per-sequence caches merge into mlx_lm batches")
    small: dict[str, Any] = _says(dict, "tests: options that compress a tiny model's "
                                        "40-token prompt", factory=True)
    lossless: dict[str, Any] = _says(dict, "tests: options that keep (nearly) everything "
                                           "of that prompt", factory=True)
    few_layer: dict[str, Any] = _says(dict, "tests: options added on models of one or two "
                                            "layers", factory=True)
    stored_numerics: Callable[[Any, Any], Any] = _says(
        _plain_numerics, "`(config, layer)`: its numerics for the tests' same-numerics "
                         "reference (`cache/numerics.py`)")
    tune_grid: Callable[[int], list[dict[str, Any]]] = _says(
        _no_grid, "`(context)`: option sets `veloxquant tune` tries")
    ladders: dict[str, dict[str, Any]] = _says(
        dict, "mixed-precision ladders (`eval/mixed.py`): name -> base, knobs, streams",
        factory=True)
    curve_tags: Callable[[Any], list[str]] = _says(
        _no_tags, "`(opts)`: options that put it on another bytes-to-quality curve")
    supports_layer: Callable[[Any], bool] = _says(
        plain_layer, "`(layer_cache)`: which of the model's layer caches it replaces")
    assign_roles: Callable[[list[Any], Any, Any], None] = _says(
        _one_group_each, "`(layers, config, model)`: cross-layer groups and their "
                         "coordinators (default: a group per layer)")
    after_build: Callable[[list[Any], Any, Any], None] = _says(
        _nothing, "`(caches, config, model)`: run once a model's caches are built (link "
                  "pairs, install hooks)")
    detach: Callable[[Any], None] = _says(
        _nothing, "`(model)`: remove what `after_build` installed")
    step_arrays: Callable[[Any], list[Any]] = _says(
        _held, "`(cache)`: what a step's output must depend on: what the cache holds, "
               "and for a cross-layer cache what its step changed in the group")
    decode_flops: Callable[[Any], int] = _says(
        dense_flops, "`(cache)`: FLOPs of one decode query's attention (bench's "
                          "roofline): dense attention's over what it attends by default")
    check_restored: Callable[[Any], None] = _says(
        _no_check, "`(cache)`: checks restored arrays kept outside its stored segments "
                   "(`cache/restore_check.py`)")
    trim_refusal: Callable[[Any], str] = _says(
        _from_the_end, "`(cache)`: why `trim` refuses now, in words (`NotTrimmableError`)")
    reusable_prefix: Callable[[Any, int], int | None] = _says(
        _by_numerics, "`(cache, keep)`: longest exact cut `<= keep` the server may reuse; "
                      "None: as `stored_numerics` says")
    replicated: Callable[[Any, int, int], str | None] = _says(
        _per_head, "`(opts, kv_width, hidden)`: what every tensor-parallel rank holds "
                   "whole")

    def declared(self) -> dict[str, Any]:
        """The fields this profile sets away from the defaults."""
        base = Profile()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(base, f.name)}


def capability_table(classes: dict[str, type]) -> str:
    """docs/developing.md's table of profile fields: default, what it declares and which
    registered methods declare it (``tests/test_contract.py`` keeps the doc equal)."""
    rows = ["| field | default | what it declares | declared by |", "|---|---|---|---|"]
    for f in fields(Profile):
        default = getattr(Profile(), f.name)
        shown = "—" if callable(default) else repr(default)
        by = [name for name, cls in classes.items() if f.name in cls.profile.declared()]
        rows.append(f"| `{f.name}` | {shown} | {f.metadata['says']} | {', '.join(by)} |")
    return "\n".join(rows)

