# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Pages a client may still be writing, or reading, after a hand-over ended its session.

A client copies into a slot (reserved ahead, or by Reserve) after checking that its session
stands; a copy under way when the old daemon ends that session still lands. The next daemon must
not give those pages to another chunk meanwhile, or that chunk's bytes would be overwritten. So
the slots and reservations a session held when a hand-over ended it go over as held pages
(RamTier.hold). Its leases go over too, as held leases on the adopted chunks (RamTier.keep):
the vLLM direct spec's worker copies a chunk its scheduler leased to the GPU whenever its
stream gets there, and must not read pages the next daemon gave to another chunk meanwhile.
Both are kept until the first of:
- the client says it is done with that session: Hello.released_sessions, from the same process
  (the Python client waits for its copies into the old session to end before it opens a new one);
- the client's process exits (watched with a pidfd);
- HOLD_MAX_S passes (a client that never says so, or whose pid cannot be watched).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from kvstored.chunks.ids import ChunkId
from kvstored.tiers.ram import ChunkRecord, EntryState, HeldPages, RamEntry, RamTier

log = logging.getLogger(__name__)

HOLD_MAX_S = 60.0  # a copy into the pool takes milliseconds; a client stalled longer is not waited for


def pid_namespace() -> int:
    """This process's pid namespace (its inode; 0: unknown): pids mean the same only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@dataclass(frozen=True, slots=True)
class HeldRecord:
    """One ended session's held pages and leases, as a hand-over carries them."""

    session_id: str
    pid: int  # the client's, as the session socket saw it (0: unknown)
    pages: tuple[HeldPages, ...]
    seconds_left: float
    leased: tuple[ChunkId, ...] = ()  # chunks it held leases on


def leases_as_pages(records: Sequence[HeldRecord], chunks: Sequence[ChunkRecord]) -> list[HeldRecord]:
    """`records` with their leased chunks held as pages instead, for a tier that refused the
    chunks' index: those pages are free there, and a late reader's must stay out of use. A chunk
    several sessions leased is in each one's pages (it is held until the last is done)."""
    by_id = {r.chunk: r for r in chunks}
    return [
        replace(
            h,
            pages=h.pages
            + tuple(dict.fromkeys(HeldPages(by_id[c].arena, by_id[c].runs, c[0]) for c in h.leased if c in by_id)),
            leased=(),
        )
        for h in records
    ]


def unique_pages(records: Sequence[HeldRecord]) -> list[HeldPages]:
    """The pages `records` hold, each once (several sessions may hold the same), in order: what a
    tier adopts as held entries, one per item."""
    return list(dict.fromkeys(p for h in records for p in h.pages))


def _deleted(leased: Sequence[RamEntry]) -> list[RamEntry]:
    """Leased chunks deleted meanwhile, each once: in no snapshot, yet their reader may still read
    their pages (they go over as held pages, with each session leasing them)."""
    return [e for e in dict.fromkeys(leased) if not e.indexed and e.runs]


@dataclass
class _Held:
    session_id: str
    pid: int
    entries: list[RamEntry]
    timer: asyncio.TimerHandle
    leased: list[RamEntry]
    pidfd: int | None = None


class HeldWrites:
    """The held pages of ended sessions (see the module's docstring). Used from the event loop."""

    def __init__(self, ram: RamTier, max_s: float = HOLD_MAX_S) -> None:
        self._ram = ram
        self._max_s = max_s
        self._held: dict[str, _Held] = {}
        self._holders: dict[RamEntry, int] = {}  # held entry -> sessions holding it (several: a shared chunk)

    @property
    def sessions(self) -> int:
        return len(self._held)

    def hold(
        self,
        session_id: str,
        pid: int,
        entries: Sequence[RamEntry],
        seconds: float | None = None,
        leased: Sequence[RamEntry] = (),
    ) -> None:
        """Keep `entries` (reservations of an ended session, or held entries adopted from a
        hand-over) from use, and `leased` (chunks leased to it, whose lease this takes over)
        where they are, until the session is released, its process exits or `seconds`
        (HOLD_MAX_S) pass."""
        for entry in entries:
            if entry.state is not EntryState.HELD:
                self._ram.hold(entry)
            self._holders[entry] = self._holders.get(entry, 0) + 1
        for entry in leased:
            self._ram.hold_lease(entry)
        if not entries and not leased:
            return
        known = self._held.get(session_id)
        if known is not None:  # (named twice: one session, one hold)
            known.entries.extend(entries)
            known.leased.extend(leased)
            return
        loop = asyncio.get_running_loop()
        seconds = self._max_s if seconds is None else max(0.0, min(seconds, self._max_s))
        timer = loop.call_later(seconds, self._free, session_id, "expired")
        held = _Held(session_id, pid, list(entries), timer, list(leased))
        self._held[session_id] = held
        log.info(
            "hand-over: holding %d slot(s) and %d leased chunk(s) of ended session %s (client pid %s) until it is "
            "done with them",
            len(entries),
            len(leased),
            session_id[:8],
            pid or "unknown",
        )
        if pid > 0:
            try:
                held.pidfd = os.pidfd_open(pid)
            except ProcessLookupError:  # (soon, not now: a caller holding the same pages for
                # other sessions counts them first)
                loop.call_soon(self._free, session_id, "its client has exited")
                return
            except (OSError, OverflowError) as exc:  # (no pidfds here, or no such pid: the timer frees them)
                log.debug("cannot watch pid %d: %s", pid, exc)
                return
            loop.add_reader(held.pidfd, self._free, session_id, "its client has exited")

    def release(self, pid: int, session_ids: Iterable[str]) -> int:
        """A client (`pid`) is done with these ended sessions; returns the sessions freed. A
        session's id is its client's secret; a held session with a known pid must also be named
        from that process."""
        freed = 0
        for session_id in session_ids:
            held = self._held.get(session_id)
            if held is not None and held.pid in (0, pid):
                self._free(session_id, "its client is done with it")
                freed += 1
        return freed

    def records(self) -> list[HeldRecord]:
        loop = asyncio.get_running_loop()
        return [
            HeldRecord(
                h.session_id,
                h.pid,
                tuple(HeldPages.of(e) for e in [*h.entries, *_deleted(h.leased)]),
                h.timer.when() - loop.time(),
                tuple(e.chunk for e in h.leased if e.indexed),
            )
            for h in self._held.values()
        ]

    def close(self) -> None:
        """Stop watching; what is held stays held (a hand-over carries it on: records())."""
        for held in self._held.values():
            self._unwatch(held)

    def _free(self, session_id: str, why: str) -> None:
        held = self._held.pop(session_id, None)
        if held is None:
            return
        self._unwatch(held)
        for entry in held.entries:
            holders = self._holders.pop(entry) - 1
            if holders:
                self._holders[entry] = holders
            else:
                self._ram.free_held(entry)
        for entry in held.leased:
            self._ram.free_lease(entry)
        log.info("hand-over: freed the held pages of ended session %s: %s", session_id[:8], why)

    @staticmethod
    def _unwatch(held: _Held) -> None:
        held.timer.cancel()
        if held.pidfd is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(held.pidfd)
            os.close(held.pidfd)
            held.pidfd = None
