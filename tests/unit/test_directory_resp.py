# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The directory's lean Redis Cluster client, its bookkeeping without Redis: slots as Redis
computes them, the slot map from CLUSTER SLOTS, the RESP frames (against hiredis' own encoder),
what an error reply asks for, and one connection's replies in order on a local socket."""

from __future__ import annotations

import asyncio

import hiredis
import pytest

from kvstored.chunks.ids import TierKind
from kvstored.directory.cluster import ClusterClient
from kvstored.directory.commands import Commands
from kvstored.directory.connection import AuthFailed, ConnectionLost, RedisError, connect
from kvstored.directory.keys import KeyLayout, field
from kvstored.directory.resp import Batch, Verdict, asking, classify, encode
from kvstored.directory.slots import SLOTS, SlotMap, key_slot, tag_of
from tests.support.data import make_keys

# -- slots -------------------------------------------------------------------------------------


def test_a_keys_slot_is_crc16_of_its_hash_tag_as_redis_computes_it():
    assert key_slot(b"123456789") == 0x31C3 % SLOTS  # CRC16/XMODEM's check value (Redis' cluster spec)
    assert key_slot(b"{user1000}.following") == key_slot(b"{user1000}.followers") == key_slot(b"user1000")
    assert key_slot(b"foo{}{bar}") == 8363  # an empty tag: the whole key is hashed
    assert key_slot(b"foo{{bar}}zap") == key_slot(b"{bar")  # the tag is '{bar'
    assert key_slot(b"foo{bar}{zap}") == key_slot(b"bar")  # the first tag only
    assert tag_of(b"kvd:c{ns/3}:\x00{x}") == b"ns/3" and tag_of(b"plain") is None and tag_of(b"a{}b") is None
    # what CLUSTER KEYSLOT answers (tests/directory/test_cluster_client.py asks a real cluster)
    assert [key_slot(k) for k in (b"foo", b"bar", b"hello", b"kvd:hb{10.0.0.1:7070}")] == [12182, 5061, 866, 4001]


def test_the_slot_map_reads_cluster_slots_and_learns_moved_slots():
    reply = [
        [0, 5460, [b"10.0.0.1", 6379, b"id1"], [b"10.0.0.4", 6379, b"id4"]],
        [5461, 10922, [b"", 6380, b"id2", []]],  # '' is the node that answered
        [10923, 16383, [b"r3.example", 6381, b"id3"]],
    ]
    m = SlotMap.from_cluster_slots(reply, asked=("10.0.0.9", 7000))
    assert m.owner(0) == m.owner(5460) == ("10.0.0.1", 6379)
    assert m.owner(5461) == ("10.0.0.9", 6380) and m.owner(16383) == ("r3.example", 6381)
    assert m.masters() == [("10.0.0.1", 6379), ("10.0.0.9", 6380), ("r3.example", 6381)]
    assert m.covered() == SLOTS
    m.moved(7, ("10.0.0.2", 6379))
    assert m.owner(7) == ("10.0.0.2", 6379) and m.owner(8) == ("10.0.0.1", 6379)
    partial = SlotMap.from_cluster_slots(reply[:1], asked=("x", 1))
    assert partial.owner(6000) is None and partial.covered() == 5461
    for bad in ("nonsense", [[0, 99999, [b"h", 1, b"i"]]], [[0, 1]], [[0, 1, [b"h", b"port?"]]]):
        with pytest.raises(ValueError):
            SlotMap.from_cluster_slots(bad, asked=("x", 1))


# -- frames and replies ------------------------------------------------------------------------


def test_frames_are_what_hiredis_would_send():
    layout = KeyLayout("kvd", 16)
    cmd = Commands(layout, "10.0.0.1:7070", 0x1F, entry_ttl_s=600, heartbeat_ttl_s=3)
    chunk = ("ns1", make_keys("frames", 1)[0])
    key = layout.chunk_key(chunk)
    batch = Batch()
    cmd.heartbeat(batch)
    cmd.gained(batch, TierKind.RAM, chunk)
    cmd.dropped(batch, TierKind.FS, chunk)
    cmd.delete_field(batch, key, b"10.0.0.2:7070|3|ram")
    f_ram, f_fs = field("10.0.0.1:7070", 0x1F, TierKind.RAM), field("10.0.0.1:7070", 0x1F, TierKind.FS)
    pack = hiredis.pack_command
    assert batch.frames == [
        pack((b"SET", b"kvd:hb{10.0.0.1:7070}", b"1f", b"PX", b"3000")),
        pack((b"HSET", key, f_ram, b"1")) + pack((b"PEXPIRE", key, b"600000")),
        pack((b"HDEL", key, f_fs)),
        pack((b"HDEL", key, b"10.0.0.2:7070|3|ram")),
    ]
    assert batch.replies == [1, 2, 1, 1] and batch.commands() == 5
    assert batch.slots == [key_slot(b"kvd:hb{10.0.0.1:7070}")] + [key_slot(key)] * 3
    keys, lookup = cmd.holders([chunk])
    assert keys == [key] and lookup.frames == [pack((b"HGETALL", key))]
    assert cmd.heartbeats(["a:1"]).frames == [pack((b"GET", b"kvd:hb{a:1}"))]
    assert encode(b"AUTH", "user", 7) == pack((b"AUTH", b"user", b"7"))
    # a frame sent after ASK: ASKING before each of its commands (it admits one command only)
    assert asking(batch.frames[1]) == (
        pack((b"ASKING",)) + pack((b"HSET", key, f_ram, b"1")) + pack((b"ASKING",)) + pack((b"PEXPIRE", key, b"600000"))
    )


def test_a_prefix_with_braces_of_its_own_still_routes_each_key_right():
    cmd = Commands(KeyLayout("odd{x", 4), "a:1", 1, entry_ttl_s=60, heartbeat_ttl_s=3)
    for k in make_keys("braces", 20):
        key, slot = cmd.chunk_key(("ns", k))
        assert slot == key_slot(key)


@pytest.mark.parametrize(
    ("text", "verdict", "slot", "address"),
    [
        ("MOVED 3999 127.0.0.1:6381", Verdict.MOVED, 3999, ("127.0.0.1", 6381)),
        ("ASK 3999 [::1]:6381", Verdict.ASK, 3999, ("::1", 6381)),
        ("MOVED 12 :7000", Verdict.MOVED, 12, ("", 7000)),  # (the node that replied, its host)
        ("TRYAGAIN Multiple keys request during rehashing of slot", Verdict.RETRY, -1, None),
        ("CLUSTERDOWN The cluster is down", Verdict.RETRY, -1, None),
        ("READONLY You can't write against a read only replica.", Verdict.RETRY, -1, None),
        ("NOPERM this user has no permissions to run the 'flushall' command", Verdict.FAIL, -1, None),
        ("MOVED garbage", Verdict.FAIL, -1, None),
    ],
)
def test_an_error_reply_says_redirect_retry_or_fail(text, verdict, slot, address):
    said = classify(text)
    assert (said.verdict, said.slot, said.address) == (verdict, slot, address)


# -- one connection, against a scripted server on loopback -------------------------------------


async def _server(script):
    """A TCP server on loopback that answers each connection with script(reader, writer)."""
    server = await asyncio.start_server(script, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[:2]


async def test_replies_reach_their_requests_in_order_and_a_lost_connection_fails_the_rest():
    async def script(reader, writer):
        await reader.readexactly(len(encode(b"GET", b"a")) * 3)
        writer.write(b"$1\r\n1\r\n:2\r\n-ERR nope\r\n")  # two requests' replies, then the link dies
        await writer.drain()
        writer.close()

    server, address = await _server(script)
    async with server:
        conn = await connect(address, None, None, None)
        first = conn.send(encode(b"GET", b"a") * 2, 2)
        second = conn.send(encode(b"GET", b"a"), 1)
        third = conn.send(b"", 1)
        assert await first == [b"1", 2]
        (error,) = await second
        assert isinstance(error, hiredis.ReplyError) and str(error) == "ERR nope"
        with pytest.raises(ConnectionLost):
            await third
        assert not conn.usable
        with pytest.raises(ConnectionLost):
            conn.send(b"", 1)


async def test_auth_is_sent_first_and_a_refusal_never_echoes_the_password():
    seen = []

    async def script(reader, writer):
        seen.append(await reader.readexactly(len(encode(b"AUTH", b"kv", b"s3cret"))))
        writer.write(b"-WRONGPASS invalid username-password pair or user is disabled.\r\n")
        await writer.drain()

    server, address = await _server(script)
    async with server:
        with pytest.raises(AuthFailed) as exc:
            await connect(address, "kv", "s3cret", None)
        assert seen == [encode(b"AUTH", b"kv", b"s3cret")]
        assert "WRONGPASS" in str(exc.value) and "s3cret" not in str(exc.value)


async def test_a_node_that_answers_nothing_costs_the_callers_deadline_and_leaves_nothing_behind():
    """CLUSTER SLOTS sent, no reply (a frozen node): the call ends at its deadline, and the
    connection it was on is dropped (its buffers with it)."""
    got = asyncio.Event()

    async def script(reader, writer):
        await reader.read(100)
        got.set()
        await asyncio.sleep(3600)

    server, address = await _server(script)
    async with server:
        client = ClusterClient([address])
        batch = Batch()
        batch.add(0, encode(b"GET", b"x"))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await client.execute(batch)
        assert got.is_set() and client._conns == {}  # (dropped)
        with pytest.raises(RedisError, match="no node of the cluster gave its slots"):
            await ClusterClient([("127.0.0.1", 1)]).refresh()  # (nothing listens on port 1)


async def test_a_node_that_stops_reading_fails_requests_at_a_bound_not_our_memory(monkeypatch):
    """Nothing reads what the client sends (a node frozen, its socket buffers full): past
    MAX_BUFFERED bytes waiting to leave, a request fails at once and the connection is dropped."""
    from kvstored.directory import connection

    monkeypatch.setattr(connection, "MAX_BUFFERED", 1 << 20)
    stalled = asyncio.Event()

    async def script(reader, writer):
        await stalled.wait()  # (never reads)

    server, address = await _server(script)
    async with server:
        conn = await connect(address, None, None, None)
        frame = encode(b"SET", b"k", b"x" * (256 << 10))
        with pytest.raises(ConnectionLost, match="backlog full"):
            for _ in range(10_000):  # (the kernel's buffers take some first: a few MiB at most)
                conn.send(frame, 1)
                await asyncio.sleep(0)
        assert not conn.usable
        stalled.set()


async def test_a_master_that_stops_answering_a_batch_loses_its_connection_at_the_deadline():
    """The slot map read, the batch's GET sent, no reply (the master frozen): the call ends at its
    deadline and the connection it waited on is dropped, so the next call connects afresh
    instead of queueing behind the frozen one."""
    connections = 0

    async def script(reader, writer):
        nonlocal connections
        connections += 1
        host, port = writer.get_extra_info("sockname")[:2]
        await reader.readuntil(b"SLOTS\r\n")
        me = f"*3\r\n:0\r\n:16383\r\n*2\r\n${len(host)}\r\n{host}\r\n:{port}\r\n"
        writer.write(f"*1\r\n{me}".encode())
        await writer.drain()
        await asyncio.sleep(3600)  # (the GET that follows is never answered)

    server, address = await _server(script)
    async with server:
        client = ClusterClient([address])
        batch = Batch()
        batch.add(0, encode(b"GET", b"x"))
        for call in range(2):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await client.execute(batch)
            assert client._conns == {}, f"call {call}: the frozen master's connection was kept"
        assert connections >= 2


async def test_an_error_reply_from_one_master_leaves_the_others_connections_in_step():
    """A batch over two masters, one answering with an error the cluster does not redirect
    (ERR) at once and the other a moment later: the call fails with that error, and the
    other master's connection stays, its reply read (it is still in step, not dropped)."""
    slow_answered = asyncio.Event()
    servers: list[asyncio.Server] = []
    addresses: list[tuple[str, int]] = []

    def slot_map() -> bytes:
        entries = [(0, 8191, addresses[0]), (8192, 16383, addresses[1])]
        out = f"*{len(entries)}\r\n"
        for first, last, (host, port) in entries:
            out += f"*3\r\n:{first}\r\n:{last}\r\n*2\r\n${len(host)}\r\n{host}\r\n:{port}\r\n"
        return out.encode()

    def serving(index: int):
        async def script(reader, writer):
            while data := await reader.read(65536):
                if b"SLOTS" in data:
                    writer.write(slot_map())
                elif index == 0:
                    writer.write(b"-ERR unknown command\r\n")
                else:
                    await asyncio.sleep(0.1)
                    writer.write(b"$-1\r\n")
                    slow_answered.set()
                await writer.drain()

        return script

    for index in range(2):
        server, address = await _server(serving(index))
        servers.append(server)
        addresses.append(address)
    try:
        client = ClusterClient([addresses[0]])
        batch = Batch()
        batch.add(0, encode(b"GET", b"a"))
        batch.add(10000, encode(b"GET", b"b"))
        with pytest.raises(RedisError, match="ERR unknown command"):
            async with asyncio.timeout(5):
                await client.execute(batch)
        assert slow_answered.is_set()
        assert set(client._conns) == set(addresses), "a master that answered in step lost its connection"
        assert all(conn.usable for conn in client._conns.values())
        client.close()
    finally:
        for server in servers:
            server.close()
            await server.wait_closed()
