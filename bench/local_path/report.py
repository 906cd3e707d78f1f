# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The local path's rows and its per-phase breakdown."""

from __future__ import annotations

import statistics
from typing import Any

from bench.lib.report import Row
from bench.local_path.clients import LOOKUP_KEYS, LOOKUP_TARGET, PHASES, POOL_TARGET, REGION_TARGET


def data_rows(nprocs: int, s: dict[str, Any], chunk_mib: float) -> list[Row]:
    ph = s["phases"]
    tag = f"{nprocs} proc" + ("s" if nprocs > 1 else "")
    base_name = f"memcpy {tag}"
    base = ph["memcpy"]["best_gib_s"]

    def row(phase: str, label: str, target: float | None) -> Row:
        median = ph[phase]["median_gib_s"]
        return Row(f"{label}, {tag}", ph[phase]["best_gib_s"], "GiB/s", base_name, base, target, median=median)

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
    """Where the time goes, per phase: wall and CPU of the best repeat, RPCs, and a CPU-based ratio.

    "cpu ratio" = memcpy CPU / (client + daemon CPU), each the median over the repeats: how many
    times more CPU the one-copy memcpy would need for the same bytes. Unlike GiB/s it hardly
    moves when other processes compete for the CPUs, so it is the steadier number on a busy box.
    """
    print(
        "\nbreakdown (wall and CPU of the best repeat; cpu ratio from the medians; client CPU summed over"
        " the client processes; daemon CPU over all its threads):"
    )
    print(
        f"  {'phase':<22} {'wall ms':>8} {'client cpu ms':>14} {'daemon cpu ms':>14} {'RPCs':>5} "
        f"{'wall/RPC ms':>12} {'cpu ratio':>10}"
    )
    for nprocs, s in results.items():

        def median_cpu(phase: str) -> float:
            return statistics.median(r["client_cpu_s"] + r["daemon_cpu_s"] for r in s["phases"][phase]["repeats"])  # noqa: B023 - called this iteration

        base_cpu = median_cpu("memcpy")
        for phase in PHASES:
            b = s["phases"][phase]["best_repeat"]
            rpcs = s["rpcs"].get(phase, 0)
            per = f"{b['wall_s'] * 1e3 / rpcs:.2f}" if rpcs else ""
            cpu_ratio = base_cpu / median_cpu(phase)
            s["phases"][phase]["cpu_ratio_vs_memcpy"] = cpu_ratio
            print(
                f"  {phase + f' ({nprocs}p)':<22} {b['wall_s'] * 1e3:8.1f} {b['client_cpu_s'] * 1e3:14.1f} "
                f"{b['daemon_cpu_s'] * 1e3:14.1f} {rpcs or '':>5} {per:>12} {cpu_ratio:9.2f}x"
            )
