# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""From the flags to a Plan (workload, modelled model, tier sizes), the sweep, and the one-node mode
(OneNode; several nodes: nodes_main.SeveralNodes)."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from bench.lib.report import GIB, fmt_bytes, load_average
from bench.lib.s3 import S3, start_s3
from bench.multiturn.bounds import bound_lines, slow_disk_lines, target_rows
from bench.multiturn.model import (
    CONFIG_BY_KEY,
    CONFIG_LABELS,
    CONFIGS,
    MODELS,
    SLOW_DISK,
    TIERS,
    Config,
    Model,
    Plan,
    Sizes,
    Workload,
    derive_model,
)
from bench.multiturn.report import daemon_lines
from bench.multiturn.runs import RunResult, Skipped, TurnsResult, run_one

SLOW_DISK_PREFILL = 4.0  # x the model's prefill rate: the seed's break-even 0.95 -> 3.8 GiB/s, above the fs tier here
R = TypeVar("R", bound=TurnsResult)


def select_configs(
    ap: argparse.ArgumentParser, text: str | None, default: Sequence[str], by_key: Mapping[str, Config], unknown: str
) -> list[Config]:
    """The set-ups --configs names (`default` without it); an unknown key is a usage error."""
    keys = [c.strip() for c in (text or ",".join(default)).split(",") if c.strip()]
    if bad := [c for c in keys if c not in by_key]:
        ap.error(f"unknown {unknown.format(bad=bad)}; choose among {', '.join(by_key)}")
    return [by_key[c] for c in keys]


def setup(ap: argparse.ArgumentParser, args: argparse.Namespace, register_rates: bool) -> Plan:
    """The plan from the flags; argparse errors for what does not fit together."""
    w = Workload(args.initial_tokens, args.turn_tokens, args.turns, args.think_s, args.chunk_tokens, args.seed)
    if w.final_tokens // w.chunk_tokens < 1:
        ap.error("--chunk-tokens is larger than the last prompt")
    for flag in ("model_kv_bytes_per_token", "prefill_tokens_per_s", "gpu_tokens", "gpu_conversations"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            ap.error(f"--{flag.replace('_', '-')} must be positive")
    m, basis, derivation = derive_model(MODELS[args.model], w, args)
    m = replace(m, register_rates=register_rates)
    if m.gpu_tokens < w.final_tokens:
        ap.error(f"the GPU cache ({m.gpu_tokens:,} tokens) must hold at least one whole prompt ({w.final_tokens:,})")
    conv = {"ram": args.ram_conversations, "fs": args.fs_conversations, "s3_fs": args.s3_fs_conversations}
    sizes = Sizes(*(int(c * w.final_tokens * m.kv_bytes_per_token) for c in conv.values()))
    counts = sorted({int(x) for x in args.conversations.split(",") if x.strip()})
    sizes_conv = {"gpu": m.gpu_tokens / w.final_tokens, **conv}
    return Plan(w, m, basis, derivation, sizes, sizes_conv, counts, Path(args.workdir))


def start_sweep_s3(kind: str, p: Plan, configs: Sequence[Config], moto: str, skipped: str) -> tuple[S3 | None, str]:
    """The S3 server of a sweep whose configurations use one (the caller stops it), and the line that says which."""
    if not any(c.uses("s3") for c in configs):
        return None, ""
    # radosgw keeps objects in a memstore OSD (RAM): room for the largest run's write-downs
    memstore = int(max(p.counts) * p.w.final_tokens * p.m.kv_bytes_per_token * 1.5) + GIB
    s3: S3 | None = None
    try:
        s3 = start_s3(kind, memstore)
        note = "S3: Ceph radosgw (memstore OSD) on loopback" if s3.is_rgw else f"S3: {moto} on loopback"
    except RuntimeError as exc:
        note = f"{skipped}: {exc}"
    print("  " + note, flush=True)
    return s3, note


def sweep(
    counts: Sequence[int],
    configs: Sequence[Config],
    s3: S3 | None,
    s3_note: str,
    run: Callable[[Config, int], R],
    skipped: Callable[[Config, int, str], R],
    status: Callable[[R], str],
    measure: Callable[[], None] | None,
) -> tuple[list[R], float]:
    """Every configuration at every count (the limits measured before and after, unless None), one progress
    line per run with its wall seconds and load average; a run that raises Skipped, or needs S3 without a
    server, is reported skipped."""
    results: list[R] = []
    t_start = time.perf_counter()
    width = max(len(c.label) for c in configs)
    if measure is not None:
        measure()
    for count in counts:
        for config in configs:
            t0, load0 = time.perf_counter(), load_average()
            try:
                if config.uses("s3") and s3 is None:
                    raise Skipped(s3_note)
                r = run(config, count)
            except Skipped as why:
                r = skipped(config, count, str(why))
            r.wall_s, r.load_average = time.perf_counter() - t0, (load0, load_average())
            results.append(r)
            took = f"[{time.perf_counter() - t_start:6.0f} s]"
            print(f"  {took} {config.label:>{width}} x {count:>3}: {r.skipped or status(r)}", flush=True)
    if measure is not None:
        measure()
    return results, time.perf_counter() - t_start


def one_node_status(r: RunResult) -> str:
    return (
        f"hit {100 * r.hit_rate_overall:.1f}%  {r.throughput_tokens_s:,.0f} tokens/s  TTFT p50 {r.ttft_p50_s:.2f} s "
        f"p99 {r.ttft_p99_s:.2f} s  wall {r.wall_s:.1f} s  load {r.load_average[1]:.1f}"
    )


class OneNode:
    """The mode: one node (every configuration on a daemon of its own); SeveralNodes (nodes_main.py)
    overrides what several nodes do differently. cli.main is the rest, in the order it prints."""

    benchmark = "multiturn"  # the JSON's "benchmark"
    title = ""  # the first line's, after "kvstored multi-turn benchmark", and the targets' heading's
    sizes_key = "sizes"  # the JSON's key for the tier sizes
    config_flags: tuple[str, ...] = ()  # the Config fields the JSON's configs show beside key, label and tiers
    moto = "moto_server (in RAM)"  # the S3 line's name for moto_server
    s3_skipped = "S3 configuration skipped"  # and for the configurations that need S3, without a server
    labels = CONFIG_LABELS  # the results table's row labels
    hit_tiers: tuple[str, ...] = TIERS  # its hit rate columns
    first_column = "config"
    loaded_column = True  # a column of the scaled bytes loaded per tier
    note = "hit rates: of reusable tokens; tokens/s, TTFT, busy: modelled; loaded: scaled bytes; GiB/s: measured"
    daemon_title = "daemon counters per run (Stats deltas; bytes are the scaled bytes):"
    bounds_title = "what bounds RAM + fs at the largest count:"
    cost_configs: Sequence[Config] = CONFIGS  # the configurations whose cost of a token is printed
    daemon_lines = staticmethod(daemon_lines)
    bound_lines = staticmethod(bound_lines)

    def __init__(self, ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        if args.slow_disk and args.prefill_tokens_per_s is None:
            args.prefill_tokens_per_s = SLOW_DISK_PREFILL * MODELS[args.model].prefill_tokens_per_s
        default = [c.key for c in (SLOW_DISK if args.slow_disk else CONFIGS)]
        self.args = args
        self.configs = select_configs(ap, args.configs, default, CONFIG_BY_KEY, "configuration(s) {bad}")
        self.register_rates = args.slow_disk or args.register_rates

    def intro(self) -> list[str]:
        """The plan's lines before the model's."""
        return []

    def scaling(self, scale: list[str], p: Plan) -> list[str]:
        """The scaling lines (printed after the model's, and in the JSON)."""
        return scale

    def outro(self, p: Plan) -> list[str]:
        top, w = max(p.counts), p.w
        loaded = fmt_bytes(top * w.reusable_per_conversation * p.m.kv_bytes_per_token)
        return [
            f"at {top} conversations: {loaded} of reusable KV loaded at most (scaled), "
            f"{top * w.tokens_per_conversation:,} prompt tokens"
        ]

    def plan_doc(self) -> dict[str, Any]:
        """The mode's own keys of the plan's JSON."""
        return {"slow_disk": self.args.slow_disk}

    def enter(self, stack: contextlib.ExitStack) -> None:
        """What the runs need beside S3 (exited after the sweep)."""

    def sweep(
        self, p: Plan, s3: S3 | None, s3_note: str, measure: Callable[[], None] | None
    ) -> tuple[list, list, float]:
        """The results, those of a second sweep (--route kv) and the seconds they took."""
        results, total_s = sweep(
            p.counts,
            self.configs,
            s3,
            s3_note,
            lambda config, n: run_one(config, n, p, s3),
            lambda config, n, note: RunResult(config.key, n, skipped=note),
            one_node_status,
            measure,
        )
        return results, [], total_s

    def sections(self, results: Sequence[Any], more: Sequence[Any], m: Model) -> list[tuple[str, list[str]]]:
        """Sections printed after the bounds."""
        title = "slow disk: RAM + fs with the recompute gate on and off, against RAM alone:"
        return [(title, slow_disk_lines(results, m))] if self.args.slow_disk else []

    def target_rows(self, p: Plan, results: Sequence[Any], limits: Any) -> list[dict[str, Any]]:
        return target_rows(results, p.m, limits, p.sizes_conv)

    def run_doc(self, s3: S3 | None, more: Sequence[Any]) -> dict[str, Any]:
        """The mode's own keys of the results' JSON."""
        return {"s3_endpoint": s3.endpoint.url if s3 is not None else ""}
