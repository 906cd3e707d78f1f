# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The peer data plane between two processes: a serving node and a fetching node
(tests/peer/node.py), on loopback and in two network namespaces joined by a bridge.

Every chunk a fetcher reports RECEIVED is compared byte for byte with the content the server
holds. Faults hit a fetcher that keeps 4 transfers in flight, each with a 1 s timeout; the
assertions are the data plane's contract: transfers end in a clean outcome (no exception, no
hang: every wait here is bounded), no slot stays quarantined, the server's leases all come back,
and the fetcher gets going again by itself once the peer is back.
"""

from __future__ import annotations

import signal

import pytest

from tests.peer.conftest import TRANSPORTS
from tests.peer.harness import FetchNode, ServerNode, failures

pytestmark = pytest.mark.slow

GIB_OF_CHUNKS = 512  # 2 MiB chunks
FAULT_CHUNKS = 64
FETCH_ARGS = ["--quiet", "--progress-every", "4", "--timeout-s", "1.0", "--connect-timeout-s", "0.5", "--batch", "2"]
CLEAN_FAILURES = {"failed", "timed_out"}


@pytest.fixture(params=[*TRANSPORTS, "tcp-threads"])
def transport(request) -> str:
    """UCX, TCP on the event loop, TCP in data threads (node.py --transport tcp-threads)."""
    return request.param


def check_clean(summary: dict) -> None:
    assert summary["exceptions"] == 0
    assert summary["wrong"] == 0, "a chunk reported received held the wrong bytes"
    assert summary["quarantined"] == 0 and summary["unsettled"] == 0
    assert summary["free_slots"] == summary["slots"], "a slot was never handed back"
    assert summary["connections_after_close"] == 0


def fetch_gib(transport: str, server_node, fetch_node) -> None:
    server = ServerNode(transport, server_node, chunks=GIB_OF_CHUNKS)
    try:
        fetcher = FetchNode(
            transport,
            fetch_node,
            server,
            chunks=GIB_OF_CHUNKS,
            once=True,
            extra=["--quiet", "--progress-every", "64", "--timeout-s", "10", "--batch", "4"],
        )
        summary = fetcher.summary()
        assert fetcher.exit_code() == 0, fetcher.describe()
        assert summary["counts"] == {"received": GIB_OF_CHUNKS}, summary
        check_clean(summary)
        stats = server.wait_settled()
        assert stats["counters"]["sent"] == GIB_OF_CHUNKS
        assert stats["counters"]["sent_bytes"] == GIB_OF_CHUNKS << 21
        assert server.stop() == 0, server.describe()
    finally:
        server.kill()


def test_gib_loopback(transport):
    fetch_gib(transport, None, None)


@pytest.mark.netns
@pytest.mark.root
def test_gib_across_namespaces(net, transport):
    fetch_gib(transport, net.nodes[0], net.nodes[1])


def test_missing_chunks_are_refused_in_band(transport):
    """Chunks the server does not hold end MISSING on the data path itself: the connection
    (TCP) or endpoint (UCX) stays usable, so the hits after them need no reconnect."""
    server = ServerNode(transport, None, chunks=8)
    try:
        fetcher = FetchNode(transport, None, server, chunks=16, once=True, extra=["--concurrency", "1"])
        summary = fetcher.summary()
        assert summary["counts"] == {"received": 8, "missing": 8}, summary
        check_clean(summary)
        assert summary["link"]["connects"] == 1
        assert server.wait_settled()["counters"]["refused"] == 8
    finally:
        server.kill()


@pytest.mark.netns
@pytest.mark.root
@pytest.mark.parametrize("fault", ["sigkill", "sigstop", "link_down", "restart"])
def test_server_fault_mid_transfer(net, transport, fault):
    server_node, fetch_node = net.nodes
    server = ServerNode(transport, server_node, chunks=FAULT_CHUNKS)
    servers = [server]
    try:
        fetcher = FetchNode(transport, fetch_node, server, chunks=FAULT_CHUNKS, once=False, extra=FETCH_ARGS)
        fetcher.received(8)  # flowing: transfers are in flight from here on
        mark = len(fetcher.events)
        if fault == "sigkill":
            server.signal(signal.SIGKILL)
            fetcher.failure(after=mark)
            server = ServerNode(
                transport,
                server_node,
                chunks=FAULT_CHUNKS,
                data_port=server.data_port,
                control_port=server.control_port,
            )
            servers.append(server)
        elif fault == "restart":  # a new incarnation on the same ports, before the fetcher notices
            server.signal(signal.SIGKILL)
            server.exit_code()
            server = ServerNode(
                transport,
                server_node,
                chunks=FAULT_CHUNKS,
                data_port=server.data_port,
                control_port=server.control_port,
            )
            servers.append(server)
            fetcher.failure(after=mark)
        elif fault == "sigstop":
            server.signal(signal.SIGSTOP)
            fetcher.failure(after=mark)
            server.signal(signal.SIGCONT)
        else:
            net.cut(server_node)
            fetcher.failure(after=mark)
            net.restore(server_node)
        healed = len(fetcher.events)
        received_before = max(e["received"] for e in fetcher.events if e["event"] == "progress")
        fetcher.received(received_before + 8, after=healed)  # it rejoined by itself
        summary = fetcher.stop()
        assert fetcher.exit_code() == 0, fetcher.describe()
        check_clean(summary)
        outcomes = {e.get("outcome") for e in failures(fetcher.events)}
        assert outcomes and outcomes <= CLEAN_FAILURES, outcomes
        stats = server.wait_settled()  # every lease came back, nothing quarantined
        assert stats["counters"]["sent"] > 0
        assert server.stop() == 0, server.describe()
    finally:
        for s in servers:
            s.kill()


@pytest.mark.netns
@pytest.mark.root
def test_fetcher_killed_mid_transfer(net, transport):
    """The serving side after its fetcher dies: sends end, leases come back, the link goes."""
    server_node, fetch_node = net.nodes
    server = ServerNode(transport, server_node, chunks=FAULT_CHUNKS)
    try:
        fetcher = FetchNode(transport, fetch_node, server, chunks=FAULT_CHUNKS, once=False, extra=FETCH_ARGS)
        fetcher.received(8)
        fetcher.signal(signal.SIGKILL)
        fetcher.exit_code()
        stats = server.wait_settled()
        assert stats["counters"]["sent"] > 0
        server.wait_stats(lambda s: s["links"] == 0, "dropped the dead fetcher's links")
        assert server.stop() == 0, server.describe()
    finally:
        server.kill()
