# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The session socket under hostile or unlucky clients: the daemon leaks nothing and keeps accepting."""

from __future__ import annotations

import os
import resource
import socket
import tempfile
import time

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from tests.support.wait import wait_for


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def hello(path) -> pb.SessionReply:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.send(pb.SessionRequest(hello=pb.Hello(client_name="probe")).SerializeToString())
        data, fds, _, _ = socket.recv_fds(s, 65536, 4)
        for fd in fds:
            os.close(fd)
        return pb.SessionReply.FromString(data)


def test_empty_packets_carrying_fds_leak_none(daemon):

    before = open_fds(daemon.pid)
    with tempfile.TemporaryFile() as f:
        for _ in range(30):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect(str(daemon.session_socket))
                socket.send_fds(s, [b""], [f.fileno()] * 4)
    assert wait_for(lambda: open_fds(daemon.pid) <= before), (
        f"daemon holds {open_fds(daemon.pid)} fds, {before} before 30 empty packets with 4 fds each"
    )
    assert hello(daemon.session_socket).WhichOneof("kind") == "welcome"


def test_running_out_of_fds_does_not_stop_accepting(daemon):

    limit = open_fds(daemon.pid) + 8
    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (limit, limit))
    held = []
    try:
        for _ in range(16):  # idle connections past the daemon's fd limit: accept() fails with EMFILE
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(str(daemon.session_socket))
            held.append(s)
        assert wait_for(lambda: "cannot accept a connection" in daemon.log)
        time.sleep(1.0)  # ten retries' worth: logged once, not once per retry
        assert daemon.log.count("cannot accept a connection") == 1, daemon.log
    finally:
        for s in held:
            s.close()
    assert wait_for(lambda: open_fds(daemon.pid) < limit - 2)
    assert hello(daemon.session_socket).WhichOneof("kind") == "welcome"
    daemon.stop()  # and it still shuts down cleanly (exit 0)


def test_a_sessions_liveness_check_runs_from_many_threads_and_sees_the_daemon_end_it(daemon_factory):
    """Copies check their session before (or after) touching the pool, in threads of their own
    (the async client's large copies): the check must work from several at once, and say
    Unavailable once the daemon has ended the session."""
    import threading

    import pytest

    from kvstored_client.errors import Unavailable
    from kvstored_client.session import PoolSession

    d = daemon_factory()
    session = PoolSession.open(d.socket, "liveness", timeout=10.0)
    failures: list[BaseException] = []

    def check() -> None:
        try:
            for _ in range(20_000):
                session.check_alive()
        except BaseException as exc:  # noqa: BLE001 (the test reports whatever it was)
            failures.append(exc)

    try:
        threads = [threading.Thread(target=check) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert failures == []
        d.stop()  # the daemon ends every session
        with pytest.raises(Unavailable, match="ended this session"):
            session.check_alive()
    finally:
        session.close()
    with pytest.raises(Unavailable, match="session is closed"):  # closed on this side too
        session.check_alive()
