# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The client's sans-IO session protocol: message order, fd ownership, backoff, fork detection.
(Talking to a real daemon through it: tests/integration and tests/vllm.)"""

from __future__ import annotations

import os

import pytest

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.errors import InvalidArgument, Unavailable
from kvstored_client.protocol import Backoff, ForkGuard, Handshake


def fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


@pytest.fixture
def fds():
    opened: list[int] = []

    def make(n: int) -> list[int]:
        new = [os.open(os.devnull, os.O_RDONLY) for _ in range(n)]
        opened.extend(new)
        return new

    yield make
    for fd in opened:
        if fd_open(fd):
            os.close(fd)


def welcome(session_id: str = "s1") -> bytes:
    return pb.SessionReply(
        welcome=pb.Welcome(session_id=session_id, pool_bytes=1 << 20, page_bytes=4096)
    ).SerializeToString()


def test_hello_welcome_attach_in_order(fds):
    hs = Handshake("me")
    with pytest.raises(RuntimeError, match="out of order"):
        hs.attach_region("r", 0)  # not welcomed yet
    hello = hs.hello()
    assert pb.SessionRequest.FromString(hello.data).hello.client_name == "me" and hello.fds == ()
    (pool_fd,) = fds(1)
    got = hs.welcome_from(welcome(), [pool_fd])
    assert (got.session_id, got.pool_bytes, got.page_bytes, got.pool_fd) == ("s1", 1 << 20, 4096, pool_fd)
    assert fd_open(pool_fd)  # the caller's now
    with pytest.raises(RuntimeError, match="out of order"):
        hs.hello()  # one session per handshake

    attach = hs.attach_region("region", 7)
    assert attach.fds == (7,) and pb.SessionRequest.FromString(attach.data).attach_region.name == "region"
    stray = fds(1)
    reply = pb.SessionReply(region_attached=pb.RegionAttached(region_id=3, size=99)).SerializeToString()
    attached = hs.attached_from(reply, stray)
    assert (attached.region_id, attached.size) == (3, 99)
    assert not fd_open(stray[0])  # an fd the reply does not carry is closed


def test_a_refused_region_raises_its_error_and_leaves_the_session_usable(fds):
    hs = Handshake("me")
    hs.hello()
    hs.welcome_from(welcome(), fds(1))
    hs.attach_region("empty", 5)
    extra = fds(2)
    error = pb.SessionReply(error=pb.SessionError(code="INVALID_ARGUMENT", message="region is empty"))
    with pytest.raises(InvalidArgument, match="region is empty"):
        hs.attached_from(error.SerializeToString(), extra)
    assert not any(fd_open(fd) for fd in extra)
    hs.attach_region("next", 6)  # the session goes on


@pytest.mark.parametrize(
    ("data", "n_fds", "message"),
    [
        (b"", 1, "closed the session"),
        (b"\xff\xff\xff", 1, "undecodable"),
        (welcome(), 0, "unexpected session reply"),  # a Welcome must carry the pool
        (welcome(), 2, "unexpected session reply"),
        (pb.SessionReply(region_attached=pb.RegionAttached(region_id=1)).SerializeToString(), 1, "unexpected"),
    ],
)
def test_a_bad_welcome_is_unavailable_and_closes_its_fds(fds, data, n_fds, message):
    hs = Handshake("me")
    hs.hello()
    got = fds(n_fds)
    with pytest.raises(Unavailable, match=message):
        hs.welcome_from(data, got)
    assert not any(fd_open(fd) for fd in got)


def test_backoff_doubles_up_to_its_cap_and_resets_on_success():
    backoff = Backoff(0.05, 0.2)
    assert backoff.due(0.0)
    for now, delay in ((10.0, 0.05), (20.0, 0.1), (30.0, 0.2), (40.0, 0.2)):
        backoff.failed(now)
        assert not backoff.due(now + delay - 0.001) and backoff.due(now + delay), (now, delay)
    backoff.failed(50.0, wait=False)  # a restart: at once, and the next delay does not grow
    assert backoff.due(50.0)
    backoff.failed(60.0)
    assert not backoff.due(60.199) and backoff.due(60.2)
    backoff.succeeded()
    backoff.failed(70.0)
    assert not backoff.due(70.049) and backoff.due(70.05)
    backoff.skip()
    assert backoff.due(70.0)


def test_fork_guard_fires_once_in_the_child_only():
    guard = ForkGuard()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, bytes([guard.forked(), guard.forked()]))
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 2) == bytes([True, False])
    os.close(read)
    os.waitpid(pid, 0)
    assert guard.forked() is False


# -- reachability and the health check's wire format ------------------------------------------------


def test_link_health_logs_each_change_of_condition_once(caplog):
    import logging

    from kvstored_client.protocol import Condition, LinkHealth, Reason

    caplog.set_level(logging.INFO, logger="kvstored_client")
    health = LinkHealth("/run/x.sock")
    gone = Condition(Reason.NOT_FOUND, "/run/x.sock: no such socket")
    health.reachable()  # never down: nothing to say
    for _ in range(3):
        health.unreachable(gone)
    health.unreachable(Condition(Reason.REFUSED, "/run/x.sock: nothing listens on it"))
    health.reachable()
    health.reachable()
    assert [(r.levelname, r.getMessage().split(";")[0]) for r in caplog.records] == [
        ("WARNING", "kvstored at /run/x.sock is unreachable: not found: /run/x.sock: no such socket"),
        ("WARNING", "kvstored at /run/x.sock is unreachable: refused: /run/x.sock: nothing listens on it"),
        ("INFO", "kvstored at /run/x.sock is reachable again (was refused)"),
    ]


def test_health_responses_decode_as_grpc_health_encodes_them():
    from grpc_health.v1 import health_pb2

    from kvstored_client.protocol import decode_health_response, encode_health_request

    assert encode_health_request() == health_pb2.HealthCheckRequest(service="").SerializeToString()
    for name, value in health_pb2.HealthCheckResponse.ServingStatus.items():
        assert decode_health_response(health_pb2.HealthCheckResponse(status=value).SerializeToString()) == name


@pytest.mark.parametrize(
    "flags, served",
    [
        ({}, set()),
        ({"fast_path": True}, {"Lookup", "Reserve", "Commit", "Acquire", "Release"}),
        (
            {"fast_path": True, "fast_regions": True},
            {"Lookup", "Reserve", "Commit", "Acquire", "Release", "StoreFromRegion", "LoadToRegion"},
        ),
        ({"fast_path": True, "fast_delete": True}, {"Lookup", "Reserve", "Commit", "Acquire", "Release", "Delete"}),
    ],
)
def test_the_welcome_says_which_calls_the_fast_path_carries(fds, flags, served):
    """An older daemon (no fast_regions, no fast_delete) is sent only what it answers there."""
    hs = Handshake("me")
    hs.hello()
    reply = pb.SessionReply(welcome=pb.Welcome(session_id="s", pool_bytes=1 << 20, page_bytes=4096, **flags))
    got = hs.welcome_from(reply.SerializeToString(), fds(1))
    methods = {
        "Lookup",
        "Reserve",
        "Commit",
        "Acquire",
        "Release",
        "StoreFromRegion",
        "LoadToRegion",
        "Delete",
        "Stats",
        "RegisterNamespace",
    }
    assert {m for m in methods if got.serves_fast(m)} == served
