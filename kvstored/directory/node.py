# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""This node's side of the fleet directory: the I/O (one Redis Cluster client).

- The write loop, once per interval: one pipelined batch (redis-py's cluster pipeline sends each
  shard its commands at once) with the heartbeat, the net changes (HSET + PEXPIRE for a chunk
  gained, HDEL for one dropped), a slice of the refresh pass and the stale fields readers found.
- lookup(): one pipelined HGETALL per chunk (at most `buckets` slots), then, only for holders
  not checked within an interval, one GET of their heartbeats; all within timeout_s.

Every call goes through one circuit breaker (kvstored.io.breaker): the directory slow or down
makes lookups misses at once after breaker_failures failures, and writes wait; the probe after
breaker_reset_s connects afresh (a new client learns the cluster's topology again, e.g. after a
failover), and its success starts an urgent refresh pass (the directory may have lost entries).
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
from kvstored.directory.config import DirectorySettings
from kvstored.directory.keys import PUBLISHED_KINDS, Holder, KeyLayout, field, heartbeat_value, parse_heartbeat
from kvstored.directory.lookups import HeartbeatCache, judge, named_addresses
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
    connects: int = 0


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
        self._client: Any = None  # redis.asyncio.cluster.RedisCluster, once connected
        self._connect_lock = asyncio.Lock()
        self._errors: tuple[type[BaseException], ...] = (OSError, TimeoutError)
        self._stale: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()
        self._task: asyncio.Task | None = None
        self._field_of = {kind: field(settings.address, settings.incarnation, kind) for kind in PUBLISHED_KINDS}
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
            hb = self.layout.heartbeat_key(self.settings.address)
            await self._call(permit, lambda p: p.delete(hb), self.settings.timeout_s * 5)
        await self._drop_client()

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
        keys = [self.layout.chunk_key(chunk) for chunk in chunks]
        own = self.settings.address
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                replies = await self._pipeline(lambda p: [p.hgetall(key) for key in keys])
                now = self._clock()
                due = self.heartbeats.due(named_addresses(replies, own), now)
                if due:
                    hb_keys = [self.layout.heartbeat_key(a) for a in due]
                    values = await self._pipeline(lambda p: [p.get(key) for key in hb_keys])
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
        hb_key, hb = self.layout.heartbeat_key(s.address), heartbeat_value(s.incarnation)
        ttl_ms, hb_ms = int(s.entry_ttl_s * 1000), int(s.heartbeat_ttl_s * 1000)
        fields = self._field_of
        layout = self.layout

        def fill(p) -> None:
            p.set(hb_key, hb, px=hb_ms)
            for change in changes:
                key = layout.chunk_key(change.chunk)
                if change.present:
                    p.hset(key, fields[change.kind], b"1")
                    p.pexpire(key, ttl_ms)
                else:
                    p.hdel(key, fields[change.kind])
            for kind, chunk in refreshed:
                key = layout.chunk_key(chunk)
                p.hset(key, fields[kind], b"1")
                p.pexpire(key, ttl_ms)
            for key, raw in stale:
                p.hdel(key, raw)

        ok = await self._call(permit, fill, s.write_timeout_s)
        c.write_batches += 1
        if not ok:
            c.write_errors += 1
            self.changes.give_back(changes, since)
            self.refresh.restart_urgently()  # (what this slice held is written again)
            return False
        c.write_commands += 1 + sum(2 if ch.present else 1 for ch in changes) + 2 * len(refreshed) + len(stale)
        c.refreshed += len(refreshed)
        c.stale_deleted += len(stale)
        c.dropped_changes = self.changes.dropped
        for item in stale:
            self._stale.pop(item, None)
        self.changes.written(self._clock())
        return True

    # -- the client -----------------------------------------------------------------------

    async def _call(self, permit: Permit, fill: Callable[[Any], Any], timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await self._pipeline(fill)
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

    async def _pipeline(self, fill: Callable[[Any], Any]) -> list:
        client = await self._connected()
        pipe = client.pipeline(transaction=False)
        fill(pipe)
        return await pipe.execute(raise_on_error=True)

    async def _connected(self) -> Any:
        async with self._connect_lock:
            if self._client is None:
                self._client = await self._connect()
            return self._client

    async def _connect(self) -> Any:
        # redis-py loads only here: a daemon without a directory never imports it
        from redis.asyncio.cluster import ClusterNode, RedisCluster
        from redis.exceptions import RedisClusterException, RedisError

        self._errors = (RedisError, RedisClusterException, OSError, TimeoutError)
        s = self.settings
        url = s.url
        tls: dict[str, Any] = {}
        if url.tls:
            tls = {"ssl": True, "ssl_ca_certs": str(s.tls_ca_file) if s.tls_ca_file else None}
        client = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in url.nodes],
            username=url.username,
            password=url.password,
            socket_timeout=max(s.timeout_s, s.write_timeout_s),
            socket_connect_timeout=s.timeout_s * 5,
            require_full_coverage=False,  # a shard without a master fails its own keys only
            **tls,
        )
        try:
            await client.initialize()
        except BaseException:
            await client.aclose()
            raise
        self.counters.connects += 1
        return client

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                async with asyncio.timeout(1.0):  # (a frozen node must not hold the caller)
                    await client.aclose()
            except Exception as exc:  # closing must not fail the caller
                log.debug("directory: closing the client: %r", exc)

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
            await self._drop_client()  # the probe connects afresh (and learns the topology anew)

    def shards(self) -> list[str]:
        """HOST:PORT of the masters the client knows now ([] while not connected)."""
        client = self._client
        return sorted(node.name for node in client.get_primaries()) if client is not None else []

    def lag_s(self) -> float:
        return self.changes.lag(self._clock())


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
