# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The peer tier: chunks other kvstored daemons hold in their RAM or on their local tiers.

- `contains` asks only the remote-location index (kvstored/peer/index.py), fed by every
  peer's KV events: a miss never costs a network round trip. A chunk counts as there when a
  peer that is UP and whose breaker lets fetches through holds it. Tenant namespaces are never
  looked up (nor indexed: peers stream public namespaces' events only).
- `read` fetches from the best holder (a peer holding it in RAM first) straight into the RAM
  slot the chain reserved, verified by the transport against the chunk format's checksum;
  concurrent reads from one peer go as one batch (kvstored/peer/fetcher.py). Only RECEIVED is a
  hit. MISSING (the index was stale) drops that entry; CORRUPT counts as a checksum failure;
  FAILED and TIMED_OUT count against the peer's breaker. Every read ends within
  fetch_timeout_s (plus settle_timeout_s after a failure), as a hit or a miss.
- Nothing is ever written down to a peer or deleted from it (the registry's capabilities say so,
  the chain honours them): a Delete on this daemon leaves the peers' copies alone.

- With a fleet directory (`directory = "redis://..."`, kvstored/directory/): the chunks that
  `contains` finds in neither the index nor RAM's neighbours are asked of the directory, once per
  call, within directory_timeout_s (slow or down: a miss); a holder it names is reached like a
  peer (handshake, data link; not followed) and fetched from by `read`, verified the same way. A
  holder's MISSING deletes its directory entry. This daemon's own holdings go to the directory
  from the event bus (the daemon adds the listener and the holdings source).

The connections to the peers (handshake, events, data links) are kvstored/peer/fleet.py; the
serving side (what this daemon gives its peers) is kvstored/server/peer_serving.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import grpc

from kvstored.chunks.ids import ChunkId, TierKind
from kvstored.errors import ListenError
from kvstored.events.identity import BlockIdentity
from kvstored.io.breaker import Permit
from kvstored.io.ports import bind_problem
from kvstored.logs import LogLimiter
from kvstored.namespaces import Namespace, NamespaceRegistry
from kvstored.peer.control import ClientTls
from kvstored.peer.factory import local_transports
from kvstored.peer.fetcher import REFUSED, PeerFetcher
from kvstored.peer.fleet import FleetSettings, PeerFleet
from kvstored.peer.handshake import LocalHello
from kvstored.peer.index import SLOT_MASK, TIER_BITS, PeerIndex
from kvstored.peer.membership import Membership, PeerRecord, parse_address
from kvstored.peer.messages import fetch_request, identities_of, receipts_of
from kvstored.peer.quarantine import span_of
from kvstored.peer.transport import (
    Receipt,
    ReceiveOutcome,
    ReceiveResult,
    SendOrder,
    Slot,
    TransportConfig,
    TransportKind,
    TransportPreference,
    UcxConfig,
)
from kvstored.tiers.base import SecondaryTier, TierUsage, WriteOutcome
from kvstored.tiers.config import PeerTierConfig, TierContext, data_ports, data_threads

if TYPE_CHECKING:
    from kvstored.directory.keys import Holder
    from kvstored.directory.node import DirectoryNode

log = logging.getLogger(__name__)
limited = LogLimiter(log)  # (a misbehaving peer's every chunk would be a line)

DIRECTORY_HITS = 65_536  # chunks the directory named a holder of, remembered for the reads that follow

FAILURES = (ReceiveOutcome.FAILED, ReceiveOutcome.TIMED_OUT)


class PeerTier(SecondaryTier):
    kind = TierKind.PEER

    def __init__(self, cfg: PeerTierConfig, ctx: TierContext) -> None:
        super().__init__(cfg.name)
        self.config = cfg
        self._namespaces = ctx.namespaces if ctx.namespaces is not None else NamespaceRegistry(1 << 62)
        self.incarnation = ctx.incarnation
        options = ctx.options
        own = options.tcp_listen if options is not None else ""
        self._own_listen = own
        self.index = PeerIndex(cfg.index_entries)
        self.membership = Membership(cfg.peers, own, cfg.breaker_failures, cfg.breaker_reset_s)
        transport = TransportConfig(
            connect_timeout_s=cfg.connect_timeout_s,
            settle_timeout_s=cfg.settle_timeout_s,
            tcp_connections=cfg.tcp_connections,
            threads=data_threads(cfg),
            ucx=UcxConfig(tls=cfg.ucx_tls, net_devices=cfg.ucx_net_devices),
        )
        self._streams = cfg.streams if transport.threads else 1  # (one event loop: one stream is as fast)
        settings = FleetSettings(
            cfg.transport,
            transport,
            cfg.connect_timeout_s,
            cfg.reconnect_s,
            cfg.peers_dns,
            cfg.dns_interval_s,
            cfg.coalesce_events,
        )
        self.fleet = PeerFleet(settings, self.membership, self.index, _client_tls(cfg, options))
        self.directory: DirectoryNode | None = None
        self._found: OrderedDict[ChunkId, Holder] = OrderedDict()  # the directory's answers, for read()
        if cfg.directory:
            self.directory = _directory(cfg, cfg.directory_address or own, ctx.incarnation, self._shareable)
            self.directory.on_dead = self._holder_gone
        self._fetchers: dict[PeerRecord, PeerFetcher] = {}
        self._replaced: list[PeerFetcher] = []  # of links since replaced: closed with the tier
        self._refused: set[tuple] = set()  # (peer, incarnation, namespace) refusals logged
        self._busy: dict[tuple[int, int], asyncio.Future] = {}  # slots a transfer may still touch
        self._closed = False
        # Where the identities the peers' fetch replies carry go (the daemon's IdentityBook.offer,
        # with a ZMQ publisher): a fetched chunk this node keeps is published as its own.
        self.on_identity: Callable[[str, bytes, BlockIdentity], None] | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def serve_as(self, hello: LocalHello) -> None:
        """How this daemon introduces itself to its peers (its serving side's ports and tiers)."""
        self.fleet.local = hello

    async def preflight(self) -> str:
        """The data ports are free and the transport asked for is installed (its peers are
        reached only once serving: one that is down is not this daemon's problem)."""
        cfg = self.config
        listen = self._own_listen
        host = listen.rpartition(":")[0].strip("[]") or "0.0.0.0"
        tcp, ucx = data_ports(cfg, listen)
        ucx_here = TransportKind.UCX in local_transports()
        if cfg.transport is TransportPreference.UCX and not ucx_here:
            raise ValueError(
                "transport = \"ucx\" but ucxx is not installed (pip install 'kvstored[ucx]'), "
                'or set transport = "auto" or "tcp"'
            )
        ports = [("tcp_port", tcp)]
        if cfg.transport is TransportPreference.UCX:  # (auto falls back to TCP alone)
            ports.append(("ucx_port", ucx))
        for option, port in ports:
            problem = bind_problem(host, port)
            if problem is not None:
                raise ListenError(f"peer tier {self.name!r}: cannot listen on {host}:{port} ({option}): {problem}")
        listed = f"{len(cfg.peers)} peer(s) listed" + (f", peers_dns {cfg.peers_dns}" if cfg.peers_dns else "")
        shown = ", ".join(f"{option} {port or 'any'}" for option, port in ports)
        return f"{listed}; data ports free ({shown})"

    async def start(self) -> None:
        await self.fleet.start()
        if self.directory is not None:
            await self.directory.start()

    async def close(self) -> None:
        """Stop following the peers, end the reads (each within its timeout), close the links."""
        if self._closed:
            return
        self._closed = True
        if self.directory is not None:
            await self.directory.close()  # (its heartbeat deleted: its entries stop counting now)
        fetchers, self._fetchers = [*self._fetchers.values(), *self._replaced], {}
        for fetcher in fetchers:
            await fetcher.close()
        await self.fleet.close()

    # -- the tier contract ------------------------------------------------------------------

    async def contains(self, chunks: Sequence[ChunkId]) -> list[bool]:
        out = [False] * len(chunks)
        by_ns: dict[str, list[int]] = {}
        for i, chunk in enumerate(chunks):
            by_ns.setdefault(chunk[0], []).append(i)
        usable = self._usable_mask()
        for namespace_id, positions in by_ns.items():
            if not usable or not self._shareable(namespace_id):
                continue
            masks = self.index.contains(namespace_id, [chunks[i][1] for i in positions])
            for i, mask in zip(positions, masks):
                out[i] = bool(mask & usable)
        if self.directory is not None and not self._closed:
            await self._ask_directory(chunks, out)
        self.counters.lookups += len(out)
        self.counters.hits += sum(out)
        return out

    async def read(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> bool:
        ns = self._namespaces.find(chunk[0])
        if self._closed or ns is None or not self._shareable(chunk[0]) or size != ns.chunk_bytes:
            return False
        record = self._holder(chunk)
        if record is None:
            return False
        fetcher = self._fetcher(record)
        if fetcher is None:
            return False
        result = await fetcher.read(ns, chunk[1], Slot(list(views), size))
        return self._judge(record, chunk, result, size)

    async def write(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> WriteOutcome:
        return WriteOutcome.FAILED  # never called: the tier accepts no write-downs (registry)

    async def remove(self, chunk: ChunkId) -> bool:
        return False  # never called: a peer's chunks are its own (registry)

    def usage(self) -> TierUsage:
        return TierUsage(0, 0, len(self.index))

    def views_busy(self, views: Sequence[memoryview]) -> asyncio.Future | None:
        if not views:
            return None
        return self._busy.get(span_of(views[0]))

    @property
    def reservations(self) -> int:
        """Slots a fetch is receiving into, or that a quarantine still holds."""
        return len(self._busy)

    # -- helpers --------------------------------------------------------------------------

    def _shareable(self, namespace_id: str) -> bool:
        """Only public namespaces this daemon knows are ever asked of peers."""
        ns = self._namespaces.find(namespace_id)
        return ns is not None and not ns.private

    def _usable_mask(self) -> int:
        mask = 0
        for record in self.membership.records():
            if record.slot is not None and record.usable() and record.address in self.fleet.links:
                mask |= SLOT_MASK << (record.slot * TIER_BITS)
        return mask

    def _holder(self, chunk: ChunkId) -> PeerRecord | None:
        """The best peer to fetch from: holding it in RAM rather than on disk, UP, breaker shut
        (a peer the index names first, else the holder the directory named)."""
        for holder in self.index.holders(chunk):
            record = self.membership.by_slot(holder.slot)
            if record is not None and record.usable() and record.address in self.fleet.links:
                return record
        found = self._found.get(chunk)
        if found is not None:
            record = self.membership.peers.get(parse_address(found.address))
            if record is not None and self._reachable(record):
                return record
        return None

    def _reachable(self, record: PeerRecord) -> bool:
        return record.usable() and record.address in self.fleet.links

    # -- the fleet directory ------------------------------------------------------------------

    async def _ask_directory(self, chunks: Sequence[ChunkId], out: list[bool]) -> None:
        """The shareable chunks still missed, asked of the directory (one call, its deadline)."""
        assert self.directory is not None
        missed = [i for i, hit in enumerate(out) if not hit and self._shareable(chunks[i][0])]
        if not missed:
            return
        answers = await self.directory.lookup([chunks[i] for i in missed])
        for i, holders in zip(missed, answers):
            for holder in holders:
                address = parse_address(holder.address)
                record = self.membership.peers.get(address)
                if record is None:
                    self.fleet.add_found(address)  # (reached in the background: a hit next time)
                    continue
                if self._reachable(record) and record.incarnation == holder.incarnation:
                    out[i] = True
                    self._found[chunks[i]] = holder
                    self._found.move_to_end(chunks[i])
                    break
        while len(self._found) > DIRECTORY_HITS:
            self._found.popitem(last=False)

    def _holder_gone(self, address: str) -> None:
        """The directory has no heartbeat of this holder any more: stop reaching it (if it was
        found there; a configured peer stays)."""
        record = self.membership.peers.get(parse_address(address))
        if record is not None and not record.follows:
            self.fleet.drop_found_soon(record.address)

    def _fetcher(self, record: PeerRecord) -> PeerFetcher | None:
        link = self.fleet.links.get(record.address)
        if link is None:
            return None
        fetcher = self._fetchers.get(record)
        if fetcher is None or fetcher.link is not link:
            if fetcher is not None:
                self._replaced.append(fetcher)
            for gone in [r for r in self._fetchers if r.address not in self.membership.peers]:
                self._replaced.append(self._fetchers.pop(gone))  # a peer DNS no longer names
            self._replaced = [f for f in self._replaced if f.in_flight]  # kept while their batches run
            fetcher = self._fetchers[record] = PeerFetcher(
                link,
                self._asker(record),
                self.config.max_batch,
                self._streams,
                self.config.fetch_timeout_s,
                functools.partial(self._gate, record),
                functools.partial(self._verdict, record),
                self._busy,
            )
        return fetcher

    def _asker(self, record: PeerRecord):
        channel = self.fleet.channel(record)
        timeout_s = self.config.fetch_timeout_s

        def ask_for(ns: Namespace, keys: list[bytes]):
            async def ask(order: SendOrder) -> Sequence[Receipt]:
                request = fetch_request(
                    order, self.incarnation, ns.namespace_id, ns.chunk_bytes, ns.key_bytes, keys, timeout_s
                )
                try:
                    response = await channel.fetch(request, timeout_s)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:  # a namespace the peer sizes otherwise
                        self._refused_once(record, ns, exc.details() or "")
                    raise
                receipts = receipts_of(response)
                if self.on_identity is not None:
                    # offered before the chunk lands in RAM: its STORED event finds it
                    by_transfer = {t.transfer_id: key for t, key in zip(order.transfers, keys)}
                    for key, identity in identities_of(response, by_transfer):
                        self.on_identity(ns.namespace_id, key, identity)
                return receipts

            return ask

        return ask_for

    def _refused_once(self, record: PeerRecord, ns: Namespace, why: str) -> None:
        mark = (record.address, record.incarnation, ns.namespace_id)
        if mark not in self._refused:
            self._refused.add(mark)
            log.error("peer %s refuses to serve namespace %s: %s", record.address, ns.namespace_id, why)

    @staticmethod
    def _gate(record: PeerRecord) -> Permit | None:
        """A batch may go to the peer (its breaker's permit taken): counted as a fetch."""
        permit = record.breaker.allow()
        if permit is not None:
            record.counters.fetches += 1
        return permit

    def _verdict(self, record: PeerRecord, permit: Permit, results: list[ReceiveResult]) -> None:
        """One verdict per batch for the peer's breaker: a failure or timeout opens it (after
        breaker_failures in a row), an answer (a hit, or an honest miss) closes it."""
        if any(r.outcome in FAILURES for r in results):
            record.breaker.record(permit, False)
        elif any(r.outcome in (ReceiveOutcome.RECEIVED, ReceiveOutcome.MISSING) for r in results):
            record.breaker.record(permit, True)
        else:
            record.breaker.abandon(permit)

    def _judge(self, record: PeerRecord, chunk: ChunkId, result: ReceiveResult, size: int) -> bool:
        c, tc = record.counters, self.counters
        if result is REFUSED:
            c.refused_by_breaker += 1
            return False
        outcome = result.outcome
        if outcome is ReceiveOutcome.RECEIVED:
            c.received_chunks += 1
            c.received_bytes += size
            tc.reads += 1
            tc.read_bytes += size
            return True
        if outcome is ReceiveOutcome.MISSING:
            c.missing_chunks += 1
            self._forget(record, chunk)  # stale: a miss, and forgotten
        elif outcome is ReceiveOutcome.CORRUPT:
            c.corrupt_chunks += 1
            tc.checksum_failures += 1
            self._forget(record, chunk)  # (not asked of this peer again until it is named anew)
            limited.log(
                f"corrupt {record.address}",
                logging.WARNING,
                "peer %s sent a corrupt chunk (%s): served as a miss",
                record.address,
                result.detail,
            )
        elif outcome is ReceiveOutcome.TIMED_OUT:
            c.timed_out_chunks += 1
            tc.errors += 1
        else:
            c.failed_chunks += 1
            tc.errors += 1
            log.debug("peer %s: fetch failed: %s", record.address, result.detail)
        return False

    def _forget(self, record: PeerRecord, chunk: ChunkId) -> None:
        """This peer is no holder of `chunk` for us: out of its index slot, and its directory
        entry deleted where the directory named it."""
        if record.slot is not None:
            self.index.drop(record.slot, chunk[0], chunk[1])
        found = self._found.pop(chunk, None)
        if found is not None and self.directory is not None:
            self.directory.forget(chunk, found)


def _directory(cfg: PeerTierConfig, address: str, incarnation: int, shareable) -> DirectoryNode:
    from kvstored.directory.config import DirectorySettings, parse_url
    from kvstored.directory.node import DirectoryNode

    settings = DirectorySettings(
        url=parse_url(cfg.directory),
        address=address,
        incarnation=incarnation,
        interval_s=cfg.directory_interval_s,
        heartbeat_ttl_s=cfg.directory_heartbeat_ttl_s,
        entry_ttl_s=cfg.directory_entry_ttl_s,
        timeout_s=cfg.directory_timeout_s,
        buckets=cfg.directory_buckets,
        prefix=cfg.directory_prefix,
        breaker_failures=cfg.breaker_failures,
        breaker_reset_s=cfg.breaker_reset_s,
        tls_ca_file=cfg.directory_tls_ca_file,
    )
    return DirectoryNode(settings, shareable)


def _client_tls(cfg: PeerTierConfig, options) -> ClientTls | None:
    """TLS to the peers whenever this daemon's own listener uses it (one trust domain): their CA
    (tls_ca_file, else the daemon's tls_client_ca_file, else the system's) and this daemon's
    certificate, presented to peers that require mutual TLS."""
    if options is None or not options.tls_cert_file:
        return None
    ca = cfg.tls_ca_file or options.tls_client_ca_file
    return ClientTls.from_files(ca, options.tls_key_file, options.tls_cert_file, cfg.tls_server_name)
