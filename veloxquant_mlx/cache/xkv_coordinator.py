"""xKV cross-layer coordinator: fan-in of a group's raw keys, fan-out of one basis.

One ``XKVCoordinator`` is shared by every ``XKVCache`` of a model. The members of
a layer group publish their own ``[S, D]`` matrices for a token range (fan-in);
the call to ``get_shared_basis`` that sees the last expected member runs ONE
truncated SVD of their concatenation ``[S, G*D]`` and memoizes it, so every member
receives the identical arrays (fan-out). State is keyed by ``(group_id,
token_start)``. mlx_lm runs layers one after another, so no locking is needed.

The returned triple is ``(A, B, s)``:

- ``A`` [S, r]: the token factor shared by the group (orthonormal columns),
- ``B`` [G, r, D]: the stacked member factors, ``B[i] = diag(s) Vt[:, i*D:(i+1)*D]``,
- ``s`` [r]: the singular values,

so member ``i``'s matrix is approximated by ``A @ B[i]``. A leading batch axis is
allowed (``keys`` [b, S, D]; one SVD per sequence): then ``A`` is [b, S, r], ``B``
[G, b, r, D] and ``s`` [b, r].

Values travel through the same coordinator under a second namespace: the keyword
``stream`` (``"keys"`` by default, ``"values"`` for values) is part of the state
key, so keys and values get separate SVDs with separate ranks. ``published_tokens``
counts the leader's (member 0) tokens of the ``"keys"`` stream.

Projection onto a held basis (an extension of the page): after a group's first
block, later tokens are not given a new SVD; they are projected onto the member
factors the group already holds. Member ``i`` publishes the partial products
``P_i = X_i B_i^T`` [S, r] and ``Q_i = B_i B_i^T`` [r, r]
(``publish_projection``); the call of ``get_projection`` that sees the last
member solves the least-squares token factor ``A = (sum P_i) (sum Q_i)^-1`` once
and memoizes it like a basis. Only these small partials cross layers.

Memory: raw member matrices are dropped as soon as the SVD has consumed them, and
the memoized triple is dropped once it has been handed out ``expected_members``
times (every member has its copy by then); asking again after that is an error.
"""

from __future__ import annotations

import math

import mlx.core as mx

from veloxquant_mlx.ops.svd import truncated_svds

STREAMS = ("keys", "values")


class XKVCoordinator:
    """Shared cross-layer basis store for one model instance / one generation.

    ``max_ctx`` is the per-group token budget; publishing beyond it raises.
    """

    def __init__(self, max_ctx: int = 8192) -> None:
        if isinstance(max_ctx, bool) or not isinstance(max_ctx, int) or max_ctx < 1:
            raise ValueError(f"XKVCoordinator max_ctx={max_ctx!r} must be a positive integer")
        self._max_ctx = max_ctx
        self.reset()

    @property
    def max_ctx(self) -> int:
        """Configured per-group token budget."""
        return self._max_ctx

    def reset(self) -> None:
        """Clear all pending groups and published-token counts (a fresh generation)."""
        # (stream, group_id, token_start) -> {"n": n_tokens, "members": {idx: array}}
        self._pending: dict[tuple, dict] = {}
        # (stream, group_id, token_start) -> [triple, times handed out]
        self._bases: dict[tuple, list] = {}
        self._done: set[tuple] = set()
        # ("proj", stream, group_id, token_start) -> {"n": n, "members": {idx: (P, Q)}}
        self._proj: dict[tuple, dict] = {}
        self._published: dict[int, int] = {}
        self.svd_calls = 0

    def publish_member_keys(self, group_id: int, member_idx: int, token_start: int,
                            n_tokens: int, keys: mx.array, *,
                            stream: str = "keys") -> None:
        """A group member publishes its own raw matrix for one token range.

        ``keys`` is [S, D] (or [b, S, D]) with S == ``n_tokens``.
        """
        if stream not in STREAMS:
            raise ValueError(f"stream={stream!r} is not one of {list(STREAMS)}")
        if member_idx < 0:
            raise ValueError(f"member_idx={member_idx} of group {group_id} must be >= 0")
        if keys.ndim not in (2, 3) or keys.shape[-2] != n_tokens:
            raise ValueError(
                f"group {group_id} member {member_idx}: keys of shape {tuple(keys.shape)} "
                f"must be [S, D] or [b, S, D] with S = n_tokens = {n_tokens}"
            )
        if n_tokens < 1:
            raise ValueError(f"group {group_id}: n_tokens={n_tokens} must be >= 1")
        if not bool(mx.all(mx.isfinite(keys)).item()):
            raise ValueError(
                f"group {group_id} member {member_idx} published {stream} with NaN or Inf "
                f"values for tokens {token_start}..{token_start + n_tokens - 1}"
            )
        key = (stream, group_id, token_start)
        if key in self._bases or key in self._done:
            raise ValueError(
                f"group {group_id} {stream} at token_start={token_start}: the basis was "
                f"already computed; member {member_idx} published too late"
            )
        entry = self._pending.setdefault(key, {"n": n_tokens, "members": {}})
        if entry["n"] != n_tokens:
            raise ValueError(
                f"group {group_id} {stream} at token_start={token_start}: member "
                f"{member_idx} published n_tokens={n_tokens}, other members published "
                f"n_tokens={entry['n']}"
            )
        if member_idx in entry["members"]:
            raise ValueError(
                f"group {group_id} member {member_idx} published {stream} at "
                f"token_start={token_start} twice"
            )
        self._count_leader_tokens(group_id, member_idx, stream, token_start, n_tokens)
        entry["members"][member_idx] = keys

    def get_shared_basis(self, group_id: int, token_start: int, expected_members: int,
                         rank: int | None = None, energy_threshold: float = 0.95, *,
                         stream: str = "keys") -> tuple[mx.array, mx.array, mx.array] | None:
        """The shared basis ``(A, B, s)`` once every expected member has published;
        ``None`` while members are missing.

        The SVD runs on the call that observes the last publish and is memoized, so
        every member gets the same objects. ``rank``/``energy_threshold`` are read
        only on that triggering call.
        """
        got = self.get_shared_bases(group_id, token_start, expected_members, {stream: rank},
                                    energy_threshold)
        return None if got is None else got[stream]

    def get_shared_bases(self, group_id: int, token_start: int, expected_members: int,
                         ranks: dict[str, int | None], energy_threshold: float = 0.95
                         ) -> dict[str, tuple[mx.array, mx.array, mx.array]] | None:
        """:meth:`get_shared_basis` of several streams (keys and values, ``ranks`` per
        stream) at once: their SVDs run side by side (``ops.svd.truncated_svds``).
        ``None`` while no stream's members have all published; one stream complete
        without the others is an error (members publish both together)."""
        keys = {stream: (stream, group_id, token_start) for stream in ranks}
        ready = {}
        for stream, key in keys.items():
            if key not in self._bases:
                x = self._basis_input(key, expected_members, ranks[stream], energy_threshold)
                if x is not None:
                    ready[stream] = x
        if ready:
            triples = truncated_svds(list(ready.values()), [ranks[s] for s in ready],
                                     energy_threshold)
            for stream, triple in zip(ready, triples):
                self._keep_basis(keys[stream], triple, expected_members)
        waiting = [stream for stream, key in keys.items() if key not in self._bases]
        if len(waiting) == len(keys):
            return None
        if waiting:
            raise ValueError(f"group {group_id} at token_start={token_start}: the basis of "
                             f"{sorted(set(keys) - set(waiting))} is ready but not of "
                             f"{waiting}: a member published one stream without the other")
        return {stream: self._hand_out(key, expected_members) for stream, key in keys.items()}

    def _basis_input(self, key: tuple, expected_members: int, rank: int | None,
                     energy_threshold: float) -> mx.array | None:
        """The members' matrices side by side ``[.., S, G*D]`` once all have published
        (None before); checks what they published."""
        stream, group_id, token_start = key
        if key in self._done:
            raise ValueError(
                f"group {group_id} {stream} at token_start={token_start}: the basis was "
                f"already handed to all {expected_members} members"
            )
        _check_expected(expected_members)
        entry = self._pending.get(key)
        if entry is None or len(entry["members"]) < expected_members:
            return None
        members = entry["members"]
        bad = sorted(i for i in members if i >= expected_members)
        if bad:
            raise ValueError(
                f"group {group_id}: member_idx {bad} out of range for a group of "
                f"{expected_members} members (allowed 0..{expected_members - 1})"
            )
        _check_energy(energy_threshold)
        parts = [members[i] for i in range(expected_members)]
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"group {group_id}: members published different shapes {shapes}")
        _check_rank(group_id, rank, parts[0].shape[-2], expected_members, parts[0].shape[-1])
        return mx.concatenate([p.astype(mx.float32) for p in parts], axis=-1)

    def _keep_basis(self, key: tuple, triple: tuple[mx.array, mx.array, mx.array],
                    members: int) -> None:
        """Memoizes ``(A, B per member, s)`` from the SVD of the members' matrices; the
        raw matrices are dropped."""
        u, s, vt = triple
        b = s[..., :, None] * vt  # [.., r, G*D]
        b = b.reshape(*b.shape[:-1], members, -1)  # [.., r, G, D]
        b = mx.moveaxis(b, -2, 0)  # [G, .., r, D]
        mx.eval(u, b, s)
        self.svd_calls += 1
        del self._pending[key]  # the raw member matrices are no longer needed
        self._bases[key] = [(u, b, s), 0]

    def _hand_out(self, key: tuple, expected_members: int):
        slot = self._bases[key]
        slot[1] += 1
        if slot[1] >= expected_members:
            del self._bases[key]
            self._done.add(key)
        return slot[0]

    def publish_projection(self, group_id: int, member_idx: int, token_start: int,
                           n_tokens: int, xb: mx.array, bb: mx.array, *,
                           stream: str = "keys") -> None:
        """A member publishes ``xb = X_i B_i^T`` [.., S, r] and ``bb = B_i B_i^T``
        [.., r, r] for tokens projected onto the group's held basis."""
        if stream not in STREAMS:
            raise ValueError(f"stream={stream!r} is not one of {list(STREAMS)}")
        if xb.shape[-2] != n_tokens or bb.shape[-1] != xb.shape[-1]:
            raise ValueError(
                f"group {group_id} member {member_idx}: projection shapes "
                f"{tuple(xb.shape)} / {tuple(bb.shape)} must be [.., S={n_tokens}, r] / "
                "[.., r, r]")
        # Both now: left lazy, ``bb`` would keep the intermediates it shares with ``xb``.
        mx.eval(xb, bb)
        if not bool(mx.all(mx.isfinite(xb)).item()):
            raise ValueError(
                f"group {group_id} member {member_idx} published {stream} with NaN or Inf "
                f"values for tokens {token_start}..{token_start + n_tokens - 1}")
        key = ("proj", stream, group_id, token_start)
        if key in self._bases or key in self._done:
            raise ValueError(
                f"group {group_id} {stream} projection at token_start={token_start}: "
                f"already solved; member {member_idx} published too late")
        entry = self._proj.setdefault(key, {"n": n_tokens, "members": {}})
        if entry["n"] != n_tokens or member_idx in entry["members"]:
            raise ValueError(
                f"group {group_id} member {member_idx}: projection at token_start="
                f"{token_start} published twice or with n_tokens={n_tokens} != "
                f"{entry['n']}")
        self._count_leader_tokens(group_id, member_idx, stream, token_start, n_tokens)
        entry["members"][member_idx] = (xb, bb)

    def get_projection(self, group_id: int, token_start: int, expected_members: int, *,
                       stream: str = "keys") -> mx.array | None:
        """The shared token factor [.., S, r] of projected tokens once every member
        has published its partials; ``None`` while members are missing."""
        key = ("proj", stream, group_id, token_start)
        if key in self._bases:
            return self._hand_out(key, expected_members)
        if key in self._done:
            raise ValueError(
                f"group {group_id} {stream} projection at token_start={token_start}: "
                f"already handed to all {expected_members} members")
        entry = self._proj.get(key)
        if entry is None or len(entry["members"]) < expected_members:
            return None
        parts = [entry["members"][i] for i in range(expected_members)]
        xb = sum(p[0].astype(mx.float32) for p in parts)
        bb = sum(p[1].astype(mx.float32) for p in parts)
        # A tiny ridge keeps the solve stable when some factor rows are ~0.
        r = bb.shape[-1]
        bb = bb + (1e-6 * mx.trace(bb, axis1=-2, axis2=-1)[..., None, None] / r + 1e-12) \
            * mx.eye(r)
        a = mx.linalg.solve(bb, xb.swapaxes(-1, -2), stream=mx.cpu).swapaxes(-1, -2)
        mx.eval(a)
        del self._proj[key]
        self._bases[key] = [a, 0]
        return self._hand_out(key, expected_members)

    def _count_leader_tokens(self, group_id: int, member_idx: int, stream: str,
                             token_start: int, n_tokens: int) -> None:
        """The leader's key tokens count toward ``published_tokens`` and the budget."""
        if member_idx != 0 or stream != "keys":
            return
        total = self._published.get(group_id, 0) + n_tokens
        if total > self._max_ctx:
            raise ValueError(
                f"group {group_id}: publishing {n_tokens} tokens at token_start="
                f"{token_start} brings it to {total} tokens, over the budget "
                f"max_ctx={self._max_ctx} (raise KVCacheConfig.max_ctx)"
            )
        self._published[group_id] = total

    def rewind(self, group_id: int, token_end: int, published: int) -> None:
        """Forget what ``group_id`` published from ``token_end`` on (its caches were
        trimmed): pending and memoized units starting there or later, so the same
        ranges can be published again, and count ``published`` tokens for the group."""
        for table in (self._pending, self._bases, self._proj):
            for key in [k for k in table if k[-2] == group_id and k[-1] >= token_end]:
                del table[key]
        self._done = {k for k in self._done if not (k[-2] == group_id and k[-1] >= token_end)}
        self._published[group_id] = published

    def published_tokens(self, group_id: int) -> int:
        """Total tokens the leader (member 0) of ``group_id`` has published."""
        return self._published.get(group_id, 0)

    def group_arrays(self, group_id: int) -> list[mx.array]:
        """Arrays held for ``group_id``: raw member matrices and projection partials not
        yet consumed, memoized results not yet handed to every member."""
        out: list[mx.array] = []
        for key, entry in (*self._pending.items(), *self._proj.items()):
            if key[-2] == group_id:
                for value in entry["members"].values():
                    out.extend(value if isinstance(value, tuple) else (value,))
        for key, (result, _) in self._bases.items():
            if key[-2] == group_id:
                out.extend(result if isinstance(result, tuple) else (result,))
        return out

    def pending_bytes(self) -> int:
        """Bytes of raw member matrices and memoized bases not yet handed out."""
        total = sum(a.nbytes for e in self._pending.values() for a in e["members"].values())
        total += sum(a.nbytes for e in self._proj.values() for p in e["members"].values()
                     for a in p)
        for t, _ in self._bases.values():
            total += sum(a.nbytes for a in (t if isinstance(t, tuple) else (t,)))
        return total


def _check_expected(expected_members: int) -> None:
    if isinstance(expected_members, bool) or not isinstance(expected_members, int) \
            or expected_members < 1:
        raise ValueError(f"expected_members={expected_members!r} must be an integer >= 1")


def _check_energy(energy_threshold: float) -> None:
    if not (isinstance(energy_threshold, (int, float))
            and 0.0 < energy_threshold <= 1.0 and not math.isnan(energy_threshold)):
        raise ValueError(
            f"energy_threshold={energy_threshold!r} is not allowed: a number in (0, 1]"
        )


def _check_rank(group_id: int, rank: int | None, S: int, G: int, D: int) -> None:
    """``rank`` must be a positive integer within ``min(S, G * D)`` (or ``None``)."""
    if rank is None:
        return
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank={rank!r} must be a positive integer")
    if rank > G * D or rank > S:
        raise ValueError(
            f"group {group_id}: rank={rank} exceeds min(S={S} tokens, G*D="
            f"{G}*{D}={G * D} features)"
        )
