# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The multi-node mode (`python -m bench.multiturn --nodes N`, N >= 2): what it plans, sweeps (with
--route kv a second time) and reports differently from one node (cli.main is the rest)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from bench.lib.s3 import S3
from bench.multiturn.kvroute import ROUTING as KV_ROUTING
from bench.multiturn.limits import Limits
from bench.multiturn.model import Config, Model
from bench.multiturn.nodes import CONFIG_BY_KEY, CONFIG_KEYS, CONFIGS, DIRECTORY_KEYS, ROUTING
from bench.multiturn.nodes_report import (
    NODES,
    bound_lines,
    daemon_lines,
    gate_line,
    progress,
    route_lines,
    target_rows,
)
from bench.multiturn.nodes_run import NodesRunResult, run_one
from bench.multiturn.plan import OneNode, Plan, select_configs, sweep
from bench.multiturn.runs import DIRECTORY_OPTIONS
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


class SeveralNodes(OneNode):
    """N nodes, each with its modelled GPU and loader and its own daemon; turns routed round robin."""

    benchmark = "multiturn-nodes"
    sizes_key = "sizes_per_node"
    moto = "moto_server"
    s3_skipped = "shared S3 skipped"
    layout = NODES
    daemon_title = (
        "daemon counters per run (Stats deltas and Peer Status, summed over the nodes; bytes are the scaled bytes):"
    )
    bounds_title = "where the modelled time went at the largest count:"
    cost_configs = CONFIGS

    def __init__(self, ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        default = DIRECTORY_KEYS if args.directory else CONFIG_KEYS
        self.args, self.n, self.register_rates = args, args.nodes, args.register_rates
        self.configs = select_configs(ap, args.configs, default, CONFIG_BY_KEY, "set-up(s) {bad} with --nodes")
        if args.settle_s < 0:
            ap.error("--settle-s must not be negative")
        self.title = f", {self.n} nodes"
        self.directory = any(c.directory for c in self.configs)
        self.directory_url = ""

    def header_tail(self, info: dict[str, Any]) -> str:
        return ""

    def intro(self) -> list[str]:
        lines = [f"routing: {ROUTING}; each node: its own modelled GPU and loader, its own daemon"]
        if self.directory:
            lines.append(f"directory: {DIRECTORY_CLUSTER}; daemons with no static peers; {DIRECTORY_OPTIONS}")
        return lines

    def scaling(self, scale: list[str], p: Plan) -> list[str]:
        setups = "; ".join(f"{c.label} ({c.key}: " + " -> ".join(c.tiers) + ")" for c in self.configs)
        return [
            *scale[:-1],
            "per node: " + scale[-1],
            f"set-ups: {setups}; peers over {self.args.peer_transport} on loopback; shared S3 with write-through; "
            f"stores settle >= {self.args.settle_s:g} s of wall time before a conversation's next turn looks them up",
            gate_line(p.m),
        ]

    def outro(self, p: Plan) -> list[str]:
        return [f"measured: {'; '.join(MEASURED)}", f"modelled: {'; '.join(MODELLED)}"]

    def config_doc(self, c: Config) -> dict[str, Any]:
        flags = {"write_through": c.write_through, "directory": c.directory, "pooled": c.pooled}
        return {**super().config_doc(c), **flags}

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

    def enter(self, stack: contextlib.ExitStack) -> None:
        if self.directory:
            self.directory_url = stack.enter_context(RedisCluster()).url

    def sweep(
        self, p: Plan, s3: S3 | None, s3_note: str, measure: Callable[[], None] | None
    ) -> tuple[list[Any], list[Any], float]:
        """Round robin, then with --route kv every set-up with offload routed by Dynamo's index."""
        a = self.args
        width = max(len(c.label) for c in CONFIG_BY_KEY.values())

        def run(route: str) -> Callable[[Config, int], NodesRunResult]:
            args = (self.n, a.peer_transport, a.settle_s, route, self.directory_url)
            return lambda c, count: run_one(c, count, p, s3, *args)

        def skipped(route: str) -> Callable[[Config, int, str], NodesRunResult]:
            return lambda c, count, note: NodesRunResult(c.key, count, nodes=self.n, skipped=note, route=route)

        results, total_s = sweep(
            p.counts, self.configs, s3, s3_note, run("rr"), skipped("rr"), progress, measure, width
        )
        if a.route != "kv":
            return results, [], total_s
        kv, kv_s = sweep(
            p.counts,
            [c for c in self.configs if c.offload],
            s3,
            s3_note,
            run("kv"),
            skipped("kv"),
            lambda r: f"KV-routed: hit {100 * r.hit_rate_overall:.1f}%  {r.throughput_tokens_s:,.0f} tokens/s",
            None,
            width,
        )
        return results, kv, total_s + kv_s

    def daemon_lines(self, results: Sequence[Any]) -> list[str]:
        return daemon_lines(results)

    def after_daemons(self, results: Sequence[Any], m: Model) -> list[tuple[str, list[str]]]:
        return []

    def bound_lines(self, results: Sequence[Any], m: Model, limits: Limits) -> list[str]:
        return bound_lines(results, m)

    def after_bounds(self, results: Sequence[Any], more: Sequence[Any]) -> list[tuple[str, list[str]]]:
        return [(f"routing: round robin vs {KV_ROUTING}:", route_lines(results, more))] if more else []

    def target_rows(self, p: Plan, results: Sequence[Any], limits: Limits) -> list[dict[str, Any]]:
        return target_rows(results, p.m, limits, self.n)

    def run_doc(self, s3: S3 | None, more: Sequence[Any]) -> dict[str, Any]:
        return {"kv_results": [asdict(r) for r in more]}
