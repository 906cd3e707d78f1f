# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""bench.fleet's arithmetic on stated figures: medians over passes, growth against the smallest N,
the verdict against the 10% target, and the mesh's modelled column."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.fleet.cli import rows, verdict
from bench.fleet.run import Load, NodeFigures, RunResult
from bench.scale_out.fleet import Costs

NODE = NodeFigures(
    cpu_s_per_s=0.05,
    rss_anon_bytes=40 << 20,
    rx_bytes_per_s=1e6,
    upkeep_rx_bytes_per_s=4096.0,
    messages_per_s=0.0,
    directory_lookups_per_s=2.0,
    directory_commands_per_s=200.0,
    directory_failures=0,
    turns=30,
    late_turns=0,
)
COSTS = Costs(
    follow_s_per_event=500e-6,
    follow_s_per_key=1e-6,
    follow_s_per_key_per_slot=0.0,
    publish_s_per_event=100e-6,
    publish_s_per_key=0.0,
    bytes_per_event=70,
    bytes_per_key=34,
    segments_per_event=1,
    index_bytes_per_entry=210,
    index_bytes_per_slot=0,
    stream_bytes=54 << 10,
    stream_idle_s_per_s=10e-6,
    lookup_fixed_s=1e-3,
    lookup_s_per_key=1e-5,
    contains_s_per_peer=1e-6,
    remote_lookup_s=1e-3,
    remote_lookup_server_s=5e-4,
    fetch_round_trip_s=1.5e-3,
    rendezvous_s_per_node=2e-7,
    single_events_per_chunk=3,
    s3_put_s=0.02,
    s3_get_s=0.007,
    s3_server="none",
)


def run(setup: str, n: int, cpu: float, upkeep: float = 4096.0, messages: float = 0.0) -> RunResult:
    node = replace(NODE, cpu_s_per_s=cpu, upkeep_rx_bytes_per_s=upkeep, messages_per_s=messages)
    return RunResult(setup, n, 15.0, [node] * n, redis_cpu_s_per_s=0.01 * n, load_average=[1.0])


def test_medians_over_passes_and_growth_against_the_smallest_n():
    results = [
        run("directory", 2, 0.050),
        run("directory", 2, 0.070),
        run("directory", 2, 0.052),
        run("directory", 16, 0.054),
        run("directory", 16, 0.090),
        run("directory", 16, 0.055),
    ]
    table = rows(results, COSTS, Load())
    small, big = table
    assert (small["nodes"], small["passes"]) == (2, 3) and small["cpu_s_per_s"] == pytest.approx(0.052)
    assert big["cpu_s_per_s"] == pytest.approx(0.055)  # the 0.090 pass is one pass, not the median
    assert big["growth"]["cpu_s_per_s"] == pytest.approx(0.055 / 0.052)
    assert big["redis_cpu_s_per_s_per_node"] == pytest.approx(0.01)
    assert big["redis_cpu_s_per_command"] == pytest.approx(0.16 / (16 * 202))
    lines = verdict(table)
    assert lines[0].startswith("directory CPU per node, 2 -> 16 nodes: 1.06x (target <= 1.10x: met)")


def test_a_growth_past_ten_percent_is_not_met():
    table = rows([run("directory", 2, 0.05), run("directory", 8, 0.06)], COSTS, Load())
    assert "1.20x (target <= 1.10x: NOT met)" in verdict(table)[0]


def test_the_mesh_model_adds_each_peers_modelled_cost_to_the_smallest_n():
    load = Load()
    results = [run("mesh", 2, 0.05, messages=3.0), run("mesh", 8, 0.08, upkeep=40_000, messages=21.0)]
    table = rows(results, COSTS, load)
    per_peer = 3.0 * (500e-6 + 100e-6) + 3 * load.chunks * load.turns_per_s * 1e-6 + 10e-6
    assert table[0]["model_cpu_s_per_s"] == pytest.approx(0.05)
    assert table[1]["model_cpu_s_per_s"] == pytest.approx(0.05 + 6 * per_peer)
    assert table[1]["growth"]["upkeep_rx_bytes_per_s"] == pytest.approx(40_000 / 4096)
    assert verdict(table) == []  # the target is the directory's
