# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fs tier under bad luck, through a real daemon (issue #12, defect 7 and the fault suite):
kill -9 under mixed load, then a restart whose index must match the disk with no temporary file
left; a disk that fills up (a small tmpfs). Every loaded byte is compared with the bytes derived
from its key."""

from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np
import pytest

from tests.support.daemon import short_tmpdir
from tests.support.data import make_keys, payload, payloads
from tests.support.fs_check import (
    assert_index_matches_disk,
    fs_stats,
    settled_stats,
    tmp_files,
)
from tests.support.worker import spawn

CHUNK = 64 << 10
WORKERS = 2


def fs_args(root, capacity: str) -> list[str]:
    return ["--tiers", f"kind=fs,root={root},bytes={capacity}"]


@pytest.fixture
def fs_root():
    root = short_tmpdir("kvcrash")
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=False)


def verify_loads(kv, ns, keys: list[bytes], batch: int = 8) -> int:
    """Load `keys` in batches; every chunk must come back, byte-exact. Returns the bytes checked."""
    out = np.zeros((batch, CHUNK), dtype=np.uint8)
    for i in range(0, len(keys), batch):
        part = keys[i : i + batch]
        out[:] = 0
        assert kv.load(ns, part, out[: len(part)]) == len(part)
        assert np.array_equal(out[: len(part)], payloads(part, CHUNK))
    return len(keys) * CHUNK


def test_kill_9_under_mixed_load_then_restart_matches_the_disk(daemon_factory, fs_root, ns_name):
    args = fs_args(fs_root, "256MiB")
    d = daemon_factory(args, cpu_bytes="2MiB")  # 32 chunks of RAM: write-downs and fs reads all along
    workers = [spawn("mix", d.socket, ns_name, CHUNK, f"kill9-{i}", 0, "--deadline", "5") for i in range(WORKERS)]
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            stats = {t.name: t for t in d.stats().tiers}
            if stats["fs"].stored_chunks >= 400 and stats["ram"].promotions >= 100:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the load never reached the fs tier: {d.stats()}")
        d.kill()
    finally:  # closing a worker's stdin ends its load: it prints its totals
        outputs = [w.communicate(input="", timeout=120) for w in workers]
    assert all(w.returncode == 0 for w in workers), [err for _, err in outputs]
    results = [json.loads(out) for out, _ in outputs]
    assert all(r["mismatched"] == 0 for r in results), results
    assert sum(r["loaded"] for r in results) > 0, results
    left_by_the_kill = len(tmp_files(fs_root))

    # a temporary file of a writer that died a moment ago (no lock on it, brand new)
    some_leaf = next(p.parent for p in fs_root.rglob("*.kv"))
    (some_leaf / f".{'ab' * 16}.99999.deadbeef.7.tmp").write_bytes(b"half a chunk")

    d.start(args)
    assert tmp_files(fs_root) == [], "temporary files of dead writers survived the restart"
    files = assert_index_matches_disk(d, fs_root)
    assert files
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        checked = verify_loads(kv, ns, sorted(bytes.fromhex(h) for h in files))
    print(
        f"\nkill -9 under load: workers {results}; {left_by_the_kill} temporary files left by the kill; "
        f"after restart {len(files)} files = index, {checked} bytes re-read exact"
    )


@pytest.mark.root
def test_full_disk_refuses_writes_and_serves_exact_bytes(daemon_factory, ns_name):
    mnt = short_tmpdir("kvfull")
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if mount.returncode != 0:
        os.rmdir(mnt)
        pytest.fail(
            f"cannot mount a tmpfs for a full disk (needs root, as in CI): {mount.stderr.strip()}", pytrace=False
        )
    try:
        d = daemon_factory(fs_args(mnt, "64MiB"), cpu_bytes="1MiB")  # the tier thinks it has room
        keys = make_keys("faults-full", 96)  # 6 MiB through 1 MiB of RAM onto a 2 MiB disk
        loaded = 0
        with d.client() as kv:
            ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
            out = np.zeros((4, CHUNK), dtype=np.uint8)
            for i in range(0, len(keys), 8):
                batch = keys[i : i + 8]
                result = kv.store(ns, batch, payloads(batch, CHUNK))
                assert result.stored + result.dropped == len(batch)
                sample = keys[max(0, i - 24) : i : 6]  # mixed: read back some earlier ones meanwhile
                n = kv.load(ns, sample, out[: len(sample)])
                assert np.array_equal(out[:n], payloads(sample[:n], CHUNK))
                loaded += n
            settled_stats(d)
            fs = fs_stats(d)
            assert fs.rejected_full > 0 and fs.errors == 0
            assert tmp_files(mnt) == []
            files = assert_index_matches_disk(d, mnt)
            served = 0
            for key in keys:
                one = np.zeros((1, CHUNK), dtype=np.uint8)
                if kv.load(ns, [key], one) == 1:
                    assert np.array_equal(one[0], payload(key, CHUNK))
                    served += 1
            assert served >= len(files) > 0
        d.stop()
        print(
            f"\nfull disk: {fs.rejected_full} writes refused, {len(files)} files fit, "
            f"{loaded + served} chunks loaded exact"
        )
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        os.rmdir(mnt)
