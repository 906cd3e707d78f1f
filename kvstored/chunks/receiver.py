# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A chunk record (header + payload, kvstored/chunks/chunkfile.py) received piece by piece, as a
network body arrives: the header goes to a buffer of its own, the payload straight into the
caller's views and into the running checksum. One copy per byte and no whole-record buffer; the
views hold unverified bytes until `problem()` says None, so the caller must not serve them before
(as with an fs read into a slot: a failed read leaves the views undefined)."""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES, CorruptChunk
from kvstored.chunks.ids import ChunkId


class RecordReceiver:
    def __init__(self, chunk: ChunkId, size: int, targets: Sequence[memoryview]) -> None:
        """`targets`: byte views holding exactly `size` bytes (kvstored.chunks.views.trim)."""
        self.chunk = chunk
        self.size = size
        self._header = bytearray(HEADER_BYTES)
        self._targets = list(targets)
        self._hash = xxhash.xxh3_64()
        self.received = 0  # bytes fed so far (past the record's length: counted, not kept)
        self._target = 0  # index of the view the next payload byte goes to
        self._offset = 0  # offset in that view

    @property
    def expected(self) -> int:
        return HEADER_BYTES + self.size

    def feed(self, piece: bytes | memoryview) -> None:
        data = memoryview(piece)
        start = self.received
        self.received += len(data)
        if start >= self.expected:
            return
        data = data[: self.expected - start]
        if start < HEADER_BYTES:
            take = min(len(data), HEADER_BYTES - start)
            self._header[start : start + take] = data[:take]
            data = data[take:]
        if not data:
            return
        self._hash.update(data)
        while data:
            target = self._targets[self._target]
            take = min(len(data), len(target) - self._offset)
            target[self._offset : self._offset + take] = data[:take]
            data = data[take:]
            self._offset += take
            if self._offset == len(target):
                self._target += 1
                self._offset = 0

    def problem(self) -> str | None:
        """Why the bytes received are not the chunk's verified payload (None: the views hold it)."""
        if self.received != self.expected:
            return f"record is {self.received} bytes, expected {self.expected}"
        try:
            chunkfile.verify_digest(
                chunkfile.decode_header(memoryview(self._header)), self.chunk, self.size, self._hash.intdigest
            )
        except CorruptChunk as exc:
            return str(exc)
        return None
