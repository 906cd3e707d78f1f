# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Fixtures for the peer data plane tests: the transports to run and a two-node network-namespace
topology. Neither is ever skipped: `make test` installs ucxx (the dev extra) and runs as root (CI
does); where either is missing the tests fail, saying what is missing."""

from __future__ import annotations

import pytest

from kvstored.peer.ucx_runtime import ucx_installed
from tests.support import netns
from tests.support.needs import Needs, require

TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.ucxx)]


@pytest.fixture(autouse=True)
def _ucx_present(request):
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if "ucx" in params.values():
        require(Needs.UCXX)
    if "ucx" in params.values() and not ucx_installed():
        pytest.fail("ucxx is not installed (make test installs it with the dev extra)", pytrace=False)


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def net():
    with netns.topology_or_fail(2) as topology:
        yield topology
