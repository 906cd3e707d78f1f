# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The scale-out model (bench/scale_out): its arithmetic on stated costs, and what it says with the
committed calibration (docs/scale-out-calibration.json, which docs/scale-out.md quotes)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from bench.lib.report import GIB
from bench.scale_out.designs import Model, break_point, designs
from bench.scale_out.fleet import DEFAULT_CALIBRATION, Budget, Costs, Fleet
from bench.scale_out.report import redis_fit

COMMITTED = json.loads(DEFAULT_CALIBRATION.read_text())


def committed() -> Model:
    return Model(Fleet(), Budget(), Costs.from_calibration(COMMITTED))


def stated() -> Model:
    """The committed costs with the directory's replaced by round figures."""
    costs = replace(
        Costs.from_calibration(COMMITTED),
        dir_interval_s=0.5,
        dir_heartbeat_s_per_interval=100e-6,
        dir_write_s_per_key=10e-6,
        dir_commands_per_key=2.0,
        dir_lookup_s=300e-6,
        dir_lookup_s_per_key=2e-6,
        dir_lookup_s_per_master=20e-6,
        dir_measured_shards=3,
        dir_lookup_added_s=0.4e-3,
        dir_lookup_added_s_per_key=1e-6,
        dir_client_bytes=10 << 20,
        redis_s_per_command=2e-6,
        redis_s_per_lookup_key=1e-6,
        redis_bytes_per_entry=100.0,
    )
    return Model(Fleet(), Budget(), costs)


def test_the_redis_directory_costs_a_node_what_its_own_work_costs_whatever_the_fleet():
    m = stated()
    r, f = m.rates, m.fleet
    p = m.redis_directory(1000)
    masters = m.redis_tier(1000)["masters"]
    touched = min(f.directory_buckets, masters)
    assert p.cpu_parts["heartbeat"] == pytest.approx(100e-6 / 0.5)
    assert p.cpu_parts["writes"] == pytest.approx((r.net_keys_per_s + r.refresh_keys_per_s) * 10e-6)
    assert p.cpu_parts["lookups"] == pytest.approx(
        f.turns_per_s * (300e-6 + (touched - 3) * 20e-6 + r.directory_keys_per_turn * 2e-6)
    )
    assert p.memory_bytes == 10 << 20 and p.coverage == 1.0 and p.index_entries == 0
    assert p.lookup_ms == pytest.approx((m.local_lookup_s() + 0.4e-3 + r.directory_keys_per_turn * 1e-6) * 1e3)
    # past `buckets` masters a lookup touches no more of them: the node's costs stop growing
    assert m.redis_directory(5000).cpu_fraction == pytest.approx(m.redis_directory(10_000).cpu_fraction)
    assert m.redis_directory(1).cpu_fraction == 0.0  # one node asks no one


def test_a_turn_asks_the_directory_for_its_new_tail_and_a_cross_node_turn_for_everything():
    r, f = stated().rates, Fleet()
    assert r.directory_keys_per_turn == pytest.approx(
        r.stored_chunks_per_turn + f.cross_node_share * r.looked_up_chunks_per_turn
    )
    assert r.refresh_keys_per_s == pytest.approx(r.chunks_held / (f.directory_entry_ttl_s / 2))


def test_the_redis_cluster_grows_with_the_fleet_in_masters_memory_and_ops():
    m = stated()
    r = m.rates
    small, big = m.redis_tier(100), m.redis_tier(1000)
    per_node_writes = 1 / 0.5 + r.net_keys_per_s * 1.5 + r.refresh_keys_per_s * 2
    assert big["commands_per_s"] == pytest.approx(1000 * per_node_writes)
    assert big["ops_per_s"] == pytest.approx(10 * small["ops_per_s"])
    assert big["memory_bytes"] == pytest.approx(1000 * r.chunks_held * 100 * 2)  # a replica per master
    cores = 1000 * (per_node_writes * 2e-6 + m.fleet.turns_per_s * r.directory_keys_per_turn * 1e-6)
    assert big["cores"] == pytest.approx(cores)
    assert big["masters"] == max(math.ceil(cores / 0.5), math.ceil(big["memory_bytes"] / 2 / (25 * GIB)))
    assert big["master_cores"] <= 0.5 and big["master_memory_bytes"] <= 25 * GIB
    assert small["masters"] < big["masters"] and big["processes"] == 2 * big["masters"]


def test_the_committed_calibration_measured_the_directory():
    c = committed().costs
    for name in ("dir_write_s_per_key", "dir_lookup_s", "redis_s_per_command", "redis_bytes_per_entry"):
        assert getattr(c, name) > 0, name


def test_with_the_committed_calibration_the_redis_directory_fits_the_budget_at_1000_nodes():
    """What docs/scale-out.md says: per node the same writes, heartbeat and memory at 10 and at
    1,000 nodes; only a lookup's fan-out grows, to at most `directory_buckets` masters (one more
    master asked per lookup: the measured cost per master); within 10% of a core and 1 GiB."""
    m = committed()
    small, big = m.redis_directory(10), m.redis_directory(1000)
    for part in ("writes", "heartbeat"):
        assert big.cpu_parts[part] == small.cpu_parts[part]
    touched = [min(m.fleet.directory_buckets, int(m.redis_tier(n)["masters"])) for n in (10, 1000)]
    assert big.cpu_parts["lookups"] - small.cpu_parts["lookups"] == pytest.approx(
        m.fleet.turns_per_s * (touched[1] - touched[0]) * m.costs.dir_lookup_s_per_master
    )
    assert big.cpu_fraction <= m.budget.cpu_fraction  # the target at 1,000 nodes
    assert big.memory_bytes <= m.budget.memory_bytes and big.memory_bytes == small.memory_bytes
    redis = next(d for d in designs(m) if d.key == "redis")
    assert break_point(redis, m.budget, 10_000) is None
    fit = redis_fit(m.fleet, m.budget, m.costs)
    assert fit["cpu_fraction"] == big.cpu_fraction and fit["ttl_4h_cpu_fraction"] < big.cpu_fraction
    slower = Model(replace(m.fleet, turns_per_s=fit["max_turns_per_s"]), m.budget, m.costs)
    assert slower.redis_directory(1000).cpu_fraction == pytest.approx(m.budget.cpu_fraction, rel=1e-3)
    tier = m.redis_tier(1000)
    assert tier["master_cores"] <= m.fleet.redis_shard_cpu and tier["master_memory_bytes"] <= 25 * GIB


def test_the_mesh_stops_where_the_docs_say():
    m = committed()
    by_key = {d.key: d for d in designs(m)}
    assert break_point(by_key["mesh"], m.budget, 10_000)["nodes"] == 2
    assert break_point(by_key["coalesced"], m.budget, 10_000)["nodes"] == 6
    assert m.coalesced(10).cpu_fraction > m.coalesced(2).cpu_fraction  # O(N) per node
