# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Who the peers are and how each one is doing: the static list and DNS, this daemon's own
address, metrics labels, and the per-peer breaker (a fake clock: counted, not timed)."""

from __future__ import annotations

from kvstored.io.breaker import BreakerState, CircuitBreaker
from kvstored.peer.membership import MAX_PEER_LABELS, OTHER_LABEL, Membership
from kvstored.peer.transport import PeerAddress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_breaker_opens_after_consecutive_failures_and_lets_one_probe_through():
    clock = Clock()
    b = CircuitBreaker(3, 5.0, clock)
    for _ in range(2):
        b.record(b.allow(), False)
    b.record(b.allow(), True)  # an answer resets the count
    for _ in range(3):
        b.record(b.allow(), False)
    assert b.state is BreakerState.OPEN and not b.would_allow() and b.allow() is None
    clock.now = 5.0
    assert b.state is BreakerState.HALF_OPEN and b.would_allow()
    probe = b.allow()
    assert probe is not None and probe.probe
    assert not b.would_allow() and b.allow() is None  # one probe at a time
    b.record(probe, False)  # a failed probe opens it for another period
    assert b.state is BreakerState.OPEN and b.times_opened == 1
    clock.now = 10.0
    b.record(b.allow(), True)
    assert b.state is BreakerState.CLOSED and b.would_allow()


def test_a_probe_whose_caller_gave_up_gives_its_turn_back():
    clock = Clock()
    b = CircuitBreaker(1, 1.0, clock)
    b.record(b.allow(), False)
    clock.now = 1.0
    probe = b.allow()
    assert probe is not None and not b.would_allow()
    b.abandon(probe)
    assert b.would_allow()


def test_a_peer_restarted_as_a_new_process_starts_with_its_breaker_closed():
    clock = Clock()
    m = Membership(["127.0.0.1:7072"], "", 1, 60.0, clock)
    record = m.records()[0]
    record.breaker.record(record.breaker.allow(), False)
    assert record.breaker.state is BreakerState.OPEN
    record.breaker.reset()
    assert record.breaker.state is BreakerState.CLOSED and record.breaker.allow() is not None


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


def test_holders_found_in_the_directory_are_fetched_from_not_followed_and_dns_leaves_them_alone():
    m = Membership(["10.0.0.2:7070"], "10.0.0.1:7070", 3, 5.0)
    found = m.add_found(PeerAddress("10.0.0.9", 7070))
    assert found is not None and not found.follows and not found.static
    assert m.add_found(PeerAddress("10.0.0.9", 7070)) is None  # already there
    assert m.add_found(PeerAddress("10.0.0.2", 7070)) is None  # a configured peer stays followed
    assert m.add_found(PeerAddress("10.0.0.1", 7070)) is None  # this daemon
    added, gone = m.update_dns([PeerAddress("10.0.0.5", 7070)])
    assert [r.address for r in added] == [PeerAddress("10.0.0.5", 7070)] and gone == []  # DNS keeps found ones
    assert m.drop_found(PeerAddress("10.0.0.2", 7070)) is None  # only found ones are dropped
    assert m.drop_found(PeerAddress("10.0.0.9", 7070)) is found
    assert PeerAddress("10.0.0.9", 7070) not in m.peers
