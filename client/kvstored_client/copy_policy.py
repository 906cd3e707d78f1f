# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""How a batch of chunk copies is split across threads: one policy for the daemon's region <-> pool
copier (kvstored/shm/copier.py) and the client's buffer <-> pool copier (buffers.ChunkCopier).

One core's memcpy reaches a fraction of a node's memory bandwidth, so a large batch is cut into
parts, one per thread; a part below MIN_PART_BYTES costs more in the thread hand-off than it gains.
"""

from __future__ import annotations

import os

MIN_PART_BYTES = 8 << 20


def part_count(total_bytes: int, items: int, threads: int) -> int:
    """How many parts a batch of `items` chunks and `total_bytes` is split into (1: no split)."""
    return max(1, min(threads, items, total_bytes // MIN_PART_BYTES))


def daemon_copy_threads() -> int:
    """The daemon's default: one thread per 8 cores, 2 to 8. It copies for every client of the
    node at once and shares memory bandwidth with the engines' own work."""
    return max(2, min(8, (os.cpu_count() or 2) // 8))


def client_copy_threads() -> int:
    """A client's default: one thread per core, up to 4. It copies only its own caller's batch,
    on cores that would otherwise wait for that copy."""
    return max(1, min(4, os.cpu_count() or 1))
