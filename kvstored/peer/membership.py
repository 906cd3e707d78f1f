# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Who the peers are and how each one is doing: bookkeeping only (no I/O).

Peers come from a static list, from a DNS name (a Kubernetes headless Service: every address
it resolves to is a peer), resolved again every few seconds by the peer tier, and from the fleet
directory (holders it names: fetched from, never followed, forgotten when their heartbeat goes);
this daemon's own
address is skipped (by address when it is listed as such, by incarnation at the handshake when
it is reached through another address, e.g. its pod IP).

Each peer has a state (CONNECTING, UP, DOWN, INCOMPATIBLE, SELF), the facts its handshake told
(incarnation, transports, data ports, serving tiers), its slot in the remote-location index,
counters, and a circuit breaker (kvstored.io.breaker, the one S3 uses): after `failures`
consecutive failed fetches (a failure or a timeout, not a miss) its chunks count as misses for
`reset_s`, then one fetch probes it. So a peer that hangs costs `failures` timeouts, not one per
lookup.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvstored.io.breaker import CircuitBreaker
from kvstored.peer.transport import PeerAddress, TransportKind
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

MAX_PEER_LABELS = 64  # peers with a metrics label of their own; the others are aggregated as "other"
OTHER_LABEL = "other"

Clock = Callable[[], float]


class PeerState(enum.IntEnum):
    CONNECTING = pb.PEER_STATE_CONNECTING
    UP = pb.PEER_STATE_UP
    DOWN = pb.PEER_STATE_DOWN
    INCOMPATIBLE = pb.PEER_STATE_INCOMPATIBLE
    SELF = pb.PEER_STATE_SELF


@dataclass(frozen=True)
class Hello:
    """What a peer's handshake said about it."""

    incarnation: int
    transports: frozenset[TransportKind]
    tcp_port: int
    ucx_port: int
    tiers: tuple[str, ...]  # the tiers it serves peers from, RAM first
    address: str = ""

    def tier_position(self, tier: str) -> int | None:
        try:
            return self.tiers.index(tier)
        except ValueError:
            return None


@dataclass
class PeerCounters:
    received_chunks: int = 0
    received_bytes: int = 0
    missing_chunks: int = 0  # the index said so, the peer did not have it
    corrupt_chunks: int = 0
    failed_chunks: int = 0
    timed_out_chunks: int = 0
    fetches: int = 0  # orders sent
    events: int = 0  # its KV events applied to the index
    resyncs: int = 0  # snapshots taken of it
    refused_by_breaker: int = 0  # reads not tried: the breaker was open


@dataclass(eq=False)
class PeerRecord:
    address: PeerAddress  # its control address (tcp_listen)
    label: str  # its metrics label
    breaker: CircuitBreaker
    static: bool = True  # from the static list (else from DNS or the directory)
    follows: bool = True  # its events are followed into the index (not for holders found in the directory)
    state: PeerState = PeerState.CONNECTING
    detail: str = ""  # why it is down or incompatible
    hello: Hello | None = None
    transport: TransportKind | None = None
    slot: int | None = None  # in the remote-location index, while its events are followed
    last_seq: int = 0  # of its events applied
    counters: PeerCounters = field(default_factory=PeerCounters)

    @property
    def incarnation(self) -> int:
        return self.hello.incarnation if self.hello else 0

    def usable(self) -> bool:
        """Its chunks may be fetched now."""
        return self.state is PeerState.UP and self.transport is not None and self.breaker.would_allow()


def parse_address(text: str) -> PeerAddress:
    host, _, port = text.strip().rpartition(":")
    return PeerAddress(host.strip("[]"), int(port))


class Membership:
    def __init__(
        self,
        static: Sequence[str],
        own: str,
        breaker_failures: int,
        breaker_reset_s: float,
        clock: Clock = time.monotonic,
    ) -> None:
        self._own = parse_address(own) if own else None
        self._breaker = (breaker_failures, breaker_reset_s, clock)
        self.peers: dict[PeerAddress, PeerRecord] = {}
        for text in static:
            address = parse_address(text)
            if address != self._own and address not in self.peers:
                self._add(address, static=True)

    def _add(self, address: PeerAddress, static: bool) -> PeerRecord:
        labelled = sum(1 for r in self.peers.values() if r.label != OTHER_LABEL)
        label = str(address) if labelled < MAX_PEER_LABELS else OTHER_LABEL
        record = PeerRecord(address, label, CircuitBreaker(*self._breaker), static=static)
        self.peers[address] = record
        return record

    def update_dns(self, resolved: Iterable[PeerAddress]) -> tuple[list[PeerRecord], list[PeerRecord]]:
        """The addresses a DNS name gives now: (records added, records removed). Static peers stay
        whatever DNS says."""
        now = {a for a in resolved if a != self._own}
        added = [self._add(a, static=False) for a in sorted(now, key=str) if a not in self.peers]
        gone = [r for a, r in self.peers.items() if not r.static and r.follows and a not in now]
        for record in gone:
            del self.peers[record.address]
        return added, gone

    def add_found(self, address: PeerAddress) -> PeerRecord | None:
        """A holder the directory named: a new record (fetched from, not followed), or None when
        it is this daemon or already a peer."""
        if address == self._own or address in self.peers:
            return None
        record = self._add(address, static=False)
        record.follows = False
        return record

    def drop_found(self, address: PeerAddress) -> PeerRecord | None:
        """A holder the directory no longer vouches for (its heartbeat expired)."""
        record = self.peers.get(address)
        if record is None or record.follows:
            return None
        del self.peers[address]
        return record

    def by_slot(self, slot: int) -> PeerRecord | None:
        for record in self.peers.values():
            if record.slot == slot:
                return record
        return None

    def records(self) -> list[PeerRecord]:
        return list(self.peers.values())
