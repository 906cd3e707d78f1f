# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The client processes, each storing and loading its share of the working set, timed; and the
lookup latency of 1 and 256 keys beside an empty gRPC round trip."""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.lib.buffers import ShmFile, each_batch, fill_pattern, populate
from bench.lib.call_latency import interleaved, timed_call
from bench.lib.daemons import Daemon, process_cpu_seconds
from bench.lib.report import Stats, aggregate_gib_s, percentile
from kvstored_client import Client, NamespaceSpec
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

LOOKUP_KEYS = 256
MODEL = "bench/local-path"
PHASES = ("memcpy", "memcpy_chunked", "pool_store", "pool_load", "region_store", "region_load")
RPCS_PER_BATCH = {"pool_store": 2, "pool_load": 2, "region_store": 1, "region_load": 1}


def make_key(proc: int, rep: int, i: int, salt: int = 0) -> bytes:
    return proc.to_bytes(4, "big") + rep.to_bytes(4, "big") + i.to_bytes(8, "big") + salt.to_bytes(16, "big")


def worker(idx: int, nprocs: int, cfg: dict[str, Any], daemon_pid: int, barrier, results) -> None:
    """One client process: its result, or its traceback, on `results`."""
    try:
        results.put(("ok", idx, _worker(idx, nprocs, cfg, daemon_pid, barrier)))
    except BaseException:
        barrier.abort()
        results.put(("error", idx, traceback.format_exc()))


def _worker(idx: int, nprocs: int, cfg: dict[str, Any], daemon_pid: int, barrier) -> dict[str, Any]:
    chunk = cfg["chunk_bytes"]
    n = cfg["chunks"] // nprocs  # this process's share of the working set
    share = n * chunk
    t_setup = time.perf_counter()
    # Source and destination in private memory (as an engine's host buffers), and one region file:
    # first half the store source, second half the load destination.
    src = populate(np.empty(share, dtype=np.uint8))
    dst = populate(np.zeros(share, dtype=np.uint8))
    fill_pattern(src, chunk, seed=idx + 1)
    region_file = ShmFile(2 * share)
    region_file.array[:share] = src

    client = Client(cfg["socket"], deadline_s=30.0, client_name=f"bench-{idx}")
    ns = client.register_namespace(NamespaceSpec(model=MODEL, dtype="uint8", chunk_bytes=chunk))
    region = client.register_region(region_file.path)  # maps the pool (populated) and the region
    region_file.unlink()  # the client and daemon hold fds; nothing left behind on a crash
    if region.region_id == 0:
        raise RuntimeError("region registration failed (daemon unreachable?)")
    store_offsets = [i * chunk for i in range(n)]
    load_offsets = [share + i * chunk for i in range(n)]
    loaded = region_file.array[share:]  # where load_to_region lands
    batches = [(b, min(b + cfg["batch"], n)) for b in range(0, n, cfg["batch"])]
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

        timed("memcpy", partial(np.copyto, dst, src))
        timed("memcpy_chunked", memcpy_chunked)
        dst[:] = 0
        for kind, what, landed in (("pool", "pool mapping", dst), ("region", "region registration", loaded)):
            for name in (f"{kind}_store", f"{kind}_load"):
                timed(name, partial(each_batch, batches, calls[name], errors, f"rep {rep} {name}"))
            if rep == 0 and not np.array_equal(landed, src):
                errors.append(f"{what}: loaded bytes differ from the stored bytes")
            for b0 in range(0, n, 4096):
                client.delete(ns, keys[b0 : b0 + 4096])

    setup_s = time.perf_counter() - t_setup
    for rep in range(cfg["warmup"] + cfg["repeat"]):
        one_repeat(rep)
    client.close()
    region_file.close()
    phases = {name: reps[cfg["warmup"] :] for name, reps in phases.items()}  # without the warm-up repeats
    return {"phases": phases, "errors": errors, "bytes": share, "batches": len(batches), "setup_s": setup_s}


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
    return summarize_clients(out)


def summarize_clients(out: dict[int, Any]) -> dict[str, Any]:
    """Per phase and repeat: the processes' bytes over their joint window, their CPU, the daemon's; per phase, the
    cpu ratio = memcpy CPU / (client + daemon CPU), medians over the repeats (steadier than GiB/s under load)."""
    workers = list(out.values())
    total = sum(w["bytes"] for w in workers)
    summary: dict[str, Any] = {
        "bytes": total,
        "setup_s": max(w["setup_s"] for w in workers),
        "errors": [e for w in workers for e in w["errors"]],
        "phases": {},
    }
    cpu: dict[str, float] = {}
    for phase in PHASES:  # (memcpy first)
        per_rep = []
        for reps in zip(*(w["phases"][phase] for w in workers)):  # each process's sample of one repeat
            windows = [(r["t0"], r["t1"]) for r in reps]
            per_rep.append(
                {
                    "gib_s": aggregate_gib_s(total, windows),
                    "wall_s": max(w[1] for w in windows) - min(w[0] for w in windows),
                    "client_cpu_s": sum(r["client_cpu_s"] for r in reps),
                    # every worker samples the daemon over the same window: take the widest reading
                    "daemon_cpu_s": max(r["daemon_cpu_s"] for r in reps),
                }
            )
        stats = Stats.of([p["gib_s"] for p in per_rep])
        best = max(per_rep, key=lambda p: p["gib_s"])
        cpu[phase] = statistics.median(p["client_cpu_s"] + p["daemon_cpu_s"] for p in per_rep)
        summary["phases"][phase] = {
            "best_gib_s": stats.best,
            "median_gib_s": stats.median,
            "repeats": per_rep,
            "best_repeat": best,
            "cpu_ratio_vs_memcpy": cpu["memcpy"] / cpu[phase],
        }
    summary["rpcs"] = {p: k * sum(w["batches"] for w in workers) for p, k in RPCS_PER_BATCH.items()}
    return summary


def run_lookups(cfg: dict[str, Any], iters: int, warmup: int) -> dict[str, Any]:
    """Lookups of 1 and 256 cached keys (Client and raw stub) interleaved with an empty gRPC call."""
    chunk = cfg["chunk_bytes"]
    with Client(cfg["socket"], deadline_s=30.0, client_name="bench-lookup") as client:
        ns = client.register_namespace(NamespaceSpec(model=MODEL, dtype="uint8", chunk_bytes=chunk))
        keys = [make_key(99, 0, i, salt=7) for i in range(LOOKUP_KEYS)]
        one = populate(np.empty(chunk, dtype=np.uint8))
        r = client.store(ns, keys, [one] * LOOKUP_KEYS)  # same bytes for every key: content is irrelevant
        if r.stored + r.already_present != LOOKUP_KEYS:
            raise RuntimeError(f"could not store the lookup keys: {r}")
        client.lookup(ns, keys[:1])  # creates the channel
        health = health_pb2_grpc.HealthStub(client._channel)  # the very channel Client.lookup uses
        health_req = health_pb2.HealthCheckRequest()
        kv, raw_req = client._get_stub(), pb.LookupRequest(namespace_id=ns.namespace_id, keys=keys)
        kinds = {
            "empty_rtt": timed_call(lambda _: health.Check(health_req, timeout=5.0)),
            "lookup_1": timed_call(
                lambda _: client.lookup(ns, keys[:1]).prefix_hits, lambda h: h == 1, "lookup of a cached key missed"
            ),
            "lookup_256": timed_call(
                lambda _: client.lookup(ns, keys).prefix_hits,
                lambda h: h == LOOKUP_KEYS,
                "lookup of cached keys missed",
            ),
            "raw_lookup_256": timed_call(lambda _: kv.Lookup(raw_req, timeout=5.0)),
        }
        samples = interleaved(kinds, iters, warmup)
        client.delete(ns, keys)
    return {
        k: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99), "mean_ms": float(np.mean(v)), "n": len(v)}
        for k, v in samples.items()
    }
