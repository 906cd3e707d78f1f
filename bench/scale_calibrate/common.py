# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Constants, the machine's own counters and key helpers of the calibration."""

from __future__ import annotations

import os
import re
import secrets
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from bench.lib.daemons import REPO, process_cpu_seconds

DEFAULT_OUT = REPO / "docs" / "scale-out-calibration.json"
README_BYTES_PER_ENTRY = 171  # README "A cluster of nodes": tracemalloc over 1,000,000 entries, 5 peers
SMALL = 4096  # bytes of the chunks whose count matters, not their size
LIFE_CHUNK = 256 << 10  # chunks of the lifecycle phase: RAM and fs fill with few of them
FS_BYTES = 16 << 20  # each node's fs tier: small, so the lifecycle phase reaches fs evictions
SINGLE_EVENTS = 1500  # stores of one key (single-key events)
BIG_BATCH = 1000  # keys per store in the batched phases
WAIT_S = 60.0  # a bound on every wait for the daemons' state, never a measurement


def tcp_received(pid: int, dport: int) -> tuple[int, int]:
    """Bytes and segments the TCP sockets of `pid` connected to port `dport` have received (tcp_info via ss)."""
    command = ["ss", "-tinpH", "state", "established", f"( dport = :{dport} )"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=10).stdout
    total, segs, mine = 0, 0, False
    for line in out.splitlines():
        if "users:" in line:
            mine = f"pid={pid}," in line
            continue
        if mine:
            got = re.search(r"\bbytes_received:(\d+)", line)
            seg = re.search(r"\bsegs_in:(\d+)", line)
            total += int(got[1]) if got else 0
            segs += int(seg[1]) if seg else 0
            mine = False
    return total, segs


def cpu_rates(pids: Sequence[int], seconds: float) -> list[float]:
    """The CPU seconds per second each of `pids` spent while this process slept `seconds`."""
    c0, t0 = [process_cpu_seconds(p) for p in pids], time.monotonic()
    time.sleep(seconds)
    c1, t1 = [process_cpu_seconds(p) for p in pids], time.monotonic()
    return [(b - a) / (t1 - t0) for a, b in zip(c0, c1)]


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def ns_fields(model: str, chunk_bytes: int) -> dict[str, Any]:
    return {"model": f"scale-calibrate/{model}", "dtype": "u8", "chunk_bytes": chunk_bytes}


def new_keys(n: int, tag: str) -> list[bytes]:
    """`n` keys: numbered and tagged, or random without a tag."""
    if not tag:
        return [secrets.token_bytes(32) for _ in range(n)]
    return [int.to_bytes(i, 24, "big") + tag.encode()[:8].ljust(8, b"-") for i in range(n)]


def batches(keys: Sequence[bytes], n: int) -> Iterator[Sequence[bytes]]:
    for i in range(0, len(keys), n):
        yield keys[i : i + n]


def storing(
    kv: Any, ns: Any, keys: Sequence[bytes], batch: int, data: np.ndarray, rate: float = 0.0
) -> Callable[[], int]:
    """A phase's work: store `keys` in batches of `batch` (each from `data`'s first rows), `rate`
    batches a second if given; returns how many keys it stored."""

    def work() -> int:
        t0 = time.monotonic()
        for i, part in enumerate(batches(keys, batch)):
            kv.store(ns, part, data[: len(part)])
            if rate:
                time.sleep(max(0.0, t0 + (i + 1) / rate - time.monotonic()))
        return len(keys)

    return work


def timed(call: Callable[[], object], reps: int) -> float:
    """The median wall time of `reps` calls."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
