# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The peer data plane's contract: how chunk bytes move from a serving daemon's pool pages into a
fetching daemon's pool pages, over TCP or UCX.

A transfer of one or more chunks (a batch) is driven by the fetcher:
1. it takes a connection to the peer (`PeerLink`: a pool of TCP connections, or one UCX endpoint),
   known to the server by a `link_id` the server gave it when it accepted it;
2. it prepares to receive into its slots (UCX: posts one tagged receive per piece of each slot),
   then hands the caller's `ask` a `SendOrder` naming the link and one `Transfer` per chunk.
   The control plane (gRPC in the daemon) carries it to the serving daemon, which leases the
   chunks and calls `PeerServer.send` with their pages (None for a chunk it no longer holds),
   then answers with the `Receipt`s that call returned (found or not, length, xxh3-64 of the
   payload: the chunk format's checksum, kvstored.chunks.chunkfile);
3. the bytes land straight in the slots (no copy, never through protobuf) and each chunk is
   verified before it is reported RECEIVED: over TCP against the frame that carries it (HEAD,
   payload, SUM: the receipt travels in-band, so `ask` may return None), over UCX against the
   receipts `ask` returned (the server hashes its pages after UCX read them, while cached).

A batch costs one control round trip and, over TCP, streams its frames back to back on one
connection, moved by a thread on each side (a bulk batch goes as several orders, one per stream:
kvstored/peer/fetcher.py). What a GiB costs each side in CPU, and where it goes, is measured in
docs/cluster.md (across a real link); on a busy machine throughput follows CPU per byte.

Neither side raises for a failed transfer: `receive_batch` and `send` return results whose
outcomes say what happened, within the caller's timeout. The views handed to them belong to the
transport until the call returns; if a failed transfer's operations have not stopped by then
(bounded by `settle_timeout_s`), the results carry a `Quarantine` (kvstored.peer.quarantine).
"""

from __future__ import annotations

import abc
import enum
import itertools
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from kvstored.choices import Choice
from kvstored.peer.quarantine import Quarantine, Quarantines


class TransportKind(enum.Enum):
    TCP = "tcp"
    UCX = "ucx"


class DataThreads(Choice):
    """A peer tier's `data_threads` setting: whether TCP chunk bytes move in threads."""

    AUTO = "auto"  # on when the node has DATA_THREADS_CPUS CPUs or more
    ON = "on"
    OFF = "off"

    def enabled(self, cpus: int | None) -> bool:
        if self is DataThreads.AUTO:
            return (cpus or 1) >= DATA_THREADS_CPUS
        return self is DataThreads.ON


# Below this many CPUs a second stream's copies find no idle CPU: the threads' hand-offs and
# wake-ups then only cost CPU (2 vCPUs running both nodes: +0.1 CPU s/GiB, -20% GiB/s on loopback).
DATA_THREADS_CPUS = 8


class TransportPreference(Choice):
    """A peer tier's `transport` setting."""

    AUTO = "auto"  # UCX when both sides have it, else TCP
    TCP = "tcp"
    UCX = "ucx"


@dataclass(frozen=True, slots=True)
class PeerAddress:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one chunk lands: the page runs of a pool slot (as RamTier.page_views gives them; only
    the first `size` bytes across them are the payload)."""

    views: Sequence[memoryview]
    size: int


@dataclass(frozen=True, slots=True)
class Source:
    """One chunk to send: its page runs, its size and, if the caller knows it, its checksum
    (otherwise the transport computes it while sending)."""

    views: Sequence[memoryview]
    size: int
    checksum: int | None = None


@dataclass(frozen=True, slots=True)
class Transfer:
    """One chunk of an order."""

    transfer_id: int  # names it in its TCP frame and in its UCX tags
    size: int  # payload bytes the fetcher expects
    segments: tuple[int, ...]  # lengths of the fetcher's receive pieces (UCX: one message each)


@dataclass(frozen=True, slots=True)
class SendOrder:
    """What the fetcher asks the serving daemon to do, carried there by the control plane."""

    transport: TransportKind
    link_id: int  # the server's name for the fetcher's connection (TCP) or endpoint (UCX)
    transfers: tuple[Transfer, ...]  # sent in this order


@dataclass(frozen=True, slots=True)
class Receipt:
    """The server's account of one transfer, returned by `send` for the control plane's answer."""

    transfer_id: int
    found: bool  # False: the chunk is not here
    length: int
    checksum: int  # xxh3-64 of the payload sent


Ask = Callable[[SendOrder], Awaitable["Sequence[Receipt] | None"]]
"""The caller's control call: deliver the order and return the server's receipts once it has acted
on it (None will do over TCP); raise if that failed. It is cancelled when the transfer ends
without it, so it must honour cancellation."""


class ReceiveOutcome(enum.Enum):
    RECEIVED = "received"  # verified bytes are in the views
    MISSING = "missing"  # the server does not hold the chunk
    CORRUPT = "corrupt"  # bytes arrived but not the right ones (checksum, length, transfer id)
    FAILED = "failed"  # connection refused or lost, control error, protocol error, link closed
    TIMED_OUT = "timed_out"  # the caller's timeout passed


class SendOutcome(enum.Enum):
    SENT = "sent"  # every transfer answered: the found ones sent, the others told so
    NO_LINK = "no_link"  # the order names a link this server does not have (closed, or another incarnation's)
    INVALID = "invalid"  # the order does not fit the chunks (count, sizes, transport): nothing sent
    FAILED = "failed"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True, slots=True)
class ReceiveResult:
    outcome: ReceiveOutcome
    detail: str = ""
    quarantine: Quarantine | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is ReceiveOutcome.RECEIVED


@dataclass(frozen=True, slots=True)
class SendResult:
    outcome: SendOutcome
    detail: str = ""
    receipts: tuple[Receipt, ...] = ()  # SENT: one per transfer, for the control plane's answer
    quarantine: Quarantine | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is SendOutcome.SENT


@dataclass(frozen=True)
class UcxConfig:
    """UCX settings (UCX_* names without the prefix). The defaults are the ones that work on plain
    Ethernet/loopback (GUIDE: tcp transport, 2 MiB segments, host bounce buffers)."""

    tls: str = "tcp"  # UCX_TLS; peer-failure detection needs a network transport, not shared memory
    net_devices: str = "all"  # UCX_NET_DEVICES, e.g. "eth0" or "mlx5_0:1"
    tcp_seg_size: str = "2m"  # UCX_TCP_TX_SEG_SIZE and UCX_TCP_RX_SEG_SIZE (2x faster than the default)
    extra: Mapping[str, str] = field(default_factory=dict)  # anything else, e.g. {"RNDV_THRESH": "64k"}

    def options(self) -> dict[str, str]:
        opts = {
            "TLS": self.tls,
            "NET_DEVICES": self.net_devices,
            "TCP_TX_SEG_SIZE": self.tcp_seg_size,
            "TCP_RX_SEG_SIZE": self.tcp_seg_size,
            "RNDV_FRAG_MEM_TYPE": "host",  # ucxx defaults it to cuda: wrong on hosts without GPUs
        }
        opts.update(self.extra)
        return opts


@dataclass(frozen=True)
class TransportConfig:
    connect_timeout_s: float = 5.0  # connect + handshake, also bounded by each transfer's timeout
    settle_timeout_s: float = 5.0  # how long a failed transfer waits for its operations to stop
    tcp_connections: int = 8  # per peer: at most this many batches in flight to it over TCP
    # TCP: move chunk bytes in threads (a pool of tcp_connections threads per link and per
    # server), not on the event loop: several connections' copies on several CPUs
    threads: bool = False
    ucx: UcxConfig = field(default_factory=UcxConfig)

    def __post_init__(self) -> None:
        if self.connect_timeout_s <= 0 or self.settle_timeout_s <= 0:
            raise ValueError("transport timeouts must be > 0")
        if self.tcp_connections < 1:
            raise ValueError("tcp_connections must be >= 1")


@dataclass
class LinkCounters:
    """Per peer link (fetching side): chunks by outcome, bytes received, connections made."""

    transfers: int = 0
    received: int = 0
    received_bytes: int = 0
    missing: int = 0
    corrupt: int = 0
    failed: int = 0
    timed_out: int = 0
    connects: int = 0
    connect_failures: int = 0
    quarantined: int = 0

    def count(self, result: ReceiveResult, size: int) -> None:
        self.transfers += 1
        if result.outcome is ReceiveOutcome.RECEIVED:
            self.received += 1
            self.received_bytes += size
        else:
            attr = result.outcome.value
            setattr(self, attr, getattr(self, attr) + 1)
        if result.quarantine is not None:
            self.quarantined += 1


@dataclass
class ServerCounters:
    """Serving side: chunks sent or refused, orders by failure, copies, links accepted."""

    sent: int = 0
    sent_bytes: int = 0
    refused: int = 0  # chunks answered "not here"
    no_link: int = 0  # orders
    invalid: int = 0
    failed: int = 0
    timed_out: int = 0
    bounced_bytes: int = 0  # UCX: pieces that straddled two of our page runs went through a copy
    links_accepted: int = 0
    quarantined: int = 0

    def count(self, result: SendResult) -> None:
        if result.outcome is SendOutcome.SENT:
            for receipt in result.receipts:
                if receipt.found:
                    self.sent += 1
                    self.sent_bytes += receipt.length
                else:
                    self.refused += 1
        else:
            attr = result.outcome.value
            setattr(self, attr, getattr(self, attr) + 1)
        if result.quarantine is not None:
            self.quarantined += 1


class PeerLink(abc.ABC):
    """The fetching side's data path to one peer over one transport. Connects lazily and again
    after failures by itself (a broken connection fails only the transfers that were on it)."""

    kind: ClassVar[TransportKind]

    def __init__(self, address: PeerAddress, config: TransportConfig) -> None:
        self.address = address
        self.config = config
        self.counters = LinkCounters()
        self.quarantines = Quarantines()

    async def start(self) -> None:
        """Optional warm-up (UCX: start the runtime); links also start on their first receive."""

    async def receive_batch(self, slots: Sequence[Slot], ask: Ask, timeout_s: float) -> list[ReceiveResult]:
        """Receive verified chunks into `slots` (one result each, in order), asking the server
        through `ask` once for all of them. Returns within `timeout_s` (plus, after a failure, the
        time for its operations to stop: at most `settle_timeout_s`)."""
        results = await self._receive(slots, ask, timeout_s)
        for result, slot in zip(results, slots):
            self.counters.count(result, slot.size)
        return results

    async def receive(self, views: Sequence[memoryview], size: int, ask: Ask, timeout_s: float) -> ReceiveResult:
        """receive_batch of one chunk."""
        return (await self.receive_batch([Slot(views, size)], ask, timeout_s))[0]

    @abc.abstractmethod
    async def _receive(self, slots: Sequence[Slot], ask: Ask, timeout_s: float) -> list[ReceiveResult]: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Fail transfers in flight, close connections, wait (bounded) for quarantines."""

    @property
    def connections(self) -> int:
        """Open connections (TCP) or endpoints (UCX) to the peer."""
        return 0


class PeerServer(abc.ABC):
    """The serving side: accepts fetchers' connections and sends chunks on them when ordered."""

    kind: ClassVar[TransportKind]

    def __init__(self, host: str, port: int, config: TransportConfig) -> None:
        self.host = host
        self.port = port
        self.config = config
        self.counters = ServerCounters()
        self.quarantines = Quarantines()

    @abc.abstractmethod
    async def start(self) -> PeerAddress:
        """Listen; returns the bound address (port 0 picks one). Raises kvstored.errors.ListenError
        (address unusable) or TransportUnavailable (UCX cannot start)."""

    async def send(self, order: SendOrder, sources: Sequence[Source | None], timeout_s: float) -> SendResult:
        """Answer every transfer of `order`: send its chunk from `sources` (same order), or tell the
        fetcher it is not here (None). The sources' pages stay pinned by the caller until this
        returns (or its quarantine settles)."""
        invalid = self._check(order, sources)
        result = SendResult(SendOutcome.INVALID, invalid) if invalid else await self._send(order, sources, timeout_s)
        self.counters.count(result)
        return result

    async def refuse(self, order: SendOrder, timeout_s: float) -> SendResult:
        """Tell the fetcher that none of the order's chunks is here."""
        return await self.send(order, [None] * len(order.transfers), timeout_s)

    def _check(self, order: SendOrder, sources: Sequence[Source | None]) -> str:
        if order.transport is not self.kind:
            return f"order for the {order.transport.value} transport sent to the {self.kind.value} server"
        if len(sources) != len(order.transfers):
            return f"{len(sources)} chunks for an order of {len(order.transfers)}"
        for transfer, source in zip(order.transfers, sources):
            if source is not None and source.size != transfer.size:
                return f"the fetcher expects {transfer.size} bytes, the chunk has {source.size}"
            if sum(transfer.segments) != transfer.size:
                return f"segments of {sum(transfer.segments)} bytes for a chunk of {transfer.size}"
        return ""

    @abc.abstractmethod
    async def _send(self, order: SendOrder, sources: Sequence[Source | None], timeout_s: float) -> SendResult: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @property
    def links(self) -> int:
        """Fetchers' connections (TCP) or endpoints (UCX) currently open."""
        return 0


TRANSFER_ID_BITS = 48  # UCX tags are (transfer id << 16 | piece)
_transfer_ids = itertools.count(secrets.randbits(TRANSFER_ID_BITS - 1))


def next_transfer_id() -> int:
    """Process-wide unique: UCX matches tags on the whole worker, whichever peer sends them (a random
    start keeps a restarted process from meeting its previous incarnation's ids)."""
    return next(_transfer_ids) & ((1 << TRANSFER_ID_BITS) - 1)


def failed_all(items: Sequence[object], outcome: ReceiveOutcome, detail: str) -> list[ReceiveResult]:
    """The same failure for every chunk of a batch."""
    return [ReceiveResult(outcome, detail) for _ in items]
