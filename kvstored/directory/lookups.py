# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The reader's bookkeeping (no I/O): from a lookup's hashes to the holders that may be asked.

A field counts when its holder's heartbeat is alive and names the field's incarnation. Heartbeats
are cached for `max_age_s` (one write interval): a lookup's holders seen recently cost no second
round trip, and a dead holder is believed alive for at most heartbeat_ttl_s + max_age_s.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvstored.chunks.ids import TierKind
from kvstored.directory.keys import Holder, parse_field

_RANK = {TierKind.RAM: 0, TierKind.FS: 1}


@dataclass(frozen=True, slots=True)
class Verdict:
    live: list[Holder]  # RAM holders first
    stale: list[tuple[Holder, bytes]]  # fields of dead or restarted holders (to delete), with their raw field


class HeartbeatCache:
    def __init__(self, max_age_s: float, max_entries: int = 65_536) -> None:
        self.max_age_s = max_age_s
        self.max_entries = max_entries
        self._seen: OrderedDict[str, tuple[int | None, float]] = OrderedDict()  # address -> (incarnation, when)

    def due(self, addresses: Iterable[str], now: float) -> list[str]:
        """Those not checked within max_age_s (each once)."""
        out = []
        for address in dict.fromkeys(addresses):
            seen = self._seen.get(address)
            if seen is None or now - seen[1] >= self.max_age_s:
                out.append(address)
        return out

    def update(self, address: str, incarnation: int | None, now: float) -> None:
        self._seen[address] = (incarnation, now)
        self._seen.move_to_end(address)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

    def incarnation(self, address: str) -> int | None:
        seen = self._seen.get(address)
        return seen[0] if seen is not None else None

    def known(self, address: str) -> bool:
        return address in self._seen


def judge(fields: Mapping[bytes, bytes] | None, own_address: str, heartbeats: HeartbeatCache) -> Verdict:
    """The holders a chunk's hash names, split into live ones (best tier first) and stale ones.
    A holder not yet checked counts as neither (the caller checks first)."""
    live, stale = [], []
    for raw in fields or ():
        holder = parse_field(raw)
        if holder is None or holder.address == own_address or not heartbeats.known(holder.address):
            continue
        if heartbeats.incarnation(holder.address) == holder.incarnation:
            live.append(holder)
        else:
            stale.append((holder, raw))
    live.sort(key=lambda h: _RANK.get(h.kind, 9))
    return Verdict(live, stale)


def named_addresses(replies: Iterable[Mapping[bytes, bytes] | None], own_address: str) -> list[str]:
    out: dict[str, None] = {}
    for fields in replies:
        for raw in fields or ():
            holder = parse_field(raw)
            if holder is not None and holder.address != own_address:
                out[holder.address] = None
    return list(out)
