# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Quarantines: views that a failed transfer's operations may still write (or read).

A transport hands one out only when it could not stop its operations within settle_timeout_s
(it never should: it guards against a UCX request that never completes). The owner of the views
must not reuse them (or, on the serving side, unpin them) until `settled` is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from kvstored.chunks.views import as_bytes


class Quarantine:
    """Views that operations of a failed transfer may still write (or read): the owner must not reuse
    them until `settled` is done. Only a transport that could not stop its operations within
    `settle_timeout_s` hands one out (it never should: it guards against a UCX request that never
    completes)."""

    def __init__(self, views: Sequence[memoryview], ops: Sequence[asyncio.Future]) -> None:
        self.views = list(views)
        self.settled: asyncio.Future = asyncio.gather(*ops, return_exceptions=True)

    @property
    def nbytes(self) -> int:
        return sum(memoryview(v).nbytes for v in self.views)

    def done(self) -> bool:
        return self.settled.done()


class Quarantines:
    """A link's or server's unsettled quarantines (those of receives cancelled by their caller too:
    check `covers()` before reusing the views of a cancelled receive)."""

    def __init__(self) -> None:
        self._pending: set[Quarantine] = set()

    def add(self, views: Sequence[memoryview], ops: Sequence[asyncio.Future]) -> Quarantine:
        q = Quarantine(views, ops)
        self._pending.add(q)
        q.settled.add_done_callback(lambda _: self._pending.discard(q))
        return q

    def pending(self) -> list[Quarantine]:
        return [q for q in self._pending if not q.done()]

    def covers(self, views: Sequence[memoryview]) -> Quarantine | None:
        """The unsettled quarantine holding any of these views' memory, if one does."""
        spans = {_span(v) for v in views}
        for q in self.pending():
            if any(_overlap(_span(v), s) for v in q.views for s in spans):
                return q
        return None

    async def wait(self, timeout_s: float) -> bool:
        """Wait (bounded) for every pending quarantine; True if none is left."""
        pending = [q.settled for q in self.pending()]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        return not self.pending()


def _span(view: memoryview) -> tuple[int, int]:
    """The address range a view covers (views of one pool compare by address)."""
    view = as_bytes(view)
    if not view.nbytes:
        return (0, 0)
    start = np.frombuffer(view, dtype=np.uint8).ctypes.data
    return (start, start + view.nbytes)


span_of = _span  # (public: the peer tier keys slots in flight by it)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]
