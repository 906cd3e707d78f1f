# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Key indexes: per namespace, the keys of its chunks RAM holds (READY), in a hash table in
shared memory (a memfd) that clients map read-only and probe without a round trip
(kvstored_client/_keyindex.c has the table and its rules).

A table is made the first time a session asks for its namespace's (its keys then are put in),
and kept up to date from then on as RAM's chunks come and go (RamTier's resident listener).
A client gets a read-only descriptor of it: it can read the keys, never change them. The memfd is
sealed once the daemon has mapped it (no resizing, no new writable mapping or write()), since a
client can reopen a memfd read-write through /proc: a table shrunk under the daemon would kill it
with SIGBUS, and one whose empty slots a client filled would hang its probes. Tables are sized
for twice the chunks RAM could hold of the namespace, so they never fill.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass

from kvstored.chunks.ids import ChunkId

log = logging.getLogger(__name__)

try:
    from kvstored_client import _keyindex
except ImportError:  # built without a C compiler: lookups always ask the daemon
    _keyindex = None  # type: ignore[assignment]

MAX_LOAD = 2  # slots per chunk RAM could hold: probes stay short (the table takes at most 3/4)
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1; not in Python 3.11's fcntl
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


def available() -> bool:
    """Built with the C helper, on a kernel that can seal a table against its readers."""
    return _keyindex is not None and _can_seal()


@functools.cache
def _can_seal() -> bool:
    fd = os.memfd_create("kvstored-seal-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return True
    except OSError as e:
        log.info("key indexes off: this kernel cannot seal a memfd against writes (%s); lookups ask the daemon", e)
        return False
    finally:
        os.close(fd)


@dataclass(frozen=True)
class IndexInfo:
    """What a client needs to map a table: its size (the fd goes with it)."""

    namespace_id: str
    size: int
    key_bytes: int


class KeyIndex:
    """One namespace's table (the daemon's side: the only writer)."""

    def __init__(self, namespace_id: str, key_bytes: int, max_chunks: int) -> None:
        if _keyindex is None:
            raise RuntimeError("kvstored_client._keyindex is not built")
        slots = 1 << max(4, (MAX_LOAD * max(1, max_chunks) - 1).bit_length())
        self.namespace_id = namespace_id
        self.key_bytes = key_bytes
        self.size = _keyindex.size(key_bytes, slots)
        self.fd = os.memfd_create(f"kvstored-index-{namespace_id[:16]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)  # (the daemon's own mapping stays writable)
        except BaseException:
            if hasattr(self, "_map"):
                self._map.close()
            os.close(self.fd)
            raise
        _keyindex.init(self._map, key_bytes, slots)

    @property
    def info(self) -> IndexInfo:
        return IndexInfo(self.namespace_id, self.size, self.key_bytes)

    def read_only_fd(self) -> int:
        """A new descriptor of the table that maps read-only only (the caller closes it)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def add(self, key: bytes) -> None:
        if len(key) == self.key_bytes and not _keyindex.add(self._map, key) and not self.holds([key])[0]:
            log.warning("key index of namespace %s is full: lookups of new chunks ask the daemon", self.namespace_id)

    def remove(self, key: bytes) -> None:
        if len(key) == self.key_bytes:
            _keyindex.remove(self._map, key)

    def holds(self, keys: list[bytes]) -> list[bool]:
        return [bool(b) for b in _keyindex.probe(self._map, keys)]

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


class KeyIndexes:
    """The tables of the namespaces sessions asked for, kept as RAM's chunks come and go."""

    def __init__(self) -> None:
        self._tables: dict[str, KeyIndex] = {}

    def open(self, namespace_id: str, key_bytes: int, max_chunks: int, keys: Iterable[bytes]) -> KeyIndex:
        """The namespace's table; made (with `keys`, the namespace's chunks in RAM now) if new."""
        table = self._tables.get(namespace_id)
        if table is None:
            table = self._tables[namespace_id] = KeyIndex(namespace_id, key_bytes, max_chunks)
            for key in keys:
                table.add(key)
        return table

    # -- RamTier's resident listener --------------------------------------------------------

    def added(self, chunk: ChunkId) -> None:
        table = self._tables.get(chunk[0])
        if table is not None:
            table.add(chunk[1])

    def removed(self, chunk: ChunkId) -> None:
        table = self._tables.get(chunk[0])
        if table is not None:
            table.remove(chunk[1])

    def close(self) -> None:
        for table in self._tables.values():
            table.close()
        self._tables.clear()
