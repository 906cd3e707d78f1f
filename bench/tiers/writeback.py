# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The write-back stream row: a daemon with little RAM and an fs tier."""

from __future__ import annotations

import hashlib
import itertools
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from bench.lib.buffers import ShmFile
from bench.lib.daemons import Daemon
from bench.lib.report import GIB, MIB
from bench.tiers.common import WB_REGION_SLOTS, WB_VERIFY_CHUNKS, Pool, tier_dirs


class WriteBackStream:
    """A daemon whose RAM (--wb-ram-mib) is a fraction of the stream, with an fs tier (write-back,
    the default policy and queue settings), fed by `streams` clients storing from one registered
    region in RPCs of `batch` chunks (what the vLLM tier sends). RAM is first filled with chunks
    that have no copy below (untimed), so every chunk of the timed stream pushes an older one
    down to the disk: the rate is what write-back sustains when RAM is full."""

    def __init__(self, args, src: Pool, workdir: Path, rnd: int) -> None:
        from kvstored_client import Client, NamespaceSpec

        self.n, self.size = args.fs_chunks, args.chunk_bytes
        self._src = src
        self.batch, self.streams = args.wb_batch, args.wb_streams
        ram = args.wb_ram_mib * MIB
        self.prefill = ram // self.size
        self.root = workdir / f"wb-{rnd}"
        self.keys = [
            hashlib.blake2b(f"wb:{rnd}:{i}".encode(), digest_size=32).digest() for i in range(self.prefill + self.n)
        ]
        self.daemon = Daemon(
            ram, extra_args=["--tiers", f"kind=fs,root={self.root},bytes={64 * GIB}", "--flush-on-stop-seconds", "0"]
        )
        self.daemon.start()
        # The region holds SLOTS chunks (the stream cycles through them, as vLLM's primary tier is
        # reused) plus a scratch area for verify(): small, so the daemon's background populate of
        # each client's mapping is over before the timed stream starts.
        self.slots = min(WB_REGION_SLOTS, len(src.views))
        self.region_file = ShmFile((self.slots + WB_VERIFY_CHUNKS) * self.size, prefix="kvstored-bench-wb")
        self.region_file.array[: self.slots * self.size] = src.array[: self.slots * self.size]
        self.clients = [
            Client(str(self.daemon.socket), deadline_s=120.0, client_name=f"bench-wb-{k}") for k in range(self.streams)
        ]
        spec = NamespaceSpec(model="bench/writeback", dtype="uint8", chunk_bytes=self.size)
        self.ns = [c.register_namespace(spec) for c in self.clients]
        self.regions = [c.register_region(self.region_file.path) for c in self.clients]
        if not args.fresh_root:  # an fs root in use, like the fs tier alone's
            tier_dirs(self.root, [(self.ns[0].namespace_id, k) for k in self.keys])
        self.dropped = 0
        self._store(0, self.prefill)

    def _store(self, first: int, end: int) -> None:
        batches = [(b, min(b + self.batch, end)) for b in range(first, end, self.batch)]
        counter = itertools.count()
        errors: list[str] = []

        def stream(k: int) -> None:
            client, ns, region = self.clients[k], self.ns[k], self.regions[k]
            while (j := next(counter)) < len(batches):
                b0, b1 = batches[j]
                r = client.store_from_region(
                    ns, region, self.keys[b0:b1], [(i % self.slots) * self.size for i in range(b0, b1)]
                )
                if r.stored != b1 - b0:
                    errors.append(f"batch {b0}: {r}")

        threads = [threading.Thread(target=stream, args=(k,)) for k in range(self.streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"write-back stream: {len(errors)} store(s) incomplete, first: {errors[0]}")

    def run(self) -> float:
        t0 = time.perf_counter()
        self._store(self.prefill, self.prefill + self.n)
        wall = time.perf_counter() - t0
        ram = {t.name: t for t in self.clients[0].stats().tiers}["ram"]
        self.dropped = ram.dropped_dirty
        return wall

    def verify(self) -> None:
        """The first chunks of the timed stream (on the disk by now) load back byte-exact."""
        k = min(WB_VERIFY_CHUNKS, self.n)
        first = self.prefill
        scratch = self.slots * self.size
        got = self.clients[0].load_to_region(
            self.ns[0], self.regions[0], self.keys[first : first + k], [scratch + i * self.size for i in range(k)]
        )
        if got != k:
            raise RuntimeError(f"write-back: loaded {got} of the stream's first {k} chunks back")
        for i in range(k):
            c = (first + i) % self.slots
            if not np.array_equal(
                self.region_file.array[scratch + i * self.size : scratch + (i + 1) * self.size],
                self._src.array[c * self.size : (c + 1) * self.size],
            ):
                raise RuntimeError(f"write-back: chunk {first + i} came back with other bytes")

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.region_file.close()
        self.daemon.stop()
        shutil.rmtree(self.root, ignore_errors=True)
