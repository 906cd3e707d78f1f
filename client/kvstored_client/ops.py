# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Client operations written once, without I/O: each is a generator that yields the RPCs it needs
(`Call`) and the local work around them (`Copy`, `MapArena`), and receives their results. The sync
and async clients only differ in how they run a Call, so the data-path logic (reserve -> copy ->
commit; acquire -> copy -> release) and its cleanup on failure exist in one place."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.blocks import BlockIdentity
from kvstored_client.blocks import to_pb as blocks_pb
from kvstored_client.buffers import chunk_views
from kvstored_client.errors import InternalError, PoolExhausted
from kvstored_client.keys import namespace_id_for
from kvstored_client.kinds import DropReason, LoadInto, StoreOutcome, TierKind
from kvstored_client.session import PoolSession

Tier = TierKind  # where a chunk was found (the client's name for it)
_TIERS = {int(t): t for t in Tier}  # a dict lookup per key: Tier(value) costs ~0.4 us each


def _tier_kinds(wire: Any) -> list[TierKind]:
    """A response's repeated tier values as TierKinds; a batch all in one tier (the usual answer)
    in one go. (A slice copies the repeated field in C; iterating it costs ~40 ns per value.)"""
    values = wire[:]
    if values and values.count(values[0]) == len(values):
        return [_TIERS[values[0]]] * len(values)
    return list(map(_TIERS.__getitem__, values))


@dataclass(frozen=True)
class NamespaceSpec:
    model: str
    dtype: str
    chunk_bytes: int
    layout: str = ""
    tenant_salt: bytes = b""
    key_bytes: int = 32
    block_tokens: int = 0  # tokens per chunk: reported in KV events
    quota_bytes: int = 0  # RAM quota of the namespace (capped by the daemon; 0: none); not part of the id
    # How fast the engine recomputes (not part of the id; 0: unknown, every hit counts): hits below
    # RAM are reported only where loading them beats recomputing (docs/configuration.md).
    prefill_tokens_per_s: float = 0.0
    kv_bytes_per_token: int = 0  # 0: chunk_bytes / block_tokens where block_tokens is given

    def namespace_id(self) -> str:
        """The id every daemon derives for this namespace (computed locally)."""
        return namespace_id_for(self.model, self.dtype, self.chunk_bytes, self.layout, self.tenant_salt, self.key_bytes)

    def to_proto(self) -> pb.NamespaceSpec:
        return pb.NamespaceSpec(
            model=self.model,
            dtype=self.dtype,
            chunk_bytes=self.chunk_bytes,
            layout=self.layout,
            tenant_salt=self.tenant_salt,
            key_bytes=self.key_bytes,
            block_tokens=self.block_tokens,
            quota_bytes=self.quota_bytes,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            kv_bytes_per_token=self.kv_bytes_per_token,
        )


@dataclass(frozen=True)
class Namespace:
    namespace_id: str
    spec: NamespaceSpec

    @property
    def private(self) -> bool:
        """A tenant namespace: only sessions that registered it can see its keys."""
        return bool(self.spec.tenant_salt)

    @property
    def chunk_bytes(self) -> int:
        return self.spec.chunk_bytes


@dataclass(frozen=True)
class LookupResult:
    prefix_hits: int
    tiers: list[Tier] = field(default_factory=list)

    @classmethod
    def miss(cls, n: int) -> LookupResult:
        return cls(0, [Tier.NONE] * n)


_STORE_OUTCOMES = {int(o): o for o in StoreOutcome}
_DROP_REASONS = {int(r): r for r in DropReason}
_SLOT_OUTCOMES = {
    pb.SLOT_STATE_ALREADY_PRESENT: StoreOutcome.ALREADY_PRESENT,
    pb.SLOT_STATE_IN_PROGRESS: StoreOutcome.IN_PROGRESS,
    pb.SLOT_STATE_NO_SPACE: StoreOutcome.DROPPED,
    pb.SLOT_STATE_UNSPECIFIED: StoreOutcome.UNKNOWN,
}


@dataclass(frozen=True)
class StoreResult:
    """What a store did. Printed, it says where the chunks already present are and why the
    dropped ones were dropped: `StoreResult(stored=0, already_present=16 (fs=16), dropped=0)`."""

    stored: int = 0
    already_present: int = 0  # in RAM or a tier below (present_in): nothing copied
    dropped: int = 0  # not stored: drop_reasons says why
    # Per key, in request order (empty from a daemon that predates them); counts compare equal without them.
    outcomes: tuple[StoreOutcome, ...] = field(default=(), compare=False, repr=False)
    present_in: tuple[TierKind, ...] = field(default=(), compare=False, repr=False)  # NONE: not present
    drop_reasons: tuple[DropReason, ...] = field(default=(), compare=False, repr=False)  # NONE: not dropped

    @classmethod
    def all_dropped(cls, n: int, reason: DropReason = DropReason.UNAVAILABLE) -> StoreResult:
        return cls(
            dropped=n, outcomes=(StoreOutcome.DROPPED,) * n, present_in=(TierKind.NONE,) * n, drop_reasons=(reason,) * n
        )

    @property
    def present_by_tier(self) -> dict[TierKind, int]:
        """Already-present chunks per tier holding them, e.g. {TierKind.FS: 16}."""
        return _tally(self.present_in)

    @property
    def dropped_by_reason(self) -> dict[DropReason, int]:
        """Dropped chunks per reason, e.g. {DropReason.RAM_FULL: 16}."""
        return _tally(self.drop_reasons)

    def __str__(self) -> str:
        present = _breakdown(self.present_by_tier)
        dropped = _breakdown(self.dropped_by_reason)
        return (
            f"StoreResult(stored={self.stored}, already_present={self.already_present}{present}, "
            f"dropped={self.dropped}{dropped})"
        )


def _tally(values: Sequence[Any]) -> dict[Any, int]:
    counts: dict[Any, int] = {}
    for value in values:
        if value:  # (NONE is 0: neither present nor dropped)
            counts[value] = counts.get(value, 0) + 1
    return counts


def _breakdown(counts: dict[Any, int]) -> str:
    return " (" + ", ".join(f"{k.name.lower()}={n}" for k, n in counts.items()) + ")" if counts else ""


@dataclass(frozen=True)
class Health:
    """Client.health(): what the daemon's standard gRPC health check says, or why it could not be
    asked. `status`: SERVING, NOT_SERVING (shutting down), UNREACHABLE, ... `reason`: why it is not
    serving ("" when it is), e.g. "permission denied: not in group kvstored (...)"."""

    socket: str
    status: str
    reason: str = ""

    @property
    def serving(self) -> bool:
        return self.status == "SERVING"


@dataclass
class Region:
    """A registered shared-memory file. Its id is per session: re-attached after reconnects."""

    name: str
    size: int
    fd: int
    region_id: int = 0
    refused: Exception | None = None  # the daemon refused it when re-attaching: register it again


# How long past its deadline a region transfer's answer is awaited: the daemon starts the copy
# only within the deadline (start_within_ms) and, once started, finishes it; until it answers,
# the region's bytes are the daemon's.
REGION_COPY_GRACE_S = 10.0


@dataclass(frozen=True)
class Call:
    method: str
    request: Any
    copy_grace_s: float = 0.0  # > 0: a region transfer (the driver sets start_within_ms)
    # A Commit or Release whose answer the plan can do without: a driver may send it and read the
    # answer later (fast.FastLink.post); the plan then receives POSTED instead of the response,
    # and the answer, once read, is handed to on_answer (if any; None for an error).
    postable: bool = False
    on_answer: Callable[[Any], None] | None = None


class _Posted:
    def __repr__(self) -> str:
        return "POSTED"


POSTED: Any = _Posted()  # a postable Call's result when it was sent and its answer not awaited


@dataclass(frozen=True)
class Copy:
    """Copy chunks between caller buffers and pool slots of one arena: (extents, view) per chunk.
    The async client runs large ones off its event loop."""

    session: PoolSession
    pairs: list[tuple[Sequence[Any], Any]]
    to_pool: bool
    arena: int = 0  # the arena the extents lie in (0: the public pool)

    @property
    def nbytes(self) -> int:
        return sum(int(ext.length) for extents, _ in self.pairs for ext in extents)

    def run(self) -> None:
        with self.session.copies.copying():  # (the session is closed, and reported released, only after)
            self.session.check_alive()
            self.session.copier.copy(self.session.arena_arrays(self.arena), self.pairs, self.to_pool)
            if not self.to_pool:  # (the leases held while it copied only if the session still stands)
                self.session.check_alive()


@dataclass(frozen=True)
class MapArena:
    """Map a tenant's arena (a blocking exchange on the session socket, within the call's
    remaining time)."""

    session: PoolSession
    arena: int

    def run(self, timeout: float) -> None:
        self.session.map_arena(self.arena, timeout)


@dataclass(frozen=True)
class MapIndex:
    """Map a namespace's key index (a blocking exchange on the session socket, within the call's
    remaining time; once a session)."""

    session: PoolSession
    namespace_id: str

    def run(self, timeout: float) -> None:
        self.session.map_index(self.namespace_id, timeout)


@dataclass(frozen=True)
class Settle:
    """Read the answers of the session's posted calls (blocking, within the call's deadline: the
    driver's _settle)."""

    session: PoolSession


Op = Generator[Call | Copy | MapArena | MapIndex | Settle, Any, Any]


def _arena_of(extent_lists: Sequence[Sequence[Any]]) -> int:
    """The one arena a batch's extents lie in (a namespace's chunks share one)."""
    arenas = {int(ext.arena) for extents in extent_lists for ext in extents}
    if len(arenas) > 1:
        raise InternalError(f"the daemon granted one namespace's chunks in several arenas ({sorted(arenas)})")
    return arenas.pop() if arenas else 0


def nothing() -> Op:
    """No RPC at all: runs only the session set-up around it."""
    return None
    yield  # makes this a generator


def _sid(session: PoolSession | None) -> str:
    return session.session_id if session is not None else ""


def lookup(
    ns: Namespace, keys: Sequence[bytes], session: PoolSession | None = None, load_into: LoadInto = LoadInto.POOL
) -> Op:
    resp = yield Call(
        "Lookup",
        pb.LookupRequest(namespace_id=ns.namespace_id, keys=keys, session_id=_sid(session), load_into=load_into),
    )
    return LookupResult(resp.prefix_hits, _tier_kinds(resp.tiers))


def store(
    session: PoolSession,
    ns: Namespace,
    keys: Sequence[bytes],
    data: Any,
    blocks: Sequence[BlockIdentity | None] | None = None,
) -> Op:
    views = chunk_views(data, len(keys), ns.chunk_bytes, writable=False)
    identities = blocks_pb(blocks, len(keys))
    ahead = session.ahead
    if ahead.enabled and keys:
        if not session.index_tried(ns.namespace_id):
            yield MapIndex(session, ns.namespace_id)
        # Which keys RAM holds says the key index (a Reserve would say the same): with it, a
        # store through slots reserved ahead answers as a Reserve would have.
        index = session.index(ns.namespace_id)
        if index is not None:
            held = index.holds(keys)
            todo = [i for i, h in enumerate(held) if not h]
            slots = ahead.take(ns.namespace_id, len(todo)) if todo else []
            if slots is None and session.fast is not None and session.fast.owed:
                # Slots may be on their way in posted Commits' answers: those come, or are there
                # already; reading them costs less than a Reserve.
                yield Settle(session)
                slots = ahead.take(ns.namespace_id, len(todo))
            if slots is not None:
                return (yield from _store_ahead(session, ns, keys, views, identities, todo, slots))
    try:
        resp = yield Call(
            "Reserve",
            pb.ReserveRequest(
                session_id=session.session_id,
                namespace_id=ns.namespace_id,
                keys=keys,
                blocks=identities,
                ahead=ahead.wanted(ns.namespace_id),
            ),
        )
    except PoolExhausted:  # (an older daemon's answer to a RAM with no room at all)
        return StoreResult.all_dropped(len(keys), DropReason.RAM_FULL)
    ahead.add(ns.namespace_id, resp.ahead)
    reserved = [(slot, view) for slot, view in zip(resp.slots, views) if slot.state == pb.SLOT_STATE_RESERVED]
    present = sum(1 for slot in resp.slots if slot.state == pb.SLOT_STATE_ALREADY_PRESENT)
    handles = [slot.handle for slot, _ in reserved]
    try:
        arena = _arena_of([slot.extents for slot, _ in reserved])
        yield Copy(session, [(slot.extents, view) for slot, view in reserved], to_pool=True, arena=arena)
    except GeneratorExit:  # abandoned: the driver drops the session, which frees the slots
        raise
    except BaseException:
        if handles:
            yield Call("Release", pb.ReleaseRequest(session_id=session.session_id, handles=handles))
        raise
    committed = 0
    if handles:
        # Posted, its answer unread: the daemon commits every handle this live session holds
        # (the session's next call finds them committed), so all of them count as stored.
        answer = yield Call("Commit", pb.CommitRequest(session_id=session.session_id, handles=handles), postable=True)
        committed = len(handles) if answer is POSTED else answer.committed
    all_in = committed == len(handles)
    stored = StoreOutcome.STORED if all_in else StoreOutcome.UNKNOWN
    outcomes = tuple(
        stored if slot.state == pb.SLOT_STATE_RESERVED else _SLOT_OUTCOMES[slot.state] for slot in resp.slots
    )
    present_in = tuple(_tier_kinds([slot.present_in for slot in resp.slots]))
    drops = tuple(
        (DropReason.NONE if all_in else DropReason.UNAVAILABLE)
        if slot.state == pb.SLOT_STATE_RESERVED
        else _DROP_REASONS.get(slot.drop_reason, DropReason.NONE)
        for slot in resp.slots
    )
    return StoreResult(committed, present, len(keys) - committed - present, outcomes, present_in, drops)


def _store_ahead(
    session: PoolSession,
    ns: Namespace,
    keys: Sequence[bytes],
    views: Sequence[Any],
    identities: Sequence[pb.BlockIdentity],
    todo: list[int],
    slots: list[Any],
) -> Op:
    """A store into slots reserved ahead: the keys at `todo` (those RAM does not hold, by the key
    index) are copied, then the Commit naming them is posted (asking for as many slots ahead
    again). Its answer is not awaited: they count as stored (the daemon frees the slot of one
    that another writer stored meanwhile); the others are already present in RAM."""
    n = len(keys)
    outcomes = [StoreOutcome.ALREADY_PRESENT] * n
    if todo:
        handles = [slot.handle for slot in slots]
        try:
            arena = _arena_of([slot.extents for slot in slots])
            pairs = [(slot.extents, views[i]) for slot, i in zip(slots, todo)]
            yield Copy(session, pairs, to_pool=True, arena=arena)
        except GeneratorExit:  # abandoned: the driver drops the session, which frees the slots
            raise
        except BaseException:
            yield Call("Release", pb.ReleaseRequest(session_id=session.session_id, handles=handles))
            raise
        request = pb.CommitRequest(
            session_id=session.session_id,
            handles=handles,
            keys=[keys[i] for i in todo],
            namespace_id=ns.namespace_id,
            blocks=[identities[i] for i in todo] if identities else [],
            ahead=len(slots),
        )
        answer = yield Call("Commit", request, postable=True, on_answer=session.ahead.adder(ns.namespace_id))
        if answer is POSTED:
            states = [pb.SLOT_STATE_RESERVED] * len(todo)
        else:
            session.ahead.add(ns.namespace_id, answer.ahead)
            states = list(answer.states)
        for i, state in zip(todo, states):
            outcomes[i] = StoreOutcome.STORED if state == pb.SLOT_STATE_RESERVED else _SLOT_OUTCOMES[state]
    stored = outcomes.count(StoreOutcome.STORED)
    present = outcomes.count(StoreOutcome.ALREADY_PRESENT)
    present_in = tuple(TierKind.RAM if o is StoreOutcome.ALREADY_PRESENT else TierKind.NONE for o in outcomes)
    drops = tuple(DropReason.IN_PROGRESS if o is StoreOutcome.IN_PROGRESS else DropReason.NONE for o in outcomes)
    return StoreResult(stored, present, n - stored - present, tuple(outcomes), present_in, drops)


def load(session: PoolSession, ns: Namespace, keys: Sequence[bytes], out: Any) -> Op:
    views = chunk_views(out, len(keys), ns.chunk_bytes, writable=True)
    resp = yield Call(
        "Acquire", pb.AcquireRequest(session_id=session.session_id, namespace_id=ns.namespace_id, keys=keys)
    )
    if not resp.leases:
        return 0
    release = Call(
        "Release",
        pb.ReleaseRequest(session_id=session.session_id, handles=[lease.handle for lease in resp.leases]),
        postable=True,
    )
    try:
        arena = _arena_of([lease.extents for lease in resp.leases])
        yield Copy(
            session, [(lease.extents, view) for lease, view in zip(resp.leases, views)], to_pool=False, arena=arena
        )
    except GeneratorExit:  # abandoned: the driver drops the session, which frees the leases
        raise
    except BaseException:
        yield release
        raise
    yield release
    return len(resp.leases)


def _usable(region: Region) -> Region:
    """A region the daemon refused when this session was set up fails its calls (only them)."""
    if region.refused is not None:
        raise type(region.refused)(
            f"region {region.name} was refused by the daemon when the session was set "
            f"up again ({region.refused}); register it again"
        )
    return region


def store_from_region(
    session: PoolSession,
    ns: Namespace,
    region: Region,
    keys: Sequence[bytes],
    offsets: Sequence[int],
    blocks: Sequence[BlockIdentity | None] | None = None,
) -> Op:
    _usable(region)
    identities = blocks_pb(blocks, len(keys))
    resp = yield Call(
        "StoreFromRegion",
        pb.RegionTransferRequest(
            session_id=session.session_id,
            namespace_id=ns.namespace_id,
            region_id=region.region_id,
            keys=keys,
            offsets=offsets,
            blocks=identities,
        ),
        REGION_COPY_GRACE_S,
    )
    return StoreResult(
        resp.stored,
        resp.already_present,
        resp.dropped,
        tuple(_STORE_OUTCOMES.get(o, StoreOutcome.UNKNOWN) for o in resp.outcomes),
        tuple(_tier_kinds(resp.present_in)),
        tuple(_DROP_REASONS.get(r, DropReason.NONE) for r in resp.drop_reasons),
    )


def load_to_region(
    session: PoolSession, ns: Namespace, region: Region, keys: Sequence[bytes], offsets: Sequence[int]
) -> Op:
    _usable(region)
    resp = yield Call(
        "LoadToRegion",
        pb.RegionTransferRequest(
            session_id=session.session_id,
            namespace_id=ns.namespace_id,
            region_id=region.region_id,
            keys=keys,
            offsets=offsets,
        ),
        REGION_COPY_GRACE_S,
    )
    return resp.loaded


def delete(ns: Namespace, keys: Sequence[bytes], session: PoolSession | None = None) -> Op:
    request = pb.DeleteRequest(namespace_id=ns.namespace_id, keys=keys, session_id=_sid(session))
    return (yield Call("Delete", request)).deleted


def stats() -> Op:
    return (yield Call("Stats", pb.StatsRequest()))


def register(spec: NamespaceSpec, session: PoolSession | None = None) -> Op:
    request = pb.RegisterNamespaceRequest(spec=spec.to_proto(), session_id=_sid(session))
    resp = yield Call("RegisterNamespace", request)
    if resp.arena_id and session is not None:  # a tenant's: its chunks' slots are in its own arena
        yield MapArena(session, resp.arena_id)
    return Namespace(resp.namespace_id, spec)
