# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Peers found through DNS (a Kubernetes headless Service's name resolves to every pod): three
daemons in network namespaces, each configured with only peers_dns and listening on 0.0.0.0 (so
only the handshake's incarnation tells a daemon that one of the addresses is its own), checking
the peers' certificate for a name (tls_server_name) rather than their addresses. The name's
addresses change while they run: a node added is found, a node removed is dropped."""

from __future__ import annotations

import numpy as np
import pytest

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from tests.support import netns
from tests.support.cluster import PEER_PORT, Cluster
from tests.support.data import make_keys, payloads

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.root]

NAME = "kvstored-peers"
CHUNK = 1 << 20


@pytest.fixture(scope="module")
def topology():
    with netns.topology_or_fail(3) as net:
        yield net


def states(d) -> dict[str, int]:
    return {p.address: p.state for p in d.status().peers}


def test_peers_come_and_go_with_the_names_addresses(topology):
    nodes = topology.nodes
    topology.hosts(NAME, nodes[:2])  # node 2 is not (yet) behind the name
    with Cluster(
        3,
        "tcp",
        net=topology,
        peers_dns=f"{NAME}:{PEER_PORT}",
        listen_any=True,
        # peers reached by IP, their certificate checked for the name it carries
        peer_options={"dns_interval_s": "0.2", "tls_server_name": "localhost"},
    ) as cluster:
        cluster.start()
        a, b, c = cluster
        cluster.wait_for(
            "node 0 finding itself and node 1",
            lambda: states(a) == {a.address: pb.PEER_STATE_SELF, b.address: pb.PEER_STATE_UP},
        )
        topology.hosts(NAME, nodes)  # a pod became ready
        cluster.wait_for("node 0 finding node 2", lambda: states(a).get(c.address) == pb.PEER_STATE_UP)

        keys = make_keys("dns", 4)
        with c.client() as kv:
            ns = kv.register_namespace(model="dns", dtype="u8", chunk_bytes=CHUNK)
            kv.store(ns, keys, payloads(keys, CHUNK))
        cluster.wait_indexed(0, 2, len(keys))
        with a.client() as kv:
            ns = kv.register_namespace(model="dns", dtype="u8", chunk_bytes=CHUNK)
            out = np.empty((len(keys), CHUNK), np.uint8)
            assert kv.load(ns, keys, out) == len(keys) and np.array_equal(out, payloads(keys, CHUNK))

        topology.hosts(NAME, [nodes[0], nodes[2]])  # node 1's pod went away
        cluster.wait_for("node 0 dropping node 1", lambda: b.address not in states(a))
        assert states(a) == {a.address: pb.PEER_STATE_SELF, c.address: pb.PEER_STATE_UP}
