# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Following one peer's KV events into the remote-location index.

A peer incarnation is first read whole (the Snapshot stream: every chunk it serves peers from,
and the event seq that reflects), then followed through WatchEvents from the next seq on. When
the connection comes back to the same incarnation, following resumes from the last seq applied;
when that seq is no longer buffered by the peer (OUT_OF_RANGE), or the follower fell too far
behind (RESOURCE_EXHAUSTED: resumed as is), the peer is read whole again into a fresh index
slot. Only events of the tiers the peer serves from are indexed (its RAM and local disk tiers,
not its S3 tier or its own peer tier); tenant namespaces' events never come (no session).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from kvstored.events.bus import EventType
from kvstored.peer.control import ControlChannel
from kvstored.peer.index import PeerIndex, tier_bit
from kvstored.peer.membership import Hello, PeerRecord
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

log = logging.getLogger(__name__)


class PeerRestarted(Exception):
    """The peer answered as another incarnation than its handshake: handshake again."""


class Follower:
    def __init__(
        self,
        channel: ControlChannel,
        record: PeerRecord,
        index: PeerIndex,
        incarnation: int,
        on_retired: Callable[[], None],
        coalesce: bool = True,
    ) -> None:
        self._coalesce = coalesce  # ask for the net changes per interval
        self._channel = channel
        self._record = record
        self._index = index
        self._incarnation = incarnation
        self._on_retired = on_retired  # a slot was retired: its bits want sweeping

    async def run(self) -> None:
        """Until the peer ends the stream (it is stopping); raises when the connection fails."""
        record = self._record
        if record.slot is None:
            await self.resync()
        while True:
            try:
                async for event in self._channel.watch(record.last_seq + 1, record.incarnation, self._coalesce):
                    self._apply(event)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.OUT_OF_RANGE:
                    log.info(
                        "peer %s: events from seq %d are gone from its buffer: reading it whole again",
                        record.address,
                        record.last_seq + 1,
                    )
                    await self.resync()
                elif exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    log.info("peer %s: fell behind its events after seq %d: resuming", record.address, record.last_seq)
                else:
                    raise

    async def resync(self) -> None:
        """Read the peer whole into a new slot (the old one's entries go at once)."""
        record = self._record
        self.retire()
        slot = self._index.add_peer()
        record.slot = slot
        record.counters.resyncs += 1
        last_seq = None
        try:
            async for batch in self._channel.snapshot(self._incarnation):
                if batch.incarnation != record.incarnation:
                    raise PeerRestarted(f"peer {record.address} restarted during its snapshot")
                last_seq = batch.last_seq
                position = record.hello.tier_position(batch.tier) if record.hello else None
                if position is not None and batch.keys:
                    self._index.add(slot, tier_bit(position), batch.namespace_id, batch.keys)
        except BaseException:
            self.retire()  # half a snapshot is not a view of the peer
            raise
        if last_seq is None:
            self.retire()
            raise PeerRestarted(f"peer {record.address} sent an empty snapshot stream")
        record.last_seq = last_seq
        log.debug("peer %s: %d chunks indexed (seq %d)", record.address, self._index.count(slot), last_seq)

    def retire(self) -> None:
        record = self._record
        if record.slot is not None:
            self._index.retire(record.slot)
            record.slot = None
            self._on_retired()

    def _apply(self, event: pb.KvEvent) -> None:
        record = self._record
        if not event.partial:  # (a coalesced interval is resumed from its end, not its middle)
            record.last_seq = event.seq
        record.counters.events += 1
        if record.slot is None or record.hello is None:
            return
        for change in event.changes or (event,):  # coalesced: the interval's changes
            self._change(record.slot, record.hello, change)

    def _change(self, slot: int, hello: Hello, change: pb.KvEvent) -> None:
        position = hello.tier_position(change.tier)
        if position is None:  # a tier it does not serve peers from (s3, its own peer tier)
            return
        if change.type == EventType.STORED:
            self._index.add(slot, tier_bit(position), change.namespace_id, change.keys)
        elif change.type == EventType.REMOVED:
            self._index.remove(slot, tier_bit(position), change.namespace_id, change.keys)
        # CLEARED: the chunks it lists were each a REMOVED event just before
