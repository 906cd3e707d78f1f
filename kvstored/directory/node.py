# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""This node's side of the fleet directory: the I/O, through two lean cluster clients
(cluster.py: raw RESP, one connection per master each), one for the writes and one for the
lookups, so that a lookup never waits behind a write batch on a connection.

- The write loop, once per interval: one batch (commands.py encodes it once; each master gets
  its share in one write) with the heartbeat, the net changes (HSET + PEXPIRE for a chunk
  gained, HDEL for one dropped), a slice of the refresh pass and the stale fields readers found.
- lookup(): one HGETALL per chunk (at most `buckets` slots), then, only for holders not checked
  within an interval, one GET of their heartbeats; all within timeout_s.

Every call goes through one circuit breaker (kvstored.io.breaker): the directory slow or down
makes lookups misses at once after breaker_failures failures, and writes wait; the probe after
breaker_reset_s starts from the seed nodes again (the clients learn the cluster's slots anew,
e.g. after a failover), and its success starts an urgent refresh pass (the directory may have
lost entries). Within a call, the clients follow MOVED and ASK and retry a lost master after
refreshing their slot map, as long as the call's deadline allows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstored.chunks.ids import ChunkId
from kvstored.directory.changes import ChangeLog, Holding, RefreshPass
from kvstored.directory.cluster import ClientCounters, ClusterClient
from kvstored.directory.commands import Commands
from kvstored.directory.config import DirectorySettings
from kvstored.directory.connection import RedisError
from kvstored.directory.keys import Holder, KeyLayout, field, parse_heartbeat
from kvstored.directory.lookups import HeartbeatCache, judge, named_addresses
from kvstored.directory.resp import Batch
from kvstored.events.bus import KvEvent
from kvstored.io.breaker import BreakerState, CircuitBreaker, Permit

log = logging.getLogger(__name__)

MAX_STALE = 100_000  # stale fields remembered for deletion at most
Clock = Callable[[], float]


@dataclass
class DirectoryCounters:
    lookups: int = 0  # lookups asked of the directory
    lookup_chunks: int = 0
    hits: int = 0  # chunks it named a live holder of
    errors: int = 0  # lookups that failed (unreachable, an error reply)
    timeouts: int = 0  # lookups that ran past timeout_s
    refused: int = 0  # lookups not tried: the breaker was open
    write_batches: int = 0
    write_commands: int = 0
    write_errors: int = 0
    refreshed: int = 0  # chunks re-written by the refresh pass
    dropped_changes: int = 0  # past max_pending while the directory was away (a refresh covers them)
    stale_deleted: int = 0  # fields of dead or restarted holders, or found missing at fetch


class DirectoryNode:
    def __init__(
        self,
        settings: DirectorySettings,
        shareable: Callable[[str], bool],
        clock: Clock = time.monotonic,
    ) -> None:
        self.settings = settings
        self.layout = KeyLayout(settings.prefix, settings.buckets)
        self.changes = ChangeLog(settings.max_pending, shareable)
        self.refresh = RefreshPass(settings.entry_ttl_s / 2, settings.interval_s, settings.batch_commands)
        self.heartbeats = HeartbeatCache(settings.interval_s)
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_reset_s, clock)
        self.counters = DirectoryCounters()
        self.holdings: Callable[[], list[Holding]] = list  # what this node holds now (set by the daemon)
        self.on_dead: Callable[[str], None] | None = None  # a holder whose heartbeat is gone
        self._clock = clock
        self.commands = Commands(
            self.layout, settings.address, settings.incarnation, settings.entry_ttl_s, settings.heartbeat_ttl_s
        )
        self._writer = self._client()
        self._reader = self._client()
        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError)
        self._stale: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()
        self._task: asyncio.Task | None = None
        self.last_error = ""

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the write loop; the directory being down now is no reason not to serve."""
        self._task = asyncio.get_running_loop().create_task(self._write_forever(), name="directory-writer")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("directory: the write loop stopped: %r", task.exception())

    async def close(self) -> None:
        """Stop writing; delete this node's heartbeat (its entries stop counting at once)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
            self._task = None
        permit = self.breaker.allow()
        if permit is not None:
            batch = Batch()
            self.commands.delete_heartbeat(batch)
            await self._call(self._writer, permit, batch, self.settings.timeout_s * 5)
        self._drop_clients()

    # -- events ---------------------------------------------------------------------------

    def on_event(self, event: KvEvent) -> None:
        """An event bus listener: never blocks, never fails."""
        self.changes.on_event(event, self._clock())

    # -- lookups --------------------------------------------------------------------------

    async def lookup(self, chunks: Sequence[ChunkId]) -> list[list[Holder]]:
        """Per chunk, the live holders the directory names (RAM holders first); [] for each when
        the directory is slow, down or its breaker open: within timeout_s in every case."""
        out: list[list[Holder]] = [[] for _ in chunks]
        if not chunks:
            return out
        c = self.counters
        permit = self.breaker.allow()
        if permit is None:
            c.refused += 1
            return out
        c.lookups += 1
        c.lookup_chunks += len(chunks)
        keys, batch = self.commands.holders(chunks)
        own = self.settings.address
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                replies = [_as_fields(r) for r in await self._reader.execute(batch)]
                now = self._clock()
                due = self.heartbeats.due(named_addresses(replies, own), now)
                if due:
                    values = await self._reader.execute(self.commands.heartbeats(due))
                    for address, value in zip(due, values):
                        incarnation = parse_heartbeat(value)
                        self.heartbeats.update(address, incarnation, now)
                        if incarnation is None and self.on_dead is not None:
                            self.on_dead(address)
        except TimeoutError:
            c.timeouts += 1
            await self._failed(permit, f"a lookup took over {self.settings.timeout_s} s")
            return out
        except asyncio.CancelledError:
            self.breaker.abandon(permit)
            raise
        except self._errors as exc:
            c.errors += 1
            await self._failed(permit, _describe(exc))
            return out
        self._succeeded(permit)
        for i, (key, fields) in enumerate(zip(keys, replies)):
            verdict = judge(fields, own, self.heartbeats)
            out[i] = verdict.live
            for _, raw in verdict.stale:
                self._forget_field(key, raw)
        c.hits += sum(1 for holders in out if holders)
        return out

    def forget(self, chunk: ChunkId, holder: Holder) -> None:
        """The holder said it does not have the chunk (at fetch): its field goes with the next write."""
        self._forget_field(self.layout.chunk_key(chunk), field(holder.address, holder.incarnation, holder.kind))

    def _forget_field(self, key: bytes, raw: bytes) -> None:
        self._stale[(key, raw)] = None
        while len(self._stale) > MAX_STALE:
            self._stale.popitem(last=False)

    # -- writes ---------------------------------------------------------------------------

    async def _write_forever(self) -> None:
        interval = self.settings.interval_s
        while True:
            started = self._clock()
            await self.write_once()
            await asyncio.sleep(max(0.0, interval - (self._clock() - started)))

    async def write_once(self) -> bool:
        """One interval's batch; False when it was not written (it is kept for the next one)."""
        permit = self.breaker.allow()
        if permit is None:
            return False
        s, c = self.settings, self.counters
        if self.changes.resync_wanted:
            self.changes.resync_wanted = False
            self.refresh.restart_urgently()
        since = self._clock()
        changes = self.changes.take(s.batch_commands // 2)
        refreshed = self.refresh.next_slice(self.holdings)
        stale = list(self._stale)[: s.batch_commands]
        # encoded once: a retry within the call (MOVED, ASK, a failover) sends these frames again
        cmd, batch = self.commands, Batch()
        cmd.heartbeat(batch)
        for change in changes:
            if change.present:
                cmd.gained(batch, change.kind, change.chunk)
            else:
                cmd.dropped(batch, change.kind, change.chunk)
        for kind, chunk in refreshed:
            cmd.gained(batch, kind, chunk)
        for key, raw in stale:
            cmd.delete_field(batch, key, raw)
        ok = await self._call(self._writer, permit, batch, s.write_timeout_s)
        c.write_batches += 1
        if not ok:
            c.write_errors += 1
            self.changes.give_back(changes, since)
            self.refresh.restart_urgently()  # (what this slice held is written again)
            return False
        c.write_commands += batch.commands()
        c.refreshed += len(refreshed)
        c.stale_deleted += len(stale)
        c.dropped_changes = self.changes.dropped
        for item in stale:
            self._stale.pop(item, None)
        self.changes.written(self._clock())
        return True

    # -- the clients ----------------------------------------------------------------------

    def _client(self) -> ClusterClient:
        s, url = self.settings, self.settings.url
        return ClusterClient(
            url.nodes,
            url.username,
            url.password,
            tls=url.tls,
            tls_ca_file=str(s.tls_ca_file) if s.tls_ca_file else None,
            connect_timeout_s=s.timeout_s * 5,
        )

    async def _call(self, client: ClusterClient, permit: Permit, batch: Batch, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await client.execute(batch)
        except TimeoutError:
            await self._failed(permit, f"a write took over {timeout_s} s")
            return False
        except asyncio.CancelledError:
            self.breaker.abandon(permit)
            raise
        except self._errors as exc:
            await self._failed(permit, _describe(exc))
            return False
        self._succeeded(permit)
        return True

    def cluster_counters(self) -> ClientCounters:
        """The writer's and the reader's cluster clients together: connections, slot map reads,
        MOVED and ASK followed."""
        w, r = vars(self._writer.counters), vars(self._reader.counters)
        return ClientCounters(**{name: w[name] + r[name] for name in w})

    def _drop_clients(self) -> None:
        """Both clients' connections dropped at once (abort: a frozen node cannot hold us) and
        their slot maps forgotten: the next call starts from the seed nodes."""
        for client in (self._writer, self._reader):
            client.close()

    def _succeeded(self, permit: Permit) -> None:
        was_open = self.breaker.state is not BreakerState.CLOSED
        self.breaker.record(permit, True)
        if was_open and self.breaker.state is BreakerState.CLOSED:
            log.info("directory %s is reachable again: re-writing what this node holds", self.settings.url.redacted())
            self.last_error = ""
            self.refresh.restart_urgently()

    async def _failed(self, permit: Permit, why: str) -> None:
        was_closed = self.breaker.state is BreakerState.CLOSED
        self.breaker.record(permit, False)
        self.last_error = why
        # (only the verdict that opened the breaker, or a failed probe, drops the client: a late
        # failure of a call admitted earlier must not close the client a probe is using)
        if self.breaker.state is not BreakerState.CLOSED and (was_closed or permit.probe):
            if was_closed:
                log.warning(
                    "directory %s unreachable (%s): lookups are misses, writes wait, probing every %.1f s",
                    self.settings.url.redacted(),
                    why,
                    self.settings.breaker_reset_s,
                )
            self._drop_clients()  # the probe connects afresh (and learns the topology anew)

    def shards(self) -> list[str]:
        """HOST:PORT of the masters the clients know now ([] while not connected)."""
        masters = self._writer.masters() or self._reader.masters()
        return [f"{host}:{port}" for host, port in masters]

    def lag_s(self) -> float:
        return self.changes.lag(self._clock())


def _as_fields(reply: Any) -> dict[bytes, bytes]:
    """HGETALL's flat [field, value, ...] as a mapping; none where the key holds another type
    (WRONGTYPE: another client's value under our key is a miss for that chunk alone)."""
    return dict(zip(reply[::2], reply[1::2])) if isinstance(reply, list) else {}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
