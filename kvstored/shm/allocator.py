# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Page allocator for a shared-memory arena (pure bookkeeping, no I/O).

An arena is cut into fixed pages. A chunk gets one contiguous run of pages when one is free
(always the case while every namespace uses one chunk size) and otherwise several runs, so
namespaces with different chunk sizes share an arena and an allocation never fails for
fragmentation: only when fewer pages are free than asked for.

Free pages are of two kinds: resident (backed by memory: reusing them costs nothing) and holes
(never touched, or returned to the kernel: the first write allocates and zeroes them, ~8x slower
than a copy into resident memory). Allocations take resident pages first. `take_resident` and
`released` let the owner return free memory to the kernel: pages taken are neither free nor
allocatable until `released` makes them holes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PageRun:
    start: int  # first page
    count: int  # number of pages


class _FreeRuns:
    """Free runs of one kind, coalesced with their neighbours of the same kind."""

    def __init__(self) -> None:
        self.runs: dict[int, int] = {}  # start -> count
        self._ends: dict[int, int] = {}  # end -> start
        self.pages = 0

    def add(self, start: int, count: int) -> None:
        end = start + count
        if start in self._ends:  # merge with the free run before
            prev = self._ends.pop(start)
            del self.runs[prev]
            start = prev
        if end in self.runs:  # merge with the free run after
            after = self.runs.pop(end)
            del self._ends[end + after]
            end += after
        self.runs[start] = end - start
        self._ends[end] = start
        self.pages += count

    def take(self, start: int, pages: int) -> PageRun:
        count = self.runs.pop(start)
        del self._ends[start + count]
        if count > pages:
            self.runs[start + pages] = count - pages
            self._ends[start + count] = start + pages
        self.pages -= pages
        return PageRun(start, pages)

    def best_fit(self, pages: int) -> int | None:
        best = None
        for start, count in self.runs.items():
            if count >= pages and (best is None or count < self.runs[best]):
                best = start
                if count == pages:
                    break
        return best

    def largest_first(self) -> list[tuple[int, int]]:
        return sorted(self.runs.items(), key=lambda item: -item[1])


class PageAllocator:
    def __init__(self, total_pages: int, resident: bool = True) -> None:
        """resident: the arena's memory is populated (False: a sparse arena, all holes)."""
        if total_pages <= 0:
            raise ValueError("a pool needs at least one page")
        self.total_pages = total_pages
        self._resident = _FreeRuns()
        self._holes = _FreeRuns()
        (self._resident if resident else self._holes).add(0, total_pages)
        self._allocated: set[PageRun] = set()  # exactly the runs handed out: frees must match
        self._releasing: set[PageRun] = set()  # taken for release: neither free nor allocated

    @property
    def free_pages(self) -> int:
        return self._resident.pages + self._holes.pages

    @property
    def resident_free_pages(self) -> int:
        """Free pages backed by memory."""
        return self._resident.pages

    @property
    def resident_pages(self) -> int:
        """Pages that may be backed by memory: allocated (their writers touch them), free but
        resident, or being released."""
        return self.total_pages - self._holes.pages

    @property
    def releasing_pages(self) -> int:
        return sum(run.count for run in self._releasing)

    def allocate(self, pages: int) -> list[PageRun] | None:
        """`pages` pages as few runs as possible, resident ones first, or None if fewer are free."""
        if pages <= 0:
            raise ValueError(f"allocation of {pages} pages")
        if pages > self.free_pages:
            return None
        for kind in (self._resident, self._holes):
            best = kind.best_fit(pages)
            if best is not None:
                return [self._hand_out(kind.take(best, pages))]
        taken: list[PageRun] = []
        remaining = pages
        for kind in (self._resident, self._holes):
            for start, count in kind.largest_first():
                taken.append(self._hand_out(kind.take(start, min(count, remaining))))
                remaining -= taken[-1].count
                if remaining == 0:
                    return taken
        raise AssertionError("free page count out of step with the free runs")

    def free(self, runs: list[PageRun]) -> None:
        """Give back allocated runs: their pages were written, so they are resident."""
        for run in runs:
            if run not in self._allocated:
                raise ValueError(f"double free of pages {run.start}..{run.start + run.count} (not an allocated run)")
        for run in runs:
            self._allocated.discard(run)
            self._resident.add(run.start, run.count)

    def take_resident(self, pages: int) -> list[PageRun]:
        """Up to `pages` resident free pages, largest runs first, to be returned to the kernel;
        they are unavailable until `released`."""
        taken: list[PageRun] = []
        remaining = pages
        for start, count in self._resident.largest_first():
            if remaining <= 0:
                break
            run = self._resident.take(start, min(count, remaining))
            self._releasing.add(run)
            taken.append(run)
            remaining -= run.count
        return taken

    def released(self, runs: list[PageRun], returned: bool = True) -> None:
        """Runs from `take_resident` are free again: holes if their memory went back to the
        kernel (`returned`), else resident."""
        for run in runs:
            if run not in self._releasing:
                raise ValueError(f"pages {run.start}..{run.start + run.count} were not taken for release")
        for run in runs:
            self._releasing.discard(run)
            (self._holes if returned else self._resident).add(run.start, run.count)

    def _hand_out(self, run: PageRun) -> PageRun:
        self._allocated.add(run)
        return run

    # -- hand-over (kvstored/server/handover.py) ---------------------------------------------

    def hole_runs(self) -> list[PageRun]:
        """The free pages that are not backed by memory (the rest of the free pages are)."""
        return [PageRun(start, count) for start, count in sorted(self._holes.runs.items())]

    @classmethod
    def restore(cls, total_pages: int, allocated: list[PageRun], holes: list[PageRun]) -> PageAllocator:
        """An allocator with exactly `allocated` handed out, `holes` free and not resident, and
        every other page free and resident. ValueError for runs out of bounds or overlapping."""
        alloc = cls(total_pages, resident=False)
        alloc._holes = _FreeRuns()
        spans = sorted([(run.start, run.count, True) for run in allocated] + [(r.start, r.count, False) for r in holes])
        alloc._resident = _FreeRuns()
        edge = 0
        for start, count, used in spans:
            if count <= 0 or start < edge or start + count > total_pages:
                raise ValueError(f"pages {start}..{start + count} overlap others or lie outside {total_pages} pages")
            if start > edge:
                alloc._resident.add(edge, start - edge)
            if used:
                alloc._allocated.add(PageRun(start, count))
            else:
                alloc._holes.add(start, count)
            edge = start + count
        if edge < total_pages:
            alloc._resident.add(edge, total_pages - edge)
        return alloc
