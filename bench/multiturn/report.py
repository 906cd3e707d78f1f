# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What the multi-turn benchmark prints: the model, the scaling, the results table, the daemons'
counters, the physical limits, the cost of a token per tier, the target rows (what bounds them:
bounds.py)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.lib.report import GIB, Row, fmt_bytes, print_aligned
from bench.multiturn.limits import Limits
from bench.multiturn.model import (
    CONFIG_LABELS,
    FS_IO_THREADS,
    S3_INFLIGHT,
    TARGET_HIT,
    TARGET_VS_NONE,
    TARGET_VS_RAM,
    TIERS,
    Basis,
    Config,
    Model,
    Sizes,
    Workload,
)
from bench.multiturn.runs import RunResult


def scaling_lines(w: Workload, m: Model, sizes: Sizes, ram_conv: float, fs_conv: float, s3_fs_conv: float) -> list[str]:
    full = m.byte_scale

    def size(nbytes: int) -> str:
        return f"{fmt_bytes(nbytes)}; {fmt_bytes(nbytes * full)} at full size"

    return [
        f"workload: {w.initial_tokens}-token first prompt + {w.turn_tokens} tokens per turn, {w.turns} turns "
        f"(last prompt {w.final_tokens} tokens), think time {w.think_s:g} s (uniform 0.5-1.5x), "
        f"chunks of {w.chunk_tokens} tokens, seed {w.seed}; loads "
        f"{'on the GPU timeline' if m.serial_loads else 'beside compute (async loader)'}",
        f"scaled: KV bytes/token {m.model_kv_bytes_per_token:,} -> {m.kv_bytes_per_token} (1/{m.byte_scale:g}); "
        f"chunk {fmt_bytes(w.chunk_tokens * m.model_kv_bytes_per_token)} -> "
        f"{fmt_bytes(w.chunk_tokens * m.kv_bytes_per_token)}; each tier's measured cost per byte x{m.byte_scale:g} "
        f"charges the full-size bytes (lookups and the fixed cost of a load call: as measured)",
        f"sized in conversations at their last turn ({w.final_tokens} tokens): GPU "
        f"{m.gpu_tokens / w.final_tokens:.1f} ({m.gpu_tokens:,} tokens = "
        f"{fmt_bytes(m.gpu_tokens * m.model_kv_bytes_per_token)}), RAM tier {ram_conv:g} ({size(sizes.ram_bytes)}), "
        f"fs {fs_conv:g} ({size(sizes.fs_bytes)}); in RAM + fs + S3: fs {s3_fs_conv:g} ({size(sizes.s3_fs_bytes)}), "
        f"S3 {'unbounded' if not sizes.s3_bytes else size(sizes.s3_bytes)}",
    ]


def model_lines(m: Model, basis: Sequence[Basis]) -> list[str]:
    width = max(len(b.quantity) for b in basis)
    vwidth = max(len(b.value) for b in basis)
    return [f"model: {m.model_name} (--model {m.model_key})"] + [
        f"  {b.quantity:<{width}}  {b.value:>{vwidth}}  {b.basis}" for b in basis
    ]


def limit_lines(limits: Limits, chunk_bytes: int) -> list[str]:
    def fmt(name: str) -> str:
        samples = getattr(limits, name)
        if not samples:
            return "not measured"
        return f"{np.median(samples):.2f} GiB/s (median of {len(samples)}; {min(samples):.2f}-{max(samples):.2f})"

    lines = [
        f"memcpy, 2 MiB pieces, one thread (a RAM-tier load's copy): {fmt('memcpy')}",
        f"raw O_DIRECT read, 2 MiB files, {FS_IO_THREADS} threads, streaming: {fmt('odirect_stream')}",
        f"raw O_DIRECT read, the same, {limits.batch_chunks}-chunk batches one at a time (the loader's pattern): "
        f"{fmt('odirect_batched')}",
        f"raw aiobotocore GET, 2 MiB objects, {S3_INFLIGHT} in flight: {fmt('s3_get')}",
    ]
    if limits.raw_tcp is not None:
        tcp = f"raw TCP on loopback, {fmt_bytes(chunk_bytes)} chunks into 16 slots (bench/lib/raw_net.py)"
        lines.append(f"{tcp}: {fmt('raw_tcp')}")
    return lines + [f"note: {n}" for n in limits.notes]


@dataclass(frozen=True)
class Layout:
    """How a sweep's results table prints: one node's configurations, or the set-ups of several nodes."""

    labels: dict[str, str]
    hit_tiers: tuple[str, ...]  # where a reusable chunk was found ("gpu" first)
    setup: str  # the first column's title
    note: str  # printed under the table
    loaded_column: bool  # the scaled bytes loaded per tier
    gib_right: bool  # the GiB/s column right-aligned
    skip_reason: bool  # a skipped run says why in the table

    @property
    def loaded_tiers(self) -> tuple[str, ...]:
        return tuple(t for t in self.hit_tiers if t != "gpu")


ONE_NODE = Layout(
    CONFIG_LABELS,
    TIERS,
    "config",
    "hit rates: shares of the reusable tokens (the previous turn's prompt); tokens/s, TTFT, busy: modelled; "
    "loaded: scaled bytes really moved; GiB/s: their measured rate (marginal: median per-byte cost of the "
    "load calls, fixed call cost removed; what the model charges, x the byte scale)",
    loaded_column=True,
    gib_right=True,
    skip_reason=False,
)


def print_results(results: Sequence[Any], layout: Layout = ONE_NODE, file=None) -> None:
    """One line per run (RunResult or NodesRunResult): hit rates per tier, modelled throughput and
    latency, the measured load rates."""
    file = file or sys.stdout
    loaded = layout.loaded_tiers
    base = {r.conversations: r.throughput_tokens_s for r in results if r.config == "none" and not r.skipped}
    header = [layout.setup, "convs", f"hit {layout.hit_tiers[0]}", *layout.hit_tiers[1:], "overall", "tokens/s"]
    header += ["vs none", "TTFT p50", "p99", "gpu busy", "loader"]
    header += [f"loaded {'/'.join(loaded)}"] * layout.loaded_column + [f"GiB/s {'/'.join(loaded)} (marginal)", "wall"]
    rows = [header]
    for r in results:
        if r.skipped:
            why = "skipped: " + r.skipped[:80] if layout.skip_reason else "skipped"
            rows.append([layout.labels[r.config], str(r.conversations), why] + [""] * (len(header) - 3))
            continue
        ratio = r.throughput_tokens_s / base[r.conversations] if base.get(r.conversations) else None
        gib = "-"
        if r.loaded_bytes:
            gib = "/".join(f"{r.load_gib_s[t]:.2f}" if t in r.load_gib_s else "-" for t in loaded)
            gib += " (" + "/".join(f"{r.marginal_gib_s[t]:.2f}" if t in r.marginal_gib_s else "-" for t in loaded) + ")"
        row = [
            layout.labels[r.config],
            str(r.conversations),
            *(f"{100 * r.hit_rate[t]:.1f}%" for t in layout.hit_tiers),
        ]
        row += [f"{100 * r.hit_rate_overall:.1f}%", f"{r.throughput_tokens_s:,.0f}", f"{ratio:.2f}x" if ratio else ""]
        row += [
            f"{r.ttft_p50_s:.2f} s",
            f"{r.ttft_p99_s:.2f} s",
            f"{100 * r.gpu_busy:.0f}%",
            f"{100 * r.loader_busy:.0f}%",
        ]
        if layout.loaded_column:
            row.append("/".join(fmt_bytes(r.loaded_bytes.get(t, 0)) for t in loaded) if r.loaded_bytes else "-")
        rows.append(row + [gib, f"{r.wall_s:.0f} s"])
    gib_col = len(header) - 2
    left = {0, gib_col - 1} if layout.loaded_column else {0}
    right = set(range(len(header))) - left - (set() if layout.gib_right else {gib_col})
    print_aligned(rows, right=right, file=file)
    print(layout.note, file=file)


TROUBLE = ("dropped_dirty", "dropped_backpressure", "errors", "checksum_failures", "rejected_full")  # Stats, when not 0


def daemon_lines(results: Sequence[RunResult]) -> list[str]:
    lines = []
    for r in results:
        if r.skipped or not r.daemon or not (r.lookups or any(r.store.get(k) for k in ("stored", "already_present"))):
            continue
        parts = []
        for name, d in r.daemon.items():
            extra = [f"{k} {d[k]}" for k in TROUBLE if d.get(k)]
            if name == "ram":  # the RAM tier counts chunks, not bytes
                parts.append(
                    f"ram: {d['loaded_chunks']} chunks leased, {d['stored_chunks']} stored"
                    + (f", promotions {d['promotions']}" if d.get("promotions") else "")
                    + (f", write-downs {d['writedowns']}" if d.get("writedowns") else "")
                    + (f", evictions {d['evictions']}" if d.get("evictions") else "")
                    + "".join(f", {e}" for e in extra)
                )
                continue
            parts.append(
                f"{name}: read {fmt_bytes(d['read_bytes'])} written {fmt_bytes(d['written_bytes'])}"
                + (f" promotions {d['promotions']}" if d.get("promotions") else "")
                + (f" evictions {d['evictions']}" if d.get("evictions") else "")
                + ("".join(f", {e}" for e in extra))
            )
        st = r.store
        lines.append(
            f"{CONFIG_LABELS[r.config]:>13} {r.conversations:>4}: "
            + "; ".join(parts)
            + f" | client stores {st['stored']} new, {st['already_present']} present, {st['dropped']} "
            f"dropped, {st['gib_s']:.2f} GiB/s | lookup p50 {r.lookup_ms_p50:.2f} ms, load call floor "
            f"{r.load_call_floor_ms:.2f} ms x {r.load_calls}"
            + (f" | {r.load_shortfall_chunks} chunks gone between lookup and load" if r.load_shortfall_chunks else "")
            + (f" | CORRUPT {r.corrupt_chunks}" if r.corrupt_chunks else "")
        )
    return lines


RAW = {  # a tier -> the raw rate beneath it: its name, its Limits field (raw_tcp: measured with --nodes)
    "ram": ("memcpy", "memcpy"),
    "fs": ("raw O_DIRECT, streaming", "odirect_stream"),
    "peer": ("raw TCP on loopback", "raw_tcp"),
    "s3": ("raw GET", "s3_get"),
}


def raw_limit(limits: Limits, tier: str) -> tuple[str, float | None]:
    name, key = RAW[tier]
    return name, limits.median(key)


def cost_lines(results: Sequence[Any], m: Model, limits: Limits, configs: Sequence[Config]) -> list[str]:
    """What a token served from each tier costs, relative to recomputing it: the break-even
    bandwidth (KV bytes per token x prefill rate) over the tier's measured marginal rate, and the
    raw device's rate beneath it (one node: what that would cost; with --nodes: the rate)."""
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    one_node = limits.raw_tcp is None
    lines = [
        f"break-even load bandwidth ({m.model_kv_bytes_per_token:,} KV bytes/token x "
        f"{m.prefill_tokens_per_s:,.0f} prefill tokens/s): {breakeven:.2f} GiB/s"
        + (" -- a tier slower than that costs more per token than recomputing" if one_node else "")
    ]
    for config in configs:
        rs = [r for r in results if r.config == config.key and not r.skipped and r.marginal_gib_s]
        if not rs:
            continue
        r = max(rs, key=lambda x: x.conversations)
        parts = []
        for t in RAW:
            if t not in r.marginal_gib_s:
                continue
            part = f"{t} {r.marginal_gib_s[t]:.2f} GiB/s = {breakeven / r.marginal_gib_s[t]:.2f}x a recompute"
            name, rate = raw_limit(limits, t)
            if rate:
                part += (
                    f" ({name} {rate:.2f} GiB/s would be {breakeven / rate:.2f}x)"
                    if one_node
                    else f" ({name} {rate:.2f})"
                )
            parts.append(part)
        lines.append(f"{config.label} at {r.conversations}: " + "; ".join(parts))
    return lines


def _tier_limit(tier: str, r: RunResult | None, limits: Limits, breakeven: float) -> str:
    """The tier's measured marginal load rate in `r` beside the raw rate of the hardware under it."""
    if r is None or tier not in r.load_gib_s:
        got = f"{tier} loads not measured"
    else:
        rate = r.marginal_gib_s.get(tier)
        got = f"{tier} loads {r.load_gib_s[tier]:.2f} GiB/s all-in, " + (
            f"{rate:.2f} marginal (charged)" if rate else "only their fixed cost charged"
        )
    if tier == "ram":
        raw = limits.median("memcpy")
        return got + (f" vs memcpy {raw:.2f}" if raw else "")
    if tier == "fs":
        stream, batched = limits.median("odirect_stream"), limits.median("odirect_batched")
        return (
            got
            + (
                f" vs raw O_DIRECT {batched:.2f} (<= {limits.batch_chunks}-chunk calls) / {stream:.2f} (streaming)"
                if stream and batched
                else ""
            )
            + f"; break-even {breakeven:.2f}"
        )
    raw = limits.median("s3_get")
    return got + (f" vs raw GET {raw:.2f}" if raw else "") + f"; break-even {breakeven:.2f}"


def _busy(r: RunResult) -> str:
    return f"; loader busy {100 * r.loader_busy:.0f}%, GPU {100 * r.gpu_busy:.0f}%"


class TargetRows(list[dict[str, Any]]):
    """A sweep's targets and ratios as rows: name, value, baseline, ratio, target, status (as the
    other benchmarks' JSON) and `limit`: what bounds it on this machine."""

    def add(
        self,
        name: str,
        value: float,
        unit: str,
        baseline_name: str,
        baseline: float | None,
        target: float | None,
        limit: str,
    ) -> None:
        self.append({**Row(name, value, unit, baseline_name, baseline, target).to_json(), "limit": limit})

    def vs(self, name: str, r: Any, baseline_name: str, base: Any, target: float | None, limit: str) -> None:
        """Run r's modelled throughput against run base's."""
        self.add(name, r.throughput_tokens_s, "tokens/s", baseline_name, base.throughput_tokens_s, target, limit)

    def loads(
        self, tier: str, r: Any, label: str, raw: tuple[str, float | None], charged: str, breakeven: float
    ) -> None:
        """The all-in load rate of a tier in run r beside the raw rate beneath it (when it loaded)."""
        if r is None or tier not in r.load_gib_s:
            return
        marginal = r.marginal_gib_s.get(tier)
        limit = (
            f"marginal {marginal:.2f} GiB/s ({charged})"
            if marginal
            else "no per-byte cost above the fixed cost per call"
        )
        self.add(
            f"{tier} tier loads, all-in ({label})",
            r.load_gib_s[tier],
            "GiB/s",
            *raw,
            None,
            limit + f"; break-even {breakeven:.2f} GiB/s",
        )


def target_rows(results: Sequence[RunResult], m: Model, limits: Limits, sizes_conv: dict[str, float]) -> TargetRows:
    """The targets at the largest count, and the informational ratios."""
    rows = TargetRows()
    runs = {(r.config, r.conversations): r for r in results if not r.skipped}
    counts = sorted({r.conversations for r in results})
    if not counts:
        return rows
    top = counts[-1]
    none, ram, fs, s3 = (runs.get((c, top)) for c in ("none", "ram", "ram+fs", "ram+fs+s3"))
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    if fs is not None:
        capacity = (
            f"capacity: GPU {sizes_conv['gpu']:.0f} + RAM {sizes_conv['ram']:g} + fs {sizes_conv['fs']:g} "
            f"conversations for {top}"
        )
        rows.add(
            f"RAM + fs hit rate, {top} conversations",
            fs.hit_rate_overall,
            "share",
            "all reusable tokens",
            1.0,
            TARGET_HIT,
            capacity,
        )
        fs_limit = _tier_limit("fs", fs, limits, breakeven) + _busy(fs)
        if none is not None:
            rows.vs(f"RAM + fs vs no offload, {top} conversations", fs, "no offload", none, TARGET_VS_NONE, fs_limit)
        if ram is not None:
            rows.vs(f"RAM + fs vs RAM alone, {top} conversations", fs, "RAM alone", ram, TARGET_VS_RAM, fs_limit)
    if ram is not None and none is not None:
        limit = _tier_limit("ram", ram, limits, breakeven) + _busy(ram)
        rows.vs(f"RAM vs no offload, {top} conversations", ram, "no offload", none, None, limit)
    if s3 is not None and none is not None:
        limit = _tier_limit("s3", s3, limits, breakeven) + _busy(s3)
        rows.vs(f"RAM + fs + S3 vs no offload, {top} conversations", s3, "no offload", none, None, limit)
    tier_rows = (
        ("ram", ram, "memcpy, 2 MiB pieces", "memcpy"),
        ("fs", fs, f"raw O_DIRECT read, {limits.batch_chunks}-chunk batches", "odirect_batched"),
        ("s3", s3, f"raw GET, {S3_INFLIGHT} in flight", "s3_get"),
    )
    charged = "fixed cost per call removed: what the model charges"
    for tier, r, raw_name, raw_key in tier_rows:
        label = f"{CONFIG_LABELS[r.config]}, {top}" if r is not None else ""
        rows.loads(tier, r, label, (raw_name, limits.median(raw_key)), charged, breakeven)
    return rows


def _fmt_value(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "share":
        return f"{100 * v:.1f}%"
    if unit == "tokens/s":
        return f"{v:,.0f} tokens/s"
    return f"{v:.2f} {unit}"


def print_rows(rows: Sequence[dict[str, Any]], file=None) -> None:
    table = [["measurement", "value", "baseline", "", "ratio", "target", "result", "bounded by (this machine)"]]
    for r in rows:
        table.append(
            [
                r["name"],
                _fmt_value(r["value"], r["unit"]),
                r["baseline_name"],
                _fmt_value(r["baseline"], r["unit"]),
                f"{r['ratio']:.2f}x" if r["ratio"] is not None else "",
                f">= {r['target']:.2f}x" if r["target"] is not None else "",
                r["status"] or "(info)",
                r["limit"],
            ]
        )
    print_aligned(table, right={1, 3, 4}, file=file)


def load_summary(results: Sequence[Any], start: float, end: float) -> dict[str, float]:
    samples = [start, end] + [x for r in results if not r.skipped for x in r.load_average]
    return {"start": start, "end": end, "min": min(samples), "max": max(samples), "mean": float(np.mean(samples))}
