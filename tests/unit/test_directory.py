# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fleet directory's bookkeeping, without Redis: its URL, the key layout (one lookup's chunks
in at most `buckets` slots), the writer's net changes and refresh pass, the reader's verdicts and
heartbeat cache; and that the directory's client loads only with a directory, without redis-py."""

from __future__ import annotations

import subprocess
import sys

import hiredis
import pytest

from kvstored.chunks.ids import TierKind
from kvstored.config import ConfigError, load_config
from kvstored.directory.changes import Change, ChangeLog, RefreshPass
from kvstored.directory.config import DirectorySettings, parse_url
from kvstored.directory.keys import Holder, KeyLayout, field, parse_field, parse_heartbeat
from kvstored.directory.lookups import HeartbeatCache, judge, named_addresses
from kvstored.directory.node import DirectoryNode
from kvstored.events.bus import Cause, EventType, KvEvent
from kvstored.io.breaker import BreakerState
from tests.support.data import make_keys
from tests.support.ports import free_port

# -- the URL -----------------------------------------------------------------------------------


def test_the_url_names_seed_nodes_credentials_and_tls():
    url = parse_url("rediss://kv:p%40ss@10.0.0.1:6379,10.0.0.2:6380")
    assert url.nodes == (("10.0.0.1", 6379), ("10.0.0.2", 6380))
    assert (url.username, url.password, url.tls) == ("kv", "p@ss", True)
    assert "p@ss" not in url.redacted() and "p%40ss" not in url.redacted()
    assert parse_url("redis://:secret@h:1").password == "secret"  # the default user (requirepass)
    assert parse_url("redis://secret@h:1") == parse_url("redis://:secret@h:1")
    assert parse_url("redis://h:1|h:2").nodes == (("h", 1), ("h", 2))  # the flag form, like peers
    assert parse_url("redis://[::1]:7000").nodes == (("::1", 7000),)


@pytest.mark.parametrize("bad", ["h:1", "http://h:1", "redis://h", "redis://h:0", "redis://:pw@h:99999"])
def test_a_bad_url_is_refused_without_echoing_a_password(bad):
    with pytest.raises(ValueError) as exc:
        parse_url(bad)
    assert "pw" not in str(exc.value)


def test_the_directory_is_a_peer_tier_key_on_flags_and_toml(tmp_path):
    flags = load_config(
        {
            "tcp_listen": "127.0.0.1:7070",
            "tiers": ["kind=peer,directory=redis://10.0.0.1:7000,10.0.0.2:7000,directory_interval_s=0.2"],
        },
        env={},
    )
    (peer,) = flags.tiers
    assert peer.directory == "redis://10.0.0.1:7000,10.0.0.2:7000" and peer.peers == ()
    assert peer.directory_interval_s == 0.2
    path = tmp_path / "kvstored.toml"
    path.write_text(
        'tcp_listen = "127.0.0.1:7070"\n[[tiers]]\nkind = "peer"\ndirectory = "rediss://kv:pw@redis-0:6379"\n'
    )
    (peer,) = load_config(env={}, config_file=path).tiers
    assert peer.directory == "rediss://kv:pw@redis-0:6379"
    with pytest.raises(ConfigError, match="directory"):
        load_config({"tcp_listen": "127.0.0.1:7070", "tiers": ["kind=peer,directory=http://x:1"]}, env={})
    with pytest.raises(ConfigError, match="heartbeat_ttl"):
        load_config(
            {
                "tcp_listen": "127.0.0.1:7070",
                "tiers": ["kind=peer,directory=redis://x:1,directory_interval_s=1,directory_heartbeat_ttl_s=1"],
            },
            env={},
        )


# -- the key layout ----------------------------------------------------------------------------


def _slot(key: bytes) -> str:
    """The part Redis Cluster hashes: the hash tag between the first { and the next }."""
    start = key.index(b"{") + 1
    return key[start : key.index(b"}", start)].decode()


def test_one_lookups_chunks_fall_in_at_most_buckets_slots():
    layout = KeyLayout("kvd", buckets=4)
    keys = make_keys("layout", 200)
    tags = {_slot(layout.chunk_key(("ns1", k))) for k in keys}
    assert tags == {f"ns1/{b}" for b in range(4)}  # every bucket used, no more
    assert layout.chunk_key(("ns1", keys[0])) == layout.chunk_key(("ns1", keys[0]))  # stable
    assert _slot(layout.chunk_key(("ns2", keys[0]))).startswith("ns2/")  # namespaces apart
    assert layout.chunk_key(("ns1", keys[0])).endswith(keys[0])
    assert layout.heartbeat_key("10.0.0.1:7070") == "kvd:hb{10.0.0.1:7070}"


def test_a_field_names_holder_incarnation_and_tier():
    raw = field("10.0.0.1:7070", 0xABC, TierKind.FS)
    assert parse_field(raw) == Holder("10.0.0.1:7070", 0xABC, TierKind.FS)
    assert parse_field(b"garbage") is None and parse_field(b"a|zz|ram") is None and parse_field(b"\xff|1|ram") is None
    assert parse_heartbeat(b"abc") == 0xABC and parse_heartbeat(None) is None and parse_heartbeat(b"x!") is None
    assert parse_heartbeat(hiredis.ReplyError("WRONGTYPE Operation against a key holding the wrong kind")) is None


# -- the writer --------------------------------------------------------------------------------


def _event(type_: EventType, kind: TierKind, keys, ns="ns1") -> KvEvent:
    return KvEvent(1, 0.0, type_, Cause.STORED, kind.name.lower(), kind, ns, tuple(keys))


def test_changes_are_net_per_interval_and_only_public_local_ones():
    log = ChangeLog(100, shareable=lambda ns: ns != "tenant")
    a, b, c = make_keys("net", 3)
    log.on_event(_event(EventType.STORED, TierKind.RAM, [a, b]), now=1.0)
    log.on_event(_event(EventType.REMOVED, TierKind.RAM, [b]), now=1.1)  # stored then evicted: one change
    log.on_event(_event(EventType.STORED, TierKind.FS, [b]), now=1.2)  # written down: its own field
    log.on_event(_event(EventType.STORED, TierKind.RAM, [c], ns="tenant"), now=1.3)  # never published
    log.on_event(_event(EventType.STORED, TierKind.S3, [c]), now=1.3)  # shared storage: never published
    assert len(log) == 3 and log.lag(now=2.0) == pytest.approx(1.0)
    taken = log.take(2)
    assert taken == [Change(TierKind.RAM, ("ns1", a), True), Change(TierKind.RAM, ("ns1", b), False)]
    log.give_back(taken, since=1.0)  # the write failed: pending again
    log.on_event(_event(EventType.STORED, TierKind.RAM, [b]), now=2.1)  # ... but a newer change wins
    assert {(ch.chunk[1], ch.kind, ch.present) for ch in log.take(10)} == {
        (a, TierKind.RAM, True),
        (b, TierKind.RAM, True),
        (b, TierKind.FS, True),
    }
    log.written(now=3.0)
    assert len(log) == 0 and log.lag(now=9.0) == 0.0


def test_past_max_pending_changes_are_dropped_and_a_rewrite_is_asked_for():
    log = ChangeLog(2, shareable=lambda ns: True)
    log.on_event(_event(EventType.STORED, TierKind.RAM, make_keys("many", 5)), now=0.0)
    assert len(log) == 2 and log.dropped == 3 and log.resync_wanted


def test_the_refresh_pass_spreads_over_its_period_and_runs_urgently_after_an_outage():
    held = [(TierKind.RAM, ("ns1", k)) for k in make_keys("held", 10)]
    refresh = RefreshPass(period_s=5.0, interval_s=1.0, batch=4)
    first = [refresh.next_slice(lambda: list(held)) for _ in range(3)]
    assert [len(s) for s in first] == [4, 4, 2]  # at start: urgent, as fast as batches go
    assert not refresh.urgent
    steady = [refresh.next_slice(lambda: list(held)) for _ in range(5)]
    assert [len(s) for s in steady] == [2, 2, 2, 2, 2]  # then 10 chunks over 5 intervals
    assert sum(steady, []) == held  # every chunk once per pass
    refresh.restart_urgently()
    assert len(refresh.next_slice(lambda: list(held))) == 4


# -- the reader --------------------------------------------------------------------------------


def test_a_field_counts_only_while_its_holders_heartbeat_names_its_incarnation():
    hb = HeartbeatCache(max_age_s=0.5)
    fields = {
        field("a:1", 7, TierKind.FS): b"1",
        field("b:1", 9, TierKind.RAM): b"1",
        field("c:1", 3, TierKind.RAM): b"1",  # restarted since (its heartbeat names 4)
        field("d:1", 5, TierKind.RAM): b"1",  # dead (no heartbeat)
        field("me:1", 1, TierKind.RAM): b"1",  # this node itself
        b"junk": b"1",
    }
    assert named_addresses([fields, None], "me:1") == ["a:1", "b:1", "c:1", "d:1"]
    assert hb.due(["a:1", "b:1", "a:1"], now=0.0) == ["a:1", "b:1"]
    for address, incarnation in (("a:1", 7), ("b:1", 9), ("c:1", 4), ("d:1", None)):
        hb.update(address, incarnation, now=0.0)
    verdict = judge(fields, "me:1", hb)
    assert verdict.live == [Holder("b:1", 9, TierKind.RAM), Holder("a:1", 7, TierKind.FS)]  # RAM first
    assert {h.address for h, _ in verdict.stale} == {"c:1", "d:1"}  # to delete
    assert hb.due(["a:1"], now=0.4) == [] and hb.due(["a:1"], now=0.5) == ["a:1"]  # cached one interval
    assert judge(None, "me:1", hb).live == []


@pytest.mark.parametrize("directory", [False, True])
def test_the_directory_client_loads_only_with_a_directory_and_never_redis_py(directory):
    tiers = "kind=peer,directory=redis://h:1" if directory else "kind=peer,peers=127.0.0.1:7071"
    code = (
        "import sys\n"
        "from kvstored.config import load_config\n"
        "from kvstored.tiers.registry import spec_of\n"
        "from kvstored.tiers.config import TierContext\n"
        "import kvstored.server.daemon\n"
        f"cfg = load_config({{'tcp_listen': '127.0.0.1:7070', 'tiers': [{tiers!r}]}}, {{}})\n"
        "tier = spec_of(cfg.tiers[0]).build(cfg.tiers[0], TierContext())\n"
        "print([m for m in ('redis', 'hiredis') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("['hiredis']" if directory else "[]"), out.stdout + out.stderr


async def test_an_unreachable_directory_costs_misses_and_a_breaker_never_a_hang():
    url = parse_url(f"redis://127.0.0.1:{free_port()}")  # nothing listens there
    node = DirectoryNode(
        DirectorySettings(url, "127.0.0.1:7070", 5, breaker_failures=2, breaker_reset_s=60), lambda ns: True
    )
    node.on_event(_event(EventType.STORED, TierKind.RAM, make_keys("down", 3)))
    chunks = [("ns1", k) for k in make_keys("asked", 4)]
    assert await node.write_once() is False
    assert len(node.changes) == 3  # kept for when it is back
    assert await node.lookup(chunks) == [[]] * 4
    assert node.breaker.state is BreakerState.OPEN
    assert await node.lookup(chunks) == [[]] * 4  # refused at once: no connection tried
    assert node.counters.refused == 1 and node.counters.errors == 1 and node.counters.write_errors == 1
    assert await node.write_once() is False and len(node.changes) == 3
    await node.close()
