# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The payload's xxh3-64 (the chunk format's checksum), fed while the bytes move: each piece is
hashed right after the kernel copied it, while it is still in the CPU cache. Hashing a 2 MiB
chunk from memory costs about half the CPU of moving it over loopback TCP on these machines;
from the cache, a fraction of that."""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvstored.chunks.views import as_bytes


class StreamDigest:
    """xxh3-64 of `pieces` (the payload), which start `skip` bytes into a stream of bytes that
    is moved in any steps: call moved(n) after each step."""

    def __init__(self, pieces: Sequence[memoryview], skip: int = 0) -> None:
        self._pieces = [as_bytes(p) for p in pieces if len(p)]
        self._skip = skip
        self._i = 0
        self._offset = 0
        self._hash = xxhash.xxh3_64()
        self.moved_bytes = 0  # of the stream (skipped bytes and what follows the pieces included)

    def moved(self, n: int) -> None:
        self.moved_bytes += n
        if self._skip:
            step = min(n, self._skip)
            self._skip -= step
            n -= step
        while n and self._i < len(self._pieces):
            piece = self._pieces[self._i]
            take = min(n, len(piece) - self._offset)
            self._hash.update(piece[self._offset : self._offset + take])
            self._offset += take
            n -= take
            if self._offset == len(piece):
                self._i += 1
                self._offset = 0

    @property
    def complete(self) -> bool:
        return self._i == len(self._pieces)

    def intdigest(self) -> int:
        return self._hash.intdigest()
