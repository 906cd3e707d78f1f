# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Damaged and odd chunk files under a real daemon (issue #12, defect 3 and the fault suite):
corrupt, truncated, FIFOs (as many as the tier has I/O threads), a directory, a symlink and a
socket under chunk names, while the daemon runs and while it is stopped. Every loaded byte is
compared with the bytes derived from its key; damaged chunks are misses, never wrong bytes; the
daemon keeps serving and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

from tests.support.daemon import short_tmpdir
from tests.support.data import make_keys, payload, payloads
from tests.support.fs_check import (
    assert_index_matches_disk,
    chunk_path,
    fs_stats,
    make_odd_entry,
    odd_entries,
    settled_stats,
    tmp_files,
)

CHUNK = 64 << 10
RAM = "1MiB"  # 16 chunks: most of what is stored goes down to the fs tier
IO_THREADS = 8  # the fs tier's default: 8 FIFOs used to block every one of them


def fs_args(root) -> list[str]:
    return ["--tiers", f"kind=fs,root={root},bytes=64MiB"]


@pytest.fixture
def fs_root():
    root = short_tmpdir("kvfault")
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=False)


def load_one(kv, ns, key) -> bool:
    """Load one chunk; True if it came back (and then it must be exact)."""
    out = np.zeros((1, CHUNK), dtype=np.uint8)
    if kv.load(ns, [key], out) == 0:
        assert not out.any(), "a miss wrote bytes"
        return False
    assert np.array_equal(out[0], payload(key, CHUNK)), f"wrong bytes for {key.hex()}"
    return True


def test_damaged_and_odd_chunk_files_are_misses_never_wrong_bytes(daemon_factory, fs_root, ns_name):
    d = daemon_factory(fs_args(fs_root), cpu_bytes=RAM)
    keys = make_keys("faults-entries", 48)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        for i in range(0, len(keys), 8):
            assert kv.store(ns, keys[i : i + 8], payloads(keys[i : i + 8], CHUNK)).stored == 8
        stats = settled_stats(d)
        assert next(t for t in stats.tiers if t.name == "ram").dropped_dirty == 0
        path = {k: chunk_path(fs_root, ns.namespace_id, k) for k in keys}
        # the oldest 16 are on disk only (RAM holds the newest): their reads go to the files
        assert all(path[k].is_file() for k in keys[:16])

        damage = {
            keys[0]: "corrupt",
            keys[1]: "truncated",
            keys[10]: "directory",
            keys[11]: "symlink",
            keys[12]: "socket",
            **{k: "fifo" for k in keys[2 : 2 + IO_THREADS]},
        }
        valid_copy = fs_root / "valid-copy.kv"
        shutil.copyfile(path[keys[11]], valid_copy)  # the symlink leads to a perfect copy: still not followed
        for key, kind in damage.items():
            if kind == "corrupt":
                with open(path[key], "r+b") as fh:
                    fh.seek(4096 + 1234)
                    byte = fh.read(1)
                    fh.seek(4096 + 1234)
                    fh.write(bytes([byte[0] ^ 0x40]))
            elif kind == "truncated":
                os.truncate(path[key], 4096 + CHUNK // 2)
            else:
                make_odd_entry(path[key], kind, target=valid_copy)

        # all FIFOs in one batch first: every I/O thread at once, as in the report
        fifos = [k for k, kind in damage.items() if kind == "fifo"]
        assert kv.load(ns, fifos, np.zeros((len(fifos), CHUNK), dtype=np.uint8)) == 0
        served = {k: load_one(kv, ns, k) for k in keys}
        assert {k for k in keys if not served[k]} == set(damage), "exactly the damaged chunks are misses"

        fs = fs_stats(d)
        assert fs.checksum_failures == 2
        assert fs.bad_entries == len(damage) - 2
        assert odd_entries(fs_root) == [] and not any(path[k].exists() for k in damage)
        assert valid_copy.exists() and tmp_files(fs_root) == []
        assert "O_DIRECT refused" not in d.log and "buffered I/O" not in d.log
        assert kv.lookup(ns, list(damage)).prefix_hits == 0
        # the damaged chunks can be stored again and come back exact
        again = list(damage)
        for i in range(0, len(again), 8):
            assert kv.store(ns, again[i : i + 8], payloads(again[i : i + 8], CHUNK)).stored == len(again[i : i + 8])
        assert all(load_one(kv, ns, k) for k in again)
    d.stop()  # SIGTERM completes: no I/O thread is stuck

    # odd entries put there while the daemon is stopped: the index rebuild skips, counts and
    # removes them
    on_disk = sorted(k for k in keys if path[k].is_file())
    offline = dict(zip(on_disk[:4], ["fifo", "directory", "symlink", "socket"]))
    for key, kind in offline.items():
        make_odd_entry(path[key], kind, target=valid_copy)
    d.start(fs_args(fs_root))
    assert fs_stats(d).bad_entries == len(offline)
    assert odd_entries(fs_root) == []
    assert_index_matches_disk(d, fs_root)
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert kv.lookup(ns, list(offline)).prefix_hits == 0
        assert all(load_one(kv, ns, k) for k in on_disk[4:])
