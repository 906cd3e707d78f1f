# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The scale-out model's command line: `python -m bench.scale_out`."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from bench.lib.report import GIB, MIB, REPO, write_json
from bench.scale_out.designs import Model
from bench.scale_out.fleet import DEFAULT_CALIBRATION, S3_PREFIX_PUTS_PER_S, SECONDS_PER_MONTH, Budget, Costs, Fleet
from bench.scale_out.report import basis, plot, print_report, redis_fit, run, sensitivity

# Fleet fields whose flag has a handier unit: (the flag, its unit).
SCALED = {"chunk_bytes": ("--chunk-mib", MIB), "ram_bytes": ("--ram-gib", GIB), "fs_bytes": ("--fs-tib", 1 << 40)}


def parse_nodes(text: str) -> list[int]:
    nodes = sorted({int(x) for x in text.split(",") if x.strip()})
    if not nodes or nodes[0] < 1:
        raise argparse.ArgumentTypeError("node counts are positive integers")
    return nodes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.scale_out",
        description="Model a fleet of 1 to 1000 kvstored nodes (and on to --max-nodes) from the daemon's measured "
        "per-operation costs (bench/scale_calibrate.py; default the committed calibration): per node index memory, "
        "inbound event traffic and the CPU to apply it, lookup cost, S3 request rate and cost, for the mesh as built "
        "(every node follows every other), a node-level coalesced mesh, directory shards placed by rendezvous hashing, "
        "the fleet directory on a Redis Cluster as built (and the cluster it takes: masters, memory, ops/s) and "
        "router-based (llm-d consuming KV events); prints where each design exceeds the budget, writes the table as "
        "JSON (--json) and a plot (--plot).",
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
    stated = Fleet()
    for f in fields(Fleet):  # --x-y sets Fleet.x_y; its default and type: the field's
        default, text = getattr(stated, f.name), f.metadata["help"]
        if f.name == "s3_tier":
            p.add_argument("--no-s3", action="store_true", help=text)
        elif f.name in SCALED:
            flag, unit = SCALED[f.name]
            p.add_argument(flag, type=float, default=default / unit, help=text)
        else:
            p.add_argument("--" + f.name.replace("_", "-"), type=type(default), default=default, help=text)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cal_path = Path(args.calibration)
    if not cal_path.is_absolute() and not cal_path.exists():
        cal_path = REPO / cal_path
    calibration = json.loads(cal_path.read_text())
    fleet = Fleet(
        **{k: v for k, v in vars(args).items() if k in {f.name for f in fields(Fleet)}},
        **{field: int(getattr(args, flag[2:].replace("-", "_")) * unit) for field, (flag, unit) in SCALED.items()},
        s3_tier=not args.no_s3,
    )
    budget = Budget(args.cpu_budget, args.memory_budget_gib * GIB)
    costs = Costs.from_calibration(calibration)
    model = Model(fleet, budget, costs)
    machine, load = calibration.get("machine", {}), calibration.get("load_average", {})
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
        **run(model, args.nodes, args.max_nodes),
        "s3": {
            "puts_per_s_per_node": puts,
            "in_flight_puts": puts * costs.s3_put_s * fleet.chunks_per_put,  # a pack's PUT: its chunks' bytes
            "prefixes_at_1000": math.ceil(puts * 1000 / S3_PREFIX_PUTS_PER_S),
            "usd_per_month_at_1000": 1000 * puts * fleet.put_usd_per_1k / 1000 * SECONDS_PER_MONTH,
        },
        "sensitivity": sensitivity(fleet, budget, costs, args.max_nodes),
        "redis_fit": redis_fit(fleet, budget, costs),
    }
    print_report(doc, model)
    if args.json:
        write_json(args.json, doc)
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"wrote {args.plot}")
    return 0
