"""``veloxquant generate``: ``mlx_lm.generate``'s command line over compressed KV caches.

The parser starts from mlx_lm.generate's own (``setup_arg_parser``), so every one of its
flags keeps its meaning (sampling, chat template, prompt cache file, draft model, ...);
``--kv SPEC`` (``KVCacheConfig.from_string``) and ``--kv-config FILE``
(``KVCacheConfig.from_file``) choose the method. Method options live in the spec: the
flat flags of earlier releases (``--method``, ``--bits``, ``--t``, ...) are refused with
the spelling that replaces them. Generation is mlx_lm's own ``generate`` with
``prompt_cache=`` the caches ``KVCacheBuilder.for_model`` builds, or those a
``--prompt-cache-file`` written by ``save_prompt_cache`` holds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Iterable
from typing import Any

from veloxquant_mlx.config import SHARED, ConfigError, KVCacheConfig, parse_value

OLD_DEST = "old_flags"  # (flag as typed, option field, value) of every refused flag
NO_VALUE = object()  # a refused flag given without a value


class _OldFlag(argparse.Action):
    """Records a flag of the old flat spelling; the parser refuses them all at once
    (``old_flags_problem``), so that the message can spell the whole spec."""

    def __init__(self, option_strings: list[str], dest: str, field: str = "",
                 **kwargs: Any) -> None:
        super().__init__(option_strings, OLD_DEST, default=None, help=argparse.SUPPRESS,
                         **kwargs)
        self.field = field

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        seen = list(getattr(namespace, OLD_DEST, None) or [])
        seen.append((option_string, self.field, NO_VALUE if values in (None, []) else values))
        setattr(namespace, OLD_DEST, seen)


def mlx_lm_parser() -> argparse.ArgumentParser:
    """The installed mlx_lm.generate's own parser (imported by module name: the package
    attribute ``mlx_lm.generate`` is the function)."""
    return importlib.import_module("mlx_lm.generate").setup_arg_parser()


def generate_parents() -> list[argparse.ArgumentParser]:
    """Parents for the ``generate`` subparser: mlx_lm.generate's parser, with ``--model``
    defaulting to the embedded model and a bare ``--verbose`` meaning ``--verbose True``."""
    base = mlx_lm_parser()
    for action in base._actions:
        if "--model" in action.option_strings:
            action.help = ("model folder, Hugging Face repo id, .gguf file or catalogue name "
                           "(default: the embedded model)")
        elif "--verbose" in action.option_strings:
            action.nargs, action.const = "?", True  # the older bare flag still parses
    return [base]


def add_generate_arguments(parser: argparse.ArgumentParser,
                           options: dict[str, Iterable[str]]) -> None:
    """``--kv`` / ``--kv-config``, and the old flat flags (refused): ``options`` maps
    every method option to its older alias names."""
    parser.add_argument("--kv", default=None, metavar="SPEC",
                        help="KV cache method and its options, e.g. 'turboquant' or "
                        "'kivi:bits=2,window=64' (`veloxquant methods` lists them; "
                        "default: none, the dense cache)")
    parser.add_argument("--kv-config", default=None, metavar="FILE",
                        help="JSON config (KVCacheConfig.to_file, veloxquant tune --out); "
                        "a --kv spec of the same method beside it overrides its options")
    fields: dict[str, Iterable[str]] = {"method": (), "config": (),
                                        **{s: () for s in SHARED}, **options}
    for field, aliases in fields.items():
        flags = ["--" + n.replace("_", "-") for n in (field, *sorted(aliases))]
        # A flag of mlx_lm's (--seed: sampling) keeps mlx_lm's meaning.
        flags = [f for f in flags if f not in parser._option_string_actions]
        if flags:
            parser.add_argument(*flags, action=_OldFlag, field=field, nargs="?")
    parser.add_argument("--chat", "--no-chat", action=_OldFlag, field="chat", nargs=0)


def _new_spelling(seen: list[tuple[str, str, Any]]) -> str:
    values = {field: value for _, field, value in seen}
    chat = [flag for flag, field, _ in seen if field == "chat"]
    method, config = values.pop("method", None), values.pop("config", None)
    values.pop("chat", None)
    items = ",".join(f"{k}={'VALUE' if v is NO_VALUE else v}" for k, v in values.items())
    out = []
    if config is not None:
        out.append(f"--kv-config {config}")
    if method is not None and method is not NO_VALUE:
        out.append(f"--kv {method}" + ((',' if ':' in method else ':') + items if items else ""))
    elif items:
        owner = "the file's method" if config is not None else "`veloxquant methods`"
        out.append(f"--kv METHOD:{items} (METHOD: {owner})")
    if "--no-chat" in chat:
        out.append("--ignore-chat-template")
    text = "use " + " ".join(out) if out else ""
    if "--chat" in chat:
        text += ("; " if text else "") + "drop --chat (the chat template applies whenever " \
                                         "the tokenizer has one)"
    return text


def old_flags_problem(namespace: argparse.Namespace) -> str | None:
    """Why a command line with the old flat flags is refused, and the new spelling."""
    seen = getattr(namespace, OLD_DEST, None)
    if not seen:
        return None
    typed = " ".join(flag if value is NO_VALUE else f"{flag} {value}"
                     for flag, _, value in seen)
    return (f"{typed}: generate takes mlx_lm.generate's flags, and the KV method with its "
            f"options as one spec: {_new_spelling(seen)}")


def _spec_values(spec: str) -> tuple[str, dict[str, Any]]:
    """The method and the values a spec names (validated by ``from_string`` first)."""
    KVCacheConfig.from_string(spec)
    method, _, rest = spec.partition(":")
    values = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, _, raw = item.partition("=")
        values[key.strip()] = parse_value(raw.strip())
    return method.strip(), values


def generate_config(args: argparse.Namespace) -> KVCacheConfig | None:
    """The config of ``--kv`` / ``--kv-config`` (None when neither was given)."""
    spec, path = args.kv, args.kv_config
    if path is None:
        return KVCacheConfig.from_string(spec) if spec is not None else None
    base = KVCacheConfig.from_file(path)
    if spec is None:
        return base
    method, values = _spec_values(spec)
    if method != base.method:
        raise ConfigError(f"--kv {spec!r} names method {method!r} but --kv-config {path!r} "
                          f"holds {base.method!r}: give one of them, or a spec of the "
                          "file's method to override its options")
    return base.replace(**values)


def _refuse_unsupported(args: argparse.Namespace, config: KVCacheConfig) -> None:
    """mlx_lm flags that have no meaning over veloxquant's caches, refused by name."""
    if args.image:
        raise ConfigError("--image: veloxquant generate runs text prompts only; vision "
                          "prompts need mlx_lm.generate")
    if args.kv_bits is not None:
        raise ConfigError(f"--kv-bits quantizes mlx_lm's own cache; here the spec does: use "
                          f"--kv affine:bits={args.kv_bits},group_size={args.kv_group_size}")
    if args.max_kv_size is not None:
        if args.prompt_cache_file is not None:
            raise ConfigError("--max-kv-size with --prompt-cache-file: the file's caches "
                              "are used as saved")
        if not config.is_reference:
            raise ConfigError(f"--max-kv-size bounds mlx_lm's own dense cache (--kv none); "
                              f"method {config.method!r} keeps its own: bound it with its "
                              "options (max_ctx=N, or e.g. --kv streaming:sink=4,window=N)")
    if args.draft_model is not None and args.prompt_cache_file is not None:
        raise ConfigError("--draft-model with --prompt-cache-file: the file holds the "
                          "model's caches only, none for the draft model")


def _saved(args: argparse.Namespace, requested: KVCacheConfig | None
           ) -> tuple[KVCacheConfig, dict[str, Any]]:
    """The config and metadata of ``--prompt-cache-file`` (refused when ``--kv``
    asks for another config than the file holds)."""
    from veloxquant_mlx.apps.prompt_cache import read_prompt_cache_header

    header = read_prompt_cache_header(args.prompt_cache_file)
    try:
        saved = KVCacheConfig.from_dict(header["config"])
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"--prompt-cache-file {args.prompt_cache_file!r}: no readable "
                          f"config in its header ({exc!r})") from exc
    if requested is not None and requested != saved:
        raise ConfigError(f"--prompt-cache-file {args.prompt_cache_file!r} holds caches of "
                          f"{saved.to_string()!r}, not {requested.to_string()!r}: drop "
                          "--kv/--kv-config, or build the file with that config")
    return saved, dict(header.get("metadata") or {})


def _model_path(args: argparse.Namespace, metadata: dict[str, Any]) -> str | None:
    saved = metadata.get("model")
    if args.model is None:
        return saved  # None: the embedded model
    if saved is not None and saved != args.model:
        raise ConfigError(f"--model {args.model!r} is not the model the prompt cache was "
                          f"made with ({saved!r})")
    return args.model


def _load(args: argparse.Namespace, path: str | None, config: KVCacheConfig) -> Any:
    """The model and tokenizer; mlx_lm's loading flags go to ``mlx_lm.load``."""
    from veloxquant_mlx.apps.distributed import load_for_ranks, world
    from veloxquant_mlx.models import named_model_path

    asks = [flag for flag, on in (("--adapter-path", args.adapter_path),
                                  ("--trust-remote-code", args.trust_remote_code),
                                  ("--quantize-activations", args.quantize_activations)) if on]
    if not asks:
        return load_for_ranks(path, args, [config])  # sharded under mlx.launch
    if path is None or path.lower().endswith(".gguf") or named_model_path(path):
        raise ConfigError(f"{', '.join(asks)}: for a model mlx_lm loads (an mlx model folder "
                          f"or repo id); {path or 'the embedded model'} is a GGUF file")
    if world() is not None:
        raise ConfigError(f"{', '.join(asks)}: not under mlx.launch")
    import mlx_lm

    return mlx_lm.load(path, tokenizer_config={"trust_remote_code": args.trust_remote_code},
                       model_config={"quantize_activations": args.quantize_activations},
                       adapter_path=args.adapter_path,
                       trust_remote_code=args.trust_remote_code)[:2]


def _prompt(args: argparse.Namespace, tokenizer: Any, using_cache: bool) -> list[int]:
    """The prompt's tokens, as mlx_lm.generate makes them (chat template, system prompt,
    prefilled response; with a prompt cache, only what follows the cached prefix)."""
    try:
        template_kwargs = json.loads(args.chat_template_config or "{}")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--chat-template-config is not a JSON object: {exc}") from exc
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    use_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if use_template:
        messages = [] if args.system_prompt is None else [
            {"role": "system", "content": args.system_prompt}]
        messages.append({"role": "user", "content": prompt})
        prefill = args.prefill_response is not None
        if prefill:
            messages.append({"role": "assistant", "content": args.prefill_response})
        kw = dict(tokenize=False, continue_final_message=prefill,
                  add_generation_prompt=not prefill)
        prompt = tokenizer.apply_chat_template(messages, **kw, **template_kwargs)
        if using_cache:  # the cache holds the prefix: keep what follows the query
            messages[-1]["content"] = "<query>"
            marker = tokenizer.apply_chat_template(messages, **kw)
            prompt = prompt[marker.index("<query>"):]
    return tokenizer.encode(prompt, add_special_tokens=not use_template)


def _caches(args: argparse.Namespace, model: Any, config: KVCacheConfig) -> list[Any]:
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    from veloxquant_mlx.adapter.builder import KVCacheBuilder
    from veloxquant_mlx.apps.prompt_cache import load_prompt_cache

    if args.prompt_cache_file is not None:
        return load_prompt_cache(args.prompt_cache_file, model=model)
    if args.max_kv_size is not None:
        # The reference method: mlx_lm's own ring (keep=4, as mlx_lm makes it) in every
        # full-attention slot, also where the model's make_cache would ignore the size.
        return [RotatingKVCache(max_size=args.max_kv_size, keep=4) if type(c) is KVCache
                else c for c in make_prompt_cache(model)]
    return KVCacheBuilder.for_model(model, config)


def _draft(args: argparse.Namespace, tokenizer: Any, caches: list[Any],
           config: KVCacheConfig) -> tuple[Any, list[Any]]:
    """The draft model and its caches (mlx_lm's own), or (None, [])."""
    if args.draft_model is None:
        return None, []
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx.models import load

    stuck = sorted({type(c).__name__ for c in caches if not c.is_trimmable()})
    if stuck:
        raise ConfigError(f"--draft-model: method {config.method!r} cannot drop the draft "
                          f"tokens the model rejects (its {', '.join(stuck)} caches are not "
                          "trimmable); speculative decoding needs a trimmable method, "
                          "e.g. none, affine or kivi")
    draft, draft_tokenizer = load(args.draft_model)
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        raise ConfigError(f"--draft-model {args.draft_model!r}: its tokenizer's vocabulary "
                          f"({draft_tokenizer.vocab_size}) is not the model's "
                          f"({tokenizer.vocab_size})")
    return draft, make_prompt_cache(draft)


def run_generate(args: argparse.Namespace) -> int:
    """``veloxquant generate``: mlx_lm.generate over the method's caches, then one
    summary line (held bytes, ratio to float16) on stderr."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from veloxquant_mlx.adapter.builder import cache_stats

    if args.seed is not None:
        mx.random.seed(args.seed)
    requested = generate_config(args)
    config, metadata = (requested or KVCacheConfig(), {})
    if args.prompt_cache_file is not None:
        config, metadata = _saved(args, requested)
    _refuse_unsupported(args, config)
    model, tokenizer = _load(args, _model_path(args, metadata), config)
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(token)
    caches = _caches(args, model, config)
    draft, draft_caches = _draft(args, tokenizer, caches, config)
    prompt = _prompt(args, tokenizer, args.prompt_cache_file is not None)
    sampler = make_sampler(args.temp, args.top_p, args.min_p, args.min_tokens_to_keep,
                           top_k=args.top_k, xtc_probability=args.xtc_probability,
                           xtc_threshold=args.xtc_threshold,
                           xtc_special_tokens=tokenizer.encode("\n")
                           + list(tokenizer.eos_token_ids))
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                           verbose=args.verbose, sampler=sampler,
                           prefill_step_size=args.prefill_step_size,
                           prompt_cache=caches + draft_caches, draft_model=draft,
                           num_draft_tokens=args.num_draft_tokens)
    if not args.verbose:
        print(text)
    s = cache_stats(caches)
    print(f"[veloxquant] method={config.method} held={s['held_bytes']} B "
          f"fp16-equivalent={s['fp16_bytes']} B ratio={s['ratio']:.3f}", file=sys.stderr)
    return 0
