# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The multi-node mode (`python -m bench.multiturn --nodes N`, N >= 2): what it plans, sweeps (with
--route kv a second time) and reports differently from one node (cli.main is the rest)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Sequence
from dataclasses import asdict
from functools import partial
from typing import Any

from bench.lib.report import fmt_bytes
from bench.lib.s3 import S3
from bench.multiturn.limits import Limits
from bench.multiturn.model import TARGET_HIT, Model, Plan
from bench.multiturn.nodes import CONFIG_BY_KEY, CONFIGS, DIRECTORY_KEYS, LABELS, NODE_TIERS, NodesRunResult, run_one
from bench.multiturn.plan import Measure, OneNode, at_top, select_configs, sweep
from bench.multiturn.report import RAW, TargetRows, model_lines, problems, scaling_lines, tier_counters, tier_limit
from bench.multiturn.runs import DIRECTORY_OPTIONS
from tests.support.redis_cluster import RedisCluster

TARGET_HIT_POINTS = 5.0  # the directory's hit rate at most this far below one node with the fleet's RAM + fs
TARGET_VS_ISLANDS = 1.3  # peers vs the same nodes without peers, at the largest count
ROUTING = "round robin: turn t of conversation c on node (c + t - 1) mod N (no KV awareness)"  # ClusterSim.route
KV_ROUTING = "KV-aware: each turn on the node whose chunks Dynamo's indexer matches longest (ties: round robin)"
DIRECTORY_CLUSTER = "a real Redis Cluster, 3 masters and 3 replicas on loopback (tests/support/redis_cluster.py)"
MEASURED = ["hit rates per tier (checked bytes)", "load and store times", "Stats and Peer Status", "physical limits"]
MODELLED = ["each node's GPU, prefill and loader (the model above)", "throughput, TTFT and busy shares"]


def gate_line(m: Model) -> str:
    """What the daemons are told about recomputing (--register-rates)."""
    breakeven = f"break-even {m.breakeven_gib_s:.2f} GiB/s"
    if not m.register_rates:
        return f"recompute gate: no prefill rate registered (--register-rates: {breakeven})"
    return (
        f"recompute gate: every node's namespace registers {m.gate_prefill_tokens_per_s:,.0f} prefill tokens/s of "
        f"{m.kv_bytes_per_token} real bytes (the model's {m.prefill_tokens_per_s:,.0f} x "
        f"{m.model_kv_bytes_per_token:,} bytes: {breakeven})"
    )


def route_lines(rr: Sequence[NodesRunResult], kv: Sequence[NodesRunResult]) -> list[str]:
    """Each set-up at each count, both routings: hit rates per tier, peer fetches, throughput."""
    by_key = {(r.config, r.conversations): r for r in rr}
    lines = []
    for k in kv:
        where = f"{LABELS[k.config]}, {k.conversations} conversations"
        r = by_key.get((k.config, k.conversations))
        if r is None or r.skipped or k.skipped:
            lines.append(f"{where}: skipped ({k.skipped or r and r.skipped})")
            continue
        for name, x in (("round robin", r), ("KV-aware", k)):
            tiers = "  ".join(f"{t} {100 * x.hit_rate.get(t, 0.0):.1f}%" for t in NODE_TIERS)
            lines.append(
                f"{where}, {name:<11}: hit {100 * x.hit_rate_overall:.1f}% ({tiers}); peer fetches "
                f"{x.peers.get('fetches', 0)} ({x.peers.get('received_chunks', 0)} chunks); "
                f"{x.throughput_tokens_s:,.0f} tokens/s"
                + (f"; {x.kv_routed} turns routed off round robin" * (x.route == "kv"))
            )
    return lines


def daemon_lines(results: Sequence[Any]) -> list[str]:
    lines = []
    for r in (r for r in results if not r.skipped and r.daemon):
        parts = tier_counters(r)
        if p := r.peers:
            parts.append(
                f"peers: {p['fetches']} fetches, {p['received_chunks']} chunks in ({fmt_bytes(p['received_bytes'])}), "
                f"served {p['served_chunks']}, missing {p['missing_chunks']}, failed {p['failed_chunks']}, timed out "
                f"{p['timed_out_chunks']}, breaker refusals {p['refused_by_breaker']}, resyncs {p['resyncs']}"
            )
        if r.slow_gib_s:
            slow = (
                f"{t} {r.marginal_gib_s.get(t, 0):.2f} / {r.slow_gib_s[t]:.2f}" for t in NODE_TIERS if t in r.slow_gib_s
            )
            parts.append("load calls' marginal GiB/s median / slowest decile: " + ", ".join(slow))
        st, se = r.store, r.settle
        lines.append(
            f"{LABELS[r.config]:>20} {r.conversations:>4}: {'; '.join(parts)} | client stores {st['stored']} new, "
            f"{st['already_present']} present, {st['dropped']} dropped | lookup p50 {r.lookup_ms_p50:.2f} ms (floor "
            f"{r.lookup_floor_ms:.2f}; {r.lookup_moved_s:.1f} s moved to fs/peer loads), call floor "
            f"{r.load_call_floor_ms:.2f} ms x {r.load_calls} | settled {se['waits']} turns, {se['seconds']:.1f} s"
            + (f", {se['s3_timeouts']} S3 waits gave up" if se["s3_timeouts"] else "")
            + problems(r)
        )
    return lines


def target_rows(results: Sequence[NodesRunResult], m: Model, limits: Limits, n: int) -> TargetRows:
    """The targets at the largest count and the informational ratios."""
    rows = TargetRows()
    keys = ("none", "ram+fs", "ram+fs+peer", "ram+fs+s3", "ram+fs+dir", "pooled")
    top, (none, islands, peers, s3, fleet, pooled) = at_top(results, *keys)
    where = f"{n} nodes, {top} conversations"
    if peers is not None:
        p = peers.peers
        lost = f"missing {p.get('missing_chunks', 0)}, failed {p.get('failed_chunks', 0)}, timed out "
        limit = f"peer {100 * peers.hit_rate['peer']:.0f}% of reusable tokens; {lost}{p.get('timed_out_chunks', 0)}"
        rows.hit_rate(f"peers: hit rate, {where}", peers, TARGET_HIT, limit)
        peer_limit = tier_limit(peers, "peer", limits, m)
        if islands is not None:  # no makespan is shorter than the think floor
            limit = (
                f"{peer_limit}; makespan {peers.makespan_s:,.0f} s, the conversations' own start and think times "
                f"{peers.think_floor_s:,.0f} s: at most {islands.makespan_s / peers.think_floor_s:.2f}x"
            )
            rows.vs(f"peers vs islands (no peers), {where}", peers, "islands", islands, TARGET_VS_ISLANDS, limit)
        rows.vs(f"peers vs no offload, {where}", peers, "no offload", none, None, peer_limit)
    if fleet is not None and pooled is not None:
        # found: the hits, and those the recompute gate answered as misses (none without --register-rates)
        gated = "".join(
            f"; {name} served {100 * r.hit_rate_overall:.1f}%, {100 * sum(r.gate_skipped.values()):.1f}% skipped "
            "as slower than recomputing"
            for name, r in (("directory", fleet), ("one node", pooled))
            if r.gate_skipped
        )
        found, pooled_found = 100 * fleet.found_rate, 100 * pooled.found_rate
        limit = (
            f"{pooled_found - found:.1f} points below it (directory {found:.1f}%, one node {pooled_found:.1f}%); "
            f"peer {100 * fleet.hit_rate['peer']:.0f}% of reusable tokens{gated}"
        )
        baseline = (f"that node's, less {TARGET_HIT_POINTS:g} points", pooled.found_rate - TARGET_HIT_POINTS / 100)
        name = f"directory: hit rate vs one node with the fleet's RAM + fs, {where}"
        rows.add(name, fleet.found_rate, "share", baseline, 1.0, limit)
    if fleet is not None and islands is not None:
        cap = f"; think time caps it at {islands.makespan_s / fleet.think_floor_s:.2f}x"
        limit = tier_limit(fleet, "peer", limits, m) + cap
        rows.vs(f"directory vs islands (no peers), {where}", fleet, "islands", islands, TARGET_VS_ISLANDS, limit)
    limit = "the same hits from one store: what reaching them on other nodes costs"
    rows.vs(f"directory vs one node with the fleet's RAM + fs, {where}", fleet, "one node", pooled, None, limit)
    for label, r, tier in (("islands", islands, "fs"), ("shared S3", s3, "s3")):
        if r is not None:
            limit = f"hit rate {100 * r.hit_rate_overall:.0f}%; " + tier_limit(r, tier, limits, m)
            rows.vs(f"{label} vs no offload, {where}", r, "no offload", none, None, limit)
    limit = "the faster of the two ways to reach another node's chunks"
    rows.vs(f"peers vs shared S3, {where}", peers, "shared S3", s3, None, limit)
    for tier, r in (("peer", peers or fleet), ("fs", islands), ("s3", s3)):
        rows.loads(tier, r, (RAW[tier][0], limits.median(RAW[tier][1])), LABELS, m)
    return rows


def bound_lines(results: Sequence[Any], m: Model, limits: Limits) -> list[str]:
    """Where the modelled time went at the largest count, per set-up with offload."""
    top = max((r.conversations for r in results), default=0)
    lines = []
    for r in (r for r in results if not r.skipped and r.conversations == top and r.config != "none"):
        full = ", ".join(f"{t} {fmt_bytes(v * m.byte_scale)}" for t, v in r.loaded_bytes.items() if v)
        lines.append(
            f"{LABELS[r.config]}: makespan {r.makespan_s:,.0f} modelled s (think floor {r.think_floor_s:,.0f}); per "
            f"node GPU busy {100 * r.gpu_busy:.0f}%, loader {100 * r.loader_busy:.0f}%; loaded at full size: {full}; "
            f"recomputed {100 * (1 - r.hit_rate_overall):.0f}% of the reusable tokens"
        )
    return lines


class SeveralNodes(OneNode):
    """N nodes, each with its modelled GPU and loader and its own daemon; turns routed round robin."""

    benchmark = "multiturn-nodes"
    sizes_key = "sizes_per_node"
    config_flags = ("write_through", "directory", "pooled")
    labels = LABELS
    hit_tiers = NODE_TIERS
    first_column = "set-up"
    loaded_column = False
    note = "hit rates, GiB/s: measured (marginal: what the model charges); tokens/s, TTFT, busy (node means): modelled"
    daemon_title = "daemon counters per run (Stats deltas and Peer Status, summed over the nodes; scaled bytes):"
    bounds_title = "where the modelled time went at the largest count:"
    cost_configs = CONFIGS
    daemon_lines = staticmethod(daemon_lines)
    bound_lines = staticmethod(bound_lines)

    def __init__(self, ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        default = DIRECTORY_KEYS if args.directory else [c.key for c in CONFIGS]
        self.args, self.n, self.register_rates = args, args.nodes, args.register_rates
        self.configs = select_configs(ap, args.configs, default, CONFIG_BY_KEY, "set-up(s) {bad} with --nodes")
        if args.settle_s < 0:
            ap.error("--settle-s must not be negative")
        self.title = f", {self.n} nodes"
        self.directory = any(c.directory for c in self.configs)

    def plan_lines(self, p: Plan) -> tuple[list[str], list[str]]:
        lines = [f"routing: {ROUTING}; each node: its own modelled GPU and loader, its own daemon"]
        if self.directory:
            lines.append(f"directory: {DIRECTORY_CLUSTER}; daemons with no static peers; {DIRECTORY_OPTIONS}")
        *scale, sizes = scaling_lines(p)
        setups = "; ".join(f"{c.label} ({c.key}: " + " -> ".join(c.tiers) + ")" for c in self.configs)
        scale += [
            "per node: " + sizes,
            f"set-ups: {setups}; peers over {self.args.peer_transport} on loopback; shared S3 with write-through; "
            f"stores settle >= {self.args.settle_s:g} s of wall time before a conversation's next turn looks them up",
            gate_line(p.m),
        ]
        lines += [*model_lines(p.m, p.basis), *scale, f"measured: {'; '.join(MEASURED)}"]
        return [*lines, f"modelled: {'; '.join(MODELLED)}"], scale

    def plan_doc(self) -> dict[str, Any]:
        return {
            "nodes": self.n,
            "routing": ROUTING,
            "measured": MEASURED,
            "modelled": MODELLED,
            "peer_transport": self.args.peer_transport,
            "settle_s": self.args.settle_s,
            "directory": DIRECTORY_CLUSTER if self.directory else "",
        }

    def sweep(self, p: Plan, s3: S3 | None, s3_note: str, measure: Measure) -> tuple[list, list, float]:
        """Round robin, then with --route kv every set-up with offload routed by Dynamo's index (--directory:
        on a Redis Cluster of their own)."""
        with RedisCluster() if self.directory else contextlib.nullcontext() as cluster:
            run = partial(run_one, p=p, s3=s3, args=self.args, directory=cluster.url if cluster else "")
            skipped = partial(NodesRunResult, nodes=self.n)
            results, total_s = sweep(p.counts, self.configs, s3, s3_note, partial(run, route="rr"), skipped, measure)
            if self.args.route != "kv":
                return results, [], total_s
            offloaded = [c for c in self.configs if c.offload]
            kv_run, kv_skipped = partial(run, route="kv"), partial(skipped, route="kv")
            kv, kv_s = sweep(p.counts, offloaded, s3, s3_note, kv_run, kv_skipped, None)
        return results, kv, total_s + kv_s

    def sections(self, results: Sequence[Any], more: Sequence[Any], m: Model) -> list[tuple[str, list[str]]]:
        return [(f"routing: round robin vs {KV_ROUTING}:", route_lines(results, more))] if more else []

    def target_rows(self, p: Plan, results: Sequence[Any], limits: Limits) -> list[dict[str, Any]]:
        return target_rows(results, p.m, limits, self.n)

    def run_doc(self, s3: S3 | None, more: Sequence[Any]) -> dict[str, Any]:
        return {"kv_results": [asdict(r) for r in more]}
