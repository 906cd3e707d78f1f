"""Benchmark of kvstored's local data path (not a test): store and load of a working set (1 GiB of
2 MiB chunks) through pool mapping and through region registration, with 1 and 2 client
processes, beside a numpy memcpy of the same bytes; lookup latency of 1 and 256 keys beside an
empty gRPC round trip. Every baseline is measured in the same run.

Method, baselines, targets and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np

from bench.lib.buffers import ShmFile, fill_pattern, populate
from bench.lib.daemons import Daemon, process_cpu_seconds
from bench.lib.report import (
    GIB,
    MIB,
    Row,
    Stats,
    aggregate_gib_s,
    load_average,
    machine_info,
    percentile,
    print_table,
    write_json,
)

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
            dst[i * chunk:(i + 1) * chunk] = src[i * chunk:(i + 1) * chunk]

    setup_s = time.perf_counter() - t_setup
    for rep in range(cfg["warmup"] + cfg["repeat"]):
        keys = [make_key(idx, rep, i) for i in range(n)]

        def pool_store() -> None:
            for b0, b1 in batches:
                r = client.store(ns, keys[b0:b1], src[b0 * chunk:b1 * chunk])
                if r.stored != b1 - b0:
                    errors.append(f"rep {rep} pool store batch {b0}: {r}")

        def pool_load() -> None:
            for b0, b1 in batches:
                got = client.load(ns, keys[b0:b1], dst[b0 * chunk:b1 * chunk])
                if got != b1 - b0:
                    errors.append(f"rep {rep} pool load batch {b0}: loaded {got} of {b1 - b0}")

        def region_store() -> None:
            for b0, b1 in batches:
                r = client.store_from_region(ns, region, keys[b0:b1], store_offsets[b0:b1])
                if r.stored != b1 - b0:
                    errors.append(f"rep {rep} region store batch {b0}: {r}")

        def region_load() -> None:
            for b0, b1 in batches:
                got = client.load_to_region(ns, region, keys[b0:b1], load_offsets[b0:b1])
                if got != b1 - b0:
                    errors.append(f"rep {rep} region load batch {b0}: loaded {got} of {b1 - b0}")

        def delete() -> None:
            for b0 in range(0, n, 4096):
                client.delete(ns, keys[b0:b0 + 4096])

        timed("memcpy", memcpy)
        timed("memcpy_chunked", memcpy_chunked)

        dst[:] = 0
        timed("pool_store", pool_store)
        timed("pool_load", pool_load)
        if rep == 0 and not np.array_equal(dst, src):
            errors.append("pool mapping: loaded bytes differ from the stored bytes")
        delete()

        timed("region_store", region_store)
        timed("region_load", region_load)
        if rep == 0 and not np.array_equal(region_file.array[share:], src):
            errors.append("region registration: loaded bytes differ from the stored bytes")
        delete()

    client.close()
    region_file.close()
    for name in phases:  # drop the warm-up repeats
        phases[name] = phases[name][cfg["warmup"]:]
    return {"phases": phases, "errors": errors, "bytes": share, "chunks": n, "batches": len(batches),
            "setup_s": setup_s}


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
            per_rep.append({
                "gib_s": aggregate_gib_s(total, windows),
                "wall_s": max(w[1] for w in windows) - min(w[0] for w in windows),
                "client_cpu_s": sum(w["phases"][phase][r]["client_cpu_s"] for w in out.values()),
                # every worker samples the daemon over the same window: take the widest reading
                "daemon_cpu_s": max(w["phases"][phase][r]["daemon_cpu_s"] for w in out.values()),
            })
        stats = Stats.of([p["gib_s"] for p in per_rep])
        best = max(per_rep, key=lambda p: p["gib_s"])
        summary["phases"][phase] = {
            "best_gib_s": stats.best, "median_gib_s": stats.median, "repeats": per_rep, "best_repeat": best,
        }
    summary["rpcs"] = {p: k * sum(w["batches"] for w in out.values()) for p, k in RPCS_PER_BATCH.items()}
    return summary


# -- lookups ------------------------------------------------------------------------------------


def run_lookups(cfg: dict[str, Any], iters: int, warmup: int) -> dict[str, Any]:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstored_client import Client, NamespaceSpec
    from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

    chunk = cfg["chunk_bytes"]
    with Client(cfg["socket"], deadline_s=30.0, client_name="bench-lookup") as client:
        ns = client.register_namespace(NamespaceSpec(model=MODEL, dtype="uint8", chunk_bytes=chunk))
        keys = [make_key(99, 0, i, salt=7) for i in range(LOOKUP_KEYS)]
        one = populate(np.empty(chunk, dtype=np.uint8))
        r = client.store(ns, keys, [one] * LOOKUP_KEYS)  # same bytes for every key: content is irrelevant
        if r.stored + r.already_present != LOOKUP_KEYS:
            raise RuntimeError(f"could not store the lookup keys: {r}")
        client.lookup(ns, keys[:1])  # creates the channel
        channel = client._channel  # the very channel Client.lookup uses
        health = health_pb2_grpc.HealthStub(channel)
        kv = client._get_stub()
        health_req = health_pb2.HealthCheckRequest()
        raw_req = pb.LookupRequest(namespace_id=ns.namespace_id, keys=keys)

        def check() -> None:
            health.Check(health_req, timeout=5.0)

        def lookup1() -> None:
            if client.lookup(ns, keys[:1]).prefix_hits != 1:
                raise RuntimeError("lookup of a cached key missed")

        def lookup256() -> None:
            if client.lookup(ns, keys).prefix_hits != LOOKUP_KEYS:
                raise RuntimeError("lookup of cached keys missed")

        def raw256() -> None:
            kv.Lookup(raw_req, timeout=5.0)

        kinds: dict[str, Callable[[], None]] = {
            "empty_rtt": check, "lookup_1": lookup1, "lookup_256": lookup256, "raw_lookup_256": raw256,
        }
        names = list(kinds)
        samples: dict[str, list[float]] = {k: [] for k in names}
        perf = time.perf_counter
        for i in range(warmup + iters):
            # rotate the order so no kind always follows the same one
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                fn = kinds[name]
                t0 = perf()
                fn()
                t1 = perf()
                if i >= warmup:
                    samples[name].append((t1 - t0) * 1e3)
        client.delete(ns, keys)
    return {
        k: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99), "mean_ms": float(np.mean(v)), "n": len(v)}
        for k, v in samples.items()
    }


# -- report -------------------------------------------------------------------------------------


def data_rows(nprocs: int, s: dict[str, Any], chunk_mib: float) -> list[Row]:
    ph = s["phases"]
    tag = f"{nprocs} proc" + ("s" if nprocs > 1 else "")
    base_name = f"memcpy {tag}"
    base = ph["memcpy"]["best_gib_s"]

    def row(phase: str, label: str, target: float | None, note: str = "") -> Row:
        return Row(
            f"{label}, {tag}", ph[phase]["best_gib_s"], "GiB/s", base_name, base, target,
            median=ph[phase]["median_gib_s"], note=note,
        )

    return [
        Row(f"memcpy (np.copyto, one copy), {tag}", base, "GiB/s", median=ph["memcpy"]["median_gib_s"]),
        row("memcpy_chunked", f"memcpy in {chunk_mib:g} MiB pieces [diag]", None),
        row("pool_store", "pool mapping store", POOL_TARGET),
        row("pool_load", "pool mapping load", POOL_TARGET),
        row("region_store", "region store_from_region", REGION_TARGET),
        row("region_load", "region load_to_region", REGION_TARGET),
    ]


def lookup_rows(lk: dict[str, Any]) -> list[Row]:
    e50, e99 = lk["empty_rtt"]["p50_ms"], lk["empty_rtt"]["p99_ms"]
    h = "Health/Check"
    return [
        Row("empty gRPC round trip p50 (Health/Check)", e50, "ms"),
        Row("empty gRPC round trip p99 (Health/Check)", e99, "ms"),
        Row("Client.lookup 1 key p50", lk["lookup_1"]["p50_ms"], "ms", f"{h} p50", e50, higher_is_better=False),
        Row("Client.lookup 1 key p99", lk["lookup_1"]["p99_ms"], "ms", f"{h} p99", e99, higher_is_better=False),
        Row(f"Client.lookup {LOOKUP_KEYS} keys p50", lk["lookup_256"]["p50_ms"], "ms", f"{h} p50", e50,
            LOOKUP_TARGET, higher_is_better=False),
        Row(f"Client.lookup {LOOKUP_KEYS} keys p99", lk["lookup_256"]["p99_ms"], "ms", f"{h} p99", e99,
            higher_is_better=False),
        Row(f"raw stub Lookup {LOOKUP_KEYS} keys p50 [diag]", lk["raw_lookup_256"]["p50_ms"], "ms", f"{h} p50", e50,
            higher_is_better=False),
    ]


def print_breakdown(results: dict[int, Any]) -> None:
    """Where the time goes, per phase: wall and CPU of the best repeat, RPCs, and a CPU-based ratio.

    "cpu ratio" = memcpy CPU / (client + daemon CPU), each the median over the repeats: how many
    times more CPU the one-copy memcpy would need for the same bytes. Unlike GiB/s it hardly
    moves when other processes compete for the CPUs, so it is the steadier number on a busy box.
    """
    print("\nbreakdown (wall and CPU of the best repeat; cpu ratio from the medians; client CPU summed over"
          " the client processes; daemon CPU over all its threads):")
    print(f"  {'phase':<22} {'wall ms':>8} {'client cpu ms':>14} {'daemon cpu ms':>14} {'RPCs':>5} "
          f"{'wall/RPC ms':>12} {'cpu ratio':>10}")
    for nprocs, s in results.items():
        def median_cpu(phase: str) -> float:
            return statistics.median(r["client_cpu_s"] + r["daemon_cpu_s"] for r in s["phases"][phase]["repeats"])

        base_cpu = median_cpu("memcpy")
        for phase in PHASES:
            b = s["phases"][phase]["best_repeat"]
            rpcs = s["rpcs"].get(phase, 0)
            per = f"{b['wall_s'] * 1e3 / rpcs:.2f}" if rpcs else ""
            cpu_ratio = base_cpu / median_cpu(phase)
            s["phases"][phase]["cpu_ratio_vs_memcpy"] = cpu_ratio
            print(f"  {phase + f' ({nprocs}p)':<22} {b['wall_s'] * 1e3:8.1f} {b['client_cpu_s'] * 1e3:14.1f} "
                  f"{b['daemon_cpu_s'] * 1e3:14.1f} {rpcs or '':>5} {per:>12} {cpu_ratio:9.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="working set in GiB (default 1)")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="chunk size in MiB (default 2)")
    ap.add_argument("--batch", type=int, default=64, help="chunks per request (default 64: one RPC per batch)")
    ap.add_argument("--repeat", type=int, default=7, help="repeats of each measurement (default 7; best is reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up repeats before those (default 1)")
    ap.add_argument("--procs", default="1,2", help="client process counts (default 1,2)")
    ap.add_argument("--lookup-iters", type=int, default=2000, help="timed calls of each lookup kind (default 2000)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    ap.add_argument(
        "--nt-threshold", metavar="BYTES", type=int,
        help="what-if: run the daemon and the client processes with GLIBC_TUNABLES="
             "glibc.cpu.x86_non_temporal_threshold=BYTES (memcpy uses non-temporal stores from that size up)",
    )
    ap.add_argument("--pool-pages", choices=("4k", "thp", "hugetlb"), default="4k",
                    help="the daemon's pool_pages (hugetlb needs vm.nr_hugepages; thp needs shmem_enabled=advise); "
                         "bench/pool.py compares the modes alone")
    ap.add_argument("--numa-node", default="", help="the daemon's numa_node (a node or interleave; default unset)")
    args = ap.parse_args(argv)
    if args.nt_threshold is not None:
        # glibc reads tunables at process start: the daemon and the spawned clients inherit this
        tunable = f"glibc.cpu.x86_non_temporal_threshold={args.nt_threshold:#x}"
        old = os.environ.get("GLIBC_TUNABLES")
        os.environ["GLIBC_TUNABLES"] = f"{old}:{tunable}" if old else tunable

    t_start = time.perf_counter()
    chunk = int(args.chunk_mib * MIB)
    procs = [int(p) for p in args.procs.split(",") if p]
    chunks = -(-int(args.gib * GIB) // chunk)
    chunks = -(-chunks // max(procs)) * max(procs)  # every process gets the same share
    working_set = chunks * chunk
    page = 64 << 10
    cpu_bytes = max(int(working_set * 1.5), (LOOKUP_KEYS + 16) * chunk)
    cpu_bytes = -(-cpu_bytes // page) * page

    print(f"kvstored local-path benchmark: working set {working_set / GIB:.3f} GiB = {chunks} chunks of "
          f"{args.chunk_mib:g} MiB, {args.batch} chunks per request, best of {args.repeat} repeats "
          f"(+{args.warmup} warm-up); "
          f"RAM tier {cpu_bytes / GIB:.2f} GiB")
    info = machine_info()
    if info["glibc_tunables"]:
        print(f"GLIBC_TUNABLES={info['glibc_tunables']} (daemon and clients)")
    print(f"machine: {info['cpus']} CPUs ({info['cpu_model']}), kernel {info['kernel']}, python {info['python']}, "
          f"{info['glibc']}, numpy {info['numpy']}, grpcio {info['grpcio']}; git {info['git']}")
    nt = info["glibc_non_temporal_threshold"]
    if nt is not None:
        sizes = ", ".join(f"{working_set // n / MIB:.0f} MiB ({n}p)" for n in procs)
        print(f"glibc non-temporal memcpy threshold: {nt / MIB:.1f} MiB; chunk copies ({args.chunk_mib:g} MiB) are "
              f"{'below' if chunk < nt else 'at or above'} it; one-copy baseline copies per process: {sizes}")
    load_start = load_average()
    print(f"load average at start: {load_start:.2f}")

    results: dict[int, Any] = {}
    pool_args = ["--pool-pages", args.pool_pages] + (["--numa-node", args.numa_node] if args.numa_node else [])
    print(f"pool: {args.pool_pages} pages, NUMA {args.numa_node or 'unset'}")
    with Daemon(cpu_bytes, extra_args=pool_args) as daemon:
        print(f"daemon pid {daemon.pid} on {daemon.socket} (ready in {daemon.start_s:.2f}s)")
        cfg = {"socket": str(daemon.socket), "chunk_bytes": chunk, "chunks": chunks, "batch": args.batch,
               "repeat": args.repeat, "warmup": args.warmup}
        for nprocs in procs:
            t0 = time.perf_counter()
            results[nprocs] = run_clients(nprocs, cfg, daemon)
            print(f"  {nprocs} client process(es): done in {time.perf_counter() - t0:.1f}s "
                  f"(buffer set-up {results[nprocs]['setup_s']:.1f}s)", flush=True)
        t0 = time.perf_counter()
        lookups = run_lookups(cfg, args.lookup_iters, warmup=max(50, args.lookup_iters // 10))
        print(f"  lookups: done in {time.perf_counter() - t0:.1f}s", flush=True)
        daemon_cpu = daemon.cpu_seconds()
        rc = daemon.stop()

    rows: list[Row] = []
    for nprocs, s in results.items():
        rows += data_rows(nprocs, s, args.chunk_mib)
    rows += lookup_rows(lookups)
    errors = [f"{n} proc(s): {e}" for n, s in results.items() for e in s["errors"]]

    print()
    print_table(rows, title="results (GiB/s rows: value = best repeat, median = median repeat; "
                            "ms rows: percentiles over all calls)")
    print_breakdown(results)
    load_end = load_average()
    limits = ", ".join(f"one memcpy {s['phases']['memcpy']['best_gib_s']:.2f} GiB/s with {n} process"
                       f"{'es' if n > 1 else ''}" for n, s in results.items())
    print(f"\nphysical limits on this machine (the baselines above): {limits} (every data row copies the same "
          f"bytes once); an empty gRPC round trip {lookups['empty_rtt']['p50_ms']:.3f} ms p50 (the raw transport "
          f"under every lookup); load average {load_start:.2f} at start, {load_end:.2f} at end")
    if max(load_start, load_end) > 1.0:
        print(f"\nWARNING: load average {load_start:.2f} at start, {load_end:.2f} at end: other processes were "
              f"competing for the {info['cpus']} CPUs; GiB/s and latencies are noisy (best-of helps, ratios less so).")
    misses = [r.name for r in rows if r.status == "MISS"]
    print(f"\n{sum(r.status == 'PASS' for r in rows)} PASS, {len(misses)} MISS; daemon exit code {rc}, "
          f"daemon CPU {daemon_cpu:.1f}s; total {time.perf_counter() - t_start:.1f}s")
    if errors:
        print("ERRORS (results above are not valid):")
        for e in errors:
            print("  " + e)

    if args.json:
        write_json(args.json, {
            "benchmark": "local_path",
            "config": {"working_set_bytes": working_set, "chunk_bytes": chunk, "chunks": chunks, "batch": args.batch,
                       "repeat": args.repeat, "warmup": args.warmup, "procs": procs, "lookup_iters": args.lookup_iters,
                       "cpu_bytes": cpu_bytes, "two_proc_split": "each process moves half the working set",
                       "gib_s_value": "best repeat", "targets": {"pool": POOL_TARGET, "region": REGION_TARGET,
                                                                 "lookup_256_p50": LOOKUP_TARGET}},
            "machine": info,
            "rows": [r.to_json() for r in rows],
            "data_path": {str(k): v for k, v in results.items()},
            "lookups": lookups,
            "errors": errors,
            "load_average": {"start": load_start, "end": load_end},
            "daemon": {"exit_code": rc, "cpu_s": daemon_cpu},
            "elapsed_s": time.perf_counter() - t_start,
        })
        print(f"JSON written to {args.json}")
    return 1 if errors or rc not in (0, None) else 0


if __name__ == "__main__":
    sys.exit(main())
