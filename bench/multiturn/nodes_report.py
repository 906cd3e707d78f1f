# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What the multi-node mode prints and writes, and its main (`python -m bench.multiturn --nodes N`)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.report import GIB, fmt_bytes, load_average, machine_info, write_json
from bench.multiturn.kvroute import ROUTING as KV_ROUTING
from bench.multiturn.limits import Limits, measure_limits
from bench.multiturn.model import MODELS, TARGET_HIT, Model, Sizes, Workload
from bench.multiturn.nodes import (
    CONFIG_BY_KEY,
    CONFIG_KEYS,
    CONFIGS,
    DIRECTORY_KEYS,
    DIRECTORY_OPTIONS,
    LABELS,
    LOADED_TIERS,
    NODE_TIERS,
    ROUTING,
    TARGET_HIT_POINTS,
    TARGET_VS_ISLANDS,
    NodesConfig,
)
from bench.multiturn.nodes_run import NodesRunResult, measure_raw_tcp, run_one
from bench.multiturn.plan import (
    command_line,
    model_doc,
    parse_counts,
    section,
    setup,
    start_sweep_s3,
    sweep,
    targets,
    write_outputs,
)
from bench.multiturn.report import (
    Layout,
    TargetRows,
    cost_lines,
    limit_lines,
    load_summary,
    model_lines,
    print_results,
    print_rows,
    raw_limit,
    scaling_lines,
)
from tests.support.redis_cluster import RedisCluster

DIRECTORY_CLUSTER = "a real Redis Cluster, 3 masters and 3 replicas on loopback (tests/support/redis_cluster.py)"

# -- reporting --------------------------------------------------------------------------------------


NODES = Layout(
    LABELS,
    NODE_TIERS,
    "set-up",
    "measured: hit rates (each node's Lookup, tier per key), GiB/s (the load calls; marginal: median per-byte "
    "cost with the fixed call cost removed, what the model charges x the byte scale); modelled: tokens/s, "
    "TTFT, busy (GPU and loader: means over the nodes)",
    loaded_column=False,
    gib_right=False,
    skip_reason=True,
)


def progress(r: NodesRunResult) -> str:
    """One run's line as the sweep goes."""
    skipped = sum(r.gate_skipped.values())
    return (
        f"hit {100 * r.hit_rate_overall:.1f}% (peer {100 * r.hit_rate['peer']:.1f}%"
        + (f"; {100 * skipped:.1f}% skipped as slower than recomputing" if skipped else "")
        + f")  {r.throughput_tokens_s:,.0f} tokens/s  wall {r.wall_s:.1f} s  load {r.load_average[1]:.1f}"
    )


def gate_line(m: Model) -> str:
    """What the daemons are told about recomputing (--register-rates)."""
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    if not m.register_rates:
        return (
            "recompute gate: no prefill rate registered (every hit counts, whatever it costs to load; "
            f"--register-rates registers it: break-even {breakeven:.2f} GiB/s)"
        )
    return (
        f"recompute gate: every node's namespace registers {m.gate_prefill_tokens_per_s:,.0f} prefill tokens/s of "
        f"{m.kv_bytes_per_token} real bytes (the model's {m.prefill_tokens_per_s:,.0f} x "
        f"{m.model_kv_bytes_per_token:,} bytes: break-even {breakeven:.2f} GiB/s), so a daemon reports a hit "
        "below RAM (fs, peer) only where its measured load rate and queue beat recomputing"
    )


def route_lines(rr: Sequence[NodesRunResult], kv: Sequence[NodesRunResult]) -> list[str]:
    """Each set-up at each count, both routings: hit rates per tier, peer fetches, throughput."""
    by_key = {(r.config, r.conversations): r for r in rr}
    lines = []
    for k in kv:
        r = by_key.get((k.config, k.conversations))
        if r is None or r.skipped or k.skipped:
            lines.append(
                f"{LABELS[k.config]}, {k.conversations} conversations: skipped ({k.skipped or r and r.skipped})"
            )
            continue
        for name, x in (("round robin", r), ("KV-aware", k)):
            tiers = "  ".join(f"{t} {100 * x.hit_rate.get(t, 0.0):.1f}%" for t in NODE_TIERS)
            lines.append(
                f"{LABELS[k.config]}, {k.conversations} conversations, {name:<11}: hit {100 * x.hit_rate_overall:.1f}% "
                f"({tiers}); peer fetches {x.peers.get('fetches', 0)} ({x.peers.get('received_chunks', 0)} chunks); "
                f"{x.throughput_tokens_s:,.0f} tokens/s"
                + (f"; {x.kv_routed} turns routed off round robin" if x.route == "kv" else "")
            )
    return lines


def daemon_lines(results: Sequence[NodesRunResult]) -> list[str]:
    lines = []
    for r in results:
        if r.skipped or not r.daemon:
            continue
        parts = []
        for name, d in r.daemon.items():
            extra = [
                f"{k} {d[k]}"
                for k in (
                    "dropped_dirty",
                    "dropped_backpressure",
                    "errors",
                    "checksum_failures",
                    "rejected_full",
                    "skipped_slow_hits",
                    "skipped_slow_writedowns",
                    "rate_probes",
                )
                if d.get(k)
            ]
            if name == "ram":
                parts.append(
                    f"ram: {d['loaded_chunks']} leased, {d['stored_chunks']} stored, promotions "
                    f"{d['promotions']}, write-downs {d['writedowns']}, evictions {d['evictions']}"
                    + "".join(f", {e}" for e in extra)
                )
            else:  # (the load rate each daemon measured, which its recompute gate goes by: their mean)
                rate = d.get("load_bytes_per_s", 0)
                extra += [f"load rate measured by the daemons {rate / GIB:.2f} GiB/s"] if rate else []
                written = f" written {fmt_bytes(d['written_bytes'])}" if name != "peer" else ""
                parts.append(f"{name}: read {fmt_bytes(d['read_bytes'])}{written}" + "".join(f", {e}" for e in extra))
        if r.peers:
            p = r.peers
            parts.append(
                f"peers: {p['fetches']} fetches, {p['received_chunks']} chunks in "
                f"({fmt_bytes(p['received_bytes'])}), served {p['served_chunks']}, missing "
                f"{p['missing_chunks']}, failed {p['failed_chunks']}, timed out {p['timed_out_chunks']}, "
                f"breaker refusals {p['refused_by_breaker']}, resyncs {p['resyncs']}"
            )
        if r.slow_gib_s:
            parts.append(
                "load calls' marginal GiB/s median / slowest decile: "
                + ", ".join(
                    f"{t} {r.marginal_gib_s.get(t, 0):.2f} / {r.slow_gib_s[t]:.2f}"
                    for t in LOADED_TIERS
                    if t in r.slow_gib_s
                )
            )
        st, se = r.store, r.settle
        lines.append(
            f"{LABELS[r.config]:>20} {r.conversations:>4}: "
            + "; ".join(parts)
            + f" | client stores {st['stored']} new, {st['already_present']} present, {st['dropped']} dropped"
            f" | lookup p50 {r.lookup_ms_p50:.2f} ms (floor {r.lookup_floor_ms:.2f}; {r.lookup_moved_s:.1f} s "
            f"moved to fs/peer loads), call floor {r.load_call_floor_ms:.2f} ms x {r.load_calls}"
            f" | settled {se['waits']} turns, {se['seconds']:.1f} s"
            + (f", {se['s3_timeouts']} S3 waits gave up" if se["s3_timeouts"] else "")
            + (f" | {r.load_shortfall_chunks} chunks gone between lookup and load" if r.load_shortfall_chunks else "")
            + (f" | CORRUPT {r.corrupt_chunks}" if r.corrupt_chunks else "")
        )
    return lines


def _limit(r: NodesRunResult, tier: str, limits: Limits, raw_tcp: Sequence[float], breakeven: float) -> str:
    name, rate = raw_limit(limits, tier, raw_tcp)
    got = (
        f"{tier} loads {r.load_gib_s[tier]:.2f} GiB/s all-in, "
        + (f"{r.marginal_gib_s[tier]:.2f} marginal" if tier in r.marginal_gib_s else "fixed cost only")
        if tier in r.load_gib_s
        else f"no {tier} loads"
    )
    daemons = r.daemon_gib_s.get(tier)
    return (
        got
        + (f" vs {name} {rate:.2f}" if rate else "")
        + (f"; the daemons measured {daemons:.2f}" if daemons else "")
        + (f", {100 * r.gate_skipped[tier]:.1f}% of reusable tokens skipped" if tier in r.gate_skipped else "")
        + f"; break-even {breakeven:.2f}; loader busy {100 * r.loader_busy:.0f}%, GPU {100 * r.gpu_busy:.0f}%"
    )


def target_rows(
    results: Sequence[NodesRunResult], m: Model, limits: Limits, raw_tcp: Sequence[float], n: int
) -> TargetRows:
    """The targets at the largest count and the informational ratios."""
    rows = TargetRows()
    runs = {(r.config, r.conversations): r for r in results if not r.skipped}
    counts = sorted({r.conversations for r in results})
    if not counts:
        return rows
    top = counts[-1]
    none, islands, peers, s3 = (runs.get((c, top)) for c in CONFIG_KEYS)
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    where = f"{n} nodes, {top} conversations"
    if peers is not None:
        p = peers.peers
        lost = f"missing {p.get('missing_chunks', 0)}, failed {p.get('failed_chunks', 0)}, timed out "
        lost += f"{p.get('timed_out_chunks', 0)}"
        limit = f"peer {100 * peers.hit_rate['peer']:.0f}% of reusable tokens; {lost}"
        rows.add(
            f"peers: hit rate, {where}", peers.hit_rate_overall, "share", "all reusable tokens", 1.0, TARGET_HIT, limit
        )
        peer_limit = _limit(peers, "peer", limits, raw_tcp, breakeven)
        if islands is not None:
            cap = islands.makespan_s / peers.think_floor_s  # no makespan is shorter than the think floor
            limit = (
                peer_limit + f"; makespan {peers.makespan_s:,.0f} s, the conversations' own start and think times "
                f"{peers.think_floor_s:,.0f} s: at most {cap:.2f}x"
            )
            rows.vs(f"peers vs islands (no peers), {where}", peers, "islands", islands, TARGET_VS_ISLANDS, limit)
        if none is not None:
            rows.vs(f"peers vs no offload, {where}", peers, "no offload", none, None, peer_limit)
    fleet, pooled = runs.get(("ram+fs+dir", top)), runs.get(("pooled", top))
    if fleet is not None and pooled is not None:
        # found: the hits, and those the recompute gate answered as misses (none without --register-rates)
        gap = 100 * (pooled.found_rate - fleet.found_rate)
        gated = "".join(
            f"; {name} served {100 * r.hit_rate_overall:.1f}%, {100 * sum(r.gate_skipped.values()):.1f}% skipped "
            "as slower than recomputing"
            for name, r in (("directory", fleet), ("one node", pooled))
            if r.gate_skipped
        )
        rows.add(
            f"directory: hit rate vs one node with the fleet's RAM + fs, {where}",
            fleet.found_rate,
            "share",
            f"that node's, less {TARGET_HIT_POINTS:g} points",
            pooled.found_rate - TARGET_HIT_POINTS / 100,
            1.0,
            f"{gap:.1f} points below it (directory {100 * fleet.found_rate:.1f}%, one node "
            f"{100 * pooled.found_rate:.1f}%); peer {100 * fleet.hit_rate['peer']:.0f}% of reusable tokens" + gated,
        )
    if fleet is not None and islands is not None:
        cap = islands.makespan_s / fleet.think_floor_s
        limit = _limit(fleet, "peer", limits, raw_tcp, breakeven) + f"; think time caps it at {cap:.2f}x"
        rows.vs(f"directory vs islands (no peers), {where}", fleet, "islands", islands, TARGET_VS_ISLANDS, limit)
    if fleet is not None and pooled is not None:
        limit = "the same hits from one store: what reaching them on other nodes costs"
        rows.vs(f"directory vs one node with the fleet's RAM + fs, {where}", fleet, "one node", pooled, None, limit)
    if islands is not None and none is not None:
        limit = f"hit rate {100 * islands.hit_rate_overall:.0f}%; " + _limit(islands, "fs", limits, raw_tcp, breakeven)
        rows.vs(f"islands vs no offload, {where}", islands, "no offload", none, None, limit)
    if s3 is not None and none is not None:
        limit = f"hit rate {100 * s3.hit_rate_overall:.0f}%; " + _limit(s3, "s3", limits, raw_tcp, breakeven)
        rows.vs(f"shared S3 vs no offload, {where}", s3, "no offload", none, None, limit)
    if peers is not None and s3 is not None:
        limit = "the faster of the two ways to reach another node's chunks"
        rows.vs(f"peers vs shared S3, {where}", peers, "shared S3", s3, None, limit)
    for tier, r in (("peer", peers or fleet), ("fs", islands), ("s3", s3)):
        label = f"{LABELS[r.config]}, {top}" if r is not None else ""
        rows.loads(tier, r, label, raw_limit(limits, tier, raw_tcp), "what the model charges", breakeven)
    return rows


def bound_lines(results: Sequence[NodesRunResult], m: Model) -> list[str]:
    """Where the modelled time went at the largest count, per set-up with offload."""
    counts = sorted({r.conversations for r in results})
    lines = []
    for r in results:
        if r.skipped or r.conversations != counts[-1] or r.config == "none":
            continue
        full = {t: r.loaded_bytes.get(t, 0) * m.byte_scale for t in LOADED_TIERS}
        lines.append(
            f"{LABELS[r.config]}: makespan {r.makespan_s:,.0f} modelled s (think floor "
            f"{r.think_floor_s:,.0f}); per node GPU busy {100 * r.gpu_busy:.0f}%, loader "
            f"{100 * r.loader_busy:.0f}%; loaded at full size: "
            + ", ".join(f"{t} {fmt_bytes(v)}" for t, v in full.items() if v)
            + f"; recomputed {100 * (1 - r.hit_rate_overall):.0f}% of the reusable tokens"
        )
    return lines


# -- main (called by bench/multiturn.py with --nodes N >= 2) ---------------------------------------


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
    keys = [c.strip() for c in (args.configs or ",".join(default)).split(",") if c.strip()]
    bad = [c for c in keys if c not in CONFIG_BY_KEY]
    if bad:
        ap.error(f"unknown set-up(s) {bad} with --nodes; choose among {', '.join(CONFIG_BY_KEY)}")
    if args.settle_s < 0:
        ap.error("--settle-s must not be negative")
    configs = [CONFIG_BY_KEY[c] for c in keys]
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
        if args.json:
            write_json(args.json, doc)
            print(f"JSON written to {args.json}")
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
    print(
        f"targets and ratios ({m.model_name}, {n} nodes; load average over the sweep {load['min']:.1f}-"
        f"{load['max']:.1f}, mean {load['mean']:.1f}, on {info['cpus']} CPUs):"
    )
    print_rows(rows)
    print(f"sweep took {total_s:.0f} s; load average {load['start']:.2f} at start, {load['end']:.2f} at end")

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
