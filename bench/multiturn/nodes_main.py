# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The multi-node mode's main (`python -m bench.multiturn --nodes N`, N >= 2): the plan, the sweep
over its set-ups (and with --route kv a second one), the report and the JSON."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.report import fmt_bytes, load_average, machine_info
from bench.multiturn.kvroute import ROUTING as KV_ROUTING
from bench.multiturn.limits import Limits, measure_limits
from bench.multiturn.model import MODELS, Model, Sizes, Workload
from bench.multiturn.nodes import (
    CONFIG_BY_KEY,
    CONFIG_KEYS,
    CONFIGS,
    DIRECTORY_KEYS,
    DIRECTORY_OPTIONS,
    ROUTING,
    NodesConfig,
)
from bench.multiturn.nodes_report import NODES, bound_lines, daemon_lines, gate_line, progress, route_lines, target_rows
from bench.multiturn.nodes_run import NodesRunResult, measure_raw_tcp, run_one
from bench.multiturn.plan import (
    command_line,
    model_doc,
    parse_counts,
    print_targets,
    section,
    select_configs,
    setup,
    start_sweep_s3,
    sweep,
    targets,
    write_outputs,
)
from bench.multiturn.report import (
    cost_lines,
    limit_lines,
    load_summary,
    model_lines,
    print_results,
    scaling_lines,
)
from tests.support.redis_cluster import RedisCluster

DIRECTORY_CLUSTER = "a real Redis Cluster, 3 masters and 3 replicas on loopback (tests/support/redis_cluster.py)"

MEASURED = [
    "hit rates per tier: each node's Lookup, tier per key, and what its loads returned (checked bytes)",
    "load and store times of the real daemons (client side), their Stats and Peer Status counters",
    "physical limits: memcpy, raw O_DIRECT, raw GET, raw TCP on loopback; the load average",
]
MODELLED = [
    "each node's GPU: prefix cache, prefill rate, loader beside it (multiturn's model, printed with its basis)",
    "throughput, time to first token, busy shares: on the model clock, charged the measured load costs x the "
    "byte scale",
]


def main(ap: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    default = DIRECTORY_KEYS if args.directory else CONFIG_KEYS
    configs = select_configs(ap, args.configs, default, CONFIG_BY_KEY, "set-up(s) {bad} with --nodes")
    if args.settle_s < 0:
        ap.error("--settle-s must not be negative")
    n = args.nodes
    w, m, basis, derivation, sizes, sizes_conv = setup(ap, args)
    m = replace(m, register_rates=args.register_rates)
    counts = parse_counts(args.conversations)
    workdir = Path(args.workdir)

    info = machine_info()
    load_start = load_average()
    print(
        f"kvstored multi-turn benchmark, {n} nodes -- {info['cpu_model']}, {info['cpus']} CPUs, "
        f"{info['mem_total_gib']} GiB, kernel {info['kernel']}, git {info['git']}, load average {load_start:.2f}"
    )
    print(f"  routing: {ROUTING}; each node: its own modelled GPU and loader, its own daemon")
    if any(c.directory for c in configs):
        print(f"  directory: {DIRECTORY_CLUSTER}; daemons with no static peers; {DIRECTORY_OPTIONS}")
    scale = scaling_lines(w, m, sizes, args.ram_conversations, args.fs_conversations, args.s3_fs_conversations)
    scale[-1] = "per node: " + scale[-1]
    scale.append(
        f"set-ups: {'; '.join(f'{c.label} ({c.key}: ' + ' -> '.join(c.tiers) + ')' for c in configs)}; "
        f"peers over {args.peer_transport} on loopback; shared S3 with write-through; stores settle "
        f">= {args.settle_s:g} s of wall time before a conversation's next turn looks them up"
    )
    scale.append(gate_line(m))
    for line in model_lines(m, basis) + scale:
        print("  " + line)
    print(f"  measured: {'; '.join(MEASURED)}\n  modelled: {'; '.join(MODELLED)}", flush=True)

    doc: dict[str, Any] = {
        "benchmark": "multiturn-nodes",
        "command": command_line(argv),
        "machine": info,
        "nodes": n,
        "routing": ROUTING,
        "workload": asdict(w),
        "model": model_doc(m, MODELS[args.model], derivation, basis),
        "configs": [
            {
                "key": c.key,
                "label": c.label,
                "tiers": list(c.tiers),
                "write_through": c.write_through,
                "directory": c.directory,
                "pooled": c.pooled,
            }
            for c in configs
        ],
        "sizes_per_node": asdict(sizes),
        "sizes_in_conversations": sizes_conv,
        "scaling": scale,
        "measured": MEASURED,
        "modelled": MODELLED,
        "peer_transport": args.peer_transport,
        "settle_s": args.settle_s,
        "directory": DIRECTORY_CLUSTER if any(c.directory for c in configs) else "",
        "registered_prefill_tokens_per_s": m.gate_prefill_tokens_per_s,
    }
    if args.dry_run:
        write_outputs(doc, args.json, None)
        return 0

    workdir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(RedisCluster()).url if any(c.directory for c in configs) else ""
        return _run(args, doc, configs, n, w, m, sizes, counts, workdir, directory, load_start, info)


def _run(
    args: argparse.Namespace,
    doc: dict[str, Any],
    configs: Sequence[NodesConfig],
    n: int,
    w: Workload,
    m: Model,
    sizes: Sizes,
    counts: Sequence[int],
    workdir: Path,
    directory: str,
    load_start: float,
    info: dict[str, Any],
) -> int:
    # write-through puts every chunk of the largest run in radosgw's memstore (RAM)
    s3, s3_note = start_sweep_s3(args.s3, configs, counts, w, m, "moto_server", "shared S3 skipped")
    limits = Limits()
    raw_tcp: list[float] = []
    chunk_bytes = w.chunk_tokens * m.kv_bytes_per_token
    batch = w.final_tokens // w.chunk_tokens

    def measure() -> None:
        measure_limits(limits, workdir, chunk_bytes, batch, s3)
        got, note = measure_raw_tcp(chunk_bytes)
        raw_tcp.extend(got)
        if note:
            limits.notes.append(note)

    results, total_s = sweep(
        counts,
        configs,
        s3,
        s3_note,
        lambda c, count: run_one(
            c, count, n, w, m, sizes, workdir, s3, args.peer_transport, args.settle_s, directory=directory
        ),
        lambda c, count, note: NodesRunResult(c.key, count, nodes=n, skipped=note),
        progress,
        None if args.no_limits else measure,
        max(len(c.label) for c in CONFIG_BY_KEY.values()),
    )
    kv_results: list[NodesRunResult] = []
    if args.route == "kv":
        kv_results, kv_s = sweep(
            counts,
            [c for c in configs if c.offload],
            s3,
            s3_note,
            lambda c, count: run_one(c, count, n, w, m, sizes, workdir, s3, args.peer_transport, args.settle_s, "kv"),
            lambda c, count, note: NodesRunResult(c.key, count, nodes=n, skipped=note, route="kv"),
            lambda r: f"KV-routed: hit {100 * r.hit_rate_overall:.1f}%  {r.throughput_tokens_s:,.0f} tokens/s",
            None,
            max(len(c.label) for c in CONFIG_BY_KEY.values()),
        )
        total_s += kv_s
    load = load_summary(results + kv_results, load_start, load_average())

    print()
    print_results(results, NODES)
    section(
        "daemon counters per run (Stats deltas and Peer Status, summed over the nodes; bytes are the scaled bytes):",
        daemon_lines(results),
    )
    tcp = (
        f"{np.median(raw_tcp):.2f} GiB/s (median of {len(raw_tcp)}; {min(raw_tcp):.2f}-{max(raw_tcp):.2f})"
        if raw_tcp
        else "not measured"
    )
    section(
        "physical limits of this machine (measured at the start and at the end of the sweep):",
        limit_lines(limits)
        + [f"raw TCP on loopback, {fmt_bytes(chunk_bytes)} chunks into 16 slots (bench/lib/raw_net.py): {tcp}"],
    )
    costs = cost_lines(results, m, limits, CONFIGS, raw_tcp)
    section("cost of a token loaded from each tier (marginal rate, at the largest count measured):", costs)
    bounds = bound_lines(results, m)
    section("where the modelled time went at the largest count:", bounds)
    if kv_results:
        section(f"routing: round robin vs {KV_ROUTING}:", route_lines(results, kv_results))
    print()
    rows = target_rows(results, m, limits, raw_tcp, n)
    print_targets(rows, f"{m.model_name}, {n} nodes", load, info["cpus"], total_s)

    doc.update(
        {
            "s3_server": s3_note,
            "results": [asdict(r) for r in results],
            "kv_results": [asdict(r) for r in kv_results],
            "rows": rows,
            "targets": targets(rows),
            "limits": {**limits.to_json(), "raw_tcp": raw_tcp},
            "tier_costs": costs,
            "bounds": bounds,
            "load_average": load,
            "sweep_s": total_s,
        }
    )
    write_outputs(doc, args.json, args.plot)
    return 0
