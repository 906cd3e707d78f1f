# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Daemon lifecycle: clean SIGTERM/SIGINT shutdown, restart over stale sockets, refusing a live
socket, the command line (--help, config sources, config errors), socket permissions."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys

import numpy as np
import pytest

from kvstored.config import env_name, flag_name, options
from kvstored_client import Client, LookupResult, StoreResult
from tests.support.daemon import REPO_ROOT, Daemon, clean_env, kvstored_command, short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.rpc import RawConn, pb, raw, rpc_error

CHUNK = 64 << 10


def run_cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        kvstored_command() + list(args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(env),
        cwd=REPO_ROOT,
    )


def store_and_check(d: Daemon, model: str, n: int = 2) -> None:
    keys = make_keys(model, n)
    data = payloads(keys, CHUNK)
    with d.client() as c:
        ns = c.register_namespace(model=model, dtype="uint8", chunk_bytes=CHUNK)
        assert c.store(ns, keys, data).stored == n
        out = np.zeros_like(data)
        assert c.load(ns, keys, out) == n
        np.testing.assert_array_equal(out, data)


def test_sigterm_shuts_down_cleanly_with_clients_attached(daemon, ns_name):
    for path in (daemon.socket, daemon.session_socket):
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o660  # the default socket mode
    store_and_check(daemon, ns_name)
    keys = make_keys(ns_name, 1)
    c = daemon.client()
    r = RawConn(daemon.socket)
    try:
        # A client with a session, and a raw session holding a lease, when the signal arrives.
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert c.lookup(ns, keys).prefix_hits == 1
        r.register(ns_name, CHUNK)
        assert len(r.acquire(ns.namespace_id, keys)) == 1
        assert daemon.stats().leases == 1
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.wait() == 0, daemon.log
        assert not daemon.socket.exists()
        assert not daemon.session_socket.exists()
        assert "stopped" in daemon.log
        assert "Traceback" not in daemon.log, daemon.log
        # The client degrades instead of raising.
        assert c.lookup(ns, keys) == LookupResult.miss(1)
        assert c.store(ns, keys, payloads(keys, CHUNK)) == StoreResult(dropped=1)
    finally:
        r.close()
        c.close()


def test_stale_socket_files_after_sigkill_do_not_block_a_restart(daemon, ns_name):
    store_and_check(daemon, ns_name)
    daemon.kill()
    assert daemon.returncode == -signal.SIGKILL
    assert daemon.socket.exists() and daemon.session_socket.exists()  # left behind

    # Meanwhile a client degrades on the dead sockets (within its deadline).
    with Client(daemon.socket, deadline_s=0.5) as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        keys = make_keys(ns_name, 2)
        assert c.lookup(ns, keys) == LookupResult.miss(2)
        assert c.store(ns, keys, payloads(keys, CHUNK)) == StoreResult(dropped=2)
        assert c.load(ns, keys, np.zeros((2, CHUNK), np.uint8)) == 0

    daemon.start()  # same socket path
    assert "stale" in daemon.log
    store_and_check(daemon, ns_name + "/after")
    # SIGINT (Ctrl-C) stops it as cleanly as SIGTERM.
    daemon.proc.send_signal(signal.SIGINT)
    assert daemon.wait() == 0, daemon.log
    assert not daemon.socket.exists() and not daemon.session_socket.exists()


def test_second_daemon_on_a_live_socket_fails_clearly(daemon, ns_name):
    """(With hand-over off: with it on, the second daemon takes over, see test_handover.py.)"""
    store_and_check(daemon, ns_name)
    second = Daemon(daemon.socket)  # its own work dir (for its log), removed by cleanup()
    try:
        second.spawn(["--handover", "false"])
        rc = second.wait()
        assert rc != 0
        assert "already serving" in second.log and str(daemon.socket) in second.log, second.log
        assert "Traceback" not in second.log, second.log
    finally:
        second.cleanup()
    # The first daemon is untouched: its sockets are there and it still serves its data.
    assert daemon.running
    assert daemon.socket.exists() and daemon.session_socket.exists()
    keys = make_keys(ns_name, 2)
    with daemon.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        out = np.zeros((2, CHUNK), np.uint8)
        assert c.load(ns, keys, out) == 2
        np.testing.assert_array_equal(out, payloads(keys, CHUNK))


def test_a_regular_file_at_the_socket_path_is_not_deleted(daemon_factory):
    """kvstored must only ever remove a stale *socket*; a regular file in its place (a typo in
    --socket, say) must make it refuse to start, leaving the file alone."""
    d = daemon_factory(start=False)
    d.socket.write_text("precious data\n")
    d.spawn()
    started = _became_ready(d)
    rc = d.terminate() if started else d.returncode
    assert d.socket.exists() and d.socket.read_text() == "precious data\n", f"file deleted\n{d.log}"
    assert not started and rc != 0, d.log


def _became_ready(d: Daemon) -> bool:
    """True if the daemon came up; False if it exited first (its code is then in d.returncode)."""
    try:
        d.wait_ready()
        return True
    except AssertionError:
        if d.running:
            raise
        return False


def test_help_lists_every_option():
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    for f in options():
        assert flag_name(f.name) in out.stdout, f"{flag_name(f.name)} missing from --help"
        assert env_name(f.name) in out.stdout, f"{env_name(f.name)} missing from --help"
    assert "--config" in out.stdout


def test_python_dash_m_kvstored():
    out = subprocess.run(
        [sys.executable, "-m", "kvstored", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env=clean_env(),
    )
    assert out.returncode == 0, out.stderr
    assert "--cpu-bytes" in out.stdout
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("kvstored ")


@pytest.mark.parametrize(
    "args, env, fragment",
    [
        (["--cpu-bytes", "lots"], {}, "cpu_bytes"),
        (["--page-bytes", "1000"], {}, "page_bytes"),
        ([], {"KVSTORED_MAX_BATCH_KEYS": "zero"}, "KVSTORED_MAX_BATCH_KEYS"),
    ],
    ids=["flag", "validate", "env"],
)
def test_config_errors_exit_2_and_name_the_option(args, env, fragment):
    sock = short_tmpdir() / "never.sock"
    out = run_cli("serve", "--socket", str(sock), *args, env=env)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert fragment in out.stderr
    assert "Traceback" not in out.stderr
    assert not sock.exists()
    sock.parent.rmdir()


def test_config_from_flags_env_and_file_reaches_the_daemon(daemon_factory, ns_name):
    d = daemon_factory(start=False)
    toml = d.workdir / "kvstored.toml"
    toml.write_text('page_bytes = "128KiB"\nmax_batch_keys = 100\nlog_format = "text"\nsocket_mode = "600"\n')
    env = {
        "KVSTORED_CPU_BYTES": "4MiB",  # loses to the --cpu-bytes flag the helper passes (16MiB)
        "KVSTORED_MAX_BATCH_KEYS": "5",  # beats the file's 100
        "KVSTORED_LOG_FORMAT": "json",  # beats the file's "text"
    }
    d.start(["--config", str(toml)], env=env)
    with raw(d.socket) as r:
        resp = r.call(
            "RegisterNamespace",
            pb.RegisterNamespaceRequest(spec=pb.NamespaceSpec(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)),
        )
        assert resp.page_bytes == 128 << 10  # from the file
        assert resp.pool_bytes == 16 << 20  # from the flag
        assert r.stats().tiers[0].capacity_bytes == 16 << 20
        ok = r.call("Lookup", pb.LookupRequest(namespace_id=resp.namespace_id, keys=make_keys("b", 5)))
        assert len(ok.tiers) == 5
        err = rpc_error(r.call, "Lookup", pb.LookupRequest(namespace_id=resp.namespace_id, keys=make_keys("b", 6)))
        assert "max_batch_keys=5" in err.details()
    for path in (d.socket, d.session_socket):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, oct(path.stat().st_mode)
    lines = [line for line in d.log.splitlines() if line.strip()]
    assert lines and all(json.loads(line)["level"] for line in lines)  # JSON log lines


def test_handles_of_one_run_never_name_the_next_runs(daemon, ns_name):
    """A client that has not noticed a restart yet may send an old handle on its new session:
    it must be refused, never commit or release one of the new run's reservations."""

    def reserve(conn: RawConn) -> int:
        ns = conn.register(ns_name, CHUNK)
        slots = conn.call(
            "Reserve", pb.ReserveRequest(session_id=conn.session_id, namespace_id=ns, keys=make_keys(ns_name, 1))
        ).slots
        return slots[0].handle

    with raw(daemon.socket) as before:
        old = reserve(before)
    daemon.stop()
    daemon.start()
    with raw(daemon.socket) as after:
        new = reserve(after)
        assert new != old
        err = rpc_error(after.call, "Commit", pb.CommitRequest(session_id=after.session_id, handles=[old]))
        assert err.code().name == "FAILED_PRECONDITION"
        assert after.stats().reservations == 1  # the new reservation is untouched
        assert after.call("Commit", pb.CommitRequest(session_id=after.session_id, handles=[new])).committed == 1


def test_sigterm_while_a_tier_is_starting_stops_at_once(daemon_factory, tmp_path):
    """An S3 endpoint that accepts connections but never answers keeps the tier starting for its
    whole timeout; a stop requested meanwhile must not wait for it."""
    import socket
    import time

    black_hole = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    black_hole.bind(("127.0.0.1", 0))
    black_hole.listen(64)  # connections queue up, nothing is ever read
    port = black_hole.getsockname()[1]
    d = daemon_factory(start=False)
    try:
        d.spawn(
            [
                "--tiers",
                f"kind=s3,bucket=b,endpoint_url=http://127.0.0.1:{port},timeout_s=120,access_key=k,secret_key=s",
            ]
        )
        deadline = time.monotonic() + 60
        while "RAM tier" not in d.log:  # past the pool, into the tiers' start
            assert d.proc.poll() is None, d.log
            assert time.monotonic() < deadline, d.log
            time.sleep(0.05)
        time.sleep(0.5)
        d.proc.send_signal(signal.SIGTERM)
        assert d.wait(timeout=30) == 0, d.log  # not the 120 s tier timeout
        assert "stop requested while checking the tiers" in d.log  # (its preflight, before populating)
        assert not d.socket.exists() and not d.session_socket.exists()
    finally:
        black_hole.close()


@pytest.mark.parametrize("option", ["--tcp-listen", "--events-zmq-endpoint"])
def test_a_busy_port_is_one_clear_line_and_exit_1(daemon_factory, option):
    import socket

    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    # (a ZMQ endpoint binds only with a wildcard; on the busy port it fails before listening)
    address = f"127.0.0.1:{port}" if option == "--tcp-listen" else f"tcp://*:{port}"
    d = daemon_factory(start=False)
    try:
        d.spawn([option, address])
        assert d.wait(timeout=60) == 1, d.log
        assert f"cannot listen on {address}" in d.log
        assert "Traceback" not in d.log
        assert not d.socket.exists()
    finally:
        busy.close()
