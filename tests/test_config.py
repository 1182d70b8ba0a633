import pytest

from veloxquant_mlx import ConfigError, KVCacheConfig, list_methods


def test_defaults_are_dense():
    assert KVCacheConfig().method == "none"


def test_unknown_method_names_field_value_and_choices():
    with pytest.raises(ConfigError) as err:
        KVCacheConfig(method="bogus")
    msg = str(err.value)
    assert "method" in msg and "'bogus'" in msg and "affine" in msg


@pytest.mark.parametrize("bits", [1, 7, 9, 16])
def test_affine_rejects_unsupported_bits(bits):
    with pytest.raises(ConfigError, match=rf"bits={bits}.*\[2, 3, 4, 5, 6, 8\]"):
        KVCacheConfig(method="affine", bits=bits)


@pytest.mark.parametrize("group_size", [16, 48, 256])
def test_affine_rejects_group_sizes(group_size):
    with pytest.raises(ConfigError, match="group_size"):
        KVCacheConfig(method="affine", group_size=group_size)


@pytest.mark.parametrize("field,value", [("bits", "4"), ("window", -1), ("max_ctx", 0),
                                         ("bits", True), ("window_dtype", "int8")])
def test_general_validation(field, value):
    with pytest.raises(ConfigError, match=field):
        KVCacheConfig(method="affine", **{field: value})


def test_frozen_and_replace_revalidates():
    cfg = KVCacheConfig(method="affine", bits=4)
    with pytest.raises(AttributeError):
        cfg.bits = 8
    assert cfg.replace(bits=8).bits == 8
    with pytest.raises(ConfigError):
        cfg.replace(bits=7)


def test_from_string_and_dict_round_trip():
    cfg = KVCacheConfig.from_string("affine:bits=8,group_size=32,window=16")
    assert (cfg.method, cfg.bits, cfg.group_size, cfg.window) == ("affine", 8, 32, 16)
    assert KVCacheConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="nonsense"):
        KVCacheConfig.from_string("affine:nonsense=1")
    with pytest.raises(ConfigError, match="key=value"):
        KVCacheConfig.from_string("affine:bits")


def test_from_string_accepts_unprefixed_method_options():
    cfg = KVCacheConfig.from_string("affine:bits=4")
    assert cfg.bits == 4


def test_list_methods_has_reference_first_and_every_method_described():
    rows = list_methods()
    assert rows[0]["name"] == "none"
    for r in rows:
        assert r["paper"] and r["family"] and r["stores"]


def test_options_are_the_methods_own_dataclass():
    cfg = KVCacheConfig("kivi", bits=4)
    assert type(cfg.options).__name__ == "KIVIOptions"
    assert (cfg.options.bits, cfg.options.group_size, cfg.options.window) == (4, 32, 128)
    assert KVCacheConfig("affine").options.bits == 4  # each method's own default
    with pytest.raises(ConfigError, match=r"unknown option 'rank_k' for method 'affine'.*"
                                          r"\['bits', 'group_size', 'window'\]"):
        KVCacheConfig("affine", rank_k=4)


def test_legacy_prefixed_names_still_work():
    new = KVCacheConfig("xkv", rank_k=64, group_layers=2)
    assert KVCacheConfig("xkv", xkv_rank_k=64, xkv_group_size=2) == new
    assert KVCacheConfig.from_string("xkv:xkv_rank_k=64,xkv_group_size=2") == new
    assert KVCacheConfig("xkv", rank_k=64, group_layers=2).xkv_rank_k == 64
    assert KVCacheConfig("minicache", minicache_bits=4).options.bits == 4


def test_legacy_flat_dict_loads():
    # What 0.1 wrote into saved caches: every method's fields, flat.
    old = {"method": "snapkv", "bits": None, "group_size": None, "window": 16,
           "window_dtype": "float16", "max_ctx": 4096, "xkv_group_size": 4,
           "xkv_rank_k": None, "snapkv_capacity": 64, "snapkv_kernel": 5,
           "snapkv_pooling": "avg", "minicache_t": 0.5, "xquant_latent": True}
    cfg = KVCacheConfig.from_dict(old)
    assert cfg == KVCacheConfig("snapkv", capacity=64, kernel=5, pooling="avg", window=16,
                                max_ctx=4096)
    with pytest.raises(ConfigError, match="unknown KVCacheConfig field 'frobnicate'"):
        KVCacheConfig.from_dict({**old, "frobnicate": 1})


def test_0_1_fields_the_method_cannot_hold_are_refused_by_name():
    # The method's own 0.1 option, set, that today's options have no field for.
    with pytest.raises(ConfigError, match=r"0\.1 option xquant_anchor_bits=4 of method 'xquant'"):
        KVCacheConfig.from_dict({"method": "xquant", "xquant_anchor_bits": 4})
    # At 0.1's default it changed nothing: it loads.
    assert KVCacheConfig.from_dict({"method": "xquant_cl", "xquant_latent": True}) == \
        KVCacheConfig("xquant_cl")
    with pytest.raises(ConfigError, match="0.1 config field 'extra'"):
        KVCacheConfig.from_dict({"method": "affine", "extra": {"k": 1}})


def test_0_1_flags_still_parse():
    from veloxquant_mlx.cli import build_parser, config_from_args

    # generate takes the method as one --kv spec; the other subcommands keep the flags.
    args = build_parser().parse_args(["eval", "--method", "xkv", "--xkv-rank-k", "64",
                                      "--xkv-group-size", "2"])
    assert config_from_args(args) == KVCacheConfig("xkv", rank_k=64, group_layers=2)
    args = build_parser().parse_args(["eval", "--method", "minicache",
                                      "--minicache-bits", "4"])
    assert config_from_args(args).options.bits == 4


def test_string_dict_and_file_round_trips(tmp_path):
    cfg = KVCacheConfig("xkv", rank_k=64, factor_bits=4, window_dtype="float32")
    assert cfg.to_string() == "xkv:rank_k=64,factor_bits=4,window_dtype=float32"
    assert KVCacheConfig.from_string(cfg.to_string()) == cfg
    assert KVCacheConfig.from_dict(cfg.to_dict()) == cfg
    cfg.to_file(tmp_path / "c.json")
    assert KVCacheConfig.from_file(tmp_path / "c.json") == cfg
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        KVCacheConfig.from_file(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        KVCacheConfig.from_file(tmp_path / "missing.json")


def test_replace_changes_method_options_and_shared_fields():
    cfg = KVCacheConfig("affine", bits=8, max_ctx=1024)
    assert cfg.replace(window=4).options.window == 4
    other = cfg.replace(method="kivi")
    assert other.method == "kivi" and other.options.bits == 2 and other.max_ctx == 1024
