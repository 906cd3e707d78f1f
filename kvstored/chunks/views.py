# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Chunk buffers as handed to lower tiers: lists of memoryviews over the pool's pages."""

from __future__ import annotations

from collections.abc import Sequence


def as_bytes(view) -> memoryview:
    view = memoryview(view)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def check_views(views: Sequence[memoryview], size: int) -> None:
    if size < 0:
        raise ValueError(f"negative chunk size {size}")
    if sum(memoryview(v).nbytes for v in views) < size:
        raise ValueError(f"views hold fewer than {size} bytes")


def trim(views: Sequence[memoryview], size: int) -> list[memoryview]:
    """The first `size` bytes of `views`, as byte views."""
    if size < 0:
        raise ValueError(f"negative chunk size {size}")
    out, remaining = [], size
    for view in views:
        if remaining <= 0:
            break
        part = as_bytes(view)[:remaining]
        if len(part):
            out.append(part)
            remaining -= len(part)
    if remaining > 0:
        raise ValueError(f"views hold fewer than {size} bytes")
    return out


def advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """What is left of `bufs` once a vectored read or write has moved `n` bytes."""
    i = 0
    while i < len(bufs) and n >= len(bufs[i]):
        n -= len(bufs[i])
        i += 1
    rest = bufs[i:]
    if n:
        rest[0] = rest[0][n:]
    return rest
