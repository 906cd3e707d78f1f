# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Who the peers are and how each one is doing: the static list and DNS, this daemon's own
address, metrics labels, and the per-peer breaker (a fake clock: counted, not timed)."""

from __future__ import annotations

from kvstored.peer.membership import MAX_PEER_LABELS, OTHER_LABEL, Breaker, BreakerState, Membership
from kvstored.peer.transport import PeerAddress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_lets_one_probe_through():
    clock = Clock()
    b = Breaker(3, 5.0, clock)
    for _ in range(2):
        assert b.begin()
        b.failure()
    b.begin()
    b.success()  # an answer resets the count
    for _ in range(3):
        assert b.begin()
        b.failure()
    assert b.state is BreakerState.OPEN and not b.available() and not b.begin()
    clock.now = 5.0
    assert b.state is BreakerState.HALF_OPEN and b.available()
    assert b.begin()  # the probe
    assert not b.available() and not b.begin()  # one at a time
    b.failure()  # a failed probe opens it for another period
    assert b.state is BreakerState.OPEN and b.opened == 2
    clock.now = 10.0
    assert b.begin()
    b.success()
    assert b.state is BreakerState.CLOSED and b.available()


def test_a_probe_whose_caller_gave_up_gives_its_turn_back():
    clock = Clock()
    b = Breaker(1, 1.0, clock)
    b.begin()
    b.failure()
    clock.now = 1.0
    assert b.begin() and not b.available()
    b.cancelled()
    assert b.available()


def test_the_static_list_skips_this_daemons_own_address_and_duplicates():
    m = Membership(["127.0.0.1:7071", "127.0.0.1:7072", "127.0.0.1:7073", "127.0.0.1:7072"], "127.0.0.1:7071", 3, 5)
    assert [str(r.address) for r in m.records()] == ["127.0.0.1:7072", "127.0.0.1:7073"]
    v6 = Membership(["[::1]:7070"], "", 3, 5)
    assert v6.records()[0].address == PeerAddress("::1", 7070)


def test_dns_adds_and_removes_peers_but_never_static_ones():
    m = Membership(["10.0.0.9:7070"], "10.0.0.1:7070", 3, 5)
    added, gone = m.update_dns({PeerAddress("10.0.0.1", 7070), PeerAddress("10.0.0.2", 7070)})
    assert [str(r.address) for r in added] == ["10.0.0.2:7070"] and gone == []  # its own skipped
    added, gone = m.update_dns({PeerAddress("10.0.0.3", 7070)})
    assert [str(r.address) for r in added] == ["10.0.0.3:7070"]
    assert [str(r.address) for r in gone] == ["10.0.0.2:7070"]
    assert sorted(str(r.address) for r in m.records()) == ["10.0.0.3:7070", "10.0.0.9:7070"]


def test_metrics_labels_are_bounded():
    m = Membership([], "", 3, 5)
    m.update_dns({PeerAddress(f"10.0.{i // 250}.{i % 250 + 1}", 7070) for i in range(MAX_PEER_LABELS + 10)})
    labels = [r.label for r in m.records()]
    assert len({label for label in labels if label != OTHER_LABEL}) == MAX_PEER_LABELS
    assert labels.count(OTHER_LABEL) == 10
