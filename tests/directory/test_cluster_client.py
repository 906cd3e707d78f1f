# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The directory's lean Redis Cluster client (kvstored/directory/cluster.py) against a real Redis
Cluster (3 masters, 3 replicas on loopback; tests/support/redis_cluster.py), on uvloop as in the
daemon. What it wrote is read back with redis-py, another client.

- Slot routing: a key's slot is what CLUSTER KEYSLOT says; a batch over every bucket lands each
  key on the master that serves its slot, with no redirection.
- Resharding under the client: a slot migrating (ASK: the client sends ASKING and the command to
  the importing master) and then moved (MOVED: the client learns the new owner); every write
  lands, in order.
- A failover in the middle of a batch: a master frozen with the batch's frames in flight, then
  killed; its replica is promoted and the same batch completes, every frame written.
- TLS with the shipped ACL user (deploy/redis/kvstored.acl): the same writes and a resharding,
  ASKING included; a wrong password fails at once, the password in no message.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import uvloop

from kvstored.chunks.ids import TierKind
from kvstored.directory.cluster import ClusterClient
from kvstored.directory.commands import Commands
from kvstored.directory.config import parse_url
from kvstored.directory.connection import AuthFailed
from kvstored.directory.keys import KeyLayout, field
from kvstored.directory.resp import Batch
from kvstored.directory.slots import key_slot
from tests.support.data import make_keys
from tests.support.redis_cluster import WAIT_S, RedisCluster

pytestmark = [pytest.mark.slow, pytest.mark.system_deps]

ADDRESS = "10.0.0.1:7070"
LAYOUT = KeyLayout("kvd", 16)
SHIPPED_ACL = Path(__file__).resolve().parents[2] / "deploy" / "redis" / "kvstored.acl"


def run(coro):
    """On uvloop, as the daemon runs."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def client_for(rc: RedisCluster, password: str | None = None) -> ClusterClient:
    url = parse_url(rc.url)
    return ClusterClient(
        url.nodes,
        url.username,
        url.password if password is None else password,
        tls=url.tls,
        tls_ca_file=str(rc.ca) if rc.ca else None,
        connect_timeout_s=5.0,
    )


def writes(chunks, kind=TierKind.RAM, incarnation=1) -> Batch:
    cmd, batch = Commands(LAYOUT, ADDRESS, incarnation, entry_ttl_s=600, heartbeat_ttl_s=30), Batch()
    cmd.heartbeat(batch)
    for chunk in chunks:
        cmd.gained(batch, kind, chunk)
    return batch


def held_fields(rc: RedisCluster, chunks) -> list[set[bytes]]:
    """Each chunk's fields, read by redis-py's cluster client."""
    with rc.cluster_client() as r:
        pipe = r.pipeline()
        for chunk in chunks:
            pipe.hgetall(LAYOUT.chunk_key(chunk))
        return [set(fields) for fields in pipe.execute()]


@pytest.fixture(scope="module")
def redis_cluster():
    with RedisCluster() as rc:
        yield rc


def test_every_key_lands_on_the_master_serving_its_slot(redis_cluster):
    rc = redis_cluster
    chunks = [(f"route{i % 4}", k) for i, k in enumerate(make_keys("route", 2000))]
    with rc.admin(rc.master_ports()[0]) as r:  # the slot Redis itself computes
        for key in [LAYOUT.chunk_key(c) for c in chunks[:40]] + [b"kvd:hb{10.0.0.1:7070}", b"foo{}{bar}"]:
            assert key_slot(key) == r.execute_command("CLUSTER", "KEYSLOT", key)

    async def write():
        client = client_for(rc)
        try:
            replies = await client.execute(writes(chunks))
            return replies, client.counters, sorted(client._conns), client.masters()
        finally:
            client.close()

    replies, counters, connected, masters = run(write())
    assert replies[0] == b"OK" and all(r == [1, 1] for r in replies[1:])  # HSET: 1 new field; PEXPIRE: 1
    assert (counters.moved, counters.asked, counters.retried) == (0, 0, 0)  # routed right the first time
    assert connected == masters and len(masters) == 3  # one connection per master, to masters only
    ram = field(ADDRESS, 1, TierKind.RAM)
    assert held_fields(rc, chunks) == [{ram}] * len(chunks)
    with rc.cluster_client() as r:
        assert r.pttl(LAYOUT.chunk_key(chunks[0])) > 0  # PEXPIRE with it


def reshard_under(rc: RedisCluster, namespace: str) -> None:
    """One bucket's slot migrated from its master to another while the client writes to it:
    ASK during the migration, MOVED after it; every write lands."""
    keys = [k for k in make_keys(namespace, 400) if LAYOUT.bucket(k) == 0][:20]
    chunks = [(namespace, k) for k in keys]
    slot = key_slot(LAYOUT.chunk_key(chunks[0]))
    src = rc.slot_owner(slot)
    dst = next(p for p in rc.master_ports() if p != src)
    ram, fs = field(ADDRESS, 1, TierKind.RAM), field(ADDRESS, 1, TierKind.FS)

    async def scenario() -> tuple[int, int, tuple[str, int] | None]:
        client = client_for(rc)
        try:
            async with asyncio.timeout(WAIT_S):
                await client.execute(writes(chunks[:10]))  # the client knows the map: slot -> src
                await asyncio.to_thread(rc.begin_migration, slot, src, dst)
                await asyncio.to_thread(rc.migrate, slot, src, dst, [LAYOUT.chunk_key(c) for c in chunks[:5]])
                # migrated keys, and keys not written yet, are the importing master's: ASK
                await client.execute(writes(chunks, TierKind.FS))
                asked = client.counters.asked
                assert client.counters.moved == 0
                await asyncio.to_thread(rc.migrate, slot, src, dst)
                await asyncio.to_thread(rc.end_migration, slot, dst)
                await client.execute(writes(chunks))  # the client still says src: MOVED
                assert client.map is not None
                return asked, client.counters.moved, client.map.owner(slot)
        finally:
            client.close()

    asked, moved, owner = run(scenario())
    assert asked >= 15 and moved >= 1 and owner == ("127.0.0.1", dst)
    assert held_fields(rc, chunks) == [{ram, fs}] * len(chunks)
    with rc.admin(src) as r:
        assert r.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0


def test_a_slot_resharded_under_the_client_is_followed_through_ask_and_moved(redis_cluster):
    reshard_under(redis_cluster, "reshard")


def test_a_failover_in_the_middle_of_a_batch_completes_the_batch(redis_cluster):
    """The batch's frames for one master are in flight when that master freezes (SIGSTOP) and
    then dies (SIGKILL); its replica is promoted and the client, within its deadline, sends those
    frames to it: every frame written, none failed."""
    rc = redis_cluster
    rc.wait_ok()
    chunks = [("failover", k) for k in make_keys("failover", 3000)]
    victim = rc.master_ports()[0]
    replica = rc.replica_of(victim)
    killed = threading.Event()

    def kill() -> None:
        proc = rc.node(victim).proc
        assert proc is not None
        proc.kill()  # (a stopped process dies on SIGKILL too)
        proc.wait(timeout=10)
        killed.set()

    async def scenario():
        client = client_for(rc)
        try:
            await client.execute(writes(chunks[:10]))  # connected, map known
            rc.freeze(victim)
            task = asyncio.get_running_loop().create_task(client.execute(writes(chunks)))
            await asyncio.sleep(0.5)
            assert not task.done()  # waiting on the frozen master
            await asyncio.to_thread(kill)
            async with asyncio.timeout(WAIT_S):
                replies = await task
            return replies, client.counters, client.masters()
        finally:
            client.close()

    try:
        replies, counters, masters = run(scenario())
    finally:
        if not killed.is_set():
            rc.thaw(victim)
    assert killed.is_set()
    assert all(r == [1, 1] or r == [0, 1] for r in replies[1:])  # (0: a field re-written)
    assert counters.retried > 0 and counters.refreshes >= 2
    assert ("127.0.0.1", replica) in masters and ("127.0.0.1", victim) not in masters
    assert held_fields(rc, chunks) == [{field(ADDRESS, 1, TierKind.RAM)}] * len(chunks)
    rc.start_all()  # the killed node rejoins, as a replica


def shipped_acl_rules() -> str:
    line = next(x for x in SHIPPED_ACL.read_text().splitlines() if x.startswith("user kvstored "))
    return " ".join(r for r in line.split()[2:] if r not in ("on", ">CHANGE-ME"))


def test_over_tls_as_the_shipped_acl_user_resharding_included():
    with RedisCluster(tls=True, password="Pw-lean3", acl=shipped_acl_rules()) as rc:
        chunks = [("tls", k) for k in make_keys("tls", 200)]

        async def write():
            client = client_for(rc)
            try:
                await client.execute(writes(chunks))
            finally:
                client.close()

        run(write())
        assert held_fields(rc, chunks) == [{field(ADDRESS, 1, TierKind.RAM)}] * len(chunks)
        reshard_under(rc, "tls-reshard")  # (ASKING and CLUSTER SLOTS under the ACL)
        for node in rc.nodes:
            assert rc.cli(node.port, "acl", "log").strip() == "", "a command was denied"

        async def wrong_password():
            client = client_for(rc, password="not-it")
            try:
                async with asyncio.timeout(WAIT_S):
                    await client.execute(writes(chunks[:1]))
            finally:
                client.close()

        with pytest.raises(Exception) as exc:
            run(wrong_password())
        assert "AUTH refused" in str(exc.value) or isinstance(exc.value, AuthFailed), exc.value
        assert "not-it" not in str(exc.value)


def test_a_key_holding_another_type_is_a_miss_for_that_chunk_alone(redis_cluster):
    """Another client's value under one chunk's key (WRONGTYPE for HGETALL) is a miss for that
    chunk, and one under a holder's heartbeat key (WRONGTYPE for GET) makes that holder dead: the
    other chunks are found, no error is counted, the breaker stays closed."""
    from kvstored.directory.config import DirectorySettings
    from kvstored.directory.node import DirectoryNode
    from kvstored.io.breaker import BreakerState

    rc = redis_cluster
    good, forged, listed = [("wrongtype", k) for k in make_keys("wrongtype", 3)]
    other_holder = "10.0.0.9:7070"
    with rc.cluster_client() as r:
        r.set(LAYOUT.chunk_key(forged), b"not a hash")
        r.rpush(f"kvd:hb{{{other_holder}}}".encode(), b"not a heartbeat")
    dead: list[str] = []

    async def look() -> tuple[list, BreakerState, int]:
        writer = client_for(rc)
        try:
            await writer.execute(writes([good]))
            batch = Batch()
            Commands(LAYOUT, other_holder, 1, entry_ttl_s=600, heartbeat_ttl_s=30).gained(batch, TierKind.RAM, listed)
            await writer.execute(batch)  # a holder of `listed` whose heartbeat key holds a list
        finally:
            writer.close()
        settings = DirectorySettings(parse_url(rc.url), "10.0.0.2:7070", 1, timeout_s=5.0, tls_ca_file=rc.ca)
        reader = DirectoryNode(settings, lambda ns: True)
        reader.on_dead = dead.append
        try:
            found = [await reader.lookup([good, forged, listed]) for _ in range(3)]
            return found, reader.breaker.state, reader.counters.errors
        finally:
            await reader.close()

    found, state, errors = run(look())
    for holders in found:
        assert [h.address for h in holders[0]] == [ADDRESS] and holders[1] == [] and holders[2] == []
    assert dead and set(dead) == {other_holder}
    assert state is BreakerState.CLOSED and errors == 0
