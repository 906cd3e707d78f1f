# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Looking at an fs tier's root from the outside: its chunk files, temporary files, odd entries,
and whether a daemon's index (Stats) matches the disk."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
import time
from pathlib import Path

from kvstored.chunks import chunkfile


def chunk_path(root: Path, namespace_id: str, key: bytes) -> Path:
    return Path(root) / chunkfile.chunk_relpath((namespace_id, key))


def chunk_files(root: Path) -> dict[str, int]:
    """Every regular file under the root named as the fs tier names chunks: key hex -> size."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if chunkfile.parse_relpath(os.path.relpath(path, root)) and stat.S_ISREG(os.lstat(path).st_mode):
                out[name[:-3]] = os.lstat(path).st_size
    return out


def tmp_files(root: Path) -> list[Path]:
    return [p for p in Path(root).rglob(".*.tmp")]


def odd_entries(root: Path) -> list[Path]:
    """Entries named like chunk files that are not regular files."""
    return [p for p in Path(root).rglob("*.kv") if not p.name.startswith(".") and not stat.S_ISREG(p.lstat().st_mode)]


def make_odd_entry(path: Path, kind: str, target: Path | None = None) -> None:
    """Replace whatever is at `path` with a FIFO, socket (left unbound: opening it says ENXIO),
    symlink to `target`, or directory (empty, or holding a file: "full directory")."""
    if path.is_symlink() or path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        short = Path(tempfile.mkdtemp(dir="/tmp")) / "s"  # unix socket paths are short: bind, then move
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(short))
            os.rename(short, path)
        short.parent.rmdir()
    elif kind == "symlink":
        assert target is not None
        path.symlink_to(target)
    elif kind in ("directory", "full directory"):
        path.mkdir()
        if kind == "full directory":
            (path / "inside").write_bytes(b"x")
    else:
        raise ValueError(kind)


def fs_stats(daemon, name: str = "fs"):
    return next(t for t in daemon.stats().tiers if t.name == name)


def settled_stats(daemon, timeout: float = 60.0):
    """The daemon's Stats once background work (write-downs, promotions, unlinks) has settled:
    two equal reads with nothing queued and no write in flight. Waits for a state, not a time."""
    deadline = time.monotonic() + timeout
    prev = None
    while True:
        cur = daemon.stats()
        if prev is not None and cur.tiers == prev.tiers and all(t.queued == 0 for t in cur.tiers):
            return cur
        if time.monotonic() > deadline:
            raise AssertionError(f"the daemon's tiers never settled:\n{cur}")
        prev = cur
        time.sleep(0.05)


def assert_index_matches_disk(daemon, root: Path, name: str = "fs") -> dict[str, int]:
    """The tier's index (chunks, used bytes) equals the chunk files on disk; returns the files."""
    tier = next(t for t in settled_stats(daemon).tiers if t.name == name)
    files = chunk_files(root)
    assert (tier.chunks, tier.used_bytes) == (len(files), sum(files.values())), (
        f"index: {tier.chunks} chunks, {tier.used_bytes} bytes; disk: {len(files)} files, {sum(files.values())} bytes"
    )
    return files
