# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fs tier beside raw O_DIRECT pwritev/preadv of the same bytes."""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.lib.limits import drop_page_cache
from bench.lib.report import GIB
from bench.tiers.common import (
    TARGET_FS,
    TARGET_WRITEBACK,
    Pair,
    Pool,
    chunk_ids,
    header_pages,
    measure,
    on_loop,
    rotated,
    run_threads,
    say,
    tier_dirs,
    tier_load,
    tier_store,
)
from bench.tiers.writeback import WriteBackStream
from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES


class RawFs:
    """Raw O_DIRECT chunk files with the same bytes as the tier's: header page + payload.
    flat: one directory; else at the tier's relative paths (creating missing directories, as
    the tier does, when `make_dirs`)."""

    def __init__(self, root: Path, chunks: Sequence[tuple[str, bytes]], headers: list[memoryview], flat: bool) -> None:
        self.root = root
        self.headers = headers
        self.flat = flat
        self.paths = [
            os.path.join(root, f"{i:06d}.raw" if flat else chunkfile.chunk_relpath(c)) for i, c in enumerate(chunks)
        ]
        self._local = threading.local()
        root.mkdir(parents=True)

    def make_dirs(self) -> None:
        for d in sorted({os.path.dirname(p) for p in self.paths}):
            os.makedirs(d, exist_ok=True)

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
        header = getattr(self._local, "header", None)
        if header is None:
            header = self._local.header = memoryview(mmap.mmap(-1, HEADER_BYTES))
        fd = os.open(self.paths[i], os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        try:
            if os.preadv(fd, [header, view], 0) != HEADER_BYTES + len(view):
                raise RuntimeError("short O_DIRECT read")
        finally:
            os.close(fd)


def bench_fs(
    runner: asyncio.Runner, args, src: Pool, dst: Pool, workdir: Path, notes: list[str]
) -> tuple[list[Pair], dict]:
    from kvstored.tiers.fs.tier import FsTier

    n, size = args.fs_chunks, args.chunk_bytes
    nbytes = n * size
    chunks = chunk_ids(n, "fs")
    headers = header_pages(chunks, src.views[:n], size)
    threads, inflight = args.fs_threads, args.fs_inflight
    # (store pair, load pair, baseline: flat?, threads); the first is the targeted one
    baselines = [
        (Pair("fs store", TARGET_FS), Pair("fs load (cold)", TARGET_FS), True, threads),
        (Pair("fs store [raw at tier paths]", None), Pair("fs load [raw at tier paths]", None), False, threads),
    ]
    if inflight != threads:  # as many I/Os at the disk as the tier has operations in flight
        baselines.append(
            (
                Pair(f"fs store [raw, {inflight} threads]", None),
                Pair(f"fs load [raw, {inflight} threads]", None),
                True,
                inflight,
            )
        )
    writeback = (
        Pair(f"write-back stream into a daemon ({args.wb_ram_mib} MiB RAM) [vs fs tier alone]", TARGET_WRITEBACK)
        if args.writeback == "on"
        else None
    )
    wb_dropped = 0
    dropped = True
    direct = True
    for rnd in range(args.rounds):
        tier_root = workdir / f"fs-tier-{rnd}"
        raws = [
            RawFs(workdir / f"fs-raw{k}-{rnd}", chunks, headers, flat=flat)
            for k, (_, _, flat, _) in enumerate(baselines)
        ]
        if not args.fresh_root:
            tier_dirs(tier_root, chunks)
            for raw in raws:
                if not raw.flat:
                    raw.make_dirs()
        tier = FsTier("bench", tier_root, 64 * GIB, io_threads=threads)
        runner.run(tier.start())
        direct = direct and tier.direct_io
        try:

            def drop() -> None:
                nonlocal dropped
                dropped &= drop_page_cache(args.drop)

            def raw_store(raw: RawFs, k: int) -> Callable[[], float]:
                return lambda: run_threads(n, k, lambda i: raw.write(i, src.views[i]))

            def raw_load(raw: RawFs, k: int) -> Callable[[], float]:
                return lambda: run_threads(n, k, lambda i: raw.read(i, dst.views[i]))

            stores = [(baselines[0][0].tier, on_loop(runner, tier_store, tier, chunks, src.views, size, inflight))]
            loads = [(baselines[0][1].tier, on_loop(runner, tier_load, tier, chunks, dst.views, size, inflight))]
            for (st, ld, _, k), raw in zip(baselines, raws):
                stores.append((st.raw, raw_store(raw, k)))
                loads.append((ld.raw, raw_load(raw, k)))
            wb = WriteBackStream(args, src, workdir, rnd) if writeback is not None else None
            if wb is not None and writeback is not None:
                stores.append((writeback.tier, wb.run))
            try:
                for samples, fn in rotated(stores, rnd):
                    samples.append(measure(nbytes, fn, prepare=os.sync))
                if wb is not None and writeback is not None:
                    wb_dropped += wb.dropped
                    writeback.raw.append(baselines[0][0].tier[-1])  # the fs tier alone, this round
                    writeback.limit.append(baselines[0][0].raw[-1])
                    if rnd == 0:
                        wb.verify()
            finally:
                if wb is not None:
                    wb.close()
            if rnd == 0:
                dst.array[:nbytes] = 0
            for samples, fn in rotated(loads, rnd):
                samples.append(measure(nbytes, fn, prepare=drop))
                if rnd == 0 and samples is baselines[0][1].tier:
                    if not np.array_equal(dst.array[:nbytes], src.array[:nbytes]):
                        raise RuntimeError("fs tier loaded bytes differ from the source")
            for st, ld, _, _ in baselines[1:]:  # the diagnostic rows share the tier's samples
                st.tier.append(baselines[0][0].tier[-1])
                ld.tier.append(baselines[0][1].tier[-1])
            labels = ["raw", "raw-tier-paths", f"raw-{inflight}-threads"]
            if writeback is not None:
                say(
                    f"  fs round {rnd}: write-back stream into the daemon {writeback.tier[-1].gib_s:.2f} GiB/s "
                    f"(fs tier alone {writeback.raw[-1].gib_s:.2f}, raw O_DIRECT {writeback.limit[-1].gib_s:.2f})"
                )
            say(
                f"  fs round {rnd}: store tier {baselines[0][0].tier[-1].gib_s:.2f} "
                + " ".join(f"{label} {b[0].raw[-1].gib_s:.2f}" for label, b in zip(labels, baselines))
                + f" | load tier {baselines[0][1].tier[-1].gib_s:.2f} "
                + " ".join(f"{label} {b[1].raw[-1].gib_s:.2f}" for label, b in zip(labels, baselines))
                + " GiB/s"
            )
        finally:
            runner.run(tier.close())
            for d in [tier_root] + [raw.root for raw in raws]:
                shutil.rmtree(d, ignore_errors=True)
    if not dropped:
        notes.append(
            "fs: could not drop the caches (not root?); loads are still cold for the data because "
            "the tier and the baselines read with O_DIRECT"
        )
    if not direct:
        notes.append(
            f"fs: the tier fell back to BUFFERED I/O under {workdir} (O_DIRECT refused): the "
            "comparison with raw O_DIRECT is not meaningful"
        )
    if wb_dropped:
        notes.append(
            f"write-back: the daemon's RAM dropped {wb_dropped} chunk(s) with no copy below (write-downs "
            "fell behind the stream): those stores were not kept"
        )
    if writeback is not None:
        notes.append(
            f"write-back stream: {args.wb_streams} clients storing from a registered region in RPCs of "
            f"{args.wb_batch} chunks, {n} chunks timed after RAM was filled with chunks that have no copy "
            "below (each stored chunk pushes one down); baseline = the fs tier alone storing the same "
            "chunks this round; limit = raw O_DIRECT this round"
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
    pairs = [p for b in baselines for p in b[:2]]
    for p in pairs:  # every fs row is bounded by raw O_DIRECT at the tier's depth
        if not p.limit:
            p.limit = list(baselines[0][0].raw if "store" in p.name else baselines[0][1].raw)
    return pairs + ([writeback] if writeback is not None else []), info
