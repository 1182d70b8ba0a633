"""XKVCoordinator: one test per sentence of the reference page, plus the errors."""

import mlx.core as mx
import pytest

from veloxquant_mlx.cache.xkv_coordinator import XKVCoordinator

S, D, G = 40, 16, 3


def _members(g=G, s=S, d=D, seed=0, batch=None):
    mx.random.seed(seed)
    shape = (s, d) if batch is None else (batch, s, d)
    return [mx.random.normal(shape) for _ in range(g)]


def _publish_all(coord, parts, group_id=0, token_start=0, **kw):
    for i, x in enumerate(parts):
        coord.publish_member_keys(group_id, i, token_start, x.shape[-2], x, **kw)


def test_max_ctx_property_and_default():
    assert XKVCoordinator().max_ctx == 8192
    assert XKVCoordinator(max_ctx=100).max_ctx == 100


def test_none_while_members_missing_then_basis():
    coord = XKVCoordinator()
    parts = _members()
    for i, x in enumerate(parts[:-1]):
        coord.publish_member_keys(0, i, 0, S, x)
        assert coord.get_shared_basis(0, 0, G, rank=8) is None
    coord.publish_member_keys(0, G - 1, 0, S, parts[-1])
    A, B, s = coord.get_shared_basis(0, 0, G, rank=8)
    assert A.shape == (S, 8) and B.shape == (G, 8, D) and s.shape == (8,)


def test_joint_svd_of_feature_concatenation():
    coord = XKVCoordinator()
    parts = _members()
    _publish_all(coord, parts)
    A, B, s = coord.get_shared_basis(0, 0, G, rank=D * G if D * G <= S else S)
    # Full rank: every member is reconstructed from the shared token factor.
    for i, x in enumerate(parts):
        assert mx.allclose(A @ B[i], x, atol=1e-3).item()
    # Singular values are those of the [S, G*D] concatenation, descending.
    ref = mx.linalg.svd(mx.concatenate(parts, axis=1), stream=mx.cpu)[1]
    assert mx.allclose(s, ref[: s.shape[0]], rtol=1e-3, atol=1e-3).item()
    # The token factor has orthonormal columns.
    assert mx.allclose(A.T @ A, mx.eye(A.shape[1]), atol=1e-3).item()


def test_truncated_rank_is_best_approximation():
    coord = XKVCoordinator()
    parts = _members()
    _publish_all(coord, parts)
    A, B, s = coord.get_shared_basis(0, 0, G, rank=5)
    x = mx.concatenate(parts, axis=1)
    approx = mx.concatenate([A @ B[i] for i in range(G)], axis=1)
    full = mx.linalg.svd(x, stream=mx.cpu)[1]
    err = mx.sqrt(((x - approx) ** 2).sum()).item()
    best = mx.sqrt((full[5:] ** 2).sum()).item()  # Eckart-Young
    assert err == pytest.approx(best, rel=1e-3)


def test_both_streams_at_once_give_each_streams_own_basis():
    # Keys and values decomposed side by side: each stream's basis is the one its own SVD
    # gives (its own rank), handed to every member.
    together, apart = XKVCoordinator(), XKVCoordinator()
    keys, values = _members(seed=1), _members(seed=2)
    for coord in (together, apart):
        _publish_all(coord, keys, stream="keys")
        _publish_all(coord, values, stream="values")
    got = [together.get_shared_bases(0, 0, G, {"keys": 6, "values": 4}) for _ in range(G)]
    want = {"keys": apart.get_shared_basis(0, 0, G, rank=6, stream="keys"),
            "values": apart.get_shared_basis(0, 0, G, rank=4, stream="values")}
    for stream, (A, B, s) in want.items():
        assert got[0][stream][0].shape == A.shape
        assert mx.allclose(got[0][stream][2], s, rtol=1e-4).item()
        # Equal up to each singular vector's sign: compare the rank-r reconstructions.
        assert mx.allclose(got[0][stream][0] @ got[0][stream][1][0], A @ B[0],
                           atol=1e-4).item()
        assert all(g[stream][0] is got[0][stream][0] for g in got)


def test_one_stream_ready_without_the_other_is_an_error():
    coord = XKVCoordinator()
    assert coord.get_shared_bases(0, 0, G, {"keys": 4, "values": 4}) is None
    _publish_all(coord, _members(), stream="keys")
    with pytest.raises(ValueError, match=r"basis of \['keys'\] is ready but not of"):
        coord.get_shared_bases(0, 0, G, {"keys": 4, "values": 4})


def test_memoized_identical_objects_for_every_member():
    coord = XKVCoordinator()
    _publish_all(coord, _members())
    got = [coord.get_shared_basis(0, 0, G, rank=4) for _ in range(G)]
    for t in got[1:]:
        assert all(a is b for a, b in zip(t, got[0]))
    assert coord.svd_calls == 1


def test_rank_and_energy_taken_from_triggering_call():
    coord = XKVCoordinator()
    _publish_all(coord, _members())
    first = coord.get_shared_basis(0, 0, G, rank=3)
    second = coord.get_shared_basis(0, 0, G, rank=7)
    assert first[0].shape[1] == 3 and second is first


def test_energy_threshold_picks_smallest_rank():
    coord = XKVCoordinator()
    parts = _members()
    _publish_all(coord, parts)
    A, B, s = coord.get_shared_basis(0, 0, G, energy_threshold=0.5)
    full = mx.linalg.svd(mx.concatenate(parts, axis=1), stream=mx.cpu)[1] ** 2
    frac = mx.cumsum(full) / full.sum()
    r = s.shape[0]
    assert frac[r - 1].item() >= 0.5 - 1e-5
    assert frac[r - 2].item() < 0.5


def test_state_keyed_by_group_and_token_start():
    coord = XKVCoordinator()
    a, b = _members(seed=1), _members(seed=2)
    _publish_all(coord, a, group_id=0, token_start=0)
    _publish_all(coord, b, group_id=0, token_start=S)
    _publish_all(coord, b, group_id=1, token_start=0)
    t0 = coord.get_shared_basis(0, 0, G, rank=4)
    t1 = coord.get_shared_basis(0, S, G, rank=4)
    t2 = coord.get_shared_basis(1, 0, G, rank=4)
    assert not mx.allclose(t0[2], t1[2]).item()
    assert mx.allclose(t1[2], t2[2]).item()
    assert coord.svd_calls == 3


def test_published_tokens_counts_leader():
    coord = XKVCoordinator()
    parts = _members()
    coord.publish_member_keys(0, 1, 0, S, parts[1])
    assert coord.published_tokens(0) == 0
    coord.publish_member_keys(0, 0, 0, S, parts[0])
    coord.publish_member_keys(0, 0, S, S, parts[0])
    assert coord.published_tokens(0) == 2 * S
    assert coord.published_tokens(5) == 0


def test_publishing_past_max_ctx_raises_naming_group_budget_field():
    coord = XKVCoordinator(max_ctx=S + 5)
    parts = _members()
    coord.publish_member_keys(3, 0, 0, S, parts[0])
    with pytest.raises(ValueError, match=r"group 3.*max_ctx=45.*KVCacheConfig.max_ctx"):
        coord.publish_member_keys(3, 0, S, S, parts[0])


def test_reset_clears_pending_and_counts():
    coord = XKVCoordinator()
    parts = _members()
    _publish_all(coord, parts[:-1])
    coord.reset()
    assert coord.published_tokens(0) == 0
    coord.publish_member_keys(0, G - 1, 0, S, parts[-1])
    assert coord.get_shared_basis(0, 0, G, rank=2) is None


def test_raw_keys_dropped_after_svd_and_basis_after_handout():
    coord = XKVCoordinator()
    _publish_all(coord, _members())
    assert coord.pending_bytes() == G * S * D * 4
    coord.get_shared_basis(0, 0, G, rank=4)
    held = coord.pending_bytes()
    assert 0 < held < G * S * D * 4  # only the memoized factors remain
    for _ in range(G - 1):
        coord.get_shared_basis(0, 0, G, rank=4)
    assert coord.pending_bytes() == 0
    with pytest.raises(ValueError, match="already handed"):
        coord.get_shared_basis(0, 0, G, rank=4)


def test_values_stream_is_separate():
    coord = XKVCoordinator()
    k, v = _members(seed=1), _members(seed=2)
    _publish_all(coord, k)
    _publish_all(coord, v, stream="values")
    tk = coord.get_shared_basis(0, 0, G, rank=4)
    tv = coord.get_shared_basis(0, 0, G, rank=6, stream="values")
    assert tk[0].shape[1] == 4 and tv[0].shape[1] == 6
    assert coord.published_tokens(0) == S  # values do not count twice


def test_batched_one_svd_per_sequence():
    coord = XKVCoordinator()
    parts = _members(batch=2)
    _publish_all(coord, parts)
    A, B, s = coord.get_shared_basis(0, 0, G, rank=5)
    assert A.shape == (2, S, 5) and B.shape == (G, 2, 5, D) and s.shape == (2, 5)
    single = XKVCoordinator()
    _publish_all(single, [p[1] for p in parts])
    s1 = single.get_shared_basis(0, 0, G, rank=5)[2]
    assert mx.allclose(s[1], s1, rtol=1e-3).item()


# ---- errors ----
def test_rank_larger_than_features_or_tokens():
    coord = XKVCoordinator()
    _publish_all(coord, _members(s=100))
    with pytest.raises(ValueError, match=r"rank=49.*G\*D=3\*16=48"):
        coord.get_shared_basis(0, 0, G, rank=G * D + 1)
    coord = XKVCoordinator()
    _publish_all(coord, _members(s=10))
    with pytest.raises(ValueError, match=r"rank=11.*S=10"):
        coord.get_shared_basis(0, 0, G, rank=11)


@pytest.mark.parametrize("energy", [0.0, -0.1, 1.5, float("nan")])
def test_energy_threshold_outside_unit_interval(energy):
    coord = XKVCoordinator()
    _publish_all(coord, _members())
    with pytest.raises(ValueError, match="energy_threshold"):
        coord.get_shared_basis(0, 0, G, energy_threshold=energy)


def test_members_publishing_different_n_tokens():
    coord = XKVCoordinator()
    coord.publish_member_keys(0, 0, 0, S, mx.zeros((S, D)))
    with pytest.raises(ValueError, match=rf"n_tokens={S - 1}.*n_tokens={S}"):
        coord.publish_member_keys(0, 1, 0, S - 1, mx.zeros((S - 1, D)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_in_keys(bad):
    coord = XKVCoordinator()
    x = mx.zeros((S, D))
    x[3, 2] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        coord.publish_member_keys(0, 0, 0, S, x)


def test_member_idx_out_of_range():
    coord = XKVCoordinator()
    with pytest.raises(ValueError, match="member_idx=-1"):
        coord.publish_member_keys(0, -1, 0, S, mx.zeros((S, D)))
    parts = _members()
    coord.publish_member_keys(0, 0, 0, S, parts[0])
    coord.publish_member_keys(0, 5, 0, S, parts[1])
    with pytest.raises(ValueError, match=r"member_idx \[5\] out of range.*0\.\.1"):
        coord.get_shared_basis(0, 0, 2)


def test_double_publish_and_late_publish():
    coord = XKVCoordinator()
    parts = _members()
    coord.publish_member_keys(0, 0, 0, S, parts[0])
    with pytest.raises(ValueError, match="twice"):
        coord.publish_member_keys(0, 0, 0, S, parts[0])
    _publish_all(XKVCoordinator(), parts)
    coord2 = XKVCoordinator()
    _publish_all(coord2, parts[:2])
    coord2.get_shared_basis(0, 0, 2, rank=2)
    with pytest.raises(ValueError, match="too late"):
        coord2.publish_member_keys(0, 2, 0, S, parts[2])


def test_shape_mismatch_with_n_tokens():
    coord = XKVCoordinator()
    with pytest.raises(ValueError, match="n_tokens = 5"):
        coord.publish_member_keys(0, 0, 0, 5, mx.zeros((S, D)))


# ---- projection onto a held basis (extension of the page) ----
def _partials(parts, bs):
    return [(x @ b.T, b @ b.T) for x, b in zip(parts, bs)]


def test_projection_is_group_least_squares_and_memoized():
    coord = XKVCoordinator()
    mx.random.seed(3)
    bs = [mx.random.normal((6, D)) for _ in range(G)]
    a_true = mx.random.normal((S, 6))
    parts = [a_true @ b for b in bs]
    for i, (xb, bb) in enumerate(_partials(parts, bs)):
        assert coord.get_projection(0, 64, G) is None  # members missing
        coord.publish_projection(0, i, 64, S, xb, bb)
    a = coord.get_projection(0, 64, G)
    assert mx.allclose(a, a_true, atol=1e-3).item()  # exact when X lies in the basis
    assert all(coord.get_projection(0, 64, G) is a for _ in range(G - 1))
    with pytest.raises(ValueError, match="already handed"):
        coord.get_projection(0, 64, G)
    assert coord.published_tokens(0) == S and coord.pending_bytes() == 0


def test_projection_errors():
    coord = XKVCoordinator(max_ctx=S)
    xb, bb = mx.zeros((S, 4)), mx.eye(4)
    with pytest.raises(ValueError, match="must be"):
        coord.publish_projection(0, 0, 0, S + 1, xb, bb)
    with pytest.raises(ValueError, match="NaN or Inf"):
        coord.publish_projection(0, 0, 0, S, xb + mx.nan, bb)
    coord.publish_projection(0, 0, 0, S, xb, bb)
    with pytest.raises(ValueError, match="twice"):
        coord.publish_projection(0, 0, 0, S, xb, bb)
    with pytest.raises(ValueError, match="max_ctx"):
        coord.publish_projection(0, 0, S, S, xb, bb)
