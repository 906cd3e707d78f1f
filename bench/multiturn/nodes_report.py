# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What the multi-node mode prints: its results, the daemons' counters, the target rows and what
bounds them (its main: nodes_main.py)."""

from __future__ import annotations

from collections.abc import Sequence

from bench.lib.report import GIB, fmt_bytes
from bench.multiturn.limits import Limits
from bench.multiturn.model import TARGET_HIT, Model
from bench.multiturn.nodes import (
    CONFIG_KEYS,
    LABELS,
    LOADED_TIERS,
    NODE_TIERS,
    TARGET_HIT_POINTS,
    TARGET_VS_ISLANDS,
)
from bench.multiturn.nodes_run import NodesRunResult
from bench.multiturn.report import TROUBLE, Layout, TargetRows, raw_limit

# -- reporting --------------------------------------------------------------------------------------


NODES = Layout(
    LABELS,
    NODE_TIERS,
    "set-up",
    "measured: hit rates (each node's Lookup, tier per key), GiB/s (the load calls; marginal: median per-byte "
    "cost with the fixed call cost removed, what the model charges x the byte scale); modelled: tokens/s, "
    "TTFT, busy (GPU and loader: means over the nodes)",
    loaded_column=False,
    gib_right=False,
    skip_reason=True,
)


def progress(r: NodesRunResult) -> str:
    """One run's line as the sweep goes."""
    skipped = sum(r.gate_skipped.values())
    return (
        f"hit {100 * r.hit_rate_overall:.1f}% (peer {100 * r.hit_rate['peer']:.1f}%"
        + (f"; {100 * skipped:.1f}% skipped as slower than recomputing" if skipped else "")
        + f")  {r.throughput_tokens_s:,.0f} tokens/s  wall {r.wall_s:.1f} s  load {r.load_average[1]:.1f}"
    )


def gate_line(m: Model) -> str:
    """What the daemons are told about recomputing (--register-rates)."""
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    if not m.register_rates:
        return (
            "recompute gate: no prefill rate registered (every hit counts, whatever it costs to load; "
            f"--register-rates registers it: break-even {breakeven:.2f} GiB/s)"
        )
    return (
        f"recompute gate: every node's namespace registers {m.gate_prefill_tokens_per_s:,.0f} prefill tokens/s of "
        f"{m.kv_bytes_per_token} real bytes (the model's {m.prefill_tokens_per_s:,.0f} x "
        f"{m.model_kv_bytes_per_token:,} bytes: break-even {breakeven:.2f} GiB/s), so a daemon reports a hit "
        "below RAM (fs, peer) only where its measured load rate and queue beat recomputing"
    )


def route_lines(rr: Sequence[NodesRunResult], kv: Sequence[NodesRunResult]) -> list[str]:
    """Each set-up at each count, both routings: hit rates per tier, peer fetches, throughput."""
    by_key = {(r.config, r.conversations): r for r in rr}
    lines = []
    for k in kv:
        r = by_key.get((k.config, k.conversations))
        if r is None or r.skipped or k.skipped:
            lines.append(
                f"{LABELS[k.config]}, {k.conversations} conversations: skipped ({k.skipped or r and r.skipped})"
            )
            continue
        for name, x in (("round robin", r), ("KV-aware", k)):
            tiers = "  ".join(f"{t} {100 * x.hit_rate.get(t, 0.0):.1f}%" for t in NODE_TIERS)
            lines.append(
                f"{LABELS[k.config]}, {k.conversations} conversations, {name:<11}: hit {100 * x.hit_rate_overall:.1f}% "
                f"({tiers}); peer fetches {x.peers.get('fetches', 0)} ({x.peers.get('received_chunks', 0)} chunks); "
                f"{x.throughput_tokens_s:,.0f} tokens/s"
                + (f"; {x.kv_routed} turns routed off round robin" if x.route == "kv" else "")
            )
    return lines


GATE = ("skipped_slow_hits", "skipped_slow_writedowns", "rate_probes")  # the recompute gate's Stats, when not 0


def daemon_lines(results: Sequence[NodesRunResult]) -> list[str]:
    lines = []
    for r in results:
        if r.skipped or not r.daemon:
            continue
        parts = []
        for name, d in r.daemon.items():
            extra = [f"{k} {d[k]}" for k in TROUBLE + GATE if d.get(k)]
            if name == "ram":
                parts.append(
                    f"ram: {d['loaded_chunks']} leased, {d['stored_chunks']} stored, promotions "
                    f"{d['promotions']}, write-downs {d['writedowns']}, evictions {d['evictions']}"
                    + "".join(f", {e}" for e in extra)
                )
            else:  # (the load rate each daemon measured, which its recompute gate goes by: their mean)
                rate = d.get("load_bytes_per_s", 0)
                extra += [f"load rate measured by the daemons {rate / GIB:.2f} GiB/s"] if rate else []
                written = f" written {fmt_bytes(d['written_bytes'])}" if name != "peer" else ""
                parts.append(f"{name}: read {fmt_bytes(d['read_bytes'])}{written}" + "".join(f", {e}" for e in extra))
        if r.peers:
            p = r.peers
            parts.append(
                f"peers: {p['fetches']} fetches, {p['received_chunks']} chunks in "
                f"({fmt_bytes(p['received_bytes'])}), served {p['served_chunks']}, missing "
                f"{p['missing_chunks']}, failed {p['failed_chunks']}, timed out {p['timed_out_chunks']}, "
                f"breaker refusals {p['refused_by_breaker']}, resyncs {p['resyncs']}"
            )
        if r.slow_gib_s:
            parts.append(
                "load calls' marginal GiB/s median / slowest decile: "
                + ", ".join(
                    f"{t} {r.marginal_gib_s.get(t, 0):.2f} / {r.slow_gib_s[t]:.2f}"
                    for t in LOADED_TIERS
                    if t in r.slow_gib_s
                )
            )
        st, se = r.store, r.settle
        lines.append(
            f"{LABELS[r.config]:>20} {r.conversations:>4}: "
            + "; ".join(parts)
            + f" | client stores {st['stored']} new, {st['already_present']} present, {st['dropped']} dropped"
            f" | lookup p50 {r.lookup_ms_p50:.2f} ms (floor {r.lookup_floor_ms:.2f}; {r.lookup_moved_s:.1f} s "
            f"moved to fs/peer loads), call floor {r.load_call_floor_ms:.2f} ms x {r.load_calls}"
            f" | settled {se['waits']} turns, {se['seconds']:.1f} s"
            + (f", {se['s3_timeouts']} S3 waits gave up" if se["s3_timeouts"] else "")
            + (f" | {r.load_shortfall_chunks} chunks gone between lookup and load" if r.load_shortfall_chunks else "")
            + (f" | CORRUPT {r.corrupt_chunks}" if r.corrupt_chunks else "")
        )
    return lines


def _limit(r: NodesRunResult, tier: str, limits: Limits, breakeven: float) -> str:
    name, rate = raw_limit(limits, tier)
    got = (
        f"{tier} loads {r.load_gib_s[tier]:.2f} GiB/s all-in, "
        + (f"{r.marginal_gib_s[tier]:.2f} marginal" if tier in r.marginal_gib_s else "fixed cost only")
        if tier in r.load_gib_s
        else f"no {tier} loads"
    )
    daemons = r.daemon_gib_s.get(tier)
    return (
        got
        + (f" vs {name} {rate:.2f}" if rate else "")
        + (f"; the daemons measured {daemons:.2f}" if daemons else "")
        + (f", {100 * r.gate_skipped[tier]:.1f}% of reusable tokens skipped" if tier in r.gate_skipped else "")
        + f"; break-even {breakeven:.2f}; loader busy {100 * r.loader_busy:.0f}%, GPU {100 * r.gpu_busy:.0f}%"
    )


def target_rows(results: Sequence[NodesRunResult], m: Model, limits: Limits, n: int) -> TargetRows:
    """The targets at the largest count and the informational ratios."""
    rows = TargetRows()
    runs = {(r.config, r.conversations): r for r in results if not r.skipped}
    counts = sorted({r.conversations for r in results})
    if not counts:
        return rows
    top = counts[-1]
    none, islands, peers, s3 = (runs.get((c, top)) for c in CONFIG_KEYS)
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    where = f"{n} nodes, {top} conversations"
    if peers is not None:
        p = peers.peers
        lost = f"missing {p.get('missing_chunks', 0)}, failed {p.get('failed_chunks', 0)}, timed out "
        lost += f"{p.get('timed_out_chunks', 0)}"
        limit = f"peer {100 * peers.hit_rate['peer']:.0f}% of reusable tokens; {lost}"
        rows.add(
            f"peers: hit rate, {where}", peers.hit_rate_overall, "share", "all reusable tokens", 1.0, TARGET_HIT, limit
        )
        peer_limit = _limit(peers, "peer", limits, breakeven)
        if islands is not None:
            cap = islands.makespan_s / peers.think_floor_s  # no makespan is shorter than the think floor
            limit = (
                peer_limit + f"; makespan {peers.makespan_s:,.0f} s, the conversations' own start and think times "
                f"{peers.think_floor_s:,.0f} s: at most {cap:.2f}x"
            )
            rows.vs(f"peers vs islands (no peers), {where}", peers, "islands", islands, TARGET_VS_ISLANDS, limit)
        if none is not None:
            rows.vs(f"peers vs no offload, {where}", peers, "no offload", none, None, peer_limit)
    fleet, pooled = runs.get(("ram+fs+dir", top)), runs.get(("pooled", top))
    if fleet is not None and pooled is not None:
        # found: the hits, and those the recompute gate answered as misses (none without --register-rates)
        gap = 100 * (pooled.found_rate - fleet.found_rate)
        gated = "".join(
            f"; {name} served {100 * r.hit_rate_overall:.1f}%, {100 * sum(r.gate_skipped.values()):.1f}% skipped "
            "as slower than recomputing"
            for name, r in (("directory", fleet), ("one node", pooled))
            if r.gate_skipped
        )
        rows.add(
            f"directory: hit rate vs one node with the fleet's RAM + fs, {where}",
            fleet.found_rate,
            "share",
            f"that node's, less {TARGET_HIT_POINTS:g} points",
            pooled.found_rate - TARGET_HIT_POINTS / 100,
            1.0,
            f"{gap:.1f} points below it (directory {100 * fleet.found_rate:.1f}%, one node "
            f"{100 * pooled.found_rate:.1f}%); peer {100 * fleet.hit_rate['peer']:.0f}% of reusable tokens" + gated,
        )
    if fleet is not None and islands is not None:
        cap = islands.makespan_s / fleet.think_floor_s
        limit = _limit(fleet, "peer", limits, breakeven) + f"; think time caps it at {cap:.2f}x"
        rows.vs(f"directory vs islands (no peers), {where}", fleet, "islands", islands, TARGET_VS_ISLANDS, limit)
    if fleet is not None and pooled is not None:
        limit = "the same hits from one store: what reaching them on other nodes costs"
        rows.vs(f"directory vs one node with the fleet's RAM + fs, {where}", fleet, "one node", pooled, None, limit)
    if islands is not None and none is not None:
        limit = f"hit rate {100 * islands.hit_rate_overall:.0f}%; " + _limit(islands, "fs", limits, breakeven)
        rows.vs(f"islands vs no offload, {where}", islands, "no offload", none, None, limit)
    if s3 is not None and none is not None:
        limit = f"hit rate {100 * s3.hit_rate_overall:.0f}%; " + _limit(s3, "s3", limits, breakeven)
        rows.vs(f"shared S3 vs no offload, {where}", s3, "no offload", none, None, limit)
    if peers is not None and s3 is not None:
        limit = "the faster of the two ways to reach another node's chunks"
        rows.vs(f"peers vs shared S3, {where}", peers, "shared S3", s3, None, limit)
    for tier, r in (("peer", peers or fleet), ("fs", islands), ("s3", s3)):
        label = f"{LABELS[r.config]}, {top}" if r is not None else ""
        rows.loads(tier, r, label, raw_limit(limits, tier), "what the model charges", breakeven)
    return rows


def bound_lines(results: Sequence[NodesRunResult], m: Model) -> list[str]:
    """Where the modelled time went at the largest count, per set-up with offload."""
    counts = sorted({r.conversations for r in results})
    lines = []
    for r in results:
        if r.skipped or r.conversations != counts[-1] or r.config == "none":
            continue
        full = {t: r.loaded_bytes.get(t, 0) * m.byte_scale for t in LOADED_TIERS}
        lines.append(
            f"{LABELS[r.config]}: makespan {r.makespan_s:,.0f} modelled s (think floor "
            f"{r.think_floor_s:,.0f}); per node GPU busy {100 * r.gpu_busy:.0f}%, loader "
            f"{100 * r.loader_busy:.0f}%; loaded at full size: "
            + ", ".join(f"{t} {fmt_bytes(v)}" for t, v in full.items() if v)
            + f"; recomputed {100 * (1 - r.hit_rate_overall):.0f}% of the reusable tokens"
        )
    return lines
