# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""From the flags to a Plan (workload, modelled model, tier sizes), the sweep, and the one-node mode
(OneNode; several nodes: nodes_main.SeveralNodes) with its target rows and what bounds them, with numbers:
the fs load rate RAM + fs would need at the largest count, and --slow-disk's gate on and off against RAM alone."""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from bench.lib.report import GIB, fmt_bytes, load_average
from bench.lib.s3 import S3, start_s3
from bench.multiturn.limits import Limits
from bench.multiturn.model import (
    CONFIG_BY_KEY,
    CONFIG_LABELS,
    CONFIGS,
    MODELS,
    S3_INFLIGHT,
    SLOW_DISK,
    TARGET_HIT,
    TARGET_VS_NONE,
    TARGET_VS_RAM,
    TIERS,
    Config,
    Model,
    Plan,
    Sizes,
    Workload,
    derive_model,
)
from bench.multiturn.report import TargetRows, daemon_lines, model_lines, scaling_lines, tier_limit
from bench.multiturn.runs import R, RunResult, Skipped, run_one

SLOW_DISK_PREFILL = 4.0  # x the model's prefill rate: the seed's break-even 0.95 -> 3.8 GiB/s, above the fs tier here
Measure = Callable[[], None] | None  # the sweep's measurement of the physical limits (None: --no-limits)
GATE_TOLERANCE = 0.02  # the measured load costs vary this much between runs of one configuration


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


def start_sweep_s3(kind: str, p: Plan, configs: Sequence[Config]) -> tuple[S3 | None, str]:
    """The S3 server of a sweep whose configurations use one (the caller stops it), and the line that says which."""
    if not any(c.uses("s3") for c in configs):
        return None, ""
    # radosgw keeps objects in a memstore OSD (RAM): room for the largest run's write-downs
    memstore = int(max(p.counts) * p.w.final_tokens * p.m.kv_bytes_per_token * 1.5) + GIB
    s3: S3 | None = None
    try:
        s3 = start_s3(kind, memstore)
        note = "S3: Ceph radosgw (memstore OSD) on loopback" if s3.is_rgw else "S3: moto_server (in RAM) on loopback"
    except RuntimeError as exc:
        note = f"S3 skipped: {exc}"
    print("  " + note, flush=True)
    return s3, note


def sweep(
    counts: Sequence[int],
    configs: Sequence[Config],
    s3: S3 | None,
    s3_note: str,
    run: Callable[[Config, int], R],
    skipped: Callable[..., R],
    measure: Measure,
) -> tuple[list[R], float]:
    """Every configuration at every count (the limits measured before and after, unless None), one progress
    line per run with its wall seconds and load average; a run that raises Skipped, or needs S3 without a
    server, is reported skipped: skipped(config key, count, skipped=why)."""
    results: list[R] = []
    t_start = time.perf_counter()
    width = max(len(c.label) for c in configs)
    if measure is not None:
        measure()
    for count, config in itertools.product(counts, configs):
        t0, load0 = time.perf_counter(), load_average()
        try:
            if config.uses("s3") and s3 is None:
                raise Skipped(s3_note)
            r = run(config, count)
        except Skipped as why:
            r = skipped(config.key, count, skipped=str(why))
        r.wall_s, r.load_average = time.perf_counter() - t0, (load0, load_average())
        results.append(r)
        took = f"[{time.perf_counter() - t_start:6.0f} s]"
        print(f"  {took} {config.label:>{width}} x {count:>3}: {r.skipped or r.progress()}", flush=True)
    if measure is not None:
        measure()
    return results, time.perf_counter() - t_start


def at_top(results: Sequence[R], *keys: str) -> tuple[int, list[R | None]]:
    """The largest count and the runs of these configurations at it (None: skipped or not run)."""
    runs = {(r.config, r.conversations): r for r in results if not r.skipped}
    top = max((r.conversations for r in results), default=0)
    return top, [runs.get((key, top)) for key in keys]


def target_rows(results: Sequence[RunResult], m: Model, limits: Limits, conv: dict[str, float]) -> TargetRows:
    """The targets at the largest count, and the informational ratios (conv: the sizes in conversations)."""
    rows = TargetRows()
    top, (none, ram, fs, s3) = at_top(results, "none", "ram", "ram+fs", "ram+fs+s3")
    if fs is not None:
        capacity = f"capacity: GPU {conv['gpu']:.0f} + RAM {conv['ram']:g} + fs {conv['fs']:g} conversations for {top}"
        name = f"RAM + fs hit rate, {top} conversations"
        rows.hit_rate(name, fs, TARGET_HIT, capacity)
        fs_limit = tier_limit(fs, "fs", limits, m)
        rows.vs(f"RAM + fs vs no offload, {top} conversations", fs, "no offload", none, TARGET_VS_NONE, fs_limit)
        rows.vs(f"RAM + fs vs RAM alone, {top} conversations", fs, "RAM alone", ram, TARGET_VS_RAM, fs_limit)
    for label, r in (("RAM", ram), ("RAM + fs + S3", s3)):
        if r is not None:
            limit = tier_limit(r, r.config.split("+")[-1], limits, m)
            rows.vs(f"{label} vs no offload, {top} conversations", r, "no offload", none, None, limit)
    raw = {
        "ram": ("memcpy, 2 MiB pieces", limits.median("memcpy")),
        "fs": (f"raw O_DIRECT read, {limits.batch_chunks}-chunk batches", limits.median("odirect_batched")),
        "s3": (f"raw GET, {S3_INFLIGHT} in flight", limits.median("s3_get")),
    }
    for tier, r in (("ram", ram), ("fs", fs), ("s3", s3)):
        rows.loads(tier, r, raw[tier], CONFIG_LABELS, m)
    return rows


def bound_lines(results: Sequence[RunResult], m: Model, limits: Limits) -> list[str]:
    """What bounds RAM + fs at the largest count: where the loader's modelled time went, the fs load rate
    the targets would need (the loader busy for the same share of a shorter makespan; all the time: lower),
    and whether this machine's disk could deliver it."""
    top, (none, ram, fs) = at_top(results, "none", "ram", "ram+fs")
    if fs is None or none is None or not fs.loaded_bytes:
        return []
    fs_full = fs.loaded_bytes.get("fs", 0) * m.byte_scale
    fs_charged = fs.charged_s.get("fs", 0.0)
    other = fs.loader_busy_s - (fs_charged - fs.charged_fixed_s.get("fs", 0.0))  # everything but fs bytes
    goal = min([none.makespan_s / TARGET_VS_NONE] + ([ram.makespan_s / TARGET_VS_RAM] if ram is not None else []))
    lines = [
        f"RAM + fs at {top}: makespan {fs.makespan_s:,.0f} modelled s; the loader was busy {fs.loader_busy_s:,.0f} s "
        f"({100 * fs.loader_busy:.0f}%: fs {fs_charged:,.0f} s for {fmt_bytes(fs_full)} at full size, "
        + ", ".join(f"{t} {s:,.0f} s" for t, s in fs.charged_s.items() if t != "fs")
        + f", lookups {fs.lookup_s:,.1f} s), the GPU {fs.gpu_busy_s:,.0f} s ({100 * fs.gpu_busy:.0f}%)",
        f"for >= {TARGET_VS_NONE:g}x no offload ({none.makespan_s:,.0f} s)"
        + (f" and >= {TARGET_VS_RAM:g}x RAM alone ({ram.makespan_s:,.0f} s)" if ram is not None else "")
        + f", the makespan must be <= {goal:,.0f} s",
    ]
    util = max(fs.loader_busy, 1e-9)
    room, room_full = util * goal - other, goal - other
    why = ""
    if fs.think_floor_s >= goal:
        why = f"the conversations' own start and think times take {fs.think_floor_s:,.0f} s: no cache reaches that"
    elif fs.gpu_busy_s >= goal:
        why = (
            f"the GPU's own compute ({fs.gpu_busy_s:,.0f} s) exceeds that: the hit rate bounds the ratio, not the disk"
        )
    elif not fs_full:
        why = "the fs tier served nothing at this count: the workload's pace bounds the ratio"
    elif room_full <= 0:
        why = f"the loader's other work ({other:,.0f} s) alone exceeds that: loads from RAM and lookups bound the ratio"
    if why:
        return lines + [why]
    needed_full = fs_full / room_full / GIB
    needed = fs_full / room / GIB if room > 0 else float("inf")
    fs_rate = fs.marginal_gib_s.get("fs")
    stream, batched = limits.median("odirect_stream"), limits.median("odirect_batched")
    raw = max(x for x in (stream, batched, 0.0) if x is not None)
    measured = "not measured"
    if stream and batched:
        measured = f"{batched:.2f} in <= {limits.batch_chunks}-chunk calls, {stream:.2f} streaming"
    lines.append(
        f"so fs loads would need >= {needed:.2f} GiB/s at full size ({fs_full / GIB:,.0f} GiB with the loader busy "
        f"{100 * util:.0f}% of {goal:,.0f} s, beside {other:,.0f} s of other loader work; >= {needed_full:.2f} with it "
        f"busy all the time); measured: {f'{fs_rate:.2f}' if fs_rate else '-'} GiB/s (marginal) through the daemon; "
        f"raw O_DIRECT read here: {measured}; break-even {m.breakeven_gib_s:.2f}"
    )
    if raw and needed > raw:
        lines.append(
            f"this machine's disk is the limit: raw O_DIRECT reads ({raw:.2f} GiB/s at best) fall short of {needed:.2f}"
        )
    elif fs_rate and needed > fs_rate:
        lines.append(f"the disk could do it (raw {raw:.2f} GiB/s): the fs tier's load path ({fs_rate:.2f}) is the gap")
    else:
        lines.append("the fs load rate suffices on paper: queueing between the loader and the GPU is the gap")
    return lines


def slow_disk_lines(results: Sequence[RunResult], m: Model) -> list[str]:
    """--slow-disk: each count's RAM + fs (gate on, gate off) throughput over RAM alone's; the target is
    that with the gate on RAM + fs never does worse than RAM alone."""
    runs = {(r.config, r.conversations): r for r in results if not r.skipped}
    lines = [
        f"break-even {m.breakeven_gib_s:.2f} GiB/s ({m.prefill_tokens_per_s:,.0f} prefill tokens/s x "
        f"{m.model_kv_bytes_per_token:,} KV bytes/token; registered as {m.gate_prefill_tokens_per_s:,.0f} "
        f"tokens/s of {m.kv_bytes_per_token} real bytes); target: gate on >= {1 - GATE_TOLERANCE:.2f}x RAM alone"
    ]
    for n in sorted({r.conversations for r in results}):
        if (ram := runs.get(("ram", n))) is None:
            continue
        parts = []
        for key, label in (("ram+fs", "gate on"), ("ram+fs-nogate", "gate off")):
            if (r := runs.get((key, n))) is None:
                continue
            ratio = r.throughput_tokens_s / ram.throughput_tokens_s
            fs_rate = r.marginal_gib_s.get("fs")
            parts.append(
                f"{label} {ratio:.2f}x (fs hits {100 * r.hit_rate.get('fs', 0):.1f}%, fs "
                f"{f'{fs_rate:.2f} GiB/s' if fs_rate else '-'}, "
                f"{r.daemon.get('fs', {}).get('skipped_slow_hits', 0)} hits skipped as slower than recompute)"
                + (" " + ("PASS" if ratio >= 1 - GATE_TOLERANCE else "MISS") if key == "ram+fs" else "")
            )
        lines.append(f"{n} conversations: RAM alone {ram.throughput_tokens_s:,.0f} tokens/s; " + "; ".join(parts))
    return lines


class OneNode:
    """The mode: one node (every configuration on a daemon of its own); SeveralNodes (nodes_main.py)
    overrides what several nodes do differently. cli.main is the rest, in the order it prints."""

    benchmark = "multiturn"  # the JSON's "benchmark"
    title = ""  # the first line's, after "kvstored multi-turn benchmark", and the targets' heading's
    sizes_key = "sizes"  # the JSON's key for the tier sizes
    config_flags: tuple[str, ...] = ()  # the Config fields the JSON's configs show beside key, label and tiers
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
        self.args, self.register_rates = args, args.slow_disk or args.register_rates
        self.configs = select_configs(ap, args.configs, default, CONFIG_BY_KEY, "configuration(s) {bad}")

    def plan_lines(self, p: Plan) -> tuple[list[str], list[str]]:
        """What the plan prints (the model's lines among them), and its scaling lines (also in the JSON)."""
        scale, top, w = scaling_lines(p), max(p.counts), p.w
        turns = range(1, w.turns + 1)
        loaded = fmt_bytes(top * sum(map(w.reusable_chunks, turns)) * w.chunk_tokens * p.m.kv_bytes_per_token)
        tokens = f"{top * sum(map(w.prompt_tokens, turns)):,} prompt tokens"
        largest = f"at {top} conversations: {loaded} of reusable KV loaded at most (scaled), {tokens}"
        return [*model_lines(p.m, p.basis), *scale, largest], scale

    def plan_doc(self) -> dict[str, Any]:
        """The mode's own keys of the plan's JSON."""
        return {"slow_disk": self.args.slow_disk}

    def sweep(self, p: Plan, s3: S3 | None, s3_note: str, measure: Measure) -> tuple[list, list, float]:
        """The results, those of a second sweep (--route kv) and the seconds they took."""
        results, total_s = sweep(p.counts, self.configs, s3, s3_note, partial(run_one, p=p, s3=s3), RunResult, measure)
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
