# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Two real daemons with NO static peers, sharing only a fleet directory on a real Redis Cluster
(3 masters, 3 replicas on loopback; tests/support/redis_cluster.py).

- A chunk stored on A is a hit on B (Lookup says PEER), loads byte-exact, and is in B's RAM after.
- A killed: once its heartbeat expires, B no longer offers A's chunks (misses, no hang).
- Faults of the directory while B keeps looking up and loading A's chunks and its own: a master
  killed and its replica promoted, a master frozen (SIGSTOP), the whole cluster stopped. In each,
  B serves its own chunks byte-exact, every lookup and load returns, no wrong bytes; after
  recovery both daemons pick the directory up again by themselves: A's chunks stored after the
  fault are hits on B (and, after the cluster was emptied, A's older chunks too: the refresh).
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvstored_client import Tier
from tests.support.cluster import TEST_PEER_OPTIONS, WAIT_S, PeerDaemon
from tests.support.daemon import short_tmpdir, stop_all
from tests.support.data import make_keys, payloads
from tests.support.ports import free_port
from tests.support.redis_cluster import RedisCluster

pytestmark = [pytest.mark.slow, pytest.mark.system_deps]

CHUNK = 256 << 10
PROBES = itertools.count()
HEARTBEAT_TTL_S = 1.5
DIRECTORY_OPTIONS = {
    **TEST_PEER_OPTIONS,
    "breaker_reset_s": "1",
    "directory_interval_s": "0.2",
    "directory_heartbeat_ttl_s": str(HEARTBEAT_TTL_S),
    "directory_timeout_s": "0.5",  # (a loaded 2-core machine; the breaker bounds the rest)
}


@pytest.fixture(scope="module")
def redis_cluster():
    with RedisCluster() as rc:
        yield rc


class Pair:
    """Daemons A and B (index 0 and 1), each with only a peer tier pointed at the directory."""

    def __init__(self, url: str, ca: Path | None = None) -> None:
        self.workdir = short_tmpdir("kvdir")
        spec = ",".join(
            ["kind=peer", "transport=tcp", "tcp_port=0", "ucx_port=0", f"directory={url}"]
            + ([f"directory_tls_ca_file={ca}"] if ca else [])
            + [f"{k}={v}" for k, v in DIRECTORY_OPTIONS.items()]
        )
        self.daemons: list[PeerDaemon] = []
        for i in range(2):
            address = f"127.0.0.1:{free_port()}"
            d = PeerDaemon(i, address, None, cpu_bytes="32MiB", workdir=self.workdir / f"n{i}")
            d.workdir.mkdir()
            self.metrics_port = free_port() if i == 1 else 0
            metrics = ["--metrics-addr", f"127.0.0.1:{self.metrics_port}"] if i == 1 else []
            d.args = ["--tcp-listen", address, "--tiers", spec, *metrics]
            self.daemons.append(d)

    def start(self) -> Pair:
        for d in self.daemons:
            d.start(d.args)
        return self

    def close(self) -> None:
        errors = stop_all(self.daemons)
        import shutil

        shutil.rmtree(self.workdir, ignore_errors=True)
        assert not errors, "\n".join(errors)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()


@pytest.fixture
def pair(redis_cluster):
    p = Pair(redis_cluster.url).start()
    try:
        yield p
    finally:
        p.close()


def fields(request) -> dict:
    model = "dir/" + re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    return {"model": model, "dtype": "u8", "chunk_bytes": CHUNK}


def store(d: PeerDaemon, ns_fields: dict, keys: list[bytes]) -> None:
    with d.client() as kv:
        ns = kv.register_namespace(**ns_fields)
        assert kv.store(ns, keys, payloads(keys, CHUNK)).stored == len(keys)


def tiers_on(d: PeerDaemon, ns_fields: dict, keys: list[bytes]) -> list[Tier]:
    with d.client() as kv:
        return list(kv.lookup(kv.register_namespace(**ns_fields), keys).tiers)


def load_checked(d: PeerDaemon, ns_fields: dict, keys: list[bytes]) -> int:
    """Load the keys; whatever loads must be byte-exact (a miss is fine, wrong bytes never)."""
    with d.client() as kv:
        ns = kv.register_namespace(**ns_fields)
        out = np.zeros((len(keys), CHUNK), np.uint8)
        n = kv.load(ns, keys, out)
        assert np.array_equal(out[:n], payloads(keys[:n], CHUNK)), "wrong bytes loaded"
        return n


def wait_for(what: str, check, describe=lambda: "") -> None:
    import time

    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never {what} within {WAIT_S:.0f} s\n{describe()}")
        time.sleep(0.1)


def logs(pair: Pair) -> str:
    return "\n".join(f"--- node {d.index}:\n{d.log[-3000:]}" for d in pair.daemons)


def wait_hits(pair: Pair, ns_fields: dict, keys: list[bytes]) -> None:
    b = pair.daemons[1]
    wait_for(
        f"B finds {len(keys)} chunks of A through the directory",
        lambda: tiers_on(b, ns_fields, keys) == [Tier.PEER] * len(keys),
        lambda: logs(pair),
    )


def found_on_b(pair: Pair, request, n: int = 4) -> tuple[dict, list[bytes]]:
    """n chunks stored on A, once B finds them all through the directory: (fields, keys)."""
    f = fields(request)
    keys = make_keys(f["model"], n)
    store(pair.daemons[0], f, keys)
    wait_hits(pair, f, keys)
    return f, keys


def test_a_chunk_stored_on_a_is_a_hit_on_b(pair, request):
    a, b = pair.daemons
    f, keys = found_on_b(pair, request, 8)
    assert load_checked(b, f, keys) == len(keys)
    assert tiers_on(b, f, keys) == [Tier.RAM] * len(keys)  # promoted like any lower tier's hit
    # B reached A only through the directory: A is a peer of B now, found there
    assert b.peer(a).received_chunks >= len(keys)
    # ... and B's own chunk, stored now, is a hit on A the same way
    mine = make_keys(f["model"] + "/b", 2)
    store(b, f, mine)
    wait_for("A finds B's chunks", lambda: tiers_on(a, f, mine) == [Tier.PEER] * 2, lambda: logs(pair))
    assert load_checked(a, f, mine) == 2
    text = pair.metrics()
    hits = re.search(r"^kvstored_directory_hit_chunks_total (\S+)$", text, re.M)
    assert hits and float(hits.group(1)) >= len(keys), text[-3000:]
    assert re.search(r"^kvstored_directory_breaker_open 0\.0$", text, re.M)
    promtool = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr
    # kvstoredctl directory: the same counters, its shards, and A found through it
    shown = json.loads(ctl_directory(b))
    assert shown["enabled"] and shown["breaker"] == "closed" and len(shown["shards"]) == 3
    assert shown["hit_chunks"] >= len(keys) and shown["found_peers"] == 1 and shown["write_errors"] == 0
    assert "***" not in shown["url"] and shown["url"].startswith("redis://127.0.0.1:")
    # a steady cluster: the slot map read at start (once per client at least), nothing redirected
    assert shown["slot_map_reads"] >= 1 and shown["moved"] == 0 and shown["asked"] == 0
    assert re.search(r"^kvstored_directory_slot_map_reads_total [1-9]", text, re.M), text[-3000:]
    assert re.search(r"^kvstored_directory_moved_total 0\.0$", text, re.M), text[-3000:]
    assert "breaker closed, 3 shard(s)" in ctl_directory(b, as_json=False)


def ctl_directory(d: PeerDaemon, as_json: bool = True) -> str:
    argv = [sys.executable, "-m", "kvstored.ctl", "--socket", str(d.socket), "directory"]
    out = subprocess.run(argv + (["--json"] if as_json else []), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_over_tls_with_an_acl_user_and_the_password_never_shown(request):
    """rediss:// with the cluster's CA, an ACL user allowed only kvd:* keys (the default user
    off): the same hit; neither the log nor kvstoredctl shows the password."""
    with RedisCluster(tls=True, password="Pw-9f3k") as rc:
        pair = Pair(rc.url, ca=rc.ca).start()
        try:
            a, b = pair.daemons
            f, keys = found_on_b(pair, request)
            assert load_checked(b, f, keys) == len(keys)
            shown = ctl_directory(b)
            assert json.loads(shown)["url"].startswith("rediss://kvstored:***@127.0.0.1:")
            assert "Pw-9f3k" not in shown and "Pw-9f3k" not in a.log + b.log
        finally:
            pair.close()


SHIPPED_ACL = Path(__file__).resolve().parents[2] / "deploy" / "redis" / "kvstored.acl"


def shipped_acl_rules() -> str:
    """deploy/redis/kvstored.acl's rules for the user kvstored, without its on/password placeholder."""
    line = next(x for x in SHIPPED_ACL.read_text().splitlines() if x.startswith("user kvstored "))
    return " ".join(r for r in line.split()[2:] if r not in ("on", ">CHANGE-ME"))


def test_the_shipped_acl_is_all_kvstored_needs_and_no_more(request):
    """The ACL user of deploy/redis/kvstored.acl, over TLS: A's chunks are hits on B and load
    byte-exact, stopping deletes the heartbeats, and no node logged a denied command; that user
    cannot touch keys outside kvd:* nor run anything else (FLUSHALL, CONFIG, KEYS, EVAL)."""
    from tests.support.redis_cluster import _cli

    with RedisCluster(tls=True, password="Pw-acl7", acl=shipped_acl_rules()) as rc:
        pair = Pair(rc.url, ca=rc.ca).start()
        try:
            a, b = pair.daemons
            f, keys = found_on_b(pair, request)
            assert load_checked(b, f, keys) == len(keys)
        finally:
            pair.close()
        assert all(rc._cli(n.port, "acl", "log").strip() == "" for n in rc.nodes), "a command was denied"
        as_kvstored = (
            "-c",
            "--tls",
            "--cacert",
            str(rc.ca),
            "--user",
            "kvstored",
            "--pass",
            "Pw-acl7",
            "--no-auth-warning",
        )
        port = rc.master_ports()[0]
        assert _cli(port, "get", "kvd:probe", client=as_kvstored).strip() == ""  # its own keys: allowed
        for denied in (
            ("set", "other:x", "1"),
            ("flushall",),
            ("config", "set", "maxmemory", "1"),
            ("keys", "kvd:*"),
            ("eval", "return 1", "0"),
        ):
            assert "NOPERM" in _cli(port, *denied, client=as_kvstored), denied


def test_a_killed_holder_stops_being_offered_once_its_heartbeat_expires(pair, request):
    a, b = pair.daemons
    f, keys = found_on_b(pair, request)
    a.kill()
    # (B's earlier Lookup may have readied some of them in its own RAM: those stay B's hits)
    wait_for(
        "B stops offering A's chunks",
        lambda: Tier.PEER not in tiers_on(b, f, keys),
        lambda: logs(pair),
    )
    held = sum(t is not Tier.NONE for t in tiers_on(b, f, keys))  # in B's own tiers
    assert load_checked(b, f, keys) <= held  # A is gone: B loads only what it holds itself


def test_a_holder_restarted_under_load_offers_only_what_its_new_incarnation_holds(pair, request):
    a, b = pair.daemons
    f = fields(request)
    old = make_keys(f["model"], 4)
    store(a, f, old)
    wait_hits(pair, f, old)
    a.kill()
    for _ in range(3):
        load_checked(b, f, old)  # (A down: misses, never an error or wrong bytes)
    a.start(a.args)  # a new incarnation at the same address, its RAM empty
    new = make_keys(f["model"] + "/new", 4)
    store(a, f, new)
    wait_hits(pair, f, new)  # B reaches the new incarnation by itself
    assert load_checked(b, f, new) == len(new)
    # the old incarnation's fields count no more (B's own RAM may hold some its Lookup readied)
    assert Tier.PEER not in tiers_on(b, f, old)


def serve_throughout(pair: Pair, f: dict, theirs: list[bytes], mine: list[bytes]) -> None:
    """B's own chunks load byte-exact; A's chunks load (hits) or not (misses), never wrongly."""
    b = pair.daemons[1]
    assert load_checked(b, f, mine) == len(mine)
    tiers_on(b, f, theirs)  # (returns: a hit or a miss, whatever the directory does)
    load_checked(b, f, theirs)
    # chunks nobody holds: asked of the directory every time (16 keys: every shard), all misses
    nobody = make_keys(f["model"] + f"/nobody{next(PROBES)}", 16)
    assert tiers_on(b, f, nobody) == [Tier.NONE] * len(nobody)


@pytest.mark.parametrize("fault", ["master_killed", "master_frozen", "cluster_stopped"])
def test_directory_faults(pair, redis_cluster, request, fault):
    a, b = pair.daemons
    f = fields(request)
    before = make_keys(f["model"], 6)
    mine = make_keys(f["model"] + "/b", 3)
    store(a, f, before)
    store(b, f, mine)
    wait_hits(pair, f, before[:1])  # the directory works, B knows A
    maps_read = sum(json.loads(ctl_directory(d))["slot_map_reads"] for d in (a, b))
    frozen = None
    if fault == "master_killed":
        redis_cluster.kill_master(0)  # (the killed node comes back as a replica below)
    elif fault == "master_frozen":
        frozen = redis_cluster.master_ports()[0]
        redis_cluster.freeze(frozen)
    else:
        redis_cluster.stop_all()
    for _ in range(5):
        serve_throughout(pair, f, before, mine)
    if fault != "master_killed":  # (a kill is over, failover included, before B looks again)
        shown = json.loads(ctl_directory(b))
        felt = shown["errors"] + shown["timeouts"] + shown["refused"] + shown["write_errors"]
        assert felt > 0, f"B never noticed the fault: {shown}"
    if frozen is not None:
        # the cluster promotes the frozen master's replica; then the old master comes back
        wait_for("a replica promoted in place of the frozen master", lambda: frozen not in redis_cluster.master_ports())
        serve_throughout(pair, f, before, mine)
        redis_cluster.thaw(frozen)
    else:
        # cluster_stopped: back empty, A's refresh pass must write its chunks again;
        # master_killed: the old master rejoins as a replica (the next fault needs one)
        redis_cluster.start_all()
    redis_cluster.wait_ok()
    after = make_keys(f["model"] + "/after", 4)
    store(a, f, after)
    wait_hits(pair, f, after)
    # (some of A's older chunks may be in B's RAM already: loaded during the fault)
    wait_for(
        "B finds A's older chunks again",
        lambda: Tier.NONE not in tiers_on(b, f, before),
        lambda: logs(pair),
    )
    assert load_checked(b, f, before + after) == len(before) + len(after)
    assert a.running and b.running
    if fault != "cluster_stopped":  # (a new master for a slot range: the clients read the map again)
        assert sum(json.loads(ctl_directory(d))["slot_map_reads"] for d in (a, b)) > maps_read


def test_a_daemon_starts_and_serves_while_its_directory_is_down(request):
    """Nothing listens at the directory's address: the daemon starts anyway, serves its own
    chunks byte-exact, its lookups of others' chunks are misses, and kvstoredctl says why."""
    pair = Pair(f"redis://127.0.0.1:{free_port()}")
    b = pair.daemons[1]
    try:
        b.start(b.args)
        f = fields(request)
        mine = make_keys(f["model"], 3)
        store(b, f, mine)
        assert load_checked(b, f, mine) == len(mine)
        for i in range(5):
            nobody = make_keys(f["model"] + f"/nobody{i}", 8)
            assert tiers_on(b, f, nobody) == [Tier.NONE] * len(nobody)
        shown = json.loads(ctl_directory(b))
        assert shown["breaker"] in ("open", "half_open") and shown["last_error"], shown
        assert shown["pending_changes"] == len(mine)  # kept until the directory is there
    finally:
        pair.close()
