# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A namespace's key index as a client sees it: the keys of the chunks the daemon's RAM holds,
in shared memory the daemon keeps up to date, mapped read-only (OpenIndex over the session
socket). A lookup whose keys are all there is answered here, with no round trip; its hits are
then told to the daemon by a posted Touch (recency, metrics). A key found here may be gone by
the time it is loaded (the load misses it, as after any lookup); one not found here may be held
below RAM or have just come: those lookups ask the daemon.

Needs the C helper (kvstored_client._keyindex); without it `available` is False and every
lookup asks the daemon.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterator, Sequence

try:
    from kvstored_client import _keyindex
except ImportError:  # built without a C compiler
    _keyindex = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

available = _keyindex is not None

# Hits found in key indexes are told to the daemon in batches: when this many keys wait, or the
# oldest has waited this long (checked at each call), and before a gRPC call.
TOUCH_KEYS = 4096
TOUCH_DELAY_S = 0.05
TOUCH_PER_PACKET = 1024  # distinct keys per Touch (1024 keys of 32 bytes: 34 KiB of a 64 KiB packet)


class KeyIndexView:
    """A read-only mapping of one namespace's key index."""

    def __init__(self, fd: int, size: int, key_bytes: int) -> None:
        """Takes `fd` (closed here)."""
        try:
            self._map: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.key_bytes = key_bytes
        if _keyindex is not None:
            try:
                _keyindex.entries(self._map)  # checks the header: ValueError for anything else
            except ValueError:
                self.close()
                raise

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many keys, from the first, RAM holds (stops at the first it does not)."""
        if self._map is None or _keyindex is None:
            return 0
        return _keyindex.leading(self._map, keys)

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: RAM holds it."""
        if self._map is None or _keyindex is None:
            return [False] * len(keys)
        return list(map(bool, _keyindex.probe(self._map, keys)))

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def open_view(namespace_id: str, fd: int, size: int, key_bytes: int) -> KeyIndexView | None:
    """The index the daemon handed over (takes `fd`), or None where it cannot be mapped or read
    (a daemon of another version, no memory for the mapping): that namespace's lookups ask the
    daemon, as for an index it refused."""
    try:
        return KeyIndexView(fd, size, key_bytes)
    except (ValueError, OSError) as exc:
        log.warning("key index of namespace %s not usable (%s): its lookups ask the daemon", namespace_id, exc)
        return None


class Touches:
    """The hits a session found in its key indexes and has not told the daemon of yet."""

    def __init__(self) -> None:
        self._hits: dict[str, list[Sequence[bytes]]] = {}  # namespace id -> the keys of each lookup
        self._keys = 0
        self._since = 0.0

    def add(self, namespace_id: str, keys: Sequence[bytes], now: float) -> None:
        if not self._keys:
            self._since = now
        self._hits.setdefault(namespace_id, []).append(list(keys))
        self._keys += len(keys)

    def due(self, now: float) -> bool:
        return self._keys >= TOUCH_KEYS or (self._keys > 0 and now - self._since >= TOUCH_DELAY_S)

    def __bool__(self) -> bool:
        return self._keys > 0

    def take(self, per_request: int = TOUCH_PER_PACKET) -> Iterator[tuple[str, list[bytes], int]]:
        """(namespace id, its distinct keys, the key lookups they stand for), at most
        `per_request` keys at a time (a packet's worth, or fewer)."""
        per_request = max(1, min(per_request, TOUCH_PER_PACKET))
        hits, self._hits, self._keys = self._hits, {}, 0
        for namespace_id, lookups in hits.items():
            distinct = list(dict.fromkeys(key for keys in lookups for key in keys))
            total = sum(map(len, lookups))
            for start in range(0, len(distinct), per_request):
                part = distinct[start : start + per_request]
                # (the first part carries the repeats: every key stands for one lookup at least)
                yield namespace_id, part, total - (len(distinct) - len(part)) if start == 0 else len(part)
