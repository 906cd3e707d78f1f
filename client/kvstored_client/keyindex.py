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

import mmap
import os
from collections.abc import Sequence

try:
    from kvstored_client import _keyindex
except ImportError:  # built without a C compiler
    _keyindex = None  # type: ignore[assignment]

available = _keyindex is not None


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
            _keyindex.entries(self._map)  # checks the header: ValueError for anything else

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
