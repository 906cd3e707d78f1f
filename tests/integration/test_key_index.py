# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Key indexes (OpenIndex): a lookup whose keys RAM holds all is answered from the namespace's
index in shared memory, with no round trip. Its hits still count as lookups and move the LRU
(a posted Touch); a tenant maps only the indexes of namespaces it may see, read-only; an entry
that went stale gives a load that misses, never wrong bytes; keys not in RAM ask the daemon."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from kvstored_client import Tier
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.errors import NotFound
from kvstored_client.fast import FastLink
from kvstored_client.protocol import Handshake
from kvstored_client.session import PoolSession, _exchange, connect
from tests.support.data import make_keys, payloads
from tests.support.wait import wait_for

CHUNK = 64 << 10


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """Every call the fast path sends (a lookup answered from the index sends only a Touch)."""
    sent: list[str] = []
    for name in ("call", "post"):
        real = getattr(FastLink, name)

        def spy(self, method, *args, _real=real, **kwargs):
            sent.append(method)
            return _real(self, method, *args, **kwargs)

        monkeypatch.setattr(FastLink, name, spy)
    return sent


def test_a_lookup_of_ram_hits_asks_nothing_yet_counts_and_moves_the_lru(daemon_factory, ns_name, calls):
    d = daemon_factory(cpu_bytes="4MiB")  # 64 chunks
    keys = make_keys(ns_name, 96)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert kv.store(ns, keys[:32], payloads(keys[:32], CHUNK)).stored == 32
        before = kv.stats().tiers[0]
        calls.clear()
        for _ in range(3):
            found = kv.lookup(ns, keys[:8])
            assert (found.prefix_hits, found.tiers) == (8, [Tier.RAM] * 8)
        assert "Lookup" not in calls and calls.count("Touch") <= 1, calls  # (hits are posted in batches)
        # The hits counted as a Lookup's would (posted before, and read before, this gRPC call).
        after = kv.stats().tiers[0]
        assert (after.lookups - before.lookups, after.hits - before.hits) == (24, 24)
        # They are the most recently used now: 48 new chunks evict the 32 - 8 others first.
        for i in range(32, 80, 16):
            assert kv.store(ns, keys[i : i + 16], payloads(keys[i : i + 16], CHUNK)).stored == 16
        out = np.zeros((8, CHUNK), np.uint8)
        assert kv.load(ns, keys[:8], out) == 8
        np.testing.assert_array_equal(out, payloads(keys[:8], CHUNK))
        assert kv.lookup(ns, keys[8:9]).prefix_hits == 0  # evicted: asked the daemon
        assert "Lookup" in calls


def test_keys_not_all_in_ram_ask_the_daemon(daemon, ns_name, calls):
    keys = make_keys(ns_name, 8)
    with daemon.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert kv.store(ns, keys[:4], payloads(keys[:4], CHUNK)).stored == 4
        calls.clear()
        found = kv.lookup(ns, keys)
        assert found.prefix_hits == 4 and found.tiers == [Tier.RAM] * 4 + [Tier.NONE] * 4
        assert calls == ["Lookup"]


def test_a_stale_entry_gives_a_miss_never_wrong_bytes(daemon, ns_name):
    keys = make_keys(ns_name, 4)
    with daemon.client() as reader, daemon.client() as writer:
        ns = writer.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        reader.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert writer.store(ns, keys, payloads(keys, CHUNK)).stored == 4
        assert reader.store(ns, keys[:1], payloads(keys[:1], CHUNK)).already_present == 1  # opens its session
        assert reader.lookup(ns, keys).prefix_hits == 4  # from the index
        assert writer.delete(ns, keys[2:]) == 2  # gone after the reader's lookup
        out = np.full((4, CHUNK), 7, np.uint8)
        assert reader.load(ns, keys, out) == 2  # the stale hits miss: their rows are not written
        np.testing.assert_array_equal(out[:2], payloads(keys[:2], CHUNK))
        assert (out[2:] == 7).all()
        assert reader.lookup(ns, keys).prefix_hits == 2  # the index no longer holds them
        # A key stored anew with other bytes: the load gets the new bytes, whatever the lookup saw.
        fresh = np.full((1, CHUNK), 0x5A, np.uint8)
        assert writer.store(ns, keys[2:3], fresh).stored == 1
        assert reader.lookup(ns, keys[:3]).prefix_hits == 3
        assert reader.load(ns, keys[2:3], out[2:3]) == 1 and (out[2] == 0x5A).all()


def test_a_tenant_maps_only_its_own_namespaces_indexes_read_only(daemon, ns_name):
    keys = make_keys(ns_name, 4)
    with daemon.client() as a, daemon.client() as b:
        ns_a = a.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"tenant-a")
        ns_b = b.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"tenant-b")
        public = b.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert a.store(ns_a, keys, payloads(keys, CHUNK)).stored == 4
        assert a.lookup(ns_a, keys).prefix_hits == 4
        # B's own namespace (same model, same keys) holds none of A's chunks, in its index or anywhere.
        assert b.lookup(ns_b, keys).prefix_hits == 0
        assert b._session is not None
        index_b = b._session.index(ns_b.namespace_id)
        assert index_b is not None and index_b.holds(keys) == [False] * 4
        assert b.lookup(public, keys).prefix_hits == 0
        # B's session asking for A's namespace's index by its id is told it does not exist.
        b._session.map_index(ns_a.namespace_id)
        assert b._session.index(ns_a.namespace_id) is None
    # The same, by hand: NOT_FOUND, as for a namespace never registered; no fd comes with it.
    with connect(daemon.session_socket, 10.0) as sock:
        handshake = Handshake("intruder")
        session = PoolSession(sock, _welcomed(sock, handshake), populate=False)
        try:
            with pytest.raises(NotFound):
                handshake.index_from(*session._exchange(handshake.open_index(ns_a.namespace_id)))
            # A public namespace's index comes read-only: it cannot be mapped for writing.
            opened = handshake.index_from(*session._exchange(handshake.open_index(public.namespace_id)))
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(opened.fd, opened.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(opened.fd)
        finally:
            session.close()


def test_an_index_reopened_read_write_cannot_be_changed(daemon, ns_name):
    """A memfd can be reopened read-write through /proc: the table is sealed against that (a
    table truncated under the daemon killed it with SIGBUS; one whose empty slots a client
    filled hung its probes)."""
    keys = make_keys(ns_name, 8)
    with daemon.client() as kv, connect(daemon.session_socket, 10.0) as sock:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert kv.store(ns, keys[:4], payloads(keys[:4], CHUNK)).stored == 4
        handshake = Handshake("intruder")
        session = PoolSession(sock, _welcomed(sock, handshake), populate=False)
        try:
            opened = handshake.index_from(*session._exchange(handshake.open_index(ns.namespace_id)))
            rw = os.open(f"/proc/self/fd/{opened.fd}", os.O_RDWR)
            try:
                for change in (
                    lambda: os.ftruncate(rw, 0),
                    lambda: os.ftruncate(rw, 2 * opened.size),
                    lambda: os.pwrite(rw, b"\xff" * 4096, 0),
                    lambda: mmap.mmap(rw, opened.size, flags=mmap.MAP_SHARED),
                ):
                    with pytest.raises(PermissionError):
                        change()
                assert os.fstat(rw).st_size == opened.size
            finally:
                os.close(rw)
                os.close(opened.fd)
        finally:
            session.close()
        # The daemon kept its table and serves: stores, deletes and lookups through the index.
        assert kv.store(ns, keys[4:], payloads(keys[4:], CHUNK)).stored == 4
        kv.delete(ns, keys[:2])
        assert kv.lookup(ns, keys[2:]).prefix_hits == 6
        out = np.empty((6, CHUNK), np.uint8)
        assert kv.load(ns, keys[2:], out) == 6 and (out == payloads(keys[2:], CHUNK)).all()


def _welcomed(sock, handshake: Handshake) -> Handshake:
    handshake.welcome_from(*_exchange(sock, handshake.hello()))
    return handshake


def test_touches_count_in_the_metrics_of_a_daemon_serving_many_lookups(daemon, ns_name):
    """Touch over gRPC (the complete API) counts as the lookups it stands for."""
    keys = make_keys(ns_name, 3)
    with daemon.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert kv.store(ns, keys[:2], payloads(keys[:2], CHUNK)).stored == 2
        before = kv.stats().tiers[0]
        with daemon.channel() as channel:
            reply = pb_grpc.KVStoreStub(channel).Touch(
                pb.TouchRequest(namespace_id=ns.namespace_id, keys=keys), timeout=10
            )
        assert reply.hits == 2
        assert wait_for(lambda: kv.stats().tiers[0].lookups - before.lookups == 3)
        assert kv.stats().tiers[0].hits - before.hits == 2
