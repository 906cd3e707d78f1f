# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""kvstored against the alternatives, in one run, on the same 2 MiB chunks (not a test): kvstored's
local path (Client.store/load through the shared pool) and its fs tier, beside Redis 7 GET/SET
(redis-py + hiredis on loopback, LMCache's usual remote backend), a raw memcpy of the same bytes,
and raw O_DIRECT reads/writes (the disk ceiling of the fs tier).

Method, baselines, targets and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.buffers import aligned_pool, fill_pattern
from bench.lib.daemons import Daemon, free_port
from bench.lib.limits import ODirectFiles, apply_nt_threshold, nt_threshold_arg
from bench.lib.report import GIB, MIB, REPO, Row, load_average, machine_info, print_table, write_json

TARGET_VS_REDIS = 5.0
BATCH = 64  # chunks per kvstored call
PIPELINE = 16  # Redis commands per pipeline (2 MiB each; deeper pipelines measured slower here)
IO_THREADS = 8  # as the fs tier's default io_threads


@dataclass
class Samples:
    gib_s: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return float(np.median(self.gib_s))

    @property
    def best(self) -> float:
        return max(self.gib_s)


def timed(nbytes: int, fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return nbytes / GIB / (time.perf_counter() - t0)


# -- systems ----------------------------------------------------------------------------------------


class KvLocal:
    """kvstored, RAM tier, pool mapping."""

    def __init__(self, chunk: int, n: int) -> None:
        from kvstored_client import Client, NamespaceSpec

        self.daemon = Daemon(int(n * chunk * 1.25) + 64 * MIB, extra_args=["--metrics-addr", "off"])
        self.daemon.start()
        self.client = Client(self.daemon.socket, deadline_s=60.0, client_name="bench-compare")
        self.ns = self.client.register_namespace(NamespaceSpec(model="bench/compare", dtype="u8", chunk_bytes=chunk))
        self.chunk, self.n = chunk, n
        self.keys = [b"L" + i.to_bytes(31, "big") for i in range(n)]

    def store(self, src: np.ndarray) -> None:
        for b in range(0, self.n, BATCH):
            r = self.client.store(self.ns, self.keys[b : b + BATCH], src[b * self.chunk : (b + BATCH) * self.chunk])
            if r.stored != len(self.keys[b : b + BATCH]):
                raise RuntimeError(f"kvstored store: {r}")

    def load(self, dst: np.ndarray) -> None:
        for b in range(0, self.n, BATCH):
            got = self.client.load(self.ns, self.keys[b : b + BATCH], dst[b * self.chunk : (b + BATCH) * self.chunk])
            if got != len(self.keys[b : b + BATCH]):
                raise RuntimeError(f"kvstored load: {got} chunks")

    def clear(self) -> None:
        self.client.delete(self.ns, self.keys)

    def close(self) -> None:
        self.client.close()
        self.daemon.stop()


class KvFs:
    """kvstored's fs tier: write-through stores timed to the last file written; loads by a
    fresh daemon (cold RAM) on the same root."""

    def __init__(self, chunk: int, n: int, workdir: Path) -> None:
        self.chunk, self.n = chunk, n
        self.workdir = workdir
        self.keys = [b"F" + i.to_bytes(31, "big") for i in range(n)]
        self.root: Path | None = None
        self.ram = int(n * chunk * 1.25) + 64 * MIB

    def _daemon(self, *extra: str) -> tuple[Daemon, Any, Any]:
        from kvstored_client import Client, NamespaceSpec

        assert self.root is not None
        # a backlog that takes the whole working set: write-through queues every chunk, none dropped
        tier = f"kind=fs,root={self.root},bytes={4 * self.n * self.chunk},max_backlog={self.n + 64}"
        d = Daemon(self.ram, extra_args=["--metrics-addr", "off", "--tiers", tier, *extra])
        d.start()
        c = Client(d.socket, deadline_s=120.0, client_name="bench-compare-fs")
        ns = c.register_namespace(NamespaceSpec(model="bench/compare-fs", dtype="u8", chunk_bytes=self.chunk))
        return d, c, ns

    def store(self, src: np.ndarray) -> float:
        """GiB/s from the first store to the fs tier reporting every chunk written."""
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        self.root = Path(tempfile.mkdtemp(prefix="compare-fs-", dir=self.workdir))
        d, c, ns = self._daemon("--write-policy", "write-through")
        try:
            fs_stats = lambda: next(t for t in c.stats().tiers if t.name == "fs")  # noqa: E731
            before = fs_stats().stored_chunks
            t0 = time.perf_counter()
            for b in range(0, self.n, BATCH):
                r = c.store(ns, self.keys[b : b + BATCH], src[b * self.chunk : (b + BATCH) * self.chunk])
                if r.stored != len(self.keys[b : b + BATCH]):
                    raise RuntimeError(f"kvstored fs store: {r}")
            progress, last_change = before, time.monotonic()
            while True:
                fs = fs_stats()
                if fs.dropped_backpressure or fs.errors or fs.rejected_full or fs.rejected_admission:
                    raise RuntimeError(f"fs tier dropped or failed writes: {fs}")
                if fs.stored_chunks - before >= self.n:
                    break
                if fs.stored_chunks != progress:
                    progress, last_change = fs.stored_chunks, time.monotonic()
                elif time.monotonic() - last_change > 30:
                    raise RuntimeError(f"fs tier stopped writing at {progress - before}/{self.n} chunks: {fs}")
                time.sleep(0.002)
            elapsed = time.perf_counter() - t0
        finally:
            c.close()
            d.stop()
        return self.n * self.chunk / GIB / elapsed

    def load(self, dst: np.ndarray) -> float:
        d, c, ns = self._daemon()
        try:
            t0 = time.perf_counter()
            for b in range(0, self.n, BATCH):
                keys = self.keys[b : b + BATCH]
                found = c.lookup(ns, keys)
                if found.prefix_hits != len(keys) or any(t.name != "FS" for t in found.tiers):
                    raise RuntimeError(f"kvstored fs: expected fs hits, got {found}")
                got = c.load(ns, keys, dst[b * self.chunk : (b + BATCH) * self.chunk])
                if got != len(keys):
                    raise RuntimeError(f"kvstored fs load: {got} chunks")
            elapsed = time.perf_counter() - t0
        finally:
            c.close()
            d.stop()
        return self.n * self.chunk / GIB / elapsed

    def close(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


class RedisServer:
    """Debian's redis-server on 127.0.0.1, no persistence; redis-py with hiredis."""

    def __init__(self, chunk: int, n: int, workdir: Path) -> None:
        import redis
        from redis.utils import HIREDIS_AVAILABLE

        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not installed (apt-get install -y --no-install-recommends redis-server)")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="redis-", dir=workdir))
        self.log = open(self.dir / "redis.log", "wb")
        argv = f"--bind 127.0.0.1 --port {self.port} --appendonly no --protected-mode no --daemonize no".split()
        self.proc = subprocess.Popen(
            [exe, *argv, "--save", "", "--dir", str(self.dir)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
        self.hiredis = HIREDIS_AVAILABLE
        self.r = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=60)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.r.ping()
                break
            except redis.ConnectionError as exc:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    log = (self.dir / "redis.log").read_text()[-500:]
                    raise RuntimeError(f"redis-server did not start ({log})") from exc
                time.sleep(0.05)
        self.chunk, self.n = chunk, n
        self.keys = [b"kv:" + i.to_bytes(8, "big") for i in range(n)]

    def set(self, src: np.ndarray) -> None:
        c = self.chunk
        for b in range(0, self.n, PIPELINE):
            pipe = self.r.pipeline(transaction=False)
            for i in range(b, min(b + PIPELINE, self.n)):
                pipe.set(self.keys[i], src[i * c : (i + 1) * c].data)
            pipe.execute()

    def get_pipelined(self, sink: list) -> None:
        sink.clear()
        for b in range(0, self.n, PIPELINE):
            pipe = self.r.pipeline(transaction=False)
            for i in range(b, min(b + PIPELINE, self.n)):
                pipe.get(self.keys[i])
            sink.extend(pipe.execute())
            sink.clear()  # keep memory flat: one batch of bytes objects alive at a time

    def get_each(self, sink: list) -> None:
        for key in self.keys:
            value = self.r.get(key)
            if value is None:
                raise RuntimeError("redis GET: missing key")
        sink.clear()

    def check(self, src: np.ndarray) -> None:
        c = self.chunk
        for i in (0, self.n // 2, self.n - 1):
            if self.r.get(self.keys[i]) != src[i * c : (i + 1) * c].tobytes():
                raise RuntimeError(f"redis returned wrong bytes for chunk {i}")

    def clear(self) -> None:
        self.r.flushall()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.r.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- main -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="working set in GiB (default 1)")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="chunk size in MiB (default 2)")
    ap.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="repeats of every phase (default 5; the best is reported, the median beside it)",
    )
    ap.add_argument(
        "--workdir",
        default=str(REPO / "results" / "tmp"),
        help="fs tier root, raw O_DIRECT files and redis' directory go under here",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    nt_threshold_arg(ap)
    args = ap.parse_args(argv)
    apply_nt_threshold(args.nt_threshold)

    chunk = int(args.chunk_mib * MIB)
    if chunk % 4096:
        ap.error("--chunk-mib must give a multiple of 4096 bytes")
    n = max(1, int(args.gib * GIB) // chunk)
    nbytes = n * chunk
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    print(
        f"kvstored vs alternatives -- {n} chunks of {chunk / MIB:g} MiB ({nbytes / GIB:.2f} GiB), "
        f"{args.repeat} repeats, round-robin; {info['cpu_model']}, {info['cpus']} CPUs, {info['mem_total_gib']} GiB, "
        f"git {info['git']}, load average {load_average():.2f}; GLIBC_TUNABLES={info['glibc_tunables'] or '(none)'} "
        f"for every process",
        flush=True,
    )

    src_map, dst_map = aligned_pool(nbytes), aligned_pool(nbytes)
    src, dst = np.frombuffer(src_map, dtype=np.uint8), np.frombuffer(dst_map, dtype=np.uint8)
    fill_pattern(src, chunk, seed=7)

    samples: dict[str, Samples] = {
        k: Samples()
        for k in (
            "memcpy kv_store kv_load kvfs_store kvfs_load redis_set redis_get_pipelined redis_get_each "
            "odirect_write odirect_read"
        ).split()
    }
    kv = kvfs = redis_srv = raw = None
    sink: list = []
    t_all = time.perf_counter()
    try:
        kv = KvLocal(chunk, n)
        kvfs = KvFs(chunk, n, workdir)
        redis_srv = RedisServer(chunk, n, workdir)
        raw = ODirectFiles(workdir, n, chunk, IO_THREADS)  # the disk ceiling of the fs tier
        print(f"  redis: {redis_srv.version}; redis-py hiredis parser: {redis_srv.hiredis}", flush=True)
        for rep in range(args.repeat):

            def memcpy() -> None:
                for i in range(n):
                    dst[i * chunk : (i + 1) * chunk] = src[i * chunk : (i + 1) * chunk]

            samples["memcpy"].gib_s.append(timed(nbytes, memcpy))

            samples["kv_store"].gib_s.append(timed(nbytes, lambda: kv.store(src)))
            dst[:] = 0
            samples["kv_load"].gib_s.append(timed(nbytes, lambda: kv.load(dst)))
            if rep == 0 and not np.array_equal(src, dst):
                raise RuntimeError("kvstored local load returned wrong bytes")
            kv.clear()

            samples["redis_set"].gib_s.append(timed(nbytes, lambda: redis_srv.set(src)))
            if rep == 0:
                redis_srv.check(src)
            samples["redis_get_pipelined"].gib_s.append(timed(nbytes, lambda: redis_srv.get_pipelined(sink)))
            samples["redis_get_each"].gib_s.append(timed(nbytes, lambda: redis_srv.get_each(sink)))
            redis_srv.clear()

            samples["odirect_write"].gib_s.append(timed(nbytes, lambda: raw.write(memoryview(src_map))))
            samples["odirect_read"].gib_s.append(timed(nbytes, lambda: raw.read(memoryview(dst_map))))

            samples["kvfs_store"].gib_s.append(kvfs.store(src))
            dst[:] = 0
            samples["kvfs_load"].gib_s.append(kvfs.load(dst))
            if rep == 0 and not np.array_equal(src, dst):
                raise RuntimeError("kvstored fs load returned wrong bytes")
            print(
                f"  repeat {rep + 1}/{args.repeat}: "
                + ", ".join(f"{k} {v.gib_s[-1]:.2f}" for k, v in samples.items())
                + " GiB/s",
                flush=True,
            )
    finally:
        for system in (kv, kvfs, redis_srv, raw):
            if system is not None:
                with contextlib.suppress(Exception):
                    system.close()

    med = {k: v.median for k, v in samples.items()}
    best = {k: v.best for k, v in samples.items()}

    def row(name: str, key: str, base_name: str, base_key: str, target: float | None = None, note: str = "") -> Row:
        return Row(name, best[key], "GiB/s", base_name, best[base_key], target=target, median=med[key], note=note)

    rows = [
        row("kvstored local path: load", "kv_load", "kvstored local load", "kv_load"),
        row("kvstored local path: store", "kv_store", "kvstored local store", "kv_store"),
        row("kvstored fs tier: load (cold RAM)", "kvfs_load", "kvstored local load", "kv_load"),
        row("kvstored fs tier: store (to disk)", "kvfs_store", "kvstored local store", "kv_store"),
        row("Redis GET, pipelined 16", "redis_get_pipelined", "kvstored local load", "kv_load"),
        row("Redis GET, one at a time", "redis_get_each", "kvstored local load", "kv_load"),
        row("Redis SET, pipelined 16", "redis_set", "kvstored local store", "kv_store"),
        row("raw memcpy (2 MiB pieces)", "memcpy", "kvstored local load", "kv_load"),
        row("raw O_DIRECT read (8 threads)", "odirect_read", "kvstored fs load", "kvfs_load"),
        row("raw O_DIRECT write (8 threads)", "odirect_write", "kvstored fs store", "kvfs_store"),
    ]
    redis_best = max(
        ("redis_get_pipelined", "Redis GET, pipelined 16"),
        ("redis_get_each", "Redis GET, one at a time"),
        key=lambda kv_: best[kv_[0]],
    )
    target_row = Row(
        "kvstored local load vs Redis GET",
        best["kv_load"],
        "GiB/s",
        redis_best[1],
        best[redis_best[0]],
        target=TARGET_VS_REDIS,
        median=med["kv_load"],
        note="issue 5 target: kvstored's local path >= 5x Redis GET (Redis' faster GET variant)",
    )
    print()
    print_table(
        rows,
        title="value: best repeat (as bench/local_path.py), median: median repeat; ratio: value / "
        "the baseline's value (a kvstored row)",
    )
    print()
    print_table([target_row], title="target")
    print(f"\ntook {time.perf_counter() - t_all:.0f} s; load average now {load_average():.2f}")

    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "compare",
                "command": " ".join(
                    [Path(sys.executable).name, *(sys.argv if argv is None else ["bench/compare.py", *argv])]
                ),
                "machine": info,
                "chunk_bytes": chunk,
                "chunks": n,
                "repeat": args.repeat,
                "redis": {
                    "version": redis_srv.version if redis_srv else "",
                    "hiredis": redis_srv.hiredis if redis_srv else None,
                },
                "samples_gib_s": {k: v.gib_s for k, v in samples.items()},
                "median_gib_s": med,
                "best_gib_s": best,
                "rows": [r.to_json() for r in rows],
                "target": target_row.to_json(),
            },
        )
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
