# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The run over node counts, its basis, the printed report and the plot."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.lib.report import GIB, MIB, print_aligned
from bench.lib.report import fmt_bytes as fmt_size
from bench.plot import pyplot, save
from bench.scale_out.designs import Model, break_point, designs, plot_nodes
from bench.scale_out.fleet import HEADER_BYTES_PER_SEGMENT, S3_PREFIX_PUTS_PER_S, Budget, Costs, Fleet, Rates
from kvstored.tiers.config import PeerTierConfig, S3TierConfig


def run(model: Model, nodes: Sequence[int], max_nodes: int) -> dict[str, Any]:
    return {
        "designs": [
            {
                "key": d.key,
                "label": d.label,
                "how": d.how,
                "break": break_point(d, model.budget, max_nodes),
                "rows": [asdict(d.point(n)) for n in nodes],
                "curve": [asdict(d.point(n)) for n in plot_nodes(max_nodes)],
            }
            for d in designs(model)
        ],
        "router_tier": [model.router_tier(n) for n in nodes],
        "redis_tier": [model.redis_tier(n) for n in sorted({*nodes, 100, 1000})],
    }


def sensitivity(fleet: Fleet, budget: Budget, costs: Costs, max_nodes: int) -> list[dict[str, Any]]:
    """Break points when one assumption changes."""
    variants = [
        ("as stated", fleet),
        ("half the turn rate", replace(fleet, turns_per_s=fleet.turns_per_s / 2)),
        ("peers fetch from RAM only (disks not indexed)", replace(fleet, fs_bytes=0)),
        ("1 s batching interval", replace(fleet, interval_s=1.0)),
        ("no S3 tier", replace(fleet, s3_tier=False)),
        ("directory entries live 4 h (the refresh pass 8x rarer)", replace(fleet, directory_entry_ttl_s=4 * 3600.0)),
    ]
    return [
        {
            "variant": label,
            "breaks": {d.key: break_point(d, budget, max_nodes) for d in designs(Model(f, budget, costs))},
        }
        for label, f in variants
    ]


def redis_fit(fleet: Fleet, budget: Budget, costs: Costs, nodes: int = 1000) -> dict[str, Any]:
    """Where the Redis Cluster directory's per-node CPU (flat in N) fits the budget: the turn rate
    it allows, and the CPU per chunk written it would need at the stated rate."""
    model = Model(fleet, budget, costs)
    p = model.redis_directory(nodes)
    lo, hi = 0.0, 1000.0  # turns/s per node: the CPU grows with them
    for _ in range(60):
        mid = (lo + hi) / 2
        fits = Model(replace(fleet, turns_per_s=mid), budget, costs).redis_directory(nodes).cpu_fraction
        lo, hi = (mid, hi) if fits <= budget.cpu_fraction else (lo, mid)
    r = model.rates
    room = budget.cpu_fraction - p.cpu_parts["heartbeat"] - p.cpu_parts["lookups"]
    long_ttl = replace(fleet, directory_entry_ttl_s=4 * 3600.0)
    return {
        "nodes": nodes,
        "cpu_fraction": p.cpu_fraction,
        "cpu_parts": p.cpu_parts,
        "memory_bytes": p.memory_bytes,
        "max_turns_per_s": lo,
        "write_s_per_key_to_fit": max(0.0, room) / (r.net_keys_per_s + r.refresh_keys_per_s),
        "ttl_4h_cpu_fraction": Model(long_ttl, budget, costs).redis_directory(nodes).cpu_fraction,
    }


def basis(f: Fleet, r: Rates, c: Costs) -> list[tuple[str, str, str]]:
    """The workload per node: (figure, value, its basis)."""
    orders = math.ceil(r.looked_up_chunks_per_turn * f.kvstored_read_share / PeerTierConfig.max_batch)
    s3_event = " + 1 for the S3 write-down (modelled)" if f.s3_tier else ""
    rows = {
        "turns per node": (
            f"{f.turns_per_s:g}/s",
            "--turns-per-s; ~ the GPU saturated: 50,000 prefill tokens/s (bench/multiturn.py's Qwen3.6-35B-A3B on 2x "
            f"H100) / {f.new_tokens_per_turn:,.0f} new tokens per turn",
        ),
        "tokens per turn": (
            f"{f.new_tokens_per_turn:,.0f} new, {f.reusable_tokens_per_turn:,.0f} reusable",
            f"{f.first_tokens:,} first + {f.turn_tokens:,} per turn, {f.turns} turns (mean over the turns)",
        ),
        "chunk": (
            f"{f.chunk_bytes / MIB:g} MiB = {f.chunk_tokens:.1f} tokens",
            f"--chunk-mib at {f.kv_bytes_per_token:,} KV bytes per token (--kv-bytes-per-token)",
        ),
        "chunks per turn": (
            f"{r.stored_chunks_per_turn:.0f} stored, {r.looked_up_chunks_per_turn:.0f} looked up",
            "the turn's new tokens, its reusable tokens",
        ),
        "stores": (
            f"{r.stores_per_s:,.0f} chunks/s ({r.stores_per_s * f.chunk_bytes / GIB:.2f} GiB/s)",
            "one store call per turn (the store event carries the turn's keys)",
        ),
        "reads from kvstored": (
            f"{r.reads_per_s:,.0f} chunks/s",
            f"--kvstored-read-share {f.kvstored_read_share:g} of the reusable chunks",
        ),
        "promotions from own fs": (f"{r.fs_promotions_per_s:,.0f}/s", f"--fs-read-share {f.fs_read_share:g} of reads"),
        "fetched from peers": (
            f"{r.peer_fetches_per_s:,.0f}/s",
            f"--cross-node-share {f.cross_node_share:g} of turns land on another node; {orders} fetch orders of "
            f"<= {PeerTierConfig.max_batch} chunks per such turn, {c.fetch_round_trip_s * 1e3:.2f} ms each (measured)",
        ),
        "events published (as built)": (
            f"{r.events_per_s:,.0f}/s, {r.keys_per_s:,.0f} keys/s",
            f"a chunk's life after its store: {c.single_events_per_chunk:.2f} single-key events (measured, RAM -> fs "
            f"full){s3_event}; a promotion or fetch: 1",
        ),
        "net changes (coalesced designs)": (
            f"{r.net_keys_per_s:,.0f} keys/s",
            "per chunk: appears in RAM, moves to fs, leaves (3); promoted from fs: 2; S3 not sent",
        ),
        "held for peers": (
            f"{r.chunks_held:,.0f} chunks",
            f"--ram-gib {f.ram_bytes / GIB:g} + --fs-tib {f.fs_bytes / (1 << 40):g} of {f.chunk_bytes / MIB:g} MiB "
            "chunks",
        ),
        "directory groups": (
            f"{r.groups_changed_per_s:,.0f} changed/s, {r.lookup_groups_per_turn} asked per turn",
            f"--group-chunks {f.group_chunks}, --replicas {f.replicas}, --interval-s {f.interval_s:g}",
        ),
        "S3": (
            f"{r.s3_puts_per_s:,.0f} PUT/s, {r.s3_base_gets_per_s:,.1f} GET/s (+ cross-node reads the index "
            "cannot place)",
            f"every chunk leaving RAM goes to fs and S3, {f.chunks_per_put} per PUT (--pack-bytes); "
            f"${f.put_usd_per_1k:g} per 1k PUT, ${f.get_usd_per_1k:g} per 1k GET (S3 Standard, us-east-1 list prices; "
            "--put-usd-per-1k, --get-usd-per-1k)",
        ),
    }
    return [(figure, value, why) for figure, (value, why) in rows.items()]


# -- printing and plotting ---------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    return fmt_size(n, grouped=True)


def fmt_rate(n: float) -> str:
    return fmt_bytes(n) + "/s"


def measured(model: Model) -> dict[str, str]:
    """The calibration's costs the model uses, as printed."""
    c = model.costs
    return {
        "follower CPU": f"{c.follow_s_per_event * 1e6:.1f} us/event + {c.follow_s_per_key * 1e6:.2f} us/key "
        f"(+{c.follow_s_per_key_per_slot * 1e9:.2f} ns per slot of the holder)",
        "publisher CPU per follower": f"{c.publish_s_per_event * 1e6:.1f} us/event + "
        f"{c.publish_s_per_key * 1e6:.3f} us/key",
        "event bytes": f"{c.bytes_per_event:.0f} B/event + {c.bytes_per_key:.1f} B/key "
        f"(+{HEADER_BYTES_PER_SEGMENT} B per segment on a network)",
        "index memory": f"{c.index_bytes_per_entry:.0f} B/entry (+{c.index_bytes_per_slot:.3f} B per slot of the "
        "holder)",
        "one stream": f"{fmt_bytes(c.stream_bytes)} (both ends)",
        "a turn's Lookup": f"{model.local_lookup_s() * 1e3:.2f} ms local, +{c.contains_s_per_peer * 1e6:.2f} us per "
        "peer (mesh)",
        "remote Lookup": f"{c.remote_lookup_s * 1e3:.2f} ms, {c.remote_lookup_server_s * 1e3:.2f} ms of the "
        "server's CPU",
        "owner choice": f"{c.rendezvous_s_per_node * 1e6:.3f} us per node per group",
        "S3 per chunk": f"PUT {c.s3_put_s * 1e3:.1f} ms, GET {c.s3_get_s * 1e3:.1f} ms ({c.s3_server})",
    }


POINT_COLUMNS: dict[str, Callable[[dict[str, Any]], str]] = {  # the design table's, after the design's label
    "nodes": lambda p: f"{p['nodes']:,}",
    "CPU": lambda p: f"{p['cpu_fraction']:.1%}",
    "memory": lambda p: fmt_bytes(p["memory_bytes"]),
    "event traffic in": lambda p: fmt_rate(p["inbound_bytes_per_s"]),
    "lookup/turn": lambda p: f"{p['lookup_ms']:.2f} ms",
    "coverage": lambda p: f"{p['coverage']:.1%}",
    "S3 $/month": lambda p: f"{p['s3_usd_per_month']:,.0f}",
}


def print_report(doc: dict[str, Any], model: Model) -> None:
    cal, c, f, budget = doc["calibration"], model.costs, model.fleet, model.budget
    print(
        f"calibration: {cal['path']} ({cal['created']}, {cal['cpu_model']}, {cal['cpus']} CPUs, "
        f"load average {cal['load_average']}; S3: {c.s3_server})"
    )
    print("\nworkload per node (every figure a flag):")
    print_aligned([["figure", "value", "basis"], *map(list, basis(f, model.rates, c))], right=set())
    print("\nmeasured costs used:")
    print_aligned([["cost", "value"], *map(list, measured(model).items())], right=set())
    print(f"\nper node, budget {budget.cpu_fraction:.0%} of a core and {fmt_bytes(budget.memory_bytes)}:")
    table = [["design", *POINT_COLUMNS]]
    table += [
        [d["label"], *(cell(row) for cell in POINT_COLUMNS.values())] for d in doc["designs"] for row in d["rows"]
    ]
    print_aligned(table, right=set(range(1, len(table[0]))))
    print("\nwhere each design stops scaling:")
    for d in doc["designs"]:
        if (b := d["break"]) is None:
            print(f"  {d['label']}: within the budget up to {doc['max_nodes']:,} nodes")
        else:
            print(
                f"  {d['label']}: {b['nodes']:,} nodes ({b['resource']}: CPU {b['cpu_fraction']:.1%}, "
                f"memory {fmt_bytes(b['memory_bytes'])})"
            )
    print("\nthe router tier takes in, for the fleet:")
    for t in doc["router_tier"]:
        print(
            f"  {t['nodes']:,} node{'s' if t['nodes'] != 1 else ''}: {t['keys_per_s']:,.0f} keys/s in "
            f"{t['messages_per_s']:,.0f} messages/s ({fmt_rate(t['inbound_bytes_per_s'])}), {t['cores']:.2f} cores at "
            f"our per-key cost, {t['index_entries']:,.0f} entries ({fmt_bytes(t['index_bytes'])})"
        )
    print(
        f"\nthe Redis Cluster the directory takes (masters within {f.redis_shard_cpu:.0%} of a core and "
        f"{f.redis_shard_gib:g} GiB, {f.redis_replicas} replica(s) each):"
    )
    for t in doc["redis_tier"]:
        print(
            f"  {t['nodes']:,} nodes: {t['masters']:,} masters ({t['processes']:,} processes), "
            f"{t['ops_per_s']:,.0f} ops/s ({t['commands_per_s']:,.0f} writes, {t['lookup_keys_per_s']:,.0f} keys "
            f"asked), {t['cores']:.2f} cores, {t['entries']:,.0f} entries, {fmt_bytes(t['memory_bytes'])} "
            f"with replicas ({fmt_bytes(t['master_memory_bytes'])} and {t['master_cores']:.0%} of a core per master)"
        )
    fit = doc["redis_fit"]
    shares = ", ".join(f"{k} {v:.1%}" for k, v in fit["cpu_parts"].items())
    versus = ""
    if c.dir_client_s_per_key and c.dir_redis_py_s_per_key:
        versus = (
            f"; redis-py's cluster pipeline in the same run {c.dir_redis_py_s_per_key * 1e6:.1f} us "
            f"({c.dir_redis_py_s_per_key / c.dir_client_s_per_key:.1f}x)"
        )
    print(
        f"the directory per node at {fit['nodes']:,} nodes: {fit['cpu_fraction']:.1%} of a core ({shares}) and "
        f"{fmt_bytes(fit['memory_bytes'])}, the same at any N, against a budget of {budget.cpu_fraction:.0%} and "
        f"{fmt_bytes(budget.memory_bytes)}; within the CPU budget up to {fit['max_turns_per_s']:.1f} turns/s per "
        f"node, or at {f.turns_per_s:g} turns/s with <= {fit['write_s_per_key_to_fit'] * 1e6:.1f} us per chunk "
        f"written (measured {c.dir_write_s_per_key * 1e6:.1f} us in the daemon; the client alone "
        f"{c.dir_client_s_per_key * 1e6:.1f} us{versus}, raw RESP {c.dir_raw_resp_s_per_key * 1e6:.1f} us); "
        f"entries living 4 h: {fit['ttl_4h_cpu_fraction']:.1%}"
    )
    s3 = doc["s3"]
    print(
        f"\nS3: {s3['puts_per_s_per_node']:,.0f} PUT/s per node ({s3['in_flight_puts']:.1f} in flight at "
        f"{c.s3_put_s * 1e3 * f.chunks_per_put:.1f} ms each, the S3 tier keeps "
        f"{S3TierConfig.pack_uploads if f.pack_bytes else S3TierConfig.concurrency}); at 1,000 nodes "
        f"{s3['puts_per_s_per_node'] * 1000:,.0f} PUT/s need >= {s3['prefixes_at_1000']} partitioned prefixes "
        f"({S3_PREFIX_PUTS_PER_S:,} PUT/s each) and cost ${s3['usd_per_month_at_1000']:,.0f}/month in requests"
    )
    print("\nbreak points when one assumption changes:")
    for v in doc["sensitivity"]:
        parts = [
            f"{k} {b['nodes']:,} ({b['resource']})" if b else f"{k} > {doc['max_nodes']:,}"
            for k, b in v["breaks"].items()
        ]
        print(f"  {v['variant']}: " + ", ".join(parts))


STYLE = {  # colour, marker
    "mesh": ("#d62728", "o"),
    "coalesced": ("#ff7f0e", "s"),
    "directory": ("#2ca02c", "^"),
    "redis": ("#9467bd", "v"),
    "router": ("#1f77b4", "D"),
}
WIDTH = {"mesh": 5.0}  # drawn wide underneath: where the coalesced mesh has the same figure, both show


def plot(doc: dict[str, Any], path: str | Path) -> None:
    plt = pyplot()

    budget = doc["budget"]
    panels = [  # title, the figure, its scale, unit, log scale, the budget's line
        ("Index upkeep CPU (share of one core)", "cpu_fraction", 100, "%", True, 100 * budget["cpu_fraction"]),
        ("Index + streams memory for a full view", "memory_bytes", 1 / MIB, "MiB", True, budget["memory_bytes"] / MIB),
        ("Inbound event traffic", "inbound_bytes_per_s", 1 / 1024, "KiB/s", True, None),
        ("A turn's Lookup", "lookup_ms", 1, "ms", False, None),
        ("Peers' chunks the index holds within the memory budget", "coverage", 100, "%", False, None),
        ("S3 GETs per node (misses the index cannot place)", "s3_gets_per_s", 1, "GET/s", False, None),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), dpi=110)
    for ax, (title, figure, scale, unit, log, line) in zip(axes.flat, panels):
        for d in doc["designs"]:
            colour, marker = STYLE.get(d["key"], ("#000000", "o"))
            xy = [(p["nodes"], p[figure] * scale) for p in d["curve"] if p["nodes"] >= 2]
            if log:
                xy = [(x, y) for x, y in xy if y > 0]  # (the router receives no events: nothing to draw)
            if not xy:
                continue
            wide = WIDTH.get(d["key"])
            style = {"color": colour, "marker": marker, "markevery": 10, "markersize": 5, "label": d["label"]}
            ax.plot(*zip(*xy), linewidth=wide or 2, alpha=0.45 if wide else 1.0, **style)
            if d["break"] is not None:
                ax.axvline(d["break"]["nodes"], color=colour, linestyle=":", linewidth=1)
        if line is not None:
            ax.axhline(line, color="black", linestyle="--", linewidth=1, label="budget")
        ax.set(xscale="log", yscale="log" if log else "linear", xlabel="nodes", ylabel=unit)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
    axes.flat[0].legend(fontsize=8, loc="lower right")
    w = doc["fleet"]
    breaks = ", ".join(
        f"{d['key']}: {d['break']['nodes']:,}" if d["break"] else f"{d['key']}: none" for d in doc["designs"]
    )
    fig.suptitle(
        f"kvstored peer index, per node, {w['turns_per_s']:g} turns/s per node "
        f"({w['chunk_bytes'] / MIB:g} MiB chunks); dotted: where a design exceeds the budget ({breaks})",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    save(fig, path)
