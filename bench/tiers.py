"""Benchmark of kvstored's secondary tiers against the raw I/O beneath them (not a test): the fs
tier beside raw O_DIRECT pwritev/preadv of the same bytes (cold reads: page cache dropped), and
the S3 tier beside raw aiobotocore put/get of the same objects (radosgw or moto), in one run.

Method, baselines, targets and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from bench.lib.buffers import ShmFile, aligned_pool, fill_pattern, populate
from bench.lib.daemons import Daemon, stat_cpu_seconds
from bench.lib.limits import drop_page_cache
from bench.lib.report import GIB, MIB, load_average, machine_info, print_aligned, write_json
from bench.lib.s3 import raw_config, start_s3
from kvstored.tiers import chunkfile
from kvstored.tiers.base import WriteOutcome
from kvstored.tiers.chunkfile import HEADER_BYTES

TARGET_FS = 0.90
TARGET_S3 = 0.85
TARGET_WRITEBACK = 0.90  # write-back stream through a daemon vs the fs tier alone (issue 13 part 1)
WB_REGION_SLOTS = 64  # chunks in the write-back clients' region (the stream cycles through them)
WB_VERIFY_CHUNKS = 32
NAMESPACE = "bench"
PAGE = mmap.PAGESIZE


# -- buffers and chunks ---------------------------------------------------------------------------


class Pool:
    """A populated anonymous mapping (page-aligned, like the daemon's pool) cut into chunk views."""

    def __init__(self, chunks: int, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._map = aligned_pool(chunks * chunk_bytes)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        whole = memoryview(self._map)
        self.views = [whole[i * chunk_bytes:(i + 1) * chunk_bytes] for i in range(chunks)]


def chunk_ids(n: int, seed: str) -> list[tuple[str, bytes]]:
    """Content-hash-like keys (32 bytes, spread uniformly over the fs tier's fan-out directories)."""
    return [(NAMESPACE, hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=32).digest()) for i in range(n)]


def header_pages(chunks: Sequence[tuple[str, bytes]], views: Sequence[memoryview], size: int) -> list[memoryview]:
    """Each chunk's chunkfile header in its own page-aligned page (what the raw baselines write)."""
    out = []
    for chunk, view in zip(chunks, views):
        page = mmap.mmap(-1, HEADER_BYTES)
        page[:] = chunkfile.encode_header(chunk, size, chunkfile.checksum([view], size))
        out.append(memoryview(page))
    return out


# -- host helpers ---------------------------------------------------------------------------------


def gib_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GIB


async def drive(n: int, inflight: int, op: Callable[[int], Awaitable[None]]) -> float:
    """Run op(0..n-1) with `inflight` worker tasks (the daemon's queue concurrency); wall seconds."""
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            await op(i)

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(min(inflight, n)):
            group.create_task(worker())
    return time.perf_counter() - t0


def run_threads(n: int, threads: int, op: Callable[[int], None]) -> float:
    """Run op(0..n-1) on `threads` plain threads pulling chunk numbers back to back; wall seconds."""
    counter = itertools.count()  # next() is atomic under the GIL
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)

    def worker() -> None:
        start.wait()
        try:
            while (i := next(counter)) < n:
                op(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
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


@dataclass
class Sample:
    gib_s: float
    cpu_s_per_gib: float  # this process, all threads
    server_cpu_s_per_gib: float | None = None  # the S3 server's processes


def measure(nbytes: int, run: Callable[[], float], server_pids: Sequence[int] = (),
            prepare: Callable[[], object] | None = None) -> Sample:
    """Run `prepare` (untimed), then `run` (which returns its wall seconds), counting CPU seconds."""
    if prepare is not None:
        prepare()
    cpu0 = time.process_time()
    srv0 = stat_cpu_seconds(server_pids)
    wall = run()
    cpu = time.process_time() - cpu0
    srv = stat_cpu_seconds(server_pids) - srv0 if server_pids else None
    gib = nbytes / GIB
    return Sample(nbytes / wall / GIB, cpu / gib, None if srv is None else srv / gib)


def rotated(arms: list, rnd: int) -> list:
    k = rnd % len(arms)
    return arms[k:] + arms[:k]


# -- results --------------------------------------------------------------------------------------


@dataclass
class Pair:
    """One measurement: the tier and its baseline, one Sample per round each."""

    name: str
    target: float | None  # None: diagnostic row
    tier: list[Sample] = field(default_factory=list)
    raw: list[Sample] = field(default_factory=list)
    limit: list[Sample] = field(default_factory=list)  # the physical limit (default: raw)

    @property
    def limit_median(self) -> float:
        return statistics.median(s.gib_s for s in (self.limit or self.raw))

    @property
    def tier_median(self) -> float:
        return statistics.median(s.gib_s for s in self.tier)

    @property
    def raw_median(self) -> float:
        return statistics.median(s.gib_s for s in self.raw)

    @property
    def ratio(self) -> float:
        return self.tier_median / self.raw_median

    @property
    def paired(self) -> list[float]:
        return [t.gib_s / r.gib_s for t, r in zip(self.tier, self.raw)]

    @property
    def status(self) -> str:
        if self.target is None:
            return "(info)"
        return "PASS" if self.ratio >= self.target else "MISS"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "tier_gib_s": self.tier_median,
                "raw_gib_s": self.raw_median, "limit_gib_s": self.limit_median, "ratio": self.ratio,
                "target": self.target, "status": self.status,
                "tier_samples": [vars(s) for s in self.tier], "raw_samples": [vars(s) for s in self.raw],
                "paired_ratios": self.paired}


def print_pairs(pairs: Sequence[Pair], file=None) -> None:
    file = file or sys.stdout
    header = ["measurement", "tier GiB/s", "baseline GiB/s", "ratio", "target", "result", "limit GiB/s",
              "of limit"]
    rows = [header] + [[p.name, f"{p.tier_median:.2f}", f"{p.raw_median:.2f}", f"{p.ratio:.2f}x",
                        f">= {p.target:.2f}x" if p.target is not None else "-", p.status,
                        f"{p.limit_median:.2f}", f"{p.tier_median / p.limit_median:.2f}x"] for p in pairs]
    print_aligned(rows, right={1, 2, 3, 6, 7}, file=file)
    print("baseline: raw O_DIRECT / raw aiobotocore of the same bytes (the write-back row: the fs tier alone); "
          "limit: the physical limit of the row on this machine (fs: raw O_DIRECT at the tier's queue depth; "
          "S3: the raw client's transport)", file=file)
    print("per round: tier/raw GiB/s = paired ratio; CPU s per GiB (this process, tier/raw"
          "[; S3 server tier/raw]):", file=file)
    for p in pairs:
        rounds = ", ".join(f"{t.gib_s:.2f}/{r.gib_s:.2f}={t.gib_s / r.gib_s:.2f}" for t, r in zip(p.tier, p.raw))
        cpu = (f"cpu {statistics.median(s.cpu_s_per_gib for s in p.tier):.2f}/"
               f"{statistics.median(s.cpu_s_per_gib for s in p.raw):.2f}")
        if p.tier and p.tier[0].server_cpu_s_per_gib is not None:
            cpu += (f"; server {statistics.median(s.server_cpu_s_per_gib for s in p.tier):.2f}/"
                    f"{statistics.median(s.server_cpu_s_per_gib for s in p.raw):.2f}")
        print(f"  {p.name}: {rounds}  ({cpu})", file=file)


def describe(exc: BaseException) -> str:
    """An exception in one line (the first of a TaskGroup's)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


def say(*parts: Any) -> None:
    print(*parts, flush=True)


# -- fs -------------------------------------------------------------------------------------------


class RawFs:
    """Raw O_DIRECT chunk files with the same bytes as the tier's: header page + payload.
    flat: one directory; else at the tier's relative paths (creating missing directories, as
    the tier does, when `make_dirs`)."""

    def __init__(self, root: Path, chunks: Sequence[tuple[str, bytes]], headers: list[memoryview],
                 flat: bool) -> None:
        self.root = root
        self.headers = headers
        self.flat = flat
        self.paths = [os.path.join(root, f"{i:06d}.raw" if flat else chunkfile.chunk_relpath(c))
                      for i, c in enumerate(chunks)]
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


def tier_dirs(root: Path, chunks: Sequence[tuple[str, bytes]]) -> None:
    """The fan-out directories a tier root in use already has for these chunks."""
    for d in sorted({os.path.dirname(os.path.join(root, chunkfile.chunk_relpath(c))) for c in chunks}):
        os.makedirs(d, exist_ok=True)


async def tier_store(tier, chunks, views, size: int, inflight: int) -> float:
    async def op(i: int) -> None:
        outcome = await tier.write(chunks[i], [views[i]], size)
        if outcome is not WriteOutcome.WRITTEN:
            raise RuntimeError(f"{tier.kind.name} tier write {i}: {outcome} (counters {tier.counters})")

    return await drive(len(chunks), inflight, op)


async def tier_load(tier, chunks, views, size: int, inflight: int) -> float:
    async def op(i: int) -> None:
        if not await tier.read(chunks[i], [views[i]], size):
            raise RuntimeError(f"{tier.kind.name} tier read {i}: miss or corrupt (counters {tier.counters})")

    return await drive(len(chunks), inflight, op)


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
        self.keys = [hashlib.blake2b(f"wb:{rnd}:{i}".encode(), digest_size=32).digest()
                     for i in range(self.prefill + self.n)]
        self.daemon = Daemon(ram, extra_args=["--tiers", f"kind=fs,root={self.root},bytes={64 * GIB}",
                                              "--flush-on-stop-seconds", "0"])
        self.daemon.start()
        # The region holds SLOTS chunks (the stream cycles through them, as vLLM's primary tier is
        # reused) plus a scratch area for verify(): small, so the daemon's background populate of
        # each client's mapping is over before the timed stream starts.
        self.slots = min(WB_REGION_SLOTS, len(src.views))
        self.region_file = ShmFile((self.slots + WB_VERIFY_CHUNKS) * self.size, prefix="kvstored-bench-wb")
        self.region_file.array[:self.slots * self.size] = src.array[:self.slots * self.size]
        self.clients = [Client(str(self.daemon.socket), deadline_s=120.0, client_name=f"bench-wb-{k}")
                        for k in range(self.streams)]
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
                r = client.store_from_region(ns, region, self.keys[b0:b1],
                                             [(i % self.slots) * self.size for i in range(b0, b1)])
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
        got = self.clients[0].load_to_region(self.ns[0], self.regions[0], self.keys[first:first + k],
                                             [scratch + i * self.size for i in range(k)])
        if got != k:
            raise RuntimeError(f"write-back: loaded {got} of the stream's first {k} chunks back")
        for i in range(k):
            c = (first + i) % self.slots
            if not np.array_equal(self.region_file.array[scratch + i * self.size:scratch + (i + 1) * self.size],
                                  self._src.array[c * self.size:(c + 1) * self.size]):
                raise RuntimeError(f"write-back: chunk {first + i} came back with other bytes")

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.region_file.close()
        self.daemon.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def bench_fs(runner: asyncio.Runner, args, src: Pool, dst: Pool, workdir: Path,
             notes: list[str]) -> tuple[list[Pair], dict]:
    from kvstored.tiers.fs import FsTier

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
        baselines.append((Pair(f"fs store [raw, {inflight} threads]", None),
                          Pair(f"fs load [raw, {inflight} threads]", None), True, inflight))
    writeback = Pair(f"write-back stream into a daemon ({args.wb_ram_mib} MiB RAM) [vs fs tier alone]",
                     TARGET_WRITEBACK) if args.writeback == "on" else None
    wb_dropped = 0
    dropped = True
    direct = True
    for rnd in range(args.rounds):
        tier_root = workdir / f"fs-tier-{rnd}"
        raws = [RawFs(workdir / f"fs-raw{k}-{rnd}", chunks, headers, flat=flat)
                for k, (_, _, flat, _) in enumerate(baselines)]
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

            stores = [(baselines[0][0].tier,
                       lambda: runner.run(tier_store(tier, chunks, src.views, size, inflight)))]
            loads = [(baselines[0][1].tier, lambda: runner.run(tier_load(tier, chunks, dst.views, size, inflight)))]
            for (st, ld, _, k), raw in zip(baselines, raws):
                stores.append((st.raw, raw_store(raw, k)))
                loads.append((ld.raw, raw_load(raw, k)))
            wb = WriteBackStream(args, src, workdir, rnd) if writeback is not None else None
            if wb is not None:
                stores.append((writeback.tier, wb.run))
            try:
                for samples, fn in rotated(stores, rnd):
                    samples.append(measure(nbytes, fn, prepare=os.sync))
                if wb is not None:
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
                say(f"  fs round {rnd}: write-back stream into the daemon {writeback.tier[-1].gib_s:.2f} GiB/s "
                    f"(fs tier alone {writeback.raw[-1].gib_s:.2f}, raw O_DIRECT {writeback.limit[-1].gib_s:.2f})")
            say(f"  fs round {rnd}: store tier {baselines[0][0].tier[-1].gib_s:.2f} " +
                " ".join(f"{label} {b[0].raw[-1].gib_s:.2f}" for label, b in zip(labels, baselines)) +
                f" | load tier {baselines[0][1].tier[-1].gib_s:.2f} " +
                " ".join(f"{label} {b[1].raw[-1].gib_s:.2f}" for label, b in zip(labels, baselines)) + " GiB/s")
        finally:
            runner.run(tier.close())
            for d in [tier_root] + [raw.root for raw in raws]:
                shutil.rmtree(d, ignore_errors=True)
    if not dropped:
        notes.append("fs: could not drop the caches (not root?); loads are still cold for the data because "
                     "the tier and the baselines read with O_DIRECT")
    if not direct:
        notes.append(f"fs: the tier fell back to BUFFERED I/O under {workdir} (O_DIRECT refused): the "
                     "comparison with raw O_DIRECT is not meaningful")
    if wb_dropped:
        notes.append(f"write-back: the daemon's RAM dropped {wb_dropped} chunk(s) with no copy below (write-downs "
                     "fell behind the stream): those stores were not kept")
    if writeback is not None:
        notes.append(f"write-back stream: {args.wb_streams} clients storing from a registered region in RPCs of "
                     f"{args.wb_batch} chunks, {n} chunks timed after RAM was filled with chunks that have no copy "
                     "below (each stored chunk pushes one down); baseline = the fs tier alone storing the same "
                     "chunks this round; limit = raw O_DIRECT this round")
    info = {"chunks": n, "chunk_bytes": size, "threads": threads, "inflight": inflight,
            "direct_io": direct, "drop_caches": args.drop if dropped else None, "fresh_root": args.fresh_root,
            "dir": str(workdir)}
    pairs = [p for b in baselines for p in b[:2]]
    for p in pairs:  # every fs row is bounded by raw O_DIRECT at the tier's depth
        if not p.limit:
            p.limit = list(baselines[0][0].raw if "store" in p.name else baselines[0][1].raw)
    return pairs + ([writeback] if writeback is not None else []), info


# -- S3 -------------------------------------------------------------------------------------------


def tier_s3_config(tier) -> Any:
    """The started tier's client configuration (the baseline uses exactly the tier's transport
    settings: timeouts, pool size, checksum and payload-signing choices); None if unreadable."""
    client = getattr(tier, "_client", None)
    return getattr(getattr(client, "meta", None), "config", None)


@contextlib.asynccontextmanager
async def raw_client(endpoint, config):
    from aiobotocore.session import get_session

    async with get_session().create_client("s3", config=config, **endpoint.client_kwargs()) as client:
        yield client


async def raw_s3_store(client, bucket: str, keys: list[str], bodies: list[bytes], inflight: int) -> float:
    async def op(i: int) -> None:
        await client.put_object(Bucket=bucket, Key=keys[i], Body=bodies[i])

    return await drive(len(keys), inflight, op)


async def raw_s3_load(client, bucket: str, keys: list[str], expected: int, inflight: int) -> float:
    async def op(i: int) -> None:
        response = await client.get_object(Bucket=bucket, Key=keys[i])
        async with response["Body"] as stream:
            data = await stream.read()
        if len(data) != expected:
            raise RuntimeError(f"raw GET {keys[i]}: {len(data)} bytes, expected {expected}")

    return await drive(len(keys), inflight, op)


def bench_s3(runner: asyncio.Runner, args, src: Pool, dst: Pool, notes: list[str]) -> tuple[list[Pair], dict]:
    from kvstored.tiers.s3 import S3Tier

    n, size = args.s3_chunks, args.chunk_bytes
    nbytes = n * size
    inflight = args.s3_inflight
    server = start_s3(args.s3, args.memstore_bytes)
    say(f"  S3 endpoint: {'Ceph radosgw (memstore OSD)' if server.is_rgw else 'moto_server'} at "
        f"{server.endpoint.url}, up in {server.started_s:.1f} s")
    if server.note:
        notes.append(server.note)
    bucket = f"kvstored-bench-tiers-{os.getpid()}"
    chunks = chunk_ids(n, "s3")
    raw_keys = ["raw/" + chunkfile.chunk_relpath(c) for c in chunks]
    # the same object bytes the tier PUTs (header + payload), built before timing
    bodies = [b"".join([chunkfile.encode_header(c, size, chunkfile.checksum([v], size)), v])
              for c, v in zip(chunks, src.views)]
    store = Pair("s3 store", TARGET_S3)
    load = Pair("s3 load", TARGET_S3)
    stats: dict[str, Any] = {}
    profile: dict[str, Any] = {}
    try:
        ep = server.endpoint
        pids = server.pids()
        server.new_bucket(bucket)
        for rnd in range(args.rounds + (1 if args.profile else 0)):
            profiling = rnd == args.rounds  # the extra round of --profile: cProfile on the loop thread
            # both clients are opened before timing (creating one costs ~0.1-0.3 s of CPU)
            tier = S3Tier("bench", bucket, prefix="tier/", max_concurrency=inflight, timeout_s=args.s3_timeout,
                          create_bucket=False, **ep.tier_kwargs())
            stack = contextlib.AsyncExitStack()
            runner.run(tier.start())
            try:
                config = tier_s3_config(tier)
                if config is None:
                    config = raw_config(inflight, args.s3_timeout)
                    if rnd == 0:
                        notes.append("s3: could not read the tier's client configuration; the raw client uses "
                                     "bench/tiers.py's copy of it (may differ from kvstored/tiers/s3.py)")
                client = runner.run(stack.enter_async_context(raw_client(ep, config)))
                stores = [
                    ("tier store", store.tier, lambda: runner.run(tier_store(tier, chunks, src.views, size, inflight))),
                    ("raw store", store.raw,
                     lambda: runner.run(raw_s3_store(client, bucket, raw_keys, bodies, inflight))),
                ]
                loads = [
                    ("tier load", load.tier, lambda: runner.run(tier_load(tier, chunks, dst.views, size, inflight))),
                    ("raw load", load.raw, lambda: runner.run(
                        raw_s3_load(client, bucket, raw_keys, HEADER_BYTES + size, inflight))),
                ]
                if profiling:
                    for name, _, fn in stores + loads:
                        profile[name] = profiled(nbytes, fn)
                    continue
                for _, samples, fn in rotated(stores, rnd):
                    samples.append(measure(nbytes, fn, pids))
                if rnd == 0:
                    dst.array[:nbytes] = 0
                for _, samples, fn in rotated(loads, rnd):
                    samples.append(measure(nbytes, fn, pids))
                    if rnd == 0 and samples is load.tier:
                        if not np.array_equal(dst.array[:nbytes], src.array[:nbytes]):
                            raise RuntimeError("s3 tier loaded bytes differ from the source")
                say(f"  s3 round {rnd}: store tier {store.tier[-1].gib_s:.2f} raw {store.raw[-1].gib_s:.2f} | "
                    f"load tier {load.tier[-1].gib_s:.2f} raw {load.raw[-1].gib_s:.2f} GiB/s "
                    f"(tier: {tier.requests} requests, {tier.counters.errors} errors)")
                stats[f"round{rnd}"] = {"requests": tier.requests, "errors": tier.counters.errors,
                                        "skipped": tier.skipped}
            finally:
                runner.run(stack.aclose())
                runner.run(tier.close())
                server.empty_bucket(bucket, delete=False)
    finally:
        server.stop()
    # start() sends HEAD bucket + warm-up PUT + DELETE; then one PUT and one GET per chunk
    retried = sum(v["requests"] for v in stats.values()) - args.rounds * (3 + 2 * n)
    if retried > 0:
        notes.append(f"s3: the tier sent {retried} requests beyond one per operation (retries)")
    info = {"server": server.kind, "chunks": n, "chunk_bytes": size, "inflight": inflight,
            "timeout_s": args.s3_timeout, "tier_stats": stats, "profile": profile}
    return [store, load], info


# -- profile (--profile) --------------------------------------------------------------------------


def profiled(nbytes: int, run: Callable[[], float], top: int = 10) -> dict[str, Any]:
    """Run one phase under cProfile (the event loop's thread only; its overhead slows Python code,
    so the wall figure is not comparable with the timed rounds): the functions with the most own
    time, as a share of the phase's profiled time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    cpu0 = time.process_time()
    prof.enable()
    try:
        wall = run()
    finally:
        prof.disable()
    cpu = time.process_time() - cpu0
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values()) or 1.0  # own time over all functions
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {
        "gib_s_under_profiler": nbytes / wall / GIB,
        "cpu_s_per_gib": cpu / (nbytes / GIB),
        "top_own_time": [(_where(f, line, fn), v[2] / total, v[1]) for (f, line, fn), v in rows],
    }


def _where(path: str, line: int, fn: str) -> str:
    if path.endswith("runners.py") and fn == "run":
        return "asyncio Runner.run: the uvloop C loop and sockets (not profiled inside)"
    return f"{Path(path).name}:{line}({fn})"


def time_best(fn: Callable[[], object], repeat: int = 20) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def profile_cpu(size: int) -> dict[str, float]:
    """Single-thread CPU per chunk (microseconds) of what the tiers add to the raw I/O. The chunk
    is one of 64 cycled through (128 MiB: out of the CPU caches, as data fresh from DMA is)."""
    from kvstored.tiers.s3 import _Body, _check, _encode

    cold = Pool(64, size)
    fill_pattern(cold.array, size, seed=3)
    chunk = chunk_ids(1, "prof")[0]
    it = itertools.cycle(range(64))
    body = _encode(chunk, [cold.views[0]], size)
    out = np.empty(size, dtype=np.uint8)
    populate(out)
    payload = memoryview(body)[HEADER_BYTES:]
    target = memoryview(out)

    def copy_out() -> None:
        target[:] = payload

    return {
        "xxh3_64 checksum (chunkfile.checksum)":
            time_best(lambda: chunkfile.checksum([cold.views[next(it)]], size)) * 1e6,
        "encode_header (without the checksum)": time_best(lambda: chunkfile.encode_header(chunk, size, 0)) * 1e6,
        "decode_header": time_best(lambda: chunkfile.decode_header(body[:HEADER_BYTES])) * 1e6,
        "s3 _encode (checksum + header + b''.join copy)":
            time_best(lambda: _encode(chunk, [cold.views[next(it)]], size)) * 1e6,
        "s3 _check (decode + verify)": time_best(lambda: _check(_Body(len(body), body), chunk, size)) * 1e6,
        "s3 read copy-out (memoryview slice assign)": time_best(copy_out) * 1e6,
        "sha256 of a body (SigV4 payload signing, if on)": time_best(lambda: hashlib.sha256(body).digest(), 5) * 1e6,
    }


_PROFILED_OS = ("open", "close", "pwritev", "preadv", "replace", "stat", "fstat", "makedirs", "utime", "unlink")


def profile_fs(runner: asyncio.Runner, args, src: Pool, dst: Pool, workdir: Path) -> dict[str, Any]:
    """One instrumented store + load of each fs arm: per chunk, the time inside the tier's pool job
    or the raw op, split into syscalls and the checksum; and how busy the I/O threads were."""
    from kvstored.tiers.fs import FsTier

    n, size = args.fs_chunks, args.chunk_bytes
    chunks = chunk_ids(n, "fsprof")
    headers = header_pages(chunks, src.views[:n], size)
    flat = RawFs(workdir / "prof-raw", chunks, headers, flat=True)
    paths = RawFs(workdir / "prof-rawpaths", chunks, headers, flat=False)
    root = workdir / "prof-tier"
    if not args.fresh_root:
        tier_dirs(root, chunks)
        paths.make_dirs()
    phase = [""]
    samples: dict[tuple[str, str], list[float]] = {}

    def timed(name: str, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                samples.setdefault((phase[0], name), []).append(time.perf_counter() - t0)
        return wrapper

    originals: dict[tuple[Any, str], Any] = {(os, f): getattr(os, f) for f in _PROFILED_OS}
    originals[(chunkfile, "checksum")] = chunkfile.checksum
    originals[(FsTier, "_write_job")] = FsTier._write_job
    originals[(FsTier, "_read_job")] = FsTier._read_job
    out: dict[str, Any] = {}
    tier = FsTier("prof", root, 64 * GIB, io_threads=args.fs_threads)
    runner.run(tier.start())
    walls: dict[str, float] = {}
    try:
        for (obj, attr), fn in originals.items():
            setattr(obj, attr, timed("op (pool job)" if attr.startswith("_") else attr, fn))
        phases = [
            ("tier store", lambda: runner.run(tier_store(tier, chunks, src.views, size, args.fs_inflight))),
            ("raw store", lambda: run_threads(n, args.fs_threads, lambda i: flat.write(i, src.views[i]))),
            ("raw-paths store", lambda: run_threads(n, args.fs_threads, lambda i: paths.write(i, src.views[i]))),
            ("tier load", lambda: runner.run(tier_load(tier, chunks, dst.views, size, args.fs_inflight))),
            ("raw load", lambda: run_threads(n, args.fs_threads, lambda i: flat.read(i, dst.views[i]))),
            ("raw-paths load", lambda: run_threads(n, args.fs_threads, lambda i: paths.read(i, dst.views[i]))),
        ]
        for name, fn in phases:
            if name.endswith("load"):
                drop_page_cache(args.drop)
            else:
                os.sync()
            raw = None if name.startswith("tier") else (flat if name.startswith("raw ") else paths)
            if raw is not None:  # time the raw op like the tier's pool job
                method = "write" if name.endswith("store") else "read"
                setattr(raw, method, timed("op (pool job)", getattr(raw, method)))
            phase[0] = name
            try:
                t0 = time.perf_counter()
                fn()
                walls[name] = time.perf_counter() - t0
            finally:
                phase[0] = ""
                if raw is not None:
                    delattr(raw, method)
    finally:
        for (obj, attr), fn in originals.items():
            setattr(obj, attr, fn)
        runner.run(tier.close())
        for d in (root, flat.root, paths.root):
            shutil.rmtree(d, ignore_errors=True)
    table: dict[str, dict[str, dict[str, float]]] = {}
    for (ph, name), v in samples.items():
        if ph not in walls:
            continue
        table.setdefault(ph, {})[name] = {"per_chunk_us": sum(v) / n * 1e6, "calls_per_chunk": len(v) / n,
                                          "mean_us": statistics.fmean(v) * 1e6}
    out["wall_s"] = walls
    out["gib_s"] = {k: gib_s(n * size, w) for k, w in walls.items()}
    out["per_chunk"] = table
    out["thread_busy"] = {ph: sum(samples.get((ph, "op (pool job)"), [])) / (args.fs_threads * w)
                          for ph, w in walls.items()}
    return out


def print_profile(prof: dict[str, Any]) -> None:
    cpu = prof.get("cpu_us")
    if cpu:
        say("\nprofile: single-thread cost per 2 MiB chunk, data out of the CPU caches (best of 20)")
        for k, v in cpu.items():
            say(f"  {k:<48} {v:8.1f} us")
    s3 = prof.get("s3")
    if s3:
        say("\nprofile: s3, one more round under cProfile (loop thread); own time per function, share of the phase")
        for ph, v in s3.items():
            say(f"  {ph:<11} {v['cpu_s_per_gib']:.2f} CPU s/GiB (this process)")
            for name, share, calls in v["top_own_time"]:
                say(f"      {share:6.1%}  {name}  x{calls}")
    fs = prof.get("fs")
    if fs:
        say("\nprofile: fs, one instrumented store + load per arm; time per chunk spent in each call, "
            "summed over the I/O threads (us/chunk, calls/chunk)")
        for ph, calls in fs["per_chunk"].items():
            say(f"  {ph:<16} {fs['gib_s'][ph]:5.2f} GiB/s, I/O threads {fs['thread_busy'][ph]:.0%} busy")
            for name, v in sorted(calls.items(), key=lambda kv: -kv[1]["per_chunk_us"]):
                say(f"      {name:<16} {v['per_chunk_us']:8.1f} us/chunk  ({v['calls_per_chunk']:.2f} calls, "
                    f"{v['mean_us']:.1f} us each)")


# -- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fs-gib", type=float, default=1.0, help="bytes per fs phase (default 1 GiB)")
    ap.add_argument("--s3-mib", type=float, default=256, help="bytes per S3 phase (default 256 MiB)")
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fs", choices=("on", "off"), default="on")
    ap.add_argument("--s3", choices=("rgw", "moto", "off"), default="rgw")
    ap.add_argument("--fs-threads", type=int, default=8, help="fs tier io_threads = raw threads (daemon: 8)")
    ap.add_argument("--fs-inflight", type=int, default=16, help="fs tier operations in flight (daemon: 16)")
    ap.add_argument("--s3-inflight", type=int, default=16, help="S3 requests in flight, tier and raw (daemon: 16)")
    ap.add_argument("--s3-timeout", type=float, default=5.0, help="S3 per-operation timeout (daemon: 5 s)")
    ap.add_argument("--drop", type=int, choices=(1, 3), default=3,
                    help="drop_caches level before fs loads: 3 = page cache + dentries/inodes, 1 = page cache")
    ap.add_argument("--writeback", choices=("on", "off"), default="on",
                    help="the write-back stream row (a daemon with an fs tier and little RAM)")
    ap.add_argument("--wb-ram-mib", type=int, default=256, help="the write-back daemon's RAM (default 256 MiB)")
    ap.add_argument("--wb-streams", type=int, default=2, help="clients storing at once (default 2)")
    ap.add_argument("--wb-batch", type=int, default=16, help="chunks per store RPC (default 16, as the vLLM tier)")
    ap.add_argument("--fresh-root", action="store_true", help="fs roots without their fan-out directories")
    ap.add_argument("--memstore-bytes", type=int, default=2 * GIB, help="radosgw memstore OSD size")
    ap.add_argument("--dir", type=Path, default=None, help="parent of the fs roots (default: the temp dir)")
    ap.add_argument("--profile", action="store_true", help="add diagnostics: where the tiers' time goes")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = ap.parse_args(argv)

    import uvloop

    args.chunk_bytes = int(args.chunk_mib * MIB)
    if args.chunk_bytes % PAGE or args.chunk_bytes <= 0:
        ap.error("--chunk-mib must give a whole number of pages")
    args.fs_chunks = max(1, int(args.fs_gib * GIB) // args.chunk_bytes) if args.fs == "on" else 0
    args.s3_chunks = max(1, int(args.s3_mib * MIB) // args.chunk_bytes) if args.s3 != "off" else 0
    pool_chunks = max(args.fs_chunks, args.s3_chunks, 1)

    t_start = time.perf_counter()
    say(f"kvstored tiers benchmark: {args.chunk_bytes / MIB:g} MiB chunks, {args.rounds} rounds (median), "
        f"fs {args.fs_chunks} chunks/phase ({args.fs_threads} I/O threads, {args.fs_inflight} in flight, "
        f"drop_caches {args.drop}, {'fresh' if args.fresh_root else 'in-use'} roots), "
        f"s3 {args.s3_chunks} chunks/phase ({args.s3_inflight} in flight, {args.s3})")
    load0 = load_average()
    say(f"  load average {load0:.2f} on {os.cpu_count()} CPUs" +
        ("  (HIGH: other work competes for the CPUs and the disk; expect noise)"
         if load0 > (os.cpu_count() or 1) * 0.5 else ""))
    src = Pool(pool_chunks, args.chunk_bytes)
    fill_pattern(src.array, args.chunk_bytes, seed=7)
    dst = Pool(pool_chunks, args.chunk_bytes)

    pairs: list[Pair] = []
    notes: list[str] = []
    failures: list[str] = []
    result: dict[str, Any] = {"machine": machine_info(), "load_average_start": load0,
                              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    prof: dict[str, Any] = {}
    workdir = Path(tempfile.mkdtemp(prefix="kvstored-bench-tiers-", dir=args.dir))
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            if args.fs == "on":
                try:
                    fs_pairs, result["fs"] = bench_fs(runner, args, src, dst, workdir, notes)
                    pairs += fs_pairs
                except Exception as exc:  # noqa: BLE001 - reported; the S3 part still runs
                    failures.append(f"fs: ABORTED: {describe(exc)}")
                    say(f"  {failures[-1]}")
            if args.s3 != "off":
                try:
                    s3_pairs, result["s3"] = bench_s3(runner, args, src, dst, notes)
                    pairs += s3_pairs
                    if args.profile:
                        prof["s3"] = result["s3"].pop("profile")
                except Exception as exc:  # noqa: BLE001 - reported with the fs results
                    failures.append(f"s3: ABORTED: {describe(exc)}")
                    say(f"  {failures[-1]}")
            if args.profile:
                try:
                    prof["cpu_us"] = profile_cpu(args.chunk_bytes)
                    if args.fs == "on":
                        prof["fs"] = profile_fs(runner, args, src, dst, workdir)
                except Exception as exc:  # noqa: BLE001 - the measurements above stand
                    failures.append(f"profile: ABORTED: {describe(exc)}")
                    say(f"  {failures[-1]}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    targeted = [p for p in pairs if p.target is not None]
    say("")
    print_pairs(targeted + [p for p in pairs if p.target is None])
    for note in notes + failures:
        say(f"  * {note}")
    if prof:
        print_profile(prof)
    elapsed = time.perf_counter() - t_start
    say(f"\nload average {load0:.2f} at start, {load_average():.2f} at end; total {elapsed:.0f} s")
    result["rows"] = [p.to_json() for p in pairs]
    result["notes"] = notes
    result["failures"] = failures
    result["profile"] = prof
    result["elapsed_s"] = elapsed
    if args.json:
        write_json(args.json, result)
        say(f"results written to {args.json}")
    if failures:
        return 2
    return 0 if all(p.status == "PASS" for p in targeted) else 1


if __name__ == "__main__":
    sys.exit(main())
