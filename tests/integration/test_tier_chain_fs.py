# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The memory ladder with a real filesystem tier, driven through a real daemon.

RAM is tiny (1 MiB = 16 chunks of 64 KiB) so every test pushes chunks down to disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstored_client import Tier
from tests.support.daemon import REPO_ROOT, Daemon, short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.wait import wait_for

CHUNK = 64 << 10
RAM = "1MiB"


def fs_args(root: Path, capacity: str = "64MiB", **extra: str) -> list[str]:
    spec = ",".join([f"kind=fs,root={root},bytes={capacity}"] + [f"{k}={v}" for k, v in extra.items()])
    return ["--tiers", spec]


def tier_stats(daemon: Daemon) -> dict[str, object]:
    return {t.name: t for t in daemon.stats().tiers}


def fill(kv, ns, keys, batch: int = 8) -> None:
    for i in range(0, len(keys), batch):
        part = keys[i : i + batch]
        assert kv.store(ns, part, payloads(part, CHUNK)).stored == len(part)


def load_all(kv, ns, keys, batch: int = 8) -> np.ndarray:
    out = np.zeros((len(keys), CHUNK), dtype=np.uint8)
    for i in range(0, len(keys), batch):
        assert kv.load(ns, keys[i : i + batch], out[i : i + batch]) == len(keys[i : i + batch])
    return out


def fs_files(root: Path) -> set[str]:
    return {p.name[:-3] for p in root.rglob("*.kv")}


@pytest.fixture
def fs_root():
    root = short_tmpdir("kvfs")
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=False)


def test_ram_evictions_land_in_fs_and_promote_back_byte_exact(daemon_factory, fs_root, ns_name):
    d = daemon_factory(fs_args(fs_root), cpu_bytes=RAM)
    keys = make_keys("ladder", 48)  # 3 MiB through a 1 MiB RAM tier
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        fill(kv, ns, keys)
        stats = tier_stats(d)
        assert stats["ram"].used_bytes <= stats["ram"].capacity_bytes
        assert stats["ram"].writedowns >= 32 and stats["ram"].dropped_dirty == 0
        assert stats["fs"].chunks >= 32
        # the oldest 32 were evicted, so each is on disk once its write-down lands: a busy machine
        # may still be writing one whose newer neighbour went first (its write finished sooner)
        evicted = {k.hex() for k in keys[:32]}
        assert wait_for(lambda: evicted <= fs_files(fs_root), 30), evicted - fs_files(fs_root)

        looked = kv.lookup(ns, keys)
        assert looked.prefix_hits == 48
        assert looked.tiers[0] == Tier.FS and looked.tiers[-1] == Tier.RAM

        assert np.array_equal(load_all(kv, ns, keys), payloads(keys, CHUNK))
        assert tier_stats(d)["ram"].promotions >= 32


def test_restart_keeps_the_fs_tier_warm(daemon_factory, fs_root, ns_name):
    keys = make_keys("warm", 40)
    d = daemon_factory(fs_args(fs_root), cpu_bytes=RAM)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        fill(kv, ns, keys)
    d.stop()
    on_disk = fs_files(fs_root)

    d.start(fs_args(fs_root))
    assert tier_stats(d)["fs"].chunks == len(on_disk)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        present = [k for k in keys if k.hex() in on_disk]
        assert len(present) >= 24
        assert kv.lookup(ns, present).prefix_hits == len(present)
        assert np.array_equal(load_all(kv, ns, present), payloads(present, CHUNK))


@pytest.mark.parametrize("flush_s", ["10", "0"])
def test_a_clean_stop_writes_ram_only_chunks_down(daemon_factory, fs_root, ns_name, flush_s):
    """Write-back keeps new chunks in RAM only; SIGTERM writes them down (within
    flush_on_stop_seconds) so a restart finds them. With 0, they are gone, as before."""
    keys = make_keys("flush", 8)  # 512 KiB: fits in RAM, nothing is written down while running
    d = daemon_factory(fs_args(fs_root) + ["--flush-on-stop-seconds", flush_s], cpu_bytes=RAM)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        fill(kv, ns, keys)
    assert fs_files(fs_root) == set()
    d.stop()
    if flush_s == "0":
        assert fs_files(fs_root) == set()
        return
    assert fs_files(fs_root) == {k.hex() for k in keys}
    d.start(fs_args(fs_root))
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert kv.lookup(ns, keys).tiers == [Tier.FS] * len(keys)
        assert np.array_equal(load_all(kv, ns, keys), payloads(keys, CHUNK))


def test_two_daemons_sharing_a_root_share_chunks(daemon_factory, fs_root, ns_name):
    a = daemon_factory(fs_args(fs_root), cpu_bytes=RAM)
    b = daemon_factory(fs_args(fs_root), cpu_bytes=RAM)
    keys = make_keys("shared-root", 40)
    with a.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        fill(kv, ns, keys)
    written = [k for k in keys if k.hex() in fs_files(fs_root)]
    assert len(written) >= 24
    with b.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert kv.lookup(ns, written).prefix_hits == len(written)
        assert np.array_equal(load_all(kv, ns, written), payloads(written, CHUNK))
        # b writing the same chunks again (some are still in its RAM) must not corrupt a's files
        for i in range(0, len(keys), 8):
            result = kv.store(ns, keys[i : i + 8], payloads(keys[i : i + 8], CHUNK))
            assert result.stored + result.already_present == len(keys[i : i + 8])
    with a.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert np.array_equal(load_all(kv, ns, written), payloads(written, CHUNK))


def test_corrupted_file_is_a_counted_miss_never_wrong_bytes(daemon_factory, fs_root, ns_name):
    d = daemon_factory(fs_args(fs_root), cpu_bytes=RAM)
    keys = make_keys("corrupt", 40)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        fill(kv, ns, keys)
        victim = keys[0]
        path = next(fs_root.rglob(victim.hex() + ".kv"))
        with open(path, "r+b") as fh:  # flip one payload byte
            fh.seek(4096 + 1000)
            byte = fh.read(1)
            fh.seek(4096 + 1000)
            fh.write(bytes([byte[0] ^ 0xFF]))
        truncated = next(fs_root.rglob(keys[1].hex() + ".kv"))
        os.truncate(truncated, 4096 + 100)

        out = np.zeros((1, CHUNK), dtype=np.uint8)
        assert kv.load(ns, [victim], out) == 0
        assert kv.load(ns, [keys[1]], out) == 0
        assert not out.any()
        assert tier_stats(d)["fs"].checksum_failures == 2
        assert not path.exists() and not truncated.exists()
        assert kv.lookup(ns, [victim]).prefix_hits == 0
        # everything else still comes back exact
        rest = [k for k in keys[2:] if k.hex() in fs_files(fs_root)]
        assert np.array_equal(load_all(kv, ns, rest), payloads(rest, CHUNK))


def test_fs_capacity_bound_evicts_least_recently_used_files(daemon_factory, fs_root, ns_name):
    # 1 MiB of fs = 15 files of 64 KiB + 4 KiB header
    d = daemon_factory(fs_args(fs_root, capacity="1MiB"), cpu_bytes=RAM)
    keys = make_keys("fs-cap", 64)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        fill(kv, ns, keys)
    stats = tier_stats(d)
    on_disk = sum(p.stat().st_size for p in fs_root.rglob("*.kv"))
    assert stats["fs"].used_bytes <= 1 << 20 and on_disk <= 1 << 20
    assert stats["fs"].evictions > 0
    # Write-downs (and the unlinks of their victims) may still be running after the stores return.
    assert wait_for(lambda: tier_stats(d)["fs"].chunks == len(fs_files(fs_root))), (
        tier_stats(d)["fs"].chunks,
        len(fs_files(fs_root)),
    )


@pytest.mark.root
def test_disk_full_stops_fs_admission_and_ram_keeps_serving(daemon_factory, ns_name):
    if os.geteuid() != 0:
        pytest.fail("this test mounts a tiny tmpfs and must run as root (CI does)")
    mnt = short_tmpdir("kvfull")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], check=True)
    try:
        d = daemon_factory(fs_args(mnt, capacity="64MiB"), cpu_bytes=RAM)
        keys = make_keys("full", 48)
        with d.client() as kv:
            ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
            fill(kv, ns, keys)
            stats = tier_stats(d)
            assert stats["fs"].rejected_full > 0
            assert stats["ram"].dropped_dirty > 0  # no copy below: dropped, counted
            # the newest chunks are still in RAM and exact; the daemon serves on
            newest = keys[-8:]
            assert np.array_equal(load_all(kv, ns, newest), payloads(newest, CHUNK))
            on_fs = [k for k in keys if k.hex() in fs_files(mnt)]
            assert on_fs and np.array_equal(load_all(kv, ns, on_fs), payloads(on_fs, CHUNK))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


STORE_FOREVER = """
import sys
from kvstored_client import Client
from tests.support.data import make_keys, payloads
socket, model, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Client(socket, deadline_s=10) as kv:
    ns = kv.register_namespace(model=model, dtype="u8", chunk_bytes=chunk)
    i = 0
    while True:
        keys = make_keys(f"forever-{i}", 8)
        kv.store(ns, keys, payloads(keys, chunk))
        i += 1
"""


def test_kill_9_during_heavy_write_downs_then_restart_serves_exact_bytes(daemon_factory, fs_root, ns_name):
    d = daemon_factory(fs_args(fs_root, capacity="256MiB"), cpu_bytes="4MiB")
    writer = subprocess.Popen(
        [sys.executable, "-c", STORE_FOREVER, str(d.socket), ns_name, str(CHUNK)],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while tier_stats(d)["fs"].stored_chunks < 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tier_stats(d)["fs"].stored_chunks >= 200, "write-downs never got going"
        d.kill()
    finally:
        writer.kill()
        writer.wait()

    d.start(fs_args(fs_root, capacity="256MiB"))
    on_disk = fs_files(fs_root)
    assert tier_stats(d)["fs"].chunks == len(on_disk)  # the index matches the files
    assert not list(fs_root.rglob("*.tmp"))  # no live writer holds them: removed at start
    keys = [bytes.fromhex(h) for h in sorted(on_disk)]
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert np.array_equal(load_all(kv, ns, keys), payloads(keys, CHUNK))


def test_admission_second_eviction_writes_only_chunks_evicted_twice(daemon_factory, fs_root, ns_name):
    d = daemon_factory(fs_args(fs_root, admission="second-eviction"), cpu_bytes=RAM)
    keys = make_keys("admit", 40)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        fill(kv, ns, keys)
        stats = tier_stats(d)
        assert stats["fs"].rejected_admission > 0 and stats["fs"].chunks == 0
        # store the same chunks again: their second eviction is admitted
        fill(kv, ns, keys)
        assert tier_stats(d)["fs"].chunks > 0
