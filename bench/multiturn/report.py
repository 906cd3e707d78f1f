# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What the multi-turn benchmark prints (one node and several alike): the model, the scaling, the results
table, the daemons' counters, the physical limits, the cost of a token per tier, the target rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.lib.report import GIB, Row, fmt_bytes, print_aligned
from bench.multiturn.limits import Limits
from bench.multiturn.model import CONFIG_LABELS, FS_IO_THREADS, S3_INFLIGHT, Basis, Config, Model, Plan

TROUBLE = ("dropped_dirty", "dropped_backpressure", "errors", "checksum_failures", "rejected_full")  # Stats, when not 0
GATE = ("skipped_slow_hits", "skipped_slow_writedowns", "rate_probes")  # the recompute gate's Stats, when not 0


def scaling_lines(p: Plan) -> list[str]:
    w, m, sizes, conv = p.w, p.m, p.sizes, p.sizes_conv

    def size(nbytes: int) -> str:
        return f"{fmt_bytes(nbytes)}; {fmt_bytes(nbytes * m.byte_scale)} at full size"

    return [
        f"workload: {w.initial_tokens}-token first prompt + {w.turn_tokens} tokens per turn, {w.turns} turns "
        f"(last prompt {w.final_tokens} tokens), think time {w.think_s:g} s (uniform 0.5-1.5x), "
        f"chunks of {w.chunk_tokens} tokens, seed {w.seed}; loads "
        f"{'on the GPU timeline' if m.serial_loads else 'beside compute (async loader)'}",
        f"scaled: KV bytes/token {m.model_kv_bytes_per_token:,} -> {m.kv_bytes_per_token} (1/{m.byte_scale:g}); "
        f"chunk {fmt_bytes(w.chunk_tokens * m.model_kv_bytes_per_token)} -> "
        f"{fmt_bytes(w.chunk_tokens * m.kv_bytes_per_token)}; each tier's measured cost per byte x{m.byte_scale:g} "
        f"(lookups and a load call's fixed cost: as measured)",
        f"sized in conversations at their last turn ({w.final_tokens} tokens): GPU "
        f"{conv['gpu']:.1f} ({m.gpu_tokens:,} tokens = {fmt_bytes(m.gpu_tokens * m.model_kv_bytes_per_token)}), "
        f"RAM tier {conv['ram']:g} ({size(sizes.ram_bytes)}), fs {conv['fs']:g} ({size(sizes.fs_bytes)}); "
        f"in RAM + fs + S3: fs {conv['s3_fs']:g} ({size(sizes.s3_fs_bytes)}), "
        f"S3 {'unbounded' if not sizes.s3_bytes else size(sizes.s3_bytes)}",
    ]


def model_lines(m: Model, basis: Sequence[Basis]) -> list[str]:
    width, vwidth = max(len(b.quantity) for b in basis), max(len(b.value) for b in basis)
    lines = [f"  {b.quantity:<{width}}  {b.value:>{vwidth}}  {b.basis}" for b in basis]
    return [f"model: {m.model_name} (--model {m.model_key})", *lines]


def limit_lines(limits: Limits, chunk_bytes: int) -> list[str]:
    def fmt(name: str) -> str:
        if not (samples := getattr(limits, name)):
            return "not measured"
        return f"{np.median(samples):.2f} GiB/s (median of {len(samples)}; {min(samples):.2f}-{max(samples):.2f})"

    lines = [
        f"memcpy, 2 MiB pieces, one thread (a RAM-tier load's copy): {fmt('memcpy')}",
        f"raw O_DIRECT read, 2 MiB files, {FS_IO_THREADS} threads, streaming: {fmt('odirect_stream')}",
        f"raw O_DIRECT read, the same, {limits.batch_chunks}-chunk batches one at a time: {fmt('odirect_batched')}",
        f"raw aiobotocore GET, 2 MiB objects, {S3_INFLIGHT} in flight: {fmt('s3_get')}",
    ]
    if limits.raw_tcp is not None:
        tcp = f"raw TCP on loopback, {fmt_bytes(chunk_bytes)} chunks into 16 slots (bench/lib/raw_net.py)"
        lines.append(f"{tcp}: {fmt('raw_tcp')}")
    return lines + [f"note: {n}" for n in limits.notes]


def print_results(results: Sequence[Any], mode: Any) -> None:
    """One line per run (RunResult or NodesRunResult): hit rates per tier, modelled throughput and latency,
    the measured load rates; `mode`: its labels, hit_tiers, first_column, loaded_column and note."""
    loaded = mode.hit_tiers[1:]
    base = {r.conversations: r.throughput_tokens_s for r in results if r.config == "none" and not r.skipped}
    header = [mode.first_column, "convs", f"hit {mode.hit_tiers[0]}", *loaded, "overall", "tokens/s", "vs none"]
    header += ["TTFT p50", "p99", "gpu busy", "loader", *[f"loaded {'/'.join(loaded)}"] * mode.loaded_column]
    rows = [header + [f"GiB/s {'/'.join(loaded)} (marginal)", "wall"]]

    def per_tier(gib_s: dict[str, float]) -> str:
        return "/".join(f"{gib_s[t]:.2f}" if t in gib_s else "-" for t in loaded)

    for r in results:
        row = [mode.labels[r.config], str(r.conversations)]
        if r.skipped:
            rows.append(row + ["skipped: " + r.skipped[:80]] + [""] * (len(rows[0]) - 3))
            continue
        ratio = r.throughput_tokens_s / base[r.conversations] if base.get(r.conversations) else None
        row += [f"{100 * r.hit_rate[t]:.1f}%" for t in mode.hit_tiers]
        row += [f"{100 * r.hit_rate_overall:.1f}%", f"{r.throughput_tokens_s:,.0f}", f"{ratio:.2f}x" if ratio else ""]
        row += [f"{r.ttft_p50_s:.2f} s", f"{r.ttft_p99_s:.2f} s"]
        row += [f"{100 * r.gpu_busy:.0f}%", f"{100 * r.loader_busy:.0f}%"]
        if mode.loaded_column:
            row.append("/".join(fmt_bytes(r.loaded_bytes.get(t, 0)) for t in loaded) if r.loaded_bytes else "-")
        gib = f"{per_tier(r.load_gib_s)} ({per_tier(r.marginal_gib_s)})" if r.loaded_bytes else "-"
        rows.append(row + [gib, f"{r.wall_s:.0f} s"])
    loaded_col = len(header) - 1 if mode.loaded_column else 0
    print_aligned(rows, right=set(range(len(header) + 2)) - {0, loaded_col})
    print(mode.note)


def tier_counters(r: Any) -> list[str]:
    """Each tier's Stats deltas over a run (RAM's in chunks, the others' in scaled bytes)."""
    parts = []
    for name, d in r.daemon.items():
        extra = "".join(f", {k} {d[k]}" for k in TROUBLE + GATE if d.get(k))
        if name == "ram":
            parts.append(
                f"ram: {d['loaded_chunks']} chunks leased, {d['stored_chunks']} stored, promotions {d['promotions']}, "
                f"write-downs {d['writedowns']}, evictions {d['evictions']}{extra}"
            )
            continue
        if rate := d.get("load_bytes_per_s", 0):  # the daemons' own load rate, which their recompute gate goes by
            extra += f", daemon-measured load rate {rate / GIB:.2f} GiB/s"
        written = f" written {fmt_bytes(d['written_bytes'])}" if name != "peer" else ""
        moved = "".join(f", {k} {d[k]}" for k in ("promotions", "evictions") if d.get(k))
        parts.append(f"{name}: read {fmt_bytes(d['read_bytes'])}{written}{moved}{extra}")
    return parts


def problems(r: Any) -> str:
    """What went wrong in a run, where anything did."""
    gone = f" | {r.load_shortfall_chunks} chunks gone between lookup and load" if r.load_shortfall_chunks else ""
    return gone + (f" | CORRUPT {r.corrupt_chunks}" if r.corrupt_chunks else "")


def daemon_lines(results: Sequence[Any]) -> list[str]:
    lines = []
    for r in results:
        if r.skipped or not r.daemon or not (r.lookups or any(r.store.get(k) for k in ("stored", "already_present"))):
            continue
        st = r.store
        lines.append(
            f"{CONFIG_LABELS[r.config]:>13} {r.conversations:>4}: {'; '.join(tier_counters(r))} | client stores "
            f"{st['stored']} new, {st['already_present']} present, {st['dropped']} dropped, {st['gib_s']:.2f} GiB/s"
            f" | lookup p50 {r.lookup_ms_p50:.2f} ms, load call floor {r.load_call_floor_ms:.2f} ms x {r.load_calls}"
            + problems(r)
        )
    return lines


RAW = {  # a tier -> the raw rate beneath it: its name, its Limits field (raw_tcp: measured with --nodes)
    "ram": ("memcpy", "memcpy"),
    "fs": ("raw O_DIRECT, streaming", "odirect_stream"),
    "peer": ("raw TCP on loopback", "raw_tcp"),
    "s3": ("raw GET", "s3_get"),
}


def cost_lines(results: Sequence[Any], m: Model, limits: Limits, configs: Sequence[Config]) -> list[str]:
    """What a token served from each tier costs, relative to recomputing it: the break-even bandwidth over
    the tier's measured marginal rate, and the raw device's rate beneath it."""
    breakeven = m.breakeven_gib_s
    lines = [
        f"break-even load bandwidth ({m.model_kv_bytes_per_token:,} KV bytes/token x "
        f"{m.prefill_tokens_per_s:,.0f} prefill tokens/s): {breakeven:.2f} GiB/s"
    ]
    for config in configs:
        if not (rs := [r for r in results if r.config == config.key and not r.skipped and r.marginal_gib_s]):
            continue
        r = max(rs, key=lambda x: x.conversations)
        parts = []
        for t in (t for t in RAW if t in r.marginal_gib_s):
            part = f"{t} {r.marginal_gib_s[t]:.2f} GiB/s = {breakeven / r.marginal_gib_s[t]:.2f}x a recompute"
            name, rate = RAW[t][0], limits.median(RAW[t][1])
            parts.append(part + (f" ({name} {rate:.2f} GiB/s would be {breakeven / rate:.2f}x)" if rate else ""))
        lines.append(f"{config.label} at {r.conversations}: " + "; ".join(parts))
    return lines


def tier_limit(r: Any, tier: str, limits: Limits, m: Model) -> str:
    """A tier's measured load rates in run r beside the raw rate of the hardware under it, the break-even,
    and how busy the loader and GPU were."""
    got = f"no {tier} loads"
    if tier in r.load_gib_s:
        marginal = f"{rate:.2f} marginal" if (rate := r.marginal_gib_s.get(tier)) else "fixed cost only"
        got = f"{tier} loads {r.load_gib_s[tier]:.2f} GiB/s all-in, {marginal}"
    stream, batched = limits.median("odirect_stream"), limits.median("odirect_batched")
    if tier == "fs" and stream and batched:
        got += f" vs raw O_DIRECT {batched:.2f} (<= {limits.batch_chunks}-chunk calls) / {stream:.2f} (streaming)"
    elif tier != "fs" and (raw := limits.median(RAW[tier][1])):
        got += f" vs {RAW[tier][0]} {raw:.2f}"
    if daemons := getattr(r, "daemon_gib_s", {}).get(tier):
        got += f"; the daemons measured {daemons:.2f}"
    if tier in getattr(r, "gate_skipped", {}):
        got += f", {100 * r.gate_skipped[tier]:.1f}% of reusable tokens skipped"
    busy = f"loader busy {100 * r.loader_busy:.0f}%, GPU {100 * r.gpu_busy:.0f}%"
    return f"{got}; break-even {m.breakeven_gib_s:.2f}; {busy}"


class TargetRows(list[dict[str, Any]]):
    """A sweep's targets and ratios as rows: name, value, baseline, ratio, target, status (as the
    other benchmarks' JSON) and `limit`: what bounds it on this machine."""

    def add(
        self, name: str, value: float, unit: str, baseline: tuple[str, float | None], target: float | None, limit: str
    ) -> None:
        self.append(Row(name, value, unit, *baseline, target, limit=limit).to_json())

    def hit_rate(self, name: str, r: Any, target: float, limit: str) -> None:
        """Run r's hit rate (of reusable tokens) against all of them."""
        self.add(name, r.hit_rate_overall, "share", ("all reusable tokens", 1.0), target, limit)

    def vs(self, name: str, r: Any, baseline_name: str, base: Any, target: float | None, limit: str) -> None:
        """Run r's modelled throughput against run base's (where both ran)."""
        if r is not None and base is not None:
            self.add(name, r.throughput_tokens_s, "tokens/s", (baseline_name, base.throughput_tokens_s), target, limit)

    def loads(self, tier: str, r: Any, raw: tuple[str, float | None], labels: dict[str, str], m: Model) -> None:
        """The all-in load rate of a tier in run r beside the raw rate beneath it (when it loaded)."""
        if r is None or tier not in r.load_gib_s:
            return
        marginal = r.marginal_gib_s.get(tier)
        limit = f"marginal {marginal:.2f} GiB/s (what the model charges)" if marginal else "fixed cost per call only"
        name = f"{tier} tier loads, all-in ({labels[r.config]}, {r.conversations})"
        self.add(name, r.load_gib_s[tier], "GiB/s", raw, None, limit + f"; break-even {m.breakeven_gib_s:.2f} GiB/s")


def _fmt_value(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return {"share": f"{100 * v:.1f}%", "tokens/s": f"{v:,.0f} tokens/s"}.get(unit, f"{v:.2f} {unit}")


def print_rows(rows: Sequence[dict[str, Any]]) -> None:
    table = [["measurement", "value", "baseline", "", "ratio", "target", "result", "bounded by (this machine)"]]
    for r in rows:
        ratio, target = r["ratio"], r["target"]
        table.append(
            [r["name"], _fmt_value(r["value"], r["unit"]), r["baseline_name"], _fmt_value(r["baseline"], r["unit"])]
            + [f"{ratio:.2f}x" if ratio is not None else "", f">= {target:.2f}x" if target is not None else ""]
            + [r["status"] or "(info)", r["limit"]]
        )
    print_aligned(table, right={1, 3, 4})


def load_summary(results: Sequence[Any], start: float, end: float) -> dict[str, float]:
    samples = [start, end] + [x for r in results if not r.skipped for x in r.load_average]
    return {"start": start, "end": end, "min": min(samples), "max": max(samples), "mean": float(np.mean(samples))}
