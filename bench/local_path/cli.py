# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The local-path benchmark's command line (`python -m bench.local_path`), its rows and breakdown."""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.lib.daemons import Daemon
from bench.lib.report import GIB, MIB, Row, load_average, machine_info, print_aligned, print_table, write_json
from bench.local_path import __doc__ as DOC
from bench.local_path.clients import LOOKUP_KEYS, run_clients, run_lookups

POOL_TARGET = 0.9
REGION_TARGET = 0.8
LOOKUP_TARGET = 1.3


def data_rows(nprocs: int, s: dict[str, Any], chunk_mib: float) -> list[Row]:
    ph = s["phases"]
    tag = f"{nprocs} proc" + ("s" if nprocs > 1 else "")
    base = ph["memcpy"]["best_gib_s"]

    def row(phase: str, label: str, target: float | None) -> Row:
        best, median = ph[phase]["best_gib_s"], ph[phase]["median_gib_s"]
        return Row(f"{label}, {tag}", best, "GiB/s", f"memcpy {tag}", base, target, median=median)

    return [
        Row(f"memcpy (np.copyto, one copy), {tag}", base, "GiB/s", median=ph["memcpy"]["median_gib_s"]),
        row("memcpy_chunked", f"memcpy in {chunk_mib:g} MiB pieces [diag]", None),
        row("pool_store", "pool mapping store", POOL_TARGET),
        row("pool_load", "pool mapping load", POOL_TARGET),
        row("region_store", "region store_from_region", REGION_TARGET),
        row("region_load", "region load_to_region", REGION_TARGET),
    ]


def lookup_rows(lk: dict[str, Any]) -> list[Row]:
    """The lookups' percentiles, each against the empty gRPC round trip's same percentile."""
    rows = [Row(f"empty gRPC round trip {p} (Health/Check)", lk["empty_rtt"][f"{p}_ms"], "ms") for p in ("p50", "p99")]
    for kind, label, percentiles in (
        ("lookup_1", "Client.lookup 1 key", ("p50", "p99")),
        ("lookup_256", f"Client.lookup {LOOKUP_KEYS} keys", ("p50", "p99")),
        ("raw_lookup_256", f"raw stub Lookup {LOOKUP_KEYS} keys", ("p50",)),
    ):
        for p in percentiles:
            target = LOOKUP_TARGET if kind == "lookup_256" and p == "p50" else None
            name = f"{label} {p}" + (" [diag]" if kind.startswith("raw") else "")
            base = lk["empty_rtt"][f"{p}_ms"]
            rows.append(Row(name, lk[kind][f"{p}_ms"], "ms", f"Health/Check {p}", base, target, higher_is_better=False))
    return rows


def print_breakdown(results: dict[int, Any]) -> None:
    """Per phase: wall and CPU of the best repeat, RPCs, and the cpu ratio (summarize_clients)."""
    print("\nbreakdown (best repeat; cpu ratio from the medians; see docs/benchmarks.md#local-data-path):")
    table = [["phase", "wall ms", "client cpu ms", "daemon cpu ms", "RPCs", "wall/RPC ms", "cpu ratio"]]
    for nprocs, s in results.items():
        for phase, ph in s["phases"].items():
            b, rpcs = ph["best_repeat"], s["rpcs"].get(phase, 0)
            ms = [f"{b[k] * 1e3:.1f}" for k in ("wall_s", "client_cpu_s", "daemon_cpu_s")]
            per = f"{b['wall_s'] * 1e3 / rpcs:.2f}" if rpcs else ""
            table.append([f"{phase} ({nprocs}p)", *ms, str(rpcs or ""), per, f"{ph['cpu_ratio_vs_memcpy']:.2f}x"])
    print_aligned(table, right={1, 2, 3, 4, 5, 6})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.local_path", description=(DOC or "").split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="working set in GiB (default 1)")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="chunk size in MiB (default 2)")
    ap.add_argument("--batch", type=int, default=64, help="chunks per request (default 64: one RPC per batch)")
    ap.add_argument("--repeat", type=int, default=7, help="repeats of each measurement (default 7; best is reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up repeats before those (default 1)")
    ap.add_argument("--procs", default="1,2", help="client process counts (default 1,2)")
    ap.add_argument("--lookup-iters", type=int, default=2000, help="timed calls of each lookup kind (default 2000)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    ap.add_argument(
        "--pool-pages",
        choices=("4k", "thp", "hugetlb"),
        default="4k",
        help="the daemon's pool_pages (hugetlb needs vm.nr_hugepages; thp needs shmem_enabled=advise)",
    )
    ap.add_argument("--numa-node", default="", help="the daemon's numa_node (a node or interleave; default unset)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    chunk = int(args.chunk_mib * MIB)
    procs = [int(p) for p in args.procs.split(",") if p]
    chunks = -(-int(args.gib * GIB) // chunk)
    chunks = -(-chunks // max(procs)) * max(procs)  # every process gets the same share
    working_set = chunks * chunk
    page = 64 << 10
    cpu_bytes = -(-max(int(working_set * 1.5), (LOOKUP_KEYS + 16) * chunk) // page) * page
    print(
        f"kvstored local-path benchmark: working set {working_set / GIB:.3f} GiB = {chunks} chunks of "
        f"{args.chunk_mib:g} MiB, {args.batch} chunks per request, best of {args.repeat} repeats "
        f"(+{args.warmup} warm-up); RAM tier {cpu_bytes / GIB:.2f} GiB"
    )
    info = machine_info()
    if info["glibc_tunables"]:
        print(f"GLIBC_TUNABLES={info['glibc_tunables']} (daemon and clients)")
    print(
        f"machine: {info['cpus']} CPUs ({info['cpu_model']}), kernel {info['kernel']}, python {info['python']}, "
        f"{info['glibc']}, numpy {info['numpy']}, grpcio {info['grpcio']}; git {info['git']}"
    )
    if (nt := info["glibc_non_temporal_threshold"]) is not None:
        sizes = ", ".join(f"{working_set // n / MIB:.0f} MiB ({n}p)" for n in procs)
        print(
            f"glibc non-temporal memcpy threshold: {nt / MIB:.1f} MiB; chunk copies ({args.chunk_mib:g} MiB) are "
            f"{'below' if chunk < nt else 'at or above'} it; one-copy baseline copies per process: {sizes}"
        )
    load_start = load_average()
    print(f"load average at start: {load_start:.2f}")
    results: dict[int, Any] = {}
    workload = dict(chunk_bytes=chunk, chunks=chunks, batch=args.batch, repeat=args.repeat, warmup=args.warmup)
    pool_args = ["--pool-pages", args.pool_pages] + (["--numa-node", args.numa_node] if args.numa_node else [])
    print(f"pool: {args.pool_pages} pages, NUMA {args.numa_node or 'unset'}")
    with Daemon(cpu_bytes, extra_args=pool_args) as daemon:
        print(f"daemon pid {daemon.pid} on {daemon.socket} (ready in {daemon.start_s:.2f}s)")
        cfg = {"socket": str(daemon.socket), **workload}
        for nprocs in procs:
            t0 = time.perf_counter()
            results[nprocs] = run_clients(nprocs, cfg, daemon)
            took = f"done in {time.perf_counter() - t0:.1f}s (buffer set-up {results[nprocs]['setup_s']:.1f}s)"
            print(f"  {nprocs} client process(es): {took}", flush=True)
        t0 = time.perf_counter()
        lookups = run_lookups(cfg, args.lookup_iters, warmup=max(50, args.lookup_iters // 10))
        print(f"  lookups: done in {time.perf_counter() - t0:.1f}s", flush=True)
        daemon_cpu = daemon.cpu_seconds()
        rc = daemon.stop()

    rows = [r for nprocs, s in results.items() for r in data_rows(nprocs, s, args.chunk_mib)] + lookup_rows(lookups)
    errors = [f"{n} proc(s): {e}" for n, s in results.items() for e in s["errors"]]
    print()
    print_table(rows, title="results (GiB/s: best and median repeat; ms: percentiles over all calls)")
    print_breakdown(results)
    load_end = load_average()
    memcpys = ", ".join(f"{s['phases']['memcpy']['best_gib_s']:.2f} GiB/s ({n}p)" for n, s in results.items())
    print(
        f"\nphysical limits (the baselines): one memcpy {memcpys}; an empty gRPC round trip "
        f"{lookups['empty_rtt']['p50_ms']:.3f} ms p50; load average {load_start:.2f} at start, {load_end:.2f} at end"
    )
    if max(load_start, load_end) > 1.0:
        print(f"\nWARNING: load average above 1 on {info['cpus']} CPUs: GiB/s and latencies are noisy")
    print(
        f"\n{sum(r.status == 'PASS' for r in rows)} PASS, {sum(r.status == 'MISS' for r in rows)} MISS; "
        f"daemon exit code {rc}, daemon CPU {daemon_cpu:.1f}s; total {time.perf_counter() - t_start:.1f}s"
    )
    if errors:
        print("ERRORS (results above are not valid):", *errors, sep="\n  ")
    if args.json:
        config = {"working_set_bytes": working_set, **workload, "procs": procs, "lookup_iters": args.lookup_iters}
        config |= {"cpu_bytes": cpu_bytes, "two_proc_split": "each process moves half the working set"}
        config |= {"gib_s_value": "best repeat"}
        config["targets"] = {"pool": POOL_TARGET, "region": REGION_TARGET, "lookup_256_p50": LOOKUP_TARGET}
        doc = {"benchmark": "local_path", "config": config, "machine": info, "rows": [r.to_json() for r in rows]}
        doc |= {"data_path": {str(k): v for k, v in results.items()}, "lookups": lookups, "errors": errors}
        doc |= {"load_average": {"start": load_start, "end": load_end}}
        doc |= {"daemon": {"exit_code": rc, "cpu_s": daemon_cpu}}
        write_json(args.json, doc | {"elapsed_s": time.perf_counter() - t_start})
        print(f"JSON written to {args.json}")
    return 1 if errors or rc not in (0, None) else 0
