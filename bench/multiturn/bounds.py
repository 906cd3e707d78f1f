# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""One node's target rows and what bounds them, with numbers: the fs load rate RAM + fs would need at
the largest count, and --slow-disk's gate on and off against RAM alone."""

from __future__ import annotations

from collections.abc import Sequence

from bench.lib.report import GIB, fmt_bytes
from bench.multiturn.limits import Limits
from bench.multiturn.model import CONFIG_LABELS, S3_INFLIGHT, TARGET_HIT, TARGET_VS_NONE, TARGET_VS_RAM, Model
from bench.multiturn.report import TargetRows, tier_limit
from bench.multiturn.runs import RunResult

GATE_TOLERANCE = 0.02  # the measured load costs vary this much between runs of one configuration


def at_top(results: Sequence[RunResult], *keys: str) -> tuple[int, list[RunResult | None]]:
    """The largest count and the runs of these configurations at it (None: skipped or not run)."""
    runs = {(r.config, r.conversations): r for r in results if not r.skipped}
    top = max((r.conversations for r in results), default=0)
    return top, [runs.get((key, top)) for key in keys]


def target_rows(results: Sequence[RunResult], m: Model, limits: Limits, sizes_conv: dict[str, float]) -> TargetRows:
    """The targets at the largest count, and the informational ratios."""
    rows = TargetRows()
    top, (none, ram, fs, s3) = at_top(results, "none", "ram", "ram+fs", "ram+fs+s3")
    if fs is not None:
        conv = sizes_conv
        capacity = f"capacity: GPU {conv['gpu']:.0f} + RAM {conv['ram']:g} + fs {conv['fs']:g} conversations for {top}"
        name = f"RAM + fs hit rate, {top} conversations"
        rows.add(name, fs.hit_rate_overall, "share", ("all reusable tokens", 1.0), TARGET_HIT, capacity)
        fs_limit = tier_limit(fs, "fs", limits, m)
        if none is not None:
            rows.vs(f"RAM + fs vs no offload, {top} conversations", fs, "no offload", none, TARGET_VS_NONE, fs_limit)
        if ram is not None:
            rows.vs(f"RAM + fs vs RAM alone, {top} conversations", fs, "RAM alone", ram, TARGET_VS_RAM, fs_limit)
    for label, r in (("RAM", ram), ("RAM + fs + S3", s3)):
        if r is not None and none is not None:
            limit = tier_limit(r, r.config.split("+")[-1], limits, m)
            rows.vs(f"{label} vs no offload, {top} conversations", r, "no offload", none, None, limit)
    raw = {
        "ram": ("memcpy, 2 MiB pieces", limits.median("memcpy")),
        "fs": (f"raw O_DIRECT read, {limits.batch_chunks}-chunk batches", limits.median("odirect_batched")),
        "s3": (f"raw GET, {S3_INFLIGHT} in flight", limits.median("s3_get")),
    }
    for tier, r in (("ram", ram), ("fs", fs), ("s3", s3)):
        rows.loads(tier, r, raw[tier], top, CONFIG_LABELS, m)
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
    else:
        why = ""
    if why:
        return lines + [why]
    needed_full = fs_full / room_full / GIB
    needed = fs_full / room / GIB if room > 0 else float("inf")
    fs_rate = fs.marginal_gib_s.get("fs")
    stream, batched = limits.median("odirect_stream"), limits.median("odirect_batched")
    raw = max(x for x in (stream, batched, 0.0) if x is not None)
    measured = (
        f"{batched:.2f} in <= {limits.batch_chunks}-chunk calls, {stream:.2f} streaming"
        if stream and batched
        else "not measured"
    )
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
