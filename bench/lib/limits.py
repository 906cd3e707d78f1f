# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The physical limits of this machine that the benchmarks read their figures against: memcpy, raw
O_DIRECT files, the page cache, glibc's non-temporal memcpy threshold."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.lib.buffers import aligned_pool, populate

GIB = 1 << 30
MIB = 1 << 20
NT_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"


def drop_page_cache(level: int = 3) -> bool:
    """sync, then drop the page cache (1) or also dentries and inodes (3); root only."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write(f"{level}\n")
        return True
    except OSError:
        return False


def memcpy_gib_s(nbytes: int = 256 * MIB, repeat: int = 3) -> float:
    """One large copy between populated buffers (glibc's non-temporal stores at this size): the
    memory bandwidth of one core, best of `repeat`."""
    return max(memcpy_pieces_gib_s(nbytes, nbytes, repeat))


def memcpy_pieces_gib_s(piece: int, total: int, rounds: int) -> list[float]:
    """`total` bytes copied `piece` bytes at a time, one thread (what a RAM-tier load copies), per round."""
    src = populate(np.ones(total, dtype=np.uint8))
    dst = populate(np.empty(total, dtype=np.uint8))
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for a in range(0, total, piece):
            np.copyto(dst[a : a + piece], src[a : a + piece])
        out.append(total / GIB / (time.perf_counter() - t0))
    return out


class ODirectFiles:
    """`n` files of `size` bytes (one per chunk) in a fresh directory under `parent`, written and
    read with O_DIRECT by `threads` threads: as many I/Os at the disk as a tier with that many."""

    def __init__(self, parent: str | os.PathLike, n: int, size: int, threads: int) -> None:
        self.n, self.size = n, size
        self.root = Path(tempfile.mkdtemp(prefix="kvstored-raw-odirect-", dir=parent))
        self.paths = [str(self.root / f"{i:06d}.raw") for i in range(n)]
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-odirect")
        self._local = threading.local()

    def _view(self, buf: memoryview | None, i: int) -> memoryview:
        if buf is None:  # each thread reads into a buffer of its own
            if getattr(self._local, "buf", None) is None:
                self._local.buf = memoryview(aligned_pool(self.size))
            return self._local.buf
        return buf if len(buf) == self.size else buf[i * self.size : (i + 1) * self.size]

    def write(self, src: memoryview) -> float:
        """Chunk i from src[i * size:] (or all of src when it is one chunk); wall seconds."""
        return self._timed(lambda i: self._io(i, src, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, os.pwritev), 0)

    def read(self, dst: memoryview | None = None, batch: int = 0) -> float:
        """Every file into dst (None: per-thread buffers), all queued at once or `batch` at a time,
        one batch after another; wall seconds."""
        return self._timed(lambda i: self._io(i, dst, os.O_RDONLY, os.preadv), batch)

    def _io(self, i: int, buf: memoryview | None, flags: int, call) -> None:
        fd = os.open(self.paths[i], flags | os.O_DIRECT | os.O_CLOEXEC, 0o644)
        try:
            if call(fd, [self._view(buf, i)], 0) != self.size:
                raise RuntimeError(f"short O_DIRECT {call.__name__}")
        finally:
            os.close(fd)

    def _timed(self, op, batch: int) -> float:
        t0 = time.perf_counter()
        step = batch or self.n
        for start in range(0, self.n, step):
            list(self.pool.map(op, range(start, min(self.n, start + step))))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass(frozen=True)
class DiskLimit:
    """Raw O_DIRECT of one file per chunk (header page + payload, as the fs tier writes them)."""

    write_gib_s: float
    read_gib_s: float  # page cache dropped first (when root); O_DIRECT reads bypass it anyway
    queue_depth: int
    chunk_bytes: int


def raw_odirect(directory: str | os.PathLike, chunks: int, chunk_bytes: int, queue_depth: int) -> DiskLimit:
    """Write then read `chunks` files of 4 KiB + chunk_bytes from `queue_depth` threads, on the same disk."""
    files = ODirectFiles(directory, chunks, 4096 + chunk_bytes, queue_depth)
    try:
        os.sync()
        w = files.write(memoryview(aligned_pool(files.size)))
        drop_page_cache()
        r = files.read()
    finally:
        files.close()
    total = chunks * chunk_bytes
    return DiskLimit(total / w / GIB, total / r / GIB, queue_depth, chunk_bytes)


def glibc_non_temporal_threshold() -> int | None:
    """glibc's memcpy size from which it uses non-temporal stores, as this process sees it
    (GLIBC_TUNABLES included; derived from the L3 size: copies below it run ~2x slower here);
    None if ld.so cannot list its tunables."""
    for ld in filter(os.path.exists, ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1")):
        try:
            out = subprocess.run([ld, "--list-tunables"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        for line in out.splitlines():
            if line.startswith(f"{NT_TUNABLE}:"):
                return int(line.split(":", 1)[1].split()[0], 16)
    return None


def nt_threshold_arg(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    ap.add_argument(
        "--nt-threshold",
        default=str(1 << 20),
        metavar="BYTES|off",
        help="run with GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=BYTES (default 1 MiB, "
        "as the daemon does for itself); 'off' keeps glibc's default",
    )


def apply_nt_threshold(value: str) -> None:
    """Re-exec this process (once) with glibc's non-temporal memcpy threshold at `value` bytes ("off":
    glibc's default), as the daemon sets it for itself; every process started from here inherits it."""
    if value == "off" or NT_TUNABLE in os.environ.get("GLIBC_TUNABLES", ""):
        return
    current = os.environ.get("GLIBC_TUNABLES", "")
    env = dict(os.environ, GLIBC_TUNABLES=":".join(filter(None, [current, f"{NT_TUNABLE}={int(value):#x}"])))
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
