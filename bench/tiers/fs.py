# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fs tier beside raw O_DIRECT pwritev/preadv of the same bytes, and the write-back stream row:
a daemon with little RAM and an fs tier, beside the fs tier alone."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

from bench.lib.buffers import ShmFile
from bench.lib.daemons import Daemon
from bench.lib.limits import drop_page_cache
from bench.lib.report import GIB, MIB
from bench.tiers.common import (
    Pair,
    Pool,
    chunk_ids,
    header_pages,
    measure,
    on_loop,
    rotated,
    say,
    tier_load,
    tier_store,
)
from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored_client import Client, NamespaceSpec

TARGET_FS = 0.90
TARGET_WRITEBACK = 0.90  # write-back stream through a daemon vs the fs tier alone (issue 13 part 1)
WB_REGION_SLOTS = 64  # chunks in the write-back clients' region (the stream cycles through them)
WB_VERIFY_CHUNKS = 32


def tier_dirs(root: Path, chunks: Sequence[tuple[str, bytes]]) -> None:
    """The fan-out directories a tier root in use already has for these chunks."""
    for d in sorted({os.path.dirname(os.path.join(root, chunkfile.chunk_relpath(c))) for c in chunks}):
        os.makedirs(d, exist_ok=True)


def run_threads(n: int, threads: int, op: Callable[[int], None]) -> float:
    """Run op(0..n-1) on `threads` plain threads pulling chunk numbers back to back; wall seconds
    from their common start (after the threads are created) to the last one's end."""
    counter = itertools.count()  # next() is atomic under the GIL
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)

    def worker() -> None:
        start.wait()
        try:
            while (i := next(counter)) < n:
                op(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


class RawFs:
    """Raw O_DIRECT chunk files with the same bytes as the tier's (header page + payload): in one
    flat directory, or at the tier's relative paths (creating missing directories as the tier does)."""

    def __init__(self, root: Path, chunks: Sequence[tuple[str, bytes]], headers: list[memoryview], flat: bool) -> None:
        self.root, self.headers, self.flat = root, headers, flat
        self.paths = [
            os.path.join(root, f"{i:06d}.raw" if flat else chunkfile.chunk_relpath(c)) for i, c in enumerate(chunks)
        ]
        self._local = threading.local()
        root.mkdir(parents=True)

    def write(self, i: int, view: memoryview) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT
        try:
            fd = os.open(self.paths[i], flags, 0o644)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(self.paths[i]), exist_ok=True)
            fd = os.open(self.paths[i], flags, 0o644)
        try:
            if os.pwritev(fd, [self.headers[i], view], 0) != HEADER_BYTES + len(view):
                raise RuntimeError("short O_DIRECT write")
        finally:
            os.close(fd)

    def read(self, i: int, view: memoryview) -> None:
        if getattr(self._local, "header", None) is None:
            self._local.header = memoryview(mmap.mmap(-1, HEADER_BYTES))
        fd = os.open(self.paths[i], os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        try:
            if os.preadv(fd, [self._local.header, view], 0) != HEADER_BYTES + len(view):
                raise RuntimeError("short O_DIRECT read")
        finally:
            os.close(fd)

    def store(self, views: Sequence[memoryview], threads: int) -> float:
        return run_threads(len(self.paths), threads, lambda i: self.write(i, views[i]))

    def load(self, views: Sequence[memoryview], threads: int) -> float:
        return run_threads(len(self.paths), threads, lambda i: self.read(i, views[i]))


def bench_fs(
    runner: asyncio.Runner, args, src: Pool, dst: Pool, workdir: Path, notes: list[str]
) -> tuple[list[Pair], dict]:
    from kvstored.tiers.fs.tier import FsTier

    n, size = args.fs_chunks, args.chunk_bytes
    nbytes = n * size
    chunks = chunk_ids(n, "fs")
    headers = header_pages(chunks, src.views[:n], size)
    threads, inflight = args.fs_threads, args.fs_inflight
    store, load = Pair("fs store", TARGET_FS), Pair("fs load (cold)", TARGET_FS)

    def arm(tag: str, flat: bool, k: int) -> tuple[Pair, Pair, bool, int]:
        """A diagnostic baseline: raw files (`flat` or at the tier's paths), k threads, beside the tier's samples
        (and bounded, as every fs row, by raw O_DIRECT at the tier's depth)."""
        diag_store = Pair(f"fs store{tag}", None, tier=store.tier, limit=store.raw)
        return diag_store, Pair(f"fs load{tag}", None, tier=load.tier, limit=load.raw), flat, k

    arms = [(store, load, True, threads), arm(" [raw at tier paths]", False, threads)]  # targeted first
    if inflight != threads:  # as many I/Os at the disk as the tier has operations in flight
        arms.append(arm(f" [raw, {inflight} threads]", True, inflight))
    wb_name = f"write-back stream into a daemon ({args.wb_ram_mib} MiB RAM) [vs fs tier alone]"
    # beside the fs tier alone (its samples), bounded by raw O_DIRECT
    writeback = Pair(wb_name, TARGET_WRITEBACK, raw=store.tier, limit=store.raw) if args.writeback == "on" else None
    wb_dropped, dropped, direct = 0, True, True
    for rnd in range(args.rounds):
        tier_root = workdir / f"fs-tier-{rnd}"
        raws = [RawFs(workdir / f"fs-raw{k}-{rnd}", chunks, headers, a[2]) for k, a in enumerate(arms)]
        if not args.fresh_root:
            for root in [tier_root] + [raw.root for raw in raws if not raw.flat]:
                tier_dirs(root, chunks)
        tier = FsTier("bench", tier_root, 64 * GIB, io_threads=threads)
        runner.run(tier.start())
        direct = direct and tier.direct_io
        try:
            stores = [(store.tier, on_loop(runner, tier_store, tier, chunks, src.views, size, inflight))]
            loads = [(load.tier, on_loop(runner, tier_load, tier, chunks, dst.views, size, inflight))]
            for (st, ld, _, k), raw in zip(arms, raws):
                stores.append((st.raw, partial(raw.store, src.views, k)))
                loads.append((ld.raw, partial(raw.load, dst.views, k)))
            with contextlib.ExitStack() as cleanup:
                if writeback is not None:
                    wb = WriteBackStream(args, src, workdir, rnd)
                    cleanup.callback(wb.close)
                    stores.append((writeback.tier, wb.run))
                for samples, fn in rotated(stores, rnd):
                    samples.append(measure(nbytes, fn, prepare=os.sync))
                if writeback is not None:
                    wb_dropped += wb.dropped
                    if rnd == 0:
                        wb.verify()
            if rnd == 0:
                dst.array[:nbytes] = 0

            def drop() -> None:
                nonlocal dropped
                dropped &= drop_page_cache(args.drop)

            for samples, fn in rotated(loads, rnd):
                samples.append(measure(nbytes, fn, prepare=drop))
                if rnd == 0 and samples is load.tier and not np.array_equal(dst.array[:nbytes], src.array[:nbytes]):
                    raise RuntimeError("fs tier loaded bytes differ from the source")
            if writeback is not None:
                say(
                    f"  fs round {rnd}: write-back stream into the daemon {writeback.tier[-1].gib_s:.2f} GiB/s "
                    f"(fs tier alone {writeback.raw[-1].gib_s:.2f}, raw O_DIRECT {writeback.limit[-1].gib_s:.2f})"
                )
            say(
                f"  fs round {rnd}: store tier {store.tier[-1].gib_s:.2f} {_raws([a[0] for a in arms], inflight)} | "
                f"load tier {load.tier[-1].gib_s:.2f} {_raws([a[1] for a in arms], inflight)} GiB/s"
            )
        finally:
            runner.run(tier.close())
            for d in [tier_root] + [raw.root for raw in raws]:
                shutil.rmtree(d, ignore_errors=True)
    if not dropped:
        notes.append("fs: could not drop the caches (not root?); O_DIRECT loads are still cold for the data")
    if not direct:
        notes.append(f"fs: the tier fell back to BUFFERED I/O under {workdir} (O_DIRECT refused): ratios meaningless")
    if wb_dropped:
        notes.append(f"write-back: the daemon's RAM dropped {wb_dropped} chunk(s) with no copy below: stores lost")
    if writeback is not None:
        notes.append(
            f"write-back stream: {args.wb_streams} clients, RPCs of {args.wb_batch} chunks, {n} chunks timed with "
            "RAM full (docs/benchmarks.md#tiers)"
        )
    info = {
        "chunks": n,
        "chunk_bytes": size,
        "threads": threads,
        "inflight": inflight,
        "direct_io": direct,
        "drop_caches": args.drop if dropped else None,
        "fresh_root": args.fresh_root,
        "dir": str(workdir),
    }
    pairs = [p for a in arms for p in a[:2]]
    return pairs + ([writeback] if writeback is not None else []), info


def _raws(pairs: list[Pair], inflight: int) -> str:
    labels = ["raw", "raw-tier-paths", f"raw-{inflight}-threads"]
    return " ".join(f"{label} {p.raw[-1].gib_s:.2f}" for label, p in zip(labels, pairs))


class WriteBackStream:
    """A daemon whose RAM (--wb-ram-mib) is a fraction of the stream, with an fs tier (write-back,
    default settings), fed by `streams` clients storing from one registered region in RPCs of
    `batch` chunks (as the vLLM tier sends). RAM is first filled (untimed) with chunks that have no
    copy below, so every chunk of the timed stream pushes an older one down to the disk."""

    def __init__(self, args, src: Pool, workdir: Path, rnd: int) -> None:
        self.n, self.size, self._src = args.fs_chunks, args.chunk_bytes, src
        self.batch, self.streams = args.wb_batch, args.wb_streams
        ram = args.wb_ram_mib * MIB
        self.prefill = ram // self.size
        self.root = workdir / f"wb-{rnd}"
        self.keys = [key for _, key in chunk_ids(self.prefill + self.n, f"wb:{rnd}")]
        tiers = ["--tiers", f"kind=fs,root={self.root},bytes={64 * GIB}", "--flush-on-stop-seconds", "0"]
        self.daemon = Daemon(ram, extra_args=tiers)
        self.daemon.start()
        # The region: SLOTS chunks the stream cycles through (as vLLM's primary tier is reused) plus
        # verify()'s scratch; small, so the daemon's populate of each mapping ends before the stream.
        self.slots = min(WB_REGION_SLOTS, len(src.views))
        self.region_file = ShmFile((self.slots + WB_VERIFY_CHUNKS) * self.size, prefix="kvstored-bench-wb")
        self.region_file.array[: self.slots * self.size] = src.array[: self.slots * self.size]
        socket = str(self.daemon.socket)
        self.clients = [Client(socket, deadline_s=120.0, client_name=f"bench-wb-{k}") for k in range(self.streams)]
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
            while (j := next(counter)) < len(batches):
                b0, b1 = batches[j]
                offsets = [(i % self.slots) * self.size for i in range(b0, b1)]
                r = self.clients[k].store_from_region(self.ns[k], self.regions[k], self.keys[b0:b1], offsets)
                if r.stored != b1 - b0:
                    errors.append(f"batch {b0}: {r}")

        with ThreadPoolExecutor(self.streams) as pool:  # a thread per client
            list(pool.map(stream, range(self.streams)))
        if errors:
            raise RuntimeError(f"write-back stream: {len(errors)} store(s) incomplete, first: {errors[0]}")

    def run(self) -> float:
        t0 = time.perf_counter()
        self._store(self.prefill, self.prefill + self.n)
        wall = time.perf_counter() - t0
        self.dropped = {t.name: t for t in self.clients[0].stats().tiers}["ram"].dropped_dirty
        return wall

    def verify(self) -> None:
        """The first chunks of the timed stream (on the disk by now) load back byte-exact."""
        k, first, size = min(WB_VERIFY_CHUNKS, self.n), self.prefill, self.size
        scratch = self.slots * size
        offsets = [scratch + i * size for i in range(k)]
        got = self.clients[0].load_to_region(self.ns[0], self.regions[0], self.keys[first : first + k], offsets)
        if got != k:
            raise RuntimeError(f"write-back: loaded {got} of the stream's first {k} chunks back")
        for i in range(k):
            c = (first + i) % self.slots
            back = self.region_file.array[scratch + i * size : scratch + (i + 1) * size]
            if not np.array_equal(back, self._src.array[c * size : (c + 1) * size]):
                raise RuntimeError(f"write-back: chunk {first + i} came back with other bytes")

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.region_file.close()
        self.daemon.stop()
        shutil.rmtree(self.root, ignore_errors=True)
