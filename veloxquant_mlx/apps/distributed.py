"""Compressed KV caches on models sharded with MLX's own distributed engine.

Under ``mlx.launch`` (any backend: ring, JACCL, MPI, NCCL) every rank runs the same
command. ``load_for_ranks`` loads the model on each rank and shards it with mlx_lm's
own machinery: tensor parallelism through ``model.shard(group)`` when the model has it
and its query heads, KV heads and MLP width divide by the world size, pipeline
parallelism through ``model.model.pipeline(group)`` when mlx_lm's model supports it,
and otherwise a ``ShardingError`` naming both requirements and the model's head
counts. ``KVCacheBuilder.for_model`` then builds each rank's caches for the KV heads
(tensor parallel) or the layers (pipeline) that rank owns, so every method works
unchanged and each rank holds only its share.

What sharding changes for the methods:

- Cross-layer groups (xKV, MiniCache, XQuant-CL anchors) are formed from the layers a
  rank runs, so they never span pipeline ranks; under pipeline parallelism a rank
  numbers its own layers from 0 (options such as ``minicache_start_layer`` count
  within a rank).
- Under tensor parallelism xKV's joint SVD is per rank, over that rank's heads.
- XQuant in latent mode stores per-rank latents of the rank's own K/V projections
  (sharded); XQuant without latents and XQuant-CL store the layer input X, which
  tensor parallelism replicates: rank 0 says so (``replication_warning``) when the
  model is loaded for such a method.

Every collective runs on every rank in the same order: the builder's routing probe
only builds a graph (nothing is evaluated, so its all_sums never run), and the model's
forward passes are the same on every rank. ``check_same_on_ranks`` ends a job whose
ranks were started with different options, and a rank whose peer died gets MLX's
"connection to a peer was lost" error, which ``install_rank_output`` turns into a
one-line message; ``mlx.launch`` stops the other ranks when one exits with an error.
"""

from __future__ import annotations

import atexit
import copy
import gc
import hashlib
import io
import json
import math
import os
import pickle
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.adapter.mlx_lm import (
    UnsupportedModelError,
    attention_layout,
    attention_module,
    model_layers,
)
from veloxquant_mlx.options import ConfigError, config_error
from veloxquant_mlx.registry import get_method

__all__ = ["RankMismatchError", "ShardPlan", "ShardingError", "check_same_on_ranks",
           "load_for_ranks", "plan_sharding", "rank_path", "replication_warning",
           "response_generator", "shard_header", "shard_model", "world"]

ENV_SHARD = "VELOXQUANT_SHARD"
SHARD_MODES = ("auto", "tensor", "pipeline")
# Variables that mlx.launch (ring, JACCL, NCCL) or mpirun set in every rank.
_LAUNCH_ENV = ("MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE", "MLX_JACCL_COORDINATOR",
               "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_RANK_SUFFIX = re.compile(r"\.rank(\d+)-of-(\d+)$")
_PLAN: ShardPlan | None = None  # how this process's model was sharded (saved caches)


class ShardingError(UnsupportedModelError):
    """The model cannot be sharded over this world size the way that was asked."""


class RankMismatchError(ConfigError):
    """The ranks of one job were started with different options."""


@dataclass(frozen=True)
class ShardPlan:
    """How a model is split over the ranks of a job (the same on every rank but ``rank``)."""

    mode: str  # "tensor", "pipeline" or "single"
    rank: int
    size: int
    n_layers: int
    n_heads: int  # query heads of the whole model (first attention layer)
    n_kv_heads: int
    layer_start: int = 0  # layers [layer_start, layer_end) run on this rank
    layer_end: int = 0

    def describe(self) -> str:
        if self.mode == "tensor":
            return (f"tensor parallel over {self.size} ranks: each rank runs all "
                    f"{self.n_layers} layers with {self.n_heads // self.size} of "
                    f"{self.n_heads} query heads and {self.n_kv_heads // self.size} of "
                    f"{self.n_kv_heads} KV heads")
        if self.mode == "pipeline":
            return (f"pipeline parallel over {self.size} ranks: rank {self.rank} runs "
                    f"layers {self.layer_start}-{self.layer_end - 1} of {self.n_layers}")
        return "single process"

    def shared(self) -> dict[str, Any]:
        """What every rank must agree on (everything but the rank and its layers)."""
        d = asdict(self)
        for k in ("rank", "layer_start", "layer_end"):
            d.pop(k)
        return d


# ---------------------------------------------------------------- the group
def world() -> Any | None:
    """The ``mx.distributed`` group of an ``mlx.launch`` run, or ``None`` (one process).

    ``mx.distributed.init()`` is only called when a launcher's variables are set, so a
    plain single-process run never touches a distributed backend.
    """
    if not any(os.environ.get(k) for k in _LAUNCH_ENV):
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def barrier(group: Any) -> None:
    """Wait for every rank (one tiny all_sum)."""
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def _gather_bytes(group: Any, data: bytes) -> list[bytes]:
    """Every rank's ``data`` (any lengths), in rank order."""
    n = mx.distributed.all_gather(mx.array([len(data)], mx.int32), group=group,
                                  stream=mx.cpu)
    lengths = [int(v) for v in n.tolist()]
    width = max(max(lengths), 1)
    padded = mx.array(list(data) + [0] * (width - len(data)), mx.int32)
    rows = mx.distributed.all_gather(padded[None], group=group, stream=mx.cpu).tolist()
    return [bytes(row[:ln]) for row, ln in zip(rows, lengths)]


def check_same_on_ranks(group: Any, what: str, value: Any) -> None:
    """Raise ``RankMismatchError`` on every rank unless all ranks passed the same ``value``.

    ``value`` is anything JSON-serializable (``repr`` for the rest). Collective: every
    rank must call it, in the same order.
    """
    if group is None:
        return
    text = json.dumps(value, sort_keys=True, default=repr)
    digest = hashlib.sha256(text.encode()).digest()
    digests = _gather_bytes(group, digest)
    if len(set(digests)) == 1:
        return
    texts = [t.decode(errors="replace") for t in _gather_bytes(group, text.encode())]
    listing = "; ".join(f"rank {r}: {t[:400]}" for r, t in enumerate(texts))
    raise RankMismatchError(
        f"the {what} differs across the {group.size()} ranks of this mlx.launch job "
        f"({listing}); every rank must run the same command with the same files")


# ---------------------------------------------------------------- planning
def _mode_from_env() -> str:
    mode = os.environ.get(ENV_SHARD, "auto") or "auto"
    if mode not in SHARD_MODES:
        raise config_error(ENV_SHARD, mode, f"one of {list(SHARD_MODES)}", "environment")
    return mode


def _model_name(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return f"model type {getattr(args, 'model_type', type(model).__module__)!r}"


def _head_counts(model: nn.Module) -> list[tuple[int, int]]:
    """(query heads, KV heads) of every attention layer, before sharding."""
    args = getattr(model, "args", None)
    counts = []
    for block in model_layers(model):
        attn = attention_module(block) if block is not None else None
        if attn is not None:
            lay = attention_layout(attn, args)
            counts.append((lay.n_heads, lay.n_kv_heads))
    return counts


def _mlp_widths(model: nn.Module) -> set[int]:
    widths = set()
    for block in model_layers(model):
        proj = getattr(getattr(block, "mlp", None), "up_proj", None)
        if proj is not None and hasattr(proj, "weight"):
            widths.add(int(proj.weight.shape[0]))
    return widths


def _tensor_problem(model: nn.Module, heads: list[tuple[int, int]], n: int) -> str | None:
    if not callable(getattr(model, "shard", None)):
        return "the model has no shard(group) method"
    bad = sorted({h for h in heads if h[0] % n or h[1] % n})
    if bad:
        return (f"{n} divides neither " if all(q % n and kv % n for q, kv in bad) else
                f"{n} does not divide all of ") + ", ".join(
                    f"{q} query / {kv} KV heads" for q, kv in bad)
    wide = sorted(w for w in _mlp_widths(model) if w % n)
    if wide:
        return f"the MLP width must divide by {n}; the model has {wide}"
    return None


def _pipeline_problem(model: nn.Module, n: int) -> str | None:
    inner = getattr(model, "model", None)
    if not callable(getattr(inner, "pipeline", None)):
        return ("this model has none; mlx_lm's models with it use "
                "mlx_lm.models.pipeline.PipelineMixin: qwen2, qwen3_moe, deepseek_v3, ...")
    n_layers = len(model_layers(model))
    if n_layers < n:
        return f"it needs at least {n} layers; the model has {n_layers}"
    return None


def _requirements(model: nn.Module, heads: list[tuple[int, int]], n: int, mode: str,
                  tensor: str | None, pipeline: str | None) -> ShardingError:
    q, kv = heads[0] if heads else (0, 0)
    fits = [d for d in range(1, max(math.gcd(q, kv), 1) + 1) if q % d == 0 and kv % d == 0]
    parts = []
    if mode in ("auto", "tensor"):
        parts.append(f"tensor parallelism needs model.shard(group) and query heads, KV "
                     f"heads and MLP width divisible by the world size ({tensor})")
    if mode in ("auto", "pipeline"):
        parts.append(f"pipeline parallelism needs an mlx_lm model with pipeline support "
                     f"({pipeline})")
    return ShardingError(
        f"{_model_name(model)} ({q} query heads, {kv} KV heads, "
        f"{len(model_layers(model))} layers) cannot be sharded over {n} ranks "
        f"({ENV_SHARD}={mode}): " + "; ".join(parts)
        + f". World sizes that divide the heads: {fits}")


def plan_sharding(model: nn.Module, size: int, rank: int = 0,
                  mode: str = "auto") -> ShardPlan:
    """How ``model`` (not yet sharded) splits over ``size`` ranks; raises ``ShardingError``.

    ``mode``: ``"tensor"``, ``"pipeline"``, or ``"auto"`` (tensor where it fits, else
    pipeline). Pure: the model is not changed.
    """
    if mode not in SHARD_MODES:
        raise config_error("mode", mode, f"one of {list(SHARD_MODES)}", "plan_sharding")
    heads = _head_counts(model)
    n_layers = len(model_layers(model))
    q, kv = heads[0] if heads else (0, 0)
    base = dict(rank=rank, size=size, n_layers=n_layers, n_heads=q, n_kv_heads=kv)
    if size == 1:
        return ShardPlan(mode="single", layer_end=n_layers, **base)
    tensor = _tensor_problem(model, heads, size) if mode != "pipeline" else "not asked"
    if tensor is None:
        return ShardPlan(mode="tensor", layer_end=n_layers, **base)
    pipeline = _pipeline_problem(model, size) if mode != "tensor" else "not asked"
    if pipeline is None:
        split = [n_layers // size + (1 if r < n_layers % size else 0) for r in range(size)]
        # mlx_lm gives rank 0 the last layers (see PipelineMixin.pipeline).
        start = sum(split[rank + 1:])
        return ShardPlan(mode="pipeline", layer_start=start, layer_end=start + split[rank],
                         **base)
    raise _requirements(model, heads, size, mode, tensor, pipeline)


# ---------------------------------------------------------------- sharding
def shard_model(model: nn.Module, group: Any, mode: str | None = None) -> ShardPlan:
    """Shard ``model`` in place over ``group`` (collective); returns the plan.

    ``mode`` defaults to ``$VELOXQUANT_SHARD`` (``auto``). The full weights are freed
    once the shards are materialized.
    """
    global _PLAN
    mode = mode or _mode_from_env()
    plan = plan_sharding(model, group.size(), group.rank(), mode)
    check_same_on_ranks(group, "model and sharding plan", plan.shared())
    if plan.mode == "tensor":
        model.shard(group)
    elif plan.mode == "pipeline":
        model.model.pipeline(group)
        if plan.rank != 0:
            _install_pipeline_tail(model)
    mx.eval(model.parameters())
    gc.collect()
    mx.clear_cache()
    _check_sharded(model, plan)
    barrier(group)
    _PLAN = plan
    if plan.rank == 0:
        print(f"[veloxquant] {_model_name(model)}: {plan.describe()}", file=sys.stderr,
              flush=True)
    return plan


def _check_sharded(model: nn.Module, plan: ShardPlan) -> None:
    """The model really runs the share of heads / layers the plan gives this rank."""
    if plan.mode == "tensor":
        want = (plan.n_heads // plan.size, plan.n_kv_heads // plan.size)
        got = _head_counts(model)
        if any(h != want for h in got):
            raise ShardingError(
                f"{_model_name(model)}: after model.shard() a rank runs {sorted(set(got))} "
                f"(query, KV) heads, expected {want}; its shard() does not split attention "
                "by heads")
    elif plan.mode == "pipeline":
        inner = model.model
        if (inner.start_idx, inner.end_idx) != (plan.layer_start, plan.layer_end):
            raise ShardingError(
                f"{_model_name(model)}: pipeline() gave rank {plan.rank} layers "
                f"{inner.start_idx}-{inner.end_idx}, expected {plan.layer_start}-"
                f"{plan.layer_end}")


# mlx_lm's pipeline models make the last cache of a rank that sends depend on the send
# (``cache[-1].keys = mx.depends(cache[-1].keys, h)``) so that evaluating the caches'
# state (chunked prefill) runs it. Compressed caches hold no ``keys`` array (or one in
# their own format), so during a forward pass the last cache is reached through a
# ``_TailProxy`` that keeps that dependency, and the cache's ``state`` carries it.
_STATE_CLASSES: dict[type, type] = {}


class _TailProxy:
    """Forwards everything to the cache except the ``keys`` that the model sets."""

    __slots__ = ("_cache", "keys")

    def __init__(self, cache: Any) -> None:
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "keys", mx.array(0.0))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "keys":
            object.__setattr__(self, name, value)
        else:
            setattr(self._cache, name, value)


def _with_dependency(state: Any, dep: mx.array) -> Any:
    """``state`` with its first array made to depend on ``dep``."""
    done = False

    def walk(x: Any) -> Any:
        nonlocal done
        if done:
            return x
        if isinstance(x, mx.array):
            done = True
            return mx.depends(x, dep)
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(state)


def _state_class(cls: type) -> type:
    """``cls`` whose ``state`` also depends on the last send (same name and module)."""
    if cls not in _STATE_CLASSES:
        base_state = cls.state

        def get_state(self: Any) -> Any:
            dep = self.__dict__.get("_pipeline_dep")
            state = base_state.fget(self)
            return state if dep is None else _with_dependency(state, dep)

        _STATE_CLASSES[cls] = type(cls.__name__, (cls,), {
            "state": property(get_state, base_state.fset), "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "_pipeline_base": cls})
    return _STATE_CLASSES[cls]


def _install_pipeline_tail(model: nn.Module) -> None:
    from mlx_lm.models.cache import KVCache

    base = type(model)

    def call(self: Any, inputs: mx.array, cache: Any = None, *args: Any, **kw: Any) -> Any:
        last = cache[-1] if cache else None
        # mlx_lm's own caches take the dependency on their keys themselves.
        if last is None or isinstance(last, KVCache) or \
                not isinstance(getattr(type(last), "state", None), property):
            return base.__call__(self, inputs, cache, *args, **kw)
        proxy = _TailProxy(last)
        out = base.__call__(self, inputs, [*cache[:-1], proxy], *args, **kw)
        if type(last) not in _STATE_CLASSES.values():
            last.__class__ = _state_class(type(last))
        last.__dict__["_pipeline_dep"] = proxy.keys
        return out

    model.__class__ = type(base.__name__, (base,), {"__call__": call,
                                                    "__module__": base.__module__})


# ---------------------------------------------------------------- rank output
class _RankPrefixed(io.TextIOBase):
    """A text stream that starts every line with the rank (stderr of a rank)."""

    def __init__(self, stream: Any, prefix: str) -> None:
        self.stream, self.prefix, self.at_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for line in text.splitlines(keepends=True):
            out.append((self.prefix if self.at_start else "") + line)
            self.at_start = line.endswith("\n")
        self.stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")


def _lost_peer(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "peer" in text or text.startswith(("[ring]", "[jaccl]", "[mpi]", "[nccl]")))


def install_rank_output(group: Any) -> None:
    """Rank 0 alone writes stdout; every rank's stderr lines carry ``[rank r/n]``.

    A rank that loses its connection to another (that rank stopped or crashed) ends
    with a one-line error instead of a traceback. Idempotent.
    """
    if group is None or isinstance(sys.stderr, _RankPrefixed):
        return
    sys.stderr = _RankPrefixed(sys.stderr, f"[rank {group.rank()}/{group.size()}] ")
    if group.rank() > 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    previous = sys.excepthook

    def hook(kind: type, exc: BaseException, tb: Any) -> None:
        if _lost_peer(exc):
            print(f"veloxquant: error: lost the connection to another rank of this "
                  f"mlx.launch job ({exc}); that rank stopped or crashed, its own output "
                  "says why", file=sys.stderr, flush=True)
            return
        previous(kind, exc, tb)

    sys.excepthook = hook
    atexit.register(_finish_pending_work)


def _finish_pending_work() -> None:
    """Run what this rank already scheduled before the process ends.

    mlx_lm's generation loop evaluates one step ahead (``async_eval``); a rank that
    exits with that step pending never sends its part, and another rank still waiting
    for it (a pipeline stage, a collective) fails. Every rank scheduled the same step,
    so waiting for it here is symmetric.
    """
    generate = sys.modules.get("mlx_lm.generate")
    streams = [getattr(generate, "generation_stream", None), None]
    for stream in streams:
        try:
            mx.synchronize(stream) if stream is not None else mx.synchronize()
        except RuntimeError as exc:  # a peer is gone: nothing left to finish
            print(f"veloxquant: {exc}", file=sys.stderr, flush=True)


def _fingerprint(args: Any, configs: Sequence[Any]) -> dict[str, Any]:
    items = {} if args is None else {k: v for k, v in sorted(vars(args).items())
                                     if not callable(v)}
    return {"args": items, "configs": [c.to_dict() if hasattr(c, "to_dict") else str(c)
                                       for c in configs]}


# ---------------------------------------------------------------- loading
def load_for_ranks(name_or_path: str | None = None, args: Any = None,
                   configs: Sequence[Any] = ()) -> tuple[nn.Module, Any]:
    """``veloxquant_mlx.models.load``, sharded over the ranks of an ``mlx.launch`` job.

    In one process it is exactly ``load(name_or_path, dtype=args.dtype)``. Under ``mlx.launch`` every rank
    checks that all ranks got the same command line (``args``, a parsed namespace) and
    cache configs (``configs``), loads the model (rank 0 first, so a first-time model
    conversion happens once), shards it (``shard_model``) and warns where a method's
    cache is replicated. Only rank 0 writes stdout and output files (``args.json`` /
    ``args.plot`` are cleared on the other ranks).
    """
    from veloxquant_mlx.models import load

    group = world()
    dtype = getattr(args, "dtype", None)
    if group is None:
        return load(name_or_path, dtype=dtype)
    install_rank_output(group)
    check_same_on_ranks(group, "command line", _fingerprint(args, configs))
    if group.rank() > 0 and args is not None:
        for name in ("json", "plot"):
            if getattr(args, name, None):
                setattr(args, name, None)
    if group.rank() == 0:
        loaded = load(name_or_path, dtype=dtype)
    barrier(group)
    if group.rank() > 0:
        loaded = load(name_or_path, dtype=dtype)
    model = loaded[0]
    plan = shard_model(model, group)
    for config in configs:
        _warn_replicated(model, config, plan)
    return loaded


def _as_config(config: Any) -> Any:
    from veloxquant_mlx.config import KVCacheConfig

    if isinstance(config, str):
        try:
            return KVCacheConfig.from_string(config)
        except ConfigError:
            return None
    return config


def replication_warning(model: nn.Module, config: Any, plan: ShardPlan) -> str | None:
    """Why ``config``'s caches do not shrink with the world size, or ``None``.

    The method says what of its cache tensor parallelism replicates
    (``replicated_by_tensor_parallelism``): XQuant caches the attention input X, which
    every rank has whole, unless its latent mode stores the rank's own, narrower, K/V
    latents (sharded).
    """
    config = _as_config(config)
    if config is None or plan.mode != "tensor":
        return None
    attn = next((a for a in map(attention_module, model_layers(model)) if a is not None),
                None)
    if attn is None:
        return None
    # Rows of a (sharded, possibly quantized) projection are its outputs on this rank.
    projs = [getattr(attn, name, None) for name in ("k_proj", "v_proj")]
    kv_width = sum(int(p.weight.shape[0]) for p in projs if p is not None)
    hidden = int(getattr(getattr(model, "args", None), "hidden_size", 0) or kv_width)
    what = get_method(config.method).profile.replicated(config.options,
                                                                      kv_width, hidden)
    if what is None:
        return None
    return (f"method {config.method!r} caches {what}, which tensor parallelism replicates: "
            f"each of the {plan.size} ranks holds the whole cache, as much as one process "
            "would (the held bytes each rank prints at the end are per rank; "
            "docs/distributed.md has measurements)")


def _warn_replicated(model: nn.Module, config: Any, plan: ShardPlan) -> None:
    message = replication_warning(model, config, plan)
    if message and plan.rank == 0:
        print(f"[veloxquant] warning: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- serving
def response_generator(cls: type, provider: Any, pool: Any, *args: Any) -> Any:
    """``cls(provider, pool, *args)`` (an mlx_lm ``ResponseGenerator``), sharded under
    mlx.launch.

    One process: just that. Under ``mlx.launch`` the model is loaded and sharded (tensor
    parallel) on every rank before the generation thread starts; mlx_lm's generator
    shares each request from rank 0 with the other ranks, which build their own caches
    (``pool``) for their heads. Rank 0 gets the generator back and serves HTTP; the other
    ranks follow requests here until the job ends, and never return.
    """
    group = world()
    if group is None:
        return cls(provider, pool, *args)
    install_rank_output(group)
    mode = _mode_from_env()
    if mode == "pipeline":
        raise config_error(ENV_SHARD, mode, "'tensor' or 'auto' for veloxquant serve (its "
                           "batched generation runs tensor parallel only)", "environment")
    check_same_on_ranks(group, "command line", _fingerprint(provider.cli_args, [pool.config]))
    original = provider._load
    for turn in (0, 1):  # rank 0 first: a first-time model conversion happens once
        if (group.rank() == 0) == (turn == 0):
            provider.load("default_model")
        barrier(group)
    plan = shard_model(provider.model, group, "tensor")
    _warn_replicated(provider.model, pool.config, plan)

    def load_and_shard(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        shard_model(provider.model, group, "tensor")

    provider._load = load_and_shard
    generator = cls(provider, pool, *args)
    _share_picklable(generator, group)
    if group.rank() == 0:
        return generator
    generator.join()
    if getattr(generator, "_generation_failed", False):
        print("veloxquant serve: error: this rank's generation stopped (see above)",
              file=sys.stderr, flush=True)
        raise SystemExit(1)
    raise SystemExit(0)


def _picklable(obj: Any) -> Any:
    """``obj``, or a shallow copy without the attributes that cannot be pickled."""
    try:
        pickle.dumps(obj)
        return obj
    except Exception:  # noqa: BLE001 - any pickling failure: fall back to the copy
        out = copy.copy(obj)
    for name, value in list(vars(out).items()):
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001
            delattr(out, name)
    return out


def _share_picklable(generator: Any, group: Any) -> None:
    """mlx_lm sends each request from rank 0 to the other ranks by pickling it. What
    only rank 0 uses (e.g. an admission ticket holding locks) is left out of what is
    sent; rank 0 keeps its request as it is."""
    original = generator._share_request

    def share(request: Any) -> Any:
        if request is None or group.rank() != 0:
            return original(request)
        original((request[0], *map(_picklable, request[1:])))
        return request

    generator._share_request = share


# ---------------------------------------------------------------- saved caches
def shard_header() -> dict[str, Any]:
    """World size, rank and sharding of this process (saved in prompt-cache headers)."""
    group = world()
    if group is None:
        return {"world_size": 1, "rank": 0, "mode": "single"}
    plan = _PLAN
    out: dict[str, Any] = {"world_size": group.size(), "rank": group.rank(),
                           "mode": plan.mode if plan else "unknown"}
    if plan is not None and plan.mode == "pipeline":
        out["layers"] = [plan.layer_start, plan.layer_end]
    return out


def _split_name(path: Path) -> tuple[str, str]:
    name = path.name
    ext = ".safetensors" if name.endswith(".safetensors") else ""
    return _RANK_SUFFIX.sub("", name[:len(name) - len(ext)]), ext


def rank_path(path: str | os.PathLike) -> Path:
    """This rank's file: ``x.safetensors`` -> ``x.rank1-of-2.safetensors`` under a job of
    several ranks; unchanged in one process."""
    path = Path(path)
    group = world()
    if group is None:
        return path
    stem, ext = _split_name(path)
    return path.with_name(f"{stem}.rank{group.rank()}-of-{group.size()}{ext}")


def saved_world_hint(path: str | os.PathLike) -> str | None:
    """For a missing file: which world sizes the files saved under that name came from."""
    path = Path(path)
    stem, ext = _split_name(path)
    sizes = set()
    for p in path.parent.glob(f"{stem}.rank*-of-*{ext}"):
        m = _RANK_SUFFIX.search(p.name[:len(p.name) - len(ext)])
        if m:
            sizes.add(int(m.group(2)))
    if (path.parent / f"{stem}{ext}").is_file():
        sizes.add(1)
    if not sizes:
        return None
    group = world()
    here = group.size() if group else 1
    return (f"prompt cache {str(path)!r} does not exist for this job of {here} rank(s); "
            f"files saved under that name come from jobs of {sorted(sizes)} rank(s): load "
            "them with the same number of ranks and the same sharding")


def shard_mismatch(saved: dict[str, Any] | None) -> str | None:
    """Why a file saved with sharding ``saved`` (its header's ``shard``) cannot load here."""
    saved = saved or {"world_size": 1, "rank": 0, "mode": "single"}
    here = shard_header()
    if saved.get("world_size") != here["world_size"]:
        return (f"saved by rank {saved.get('rank')} of a job of {saved.get('world_size')} "
                f"rank(s) ({saved.get('mode')}); this job runs {here['world_size']} rank(s): "
                f"load it with {saved.get('world_size')} rank(s) and the same sharding")
    if saved.get("rank") != here["rank"]:
        return f"saved by rank {saved.get('rank')}; this is rank {here['rank']}"
    for key in ("mode", "layers"):
        known = "unknown" not in (saved.get("mode"), here["mode"])
        if known and saved.get(key) != here.get(key):
            return (f"saved with sharding {key}={saved.get(key)!r}; this job runs "
                    f"{key}={here.get(key)!r}")
    return None
