"""veloxquant_mlx: KV-cache compression for MLX language models.

    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="affine", bits=4))
    mlx_lm.generate(model, tokenizer, prompt, prompt_cache=caches)
"""

from veloxquant_mlx._version import __version__
from veloxquant_mlx.deps import check_versions

# Before anything imports mlx_lm: an unsupported version gets one clear error, not a
# missing name deep in the server.
check_versions()

from veloxquant_mlx.adapter.builder import KVCacheBuilder, cache_stats  # noqa: E402
from veloxquant_mlx.apps.prompt_cache import (  # noqa: E402
    can_trim_prompt_cache,
    load_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from veloxquant_mlx.config import ConfigError, KVCacheConfig  # noqa: E402
from veloxquant_mlx.registry import list_methods  # noqa: E402

__all__ = ["KVCacheBuilder", "KVCacheConfig", "ConfigError", "cache_stats", "list_methods",
           "save_prompt_cache", "load_prompt_cache", "can_trim_prompt_cache",
           "trim_prompt_cache", "__version__"]
