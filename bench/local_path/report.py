# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The local path's rows and its per-phase breakdown."""

from __future__ import annotations

import statistics
from typing import Any

from bench.lib.report import (
    Row,
)
from bench.local_path.clients import LOOKUP_KEYS, LOOKUP_TARGET, PHASES, POOL_TARGET, REGION_TARGET


def data_rows(nprocs: int, s: dict[str, Any], chunk_mib: float) -> list[Row]:
    ph = s["phases"]
    tag = f"{nprocs} proc" + ("s" if nprocs > 1 else "")
    base_name = f"memcpy {tag}"
    base = ph["memcpy"]["best_gib_s"]

    def row(phase: str, label: str, target: float | None, note: str = "") -> Row:
        return Row(
            f"{label}, {tag}",
            ph[phase]["best_gib_s"],
            "GiB/s",
            base_name,
            base,
            target,
            median=ph[phase]["median_gib_s"],
            note=note,
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
        Row(
            f"Client.lookup {LOOKUP_KEYS} keys p50",
            lk["lookup_256"]["p50_ms"],
            "ms",
            f"{h} p50",
            e50,
            LOOKUP_TARGET,
            higher_is_better=False,
        ),
        Row(
            f"Client.lookup {LOOKUP_KEYS} keys p99",
            lk["lookup_256"]["p99_ms"],
            "ms",
            f"{h} p99",
            e99,
            higher_is_better=False,
        ),
        Row(
            f"raw stub Lookup {LOOKUP_KEYS} keys p50 [diag]",
            lk["raw_lookup_256"]["p50_ms"],
            "ms",
            f"{h} p50",
            e50,
            higher_is_better=False,
        ),
    ]


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
