# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Start-up on a big node, through the real daemon: populating the pool says how far it is (log and
systemd's STATUS / EXTEND_TIMEOUT_USEC), SIGTERM stops it at once, huge pages and NUMA placement
are what the kernel shows for the daemon's mapping, and what the machine cannot give ends the
start with one line (exit 2)."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest

from kvstored.shm import memory
from tests.support.daemon import short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.hugepages import reserved_huge_pages

WAIT_S = 60.0
CHUNK = 2 << 20


class Notifications:
    """A $NOTIFY_SOCKET listening like systemd's."""

    def __init__(self) -> None:
        self.dir = short_tmpdir("kvntf")
        self.path = self.dir / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.settimeout(WAIT_S)

    def next(self, log=lambda: "") -> dict[str, str]:
        try:
            raw = self.sock.recv(4096).decode()
        except TimeoutError:
            pytest.fail(f"no sd_notify message within {WAIT_S}s:\n{log()}")
        return dict(line.split("=", 1) for line in raw.splitlines())

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)
        self.dir.rmdir()


@pytest.fixture
def notifications():
    n = Notifications()
    yield n
    n.close()


def pool_mapping(pid: int) -> str:
    """The daemon's /proc/PID/numa_maps line of its pool."""
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        if "memfd:kvstored-pool" in line:
            return line
    raise AssertionError(f"no pool mapping in /proc/{pid}/numa_maps")


def test_populate_reports_progress_to_systemd_and_the_log(daemon_factory, notifications):
    d = daemon_factory(start=False, cpu_bytes="256MiB")
    d.spawn(env={"NOTIFY_SOCKET": str(notifications.path)})
    first = notifications.next(d.log)
    assert first["STATUS"] == "populating the RAM tier: 0 B of 256.0 MiB (0%)"
    assert int(first["EXTEND_TIMEOUT_USEC"]) >= 10_000_000  # systemd's start timeout moves on with it
    done = notifications.next(d.log)
    assert done["STATUS"].startswith("populating the RAM tier: 256.0 MiB of 256.0 MiB (100%)")
    assert "READY" in notifications.next(d.log)
    d.wait_ready()
    assert "populating the RAM tier (256.0 MiB, " in d.log and "RAM tier populated: 256.0 MiB in" in d.log


def test_sigterm_while_populating_stops_at_once(daemon_factory, notifications):
    d = daemon_factory(start=False, cpu_bytes="2GiB")  # ~2 s of populating here: 30 steps of 64 MiB
    d.spawn(env={"NOTIFY_SOCKET": str(notifications.path)})
    assert notifications.next(d.log)["STATUS"].startswith("populating the RAM tier: 0 B of 2.0 GiB")
    d.proc.terminate()  # as systemd's stop does
    assert d.wait(timeout=WAIT_S) == 0, d.log  # a hang guard: the stop lands within one step
    assert "stop requested while populating the RAM tier; stopped" in d.log
    assert "RAM tier populated" not in d.log and "serving on" not in d.log
    assert not d.socket.exists() and not d.session_socket.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--cpu-bytes", "100TiB"],
            r"cpu_bytes 100.0 TiB is more than this machine can give: it has [\d.]+ GiB of RAM",
        ),
        (["--numa-node", "7"], r"numa_node 7 does not exist: this machine's NUMA nodes with memory are 0"),
        (
            ["--pool-pages", "hugetlb", "--cpu-bytes", "64GiB"],
            r"pool_pages = hugetlb: cpu_bytes 64.0 GiB needs 32768 huge pages of 2 MiB; this system has \d+ free",
        ),
    ],
)
def test_a_pool_the_machine_cannot_give_is_one_line_and_exit_2(daemon_factory, args, message):
    import re

    d = daemon_factory(start=False)
    d.spawn(args)
    assert d.wait(timeout=WAIT_S) == 2, d.log
    lines = d.log.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), d.log
    assert not d.socket.exists()


def test_bad_page_mode_names_the_choices(daemon_factory):
    d = daemon_factory(start=False)
    d.spawn(["--pool-pages", "1g"])
    assert d.wait(timeout=WAIT_S) == 2
    assert "bad value for pool_pages: '1g' is not one of 4k, thp, hugetlb" in d.log


@pytest.mark.parametrize("numa, shown", [("0", "bind:0"), ("interleave", "interleave:0")])
def test_numa_placement_of_the_daemons_pool(daemon_factory, numa, shown):
    d = daemon_factory(["--numa-node", numa], cpu_bytes="64MiB")
    line = pool_mapping(d.pid)
    assert line.split()[1] == shown and " N0=" in line  # every page on the node(s) asked for
    assert f"NUMA {numa}" in d.log


@pytest.mark.root
def test_a_hugetlb_pool_serves_clients(daemon_factory, ns_name):
    pages = 32  # 64 MiB
    with reserved_huge_pages(pages):
        d = daemon_factory(["--pool-pages", "hugetlb", "--numa-node", "0"], cpu_bytes="65MiB")  # rounded down
        line = pool_mapping(d.pid)
        assert "huge" in line and f"N0={pages}" in line  # numa_maps counts huge pages for a hugetlb mapping
        assert "RAM tier: 64.0 MiB of 64.0 MiB in 2 MiB pages" in d.log
        assert d.stats().tiers[0].capacity_bytes == 64 << 20
        keys = make_keys("hugetlb", 8)
        with d.client() as kv:  # the client maps the same hugetlb memfd
            ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
            assert kv.store(ns, keys, payloads(keys, CHUNK)).stored == 8
            out = np.zeros((8, CHUNK), np.uint8)
            assert kv.load(ns, keys, out) == 8 and np.array_equal(out, payloads(keys, CHUNK))
        d.stop()


def test_thp_pool_says_what_the_kernel_gives(daemon_factory):
    d = daemon_factory(["--pool-pages", "thp"], cpu_bytes="64MiB")
    mode = memory.thp_shmem_mode()
    if mode in ("never", "deny", "unavailable"):
        assert f"pool_pages = thp has no effect: {memory.THP_SHMEM} is {mode!r}" in d.log
        assert "RAM tier: 0 B of 64.0 MiB in 2 MiB pages" in d.log
    else:
        assert "has no effect" not in d.log and "RAM tier: 0 B of" not in d.log
