# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""gRPC servicer: translates protobuf messages to session-broker and tier-chain calls and back.
No logic of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from kvstored import __version__
from kvstored.chain.chain import TierChain
from kvstored.chain.stats import chain_snapshot
from kvstored.chunks.ids import TierKind
from kvstored.errors import BatchTooLarge, InvalidRequest, RegionNotAllowed, SessionRequired, UnknownNamespace, shown
from kvstored.events.feed import IntervalFeeds
from kvstored.events.identity import BlockIdentity, IdentityBook
from kvstored.namespaces import Namespace, NamespaceRegistry, check_keys
from kvstored.observability.snapshot import STORE_DROP_REASONS
from kvstored.server.broker import SessionBroker, Slot
from kvstored.server.sessions import Session
from kvstored.server.tenants import ArenasUnsupported, Tenancy, events_for, visible
from kvstored.server.watch import each_event, net_changes
from kvstored.shm.keyindex import KeyIndex, KeyIndexes
from kvstored.shm.mapping import open_region_file
from kvstored.tiers.ram import Extent, ReserveOutcome
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.errors import INCARNATION_KEY, OLDEST_SEQ_KEY
from kvstored_client.kinds import DropReason, LoadInto

_SLOT_STATE = {
    ReserveOutcome.RESERVED: pb.SLOT_STATE_RESERVED,
    ReserveOutcome.ALREADY_PRESENT: pb.SLOT_STATE_ALREADY_PRESENT,
    ReserveOutcome.IN_PROGRESS: pb.SLOT_STATE_IN_PROGRESS,
    ReserveOutcome.NO_SPACE: pb.SLOT_STATE_NO_SPACE,
}
_RAM = int(TierKind.RAM)
MAX_PATH_BYTES = 4096  # Linux's PATH_MAX, terminating NUL included

_STORE_OUTCOMES = {
    ReserveOutcome.RESERVED: pb.STORE_OUTCOME_STORED,
    ReserveOutcome.ALREADY_PRESENT: pb.STORE_OUTCOME_ALREADY_PRESENT,
    ReserveOutcome.IN_PROGRESS: pb.STORE_OUTCOME_IN_PROGRESS,
    ReserveOutcome.NO_SPACE: pb.STORE_OUTCOME_DROPPED,
}


def _start_by(request: pb.RegionTransferRequest) -> float | None:
    """The loop time after which a region transfer must not start copying (None: no limit)."""
    if not request.start_within_ms:
        return None
    return asyncio.get_running_loop().time() + request.start_within_ms / 1000


def _region_path(path: str) -> str:
    """A region path as a request may name it: the OS takes no NUL and no path of PATH_MAX or more."""
    if not path:
        raise InvalidRequest("RegisterRegion needs a path")
    if "\x00" in path:
        raise InvalidRequest(f"region path {shown(path)} contains a NUL byte")
    size = len(path.encode())
    if size >= MAX_PATH_BYTES:
        raise InvalidRequest(f"region path {shown(path)} is {size} bytes; paths are shorter than {MAX_PATH_BYTES}")
    return path


# Tokens per chunk at most in a block identity (a 2 MiB chunk of a small model: a few thousand).
MAX_IDENTITY_TOKENS = 1 << 16
# The key lookups one Touch may stand for: a client posts its index hits every few thousand keys
# (kvstored_client.keyindex), far below this; a bound keeps the counters from overflowing uint64.
MAX_TOUCH_LOOKUPS = 1 << 20
U64_MAX = (1 << 64) - 1


def _identities(blocks: Sequence[pb.BlockIdentity], keys: int) -> list[BlockIdentity | None] | None:
    """The request's block identities (one per key; None for a key sent with an empty one),
    checked; None when it sends none."""
    if not blocks:
        return None
    if len(blocks) != keys:
        raise InvalidRequest(f"blocks must be empty or one per key: {len(blocks)} block identities for {keys} keys")
    out: list[BlockIdentity | None] = []
    for i, b in enumerate(blocks):
        if not b.block_hashes and not b.token_ids:
            out.append(None)
            continue
        if len(b.token_ids) > MAX_IDENTITY_TOKENS:
            raise InvalidRequest(
                f"block identity {i}: {len(b.token_ids)} token_ids exceed the limit of {MAX_IDENTITY_TOKENS}"
            )
        try:
            out.append(
                BlockIdentity.of(
                    list(b.block_hashes),
                    b.parent_block_hash if b.has_parent else None,
                    list(b.token_ids),
                    b.block_size,
                    b.group_idx,
                )
            )
        except ValueError as exc:
            raise InvalidRequest(f"block identity {i}: {exc}") from None
    return out


def _extents(extents: Sequence[Extent]) -> list[pb.Extent]:
    return [pb.Extent(offset=e.offset, length=e.length, arena=e.arena) for e in extents]


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(
        self,
        chain: TierChain,
        broker: SessionBroker,
        namespaces: NamespaceRegistry,
        max_batch_keys: int,
        region_dirs: Sequence[Path],
        tenancy: Tenancy,
        peer_counts: Callable[[], tuple[int, int]] = lambda: (0, 0),
        identities: IdentityBook | None = None,
        feeds: IntervalFeeds | None = None,
        indexes: KeyIndexes | None = None,
        incarnation: int = 0,
    ) -> None:
        self._incarnation = incarnation  # this daemon run (its event seqs mean nothing to another)
        self._indexes = indexes  # the key indexes sessions may map (None: none are kept)
        self._feeds = feeds  # coalesced watch streams' (None: not served)
        self._identities = identities  # None: no ZMQ publisher, identities are checked, not kept
        self._peer_counts = peer_counts  # (chunks leased to peers, RAM slots peer fetches hold)
        self._region_dirs = tuple(region_dirs)
        self._tenancy = tenancy
        self._chain = chain
        self._namespaces = namespaces
        self._broker = broker
        self._max_keys = max_batch_keys

    def _ns_keys(self, namespace_id: str, keys: Sequence[bytes]) -> Namespace:
        ns = self._namespaces.get(namespace_id)
        check_keys(ns, keys, self._max_keys)
        return ns

    @staticmethod
    def _visible(ns: Namespace, session: Session | None) -> bool:
        """Tenant namespaces exist only for the sessions that registered them: for anyone else
        every key answers exactly as a miss (and stores are dropped)."""
        return visible(ns, session)

    @staticmethod
    def _check_arenas(ns: Namespace, session: Session) -> None:
        """A client that knows only the public pool would copy a tenant's chunk at the right
        offsets of the wrong arena: refuse it the slots (its region transfers still work)."""
        if ns.private and not session.arenas:
            raise ArenasUnsupported(
                f"namespace {ns.namespace_id} is a tenant namespace, whose chunks live in the tenant's own "
                f"arena, and this session's client maps only the public pool: upgrade the client, or use "
                f"region transfers (StoreFromRegion / LoadToRegion)"
            )

    def _offer_identities(self, ns: Namespace, keys: Sequence[bytes], blocks: Sequence[pb.BlockIdentity]) -> None:
        identities = _identities(blocks, len(keys))
        if identities is not None and self._identities is not None:
            for key, identity in zip(keys, identities):
                if identity is not None:
                    self._identities.offer(ns.namespace_id, key, identity)

    def _check_handles(self, handles: Sequence[int]) -> None:
        if len(handles) > self._max_keys:
            raise BatchTooLarge(f"batch of {len(handles)} handles exceeds max_batch_keys={self._max_keys}")

    async def RegisterNamespace(self, request: pb.RegisterNamespaceRequest, context) -> pb.RegisterNamespaceResponse:
        spec = request.spec
        session = self._broker.optional(request.session_id)
        if spec.tenant_salt and session is None:
            raise SessionRequired("a tenant namespace (tenant_salt set) must be registered with a session_id")
        ns = self._namespaces.register(
            spec.model,
            spec.dtype,
            spec.chunk_bytes,
            spec.layout,
            spec.tenant_salt,
            spec.key_bytes,
            spec.block_tokens,
            spec.prefill_tokens_per_s,
            spec.kv_bytes_per_token,
        )
        placed = self._tenancy.register(session, ns, spec.quota_bytes)
        if ns.private and session is not None:  # (a tenant namespace always has one: checked above)
            session.namespaces.add(ns.namespace_id)
        return pb.RegisterNamespaceResponse(
            namespace_id=ns.namespace_id,
            chunk_bytes=ns.chunk_bytes,
            key_bytes=ns.key_bytes,
            pool_bytes=self._chain.pool_bytes,
            page_bytes=self._chain.page_bytes,
            arena_id=placed.arena_id,
            arena_bytes=placed.arena_bytes,
            quota_bytes=placed.quota_bytes,
        )

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        keys = request.keys[:]  # once, in C: every pass over the repeated field makes new bytes objects
        ns = self._ns_keys(request.namespace_id, keys)
        if not self._visible(ns, self._broker.optional(request.session_id)):
            return pb.LookupResponse(prefix_hits=0, tiers=[0] * len(keys))
        tiers = await self._chain.lookup(ns, keys, _load_into(request.load_into))  # (TierKind is an int)
        prefix = tiers.index(TierKind.NONE) if TierKind.NONE in tiers else len(tiers)
        if tiers.count(TierKind.RAM) == len(tiers):  # the usual answer: plain ints go into protobuf faster
            return pb.LookupResponse(prefix_hits=prefix, tiers=[_RAM] * len(tiers))
        return pb.LookupResponse(prefix_hits=prefix, tiers=tiers)

    async def Touch(self, request: pb.TouchRequest, context) -> pb.TouchResponse:
        keys = request.keys[:]
        ns = self._ns_keys(request.namespace_id, keys)
        if request.lookups and not len(keys) <= request.lookups <= MAX_TOUCH_LOOKUPS:
            raise InvalidRequest(
                f"Touch lookups={request.lookups} must be 0 (one per key) or between its {len(keys)} keys "
                f"(each stands for one lookup at least) and {MAX_TOUCH_LOOKUPS}"
            )
        if not self._visible(ns, self._broker.optional(request.session_id)):
            return pb.TouchResponse(hits=0)
        return pb.TouchResponse(hits=self._chain.touch(ns, keys, request.lookups))

    def open_index(self, session: Session, namespace_id: str) -> KeyIndex:
        """The key index of a namespace the session may see (NotFound for any other, as if it
        did not exist); made the first time it is asked for."""
        if self._indexes is None:
            raise InvalidRequest("this daemon keeps no key indexes (built without kvstored_client._keyindex)")
        ns = self._namespaces.get(namespace_id)
        if not self._visible(ns, session):
            # (the answer for a namespace never registered: a tenant's is not there for others)
            raise UnknownNamespace(f"unknown namespace {shown(namespace_id)}: register it first (RegisterNamespace)")
        max_chunks, keys = self._chain.resident(ns)
        return self._indexes.open(ns.namespace_id, ns.key_bytes, max_chunks, keys)

    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        session = self._broker.get(request.session_id)
        ns = self._ns_keys(request.namespace_id, request.keys)
        if not self._visible(ns, session):
            self._chain.drops.record([DropReason.NOT_VISIBLE] * len(request.keys))
            return pb.ReserveResponse(
                slots=[pb.Slot(state=pb.SLOT_STATE_NO_SPACE, drop_reason=DropReason.NOT_VISIBLE) for _ in request.keys]
            )
        self._check_arenas(ns, session)
        self._offer_identities(ns, request.keys, request.blocks)
        slots = await self._broker.reserve(session, ns, request.keys)
        ahead = self._broker.reserve_ahead(session, ns, request.ahead) if request.ahead else []
        return pb.ReserveResponse(
            slots=[
                pb.Slot(
                    state=_SLOT_STATE[s.outcome],
                    handle=s.handle,
                    extents=_extents(s.extents),
                    present_in=s.present_in,
                    drop_reason=s.drop,
                )
                for s in slots
            ],
            ahead=_ahead_slots(ahead),
        )

    async def Commit(self, request: pb.CommitRequest, context) -> pb.CommitResponse:
        session = self._broker.get(request.session_id)
        self._check_handles(request.handles)
        if not request.keys and not request.namespace_id:
            if request.ahead:
                raise InvalidRequest("Commit's ahead needs the namespace_id to reserve the slots in")
            return pb.CommitResponse(committed=self._broker.commit(session, request.handles))
        # Slots reserved ahead, named now (answered at once: this may be a posted call).
        keys = request.keys[:]
        ns = self._ns_keys(request.namespace_id, keys)
        if not self._visible(ns, session):  # (no slot was ever granted for it: nothing to free)
            raise InvalidRequest(f"namespace {ns.namespace_id} has no slots reserved ahead in this session")
        if request.ahead:
            self._check_arenas(ns, session)  # (as Reserve: slots in an arena its client does not map)
        self._offer_identities(ns, keys, request.blocks)
        outcomes = self._broker.commit_ahead(session, ns, request.handles, keys) if keys or request.handles else []
        ahead = self._broker.reserve_ahead(session, ns, request.ahead) if request.ahead else []
        return pb.CommitResponse(
            committed=outcomes.count(ReserveOutcome.RESERVED),
            ahead=_ahead_slots(ahead),
            states=[_SLOT_STATE[o] for o in outcomes],
        )

    async def Acquire(self, request: pb.AcquireRequest, context) -> pb.AcquireResponse:
        session = self._broker.get(request.session_id)
        ns = self._ns_keys(request.namespace_id, request.keys)
        if not self._visible(ns, session):
            return pb.AcquireResponse()
        self._check_arenas(ns, session)
        leases = await self._broker.acquire(session, ns, request.keys)
        return pb.AcquireResponse(leases=[pb.Lease(handle=g.handle, extents=_extents(g.extents)) for g in leases])

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        session = self._broker.get(request.session_id)
        self._check_handles(request.handles)
        return pb.ReleaseResponse(released=self._broker.release(session, request.handles))

    async def RegisterRegion(self, request: pb.RegisterRegionRequest, context) -> pb.RegisterRegionResponse:
        session = self._broker.get(request.session_id)
        fd = open_region_file(_region_path(request.path), self._region_dirs)
        try:
            if session.client is not None and not session.client.may_map(os.fstat(fd)):
                # (the daemon opened it with its own rights: only its owner may name it)
                raise RegionNotAllowed(
                    f"region file {shown(request.path)} is not owned by the session's user "
                    f"(uid {session.client.uid}); open it yourself and pass the fd (AttachRegion)"
                )
            region = self._broker.attach_region(session, request.path, fd)
        finally:
            os.close(fd)
        return pb.RegisterRegionResponse(region_id=region.region_id, size=region.size)

    async def StoreFromRegion(self, request: pb.RegionTransferRequest, context) -> pb.StoreFromRegionResponse:
        session = self._broker.get(request.session_id)
        ns = self._ns_keys(request.namespace_id, request.keys)
        region = session.region(request.region_id)
        n = len(request.keys)
        if not self._visible(ns, session):
            self._chain.drops.record([DropReason.NOT_VISIBLE] * n)
            return pb.StoreFromRegionResponse(
                dropped=n,
                outcomes=[pb.STORE_OUTCOME_DROPPED] * n,
                present_in=[TierKind.NONE] * n,
                drop_reasons=[DropReason.NOT_VISIBLE] * n,
            )
        self._offer_identities(ns, request.keys, request.blocks)
        result = await self._broker.store_from_region(
            session, ns, region, request.keys, request.offsets, _start_by(request)
        )
        return pb.StoreFromRegionResponse(
            stored=result.count(ReserveOutcome.RESERVED),
            already_present=result.count(ReserveOutcome.ALREADY_PRESENT),
            dropped=result.count(ReserveOutcome.IN_PROGRESS, ReserveOutcome.NO_SPACE),
            outcomes=[_STORE_OUTCOMES[o] for o in result.per_key],
            present_in=result.present_in,  # (TierKind and DropReason are ints)
            drop_reasons=result.drops,
        )

    async def LoadToRegion(self, request: pb.RegionTransferRequest, context) -> pb.LoadToRegionResponse:
        session = self._broker.get(request.session_id)
        ns = self._ns_keys(request.namespace_id, request.keys)
        region = session.region(request.region_id)
        if not self._visible(ns, session):
            return pb.LoadToRegionResponse(loaded=0)
        loaded = await self._broker.load_to_region(
            session, ns, region, request.keys, request.offsets, _start_by(request)
        )
        return pb.LoadToRegionResponse(loaded=loaded)

    async def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteResponse:
        ns = self._ns_keys(request.namespace_id, request.keys)
        if not self._visible(ns, self._broker.optional(request.session_id)):
            return pb.DeleteResponse(deleted=0)
        return pb.DeleteResponse(deleted=await self._chain.delete(ns, request.keys))

    async def ClearNamespace(self, request: pb.ClearNamespaceRequest, context) -> pb.ClearNamespaceResponse:
        ns = self._namespaces.get(request.namespace_id)
        if not self._visible(ns, self._broker.optional(request.session_id)):
            return pb.ClearNamespaceResponse(removed=0)
        return pb.ClearNamespaceResponse(removed=await self._chain.clear_namespace(ns))

    async def ListNamespaces(self, request: pb.ListNamespacesRequest, context) -> pb.ListNamespacesResponse:
        session = self._broker.optional(request.session_id)
        usage = self._chain.ram_usage_by_namespace()
        infos = []
        for ns in self._namespaces.all():
            if not self._visible(ns, session):
                continue
            chunks, ram_bytes = usage.get(ns.namespace_id, (0, 0))
            own = self._tenancy.namespace_usage(ns.namespace_id)
            tenant = self._tenancy.tenant_usage(ns.tenant) if ns.private else None
            infos.append(
                pb.NamespaceInfo(
                    namespace_id=ns.namespace_id,
                    model=ns.model,
                    dtype=ns.dtype,
                    chunk_bytes=ns.chunk_bytes,
                    layout=ns.layout,
                    key_bytes=ns.key_bytes,
                    block_tokens=ns.block_tokens,
                    tenant=ns.private,
                    ram_chunks=chunks,
                    ram_bytes=ram_bytes,
                    quota_bytes=own.quota_bytes if own else 0,
                    tenant_quota_bytes=tenant.quota_bytes if tenant else 0,
                    tenant_ram_bytes=tenant.used_bytes if tenant else 0,
                    recovered_from=self._namespaces.recovered_from(ns.namespace_id),
                )
            )
        tenants = self._tenancy.snapshot().tenants
        return pb.ListNamespacesResponse(
            namespaces=infos,
            tenants=len(tenants),
            tenant_ram_bytes=sum(t.used_bytes for t in tenants),
            tenant_quota_bytes=self._tenancy.tenant_quota_bytes,
        )

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        peer_leases, peer_reservations = self._peer_counts()
        snapshot = chain_snapshot(self._chain)
        staging = snapshot.staging
        return pb.StatsResponse(
            tiers=[pb.TierStats(**{**_clamped(dataclasses.asdict(t)), "kind": int(t.kind)}) for t in snapshot.tiers],
            namespaces=len(self._namespaces),
            **dataclasses.asdict(self._broker.counts()),
            version=__version__,
            peer_leases=peer_leases,
            peer_reservations=peer_reservations,
            staging_capacity_bytes=staging.capacity_bytes,
            staging_used_bytes=staging.used_bytes,
            staged_chunks=staging.staged_chunks,
            store_drops=[
                pb.StoreDrops(reason=reason, chunks=snapshot.store_drops.get(reason, 0))
                for reason in STORE_DROP_REASONS
            ],
        )

    async def WatchEvents(self, request: pb.WatchEventsRequest, context):
        bus = self._chain.events
        accepts = events_for(self._namespaces, self._broker.optional(request.session_id))
        await context.send_initial_metadata(((INCARNATION_KEY, str(self._incarnation)),))
        if request.incarnation and request.incarnation != self._incarnation:
            _out_of_range(
                context,
                bus.oldest_seq,
                f"seq {request.from_seq} is of another daemon run (incarnation {request.incarnation}; this one is "
                f"{self._incarnation}): it restarted; read the state anew",
            )
            return
        # Events between are gone (or, past the newest, the seq is an earlier daemon's: a restart):
        # streaming on would skip them without a word. Ended here, not raised, so the
        # error-mapping interceptor leaves the status as is.
        if request.from_seq and request.from_seq < bus.oldest_seq:
            _out_of_range(
                context,
                bus.oldest_seq,
                f"events from seq {request.from_seq} are no longer buffered; the oldest "
                f"available is seq {bus.oldest_seq} (events_buffer={bus.buffer_events})",
            )
            return
        if request.from_seq > bus.last_seq + 1:
            _out_of_range(
                context,
                bus.oldest_seq,
                f"events from seq {request.from_seq} are ahead of this daemon's newest (seq {bus.last_seq}): "
                f"the seq is an earlier daemon's (a restart); read the state anew",
            )
            return
        if not request.coalesce:
            async for event in each_event(bus, accepts, request.from_seq):
                yield event
            return
        if self._feeds is None:
            raise InvalidRequest("coalesced event streams are not served here")
        # Streams that see the same events share a feed: those of one session, or of none.
        async for payload in net_changes(self._feeds, request.session_id, accepts, request.from_seq):
            yield payload  # (encoded once for the whole audience: see add_to_server)


def _out_of_range(context, oldest_seq: int, details: str) -> None:
    """End a WatchEvents stream with OUT_OF_RANGE and the oldest seq it could start from."""
    context.set_code(grpc.StatusCode.OUT_OF_RANGE)
    context.set_trailing_metadata(((OLDEST_SEQ_KEY, str(oldest_seq)),))
    context.set_details(details)


def _ahead_slots(slots: Sequence[Slot]) -> list[pb.Slot]:
    return [pb.Slot(state=pb.SLOT_STATE_RESERVED, handle=s.handle, extents=_extents(s.extents)) for s in slots]


def _load_into(value: int) -> LoadInto:
    try:
        return LoadInto(value)
    except ValueError:
        raise InvalidRequest(
            f"load_into {value} is not a LoadInto value ({', '.join(f'{m.value}: {m.name}' for m in LoadInto)})"
        ) from None


def _encoded_or_message(message: bytes | pb.KvEvent) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class _PassEncoded:
    """Stands in for the server while the generated code registers the KVStore handlers: gives
    WatchEvents a serializer that passes an already encoded message through."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def _patched(self, handlers: dict[str, grpc.RpcMethodHandler]) -> dict[str, grpc.RpcMethodHandler]:
        watch = handlers["WatchEvents"]
        return {**handlers, "WatchEvents": watch._replace(response_serializer=_encoded_or_message)}

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        pass  # (the same methods come again as registered ones: both are added from those)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        methods = self._patched(handlers)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, methods),))
        self._server.add_registered_method_handlers(service, methods)


def add_to_server(service: KVStoreService, server: grpc.aio.Server) -> None:
    """Register the KVStore service; a coalesced WatchEvents stream yields messages its feed
    encoded once for every stream of the audience (feed.py), sent as they are."""
    pb_grpc.add_KVStoreServicer_to_server(service, _PassEncoded(server))


def _clamped(counters: dict[str, Any]) -> dict[str, Any]:
    """Counters as uint64 fields take them: one past 2**64 - 1 saturates instead of failing Stats."""
    return {k: min(v, U64_MAX) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in counters.items()}
