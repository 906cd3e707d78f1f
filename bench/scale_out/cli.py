# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The scale-out model's command line: `python -m bench.scale_out`."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.lib.report import GIB, MIB, REPO, write_json
from bench.scale_out.designs import Model
from bench.scale_out.fleet import DEFAULT_CALIBRATION, S3_PREFIX_PUTS_PER_S, SECONDS_PER_MONTH, Budget, Costs, Fleet
from bench.scale_out.report import basis, plot, print_report, run, sensitivity


def parse_nodes(text: str) -> list[int]:
    nodes = sorted({int(x) for x in text.split(",") if x.strip()})
    if not nodes or nodes[0] < 1:
        raise argparse.ArgumentTypeError("node counts are positive integers")
    return nodes


def build_parser() -> argparse.ArgumentParser:
    d = Fleet()
    p = argparse.ArgumentParser(
        prog="python -m bench.scale_out",
        description="Model a fleet of 1 to 1000 kvstored nodes (and on to --max-nodes) from the daemon's measured "
        "per-operation costs (bench/scale_calibrate.py; default the committed calibration): per node "
        "index memory, inbound event traffic and the CPU to apply it, lookup cost, S3 request rate and "
        "cost, for the mesh as built (every node follows every other), a node-level coalesced mesh, "
        "directory shards placed by rendezvous hashing and router-based (llm-d consuming KV events); "
        "prints where "
        "each design exceeds the budget, writes the table as JSON (--json) and a plot (--plot).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--calibration",
        default=str(DEFAULT_CALIBRATION.relative_to(REPO)),
        help="calibration JSON written by scale_calibrate.py (relative paths: to the working directory, "
        "else to the repository)",
    )
    p.add_argument("--json", help="write the table, the break points and every assumption here")
    p.add_argument("--plot", help="write the plot here (PNG; needs matplotlib)")
    p.add_argument("--nodes", type=parse_nodes, default=[1, 10, 100, 1000], help="node counts of the table")
    p.add_argument("--max-nodes", type=int, default=10_000, help="how far to look for break points (and to plot)")
    p.add_argument("--cpu-budget", type=float, default=0.10, help="index upkeep CPU per node, share of one core")
    p.add_argument("--memory-budget-gib", type=float, default=1.0, help="index and stream memory per node")
    p.add_argument("--turns-per-s", type=float, default=d.turns_per_s, help="turns per GPU node per second")
    p.add_argument("--first-tokens", type=int, default=d.first_tokens, help="tokens of a conversation's first prompt")
    p.add_argument("--turn-tokens", type=int, default=d.turn_tokens, help="tokens each later turn adds")
    p.add_argument("--turns", type=int, default=d.turns, help="turns per conversation")
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=d.kv_bytes_per_token,
        help="KV bytes per token (Qwen3.6-35B-A3B: 20,480; Llama-3.1-8B: 131,072)",
    )
    p.add_argument("--chunk-mib", type=float, default=d.chunk_bytes / MIB, help="chunk size")
    p.add_argument(
        "--kvstored-read-share",
        type=float,
        default=d.kvstored_read_share,
        help="share of a turn's reusable chunks loaded from kvstored (the GPU cache has the rest)",
    )
    p.add_argument(
        "--fs-read-share",
        type=float,
        default=d.fs_read_share,
        help="share of kvstored reads served by the node's own fs tier (each promotion is an event)",
    )
    p.add_argument(
        "--cross-node-share",
        type=float,
        default=d.cross_node_share,
        help="share of turns sent to a node other than the one holding the conversation",
    )
    p.add_argument(
        "--s3-read-share", type=float, default=d.s3_read_share, help="share of kvstored reads only S3 can serve"
    )
    p.add_argument("--ram-gib", type=float, default=d.ram_bytes / GIB, help="each node's RAM tier")
    p.add_argument("--fs-tib", type=float, default=d.fs_bytes / (1 << 40), help="each node's fs tier (0: not indexed)")
    p.add_argument("--no-s3", action="store_true", help="no S3 tier below the peers")
    p.add_argument(
        "--interval-s",
        type=float,
        default=d.interval_s,
        help="coalesced mesh, directory, router: one message per destination per interval",
    )
    p.add_argument(
        "--group-chunks",
        type=int,
        default=d.group_chunks,
        help="directory: consecutive chunks of a chain owned together",
    )
    p.add_argument("--replicas", type=int, default=d.replicas, help="directory: owners per chunk group")
    p.add_argument("--routers", type=int, default=d.routers, help="router: instances each node publishes to")
    p.add_argument("--put-usd-per-1k", type=float, default=d.put_usd_per_1k, help="S3 price per 1,000 PUTs")
    p.add_argument("--get-usd-per-1k", type=float, default=d.get_usd_per_1k, help="S3 price per 1,000 GETs")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cal_path = Path(args.calibration)
    if not cal_path.is_absolute() and not cal_path.exists():
        cal_path = REPO / cal_path
    calibration = json.loads(cal_path.read_text())
    fleet = Fleet(
        turns_per_s=args.turns_per_s,
        first_tokens=args.first_tokens,
        turn_tokens=args.turn_tokens,
        turns=args.turns,
        kv_bytes_per_token=args.kv_bytes_per_token,
        chunk_bytes=int(args.chunk_mib * MIB),
        kvstored_read_share=args.kvstored_read_share,
        fs_read_share=args.fs_read_share,
        cross_node_share=args.cross_node_share,
        s3_read_share=args.s3_read_share,
        ram_bytes=int(args.ram_gib * GIB),
        fs_bytes=int(args.fs_tib * (1 << 40)),
        s3_tier=not args.no_s3,
        interval_s=args.interval_s,
        group_chunks=args.group_chunks,
        replicas=args.replicas,
        routers=args.routers,
        put_usd_per_1k=args.put_usd_per_1k,
        get_usd_per_1k=args.get_usd_per_1k,
    )
    budget = Budget(args.cpu_budget, args.memory_budget_gib * GIB)
    costs = Costs.from_calibration(calibration)
    model = Model(fleet, budget, costs)
    machine = calibration.get("machine", {})
    load = calibration.get("load_average", {})
    result = run(model, args.nodes, args.max_nodes)
    puts = model.rates.s3_puts_per_s
    doc: dict[str, Any] = {
        "calibration": {
            "path": str(cal_path),
            "created": calibration.get("created"),
            "cpu_model": machine.get("cpu_model"),
            "cpus": machine.get("cpus"),
            "load_average": f"{load.get('start', ['?'])[0]}-{load.get('end', ['?'])[0]}",
        },
        "fleet": asdict(fleet),
        "budget": asdict(budget),
        "costs": asdict(costs),
        "rates": asdict(model.rates),
        "basis": [{"figure": a, "value": b, "basis": c} for a, b, c in basis(fleet, model.rates, costs)],
        "nodes": args.nodes,
        "max_nodes": args.max_nodes,
        **result,
        "s3": {
            "puts_per_s_per_node": puts,
            "in_flight_puts": puts * costs.s3_put_s,
            "prefixes_at_1000": math.ceil(puts * 1000 / S3_PREFIX_PUTS_PER_S),
            "usd_per_month_at_1000": 1000 * puts * fleet.put_usd_per_1k / 1000 * SECONDS_PER_MONTH,
        },
        "sensitivity": sensitivity(fleet, budget, costs, args.max_nodes),
    }
    print_report(doc, model)
    if args.json:
        write_json(args.json, doc)
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"wrote {args.plot}")
    return 0
