"""Page allocator for the shared-memory pool (pure bookkeeping, no I/O).

The pool is cut into fixed pages. A chunk gets one contiguous run of pages when one is free
(always the case while every namespace uses one chunk size) and otherwise several runs, so
namespaces with different chunk sizes share the pool and an allocation never fails for
fragmentation: only when fewer pages are free than asked for.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PageRun:
    start: int  # first page
    count: int  # number of pages


class PageAllocator:
    def __init__(self, total_pages: int) -> None:
        if total_pages <= 0:
            raise ValueError("a pool needs at least one page")
        self.total_pages = total_pages
        self.free_pages = total_pages
        self._runs: dict[int, int] = {0: total_pages}  # start -> count of each free run
        self._ends: dict[int, int] = {total_pages: 0}  # end -> start, to coalesce on free
        self._allocated: set[PageRun] = set()  # exactly the runs handed out: frees must match

    def allocate(self, pages: int) -> list[PageRun] | None:
        """`pages` pages as few runs as possible, or None if fewer are free."""
        if pages <= 0:
            raise ValueError(f"allocation of {pages} pages")
        if pages > self.free_pages:
            return None
        best = None
        for start, count in self._runs.items():
            if count >= pages and (best is None or count < self._runs[best]):
                best = start
                if count == pages:
                    break
        if best is not None:
            return [self._take(best, pages)]
        taken: list[PageRun] = []
        remaining = pages
        for start, count in sorted(self._runs.items(), key=lambda item: -item[1]):
            taken.append(self._take(start, min(count, remaining)))
            remaining -= taken[-1].count
            if remaining == 0:
                break
        return taken

    def free(self, runs: list[PageRun]) -> None:
        for run in runs:
            start, end = run.start, run.start + run.count
            if run not in self._allocated:
                raise ValueError(f"double free of pages {start}..{end} (not an allocated run)")
            self._allocated.discard(run)
            if start in self._ends:  # merge with the free run before
                prev = self._ends.pop(start)
                start = prev
                del self._runs[prev]
            if end in self._runs:  # merge with the free run after
                after = self._runs.pop(end)
                del self._ends[end + after]
                end += after
            self._runs[start] = end - start
            self._ends[end] = start
            self.free_pages += run.count

    def _take(self, start: int, pages: int) -> PageRun:
        count = self._runs.pop(start)
        del self._ends[start + count]
        if count > pages:
            self._runs[start + pages] = count - pages
            self._ends[start + count] = start + pages
        self.free_pages -= pages
        run = PageRun(start, pages)
        self._allocated.add(run)
        return run
