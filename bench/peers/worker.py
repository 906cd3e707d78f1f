# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""One client process of bench.compare: `python -m bench.peers.worker SYSTEM CONFIG_JSON`, in the system's own
venv. One JSON command a line on stdin, one JSON answer a line on stdout; it times the calls (perf_counter is
CLOCK_MONOTONIC: windows of several processes combine) and checks every loaded byte against a digest.
Also what a system's start function returns (Server): stdlib and numpy only, so it runs in any venv."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# system name -> "module:Class"; imported in the worker only (each in its own venv)
DRIVERS = {
    "kvstored": "bench.peers.local:KvstoredDriver",
    "redis": "bench.peers.local:RedisDriver",
    "memcpy": "bench.peers.local:MemcpyDriver",
    "mooncake": "bench.peers.mooncake:MooncakeDriver",  # standalone or embedded: as its server's config says
    "mooncake-embedded": "bench.peers.mooncake:MooncakeDriver",
    "lmcache": "bench.peers.lmcache:LMCacheDriver",
}


@dataclass
class Server:
    """The server side of one system: its processes (for CPU accounting), the config its client
    processes get, the python that runs them (None: the project's), a line for the report."""

    pids: Callable[[], list[int]]
    config: dict[str, Any]
    describe: str
    stop: Callable[[], Any] = lambda: None
    python: Path | None = None
    env: dict[str, str] = field(default_factory=dict)


class Driver(ABC):
    """A system's client: `slots` chunk slots of client memory (where its library wants them), slot i <-> key
    (tag, first + i). A subclass moves the bytes (store, load, lookup...); the commands the coordinator sends are
    methods of this class (one returning None answers just "ok"), which time those calls and check every loaded
    byte. A batch is fill, batch_store, zero, batch_load, verify, so that every process's timed window runs while
    the others wait (their untimed work would count in the combined window)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.chunk: int = cfg["chunk"]
        self.slots: int = cfg["slots"]
        self._key_lists: dict[tuple[str, int, int], list[Any]] = {}
        self.digests: dict[int, bytes] = {}  # slot -> what the last fill put there
        self.fills = 0

    def key_list(self, tag: str, n: int, first: int, derive: Callable[[str, int], Any]) -> list[Any]:
        """Keys tag/first..first+n-1 as the system names them, derived once: an engine has its block hashes
        before it calls (256 blake2b digests take ~0.2 ms, as long as a lookup)."""
        keys = self._key_lists.get((tag, n, first))
        if keys is None:
            keys = self._key_lists[tag, n, first] = [derive(tag, i) for i in range(first, first + n)]
        return keys

    buf: np.ndarray  # a flat buffer of `slots` chunks, where the driver has one

    def chunk_views(self, slot: int) -> list[np.ndarray]:
        """The uint8 arrays slot `slot` is made of (by default one, of the flat `buf`)."""
        return [self.buf[slot * self.chunk : (slot + 1) * self.chunk]]

    @abstractmethod
    def store(self, tag: str, n: int, first: int = 0) -> None:
        """Slots 0..n-1 -> keys tag/first..first+n-1; raises unless all are stored."""

    @abstractmethod
    def load(self, tag: str, n: int) -> None:
        """Keys tag/0..n-1 -> slots 0..n-1; raises unless all are loaded."""

    def lookup(self, tag: str, n: int) -> int:
        """How many of keys tag/0..n-1 the system holds (a prefix for prefix-keyed systems)."""
        raise NotImplementedError

    def release(self) -> None:
        """Untimed clean-up after a timed lookup (locks a lookup took)."""

    def remove(self, tag: str, n: int) -> None:
        """Drop keys tag/0..n-1 (untimed; a no-op where the system evicts by itself)."""

    def clear(self) -> None:
        """Drop every key, where the system cannot be trusted to evict what the next measurement needs."""

    def close(self) -> None:
        pass

    # -- the commands

    def _digest(self, slot: int) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for v in self.chunk_views(slot):
            h.update(v.data)
        return h.digest()

    def fill(self, n: int) -> None:
        """Distinct content per slot and per fill; the digests taken here check the loads."""
        self.fills += 1
        seed = (os.getpid() * 1009 + self.fills) & 0xFFFFF
        for s in range(n):
            for j, v in enumerate(self.chunk_views(s)):
                words = v.view(np.uint64)
                words[:] = np.arange(words.size, dtype=np.uint64)
                words ^= np.uint64((seed << 40) | (s << 20) | (j << 8) | 0x5A)
            self.digests[s] = self._digest(s)

    def zero(self, n: int) -> None:
        for s in range(n):
            for v in self.chunk_views(s):
                v[:] = 0

    def verify(self, n: int, what: str = "batch load") -> None:
        for s in range(n):
            if self._digest(s) != self.digests[s]:
                raise RuntimeError(f"{what}: slot {s} does not hold the bytes stored")

    def batch_store(self, tag: str, n: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.store(tag, n)
        return {"t0": t0, "t1": time.perf_counter()}

    def batch_load(self, tag: str, n: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.load(tag, n)
        return {"t0": t0, "t1": time.perf_counter()}

    def lat_store(self, tag: str, iters: int) -> dict[str, Any]:
        """1-chunk stores, each of a new key (removed after its timing)."""
        self.fill(1)
        lat = []
        for i in range(iters):
            key = f"{tag}-{i}"
            t0 = time.perf_counter()
            self.store(key, 1)
            lat.append(time.perf_counter() - t0)
            self.remove(key, 1)
        return {"lat": lat}

    def lat_load(self, tag: str, iters: int) -> dict[str, Any]:
        """1-chunk loads of one stored chunk, each checked."""
        self.fill(1)
        self.store(tag, 1)
        lat = []
        for _ in range(iters):
            self.zero(1)
            t0 = time.perf_counter()
            self.load(tag, 1)
            lat.append(time.perf_counter() - t0)
            self.verify(1, "1-chunk load")
        self.remove(tag, 1)
        return {"lat": lat}

    def prepare_lookup(self, tag: str, keys: int) -> None:
        """Store `keys` chunks under `tag` (from the slots, `slots` at a time) for lat_lookup."""
        self.fill(min(keys, self.slots))
        for first in range(0, keys, self.slots):
            self.store(tag, min(self.slots, keys - first), first)

    def lat_lookup(self, tag: str, iters: int, keys: int) -> dict[str, Any]:
        """Lookups of `keys` keys that prepare_lookup stored (here or in another process)."""
        lat = []
        for _ in range(iters):
            t0 = time.perf_counter()
            hits = self.lookup(tag, keys)
            lat.append(time.perf_counter() - t0)
            self.release()
            if hits != keys:
                raise RuntimeError(f"lookup of {keys} stored keys found {hits}")
        return {"lat": lat}


def main() -> int:
    # the protocol owns the real stdout; libraries that print go to stderr (the worker's log)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    system, cfg = sys.argv[1], json.loads(sys.argv[2])
    try:
        module, cls = DRIVERS[system].split(":")
        driver: Driver = getattr(importlib.import_module(module), cls)(cfg)
    except Exception as exc:  # reported to the coordinator, which prints it as the system's failure
        traceback.print_exc()
        proto.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return 1
    proto.write(json.dumps({"ok": True, "pid": os.getpid()}) + "\n")
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "quit":
                break
            try:
                reply = {"ok": True, **(getattr(driver, op)(**cmd) or {})}
            except Exception as exc:
                traceback.print_exc()
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            proto.write(json.dumps(reply) + "\n")
    finally:
        driver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
