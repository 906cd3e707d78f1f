# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Slots reserved ahead: pool slots a session holds for its next stores in a namespace, granted
before their keys are known (ReserveRequest.ahead, CommitRequest.ahead), so that a store copies
into one at once and posts the Commit that names its key: no round trip before the copy.

Bookkeeping only. The daemon keeps the accounting (they count against RAM and the namespace's
quotas, and are freed when the session ends); a daemon whose RAM is not its only tier grants
none, and stores then reserve per call as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TARGET = 4  # slots a session asks to hold per namespace: one-chunk stores in a row never run out
MOST = 32  # the most a session asks for (batches of more keys reserve as they go; the daemon caps it too)


class AheadSlots:
    """The slots (pb.Slot: handle + extents) one session holds per namespace."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._slots: dict[str, list[Any]] = {}

    def held(self, namespace_id: str) -> int:
        return len(self._slots.get(namespace_id, ()))

    def wanted(self, namespace_id: str, batch: int = 0) -> int:
        """How many more to ask for (0 when off): enough for TARGET, or for a batch of `batch`
        keys (up to MOST)."""
        if not self.enabled:
            return 0
        return max(0, min(MOST, max(TARGET, batch)) - self.held(namespace_id))

    def take(self, namespace_id: str, n: int) -> list[Any] | None:
        """`n` slots of the namespace, or None (and none taken) when fewer are held."""
        slots = self._slots.get(namespace_id)
        if not self.enabled or slots is None or len(slots) < n:
            return None
        taken, slots[:] = slots[:n], slots[n:]
        return taken

    def add(self, namespace_id: str, slots: Sequence[Any]) -> None:
        if slots:
            self._slots.setdefault(namespace_id, []).extend(slots)

    def adder(self, namespace_id: str):  # -> Callable[[response with .ahead], None]
        """What a posted Commit's answer is handed to: its new slots join the namespace's."""

        def add(response: Any) -> None:  # (None: the Commit failed; its slots went with it)
            if response is not None:
                self.add(namespace_id, response.ahead)

        return add

    def clear(self) -> None:
        self._slots.clear()
