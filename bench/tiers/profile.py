# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""--profile: where the tiers' time goes."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.buffers import fill_pattern, populate
from bench.lib.limits import drop_page_cache
from bench.lib.report import GIB
from bench.tiers.common import (
    Pool,
    chunk_ids,
    header_pages,
    on_loop,
    run_threads,
    say,
    tier_dirs,
    tier_load,
    tier_store,
)
from bench.tiers.fs import RawFs
from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES


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
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values()) or 1.0  # own time over all functions
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
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
    from kvstored.chunks.receiver import RecordReceiver
    from kvstored.tiers.s3 import _encode

    cold = Pool(64, size)
    fill_pattern(cold.array, size, seed=3)
    chunk = chunk_ids(1, "prof")[0]
    it = itertools.cycle(range(64))
    body = _encode(chunk, [cold.views[0]], size)
    out = np.empty(size, dtype=np.uint8)
    populate(out)
    payload = memoryview(body)[HEADER_BYTES:]
    target = out.data

    def copy_out() -> None:
        target[:] = payload

    def receive(receiver: RecordReceiver) -> None:  # in 64 KiB pieces, as the body arrives
        for at in range(0, len(body), 1 << 16):
            receiver.feed(memoryview(body)[at : at + (1 << 16)])
        if receiver.problem() is not None:
            raise RuntimeError(receiver.problem())

    calls: dict[str, Callable[[], object]] = {
        "xxh3_64 checksum (chunkfile.checksum)": lambda: chunkfile.checksum([cold.views[next(it)]], size),
        "encode_header (without the checksum)": lambda: chunkfile.encode_header(chunk, size, 0),
        "decode_header": lambda: chunkfile.decode_header(body[:HEADER_BYTES]),
        "s3 _encode (checksum + header + b''.join copy)": lambda: _encode(chunk, [cold.views[next(it)]], size),
        "s3 read copy-out (memoryview slice assign)": copy_out,
        "s3 receive (copy-out + xxh3 + header check)": lambda: receive(RecordReceiver(chunk, size, [target])),
        "sha256 of a body (SigV4 payload signing, if on)": lambda: hashlib.sha256(body).digest(),
    }
    # (sha256 of 2 MiB is slow: 5 repeats)
    return {name: time_best(fn, 5 if name.startswith("sha256") else 20) * 1e6 for name, fn in calls.items()}


_PROFILED_OS = ("open", "close", "pwritev", "preadv", "replace", "stat", "fstat", "makedirs", "utime", "unlink")


def profile_fs(runner: asyncio.Runner, args, src: Pool, dst: Pool, workdir: Path) -> dict[str, Any]:
    """One instrumented store + load of each fs arm: per chunk, the time inside the tier's pool job
    or the raw op, split into syscalls and the checksum; and how busy the I/O threads were."""
    from kvstored.tiers.fs.jobs import FsJobs
    from kvstored.tiers.fs.tier import FsTier

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
    originals[(FsJobs, "write")] = FsJobs.write  # the tier's pool jobs
    originals[(FsJobs, "read")] = FsJobs.read
    out: dict[str, Any] = {}
    tier = FsTier("prof", root, 64 * GIB, io_threads=args.fs_threads)
    runner.run(tier.start())
    walls: dict[str, float] = {}
    try:
        for (obj, attr), fn in originals.items():
            setattr(obj, attr, timed("op (pool job)" if obj is FsJobs else attr, fn))
        phases = [
            ("tier store", on_loop(runner, tier_store, tier, chunks, src.views, size, args.fs_inflight)),
            ("raw store", lambda: run_threads(n, args.fs_threads, lambda i: flat.write(i, src.views[i]))),
            ("raw-paths store", lambda: run_threads(n, args.fs_threads, lambda i: paths.write(i, src.views[i]))),
            ("tier load", on_loop(runner, tier_load, tier, chunks, dst.views, size, args.fs_inflight)),
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
        table.setdefault(ph, {})[name] = {
            "per_chunk_us": sum(v) / n * 1e6,
            "calls_per_chunk": len(v) / n,
            "mean_us": statistics.fmean(v) * 1e6,
        }
    out["wall_s"] = walls
    out["gib_s"] = {k: n * size / w / GIB for k, w in walls.items()}
    out["per_chunk"] = table
    out["thread_busy"] = {
        ph: sum(samples.get((ph, "op (pool job)"), [])) / (args.fs_threads * w) for ph, w in walls.items()
    }
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
        say(
            "\nprofile: fs, one instrumented store + load per arm; time per chunk spent in each call, "
            "summed over the I/O threads (us/chunk, calls/chunk)"
        )
        for ph, calls in fs["per_chunk"].items():
            say(f"  {ph:<16} {fs['gib_s'][ph]:5.2f} GiB/s, I/O threads {fs['thread_busy'][ph]:.0%} busy")
            for name, v in sorted(calls.items(), key=lambda kv: -kv[1]["per_chunk_us"]):
                say(
                    f"      {name:<16} {v['per_chunk_us']:8.1f} us/chunk  ({v['calls_per_chunk']:.2f} calls, "
                    f"{v['mean_us']:.1f} us each)"
                )
