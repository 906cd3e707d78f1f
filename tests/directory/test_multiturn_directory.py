# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""`python -m bench.multiturn --nodes 2 --directory`, tiny: the bench starts its own Redis Cluster,
two daemons with no static peers find each other's chunks through it (PEER hits that came over
the wire, checked bytes), and the rows name the directory's targets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.daemon import REPO_ROOT, clean_env

pytestmark = [pytest.mark.slow, pytest.mark.system_deps]


def test_multiturn_directory_small_run_finds_the_other_nodes_chunks(tmp_path):
    out = tmp_path / "run.json"
    argv = [sys.executable, "-m", "bench.multiturn", "--nodes", "2", "--directory", "--conversations", "4"]
    argv += ["--initial-tokens", "8192", "--turn-tokens", "4096", "--turns", "3", "--think-s", "0.5"]
    argv += ["--gpu-tokens", "16384", "--ram-conversations", "2", "--fs-conversations", "8", "--settle-s", "0.5"]
    argv += ["--no-limits", "--workdir", str(tmp_path / "work"), "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=clean_env(), cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    runs = {r["config"]: r for r in doc["results"]}
    assert set(runs) == {"none", "ram+fs", "ram+fs+dir", "pooled"}
    assert not any(r["skipped"] for r in runs.values()), [r["skipped"] for r in runs.values()]
    assert all(r["corrupt_chunks"] == 0 for r in runs.values())
    fleet, islands, pooled = runs["ram+fs+dir"], runs["ram+fs"], runs["pooled"]
    # a turn always lands on the other node: only the directory (or one shared store) finds its chunks
    assert fleet["hit_rate"]["peer"] > 0 and islands["hit_rate"]["peer"] == 0
    assert fleet["hit_rate_overall"] > islands["hit_rate_overall"] and pooled["hit_rate_overall"] == 1.0
    peer_chunks = fleet["hit_tokens"]["peer"] // 4096
    assert fleet["peers"]["received_chunks"] >= peer_chunks > 0
    assert fleet["peers"]["served_chunks"] == fleet["peers"]["received_chunks"]
    assert len(pooled["per_node"]) == 2 and all(node["turns"] > 0 for node in pooled["per_node"])
    # no prefill rate registered (no --register-rates): the recompute gate skipped nothing; the
    # daemons measured the peer tier's load rate from the fetches
    assert doc["registered_prefill_tokens_per_s"] == 0
    assert all(not r["gate_skipped"] and r["found_rate"] == r["hit_rate_overall"] for r in runs.values())
    assert fleet["daemon_gib_s"]["peer"] > 0
    targeted = {r["name"] for r in doc["rows"] if r["target"] is not None}
    assert targeted == {
        "directory: hit rate vs one node with the fleet's RAM + fs, 2 nodes, 4 conversations",
        "directory vs islands (no peers), 2 nodes, 4 conversations",
    }
