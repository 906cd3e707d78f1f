"""Fixtures for the peer data plane tests: the transports to run (UCX only where ucxx is
installed) and a two-node network-namespace topology (only as root)."""

from __future__ import annotations

import pytest

from kvstored.peer.ucx_runtime import ucx_installed
from tests.support import netns


def _transports() -> list:
    ucx = pytest.param("ucx", marks=pytest.mark.skipif(not ucx_installed(), reason="ucxx is not installed"))
    return ["tcp", ucx]


TRANSPORTS = _transports()


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def net():
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.Topology(nodes=2) as topology:
        yield topology
