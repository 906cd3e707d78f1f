# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The client processes: each stores and loads its share of the working set, timed."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from bench.lib.buffers import ShmFile, each_batch, fill_pattern, populate
from bench.lib.daemons import Daemon, process_cpu_seconds
from bench.lib.report import Stats, aggregate_gib_s

POOL_TARGET = 0.9
REGION_TARGET = 0.8
LOOKUP_TARGET = 1.3
LOOKUP_KEYS = 256
MODEL = "bench/local-path"

PHASES = ("memcpy", "memcpy_chunked", "pool_store", "pool_load", "region_store", "region_load")
RPCS_PER_BATCH = {"pool_store": 2, "pool_load": 2, "region_store": 1, "region_load": 1}


def make_key(proc: int, rep: int, i: int, salt: int = 0) -> bytes:
    return proc.to_bytes(4, "big") + rep.to_bytes(4, "big") + i.to_bytes(8, "big") + salt.to_bytes(16, "big")


# -- worker (one client process) ----------------------------------------------------------------


def worker(idx: int, nprocs: int, cfg: dict[str, Any], daemon_pid: int, barrier, results) -> None:
    try:
        results.put(("ok", idx, _worker(idx, nprocs, cfg, daemon_pid, barrier)))
    except BaseException:
        barrier.abort()
        results.put(("error", idx, traceback.format_exc()))


def _worker(idx: int, nprocs: int, cfg: dict[str, Any], daemon_pid: int, barrier) -> dict[str, Any]:
    from kvstored_client import Client, NamespaceSpec

    chunk = cfg["chunk_bytes"]
    n = cfg["chunks"] // nprocs  # this process's share of the working set
    share = n * chunk
    batch = cfg["batch"]

    t_setup = time.perf_counter()
    # Buffers: source and destination (private memory, as an engine's host buffers would be),
    # and one region file: first half the store source, second half the load destination.
    src = populate(np.empty(share, dtype=np.uint8))
    dst = populate(np.empty(share, dtype=np.uint8))
    fill_pattern(src, chunk, seed=idx + 1)
    dst[:] = 0
    region_file = ShmFile(2 * share)
    region_file.array[:share] = src
    region_file.array[share:] = 0

    client = Client(cfg["socket"], deadline_s=30.0, client_name=f"bench-{idx}")
    ns = client.register_namespace(NamespaceSpec(model=MODEL, dtype="uint8", chunk_bytes=chunk))
    region = client.register_region(region_file.path)  # maps the pool (populated) and the region
    region_file.unlink()  # the client and daemon hold fds; nothing left behind on a crash
    if region.region_id == 0:
        raise RuntimeError("region registration failed (daemon unreachable?)")
    store_offsets = [i * chunk for i in range(n)]
    load_offsets = [share + i * chunk for i in range(n)]
    batches = [(b, min(b + batch, n)) for b in range(0, n, batch)]

    phases: dict[str, list[dict[str, float]]] = {p: [] for p in PHASES}
    errors: list[str] = []

    def timed(name: str, fn: Callable[[], None]) -> None:
        barrier.wait()
        d0, c0 = process_cpu_seconds(daemon_pid), time.process_time()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        c1, d1 = time.process_time(), process_cpu_seconds(daemon_pid)
        barrier.wait()
        phases[name].append({"t0": t0, "t1": t1, "client_cpu_s": c1 - c0, "daemon_cpu_s": d1 - d0})

    def memcpy() -> None:
        np.copyto(dst, src)

    def memcpy_chunked() -> None:
        for i in range(n):
            dst[i * chunk : (i + 1) * chunk] = src[i * chunk : (i + 1) * chunk]

    def one_repeat(rep: int) -> None:
        keys = [make_key(idx, rep, i) for i in range(n)]
        calls: dict[str, Callable[[int, int], int]] = {
            "pool_store": lambda b0, b1: client.store(ns, keys[b0:b1], src[b0 * chunk : b1 * chunk]).stored,
            "pool_load": lambda b0, b1: client.load(ns, keys[b0:b1], dst[b0 * chunk : b1 * chunk]),
            "region_store": lambda b0, b1: (
                client.store_from_region(ns, region, keys[b0:b1], store_offsets[b0:b1]).stored
            ),
            "region_load": lambda b0, b1: client.load_to_region(ns, region, keys[b0:b1], load_offsets[b0:b1]),
        }

        def phase(name: str) -> None:
            timed(name, partial(each_batch, batches, calls[name], errors, f"rep {rep} {name}"))

        def delete() -> None:
            for b0 in range(0, n, 4096):
                client.delete(ns, keys[b0 : b0 + 4096])

        timed("memcpy", memcpy)
        timed("memcpy_chunked", memcpy_chunked)
        dst[:] = 0
        phase("pool_store")
        phase("pool_load")
        if rep == 0 and not np.array_equal(dst, src):
            errors.append("pool mapping: loaded bytes differ from the stored bytes")
        delete()
        phase("region_store")
        phase("region_load")
        if rep == 0 and not np.array_equal(region_file.array[share:], src):
            errors.append("region registration: loaded bytes differ from the stored bytes")
        delete()

    setup_s = time.perf_counter() - t_setup
    for rep in range(cfg["warmup"] + cfg["repeat"]):
        one_repeat(rep)
    client.close()
    region_file.close()
    for name in phases:  # drop the warm-up repeats
        phases[name] = phases[name][cfg["warmup"] :]
    return {
        "phases": phases,
        "errors": errors,
        "bytes": share,
        "chunks": n,
        "batches": len(batches),
        "setup_s": setup_s,
    }


def run_clients(nprocs: int, cfg: dict[str, Any], daemon: Daemon) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # no inherited gRPC state
    barrier = ctx.Barrier(nprocs, timeout=300)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(i, nprocs, cfg, daemon.pid, barrier, results), name=f"bench-client-{i}")
        for i in range(nprocs)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    failures = []
    try:
        for _ in procs:
            status, idx, payload = results.get(timeout=600)
            if status == "ok":
                out[idx] = payload
            else:
                failures.append(f"client process {idx}:\n{payload}")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()  # our own child, by its handle
    if failures:
        raise RuntimeError("\n".join(failures) + "\n--- daemon log ---\n" + daemon.log_tail())
    return summarize_clients(nprocs, out)


def summarize_clients(nprocs: int, out: dict[int, Any]) -> dict[str, Any]:
    total = sum(w["bytes"] for w in out.values())
    repeats = len(out[0]["phases"]["memcpy"])
    summary: dict[str, Any] = {
        "bytes": total,
        "setup_s": max(w["setup_s"] for w in out.values()),
        "errors": [e for w in out.values() for e in w["errors"]],
        "phases": {},
    }
    for phase in PHASES:
        per_rep = []
        for r in range(repeats):
            windows = [(w["phases"][phase][r]["t0"], w["phases"][phase][r]["t1"]) for w in out.values()]
            per_rep.append(
                {
                    "gib_s": aggregate_gib_s(total, windows),
                    "wall_s": max(w[1] for w in windows) - min(w[0] for w in windows),
                    "client_cpu_s": sum(w["phases"][phase][r]["client_cpu_s"] for w in out.values()),
                    # every worker samples the daemon over the same window: take the widest reading
                    "daemon_cpu_s": max(w["phases"][phase][r]["daemon_cpu_s"] for w in out.values()),
                }
            )
        stats = Stats.of([p["gib_s"] for p in per_rep])
        best = max(per_rep, key=lambda p: p["gib_s"])
        summary["phases"][phase] = {
            "best_gib_s": stats.best,
            "median_gib_s": stats.median,
            "repeats": per_rep,
            "best_repeat": best,
        }
    summary["rpcs"] = {p: k * sum(w["batches"] for w in out.values()) for p, k in RPCS_PER_BATCH.items()}
    return summary
