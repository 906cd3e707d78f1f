# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""From the flags to the workload, the modelled model and the tier sizes (a Plan); the sweep, and where
the outputs go (one node and several alike)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TypeVar

from bench.lib.report import GIB, fmt_bytes, load_average, write_json
from bench.lib.s3 import S3, start_s3
from bench.multiturn.bounds import bound_lines, slow_disk_lines
from bench.multiturn.limits import Limits
from bench.multiturn.model import (
    CONFIG_BY_KEY,
    CONFIGS,
    MODELS,
    SLOW_DISK,
    Basis,
    Config,
    Model,
    ModelSpec,
    Plan,
    Sizes,
    Workload,
    derive_model,
)
from bench.multiturn.report import ONE_NODE, daemon_lines, print_rows, target_rows
from bench.multiturn.runs import RunResult, Skipped, TurnsResult, run_one

SLOW_DISK_PREFILL = 4.0  # x the model's prefill rate: the seed's break-even 0.95 -> 3.8 GiB/s, above the fs tier here


R = TypeVar("R", bound=TurnsResult)


def parse_counts(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def select_configs(
    ap: argparse.ArgumentParser, text: str | None, default: Sequence[str], by_key: Mapping[str, Config], unknown: str
) -> list[Config]:
    """The set-ups --configs names (`default` without it); an unknown key is a usage error
    ("unknown {unknown} [keys]; choose among ...")."""
    keys = [c.strip() for c in (text or ",".join(default)).split(",") if c.strip()]
    bad = [c for c in keys if c not in by_key]
    if bad:
        ap.error(f"unknown {unknown.format(bad=bad)}; choose among {', '.join(by_key)}")
    return [by_key[c] for c in keys]


def print_targets(
    rows: Sequence[dict[str, Any]], heading: str, load: dict[str, float], cpus: int, sweep_s: float
) -> None:
    """The target rows under their heading, then what the sweep took (one node and several alike)."""
    print(
        f"targets and ratios ({heading}; load average over the sweep {load['min']:.1f}-{load['max']:.1f}, "
        f"mean {load['mean']:.1f}, on {cpus} CPUs):"
    )
    print_rows(rows)
    print(f"sweep took {sweep_s:.0f} s; load average {load['start']:.2f} at start, {load['end']:.2f} at end")


def setup(ap: argparse.ArgumentParser, args: argparse.Namespace, register_rates: bool) -> Plan:
    """The plan from the flags; argparse errors for what does not fit together."""
    w = Workload(args.initial_tokens, args.turn_tokens, args.turns, args.think_s, args.chunk_tokens, args.seed)
    if w.final_tokens // w.chunk_tokens < 1:
        ap.error("--chunk-tokens is larger than the last prompt")
    for flag in ("model_kv_bytes_per_token", "prefill_tokens_per_s", "gpu_tokens", "gpu_conversations"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            ap.error(f"--{flag.replace('_', '-')} must be positive")
    m, basis, derivation = derive_model(
        MODELS[args.model],
        w,
        args.kv_bytes_per_token,
        args.serial_loads,
        args.model_kv_bytes_per_token,
        args.prefill_tokens_per_s,
        args.gpu_tokens,
        args.gpu_conversations,
    )
    m = replace(m, transfer=args.transfer, register_rates=register_rates)
    if m.gpu_tokens < w.final_tokens:
        ap.error(f"the GPU cache ({m.gpu_tokens:,} tokens) must hold at least one whole prompt ({w.final_tokens:,})")
    conv_bytes = w.final_tokens * m.kv_bytes_per_token
    sizes = Sizes(
        ram_bytes=int(args.ram_conversations * conv_bytes),
        fs_bytes=int(args.fs_conversations * conv_bytes),
        s3_fs_bytes=int(args.s3_fs_conversations * conv_bytes),
    )
    sizes_conv = {
        "gpu": m.gpu_tokens / w.final_tokens,
        "ram": args.ram_conversations,
        "fs": args.fs_conversations,
        "s3_fs": args.s3_fs_conversations,
    }
    return Plan(w, m, basis, derivation, sizes, sizes_conv, parse_counts(args.conversations), Path(args.workdir))


def write_outputs(doc: dict[str, Any], json_path: str | None, plot_path: str | None) -> None:
    """The run's JSON and chart, where asked for."""
    if json_path:
        write_json(json_path, doc)
        print(f"JSON written to {json_path}")
    if plot_path:
        from bench.plot import plot_multiturn

        plot_multiturn(doc, plot_path)
        print(f"plot written to {plot_path}")


def command_line(argv: Sequence[str] | None) -> str:
    return " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv)


def model_doc(m: Model, spec: ModelSpec, derivation: dict[str, float], basis: Sequence[Basis]) -> dict[str, Any]:
    return {
        **asdict(m),
        "transfer": m.transfer.value,
        "byte_scale": m.byte_scale,
        "spec": asdict(spec),
        "derivation": derivation,
        "basis": [asdict(b) for b in basis],
    }


def start_sweep_s3(
    kind: str, configs: Sequence[Config], counts: Sequence[int], w: Workload, m: Model, moto: str, skipped: str
) -> tuple[S3 | None, str]:
    """The S3 server of a sweep whose configurations use one (the caller stops it), and the line that
    says which (printed)."""
    if not any(c.uses("s3") for c in configs):
        return None, ""
    # radosgw keeps objects in a memstore OSD (RAM): room for the largest run's write-downs
    memstore = int(max(counts) * w.final_tokens * m.kv_bytes_per_token * 1.5) + GIB
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
    width: int,
) -> tuple[list[R], float]:
    """Every configuration at every count (the limits measured before and after, unless None), one
    progress line per run, each with its wall seconds and the load average at its start and end; a run
    that raises Skipped, or needs S3 without a server, is reported skipped. Returns the results and the
    seconds."""
    results: list[R] = []
    t_start = time.perf_counter()
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


def section(title: str, lines: Sequence[str]) -> None:
    print()
    print(title)
    for line in lines:
        print("  " + line)


def targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"text": f"{r['name']}: {r['ratio']:.2f}x (target >= {r['target']:g}x)", "met": r["status"] == "PASS"}
        for r in rows
        if r["target"] is not None and r["ratio"] is not None
    ]


class OneNode:
    """The mode: one node (every configuration on a daemon of its own); SeveralNodes (nodes_main.py)
    overrides what several nodes do differently. cli.main is the rest, in the order it prints."""

    benchmark = "multiturn"  # the JSON's "benchmark"
    title = ""  # the first line's, after "kvstored multi-turn benchmark", and the targets' heading's
    sizes_key = "sizes"  # the JSON's key for the tier sizes
    moto = "moto_server (in RAM)"  # the S3 line's name for moto_server
    s3_skipped = "S3 configuration skipped"  # and for the configurations that need S3, without a server
    layout = ONE_NODE
    daemon_title = "daemon counters per run (Stats deltas; bytes are the scaled bytes):"
    bounds_title = "what bounds RAM + fs at the largest count:"
    cost_configs: Sequence[Config] = CONFIGS  # the configurations whose cost of a token is printed

    def __init__(self, ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        if args.slow_disk and args.prefill_tokens_per_s is None:
            args.prefill_tokens_per_s = SLOW_DISK_PREFILL * MODELS[args.model].prefill_tokens_per_s
        default = [c.key for c in (SLOW_DISK if args.slow_disk else CONFIGS)]
        self.args = args
        self.configs = select_configs(ap, args.configs, default, CONFIG_BY_KEY, "configuration(s) {bad}")
        self.register_rates = args.slow_disk or args.register_rates

    def header_tail(self, info: dict[str, Any]) -> str:
        return f", GLIBC_TUNABLES={info['glibc_tunables'] or '(none)'}"

    def intro(self) -> list[str]:
        """The plan's lines before the model's."""
        return []

    def scaling(self, scale: list[str], p: Plan) -> list[str]:
        """The scaling lines (printed after the model's, and in the JSON)."""
        return scale

    def outro(self, p: Plan) -> list[str]:
        """The plan's last lines."""
        top, w = max(p.counts), p.w
        return [
            f"at {top} conversations: {fmt_bytes(top * w.reusable_per_conversation * p.m.kv_bytes_per_token)} of "
            f"reusable KV loaded at most (scaled), {top * w.tokens_per_conversation:,} prompt tokens"
        ]

    def config_doc(self, c: Config) -> dict[str, Any]:
        return {"key": c.key, "label": c.label, "tiers": list(c.tiers)}

    def plan_doc(self) -> dict[str, Any]:
        """The mode's own keys of the plan's JSON."""
        return {"slow_disk": self.args.slow_disk}

    def enter(self, stack: contextlib.ExitStack) -> None:
        """What the runs need beside S3 (exited after the sweep)."""

    def sweep(
        self, p: Plan, s3: S3 | None, s3_note: str, measure: Callable[[], None] | None
    ) -> tuple[list[Any], list[Any], float]:
        """The results, those of a second sweep (--route kv) and the seconds they took."""
        results, total_s = sweep(
            p.counts,
            self.configs,
            s3,
            s3_note,
            lambda config, n: run_one(config, n, p, s3),
            lambda config, n, note: RunResult(config.key, n, skipped=note),
            lambda r: (
                f"hit {100 * r.hit_rate_overall:.1f}%  {r.throughput_tokens_s:,.0f} tokens/s  "
                f"TTFT p50 {r.ttft_p50_s:.2f} s p99 {r.ttft_p99_s:.2f} s  wall {r.wall_s:.1f} s  "
                f"load {r.load_average[1]:.1f}"
            ),
            measure,
            max(len(c.label) for c in CONFIG_BY_KEY.values()),
        )
        return results, [], total_s

    def daemon_lines(self, results: Sequence[Any]) -> list[str]:
        return daemon_lines(results)

    def after_daemons(self, results: Sequence[Any], m: Model) -> list[tuple[str, list[str]]]:
        """Sections printed after the daemons' counters."""
        if not self.args.slow_disk:
            return []
        title = "slow disk: RAM + fs with the recompute gate on and off, against RAM alone:"
        return [(title, slow_disk_lines(results, m))]

    def bound_lines(self, results: Sequence[Any], m: Model, limits: Limits) -> list[str]:
        return bound_lines(results, m, limits)

    def after_bounds(self, results: Sequence[Any], more: Sequence[Any]) -> list[tuple[str, list[str]]]:
        """Sections printed after the bounds."""
        return []

    def target_rows(self, p: Plan, results: Sequence[Any], limits: Limits) -> list[dict[str, Any]]:
        return target_rows(results, p.m, limits, p.sizes_conv)

    def run_doc(self, s3: S3 | None, more: Sequence[Any]) -> dict[str, Any]:
        """The mode's own keys of the results' JSON."""
        return {"s3_endpoint": s3.endpoint.url if s3 is not None else ""}
