# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What bounds the multi-turn targets, with numbers: the fs load rate RAM + fs would need at the
largest count, and --slow-disk's gate on and off against RAM alone."""

from __future__ import annotations

from collections.abc import Sequence

from bench.lib.report import GIB, fmt_bytes
from bench.multiturn.limits import Limits
from bench.multiturn.model import TARGET_VS_NONE, TARGET_VS_RAM, Model
from bench.multiturn.runs import RunResult


def bound_lines(results: Sequence[RunResult], m: Model, limits: Limits) -> list[str]:
    """What bounds RAM + fs at the largest count, with numbers: where the loader's modelled time went,
    the fs load rate the targets would need, and whether this machine's disk could deliver it. The
    needed rate assumes the loader stays busy for the same share of the (shorter) makespan as in
    this run; with a loader busy all the time (a bound no run reaches) it is lower, printed too."""
    runs = {(r.config, r.conversations): r for r in results if not r.skipped}
    counts = sorted({r.conversations for r in results})
    if not counts:
        return []
    top = counts[-1]
    none, ram, fs = (runs.get((c, top)) for c in ("none", "ram", "ram+fs"))
    if fs is None or none is None or not fs.loaded_bytes:
        return []
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    fs_full = fs.loaded_bytes.get("fs", 0) * m.byte_scale
    fs_charged = fs.charged_s.get("fs", 0.0)
    other = fs.loader_busy_s - (fs_charged - fs.charged_fixed_s.get("fs", 0.0))  # everything but fs bytes
    goal = min([none.makespan_s / TARGET_VS_NONE] + ([ram.makespan_s / TARGET_VS_RAM] if ram is not None else []))
    lines = [
        f"RAM + fs at {top}: makespan {fs.makespan_s:,.0f} modelled s; the loader was busy {fs.loader_busy_s:,.0f} s "
        f"({100 * fs.loader_busy:.0f}%: fs {fs_charged:,.0f} s for {fmt_bytes(fs_full)} at full size, "
        + ", ".join(f"{t} {fs.charged_s[t]:,.0f} s" for t in fs.charged_s if t != "fs")
        + f", lookups {fs.lookup_s:,.1f} s), the GPU {fs.gpu_busy_s:,.0f} s ({100 * fs.gpu_busy:.0f}%)",
        f"for >= {TARGET_VS_NONE:g}x no offload ({none.makespan_s:,.0f} s)"
        + (f" and >= {TARGET_VS_RAM:g}x RAM alone ({ram.makespan_s:,.0f} s)" if ram is not None else "")
        + f", the makespan must be <= {goal:,.0f} s",
    ]
    if fs.think_floor_s >= goal:
        return lines + [
            f"the conversations' own start and think times take {fs.think_floor_s:,.0f} s: no cache "
            f"reaches that at {top} conversations"
        ]
    if fs.gpu_busy_s >= goal:
        return lines + [
            f"the GPU's own compute ({fs.gpu_busy_s:,.0f} s) exceeds that: the hit rate bounds the ratio, not the disk"
        ]
    if not fs_full:
        return lines + ["the fs tier served nothing at this count: the workload's pace bounds the ratio"]
    util = max(fs.loader_busy, 1e-9)
    room, room_full = util * goal - other, goal - other
    if room_full <= 0:
        return lines + [
            f"the loader's other work ({other:,.0f} s) alone exceeds that: loads from RAM and lookups bound the ratio"
        ]
    needed_full = fs_full / room_full / GIB
    needed = fs_full / room / GIB if room > 0 else float("inf")
    fs_rate = fs.marginal_gib_s.get("fs")
    stream, batched = limits.median("odirect_stream"), limits.median("odirect_batched")
    raw = max(x for x in (stream, batched, 0.0) if x is not None)
    lines.append(
        f"so fs loads would need >= {needed:.2f} GiB/s at full size ({fs_full / GIB:,.0f} GiB with the loader busy "
        f"{100 * util:.0f}% of {goal:,.0f} s, beside {other:,.0f} s of other loader work; >= {needed_full:.2f} with it "
        f"busy all the time); measured: " + (f"{fs_rate:.2f}" if fs_rate else "-") + " GiB/s (marginal) through the "
        "daemon; raw O_DIRECT read here: "
        + (
            f"{batched:.2f} in <= {limits.batch_chunks}-chunk calls, {stream:.2f} streaming"
            if stream and batched
            else "not measured"
        )
        + f"; break-even {breakeven:.2f}"
    )
    if raw and needed > raw:
        lines.append(
            f"this machine's disk is the limit: raw O_DIRECT reads ({raw:.2f} GiB/s at best) fall short of "
            "the "
            f"{needed:.2f} GiB/s the targets need"
        )
    elif fs_rate and needed > fs_rate:
        lines.append(f"the disk could do it (raw {raw:.2f} GiB/s): the fs tier's load path ({fs_rate:.2f}) is the gap")
    else:
        lines.append("the fs load rate suffices on paper: queueing between the loader and the GPU is the gap")
    return lines


GATE_TOLERANCE = 0.02  # the measured load costs vary this much between runs of one configuration


def slow_disk_lines(results: Sequence[RunResult], m: Model) -> list[str]:
    """--slow-disk: each count's RAM + fs (gate on, gate off) throughput over RAM alone's; the
    target is that with the gate on RAM + fs never does worse than RAM alone."""
    runs = {(r.config, r.conversations): r for r in results if not r.skipped}
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    lines = [
        f"break-even {breakeven:.2f} GiB/s ({m.prefill_tokens_per_s:,.0f} prefill tokens/s x "
        f"{m.model_kv_bytes_per_token:,} KV bytes/token; registered as {m.gate_prefill_tokens_per_s:,.0f} "
        f"tokens/s of {m.kv_bytes_per_token} real bytes); target: gate on >= {1 - GATE_TOLERANCE:.2f}x RAM alone"
    ]
    for n in sorted({r.conversations for r in results}):
        ram = runs.get(("ram", n))
        if ram is None:
            continue
        parts = []
        for key, label in (("ram+fs", "gate on"), ("ram+fs-nogate", "gate off")):
            r = runs.get((key, n))
            if r is None:
                continue
            ratio = r.throughput_tokens_s / ram.throughput_tokens_s
            fs_rate = r.marginal_gib_s.get("fs")
            part = (
                f"{label} {ratio:.2f}x (fs hits {100 * r.hit_rate.get('fs', 0):.1f}%, fs "
                f"{f'{fs_rate:.2f} GiB/s' if fs_rate else '-'}, "
                f"{r.daemon.get('fs', {}).get('skipped_slow_hits', 0)} hits skipped as slower than recompute)"
            )
            if key == "ram+fs":
                part += " " + ("PASS" if ratio >= 1 - GATE_TOLERANCE else "MISS")
            parts.append(part)
        lines.append(f"{n} conversations: RAM alone {ram.throughput_tokens_s:,.0f} tokens/s; " + "; ".join(parts))
    return lines
