# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fleet bench's plot (matplotlib), from its JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 1 << 20


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
