# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The serving side of the peer tier: what this daemon gives its peers, and the data servers
(TCP data port; UCX port where UCX may be used) they fetch through.

A fetch is served from RAM and from this node's own tiers (promoted into RAM first, as a local
load would be: such a chunk is read once and goes to the cold end of the LRU), never from this
daemon's own peers (no loops, no amplification) and never for a tenant namespace. Each chunk
sent is pinned by a lease that lives as long as its send: at most the fetch's timeout (the
fetcher's, capped at MAX_SEND_S), so a fetcher that dies or vanishes frees it by itself (its gRPC
call is cancelled, or the send times out). A send whose transfer could not be stopped in time
keeps its leases until its quarantine settles: the pages are never handed to another chunk while
the network may still read them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstored.chain.chain import TierChain
from kvstored.chain.leases import LeaseRequest, Reach
from kvstored.chunks.ids import ChunkId, TierKind
from kvstored.errors import BatchTooLarge, InvalidRequest, PeerIncompatible, TierStartError
from kvstored.events.bus import EventBus
from kvstored.events.identity import IdentityBook
from kvstored.namespaces import Namespace, NamespaceRegistry
from kvstored.peer.errors import TransportUnavailable
from kvstored.peer.factory import local_transports, make_server
from kvstored.peer.handshake import LocalHello
from kvstored.peer.messages import fetch_response, order_of
from kvstored.peer.transport import (
    PeerServer,
    SendOutcome,
    SendResult,
    Source,
    TransportConfig,
    TransportKind,
    TransportPreference,
    UcxConfig,
)
from kvstored.tiers.config import PeerTierConfig, data_ports, data_threads
from kvstored.tiers.ram import RamEntry
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

log = logging.getLogger(__name__)

MAX_SEND_S = 30.0  # a lease never outlives this, whatever the fetcher asks
MAX_FETCH_KEYS = 1024  # chunks one fetch may ask for (fetchers send max_batch, 16 by default)
SNAPSHOT_BATCH_KEYS = 8192
MAX_FETCHERS_TRACKED = 1024  # per-fetcher byte counts kept; older fetchers' go to other_sent_bytes


@dataclass
class ServingCounters:
    served_chunks: int = 0
    served_bytes: int = 0
    refused_chunks: int = 0  # asked for and not here (or not shareable)
    other_sent_bytes: int = 0  # to fetchers no longer tracked one by one
    send_failures: int = 0


class PeerServing:
    def __init__(
        self, chain: TierChain, namespaces: NamespaceRegistry, cfg: PeerTierConfig, tcp_listen: str, incarnation: int
    ) -> None:
        self._chain = chain
        self._namespaces = namespaces
        self._cfg = cfg
        self._host = tcp_listen.rpartition(":")[0].strip("[]") or "0.0.0.0"
        self._ports = data_ports(cfg, tcp_listen)
        self.incarnation = incarnation
        self.address = tcp_listen
        self._transport = TransportConfig(
            connect_timeout_s=cfg.connect_timeout_s,
            settle_timeout_s=cfg.settle_timeout_s,
            tcp_connections=cfg.tcp_connections,
            threads=data_threads(cfg),
            ucx=UcxConfig(tls=cfg.ucx_tls, net_devices=cfg.ucx_net_devices),
        )
        self.servers: dict[TransportKind, PeerServer] = {}
        self.counters = ServingCounters()
        self.sent_to: OrderedDict[int, int] = OrderedDict()  # fetcher incarnation -> bytes sent to it
        self.leases = 0  # chunks pinned for peers now (quarantined sends included)
        self._held: set[asyncio.Future] = set()  # quarantines keeping leases
        self._refused_logged: set[tuple[int, str]] = set()
        self._local = ["ram"] + [lower.tier.name for lower in chain.lower if lower.capabilities.local]
        self.hello: LocalHello | None = None
        self.identities: IdentityBook | None = None  # set with a ZMQ publisher: fetch replies carry them

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> LocalHello:
        """Listen on the data ports. ListenError: a port cannot be bound; TierStartError: UCX was
        asked for (transport = "ucx") and cannot start."""
        kinds = [TransportKind.TCP]
        if self._cfg.transport is not TransportPreference.TCP and TransportKind.UCX in local_transports():
            kinds.append(TransportKind.UCX)
        elif self._cfg.transport is TransportPreference.UCX:
            raise TierStartError(
                f'peer tier {self._cfg.name!r}: transport = "ucx" but ucxx is not installed '
                f'(pip install \'kvstored[ucx]\'), or set transport = "auto" or "tcp"'
            )
        ports = {}
        try:
            for kind in kinds:
                port = self._ports[0] if kind is TransportKind.TCP else self._ports[1]
                server = make_server(kind, self._host, port, self._transport)
                try:
                    bound = await server.start()
                except TransportUnavailable as exc:
                    if self._cfg.transport is TransportPreference.UCX:
                        raise TierStartError(f"peer tier {self._cfg.name!r}: UCX cannot start: {exc}") from None
                    log.warning("peer tier: serving over TCP only, UCX cannot start: %s", exc)
                    continue
                self.servers[kind] = server
                ports[kind] = bound.port
        except BaseException:
            await self.close()
            raise
        self.hello = LocalHello(
            self.incarnation,
            frozenset(self.servers),
            ports.get(TransportKind.TCP, 0),
            ports.get(TransportKind.UCX, 0),
            tuple(self._local),
            self.address,
        )
        log.info(
            "serving peers on %s (%s; from %s)",
            self.address,
            ", ".join(f"{k.value} data port {p}" for k, p in ports.items()),
            ", ".join(self._local),
        )
        return self.hello

    async def close(self) -> None:
        """Stop serving: close the data servers (sends in flight fail, their leases come back),
        then wait (bounded) for quarantined sends."""
        for server in self.servers.values():
            try:
                await server.close()
            except Exception as exc:  # one server's failure must not keep the other open
                log.warning("closing the peer %s server: %r", server.kind.value, exc)
        self.servers.clear()
        if self._held:
            await asyncio.wait(list(self._held), timeout=self._cfg.settle_timeout_s)

    # -- handshake ------------------------------------------------------------------------

    def check_fetcher(self, remote: pb.PeerHello, why: str, peer: str) -> None:
        """Refuse an incompatible fetcher: once in the log per fetcher incarnation."""
        if not why:
            return
        if (remote.incarnation, "hello") not in self._refused_logged:
            self._refused_logged.add((remote.incarnation, "hello"))
            log.error("refusing peer %s (%s): %s", remote.address or peer, peer, why)
        raise PeerIncompatible(f"this daemon ({self.address}) cannot share chunks with yours: {why}")

    # -- fetch ----------------------------------------------------------------------------

    async def fetch(self, request: pb.FetchRequest) -> pb.FetchResponse:
        try:
            order = order_of(request)
        except ValueError:
            raise InvalidRequest(f"unknown transport {request.transport!r}") from None
        server = self.servers.get(order.transport)
        if server is None:
            refused = SendResult(SendOutcome.INVALID, f"this daemon does not serve over {order.transport.value}")
            return fetch_response(refused, self.incarnation)
        if len(request.keys) != len(order.transfers):
            raise InvalidRequest(f"{len(request.keys)} keys for {len(order.transfers)} transfers")
        if len(request.keys) > MAX_FETCH_KEYS:
            raise BatchTooLarge(f"a fetch of {len(request.keys)} chunks; at most {MAX_FETCH_KEYS}")
        timeout_s = min(max(request.timeout_ms, 1) / 1000, MAX_SEND_S)
        ns = self._shareable(request)
        if ns is None:
            self.counters.refused_chunks += len(request.keys)
            return fetch_response(await server.refuse(order, timeout_s), self.incarnation)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s  # the leases' time to live: promotions, then the send
        entries = await self._lease(ns, request.keys, loop.time() + timeout_s / 2)
        sources = [self._source(e) if e is not None else None for e in entries]
        sent: SendResult | None = None
        try:
            sent = await server.send(order, sources, max(0.001, deadline - loop.time()))
            if sent.ok:  # the next send of these chunks hashes them no more
                for entry, receipt in zip(entries, sent.receipts):
                    if entry is not None and receipt.found:
                        entry.checksum = receipt.checksum
        finally:
            self._release(server, entries, sources, sent)
        self._count(request.incarnation, sent, len(request.keys))
        book = self.identities
        if book is None:
            return fetch_response(sent, self.incarnation)
        keys = {t.transfer_id: key for t, key in zip(order.transfers, request.keys)}
        return fetch_response(sent, self.incarnation, keys, lambda key: book.get(ns.namespace_id, key))

    def _shareable(self, request: pb.FetchRequest) -> Namespace | None:
        """The namespace if peers may have its chunks (a public one this daemon knows)."""
        ns = self._namespaces.find(request.namespace_id)
        if ns is None or ns.private:
            return None
        if (ns.chunk_bytes, ns.key_bytes) != (request.chunk_bytes, request.key_bytes):
            mark = (request.incarnation, ns.namespace_id)
            why = (
                f"namespace {ns.namespace_id}: chunk_bytes {ns.chunk_bytes}, key_bytes {ns.key_bytes} here; "
                f"the fetcher has {request.chunk_bytes}, {request.key_bytes}"
            )
            if mark not in self._refused_logged:
                self._refused_logged.add(mark)
                log.error("refusing a peer's fetch: %s", why)
            raise PeerIncompatible(why)
        for key in request.keys:
            if len(key) != ns.key_bytes:
                raise InvalidRequest(
                    f"a key of {len(key)} bytes in namespace {ns.namespace_id} ({ns.key_bytes}-byte keys)"
                )
        return ns

    async def _lease(self, ns: Namespace, keys: Sequence[bytes], promote_by: float) -> list[RamEntry | None]:
        """Leases for the chunks this node holds itself: in RAM, or promoted from its local tiers
        (waiting until `promote_by`). Never a chunk on its way from a peer."""
        request = LeaseRequest(Reach.EACH, start_by=promote_by, local_only=True)
        leased = await self._chain.leases.lease(ns, keys, request)
        self.leases += len(leased.held)
        return leased.entries

    def _source(self, entry: RamEntry) -> Source:
        return Source(self._chain.leases.page_views(entry), entry.size, entry.checksum)

    def _release(
        self,
        server: PeerServer,
        entries: list[RamEntry | None],
        sources: list[Source | None],
        result: SendResult | None,
    ) -> None:
        """Give the leases back, unless the network may still read their pages (a quarantine:
        the send's own, or, after a cancellation, the server's covering them)."""
        held = [e for e in entries if e is not None]
        if not held:
            return
        quarantine = result.quarantine if result is not None else None
        if quarantine is None and result is None:
            views = [v for s in sources if s is not None for v in s.views]
            quarantine = server.quarantines.covers(views)
        if quarantine is None:
            self._unlease(held)
            return
        settled = quarantine.settled
        self._held.add(settled)

        def release(future: asyncio.Future) -> None:
            self._held.discard(future)
            self._unlease(held)

        settled.add_done_callback(release)

    def _unlease(self, entries: list[RamEntry]) -> None:
        self._chain.release(entries)
        self.leases -= len(entries)

    def _count(self, fetcher: int, result: SendResult, asked: int) -> None:
        c = self.counters
        if not result.ok:
            c.send_failures += 1
            return
        sent = sum(r.length for r in result.receipts if r.found)
        found = sum(1 for r in result.receipts if r.found)
        c.served_chunks += found
        c.served_bytes += sent
        c.refused_chunks += asked - found
        self.sent_to[fetcher] = self.sent_to.pop(fetcher, 0) + sent
        while len(self.sent_to) > MAX_FETCHERS_TRACKED:
            _, old = self.sent_to.popitem(last=False)
            c.other_sent_bytes += old

    # -- snapshot -------------------------------------------------------------------------

    def holdings(self) -> list[tuple[TierKind, ChunkId]]:
        """Every chunk of a public namespace this daemon holds in RAM or a local tier, with the
        tier's kind (what the fleet directory's refresh pass re-writes)."""
        public = {ns.namespace_id for ns in self._namespaces.all() if not ns.private}
        out: list[tuple[TierKind, ChunkId]] = [(TierKind.RAM, c) for c in self._chain.ready_chunks() if c[0] in public]
        for lower in self._chain.lower:
            if lower.capabilities.local:
                for ns_id in public:
                    out += [(lower.tier.kind, c) for c in lower.tier.known_chunks(ns_id)]
        return out

    def snapshot(self, events: EventBus) -> Iterator[pb.SnapshotBatch]:
        """Every chunk this daemon serves peers from, of public namespaces, listed at once (one
        event-loop turn: consistent with `last_seq`), then cut into batches."""
        last_seq = events.last_seq
        public = {ns.namespace_id for ns in self._namespaces.all() if not ns.private}
        groups: dict[tuple[str, str], list[bytes]] = {}
        for ns_id, key in self._chain.ready_chunks():
            if ns_id in public:
                groups.setdefault(("ram", ns_id), []).append(key)
        for lower in self._chain.lower:
            if not lower.capabilities.local:
                continue
            for ns_id in public:
                keys = [key for _, key in lower.tier.known_chunks(ns_id)]
                if keys:
                    groups[(lower.tier.name, ns_id)] = keys
        yield pb.SnapshotBatch(incarnation=self.incarnation, last_seq=last_seq)  # even when empty
        for (tier, ns_id), keys in groups.items():
            for start in range(0, len(keys), SNAPSHOT_BATCH_KEYS):
                yield pb.SnapshotBatch(
                    incarnation=self.incarnation,
                    last_seq=last_seq,
                    tier=tier,
                    namespace_id=ns_id,
                    keys=keys[start : start + SNAPSHOT_BATCH_KEYS],
                )
