# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What the real daemon checks before it populates its RAM tier: a tier or an address that
cannot work ends the start with one line before any page is touched (asserted on the log: the
populate never begins), and a start that goes on says what was checked."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

import pytest

from tests.support.daemon import short_tmpdir

BIG_POOL = "8GiB"  # a populate this size would take seconds: the checks must come first
WAIT_S = 60.0


@pytest.fixture
def busy_port() -> Iterator[int]:
    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        yield busy.getsockname()[1]
    finally:
        busy.close()


def refused_before_populating(d, code: int) -> str:
    """The daemon exited with `code` before populating; its one ERROR line."""
    assert d.wait(timeout=WAIT_S) == code, d.log
    assert "populating" not in d.log and "Traceback" not in d.log, d.log
    errors = [line for line in d.log.splitlines() if " ERROR " in line]
    assert len(errors) == 1, d.log
    assert not d.socket.exists() and not d.session_socket.exists()
    return errors[0]


def _regular_file(tmp) -> tuple[str, str]:
    path = tmp / "a-file"
    path.write_text("not a directory\n")
    return str(path), f"root {path} is a regular file, not a directory"


def _file_on_the_path(tmp) -> tuple[str, str]:
    path = tmp / "a-file"
    path.write_text("not a directory\n")
    return str(path / "kv"), f"root {path}/kv: {path}, on its path, is a regular file, not a directory"


@pytest.mark.parametrize(
    "make_root",
    [
        _regular_file,
        _file_on_the_path,
        lambda tmp: ("/proc/kvstored-test", "root /proc/kvstored-test is on proc, not storage"),
        lambda tmp: ("/sys/kernel/kvstored-test", "root /sys/kernel/kvstored-test is on sysfs, not storage"),
    ],
    ids=["regular-file", "file-on-its-path", "proc", "sys"],
)
def test_an_fs_root_it_cannot_use_is_exit_2_before_populating(daemon_factory, make_root):
    root, problem = make_root(short_tmpdir("kvroot"))
    d = daemon_factory(start=False, cpu_bytes=BIG_POOL)
    d.spawn(["--tiers", f"kind=fs,root={root},bytes=1GiB"])
    error = refused_before_populating(d, 2)
    assert f"cannot start tier 'fs': {problem}" in error, error


def test_the_log_says_what_was_checked_before_populating(daemon_factory):
    root = short_tmpdir("kvroot") / "fs"
    d = daemon_factory(
        ["--tiers", f"kind=fs,root={root},bytes=64MiB", "--metrics-addr", "127.0.0.1:0"], cpu_bytes="64MiB"
    )
    lines = d.log.splitlines()

    def at(pattern: str) -> int:
        found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
        assert found, f"no line matches {pattern!r}:\n{d.log}"
        return found[0]

    checked_tier = at(rf"checked tier fs: root {root} writable, O_DIRECT (on|off)")
    checked = at(
        r"checked before populating: sockets .*kv\.sock and .*kv\.sock\.session, metrics_addr 127.0.0.1:0 free"
    )
    assert checked_tier < checked < at(r"populating the RAM tier \(64.0 MiB, \d+ threads?\)") < at("serving on")


def test_a_taken_metrics_port_is_exit_1_before_populating(daemon_factory, busy_port):
    d = daemon_factory(start=False, cpu_bytes=BIG_POOL)
    d.spawn(["--metrics-addr", f"127.0.0.1:{busy_port}"])
    error = refused_before_populating(d, 1)
    assert f"cannot listen on 127.0.0.1:{busy_port} (metrics_addr): Address already in use" in error, error


def test_a_peer_tiers_taken_data_port_is_exit_1_before_populating(daemon_factory, busy_port):
    with socket.socket() as s:  # a free port for tcp_listen itself
        s.bind(("127.0.0.1", 0))
        listen_port = s.getsockname()[1]
    d = daemon_factory(start=False, cpu_bytes=BIG_POOL)
    d.spawn(
        [
            "--tcp-listen",
            f"127.0.0.1:{listen_port}",
            "--tiers",
            f"kind=peer,peers=127.0.0.1:9,tcp_port={busy_port},transport=tcp",
        ]
    )
    error = refused_before_populating(d, 1)
    assert f"peer tier 'peer': cannot listen on 127.0.0.1:{busy_port} (tcp_port): Address already in use" in error


def test_an_s3_endpoint_that_does_not_answer_is_a_warning_and_the_daemon_serves(daemon_factory):
    """The documented choice: an outage of the object store at start is an outage, not a
    configuration error. The line says so; the breaker probes it while the daemon serves."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there: connections are refused
    d = daemon_factory(
        ["--tiers", f"kind=s3,bucket=b,endpoint_url=http://127.0.0.1:{port},access_key=k,secret_key=s,timeout_s=2"]
    )
    line = next(line for line in d.log.splitlines() if "checked tier s3" in line)
    assert f"bucket 'b' at http://127.0.0.1:{port} unreachable" in line
    assert "starting without it, probed every 5 s" in line
    assert d.log.index("checked tier s3") < d.log.index("populating")
    assert [t.name for t in d.stats().tiers] == ["ram", "s3"]


def test_a_tls_file_it_cannot_read_is_exit_2_before_populating(daemon_factory):
    """On Kubernetes: the peer tier's config with its Secret kvstored-tls missing (the volume is
    optional)."""
    missing = short_tmpdir("kvtls") / "tls.crt"
    d = daemon_factory(start=False, cpu_bytes=BIG_POOL)
    d.spawn(["--tcp-listen", "127.0.0.1:0", "--tls-cert-file", str(missing), "--tls-key-file", str(missing)])
    error = refused_before_populating(d, 2)
    assert f"tls_cert_file {missing} cannot be read: No such file or directory" in error, error


@pytest.mark.root
def test_a_read_only_root_is_exit_2_before_populating(daemon_factory):
    """A root the daemon cannot write (here a read-only bind mount: as root, file modes would
    not stop it)."""
    import subprocess

    root = short_tmpdir("kvro")
    mount = subprocess.run(["mount", "--bind", "-o", "ro", str(root), str(root)], capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.fail(f"cannot make a read-only bind mount (needs root, as in CI): {mount.stderr.strip()}")
    try:
        d = daemon_factory(start=False, cpu_bytes=BIG_POOL)
        d.spawn(["--tiers", f"kind=fs,root={root},bytes=1GiB"])
        error = refused_before_populating(d, 2)
        assert f"cannot start tier 'fs': root {root} is not writable: Read-only file system" in error, error
    finally:
        subprocess.run(["umount", str(root)], check=False)


def test_an_events_endpoint_that_connects_to_a_local_router_is_not_a_listener(daemon_factory, busy_port):
    """`tcp://HOST:PORT` connects (vLLM's rule): a router bound on this host is what it wants,
    not a taken port; only `tcp://*:PORT` is checked as a listener."""
    d = daemon_factory(["--events-zmq-endpoint", f"tcp://127.0.0.1:{busy_port}"], cpu_bytes="64MiB")
    assert "serving on" in d.log and f"events_zmq_endpoint 127.0.0.1:{busy_port}" not in d.log, d.log
    d.stop()
    bound = daemon_factory(start=False, cpu_bytes=BIG_POOL)
    bound.spawn(["--events-zmq-endpoint", f"tcp://*:{busy_port}"])
    error = refused_before_populating(bound, 1)
    assert f"cannot listen on tcp://*:{busy_port} (events_zmq_endpoint)" in error, error
