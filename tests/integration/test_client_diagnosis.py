# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The client says why it misses: one WARNING per change of condition naming the socket and the
reason (not found, refused, permission denied naming the group, daemon restarting), one INFO when
the daemon is back, in the blocking clients and in the vLLM driver alike; and a health check that
never raises. Real sockets, real daemons, and a client process running as another uid."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import stat
import threading
from pathlib import Path

import pytest

from kvstored_client import Client, DropReason, StoreResult
from kvstored_client.vllm.driver import DaemonLink, LinkOptions
from tests.support.another_user import NOBODY, OTHER_GROUP, group_only_socket_dir, run_script
from tests.support.daemon import short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.wait import wait_for

CHUNK = 64 << 10


def said(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name.startswith("kvstored_client")]


def test_a_wrong_socket_path_warns_once_naming_it(caplog):
    caplog.set_level(logging.INFO, logger="kvstored_client")
    sock = short_tmpdir() / "typo.sock"
    with Client(sock, deadline_s=1.0) as kv:
        ns = kv.register_namespace(model="diag/wrong-path", dtype="u8", chunk_bytes=CHUNK)
        for _ in range(3):
            assert kv.lookup(ns, make_keys("wrong-path", 2)).prefix_hits == 0
        health = kv.health()
    assert (health.status, health.serving) == ("UNREACHABLE", False)
    assert health.reason.startswith(f"not found: {sock}: no such socket")
    [warning] = said(caplog, logging.WARNING)  # one, however many calls missed
    assert f"kvstored at {sock} is unreachable: not found" in warning
    assert "lookups miss and stores are dropped" in warning
    sock.parent.rmdir()


def test_a_stopped_daemon_is_refused_then_reachable_again_then_not_found(daemon, ns_name, caplog):
    caplog.set_level(logging.INFO, logger="kvstored_client")
    keys = make_keys("diag-stop", 1)
    with daemon.client(deadline_s=1.0) as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert kv.health().serving and kv.health().reason == ""
        assert not said(caplog, logging.WARNING) and not said(caplog, logging.INFO)

        daemon.kill()  # its socket files stay: connections are refused
        for _ in range(2):
            assert kv.lookup(ns, keys).prefix_hits == 0
        assert kv.health().reason.startswith(f"refused: {daemon.socket}: nothing listens on it")
        [refused] = said(caplog, logging.WARNING)
        assert f"kvstored at {daemon.socket} is unreachable: refused" in refused

        daemon.start()
        assert kv.lookup(ns, keys).prefix_hits == 0  # served (nothing stored): reachable
        assert said(caplog, logging.INFO)[-1] == f"kvstored at {daemon.socket} is reachable again (was refused)"
        assert kv.health().serving

        daemon.stop()  # a clean stop removes the sockets
        assert kv.lookup(ns, keys).prefix_hits == 0
        assert "unreachable: not found" in said(caplog, logging.WARNING)[-1]
        assert len(said(caplog, logging.WARNING)) == 2


async def test_the_async_client_says_the_same(daemon, ns_name, caplog):
    caplog.set_level(logging.INFO, logger="kvstored_client")
    async with daemon.async_client(deadline_s=1.0) as kv:
        ns = await kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert (await kv.health()).serving
        daemon.kill()
        assert (await kv.lookup(ns, make_keys("diag-async", 1))).prefix_hits == 0
        assert (await kv.health()).reason.startswith("refused:")
        assert len(said(caplog, logging.WARNING)) == 1


# -- stores a busy daemon misses ----------------------------------------------------------------------


@contextlib.contextmanager
def paused(daemon):
    """The daemon serving but answering nothing (as one far behind under load): SIGSTOP."""
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(daemon.pid, signal.SIGCONT)


def dropped_lines(caplog) -> list[str]:
    return [line for line in said(caplog, logging.WARNING) if "stores dropped" in line]


def test_a_store_a_busy_daemon_misses_says_why_in_the_reply_and_one_warning(daemon, ns_name, caplog):
    """The issue's quickstart under load: `dropped=16` and nothing logged. Now the reply says
    unavailable per key and the client logs one WARNING naming the deadline, however many
    stores miss it within 10 s; the link itself stays healthy (no unreachable line)."""
    caplog.set_level(logging.INFO, logger="kvstored_client")
    first, keys = make_keys("busy-first", 1), make_keys("busy", 4)
    # (Slots reserved ahead would let the store copy and post its Commit without an answer.)
    with daemon.client(deadline_s=0.5, store_ahead=False) as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert kv.store(ns, first, payloads(first, CHUNK)) == StoreResult(stored=1)  # session open
        with paused(daemon):
            result = kv.store(ns, keys, payloads(keys, CHUNK))
        assert result == StoreResult(dropped=4) and result.drop_reasons == (DropReason.UNAVAILABLE,) * 4
        assert str(result) == "StoreResult(stored=0, already_present=0, dropped=4 (unavailable=4))"
        [line] = dropped_lines(caplog)
        assert line.startswith(f"kvstored at {daemon.socket}: stores dropped 4 chunk(s) (unavailable): ")
        assert "did not answer within the 0.5 s deadline" in line and "a larger deadline_s" in line
        assert kv.store(ns, keys, payloads(keys, CHUNK)) == StoreResult(stored=4)  # back: stored, no line
    assert len(dropped_lines(caplog)) == 1 and not any("unreachable" in w for w in said(caplog, logging.WARNING))


async def test_the_async_client_logs_a_busy_daemons_dropped_store_the_same(daemon, ns_name, caplog):
    caplog.set_level(logging.INFO, logger="kvstored_client")
    first, keys = make_keys("busy-async-first", 1), make_keys("busy-async", 3)
    async with daemon.async_client(deadline_s=0.5) as kv:
        ns = await kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert await kv.store(ns, first, payloads(first, CHUNK)) == StoreResult(stored=1)
        with paused(daemon):
            result = await kv.store(ns, keys, payloads(keys, CHUNK))
        assert result.dropped_by_reason == {DropReason.UNAVAILABLE: 3}
        [line] = dropped_lines(caplog)
        assert f"kvstored at {daemon.socket}: stores dropped 3 chunk(s) (unavailable)" in line
        assert "0.5 s deadline" in line
        assert await kv.store(ns, keys, payloads(keys, CHUNK)) == StoreResult(stored=3)


# -- the vLLM driver ---------------------------------------------------------------------------------

FAST = LinkOptions(connect_timeout_s=1.0, backoff_min_s=0.001, backoff_max_s=0.001)


def poll_until(link: DaemonLink, predicate) -> None:
    assert wait_for(lambda: (link.poll(), predicate())[1]), link.counters


def test_the_vllm_driver_warns_once_per_condition_and_says_when_it_is_back(daemon_factory, caplog):
    caplog.set_level(logging.INFO, logger="kvstored_client")
    d = daemon_factory(start=False)
    link = DaemonLink(d.socket, "diag-driver", options=FAST)
    poll_until(link, lambda: link.counters.failures >= 5)  # many tries, one warning
    [missing] = said(caplog, logging.WARNING)
    assert f"kvstored at {d.socket} is unreachable: not found" in missing

    d.start()
    poll_until(link, lambda: link.ready)
    assert said(caplog, logging.INFO) == [f"kvstored at {d.socket} is reachable again (was not found)"]

    d.kill()
    poll_until(link, lambda: link.counters.failures >= 10)
    assert "unreachable: refused" in said(caplog, logging.WARNING)[-1]
    assert len(said(caplog, logging.WARNING)) == 2
    link.close()


def test_the_vllm_driver_names_a_daemon_that_accepts_but_does_not_serve(tmp_path, caplog):
    """Both sockets accept connections, and the session socket closes each one at once (what a
    stopping or restarting daemon does): "daemon restarting", not a miss without a word."""
    caplog.set_level(logging.INFO, logger="kvstored_client")
    path = tmp_path / "kv.sock"
    grpc_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    grpc_sock.bind(str(path))
    grpc_sock.listen(8)
    session = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session.bind(f"{path}.session")
    session.listen(8)
    stop = threading.Event()

    def close_each() -> None:
        session.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = session.accept()
            except TimeoutError:
                continue
            conn.close()

    closer = threading.Thread(target=close_each, daemon=True)
    closer.start()
    link = DaemonLink(path, "diag-restarting", options=FAST)
    try:
        poll_until(link, lambda: link.counters.failures >= 3)
        [warning] = said(caplog, logging.WARNING)
        assert f"kvstored at {path} is unreachable: daemon restarting: {path} accepts connections" in warning
    finally:
        stop.set()
        closer.join(10)
        link.close()
        session.close()
        grpc_sock.close()


# -- another user --------------------------------------------------------------------------------------

# Runs as root long enough to import everything (the interpreter lives under /root, which other
# users cannot read), then becomes nobody with the given supplementary groups.
AS_ANOTHER_USER = """
import json, logging, os, sys
from kvstored_client import Client
from kvstored_client.keys import chunk_keys

records = []
logging.basicConfig(level=logging.INFO)
logging.getLogger().addHandler(type("Keep", (logging.Handler,), {"emit": lambda self, r: records.append(
    [r.levelname, r.getMessage()])})())
sock, groups, uid = sys.argv[1], [int(g) for g in sys.argv[2].split(",") if g], int(sys.argv[3])
os.setgroups(groups)
os.setgid(uid)
os.setuid(uid)
with Client(sock, deadline_s=2.0) as kv:
    ns = kv.register_namespace(model="diag/other-user", dtype="u8", chunk_bytes=65536)
    hits = [kv.lookup(ns, [bytes(32)]).prefix_hits for _ in range(3)]
    health = kv.health()
print(json.dumps({"hits": hits, "health": [health.status, health.reason],
                  "log": [r for r in records if r[1].startswith("kvstored at")]}))
"""


def as_nobody(sock: Path, groups: list[int]) -> dict:
    return run_script(AS_ANOTHER_USER, str(sock), ",".join(map(str, groups)), str(NOBODY))


@pytest.fixture
def group_socket_dir():
    """A socket directory owned by root and group OTHER_GROUP, set-group-id so the daemon's
    sockets get that group (as /run/kvstored gets the kvstored group under systemd)."""
    if os.geteuid() != 0:
        pytest.fail("this test runs a client as another uid: it needs root", pytrace=False)
    yield group_only_socket_dir("kvgrp")


@pytest.mark.root
def test_a_user_outside_the_sockets_group_is_told_which_group(daemon_factory, group_socket_dir):
    group = __import__("grp").getgrgid(OTHER_GROUP).gr_name
    d = daemon_factory(socket=group_socket_dir / "kv.sock")
    assert d.socket.stat().st_gid == OTHER_GROUP and stat.S_IMODE(d.socket.stat().st_mode) == 0o660

    # The directory is 0750: nobody cannot even look into it.
    out = as_nobody(d.socket, groups=[])
    assert out["hits"] == [0, 0, 0] and out["health"][0] == "UNREACHABLE"
    assert out["health"][1] == (
        f"permission denied: not in group {group} (directory {group_socket_dir}: mode 2750, owner root, group {group})"
    )
    [[level, message]] = out["log"]
    assert level == "WARNING" and message.startswith(
        f"kvstored at {d.socket} is unreachable: permission denied: not in group {group}"
    )

    # The directory is open, the socket is 0660 root:group.
    os.chmod(group_socket_dir, 0o2755)
    out = as_nobody(d.socket, groups=[])
    assert out["health"][1] == (
        f"permission denied: not in group {group} (socket {d.socket}: mode 0660, owner root, group {group})"
    )
    assert len(out["log"]) == 1

    # In the group: served, and nothing to say.
    os.chmod(group_socket_dir, 0o2750)
    out = as_nobody(d.socket, groups=[OTHER_GROUP])
    assert out == {"hits": [0, 0, 0], "health": ["SERVING", ""], "log": []}
