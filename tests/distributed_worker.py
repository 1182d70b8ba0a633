"""What each rank of ``mlx.launch`` runs for tests/test_distributed.py (also in one process).

    python distributed_worker.py methods OUT LLAMA_DIR QWEN2_DIR

Tensor parallel (llama) runs of every registered method and pipeline (qwen2) runs of
the cross-layer ones, a saved prompt cache per rank, ranks given different configs; each
rank writes OUT/rank<r>.json. Then rank 1 leaves in the middle of the job, and rank 0
must end with a clear error.

``run_methods`` is also called in the test process for the single-process reference.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
from conftest import LOSSLESS_OPTIONS, PROMPT  # noqa: E402
from mlx_lm.generate import generate_step, generation_stream  # noqa: E402

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig  # noqa: E402
from veloxquant_mlx.adapter.builder import cache_stats  # noqa: E402
from veloxquant_mlx.apps import distributed as dist  # noqa: E402
from veloxquant_mlx.registry import methods  # noqa: E402

# 4 KV heads (2 per rank over 2 ranks); X (512 wide) is wider than K and V together, so
# XQuant stores latents of the K/V projections, which tensor parallelism splits.
DIMS = dict(hidden_size=512, num_hidden_layers=2, intermediate_size=512,
            num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=128,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            max_position_embeddings=4096)
WORDS = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant"] + [
    f"w{i}" for i in range(123)]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
# Every collective waits for the other rank to be scheduled (milliseconds on 2 shared
# cores): 2 layers under tensor parallelism (4 all_sums per token), 4 layers (2 per rank)
# under pipeline parallelism, few forward passes.
LAYERS = {"llama": 2, "qwen2": 4}
NEW_TOKENS = 4
# 160 prompt tokens: enough that what the caches hold outweighs their small fixed
# overheads (an all-heads cache on a rank is then plainly not "about half").
PROMPT_LEN = 160
LONG_PROMPT = [(i * 37 + 11) % 120 + 1 for i in range(PROMPT_LEN)]
# LOSSLESS_OPTIONS are for a 40-token prompt; these keep everything of 168 tokens too
# (KIVI window, xKV's full-rank first block + window).
LONG_OPTIONS = {"kivi": dict(window=256), "xkv": dict(block=128, rank_k=128, rank_v=128,
                                                      window=64)}


def write_tiny_model(folder: Path, model_type: str = "llama", seed: int = 0) -> Path:
    """A random model with a word-level tokenizer, in mlx_lm's folder format."""
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, models, pre_tokenizers

    from veloxquant_mlx.testing.tiny import tiny_model

    dims = dict(DIMS, num_hidden_layers=LAYERS[model_type])
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, tiny_model(model_type, seed=seed, **dims))
    save_config(dict(dims, model_type=model_type), folder / "config.json")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}))
    return folder


# Pipeline runs: the reference and the cross-layer methods, whose groups must stay within
# a rank (every collective costs milliseconds on 2 shared cores).
PIPELINE_METHODS = ("none", "xkv", "minicache", "xquant_cl")


def method_options(pipeline: bool) -> dict[str, dict[str, Any]]:
    """Lossless settings; MiniCache pairs layers (0,1) (and (2,3)) in every layout."""
    names = PIPELINE_METHODS if pipeline else tuple(methods())
    out = {m: {**LOSSLESS_OPTIONS.get(m, {}), **LONG_OPTIONS.get(m, {})} for m in names}
    # A pipeline rank numbers its 2 layers 0-1; 2-layer models need the pair to start at 0.
    out["minicache"]["start_layer"] = 0
    return out


def quiet_memory() -> int:
    # Work still running on generate_step's stream holds transients: let it end first.
    mx.synchronize(generation_stream)
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def run_method(model: Any, config: KVCacheConfig, chunk: int = 256) -> dict[str, Any]:
    """Greedy generation; tokens, log-probabilities and the bytes the caches keep.

    ``chunk``: prefill chunk (pipeline runs use several: each chunk's send must run when
    only the caches' state is evaluated)."""
    KVCacheBuilder.detach(model)
    # A first run, not measured: MLX keeps one-time state from a kernel's first use in a
    # process (compiled kernels and their constants, about 10 KB for the attention's),
    # which would otherwise count as the caches' bytes on whichever rank ran it first.
    for _ in generate_step(mx.array(LONG_PROMPT), model, max_tokens=2,
                           prompt_cache=KVCacheBuilder.for_model(model, config),
                           sampler=lambda x: mx.argmax(x, axis=-1), prefill_step_size=chunk):
        pass
    KVCacheBuilder.detach(model)
    base = quiet_memory()
    t0 = time.perf_counter()
    caches = KVCacheBuilder.for_model(model, config)
    t1 = time.perf_counter()
    tokens, rows = [], []
    for token, logprobs in generate_step(
            mx.array(LONG_PROMPT), model, max_tokens=NEW_TOKENS, prompt_cache=caches,
            sampler=lambda x: mx.argmax(x, axis=-1), prefill_step_size=chunk):
        tokens.append(int(token))
        rows.append(logprobs.tolist())
    del logprobs
    t2 = time.perf_counter()
    retained = quiet_memory() - base
    held = cache_stats(caches)["held_bytes"]
    del caches
    KVCacheBuilder.detach(model)
    return {"tokens": tokens, "logprobs": rows, "retained": retained, "held": held,
            "seconds": [round(t1 - t0, 3), round(t2 - t1, 3)]}


def run_methods(model: Any, pipeline: bool) -> dict[str, Any]:
    return {m: run_method(model, KVCacheConfig(m, **opts), 96 if pipeline else 256)
            for m, opts in method_options(pipeline).items()}


def probe_on_rank0_only(model: Any, group: Any) -> float:
    """Rank 0 builds every method's caches (the builder's routing probe runs the sharded
    forward lazily) while rank 1 waits; a probe that ran a collective would pair with
    the all_sum below and hang or corrupt it."""
    if group.rank() == 0:
        for m, opts in method_options(False).items():
            KVCacheBuilder.for_model(model, KVCacheConfig(m, **opts))
        KVCacheBuilder.detach(model)
    total = mx.distributed.all_sum(mx.array(float(group.rank() + 1)), group=group)
    return float(total.item())


def _arrays(state: Any) -> list[mx.array]:
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, (list, tuple)):
        return [a for x in state for a in _arrays(x)]
    return []


def save_and_reload(model: Any, out: Path) -> dict[str, Any]:
    """A kivi cache saved by each rank to its own file, then loaded back in the same job."""
    from veloxquant_mlx.apps.prompt_cache import load_prompt_cache, save_prompt_cache

    config = KVCacheConfig("kivi", **LOSSLESS_OPTIONS["kivi"])
    caches = KVCacheBuilder.for_model(model, config)
    for _ in generate_step(mx.array(PROMPT), model, max_tokens=2, prompt_cache=caches,
                           sampler=lambda x: mx.argmax(x, axis=-1)):
        pass
    save_prompt_cache(out / "kivi.safetensors", caches)
    loaded = load_prompt_cache(out / "kivi.safetensors", model)
    same = all(_arrays(c.state) and len(_arrays(c.state)) == len(_arrays(d.state)) and all(
        mx.array_equal(a, b).item() for a, b in zip(_arrays(c.state), _arrays(d.state)))
        for c, d in zip(caches, loaded))
    KVCacheBuilder.detach(model)
    dist.barrier(dist.world())  # every rank has written its file before one lists them
    return {"offsets": [c.offset for c in loaded], "same_state": bool(same),
            "files": sorted(p.name for p in out.glob("kivi*.safetensors"))}


def methods_job(out: Path, llama_dir: str, qwen2_dir: str) -> None:
    from veloxquant_mlx.models import load

    t0 = time.perf_counter()
    group = dist.world()
    model, _ = dist.load_for_ranks(llama_dir)  # tensor parallel (auto)
    record: dict[str, Any] = {"rank": group.rank(), "size": group.size(),
                              "probe_sum": probe_on_rank0_only(model, group)}
    t1 = time.perf_counter()
    record["tensor"] = run_methods(model, pipeline=False)
    t2 = time.perf_counter()
    record["saved"] = save_and_reload(model, out)
    del model
    model, _ = load(qwen2_dir)
    plan = dist.shard_model(model, group, "pipeline")
    record["pipeline_layers"] = [plan.layer_start, plan.layer_end]
    t3 = time.perf_counter()
    record["pipeline"] = run_methods(model, pipeline=True)
    record["seconds"] = {"load_probe": t1 - t0, "tensor": t2 - t1, "save_load": t3 - t2,
                         "pipeline": time.perf_counter() - t3}
    record["mismatch"] = mismatch(group)
    (out / f"rank{group.rank()}.json").write_text(json.dumps(record))
    lose_a_rank(model, group)


def mismatch(group: Any) -> str:
    """Ranks given different cache configs: the error every rank gets."""
    config = KVCacheConfig("kivi", bits=4 if group.rank() == 0 else 2)
    try:
        dist.check_same_on_ranks(group, "cache config", config.to_dict())
    except dist.RankMismatchError as exc:
        return str(exc)
    return "no error"


def lose_a_rank(model: Any, group: Any) -> None:
    """Rank 1 leaves without a word and with status 0, so mlx.launch does not stop rank 0
    (it does on a non-zero status): rank 0's next collective must end the job."""
    if group.rank() == 1:
        os._exit(0)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig("kivi", bits=4, group_size=32))
    for _ in range(20):
        mx.eval(model(mx.array([[1]]), cache=caches))
    print("rank 0 was never told", flush=True)


if __name__ == "__main__":
    job, out = sys.argv[1], Path(sys.argv[2])
    if job != "methods":
        raise SystemExit(f"unknown job {job!r}")
    methods_job(out, sys.argv[3], sys.argv[4])
