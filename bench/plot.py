# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Charts for the kvstored benchmarks (matplotlib, PNG).

Method, baselines, targets and results: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.lib.report import MIB

STYLE = {  # colour, marker
    "none": ("#7f7f7f", "o"),
    "ram": ("#1f77b4", "s"),
    "ram+fs": ("#2ca02c", "^"),
    "ram+fs+s3": ("#d62728", "D"),
    "ram+fs+peer": ("#ff7f0e", "P"),
}
EXTRA_STYLES = [("#9467bd", "v"), ("#8c564b", "P"), ("#e377c2", "X"), ("#17becf", "*")]  # configurations added later
TIER_TITLES = {
    "gpu": "GPU prefix cache",
    "ram": "kvstored RAM tier",
    "fs": "kvstored fs tier",
    "peer": "kvstored peer tier",
    "s3": "kvstored S3 tier",
}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only), imported when a chart is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str | Path, **savefig: Any) -> None:
    """Write `fig` to `path` (its folder made first) and free it."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, **savefig)
    pyplot().close(fig)


def plot_multiturn(doc: dict[str, Any], path: str | Path) -> None:
    plt = pyplot()

    runs = [r for r in doc["results"] if not r.get("skipped")]
    listed = doc["configs"]
    labels = {c["key"]: c["label"] for c in listed}
    has_tier = {c["key"]: set(c["tiers"]) for c in listed}
    extra = iter(EXTRA_STYLES)
    style = {c["key"]: STYLE.get(c["key"]) or next(extra, ("#000000", "o")) for c in listed}
    configs = [c["key"] for c in listed if any(r["config"] == c["key"] for r in runs)]
    tiers = [t for t in TIER_TITLES if any(t in has_tier[c] for c in configs)] or ["gpu"]
    k = len(tiers)  # one small chart per tier below the two large ones, which split the width
    fig = plt.figure(figsize=(13 if k <= 4 else 15, 8.5), dpi=110)
    grid = fig.add_gridspec(2, 2 * k, height_ratios=[1.5, 1], hspace=0.42, wspace=1.0)
    ax_tp = fig.add_subplot(grid[0, 0:k])
    ax_hit = fig.add_subplot(grid[0, k : 2 * k])
    tier_axes = [fig.add_subplot(grid[1, 2 * i : 2 * i + 2]) for i in range(k)]
    counts = sorted({r["conversations"] for r in runs})

    for config in configs:
        rs = sorted((r for r in runs if r["config"] == config), key=lambda r: r["conversations"])
        xs = [r["conversations"] for r in rs]
        colour, marker = style[config]
        kw = dict(color=colour, marker=marker, label=labels[config], linewidth=2, markersize=6)
        ax_tp.plot(xs, [r["throughput_tokens_s"] / 1000 for r in rs], **kw)
        ax_hit.plot(xs, [100 * r["hit_rate_overall"] for r in rs], **kw)
        for ax, tier in zip(tier_axes, tiers):
            if tier not in has_tier[config]:
                continue
            ax.plot(xs, [100 * r["hit_rate"].get(tier, 0.0) for r in rs], **{**kw, "linewidth": 1.5, "markersize": 4})

    model = doc.get("model", {})
    scale = model.get("byte_scale")
    ax_tp.set_title("Modelled throughput (prompt tokens/s)")
    ax_tp.set_ylabel("thousand tokens/s")
    ax_hit.set_title("Hit rate, all tiers (share of reusable tokens)")
    ax_hit.set_ylabel("%")
    ax_hit.set_ylim(-3, 103)
    for ax, tier in zip(tier_axes, tiers):
        ax.set_title(TIER_TITLES[tier], fontsize=10)
        ax.set_ylim(-3, 103)
        ax.set_xlabel("conversations", fontsize=9)
        ax.tick_params(labelsize=8)
    tier_axes[0].set_ylabel("hit rate %")
    for ax in (ax_tp, ax_hit, *tier_axes):
        ax.set_xticks(counts)
        ax.grid(True, alpha=0.3)
    for ax in (ax_tp, ax_hit):
        ax.set_xlabel("simultaneous conversations")
    ax_tp.set_ylim(bottom=0)
    ax_tp.legend(loc="best", fontsize=9)

    w = doc.get("workload", {})
    machine = doc.get("machine", {})
    nodes = doc.get("nodes", 1)
    routed = f", {nodes} nodes, turns routed round-robin (no KV awareness)" if nodes > 1 else ""
    each, per_node = (" on each node", " per node") if nodes > 1 else ("", "")
    fig.suptitle(
        f"kvstored multi-turn benchmark: {w.get('initial_tokens')} + {w.get('turn_tokens')} tokens/turn, "
        f"{w.get('turns')} turns{routed}\nmodelled {model.get('model_name', 'GPU')}{each}: "
        f"{model.get('model_kv_bytes_per_token', 0):,} KV bytes/token, "
        f"{model.get('prefill_tokens_per_s', 0):,.0f} prefill tokens/s",
        fontsize=12,
    )
    load = doc.get("load_average")
    loads = f", load average {load['min']:.1f}-{load['max']:.1f}" if load else ""
    conv = doc.get("sizes_in_conversations", {})
    foot = (
        f"Real {'daemons' if nodes > 1 else 'daemon'}, real transfers of KV scaled 1/{scale:g} (load times "
        f"x{scale:g}); modelled GPU cache {conv.get('gpu', 0):.0f} conversations, RAM tier {conv.get('ram', 0):g}, "
        f"fs {conv.get('fs', 0):g}{per_node}; {machine.get('cpus')} CPUs, {machine.get('mem_total_gib')} GiB, "
        f"git {machine.get('git')}{loads}; {doc.get('s3_server', '')}"
    )
    fig.text(0.5, 0.01, foot, ha="center", fontsize=8, color="#555555")
    save(fig, path, bbox_inches="tight")


def plot_fleet(doc: dict[str, Any], path: str) -> None:
    """bench.fleet's chart, from its JSON: per-node costs against N, each set-up a line."""
    plt = pyplot()

    panels = [
        ("Daemon CPU per node (s/s)", lambda r: r["cpu_s_per_s"]),
        ("Heap per node (RssAnon, MiB)", lambda r: r["rss_anon_bytes"] / MIB),
        ("Control bytes in per node (KiB/s; data plane left out)", lambda r: r["upkeep_rx_bytes_per_s"] / 1024),
        ("Redis Cluster CPU (s/s, all 6 processes)", lambda r: r["redis_cpu_s_per_s"]),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2), dpi=110)
    style = {"mesh": ("#d62728", "o"), "directory": ("#2ca02c", "^"), "islands": ("#7f7f7f", "s")}
    for ax, (title, value) in zip(axes, panels):
        for setup, (colour, marker) in style.items():
            rs = [r for r in doc["rows"] if r["setup"] == setup]
            if not rs or (setup != "directory" and "Redis" in title):
                continue
            ax.plot([r["nodes"] for r in rs], [value(r) for r in rs], color=colour, marker=marker, label=setup)
            if setup == "mesh" and title.startswith("Daemon CPU"):
                m = [(r["nodes"], r["model_cpu_s_per_s"]) for r in rs if "model_cpu_s_per_s" in r]
                ax.plot(*zip(*m), color=colour, linestyle="--", label="mesh, bench.scale_out's model")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("nodes")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    ld = doc["load"]
    fig.suptitle(
        f"kvstored fleet measured: {ld['turns_per_s']:g} turns/s per node of {ld['chunks']} x "
        f"{ld['chunk_bytes'] >> 10} KiB chunks, daemons in network namespaces on one "
        f"{doc['machine'].get('cpus', '?')}-CPU VM",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    save(fig, path)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m bench.plot RESULTS.json CHART.png (the JSON of bench.multiturn)", file=sys.stderr)
        return 2
    doc = json.loads(Path(argv[0]).read_text())
    plot_multiturn(doc, argv[1])
    print(f"plot written to {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
