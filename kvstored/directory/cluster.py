# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A lean Redis Cluster client for the directory's batches (I/O): raw RESP, one connection per
master, each master's frames of a batch sent in one write.

execute(batch) groups the batch's frames by the master that owns their slot (its slot map, from
CLUSTER SLOTS), writes every master's share at once, then collects the replies. Within the
caller's deadline (the caller's asyncio.timeout bounds every step) it follows what the cluster
says: MOVED (the slot's new owner, learnt at once, the map refreshed before the next round), ASK
(that frame once to the named node after ASKING: a slot being migrated), TRYAGAIN, CLUSTERDOWN,
LOADING, READONLY (a pause, the map refreshed) and connection errors (the node marked suspect,
the map refreshed from another node); frames are re-sent as encoded, in their order. Every
command the directory sends is idempotent (HSET, PEXPIRE, HDEL, SET, GET, HGETALL, DEL), so a
frame whose reply was lost is simply sent again. A caller whose deadline passes with replies
outstanding drops the connections they were on (a frozen node holds no buffers of ours).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import hiredis

from kvstored.directory.connection import AuthFailed, Connection, ConnectionLost, RedisError, connect, tls_context
from kvstored.directory.resp import Batch, Verdict, classify, encode
from kvstored.directory.resp import asking as with_asking
from kvstored.directory.slots import Address, SlotMap

log = logging.getLogger(__name__)

MAX_ROUNDS = 64  # sends of one batch (the first and the retries), at most: ~20 s of pauses, past
# any failover; the caller's deadline (the directory's: 2 s a write, timeout_s a lookup) comes first
PAUSE_S = 0.01  # before a retry after a transient error or a lost node, doubling per such round ...
MAX_PAUSE_S = 0.5  # ... up to this
SUSPECT_S = 10.0  # a node that failed is asked for the slot map last, for this long
CLUSTER_SLOTS = encode(b"CLUSTER", b"SLOTS")


@dataclass
class ClientCounters:
    connects: int = 0  # connections opened
    refreshes: int = 0  # slot maps read (CLUSTER SLOTS)
    moved: int = 0  # MOVED replies followed
    asked: int = 0  # ASK replies followed
    retried: int = 0  # frames sent again (redirected, transient errors, lost connections)


class ClusterClient:
    def __init__(
        self,
        seeds: Sequence[Address],
        username: str | None = None,
        password: str | None = None,
        tls: bool = False,
        tls_ca_file: str | None = None,
        connect_timeout_s: float = 1.0,
    ) -> None:
        self.seeds = list(seeds)
        self._username, self._password = username, password
        self._tls, self._tls_ca_file = tls, tls_ca_file
        self._tls_context: ssl.SSLContext | None = None  # (made at the first connection: a bad CA
        # file is then the directory's error, behind the breaker, not a daemon that fails to start)
        self.connect_timeout_s = connect_timeout_s
        self.map: SlotMap | None = None
        self._stale = True  # the map must be read before the next send
        self._conns: dict[Address, Connection] = {}
        self._suspect: dict[Address, float] = {}
        self._refresh_lock = asyncio.Lock()
        self.counters = ClientCounters()

    # -- calls ----------------------------------------------------------------------------

    async def execute(self, batch: Batch) -> list[Any]:
        """Each frame's replies (one reply, or a list for a frame of several commands), in the
        batch's order; RedisError for an error reply the cluster does not redirect or clear, when
        no node gives a slot map, or when the rounds run out. The caller bounds the time."""
        n = len(batch)
        out: list[Any] = [None] * n
        pending = list(range(n))
        asking: dict[int, Address] = {}
        pauses = 0
        for round_ in range(MAX_ROUNDS):
            if round_:
                self.counters.retried += len(pending)
            if self._stale or self.map is None:
                await self.refresh()
            owners = self._route(pending, batch.slots, asking)
            retry: list[int] = []
            pause = False
            refused: RedisError | None = None
            sent = await self._send(owners, batch, asking)
            try:
                for address, indices, conn, request in sent:
                    try:
                        replies = await request if request is not None else None
                    except ConnectionLost as exc:
                        replies = None
                        log.debug("directory: %s", exc)
                    if replies is None:  # (lost, or never connected)
                        self._lost(address, conn)
                        for i in indices:  # (an ASK target lost: the slot's owner is asked again)
                            asking.pop(i, None)
                        retry += indices
                        pause = True
                        continue
                    try:
                        pause |= self._collect(address, indices, replies, batch, asking, out, retry)
                    except RedisError as exc:  # (raised once every master's replies are read:
                        refused = refused or exc  # their connections stay in step)
            except BaseException:
                # the deadline (or an error) with replies outstanding: those connections are in
                # an unknown state, and a frozen node must not keep our bytes (the request awaited
                # when the deadline came is done too: cancelled)
                for address, _, conn, request in sent:
                    if request is not None and (not request.done() or request.cancelled()):
                        self._lost(address, conn)
                raise
            if refused is not None:
                raise refused
            if not retry:
                return out
            pending = sorted(retry)
            if pause:
                await asyncio.sleep(min(MAX_PAUSE_S, PAUSE_S * 2**pauses))
                pauses += 1
        raise RedisError(f"the cluster did not take a batch in {MAX_ROUNDS} rounds (redirected or unreachable)")

    def _route(self, pending: list[int], slots: list[int], asking: dict[int, Address]) -> dict[Address, list[int]]:
        assert self.map is not None
        owner = self.map.owner
        groups: dict[Address, list[int]] = {}
        for i in pending:
            address = asking.get(i) or owner(slots[i])
            if address is None:
                raise RedisError(f"slot {slots[i]} has no master (the cluster lost a shard)")
            group = groups.get(address)
            if group is None:
                groups[address] = [i]
            else:
                group.append(i)
        return groups

    async def _send(
        self, owners: dict[Address, list[int]], batch: Batch, asking: dict[int, Address]
    ) -> list[tuple[Address, list[int], Connection | None, asyncio.Future[list[Any]] | None]]:
        """Every master's share written at once; a master not reachable gets None (retried)."""
        frames, counts = batch.frames, batch.replies
        missing = [a for a in owners if a not in self._conns or not self._conns[a].usable]
        if missing:
            connected = await asyncio.gather(*(self._connection(a) for a in missing), return_exceptions=True)
            for result in connected:
                if isinstance(result, AuthFailed):
                    raise result  # (refused credentials do not get better by retrying)
        sent: list[tuple[Address, list[int], Connection | None, asyncio.Future[list[Any]] | None]] = []
        for address, indices in owners.items():
            conn = self._conns.get(address)
            if conn is None or not conn.usable:
                sent.append((address, indices, conn, None))
                continue
            if asking:
                parts = [with_asking(frames[i]) if i in asking else frames[i] for i in indices]
                count = sum(counts[i] * (2 if i in asking else 1) for i in indices)
            else:
                parts = [frames[i] for i in indices]
                count = sum(counts[i] for i in indices)
            try:
                sent.append((address, indices, conn, conn.send(b"".join(parts), count)))
            except ConnectionLost:
                sent.append((address, indices, conn, None))
        return sent

    def _collect(
        self,
        address: Address,
        indices: list[int],
        replies: list[Any],
        batch: Batch,
        asking: dict[int, Address],
        out: list[Any],
        retry: list[int],
    ) -> bool:
        """Replies to their frames; frames to send again into retry. True: pause before that.
        Once a frame of a slot is to be sent again, so are the later frames of that slot that
        went through (a key's commands stay in their order: what runs last wins)."""
        pause = False
        pos = 0
        failed: set[int] = set()
        counts, slots = batch.replies, batch.slots
        for i in indices:
            count = counts[i]
            if asking.pop(i, None) is not None:  # ASKING's +OK before each command
                pairs = replies[pos : pos + 2 * count]
                pos += 2 * count
                for ok in pairs[::2]:
                    if isinstance(ok, hiredis.ReplyError):  # (an ACL without ASKING)
                        raise RedisError(f"{address[0]}:{address[1]}: ASKING: {ok}")
                got = pairs[1] if count == 1 else pairs[1::2]
            else:
                got = replies[pos] if count == 1 else replies[pos : pos + count]
                pos += count
            error = _first_error(got, count)
            said = classify(str(error)) if error is not None else None
            if said is None or said.verdict is Verdict.VALUE:
                out[i] = got  # (a VALUE error stays in its place among the replies)
                if failed and slots[i] in failed:
                    retry.append(i)
                continue
            if said.verdict is Verdict.FAIL:
                raise RedisError(f"{address[0]}:{address[1]}: {said.text}")
            retry.append(i)
            failed.add(slots[i])
            where = (said.address[0] or address[0], said.address[1]) if said.address is not None else None
            if said.verdict is Verdict.MOVED and where is not None and self.map is not None:
                self.counters.moved += 1
                self.map.moved(said.slot, where)
                self._stale = True  # (one slot moved: likely more; read the whole map next round)
            elif said.verdict is Verdict.ASK and where is not None:
                self.counters.asked += 1
                asking[i] = where
            else:
                self._stale = True
                pause = True
        return pause

    # -- the slot map ---------------------------------------------------------------------

    async def refresh(self) -> SlotMap:
        """Read the slot map from the first node that answers: known masters, then the seeds,
        those that failed lately last. RedisError when none does."""
        async with self._refresh_lock:
            if not self._stale and self.map is not None:
                return self.map  # (another call read it meanwhile)
            now = time.monotonic()
            candidates = list(dict.fromkeys([*(self.map.masters() if self.map else []), *self.seeds]))
            candidates.sort(key=lambda a: self._suspect.get(a, 0.0) > now - SUSPECT_S)  # (stable)
            why = "no seed nodes"
            for address in candidates:
                conn = None
                try:
                    conn = await self._connection(address)
                    async with asyncio.timeout(self.connect_timeout_s):  # (a frozen node: the next one)
                        (reply,) = await conn.send(CLUSTER_SLOTS, 1)
                    if isinstance(reply, hiredis.ReplyError):
                        raise RedisError(f"{conn.name}: CLUSTER SLOTS: {reply}")
                    slot_map = SlotMap.from_cluster_slots(reply, address)
                except (RedisError, OSError, ValueError, TimeoutError) as exc:
                    why = f"{address[0]}:{address[1]}: {exc or type(exc).__name__}"
                    self._lost(address, conn)
                    continue
                except BaseException:
                    self._lost(address, conn)  # (the deadline passed while this node was asked)
                    raise
                if not slot_map.covered():
                    why = f"{address[0]}:{address[1]}: no slot served (not a cluster yet?)"
                    continue
                self.map, self._stale = slot_map, False
                self.counters.refreshes += 1
                self._prune(slot_map)
                return slot_map
            raise RedisError(f"no node of the cluster gave its slots ({why})")

    def _prune(self, slot_map: SlotMap) -> None:
        """Connections only to masters (a node that is no longer one is dropped)."""
        masters = set(slot_map.masters())
        for address in [a for a in self._conns if a not in masters]:
            self._conns.pop(address).abort()
        for address in [a for a, t in self._suspect.items() if t < time.monotonic() - SUSPECT_S]:
            del self._suspect[address]

    def masters(self) -> list[Address]:
        return self.map.masters() if self.map is not None else []

    # -- connections ----------------------------------------------------------------------

    async def _connection(self, address: Address) -> Connection:
        conn = self._conns.get(address)
        if conn is not None and conn.usable:
            return conn
        if self._tls and self._tls_context is None:
            self._tls_context = tls_context(self._tls_ca_file)
        async with asyncio.timeout(self.connect_timeout_s):
            conn = await connect(address, self._username, self._password, self._tls_context)
        self.counters.connects += 1
        old = self._conns.get(address)
        if old is not None and old.usable:  # (a concurrent call connected first: keep one)
            conn.abort()
            return old
        self._conns[address] = conn
        return conn

    def _lost(self, address: Address, conn: Connection | None) -> None:
        """The node failed a call: the connection the call used dropped (None: it never got one;
        a concurrent call may have made a new one since, which stays), the node asked for the
        slot map last for a while, the map read again before the next send."""
        if conn is not None:
            if self._conns.get(address) is conn:
                del self._conns[address]
            conn.abort()
        self._suspect[address] = time.monotonic()
        self._stale = True

    def close(self) -> None:
        """Every connection dropped at once (nothing to wait for: the directory's calls are
        idempotent and bounded by their callers)."""
        for conn in self._conns.values():
            conn.abort()
        self._conns.clear()
        self.map, self._stale = None, True


def _first_error(got: Any, count: int) -> hiredis.ReplyError | None:
    if count == 1:
        return got if isinstance(got, hiredis.ReplyError) else None
    for reply in got:
        if isinstance(reply, hiredis.ReplyError):
            return reply
    return None
