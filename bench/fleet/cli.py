# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fleet bench's command line: `python -m bench.fleet` (root: network namespaces)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.fleet.run import SETUPS, Load, NodeFigures, RunResult, sweep
from bench.lib.report import MIB, machine_info, print_aligned, write_json
from bench.plot import plot_fleet
from bench.scale_out.cli import parse_nodes
from bench.scale_out.fleet import DEFAULT_CALIBRATION, Costs

TARGET_GROWTH = 1.10  # the directory's per-node costs from N=2 to the largest N, at most
GROWTH = ("cpu_s_per_s", "rss_anon_bytes", "upkeep_rx_bytes_per_s")  # the figures held to it


def build_parser() -> argparse.ArgumentParser:
    d = Load()
    p = argparse.ArgumentParser(
        prog="python -m bench.fleet",
        description="Run N real kvstored daemons, each in a network namespace, under the same bounded load per "
        "node (one client per node: stores and lookups at a fixed rate, RAM and fs full), for the mesh "
        "(static peers, every node follows every other) and for the fleet directory (a real Redis Cluster, "
        "3 masters with replicas, no static peers); print per-node upkeep CPU (s/s), RSS and bytes in per "
        "second against N, Redis's own CPU and memory, the directory's growth from the smallest to the "
        "largest N (target <= 1.10x) and the mesh beside bench.scale_out's model. Needs root.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nodes", type=parse_nodes, default=[2, 4, 8, 16], help="node counts")
    setups_help = "of mesh, directory, islands (no peer tier: how much the machine alone drifts with N)"
    p.add_argument("--setups", default="mesh,directory", help=setups_help)
    p.add_argument("--turns-per-s", type=float, default=d.turns_per_s, help="turns per node per second")
    p.add_argument("--chunks", type=int, default=d.chunks, help="chunks stored per turn")
    p.add_argument("--chunk-kib", type=int, default=d.chunk_bytes >> 10, help="chunk size")
    p.add_argument("--ram", default=d.ram, help="each daemon's RAM tier (MiB)")
    p.add_argument("--fs-mib", type=int, default=d.fs_bytes >> 20, help="each daemon's fs tier")
    p.add_argument("--warm-s", type=float, default=d.warm_s, help="load before the window")
    p.add_argument("--window-s", type=float, default=d.window_s, help="the measured window")
    p.add_argument("--repeats", type=int, default=1, help="passes over every (set-up, N); the table shows medians")
    p.add_argument("--calibration", default=str(DEFAULT_CALIBRATION), help="scale_calibrate's JSON (the mesh's model)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write the plot here (PNG; needs matplotlib)")
    p.add_argument("--from-json", help="draw --plot from this earlier run's --json instead of running")
    return p


COUNTS = ("directory_failures", "turns", "late_turns")  # a node's counts over the window (not per-node means)
FIGURES = [f.name for f in fields(NodeFigures) if f.name not in COUNTS]  # the rest: its rates and heap


def medians(results: list[RunResult]) -> list[dict[str, Any]]:
    """Per (set-up, N): the median over the passes of each per-node mean, and of Redis's figures."""
    groups: dict[tuple[str, int], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.setup, r.nodes), []).append(r)
    out = []
    for (setup, n), rs in groups.items():
        row: dict[str, Any] = {"setup": setup, "nodes": n, "passes": len(rs)}
        row |= {k: statistics.median(r.mean(k) for r in rs) for k in FIGURES}
        row["cpu_s_per_s_max"] = statistics.median(r.max("cpu_s_per_s") for r in rs)
        row["cpu_s_per_s_passes"] = [r.mean("cpu_s_per_s") for r in rs]
        for k in ("redis_cpu_s_per_s", "redis_rss_bytes", "redis_used_memory_bytes", "redis_keys"):
            row[k] = statistics.median(getattr(r, k) for r in rs)
        row["directory_failures"] = sum(x.directory_failures for r in rs for x in r.per_node)
        row["turns_per_s"] = statistics.median(sum(x.turns for x in r.per_node) / r.window_s / n for r in rs)
        row["late_turns"] = sum(x.late_turns for r in rs for x in r.per_node)
        row["load_average"] = [r.load_average[0] for r in rs]
        out.append(row)
    return out


def mesh_model(table: list[dict[str, Any]], costs: Costs, load: Load) -> None:
    """bench.scale_out's coalesced mesh at this run's rates, into the mesh's rows: the smallest N's CPU
    plus, per further peer, following and publishing to it (its messages as measured, 3 net changes per
    chunk stored) and its quiet streams."""
    mesh = sorted((r for r in table if r["setup"] == "mesh"), key=lambda r: r["nodes"])
    if not mesh:
        return
    base = mesh[0]
    keys = 3 * load.chunks * load.turns_per_s
    for r in mesh:
        messages = r["messages_per_s"] / (r["nodes"] - 1)
        per_peer = (
            messages * (costs.follow_s_per_event + costs.publish_s_per_event)
            + keys * (costs.follow_s_per_key + costs.publish_s_per_key)
            + costs.stream_idle_s_per_s
        )
        r["model_cpu_s_per_s"] = base["cpu_s_per_s"] + (r["nodes"] - base["nodes"]) * per_peer


def rows(results: list[RunResult], costs: Costs, load: Load) -> list[dict[str, Any]]:
    table = sorted(medians(results), key=lambda r: (SETUPS.index(r["setup"]), r["nodes"]))
    mesh_model(table, costs, load)
    first: dict[str, dict[str, Any]] = {}
    for row in table:  # (sorted by N within a set-up)
        f = first.setdefault(row["setup"], row)
        row["growth"] = {k: row[k] / f[k] if f[k] else None for k in GROWTH}
        row["redis_cpu_s_per_s_per_node"] = row["redis_cpu_s_per_s"] / row["nodes"]
        if row["setup"] == "directory":
            commands = row["nodes"] * (row["directory_commands_per_s"] + row["directory_lookups_per_s"])
            row["redis_cpu_s_per_command"] = row["redis_cpu_s_per_s"] / commands if commands else None
    return table


COLUMNS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [  # (header, a row's cell)
    ("set-up", lambda r: r["setup"]),
    ("N", lambda r: str(r["nodes"])),
    ("CPU s/s per node", lambda r: f"{r['cpu_s_per_s']:.4f} (max {r['cpu_s_per_s_max']:.4f})"),
    ("x N=min", lambda r: f"{r['growth']['cpu_s_per_s']:.2f}"),
    ("model", lambda r: f"{r['model_cpu_s_per_s']:.4f}" if "model_cpu_s_per_s" in r else ""),
    ("RSS MiB", lambda r: f"{r['rss_anon_bytes'] / MIB:.1f}"),
    ("x", lambda r: f"{r['growth']['rss_anon_bytes']:.2f}"),
    ("in KiB/s (upkeep)", lambda r: f"{r['rx_bytes_per_s'] / 1024:.1f} ({r['upkeep_rx_bytes_per_s'] / 1024:.1f})"),
    ("x", lambda r: f"{g:.2f}" if (g := r["growth"]["upkeep_rx_bytes_per_s"]) else ""),
    ("msgs/s", lambda r: f"{r['messages_per_s']:.1f}"),
    ("dir lookups/s", lambda r: f"{r['directory_lookups_per_s']:.2f}"),
    ("dir cmds/s", lambda r: f"{r['directory_commands_per_s']:.1f}"),
    ("Redis CPU s/s", lambda r: f"{r['redis_cpu_s_per_s']:.4f}" if r["setup"] == "directory" else ""),
    ("Redis mem MiB", lambda r: f"{r['redis_used_memory_bytes'] / MIB:.1f}" if r["setup"] == "directory" else ""),
    ("turns/s", lambda r: f"{r['turns_per_s']:.2f}"),
]


def print_table(table: list[dict[str, Any]]) -> None:
    lines = [[header for header, _ in COLUMNS], *[[cell(row) for _, cell in COLUMNS] for row in table]]
    print_aligned(lines, right=set(range(1, len(COLUMNS))))


def verdict(table: list[dict[str, Any]]) -> list[str]:
    out = []
    directory = sorted((r for r in table if r["setup"] == "directory"), key=lambda r: r["nodes"])
    if len(directory) > 1:
        first, last = directory[0], directory[-1]
        for key, label in zip(GROWTH, ("CPU", "RSS", "control bytes in")):
            ratio = last["growth"][key]
            ok = ratio is not None and ratio <= TARGET_GROWTH
            out.append(
                f"directory {label} per node, {first['nodes']} -> {last['nodes']} nodes: "
                f"{ratio:.2f}x (target <= {TARGET_GROWTH:.2f}x: {'met' if ok else 'NOT met'})"
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json:
        if not args.plot:
            raise SystemExit("--from-json needs --plot")
        plot_fleet(json.loads(Path(args.from_json).read_text()), args.plot)
        print(f"wrote {args.plot}")
        return 0
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if bad := [s for s in setups if s not in SETUPS]:
        raise SystemExit(f"--setups: unknown {bad}; choose from {', '.join(SETUPS)}")
    if os.geteuid() != 0:
        raise SystemExit("bench.fleet needs root (network namespaces)")
    load = Load(
        **{k: getattr(args, k) for k in ("turns_per_s", "chunks", "ram", "warm_s", "window_s")},
        chunk_bytes=args.chunk_kib << 10,
        fs_bytes=args.fs_mib << 20,
    )
    started = datetime.now(UTC).isoformat(timespec="seconds")
    results = sweep(setups, args.nodes, load, args.repeats)
    costs = Costs.from_calibration(json.loads(Path(args.calibration).read_text()))
    table = rows(results, costs, load)
    doc: dict[str, Any] = {"schema": 1, "created": started, "machine": machine_info(), "load": asdict(load)}
    doc |= {"rows": table, "runs": [asdict(r) for r in results], "verdict": verdict(table)}
    print()
    print_table(table)
    for line in doc["verdict"]:
        print(line)
    if args.json:
        write_json(args.json, doc)
        print(f"wrote {args.json}")
    if args.plot:
        plot_fleet(doc, args.plot)
        print(f"wrote {args.plot}")
    return 0
