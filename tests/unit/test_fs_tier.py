# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""FsTier on real files: round trips through page-aligned views, LRU capacity, restart, a shared
root, corruption, admission, a full disk (a 1 MiB tmpfs) and filesystems that refuse O_DIRECT."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import mmap
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored.chunks.ids import RemovalCause
from kvstored.errors import TierUnavailable
from kvstored.tiers.base import AdmissionPolicy, WriteOutcome
from kvstored.tiers.fs.tier import FsTier

PAGE = 4096
NS = "0123456789abcdef0123456789abcdef"


class Slot:
    """A pool slot: page-aligned anonymous memory chopped into page-multiple views."""

    def __init__(self, pages_per_view: tuple[int, ...] = (64,)) -> None:
        self.mm = mmap.mmap(-1, sum(pages_per_view) * PAGE)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        whole, offset, self.views = memoryview(self.mm), 0, []
        for pages in pages_per_view:
            self.views.append(whole[offset : offset + pages * PAGE])
            offset += pages * PAGE

    def fill(self, size: int, seed: int) -> bytes:
        self.array[:size] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        return bytes(self.array[:size])

    def payload(self, size: int) -> bytes:
        return bytes(self.array[:size])


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest()  # spread over the fan-out directories


def chunk(i: int) -> tuple[str, bytes]:
    return NS, key(i)


def path_of(root: Path, c) -> Path:
    return root / chunkfile.chunk_relpath(c)


def tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*.tmp")]


def failing(real, code: int, times: int = 1 << 30, before=None):
    """`real`, except that its first `times` calls raise OSError(code) (after `before()`, if given)."""
    left = [times]

    def call(*args):
        if left[0] > 0:
            left[0] -= 1
            if before is not None:
                before()
            raise OSError(code, os.strerror(code))
        return real(*args)

    return call


@pytest.fixture
async def make_tier(tmp_path):
    made: list[FsTier] = []

    async def make(root: Path | None = None, capacity: int = 64 << 20, **kwargs) -> FsTier:
        tier = FsTier("fs", root or tmp_path / "fs", capacity, **kwargs)
        await tier.start()
        made.append(tier)
        return tier

    yield make
    for tier in made:
        await tier.close()


def _mount(fstype: str, target: Path, options: str | None = None) -> None:
    target.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(target)]
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs: real ENOSPC (needs root, as in CI)."""
    target = tmp_path / "small"
    _mount("tmpfs", target, "size=1m")
    yield target
    subprocess.run(["umount", "-l", str(target)], check=True)


@pytest.fixture
def ramfs(tmp_path):
    """ramfs refuses O_DIRECT with EINVAL (tmpfs accepts it on Linux >= 6.6)."""
    target = tmp_path / "ramfs"
    _mount("ramfs", target)
    yield target
    subprocess.run(["umount", "-l", str(target)], check=True)


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [PAGE * 16, PAGE * 16 - 1000, 1, 0])
async def test_round_trip_single_view(make_tier, tmp_path, size):
    tier = await make_tier()
    assert tier.direct_io  # ext4 under tmp_path: the O_DIRECT path is the one tested here
    src = Slot((16,))
    data = src.fill(size, seed=size)
    assert await tier.write(chunk(1), src.views, size) is WriteOutcome.WRITTEN
    dst = Slot((16,))
    assert await tier.read(chunk(1), dst.views, size)
    assert dst.payload(size) == data
    on_disk = path_of(tmp_path / "fs", chunk(1)).stat().st_size
    assert on_disk == HEADER_BYTES + -(-size // PAGE) * PAGE  # O_DIRECT files are page-rounded
    assert tier.usage().used_bytes == on_disk and tier.usage().chunks == 1
    c = tier.counters
    assert (c.writes, c.written_bytes, c.reads, c.read_bytes) == (1, size, 1, size)
    assert tmp_files(tmp_path / "fs") == []


async def test_round_trip_multi_view(make_tier):
    tier = await make_tier()
    size = PAGE * 5 + 777  # ends inside the third view
    src = Slot((1, 3, 2, 4))
    data = src.fill(size, seed=7)
    assert await tier.write(chunk(2), src.views, size) is WriteOutcome.WRITTEN
    for layout in ((10,), (2, 2, 2, 4), (6,)):  # read into other slot shapes
        dst = Slot(layout)
        assert await tier.read(chunk(2), dst.views, size)
        assert dst.payload(size) == data


async def test_unaligned_views_use_buffered_io(make_tier):
    tier = await make_tier()
    size = 10_000
    data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8).tobytes()
    buf = bytearray(b"x" + data)
    assert await tier.write(chunk(3), [memoryview(buf)[1:]], size) is WriteOutcome.WRITTEN
    out = bytearray(size + 3)
    assert await tier.read(chunk(3), [memoryview(out)[3:]], size)
    assert bytes(out[3:]) == data


async def test_read_miss_and_wrong_size(make_tier):
    tier = await make_tier()
    dst = Slot((4,))
    assert not await tier.read(chunk(9), dst.views, PAGE)
    assert tier.counters.checksum_failures == 0
    with pytest.raises(ValueError):
        await tier.read(chunk(9), dst.views, 5 * PAGE)  # views too small


async def test_already_present(make_tier):
    tier = await make_tier()
    src = Slot((4,))
    src.fill(PAGE * 4, seed=1)
    assert await tier.write(chunk(1), src.views, PAGE * 4) is WriteOutcome.WRITTEN
    assert await tier.write(chunk(1), src.views, PAGE * 4) is WriteOutcome.ALREADY_PRESENT
    assert tier.counters.writes == 1 and tier.usage().chunks == 1


async def test_concurrent_writes_and_reads(make_tier):
    tier = await make_tier(io_threads=3)
    size = PAGE * 8
    slots = [Slot((8,)) for _ in range(6)]
    datas = [s.fill(size, seed=i) for i, s in enumerate(slots)]
    outcomes = await asyncio.gather(
        *(tier.write(chunk(i), s.views, size) for i, s in enumerate(slots)),
        tier.write(chunk(0), slots[0].views, size),  # the same chunk twice at once
    )
    assert outcomes[:6] == [WriteOutcome.WRITTEN] * 6
    assert outcomes[6] is WriteOutcome.ALREADY_PRESENT
    dsts = [Slot((8,)) for _ in range(6)]
    assert all(await asyncio.gather(*(tier.read(chunk(i), d.views, size) for i, d in enumerate(dsts))))
    assert [d.payload(size) for d in dsts] == datas
    assert tier.usage().chunks == 6 and tier.counters.writes == 6


async def test_remove(make_tier, tmp_path):
    tier = await make_tier()
    src = Slot((2,))
    src.fill(PAGE * 2, seed=5)
    await tier.write(chunk(1), src.views, PAGE * 2)
    assert await tier.remove(chunk(1))
    assert not path_of(tmp_path / "fs", chunk(1)).exists()
    assert tier.usage() == tier.usage().__class__(64 << 20, 0, 0)
    assert not await tier.remove(chunk(1))
    assert await tier.contains([chunk(1)]) == [False]
    assert await tier.write(chunk(1), src.views, PAGE * 2) is WriteOutcome.WRITTEN


def refusing_unlink(real, code: int = errno.EACCES):
    """os.unlink, except that chunk files (*.kv) cannot be unlinked: a read-only directory, an
    immutable file, a filesystem remounted read-only."""

    def unlink(path, *args, **kwargs):
        if os.fspath(path).endswith(".kv"):
            raise OSError(code, os.strerror(code), path)
        return real(path, *args, **kwargs)

    return unlink


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.EPERM], ids=errno.errorcode.get)
async def test_a_failed_unlink_raises_and_the_old_file_is_never_served(make_tier, tmp_path, monkeypatch, code):
    """remove() whose unlink fails: it raises (the Delete fails and can be retried), and the file
    left behind is neither found again nor taken for the chunk by a new write, whose bytes are the
    ones read back (not the old file's)."""
    root = tmp_path / "fs"
    tier = await make_tier(root)
    await _write_one(tier, chunk(1), seed=1)
    path = path_of(root, chunk(1))
    monkeypatch.setattr(os, "unlink", refusing_unlink(os.unlink, code))
    with pytest.raises(TierUnavailable, match=f"{path}.*{errno.errorcode[code]}"):
        await tier.remove(chunk(1))
    monkeypatch.undo()  # the permission is back; the old file is still there
    assert path.exists() and tier.counters.errors == 1
    assert tier.holds([chunk(1)]) == [False] and await tier.contains([chunk(1)]) == [False]
    assert not await tier.read(chunk(1), Slot((4,)).views, PAGE * 4)
    assert tier.usage().chunks == 0
    src = Slot((4,))
    new = src.fill(PAGE * 4, seed=2)
    assert await tier.write(chunk(1), src.views, PAGE * 4) is WriteOutcome.WRITTEN
    dst = Slot((4,))
    assert await tier.read(chunk(1), dst.views, PAGE * 4) and dst.payload(PAGE * 4) == new
    assert await tier.contains([chunk(1)]) == [True]


async def test_a_failed_unlink_is_retried_by_the_next_remove(make_tier, tmp_path, monkeypatch):
    root = tmp_path / "fs"
    tier = await make_tier(root)
    data = await _write_one(tier, chunk(1))
    path = path_of(root, chunk(1))
    monkeypatch.setattr(os, "unlink", refusing_unlink(os.unlink))
    for _ in range(2):
        with pytest.raises(TierUnavailable):
            await tier.remove(chunk(1))
    monkeypatch.undo()
    assert await tier.remove(chunk(1)) and not path.exists()
    assert not await tier.remove(chunk(1))
    assert await tier.contains([chunk(1)]) == [False]
    # gone for good: a file a daemon sharing the root writes under the name is adopted again
    other = await make_tier(root)
    await _write_one(other, chunk(1))
    assert await tier.contains([chunk(1)]) == [True]
    dst = Slot((4,))
    assert await tier.read(chunk(1), dst.views, PAGE * 4) and dst.payload(PAGE * 4) == data


async def test_an_evicted_file_that_cannot_be_unlinked_is_not_adopted_back(make_tier, tmp_path, monkeypatch, caplog):
    """Evictions (a write's victims) whose unlink fails: counted, logged, and the files left behind
    are not found again (the chunk was evicted: its removal was announced) until removed."""
    from kvstored.tiers.fs import tier as fs_tier

    fs_tier.limited._windows.clear()
    root = tmp_path / "fs"
    size = PAGE * 4
    tier = await make_tier(root, capacity=2 * (HEADER_BYTES + size))
    await _write_one(tier, chunk(1), size)
    await _write_one(tier, chunk(2), size)
    caplog.set_level(logging.WARNING, logger=fs_tier.__name__)
    monkeypatch.setattr(os, "unlink", refusing_unlink(os.unlink))
    await _write_one(tier, chunk(3), size)  # evicts chunk 1: its unlink fails
    monkeypatch.undo()
    assert path_of(root, chunk(1)).exists() and tier.counters.errors == 1
    assert any(
        "cannot unlink" in r.getMessage() and str(path_of(root, chunk(1))) in r.getMessage() for r in caplog.records
    )
    assert await tier.contains([chunk(1), chunk(2), chunk(3)]) == [False, True, True]
    assert not await tier.read(chunk(1), Slot((4,)).views, size)
    assert await tier.remove(chunk(1)) and not path_of(root, chunk(1)).exists()


async def test_closed_tier_refuses_work(tmp_path):
    tier = FsTier("fs", tmp_path / "fs", 1 << 20)
    await tier.start()
    await tier.close()
    src = Slot((1,))
    assert await tier.write(chunk(1), src.views, 10) is WriteOutcome.FAILED
    assert not await tier.read(chunk(1), src.views, 10)


# -- capacity and LRU ----------------------------------------------------------------------------


async def test_capacity_evicts_least_recently_used(make_tier, tmp_path):
    size = PAGE * 8
    file_bytes = HEADER_BYTES + size
    tier = await make_tier(capacity=3 * file_bytes)
    src = Slot((8,))
    for i in range(3):
        src.fill(size, seed=i)
        assert await tier.write(chunk(i), src.views, size) is WriteOutcome.WRITTEN
    dst = Slot((8,))
    assert await tier.read(chunk(0), dst.views, size)  # chunk 0 becomes the most recent
    src.fill(size, seed=3)
    assert await tier.write(chunk(3), src.views, size) is WriteOutcome.WRITTEN
    root = tmp_path / "fs"
    assert not path_of(root, chunk(1)).exists()  # the least recently used went
    assert all(path_of(root, chunk(i)).exists() for i in (0, 2, 3))
    assert await tier.contains([chunk(i) for i in range(4)]) == [True, False, True, True]
    assert tier.counters.evictions == 1
    on_disk = sum(p.stat().st_size for p in root.rglob("*.kv"))
    assert tier.usage().used_bytes == on_disk <= 3 * file_bytes
    # a chunk that can never fit
    big = Slot((3 * file_bytes // PAGE,))
    assert await tier.write(chunk(9), big.views, 3 * file_bytes) is WriteOutcome.REJECTED_FULL
    assert tier.counters.rejected_full == 1


async def test_contains_refreshes_recency(make_tier, tmp_path):
    size = PAGE
    tier = await make_tier(capacity=2 * (HEADER_BYTES + size))
    src = Slot((1,))
    await tier.write(chunk(0), src.views, size)
    await tier.write(chunk(1), src.views, size)
    assert await tier.contains([chunk(0)]) == [True]
    await tier.write(chunk(2), src.views, size)
    assert await tier.contains([chunk(0), chunk(1), chunk(2)]) == [True, False, True]
    assert (tier.counters.lookups, tier.counters.hits) == (4, 3)


# -- restart and a shared root -------------------------------------------------------------------


async def test_restart_rebuilds_index(make_tier, tmp_path):
    root = tmp_path / "fs"
    size = PAGE * 4 + 5
    first = await make_tier(root)
    src = Slot((5,))
    datas = {}
    for i in range(3):
        datas[i] = src.fill(size, seed=i)
        await first.write(chunk(i), src.views, size)
    await first.close()

    second = await make_tier(root)
    assert second.usage() == first.usage()
    assert await second.contains([chunk(i) for i in range(4)]) == [True, True, True, False]
    dst = Slot((5,))
    for i in range(3):
        assert await second.read(chunk(i), dst.views, size)
        assert dst.payload(size) == datas[i]


async def test_restart_orders_lru_by_mtime_and_fits_capacity(make_tier, tmp_path):
    root = tmp_path / "fs"
    size = PAGE
    first = await make_tier(root)
    src = Slot((1,))
    for i in range(4):
        await first.write(chunk(i), src.views, size)
    await first.close()
    now = time.time()
    for age, i in ((400, 2), (300, 0), (200, 3), (100, 1)):  # oldest first: 2, 0, 3, 1
        os.utime(path_of(root, chunk(i)), (now - age, now - age))

    second = await make_tier(root, capacity=3 * (HEADER_BYTES + size))  # one file too many
    assert not path_of(root, chunk(2)).exists() and second.counters.evictions == 1
    await second.write(chunk(4), src.views, size)
    assert not path_of(root, chunk(0)).exists()
    assert sorted(p.name for p in root.rglob("*.kv")) == sorted(path_of(root, chunk(i)).name for i in (1, 3, 4))


async def test_read_hits_persist_recency_across_restart(make_tier, tmp_path):
    root = tmp_path / "fs"
    size = PAGE
    first = await make_tier(root, touch_interval_s=0)
    src = Slot((1,))
    for i in range(2):
        await first.write(chunk(i), src.views, size)
    now = time.time()
    os.utime(path_of(root, chunk(0)), (now - 200, now - 200))
    os.utime(path_of(root, chunk(1)), (now - 100, now - 100))
    await first.close()
    second = await make_tier(root, touch_interval_s=0)
    assert await second.read(chunk(0), Slot((1,)).views, size)  # touches chunk 0's mtime
    await second.close()

    third = await make_tier(root, capacity=2 * (HEADER_BYTES + size))
    await third.write(chunk(2), src.views, size)
    assert path_of(root, chunk(0)).exists() and not path_of(root, chunk(1)).exists()


async def test_holds_answers_from_the_index_alone(make_tier, tmp_path):
    """What a store asks (no I/O): chunks indexed at start or written since, not a file another
    tier sharing the root wrote until a lookup adopted it, not a removed chunk; a hit is a use."""
    root = tmp_path / "fs"
    size = PAGE
    src = Slot((1,))
    first = await make_tier(root)
    await first.write(chunk(1), src.views, size)
    await first.close()
    tier = await make_tier(root, capacity=2 * (HEADER_BYTES + size))
    other = await make_tier(root)
    await tier.write(chunk(2), src.views, size)
    await other.write(chunk(3), src.views, size)
    assert tier.holds([chunk(1), chunk(2), chunk(3), chunk(4)]) == [True, True, False, False]
    assert tier.counters.lookups == 0  # (not a lookup: stats stay what lookups did)
    assert tier.holds([chunk(1)]) == [True]  # chunk 1 used last: chunk 2 is the oldest now
    await tier.write(chunk(5), src.views, size)
    assert path_of(root, chunk(1)).exists() and not path_of(root, chunk(2)).exists()
    assert tier.holds([chunk(1), chunk(2), chunk(5)]) == [True, False, True]
    assert await tier.remove(chunk(1)) and tier.holds([chunk(1)]) == [False]
    assert await tier.contains([chunk(3)]) == [True]  # adopted from disk by a lookup
    assert tier.holds([chunk(3)]) == [True]


async def test_two_tiers_share_a_root(make_tier, tmp_path):
    root = tmp_path / "fs"
    a = await make_tier(root)
    b = await make_tier(root)
    size = PAGE * 3 + 9
    src = Slot((4,))
    data = src.fill(size, seed=11)
    assert await a.write(chunk(1), src.views, size) is WriteOutcome.WRITTEN
    assert await a.write(chunk(2), src.views, size) is WriteOutcome.WRITTEN
    assert await b.contains([chunk(1), chunk(3)]) == [True, False]  # adopted from disk
    assert b.usage().chunks == 1 and b.counters.hits == 1
    dst = Slot((4,))
    assert await b.read(chunk(1), dst.views, size) and dst.payload(size) == data
    assert await b.read(chunk(2), dst.views, size) and dst.payload(size) == data  # no contains first
    assert b.usage().chunks == 2
    assert await b.write(chunk(2), src.views, size) is WriteOutcome.ALREADY_PRESENT
    # a write of a chunk the other tier wrote adopts the file instead of rewriting it
    assert await a.write(chunk(5), src.views, size) is WriteOutcome.WRITTEN
    inode = path_of(root, chunk(5)).stat().st_ino
    assert await b.write(chunk(5), src.views, size) is WriteOutcome.ALREADY_PRESENT
    assert path_of(root, chunk(5)).stat().st_ino == inode and b.counters.writes == 0
    assert b.usage().chunks == 3
    # many misses at once take the pool path
    many = [chunk(i) for i in range(20)]
    assert await b.contains(many) == [i in (1, 2, 5) for i in range(20)]


# -- corruption ---------------------------------------------------------------------------------


async def _write_one(tier, c, size=PAGE * 4, seed=0):
    src = Slot((4,))
    data = src.fill(size, seed=seed)
    assert await tier.write(c, src.views, size) is WriteOutcome.WRITTEN
    return data


async def test_corrupt_payload_byte(make_tier, tmp_path):
    tier = await make_tier()
    size = PAGE * 4
    await _write_one(tier, chunk(1), size)
    path = path_of(tmp_path / "fs", chunk(1))
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 1234)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 1234)
        f.write(bytes([byte[0] ^ 0x01]))
    assert not await tier.read(chunk(1), Slot((4,)).views, size)
    assert not path.exists()
    assert tier.counters.checksum_failures == 1
    assert tier.usage().chunks == 0 and tier.usage().used_bytes == 0
    assert await tier.contains([chunk(1)]) == [False]


@pytest.mark.parametrize("keep", [HEADER_BYTES + PAGE * 2, 100, 0])
async def test_truncated_file(make_tier, tmp_path, keep):
    tier = await make_tier()
    size = PAGE * 4
    await _write_one(tier, chunk(1), size)
    path = path_of(tmp_path / "fs", chunk(1))
    os.truncate(path, keep)
    assert not await tier.read(chunk(1), Slot((4,)).views, size)
    assert not path.exists()
    assert tier.counters.checksum_failures == 1 and tier.usage().chunks == 0


async def test_header_naming_another_chunk(make_tier, tmp_path):
    root = tmp_path / "fs"
    tier = await make_tier(root)
    size = PAGE * 4
    data = await _write_one(tier, chunk(1), size)
    impostor = path_of(root, chunk(2))
    impostor.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path_of(root, chunk(1)), impostor)
    assert await tier.contains([chunk(2)]) == [True]  # by name only
    assert not await tier.read(chunk(2), Slot((4,)).views, size)
    assert not impostor.exists() and tier.counters.checksum_failures == 1
    dst = Slot((4,))
    assert await tier.read(chunk(1), dst.views, size) and dst.payload(size) == data


def _foreign_files(root: Path, size: int) -> dict[str, bytes]:
    """What may lie under a chunk's name, at least as long as its file, without being a copy of it."""
    other = path_of(root, chunk(2)).read_bytes()  # a valid file of another chunk
    zeros = bytes(HEADER_BYTES + size)  # renamed before its blocks reached the disk (power loss)
    header = chunkfile.encode_header(chunk(1), size, 12345)  # the chunk, other bytes (an old version)
    shorter = chunkfile.encode_header(chunk(1), size - 1, 0)  # the chunk at another length
    return {
        "zeros": zeros,
        "other chunk": other,
        "foreign": b"#!/bin/sh\n" * (HEADER_BYTES + size),
        "other bytes": header + bytes(size),
        "other length": shorter + bytes(size),
        "bad header crc": header[:100] + bytes([header[100] ^ 1]) + header[101:] + bytes(size),
    }


@pytest.mark.parametrize("what", ["zeros", "other chunk", "foreign", "other bytes", "other length", "bad header crc"])
async def test_a_write_over_a_file_that_is_no_copy_of_the_chunk_rewrites_it(make_tier, tmp_path, what):
    """A file under the chunk's name, long enough, but whose header is not the chunk's (damaged,
    foreign, another length or checksum): a write must not take it for the chunk (the chain would
    drop RAM's copy and the next read find the file corrupt); it is replaced, atomically."""
    root = tmp_path / "fs"
    tier = await make_tier(root)
    size = PAGE * 4
    await _write_one(tier, chunk(2), size, seed=2)
    path = path_of(root, chunk(1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_foreign_files(root, size)[what])
    src = Slot((4,))
    data = src.fill(size, seed=1)
    assert await tier.write(chunk(1), src.views, size) is WriteOutcome.WRITTEN
    assert tier.counters.writes == 2 and tier.counters.checksum_failures == 1
    dst = Slot((4,))
    assert await tier.read(chunk(1), dst.views, size) and dst.payload(size) == data
    assert tmp_files(root) == []


async def test_a_write_over_a_valid_copy_keeps_it(make_tier, tmp_path):
    """A file of the chunk that a daemon sharing the root wrote (same bytes): adopted, not rewritten,
    even if the file is longer than needed (O_DIRECT rounding)."""
    root = tmp_path / "fs"
    a, b = await make_tier(root), await make_tier(root)
    size = PAGE * 4 - 100
    src = Slot((4,))
    src.fill(size, seed=1)
    assert await a.write(chunk(1), src.views, size) is WriteOutcome.WRITTEN
    inode = path_of(root, chunk(1)).stat().st_ino
    assert await b.write(chunk(1), src.views, size) is WriteOutcome.ALREADY_PRESENT
    assert path_of(root, chunk(1)).stat().st_ino == inode
    assert b.counters.writes == 0 and b.counters.checksum_failures == 0 and b.usage().chunks == 1


async def test_wrong_expected_size_is_corrupt(make_tier, tmp_path):
    tier = await make_tier()
    await _write_one(tier, chunk(1), PAGE * 4)
    assert not await tier.read(chunk(1), Slot((4,)).views, PAGE * 3)
    assert tier.counters.checksum_failures == 1


async def test_unreadable_file_is_dropped_and_unlinked(make_tier, tmp_path, monkeypatch):
    """A file whose reads fail with EIO (a bad sector) is forgotten and removed, not offered by
    contains() and re-read (and failed) on every lookup; a transient error (ENOMEM) keeps it."""
    tier = await make_tier()
    heard = []
    tier.removal_listener = lambda t, c, cause: heard.append((c, cause))
    await _write_one(tier, chunk(1))
    path = path_of(tmp_path / "fs", chunk(1))
    dst = Slot((4,))
    monkeypatch.setattr(os, "preadv", failing(os.preadv, errno.ENOMEM, times=1))
    assert not await tier.read(chunk(1), dst.views, PAGE * 4)
    assert tier.counters.errors == 1 and path.exists() and await tier.contains([chunk(1)]) == [True]
    monkeypatch.setattr(os, "preadv", failing(os.preadv, errno.EIO))
    assert not await tier.read(chunk(1), dst.views, PAGE * 4)
    monkeypatch.undo()
    assert tier.counters.errors == 2 and tier.counters.checksum_failures == 0
    assert not path.exists() and tier.usage().chunks == 0 and tier.usage().used_bytes == 0
    assert heard == [(chunk(1), RemovalCause.CORRUPT)]
    assert await tier.contains([chunk(1)]) == [False]
    assert not await tier.read(chunk(1), dst.views, PAGE * 4)  # a plain miss now: no disk error
    assert tier.counters.errors == 2
    data = await _write_one(tier, chunk(1), seed=5)
    assert await tier.read(chunk(1), dst.views, PAGE * 4) and dst.payload(PAGE * 4) == data


async def test_unreadable_file_replaced_meanwhile_is_kept(make_tier, tmp_path, monkeypatch):
    """The read failed on a file that a daemon sharing the root replaced meanwhile: the index
    entry goes, the new file stays (and is adopted again)."""
    tier = await make_tier()
    data = await _write_one(tier, chunk(1))
    path = path_of(tmp_path / "fs", chunk(1))
    fresh = path.with_name(".fresh.tmp")

    def replace() -> None:
        shutil.copyfile(path, fresh)
        os.replace(fresh, path)

    monkeypatch.setattr(os, "preadv", failing(os.preadv, errno.EIO, times=1, before=replace))
    dst = Slot((4,))
    assert not await tier.read(chunk(1), dst.views, PAGE * 4)
    assert tier.counters.errors == 1 and tier.usage().chunks == 0 and path.exists()
    assert await tier.contains([chunk(1)]) == [True]
    assert await tier.read(chunk(1), dst.views, PAGE * 4) and dst.payload(PAGE * 4) == data


# -- admission ----------------------------------------------------------------------------------


async def test_second_eviction_admission(make_tier):
    tier = await make_tier(admission=AdmissionPolicy.SECOND_EVICTION)
    src = Slot((1,))
    assert await tier.write(chunk(1), src.views, PAGE) is WriteOutcome.REJECTED_ADMISSION
    assert tier.counters.rejected_admission == 1 and tier.usage().chunks == 0
    assert await tier.write(chunk(2), src.views, PAGE) is WriteOutcome.REJECTED_ADMISSION
    assert await tier.write(chunk(1), src.views, PAGE) is WriteOutcome.WRITTEN
    assert await tier.write(chunk(1), src.views, PAGE) is WriteOutcome.ALREADY_PRESENT
    tier.set_admission(AdmissionPolicy.ALWAYS)
    assert await tier.write(chunk(3), src.views, PAGE) is WriteOutcome.WRITTEN
    tier.set_admission(AdmissionPolicy.SECOND_EVICTION)
    assert await tier.write(chunk(4), src.views, PAGE) is WriteOutcome.REJECTED_ADMISSION
    assert tier.counters.rejected_admission == 3 and tier.counters.writes == 2


# -- disk full and O_DIRECT fallback -------------------------------------------------------------


@pytest.mark.root
async def test_disk_full(make_tier, small_tmpfs):
    backoff = 0.2
    tier = await make_tier(small_tmpfs, capacity=1 << 30, full_backoff_s=backoff)
    size = 256 << 10  # three fit in 1 MiB with their headers, the fourth does not
    src = Slot((64,))
    datas, outcome, i = {}, None, 0
    while True:
        datas[i] = src.fill(size, seed=i)
        outcome = await tier.write(chunk(i), src.views, size)
        if outcome is not WriteOutcome.WRITTEN:
            break
        i += 1
    assert outcome is WriteOutcome.REJECTED_FULL and i >= 1
    assert tier.counters.rejected_full == 1 and tier.counters.errors == 0
    assert tmp_files(small_tmpfs) == []
    assert not path_of(small_tmpfs, chunk(i)).exists()
    # backing off: refused at once, reads still served
    assert await tier.write(chunk(100), src.views, PAGE) is WriteOutcome.REJECTED_FULL
    assert tier.counters.rejected_full == 2
    dst = Slot((64,))
    for j in range(i):
        assert await tier.read(chunk(j), dst.views, size) and dst.payload(size) == datas[j]
    # free space, wait out the back-off: writes work again
    assert await tier.remove(chunk(0))
    await asyncio.sleep(backoff * 1.5)
    src.array[:size] = np.frombuffer(datas[i], dtype=np.uint8)
    assert await tier.write(chunk(i), src.views, size) is WriteOutcome.WRITTEN
    assert await tier.read(chunk(i), dst.views, size) and dst.payload(size) == datas[i]


@pytest.mark.root
async def test_direct_io_on_tmpfs_round_trip(make_tier, small_tmpfs):
    tier = await make_tier(small_tmpfs)
    size = PAGE * 10 + 3
    src = Slot((2, 9))
    data = src.fill(size, seed=4)
    assert await tier.write(chunk(1), src.views, size) is WriteOutcome.WRITTEN
    dst = Slot((11,))
    assert await tier.read(chunk(1), dst.views, size) and dst.payload(size) == data


@pytest.mark.root
async def test_odirect_refused_at_start_falls_back(make_tier, ramfs):
    tier = await make_tier(ramfs)
    assert not tier.direct_io
    size = PAGE * 6 + 100
    src = Slot((3, 4))
    data = src.fill(size, seed=8)
    assert await tier.write(chunk(1), src.views, size) is WriteOutcome.WRITTEN
    assert path_of(ramfs, chunk(1)).stat().st_size == HEADER_BYTES + size  # buffered: exact length
    dst = Slot((7,))
    assert await tier.read(chunk(1), dst.views, size) and dst.payload(size) == data
    assert tmp_files(ramfs) == []


@pytest.mark.root
async def test_odirect_refused_per_file_falls_back(ramfs):
    tier = FsTier("fs", ramfs, 1 << 20)  # not started: no probe, the first open finds out
    try:
        assert tier.direct_io
        size = PAGE * 2
        src = Slot((2,))
        data = src.fill(size, seed=9)
        assert await tier.write(chunk(1), src.views, size) is WriteOutcome.WRITTEN
        assert not tier.direct_io
        dst = Slot((2,))
        assert await tier.read(chunk(1), dst.views, size) and dst.payload(size) == data
    finally:
        await tier.close()


@pytest.mark.root
async def test_odirect_refused_at_the_first_read_falls_back(make_tier, ramfs):
    writer = await make_tier(ramfs)
    size = PAGE * 3
    src = Slot((3,))
    data = src.fill(size, seed=10)
    assert await writer.write(chunk(1), src.views, size) is WriteOutcome.WRITTEN
    tier = FsTier("fs", ramfs, 1 << 20)  # not started: no probe, the read's open finds out
    try:
        assert tier.direct_io
        dst = Slot((3,))
        assert await tier.read(chunk(1), dst.views, size) and dst.payload(size) == data
        assert not tier.direct_io and tier.counters.errors == 0
        path_of(ramfs, chunk(1)).write_bytes(path_of(ramfs, chunk(1)).read_bytes()[:-1] + b"?")
        assert not await tier.read(chunk(1), dst.views, size)  # the buffered path verifies too
        assert tier.counters.checksum_failures == 1 and not path_of(ramfs, chunk(1)).exists()
    finally:
        await tier.close()


@pytest.mark.parametrize(
    "code, direct", [(errno.ENOSPC, True), (errno.EIO, True), (errno.EINVAL, False)], ids=["ENOSPC", "EIO", "EINVAL"]
)
async def test_failed_odirect_probe_does_not_stop_the_start(make_tier, tmp_path, monkeypatch, code, direct):
    """Only EINVAL from the start-up probe means no O_DIRECT. A full disk (or any other error)
    must not stop the start: the cache on disk is indexed and the start-up eviction frees space."""
    root = tmp_path / "fs"
    first = await make_tier(root)
    datas = [await _write_one(first, chunk(i), seed=i) for i in range(4)]
    await first.close()
    file_bytes = path_of(root, chunk(0)).stat().st_size
    monkeypatch.setattr(os, "pwrite", failing(os.pwrite, code))  # the probe's one write
    tier = await make_tier(root, capacity=2 * file_bytes)
    monkeypatch.undo()
    assert tier.direct_io is direct
    assert tier.usage().chunks == 2 and tier.usage().used_bytes == 2 * file_bytes
    assert len(list(root.rglob("*.kv"))) == 2 and tmp_files(root) == []
    kept = [i for i in range(4) if chunk(i) in tier._index]
    dst = Slot((4,))
    for i in kept:
        assert await tier.read(chunk(i), dst.views, PAGE * 4) and dst.payload(PAGE * 4) == datas[i]


async def test_fragmented_chunk_keeps_odirect(make_tier, monkeypatch):
    """A chunk in more views than one preadv takes (IOV_MAX, 1024) is read in several calls, not
    refused with EINVAL and taken as the filesystem refusing O_DIRECT."""
    tier = await make_tier()
    pages = 1100
    size = pages * PAGE
    src = Slot((1,) * pages)
    data = src.fill(size, seed=11)
    assert await tier.write(chunk(1), src.views, size) is WriteOutcome.WRITTEN
    iovecs = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: (iovecs.append(len(bufs)), real(fd, bufs, offset))[1])
    dst = Slot((1,) * pages)
    assert await tier.read(chunk(1), dst.views, size) and dst.payload(size) == data
    assert tier.direct_io and tier.counters.errors == 0
    assert max(iovecs) <= 1024 and sum(iovecs) >= 1 + pages


async def test_einval_from_one_direct_io_falls_back_for_that_file_only(make_tier, tmp_path, monkeypatch):
    """EINVAL from an O_DIRECT read or write (not from open) says nothing about the filesystem:
    that file is read or written buffered, later ones use O_DIRECT again."""
    tier = await make_tier()
    src = Slot((4,))
    data = src.fill(PAGE * 4 - 10, seed=3)
    monkeypatch.setattr(os, "pwritev", failing(os.pwritev, errno.EINVAL, times=1))
    assert await tier.write(chunk(1), src.views, PAGE * 4 - 10) is WriteOutcome.WRITTEN
    assert path_of(tmp_path / "fs", chunk(1)).stat().st_size == HEADER_BYTES + PAGE * 4 - 10  # buffered
    monkeypatch.setattr(os, "preadv", failing(os.preadv, errno.EINVAL, times=1))
    dst = Slot((4,))
    assert await tier.read(chunk(1), dst.views, PAGE * 4 - 10) and dst.payload(PAGE * 4 - 10) == data
    monkeypatch.undo()
    assert tier.direct_io and tier.counters.errors == 0
    await _write_one(tier, chunk(2), PAGE * 4 - 10)
    assert path_of(tmp_path / "fs", chunk(2)).stat().st_size == HEADER_BYTES + PAGE * 4  # O_DIRECT


async def test_reads_files_written_buffered_with_odirect(make_tier, tmp_path):
    root = tmp_path / "fs"
    buffered = await make_tier(root, direct_io=False)
    size = PAGE * 3 + 17
    data = await _write_one(buffered, chunk(1), size)
    assert path_of(root, chunk(1)).stat().st_size == HEADER_BYTES + size
    direct = await make_tier(root)
    dst = Slot((4,))
    assert await direct.read(chunk(1), dst.views, size) and dst.payload(size) == data


# -- leftovers --------------------------------------------------------------------------------------


def _hold_lock(path: Path) -> int:
    """Open and flock `path` as a live writer does (the fd keeps the lock until closed)."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


async def test_leftover_tmp_files_go_at_start_unless_a_live_writer_holds_them(make_tier, tmp_path):
    """Temporary files of a killed writer (kill -9) are removed by the next start however young
    they are; one a live writer holds (a daemon sharing the root) stays, however old."""
    root = tmp_path / "fs"
    first = await make_tier(root)
    await _write_one(first, chunk(1))
    await first.close()
    leaf = path_of(root, chunk(1)).parent
    dead_fresh, dead_old = leaf / f".{key(1).hex()}.999.ab.1.tmp", leaf / f".{key(1).hex()}.999.ab.2.tmp"
    dead_probe = root / ".odirect-probe.999.3.tmp"
    for p in (dead_fresh, dead_old, dead_probe):
        p.write_bytes(b"partial")
    then = time.time() - 600
    os.utime(dead_old, (then, then))
    dead_fifo = leaf / f".{key(2).hex()}.999.ab.4.tmp"
    os.mkfifo(dead_fifo)  # a tmp name on something else: nobody's write, and no reason to block
    live = leaf / f".{key(3).hex()}.998.cd.1.tmp"
    live_fd = _hold_lock(live)
    os.utime(live, (then, then))
    try:
        (root / NS / "zz").mkdir()  # stray entries are ignored, not served
        (leaf / "not-a-chunk.kv").write_bytes(b"?")
        second = await make_tier(root)
        assert not any(p.exists() for p in (dead_fresh, dead_old, dead_probe, dead_fifo))
        assert live.exists()
        assert second.usage().chunks == 1
        assert await second.contains([chunk(1)]) == [True]
    finally:
        os.close(live_fd)


async def test_without_file_locks_tmp_files_go_by_age(make_tier, tmp_path, monkeypatch):
    """A filesystem without flock (some network filesystems): liveness falls back to age."""
    import fcntl

    root = tmp_path / "fs"
    leaf = root / NS / "00" / "00"
    leaf.mkdir(parents=True)
    old, fresh = leaf / ".0000aa.999.ab.1.tmp", leaf / ".0000aa.999.ab.2.tmp"
    for p in (old, fresh):
        p.write_bytes(b"partial")
    then = time.time() - 600
    os.utime(old, (then, then))
    monkeypatch.setattr(fcntl, "flock", failing(fcntl.flock, errno.ENOLCK))
    await make_tier(root)
    assert not old.exists() and fresh.exists()


async def test_writes_in_flight_count_in_used_bytes_and_survive_a_sharing_start(make_tier, tmp_path, monkeypatch):
    """A write's temporary file takes disk space while it exists: counted in used_bytes (and
    against the capacity). A daemon starting on the same root meanwhile must leave it alone."""
    import threading

    from kvstored.tiers.fs import io as fs_io

    root = tmp_path / "fs"
    tier = await make_tier(root)
    entered, release = threading.Event(), threading.Event()
    real = fs_io.pwritev_all

    def gated(fd, bufs):
        entered.set()
        release.wait()
        return real(fd, bufs)

    monkeypatch.setattr(fs_io, "pwritev_all", gated)
    size = PAGE * 4 - 100
    src = Slot((4,))
    data = src.fill(size, seed=1)
    loop = asyncio.get_running_loop()
    writing = asyncio.ensure_future(tier.write(chunk(1), src.views, size))
    try:
        assert await loop.run_in_executor(None, entered.wait, 30)
        assert tier.usage().used_bytes == HEADER_BYTES + PAGE * 4 and tier.usage().chunks == 0
        [tmp] = tmp_files(root)
        other = await make_tier(root)  # sweeps leftovers: this one has a live writer
        assert tmp.exists() and other.usage().chunks == 0
    finally:
        release.set()
    assert await writing is WriteOutcome.WRITTEN
    monkeypatch.undo()
    file_bytes = path_of(root, chunk(1)).stat().st_size
    assert tier.usage().used_bytes == file_bytes and tier.usage().chunks == 1 and tmp_files(root) == []
    dst = Slot((4,))
    assert await other.read(chunk(1), dst.views, size) and dst.payload(size) == data


# -- removal events and cancellation ------------------------------------------------------------


async def test_removal_listener_hears_evictions_and_corruption(make_tier, tmp_path):
    from kvstored.chunks.ids import RemovalCause

    size = PAGE
    tier = await make_tier(capacity=2 * (HEADER_BYTES + size))
    heard = []
    tier.removal_listener = lambda t, c, cause: heard.append((t, c, cause))
    src = Slot((1,))
    for i in range(3):
        await tier.write(chunk(i), src.views, size)
    assert heard == [(tier, chunk(0), RemovalCause.EVICTED)]
    os.truncate(path_of(tmp_path / "fs", chunk(1)), 10)
    assert not await tier.read(chunk(1), src.views, size)
    assert heard[1:] == [(tier, chunk(1), RemovalCause.CORRUPT)]
    assert await tier.remove(chunk(2))  # asked for: not an event
    assert len(heard) == 2


async def test_cancelled_write_and_read_leave_no_work_behind(make_tier):
    tier = await make_tier()
    size = PAGE * 32
    src = Slot((32,))
    data = src.fill(size, seed=1)
    task = asyncio.create_task(tier.write(chunk(1), src.views, size))
    await asyncio.sleep(0)  # the job is in the pool now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # cancellation waited for the job: the file is complete and indexed, nothing is reserved
    assert tier.usage().chunks == 1 and tier._index.reserved_bytes == 0
    dst = Slot((32,))
    task = asyncio.create_task(tier.read(chunk(1), dst.views, size))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert dst.payload(size) == data  # the read had finished filling the views before raising
    assert await tier.read(chunk(1), dst.views, size)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_concurrent_mix_keeps_index_and_disk_in_step(make_tier, tmp_path, seed):
    """Writes, reads, removes and lookups of overlapping chunks at once, with evictions: reads
    that succeed are byte-exact, and at rest the index matches the files on disk."""
    root = tmp_path / "fs"
    size = PAGE * 2 + 50
    tier = await make_tier(root, capacity=6 * (HEADER_BYTES + PAGE * 3), io_threads=3)
    rng = np.random.default_rng(seed)
    sources = {}
    for i in range(12):
        sources[i] = Slot((3,))
        sources[i].fill(size, seed=100 + i)

    async def op(n: int) -> None:
        i = int(rng.integers(0, 12))
        kind = n % 4
        if kind in (0, 1):
            await tier.write(chunk(i), sources[i].views, size)
        elif kind == 2:
            dst = Slot((3,))
            if await tier.read(chunk(i), dst.views, size):
                assert dst.payload(size) == sources[i].payload(size)
        elif n % 8 == 3:
            await tier.remove(chunk(i))
        else:
            await tier.contains([chunk(i), chunk((i + 1) % 12)])

    for _ in range(10):
        await asyncio.gather(*(op(n) for n in range(60)))
    files = {p.name: p.stat().st_size for p in root.rglob("*.kv")}
    indexed = [i for i in range(12) if chunk(i) in tier._index]
    assert sorted(files) == sorted(path_of(root, chunk(i)).name for i in indexed)
    assert tier.usage().used_bytes == sum(files.values()) <= tier.usage().capacity_bytes
    assert tier.usage().chunks == len(files) and tmp_files(root) == []
    assert tier.counters.checksum_failures == 0 and tier.counters.errors == 0


async def test_a_write_joining_one_whose_file_is_being_removed_writes_anew(tmp_path, monkeypatch):
    """write(X) in flight, remove(X) queued behind it, then X written again (deleted and stored
    again by a client): the new write must not report the file that the remove is about to unlink."""
    from kvstored.tiers.fs import io as fs_io

    real = fs_io.pwritev_all
    monkeypatch.setattr(fs_io, "pwritev_all", lambda fd, bufs: (time.sleep(0.2), real(fd, bufs))[1])
    tier = FsTier("fs", tmp_path / "fs", 64 << 20)
    await tier.start()
    try:
        buf = mmap.mmap(-1, 16 * 4096)
        chunk = ("0123456789abcdef0123456789abcdef", hashlib.sha256(b"x").digest())
        old = asyncio.create_task(tier.write(chunk, [memoryview(buf)], len(buf)))
        await asyncio.sleep(0.05)
        removing = asyncio.create_task(tier.remove(chunk))
        await asyncio.sleep(0.05)
        new = asyncio.create_task(tier.write(chunk, [memoryview(buf)], len(buf)))
        assert await old is WriteOutcome.WRITTEN and await removing
        assert await new is WriteOutcome.WRITTEN
        assert (tmp_path / "fs" / chunkfile.chunk_relpath(chunk)).exists()
        assert await tier.contains([chunk]) == [True]
    finally:
        await tier.close()


async def test_closing_during_a_slow_index_rebuild_stops_it(tmp_path, monkeypatch):
    """A stop during start-up must not wait for a scan of millions of files."""
    from kvstored.tiers.fs import tier as fs_module

    root = tmp_path / "fs"
    for i in range(30):
        (root / f"{i:032x}").mkdir(parents=True)
    calls = []
    real_scandir = os.scandir

    def slow_scandir(path):
        calls.append(path)
        time.sleep(0.05)  # a cold directory on a slow disk
        return real_scandir(path)

    monkeypatch.setattr(fs_module.os, "scandir", slow_scandir)
    tier = FsTier("fs", root, 64 << 20)
    starting = asyncio.create_task(tier.start())
    await asyncio.sleep(0.2)
    await tier.close()  # returns once the scan job has ended
    starting.cancel()
    await asyncio.gather(starting, return_exceptions=True)
    assert len(calls) < 31, "the scan went on after the tier closed"


# -- odd entries under chunk names (issue #12, defect 3) ----------------------------------------


def make_odd_entry(path: Path, kind: str, target: Path | None = None):
    """Put a non-regular entry at `path` (whatever was there goes). Returns what must stay open
    (a bound socket)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        import socket
        import tempfile

        sock = socket.socket(socket.AF_UNIX)
        short = Path(tempfile.mkdtemp(dir="/tmp")) / "s"  # unix socket paths are short: bind, then move
        sock.bind(str(short))
        os.rename(short, path)
        short.parent.rmdir()
        return sock
    elif kind == "symlink":
        assert target is not None
        path.symlink_to(target)
    elif kind == "directory":
        path.mkdir()
    elif kind == "full directory":
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    else:
        raise ValueError(kind)
    return None


async def _unless_blocked(aw, fifos: list[Path]):
    """Await `aw`; if it blocks on FIFOs, release them (open their writing ends) and fail.
    A hang guard, not a timing check: reads that do not block answer in milliseconds."""
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.wait_for(asyncio.shield(task), 30)
    except TimeoutError:
        while not task.done():  # reads queued behind the blocked ones block in their turn
            for fifo in fifos:
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # lets a blocked open() return
                except OSError:
                    pass
            await asyncio.wait((task,), timeout=0.1)
        pytest.fail(f"fs reads blocked on {fifos}")


ODD_KINDS = ["fifo", "socket", "symlink", "directory", "full directory"]


@pytest.mark.parametrize("kind", ODD_KINDS)
async def test_odd_entry_under_a_chunk_name_is_a_counted_miss_removed_alone(make_tier, tmp_path, kind):
    """A FIFO must not block an I/O thread, a directory must not turn O_DIRECT off for the whole
    tier, a symlink is not followed (even to a valid copy): each is a miss, counted, removed
    where it can be, and affects nothing but itself."""
    root = tmp_path / "fs"
    tier = await make_tier(root)
    heard = []
    tier.removal_listener = lambda t, c, cause: heard.append((c, cause))
    size = PAGE * 4
    data = {i: await _write_one(tier, chunk(i), size, seed=i) for i in range(3)}
    path = path_of(root, chunk(1))
    valid_copy = tmp_path / "copy.kv"
    shutil.copyfile(path, valid_copy)
    keep = make_odd_entry(path, kind, target=valid_copy)
    try:
        dst = Slot((4,))
        assert not await _unless_blocked(tier.read(chunk(1), dst.views, size), [path])
        assert tier.direct_io, "one odd entry turned O_DIRECT off for the whole tier"
        assert (path.exists() or path.is_symlink()) == (kind == "full directory")  # removed where possible
        assert tier.counters.bad_entries == 1
        assert tier.counters.checksum_failures == 0 and tier.counters.reads == 0
        assert heard == [(chunk(1), RemovalCause.CORRUPT)]
        assert tier.usage().chunks == 2 and await tier.contains([chunk(1)]) == [False]
        # everything else is served exactly, with O_DIRECT (page-rounded files)
        for i in (0, 2):
            assert await tier.read(chunk(i), dst.views, size) and dst.payload(size) == data[i]
        await _write_one(tier, chunk(3), PAGE * 4 - 10, seed=3)
        assert path_of(root, chunk(3)).stat().st_size == HEADER_BYTES + PAGE * 4
        assert valid_copy.exists()  # a symlink's target is never touched
        # the chunk can be written again (over whatever is left), then it is served
        src = Slot((4,))
        src.array[:size] = np.frombuffer(data[1], dtype=np.uint8)
        outcome = await tier.write(chunk(1), src.views, size)
        if kind == "full directory":  # not ours to empty: the write fails, counted
            assert outcome is WriteOutcome.FAILED and tier.counters.errors == 1
            assert tier.counters.bad_entries == 2 and path.is_dir()
        else:
            assert outcome is WriteOutcome.WRITTEN and not path.is_symlink()
            assert await tier.read(chunk(1), dst.views, size) and dst.payload(size) == data[1]
        assert tmp_files(root) == []
    finally:
        if keep is not None:
            keep.close()


async def test_as_many_fifos_as_io_threads_block_nothing(make_tier, tmp_path):
    """With every I/O thread stuck on a FIFO, no fs read could run and a stop never completed."""
    root = tmp_path / "fs"
    tier = await make_tier(root, io_threads=2)
    size = PAGE * 2
    data = {i: await _write_one(tier, chunk(i), size, seed=i) for i in range(4)}
    for i in (0, 1, 2):
        make_odd_entry(path_of(root, chunk(i)), "fifo")
    results = await _unless_blocked(
        asyncio.gather(*(tier.read(chunk(i), Slot((2,)).views, size) for i in (0, 1, 2))),
        [path_of(root, chunk(i)) for i in (0, 1, 2)],
    )
    assert results == [False] * 3 and tier.counters.bad_entries == 3
    dst = Slot((2,))
    assert await tier.read(chunk(3), dst.views, size) and dst.payload(size) == data[3]
    assert not any(path_of(root, chunk(i)).exists() for i in (0, 1, 2))


async def test_rebuild_skips_counts_and_removes_odd_entries(make_tier, tmp_path):
    root = tmp_path / "fs"
    first = await make_tier(root)
    size = PAGE * 2
    data = {i: await _write_one(first, chunk(i), size, seed=i) for i in range(6)}
    await first.close()
    valid_copy = tmp_path / "copy.kv"
    shutil.copyfile(path_of(root, chunk(0)), valid_copy)
    keep = [make_odd_entry(path_of(root, chunk(i)), kind, target=valid_copy) for i, kind in enumerate(ODD_KINDS)]
    try:
        second = await make_tier(root)
        assert second.counters.bad_entries == len(ODD_KINDS)
        assert second.usage().chunks == 1 and await second.contains([chunk(i) for i in range(6)]) == [False] * 5 + [
            True
        ]
        assert [path_of(root, chunk(i)).exists() or path_of(root, chunk(i)).is_symlink() for i in range(5)] == [
            kind == "full directory" for kind in ODD_KINDS
        ]
        dst = Slot((2,))
        assert await second.read(chunk(5), dst.views, size) and dst.payload(size) == data[5]
        assert second.direct_io and valid_copy.exists()
    finally:
        for sock in keep:
            if sock is not None:
                sock.close()


async def test_a_symlink_under_a_chunk_name_is_not_adopted(make_tier, tmp_path):
    """contains() adopts files a daemon sharing the root wrote, not symlinks (to anything)."""
    root = tmp_path / "fs"
    a = await make_tier(root)
    await _write_one(a, chunk(1))
    valid_copy = tmp_path / "copy.kv"
    shutil.copyfile(path_of(root, chunk(1)), valid_copy)
    target = path_of(root, chunk(2))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(valid_copy)
    assert await a.contains([chunk(1), chunk(2)]) == [True, False]


# -- permissions -------------------------------------------------------------------------------


@pytest.mark.parametrize(("group_access", "file_mode", "dir_mode"), [(False, 0o600, 0o700), (True, 0o640, 0o750)])
async def test_chunk_files_and_directories_are_the_daemons(make_tier, tmp_path, group_access, file_mode, dir_mode):
    """Chunk files 0600 under 0700 directories (group_access: 0640 / 0750), whatever the umask
    leaves; a file written with an older, wider mode is still served."""
    old_umask = os.umask(0o022)
    try:
        root = tmp_path / "deep" / "fs"
        tier = await make_tier(root, group_access=group_access)
        src = Slot((4,))
        data = src.fill(4 * PAGE, seed=3)
        assert await tier.write(chunk(1), src.views, 4 * PAGE) is WriteOutcome.WRITTEN
    finally:
        os.umask(old_umask)
    path = path_of(root, chunk(1))
    assert stat.S_IMODE(path.stat().st_mode) == file_mode
    for directory in (root, *[p for p in path.parents if root in p.parents]):
        assert stat.S_IMODE(directory.stat().st_mode) == dir_mode, directory
    path.chmod(0o644)  # as written by an earlier release
    dst = Slot((4,))
    assert await tier.read(chunk(1), dst.views, 4 * PAGE)
    assert dst.payload(4 * PAGE) == data


async def test_a_root_that_fails_every_write_logs_one_line_not_one_per_chunk(make_tier, tmp_path, caplog):
    """The root replaced by a regular file: every write fails (ENOTDIR), each counted, and the log
    says so once per 10 s instead of once per chunk."""
    from kvstored.tiers.fs import tier as fs_tier

    fs_tier.limited._windows.clear()  # (an earlier test's line must not hide this one's)
    root = tmp_path / "fs"
    tier = await make_tier(root)
    shutil.rmtree(root)
    root.write_bytes(b"not a directory")
    caplog.set_level(logging.WARNING, logger=fs_tier.__name__)
    src = Slot((4,))
    for i in range(8):
        assert await tier.write(chunk(i), src.views, PAGE) is WriteOutcome.FAILED
    assert tier.counters.errors == 8
    lines = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(lines) == 1 and "Not a directory" in lines[0], lines
