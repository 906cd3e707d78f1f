# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Three real daemons with peer tiers, on loopback and in three network namespaces joined by veth
pairs (mutual TLS on the control plane there), over each transport.

- A chunk stored through node A loads byte-exact through a client of node B: B's Lookup says
  PEER before the load, RAM after; node C gets it too; nothing stays leased or reserved.
- Faults of the serving node while a client of B keeps loading its chunks (SIGKILL, SIGSTOP, a
  restart, its link down): every load returns (a miss during the fault, never an exception or a
  hang), no wrong bytes, the breaker caps the fetches a frozen node costs, leases and
  reservations come back to 0 on both sides, and B fetches from the node again by itself.
- A tenant's chunk is never fetched: B's client with the same salt misses, and A was never asked.
- A chunk whose bytes changed in A's RAM after A sent it once (A hashes a chunk once) is refused
  by the next fetcher: a miss, never wrong bytes.
- Across namespaces the TCP data plane runs both ways: on the event loop and in data threads
  (with two streams per bulk fetch).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from kvstored_client import Tier
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.session import PoolSession
from tests.peer.conftest import TRANSPORTS
from tests.support import netns
from tests.support.cluster import Cluster
from tests.support.daemon import clean_env
from tests.support.data import make_keys, payloads
from tests.support.peer_loader import PeerLoader

pytestmark = pytest.mark.slow

CHUNK = 1 << 20
BREAKER_FAILURES = 3


def ns_fields(name: str, **extra) -> dict:
    return {"model": name, "dtype": "u8", "chunk_bytes": CHUNK, **extra}


def model_of(request) -> str:
    return "peer/" + re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)


@pytest.fixture(scope="module", params=TRANSPORTS)
def loopback(request):
    """RAM -> fs -> peer on every node: small RAM, so older chunks are served from a peer's disk."""
    with Cluster(3, request.param, cpu_bytes="24MiB", fs_bytes="256MiB") as cluster:
        cluster.start()
        for i in range(3):
            cluster.wait_up(i)
        yield cluster


@pytest.fixture(scope="module")
def topology():
    with netns.topology_or_fail(3) as net:
        yield net


@pytest.fixture(scope="module", params=[*TRANSPORTS, "tcp-threads"])
def namespaced(request, topology):
    """Over UCX, over TCP on the event loop, and over TCP in data threads with two streams."""
    threads = {"data_threads": "on", "streams": "2"} if request.param == "tcp-threads" else {}
    with Cluster(3, request.param.removesuffix("-threads"), net=topology, peer_options=threads) as cluster:
        cluster.start()
        for i in range(3):
            cluster.wait_up(i)
        yield cluster


def store_on(daemon, fields: dict, keys: list[bytes]) -> None:
    with daemon.client() as kv:
        ns = kv.register_namespace(**fields)
        assert kv.store(ns, keys, payloads(keys, CHUNK)).stored == len(keys)


def settled(cluster: Cluster) -> None:
    """Nothing leased to a peer, no RAM slot held by a peer fetch, on any running node."""

    def check() -> bool:
        stats = [d.stats() for d in cluster if d.running]
        return all(s.peer_leases == 0 and s.peer_reservations == 0 and s.leases == 0 for s in stats)

    cluster.wait_for("settled (peer leases and reservations back to 0)", check)


def check_store_on_a_load_on_b(cluster: Cluster, model: str) -> None:
    a, b, c = cluster
    fields = ns_fields(model)
    keys = make_keys(model, 8)
    store_on(a, fields, keys)
    cluster.wait_indexed(1, 0, len(keys))
    fetches_before = b.peer(a).fetches
    with b.client() as kv:
        ns = kv.register_namespace(**fields)
        assert kv.lookup(ns, keys).tiers == [Tier.PEER] * len(keys)  # the index, no round trip
        out = np.empty((len(keys), CHUNK), np.uint8)
        assert kv.load(ns, keys, out) == len(keys)
        assert np.array_equal(out, payloads(keys, CHUNK))
        assert kv.lookup(ns, keys).tiers == [Tier.RAM] * len(keys)  # promoted like an fs/S3 hit
    assert b.peer(a).fetches - fetches_before < len(keys)  # concurrent reads from A went in batches
    with c.client() as kv:
        ns = kv.register_namespace(**fields)
        out = np.zeros((len(keys), CHUNK), np.uint8)
        assert kv.load(ns, keys, out) == len(keys)  # from A or B, whichever the index names
        assert np.array_equal(out, payloads(keys, CHUNK))
    peer_a = b.peer(a)
    assert peer_a.received_chunks >= len(keys) and peer_a.received_bytes >= len(keys) * CHUNK
    assert peer_a.transport == cluster.transport
    assert a.status().served_chunks >= len(keys)
    settled(cluster)


def test_a_chunk_stored_on_a_loads_on_b_loopback(loopback, request):
    check_store_on_a_load_on_b(loopback, model_of(request))


@pytest.mark.netns
@pytest.mark.root
def test_a_chunk_stored_on_a_loads_on_b_across_namespaces(namespaced, request):
    check_store_on_a_load_on_b(namespaced, model_of(request))


def test_chunks_on_a_peers_disk_are_served_and_deletes_stay_local(loopback, request):
    """A's older chunks went down to its fs tier: B still gets them (A promotes them into its RAM to
    send them). A Delete on B acts on B alone: A keeps its copy, so B finds it at A again."""
    a, b, _ = loopback
    fields = ns_fields(model_of(request))
    keys = make_keys(model_of(request), 40)  # 40 MiB through A's 24 MiB of RAM
    with a.client() as kv:
        ns = kv.register_namespace(**fields)
        for i in range(0, len(keys), 4):
            assert kv.store(ns, keys[i : i + 4], payloads(keys[i : i + 4], CHUNK)).stored == 4
    loopback.wait_for("A writing its older chunks down", lambda: a.stats().tiers[1].chunks >= 16)
    loopback.wait_indexed(1, 0, len(keys))
    with b.client() as kv:
        ns = kv.register_namespace(**fields)
        out = np.empty((4, CHUNK), np.uint8)
        for i in range(0, len(keys), 4):
            batch = keys[i : i + 4]
            assert kv.load(ns, batch, out) == 4, i
            assert np.array_equal(out, payloads(batch, CHUNK))
        assert kv.delete(ns, keys[:4]) == 4  # B's RAM and B's fs only
        assert kv.lookup(ns, keys[:4]).tiers == [Tier.PEER] * 4  # A still has them
        assert kv.load(ns, keys[:4], out) == 4 and np.array_equal(out, payloads(keys[:4], CHUNK))
    assert a.stats().tiers[0].promotions > 0  # A's RAM took them back from its disk to send them
    settled(loopback)


def test_kvstoredctl_peers_and_lookup(loopback, request):
    a, b, c = loopback
    fields = ns_fields(model_of(request))
    keys = make_keys(model_of(request), 2)
    store_on(a, fields, keys)
    loopback.wait_indexed(2, 0, len(keys))
    with c.client() as kv:
        ns_id = kv.register_namespace(**fields).namespace_id
        looked = json.loads(ctl(c, "lookup", "--json", "-n", ns_id, *(k.hex() for k in keys)))
        assert [k["tier"] for k in looked["keys"]] == ["peer", "peer"] and looked["prefix_hits"] == 2
    listing = json.loads(ctl(c, "peers", "--json"))
    assert listing["enabled"] and listing["transports"] and listing["index_entries"] >= len(keys)
    by_address = {p["address"]: p for p in listing["peers"]}
    assert set(by_address) == {a.address, b.address}  # its own address skipped
    row = by_address[a.address]
    assert row["state"] == "up" and row["transport"] == loopback.transport and row["breaker"] == "closed"
    assert row["indexed_chunks"] == c.peer(a).indexed_chunks >= len(keys)
    table = ctl(c, "peers")
    assert a.address in table and "BREAKER" in table and "up" in table


def ctl(d, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstored.ctl", "--socket", str(d.socket), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_a_tenants_chunk_is_never_fetched(loopback, request):
    a, b, _ = loopback
    fields = ns_fields(model_of(request), tenant_salt=b"acme")
    keys = make_keys(model_of(request), 4)
    served_before = a.status().served_chunks + a.status().refused_chunks
    fetches_before = b.peer(a).fetches
    entries_before = b.status().index_entries
    indexed_before = b.peer(a).indexed_chunks
    store_on(a, fields, keys)
    public = ns_fields(model_of(request) + "/public")
    marker = make_keys(model_of(request) + "/public", 1)
    store_on(a, public, marker)  # a public chunk stored after: once B indexes it, A's events are in
    loopback.wait_indexed(1, 0, indexed_before + 1)
    with b.client() as kv:
        ns = kv.register_namespace(**fields)  # the same salt, registered on B
        assert kv.lookup(ns, keys).prefix_hits == 0
        out = np.zeros((len(keys), CHUNK), np.uint8)
        assert kv.load(ns, keys, out) == 0 and not out.any()
    assert b.status().index_entries == entries_before + 1  # only the public marker was indexed
    assert b.peer(a).fetches == fetches_before  # nothing asked of A...
    after = a.status()
    assert after.served_chunks + after.refused_chunks == served_before  # ...and A saw no fetch


def test_a_chunk_changed_in_the_servers_ram_after_its_first_send_is_refused(loopback, request):
    """The serving node hashes a chunk at its first send only (a chunk's bytes never change in
    RAM); if its pages were overwritten since (a client writing where it must not), the next
    fetcher finds them not matching and refuses them: a miss, never the wrong bytes."""
    a, b, _ = loopback
    fields = ns_fields(model_of(request))
    keys = make_keys(model_of(request), 1)
    indexed_before = b.peer(a).indexed_chunks
    store_on(a, fields, keys)
    loopback.wait_indexed(1, 0, indexed_before + 1)
    out = np.zeros((1, CHUNK), np.uint8)
    with b.client() as kv:
        ns = kv.register_namespace(**fields)
        assert kv.load(ns, keys, out) == 1 and np.array_equal(out, payloads(keys, CHUNK))  # A hashed it
        assert kv.delete(ns, keys) == 1  # B's copy only: the next load fetches from A again
    overwrite_in_ram(a, fields, keys[0])
    corrupt_before = b.peer(a).corrupt_chunks
    out[:] = 0
    with b.client() as kv:
        assert kv.load(kv.register_namespace(**fields), keys, out) == 0 and not out.any()
    assert b.peer(a).corrupt_chunks == corrupt_before + 1
    # B forgets that A holds it (as for a MISSING answer): the next load does not ask A again.
    assert b.peer(a).indexed_chunks == indexed_before
    with b.client() as kv:
        assert kv.load(kv.register_namespace(**fields), keys, out) == 0
    assert b.peer(a).corrupt_chunks == corrupt_before + 1
    settled(loopback)


def overwrite_in_ram(daemon, fields: dict, key: bytes) -> None:
    """Flip every byte of a chunk in the daemon's pool, through a client's mapping of it."""
    with daemon.client() as kv:
        namespace_id = kv.register_namespace(**fields).namespace_id
    session = PoolSession.open(daemon.socket, "overwriter", timeout=10.0)
    try:
        with daemon.channel() as channel:
            stub = pb_grpc.KVStoreStub(channel)
            leases = stub.Acquire(
                pb.AcquireRequest(session_id=session.session_id, namespace_id=namespace_id, keys=[key]), timeout=10
            ).leases
            assert len(leases) == 1
            pool = session.arrays.numpy
            assert pool is not None
            for extent in leases[0].extents:
                pool[extent.offset : extent.offset + extent.length] ^= 0xFF
            stub.Release(pb.ReleaseRequest(session_id=session.session_id, handles=[leases[0].handle]), timeout=10)
    finally:
        session.close()


def test_a_fetcher_killed_mid_transfer_leaves_no_lease_behind(loopback, request):
    a, b, _ = loopback
    fields = ns_fields(model_of(request))
    keys = make_keys(model_of(request), 16)
    store_on(a, fields, keys)
    loopback.wait_indexed(1, 0, len(keys))
    served = a.status().served_chunks
    with PeerLoader(b, fields, keys, CHUNK) as loader:
        loopback.wait_for("B loading A's chunks", lambda: loader.snapshot().full >= 4)
        loopback.kill(1)
        loader.stop()
    assert a.status().served_chunks > served
    loopback.wait_for("A's leases back to 0", lambda: a.stats().peer_leases == 0 and a.status().leases == 0)
    loopback.restart(1)
    loopback.wait_up(1)
    loopback.wait_up(0)
    settled(loopback)


FAULTS = ["sigkill", "sigstop", "restart"]


@pytest.mark.parametrize("fault", FAULTS)
def test_serving_node_fault_loopback(loopback, request, fault):
    check_fault(loopback, model_of(request), fault)


@pytest.mark.netns
@pytest.mark.root
@pytest.mark.parametrize("fault", FAULTS + ["link_down"])
def test_serving_node_fault_across_namespaces(namespaced, request, fault):
    check_fault(namespaced, model_of(request), fault)


def check_fault(cluster: Cluster, model: str, fault: str) -> None:
    a, b, _ = cluster
    fields = ns_fields(model)
    keys = make_keys(model, 16)
    store_on(a, fields, keys)
    cluster.wait_indexed(1, 0, len(keys))
    incarnation_before = a.status().incarnation
    with PeerLoader(b, fields, keys, CHUNK) as loader:
        cluster.wait_for("B loading A's chunks", lambda: loader.snapshot().full >= 4)
        missed_before = loader.snapshot().missed
        if fault == "sigkill" or fault == "restart":
            cluster.kill(0)
            if fault == "restart":  # a new incarnation at once, before B notices
                cluster.restart(0)
        elif fault == "sigstop":
            cluster.freeze(0)
        else:
            assert cluster.net is not None
            cluster.net.cut(a.node)
        # Counted once the fault is in place: B loads from A every few ms until then, and the cut
        # is an `ip` process that a loaded machine may take a few hundred ms to run.
        fetches_at_fault = b.peer(a).fetches
        # Loads keep returning, as misses: at least 10 times the breaker's threshold of them.
        cluster.wait_for(
            "B's loads missing A's chunks", lambda: loader.snapshot().missed >= missed_before + 10 * BREAKER_FAILURES
        )
        fetches_in_fault = b.peer(a).fetches - fetches_at_fault
        if fault == "sigkill":
            cluster.restart(0)
        elif fault == "sigstop":
            cluster.thaw(0)
        elif fault == "link_down":
            assert cluster.net is not None
            cluster.net.restore(a.node)
        if fault in ("sigstop", "link_down"):
            # a frozen or cut-off peer costs the breaker's failures (and a probe), not a timeout per load
            assert fetches_in_fault <= BREAKER_FAILURES + 1, fetches_in_fault
            full = loader.snapshot().full
            cluster.wait_for("B loading A's chunks again", lambda: loader.snapshot().full >= full + 4)
        log = loader.stop()
    print(
        f"peer fault {fault} over {cluster.transport}{' across namespaces' if cluster.net else ''}: "
        f"{log.loads} loads ({log.full} whole, {log.missed} missed, {log.partial} partial), "
        f"{fetches_in_fault} fetches during the fault, {log.wrong} wrong chunks, {len(log.exceptions)} exceptions"
    )
    assert log.exceptions == [] and log.wrong == 0, log
    if fault in ("sigkill", "restart"):
        # A new incarnation: B reads it whole again; what the old one held in RAM is forgotten
        # (the index never says more than A holds now: its fs tier may have kept some).
        cluster.wait_up(1, [0])
        assert b.peer(a).incarnation == a.status().incarnation != incarnation_before
        assert b.peer(a).breaker == pb.BREAKER_STATE_CLOSED  # the old process's failures are forgiven
        held = sum(t.chunks for t in a.stats().tiers if t.name != "peer")
        assert b.peer(a).indexed_chunks <= held
        fresh = make_keys(model + "/after", 4)
        store_on(a, fields, fresh)
        with b.client() as kv:
            ns = kv.register_namespace(**fields)
            # (a count of A's chunks in B's index could be met by what A's fs tier kept from before)
            cluster.wait_for("B's index finding A's new chunks", lambda: kv.lookup(ns, fresh).prefix_hits == len(fresh))
            out = np.empty((len(fresh), CHUNK), np.uint8)
            assert kv.load(ns, fresh, out) == len(fresh)
            assert np.array_equal(out, payloads(fresh, CHUNK))
    assert b.peer(a).state == 2  # PEER_STATE_UP: it rejoined by itself
    settled(cluster)
