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


def test_list_methods_has_reference_and_affine():
    rows = {r["name"]: r for r in list_methods()}
    assert rows["none"]["status"] == "implemented"
    assert rows["affine"]["status"] == "implemented"
    for r in rows.values():
        assert r["paper"] and r["family"]
