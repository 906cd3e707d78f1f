# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Each benchmark's --help says what it compares (the multi-turn one: the article's workload, with
defaults that are that workload)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.support.daemon import REPO_ROOT, clean_env

COMPARED = {
    "compare.py": ["Mooncake Store", "LMCache", "Redis 7", "raw memcpy", "interleaved"],
    "local_path.py": ["pool mapping", "region registration", "memcpy", "empty gRPC round trip"],
    "peer.py": ["peer tier", "raw TCP socket", "raw ucxx", "fs tier", "S3 tier", "radosgw"],
    "multiturn.py": [
        "12K-token first prompt",
        "4K more tokens per turn",
        "8 turns",
        "20 s think time",
        "no offload",
        "RAM + fs + S3",
    ],
    "scale_calibrate.py": [
        "two real kvstored daemons",
        "index memory per remote entry",
        "171 B/entry",
        "follower CPU per event",
        "WatchEvents",
        "publisher CPU per subscriber",
        "local Lookup",
        "peer fetch round trip",
        "fleet directory's heartbeat, writes and lookups",
        "S3 PUT/GET latency",
        "radosgw",
        "load average",
    ],
    "scale_out.py": [
        "1 to 1000 kvstored nodes",
        "measured per-operation costs",
        "index memory",
        "inbound event traffic",
        "lookup cost",
        "S3 request rate and cost",
        "mesh as built",
        "node-level coalesced mesh",
        "directory shards placed by rendezvous hashing",
        "fleet directory on a Redis Cluster",
        "llm-d consuming KV events",
        "budget",
    ],
    "fleet.py": [
        "N real kvstored daemons, each in a network namespace",
        "same bounded load per node",
        "the mesh",
        "real Redis Cluster",
        "upkeep CPU (s/s), RSS and bytes in per second",
        "Redis's own CPU and memory",
        "target <= 1.10x",
        "bench.scale_out's model",
    ],
    "populate.py": ["1 thread (the baseline)", "page mode", "same run"],
    "restart.py": ["hand-over", "cold restart", "byte-exact", "ratio cold / hand-over", "16 GiB pool", "runs 8 GiB"],
    "tiers.py": ["raw O_DIRECT", "raw aiobotocore", "fs tier", "S3 tier"],
    "vllm_tier.py": ["vLLM's built-in fs tier", "TieringOffloadingManager"],
}


def bench(script: str) -> list[str]:
    """The command that runs bench/<script> (a module of the bench package)."""
    return [sys.executable, "-m", f"bench.{script.removesuffix('.py')}"]


def run_bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*bench(script), *args], capture_output=True, text=True, timeout=timeout, env=clean_env(), cwd=REPO_ROOT
    )


def bench_help(script: str) -> str:
    proc = run_bench(script, "--help")
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.split())  # argparse wraps lines


DOCS = [REPO_ROOT / "README.md", REPO_ROOT / "Makefile", *sorted((REPO_ROOT / "docs").glob("*.md"))]
BENCH_COMMAND = re.compile(r"-m bench\.(\w+)((?:[ \t]+(?:\\\n[ \t]*)?[^\s`|#;]+)*)")


def documented_flags() -> dict[str, set[str]]:
    """Every `python -m bench.X ... --flag` the docs and the Makefile give: module -> flags."""
    flags: dict[str, set[str]] = {}
    for path in DOCS:
        for module, rest in BENCH_COMMAND.findall(path.read_text()):
            flags.setdefault(module, set()).update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest))
    return flags


@pytest.mark.vllm  # (bench.vllm_tier imports vllm before it parses --help)
def test_every_flag_the_docs_give_a_bench_is_one_it_takes():
    documented = documented_flags()
    assert {"local_path", "multiturn", "scale_out", "fleet"} <= set(documented), sorted(documented)
    for module, flags in sorted(documented.items()):
        offered = set(re.findall(r"--[a-z][a-z0-9-]*", bench_help(f"{module}.py")))
        assert flags <= offered, f"bench.{module}: the docs give {sorted(flags - offered)}, which --help does not list"


# vllm_tier.py imports vllm before it parses --help
@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=pytest.mark.vllm) if s == "vllm_tier.py" else s for s in sorted(COMPARED)]
)
def test_help_says_what_is_compared(script):
    text = bench_help(script)
    missing = [phrase for phrase in COMPARED[script] if phrase not in text]
    assert not missing, f"bench/{script} --help does not mention {missing}:\n{text}"


def test_multiturn_defaults_are_the_workload_its_help_names():
    text = bench_help("multiturn.py")
    options = re.split(r" (?=--[a-z][\w-]* [A-Z_]+ )", text[text.index("options:") :])
    defaults = {}
    for option in options:
        found = re.match(r"--([\w-]+) [A-Z_]+ .*\(default: ([^)]+)\)", option)
        if found:
            defaults[found[1]] = found[2]
    assert (defaults["initial-tokens"], defaults["turn-tokens"], defaults["turns"], defaults["think-s"]) == (
        str(12 * 1024),
        str(4 * 1024),
        "8",
        "20.0",
    )
    assert defaults["conversations"].split(",")[0] == "16" and defaults["conversations"].split(",")[-1] == "256"


def test_multiturn_model_flag_names_both_models_and_defaults_to_the_seeds():
    text = bench_help("multiturn.py")
    found = re.search(r"--model \{([^}]*)\}.*?\(default: ([^)]+)\)", text[text.index("options:") :])
    assert found, text
    assert set(found[1].split(",")) == {"qwen3.6-35b-a3b", "llama-3.1-8b"}
    assert found[2] == "qwen3.6-35b-a3b"
    for flag in ("--model-kv-bytes-per-token", "--prefill-tokens-per-s", "--gpu-tokens", "--gpu-conversations"):
        assert flag in text


def dry_run(tmp_path, *args: str) -> dict:
    out = tmp_path / "plan.json"
    proc = run_bench("multiturn", "--dry-run", "--json", str(out), *args)
    assert proc.returncode == 0, proc.stderr
    assert "results" not in json.loads(out.read_text())  # nothing ran
    return json.loads(out.read_text())["model"] | {"stdout": proc.stdout}


def kv_cache_bytes(gpus: int, params: float) -> float:
    """vLLM's KV budget: per GPU, HBM (81,559 MiB) x 0.9 - the weights' share (bf16) - a 10% reserve."""
    hbm = 81_559 * 2**20
    return gpus * (0.9 * hbm - params * 2 / gpus - 0.1 * hbm)


def test_multiturn_models_figures_come_from_their_shapes(tmp_path):
    qwen = dry_run(tmp_path)
    assert qwen["model_key"] == "qwen3.6-35b-a3b"
    assert qwen["model_kv_bytes_per_token"] == 10 * 2 * 2 * 256 * 2 == 20_480
    assert qwen["prefill_tokens_per_s"] == 50_000
    assert qwen["gpu_tokens"] == int(kv_cache_bytes(2, 35e9) // 20_480)
    assert 75 < qwen["gpu_tokens"] / 40_960 < 85  # conversations at their 40K-token last turn
    assert qwen["byte_scale"] == 40
    derivation = qwen["derivation"]
    assert derivation["flops_per_token"] == 2 * 3e9 + 10 * 4 * 16 * 256 * 20_480
    assert 45_000 < derivation["estimated_prefill_tokens_per_s"] < 55_000
    assert [b["quantity"] for b in qwen["basis"]][:3] == ["KV bytes/token", "prefill", "GPU prefix cache"]
    assert "TP=2" in qwen["model_name"] and "MFU" in qwen["stdout"]

    llama = dry_run(tmp_path, "--model", "llama-3.1-8b")
    assert llama["model_kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2 == 131_072
    assert llama["prefill_tokens_per_s"] == 16_000
    assert llama["gpu_tokens"] == int(kv_cache_bytes(1, 8.03e9) // 131_072)
    assert llama["byte_scale"] == 256


def test_multiturn_overrides_win_and_say_so(tmp_path):
    m = dry_run(tmp_path, "--model-kv-bytes-per-token", "65536", "--prefill-tokens-per-s", "8000")
    assert (m["model_kv_bytes_per_token"], m["prefill_tokens_per_s"]) == (65_536, 8_000)
    assert m["gpu_tokens"] == int(kv_cache_bytes(2, 35e9) // 65_536)  # the HBM budget, in the overridden size
    basis = {b["quantity"]: b["basis"] for b in m["basis"]}
    assert basis["KV bytes/token"].startswith("--model-kv-bytes-per-token")
    assert basis["prefill"].startswith("--prefill-tokens-per-s")
    assert "overridden" in m["model_name"]

    assert dry_run(tmp_path, "--gpu-tokens", "100000")["gpu_tokens"] == 100_000
    assert dry_run(tmp_path, "--gpu-conversations", "64")["gpu_tokens"] == 64 * 40_960


@pytest.mark.parametrize("transfer", ["region", "pool"])
def test_multiturn_small_run_reports_rows_with_their_limits(tmp_path, transfer):
    """A tiny sweep against a real daemon (RAM of one conversation, so the fs tier serves loads),
    moving chunks as vLLM's tier does (region) or as the direct spec does (pool): the JSON has the
    target rows (name, value, baseline, ratio, target, status) and what bounds each."""
    out = tmp_path / "run.json"
    proc = run_bench(
        "multiturn",
        "--conversations",
        "4",
        "--configs",
        "none,ram,ram+fs",
        "--initial-tokens",
        "8192",
        "--turn-tokens",
        "4096",
        "--turns",
        "3",
        "--think-s",
        "0.5",
        "--gpu-tokens",
        "16384",
        "--ram-conversations",
        "1",
        "--fs-conversations",
        "8",
        "--no-limits",
        "--transfer",
        transfer,
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        str(out),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    targeted = [r for r in doc["rows"] if r["target"] is not None]
    assert {r["name"] for r in targeted} == {
        "RAM + fs hit rate, 4 conversations",
        "RAM + fs vs no offload, 4 conversations",
        "RAM + fs vs RAM alone, 4 conversations",
    }
    for r in targeted:
        assert set(r) >= {"name", "value", "baseline", "ratio", "target", "status", "limit"}
        assert r["status"] == ("PASS" if r["ratio"] >= r["target"] else "MISS")
        assert r["limit"]
    vs_none = rows["RAM + fs vs no offload, 4 conversations"]
    assert vs_none["ratio"] == pytest.approx(vs_none["value"] / vs_none["baseline"])
    runs = {r["config"]: r for r in doc["results"]}
    assert runs["ram+fs"]["hit_rate"]["fs"] > 0 and runs["ram+fs"]["corrupt_chunks"] == 0
    assert "fs loads" in vs_none["limit"]
    assert doc["load_average"]["max"] >= doc["load_average"]["min"] > 0
    assert doc["model"]["transfer"] == transfer
    assert "targets and ratios" in proc.stdout and "bounded by" in proc.stdout


def test_multiturn_slow_disk_preset_plans_its_three_configs(tmp_path):
    """--slow-disk: RAM alone, RAM + fs with the recompute gate, RAM + fs without it (the daemon told
    recompute_gate=false); the prefill rate registered (x4 the model's, in real bytes per token)."""
    plan = dry_run(tmp_path, "--slow-disk")
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert [c["key"] for c in doc["configs"]] == ["ram", "ram+fs", "ram+fs-nogate"]
    assert doc["slow_disk"] is True
    assert plan["prefill_tokens_per_s"] == 4 * 50_000
    assert doc["registered_prefill_tokens_per_s"] == 4 * 50_000 * plan["byte_scale"]
    assert "--slow-disk" in bench_help("multiturn.py")
    assert dry_run(tmp_path)["prefill_tokens_per_s"] == 50_000  # (without it: nothing registered)
    assert json.loads((tmp_path / "plan.json").read_text())["registered_prefill_tokens_per_s"] == 0


def test_multiturn_register_rates_registers_the_modelled_prefill_rate(tmp_path):
    """--register-rates: every namespace registers the modelled prefill rate per real KV byte (x the
    byte scale, so the daemon's break-even is the model's), on one node and with --nodes; the
    multi-node plan says so. Without it nothing is registered."""
    one = dry_run(tmp_path, "--register-rates")
    assert one["register_rates"] is True
    assert json.loads((tmp_path / "plan.json").read_text())["registered_prefill_tokens_per_s"] == 50_000 * 40
    fleet = dry_run(tmp_path, "--nodes", "2", "--directory", "--register-rates", "--prefill-tokens-per-s", "20000")
    assert json.loads((tmp_path / "plan.json").read_text())["registered_prefill_tokens_per_s"] == 20_000 * 40
    assert "registers 800,000 prefill tokens/s of 512 real bytes" in fleet["stdout"]
    assert "break-even 0.38 GiB/s" in fleet["stdout"]
    plain = dry_run(tmp_path, "--nodes", "2", "--directory")
    assert json.loads((tmp_path / "plan.json").read_text())["registered_prefill_tokens_per_s"] == 0
    assert "no prefill rate registered" in plain["stdout"] and "--register-rates" in bench_help("multiturn.py")


def test_restart_small_run_keeps_every_chunk_a_byte_exact_ram_hit_only_with_the_hand_over(tmp_path):
    """bench.restart on a 64 MiB RAM tier: after the hand-over every chunk is a RAM hit and loads
    byte-exact, without a second pool, three times over; after the cold restart (RAM only) none is."""
    out = tmp_path / "restart.json"
    proc = run_bench("restart", "--cpu-bytes", "64MiB", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    *handovers, cold = doc["results"]
    assert [r["kind"] for r in handovers] == ["hand-over"] * 3 and cold["kind"] == "cold"  # (--rounds 3)
    assert doc["chunks"] == 32 and cold["chunks"] == 32
    for ho in handovers:  # (each adopts what the one before adopted)
        assert ho["ram_hits"] == 32 and ho["wrong_chunks"] == 0 and ho["bytes_verified"] == 64 << 20
        assert ho["all_ram_hits_s"] is not None and ho["same_pool"]  # the pool adopted, not a second one
        assert {"requested", "sent", "received", "adopted", "serving"} <= set(ho["steps_s"])
    assert (
        cold["ram_hits"] == 0
        and cold["bytes_verified"] == 0
        and cold["all_ram_hits_s"] is None
        and not cold["same_pool"]
    )
    assert doc["target"]["unserved"] in ("PASS", "MISS") and "cold / hand-over" in proc.stdout


SCALE_DESIGNS = ["mesh", "coalesced", "directory", "redis", "router"]


def scale_out(tmp_path, *args: str) -> dict:
    out = tmp_path / "scale.json"
    proc = run_bench("scale_out", "--json", str(out), *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()) | {"stdout": proc.stdout}


def test_scale_out_models_the_committed_calibration(tmp_path):
    """From the committed calibration (measured on real daemons): four designs at 1, 10, 100 and 1000
    nodes, costs that grow with the fleet, and where each design leaves the budget, in the order the
    designs are meant to scale (the mesh first, the router never: it keeps no index of the others)."""
    doc = scale_out(tmp_path)
    assert doc["calibration"]["path"].endswith("docs/scale-out-calibration.json")
    assert doc["calibration"]["load_average"] and doc["calibration"]["cpu_model"] is not None
    assert [d["key"] for d in doc["designs"]] == SCALE_DESIGNS
    assert doc["nodes"] == [1, 10, 100, 1000]
    fields = {
        "nodes",
        "cpu_fraction",
        "cpu_parts",
        "memory_bytes",
        "memory_parts",
        "inbound_bytes_per_s",
        "lookup_ms",
        "coverage",
        "s3_puts_per_s",
        "s3_gets_per_s",
        "s3_usd_per_month",
    }
    designs = {d["key"]: d for d in doc["designs"]}
    for d in doc["designs"]:
        assert [r["nodes"] for r in d["rows"]] == [1, 10, 100, 1000]
        for rows in (d["rows"], d["curve"]):
            assert all(fields <= set(r) for r in rows)
            for before, after in zip(rows, rows[1:]):  # more nodes never cost a node less
                for key in ("cpu_fraction", "memory_bytes", "inbound_bytes_per_s", "lookup_ms", "s3_gets_per_s"):
                    assert after[key] >= before[key] - 1e-12, (d["key"], key, before["nodes"], after["nodes"])
                assert after["coverage"] <= before["coverage"] + 1e-12
        for r in d["rows"]:
            assert r["cpu_fraction"] == sum(r["cpu_parts"].values())
            assert r["memory_bytes"] == sum(r["memory_parts"].values())
    one = [d["rows"][0] for d in doc["designs"]]
    assert all(r["inbound_bytes_per_s"] == 0 and r["memory_parts"]["index"] == 0 for r in one)  # no peers yet
    # The full mesh follows every peer: per node it grows with the fleet; a directory's stays flat.
    mesh, directory = designs["mesh"]["rows"], designs["directory"]["rows"]
    assert mesh[3]["inbound_bytes_per_s"] > 50 * mesh[1]["inbound_bytes_per_s"]
    assert directory[3]["memory_parts"]["index"] == directory[1]["memory_parts"]["index"]
    assert designs["router"]["rows"][3]["inbound_bytes_per_s"] == 0

    breaks = {k: d["break"] for k, d in designs.items()}
    assert breaks["router"] is None
    assert 2 <= breaks["mesh"]["nodes"] <= breaks["coalesced"]["nodes"] < breaks["directory"]["nodes"]
    for b in (breaks["mesh"], breaks["coalesced"], breaks["directory"]):
        assert b["resource"] in ("cpu", "memory")
        over = b["cpu_fraction"] > doc["budget"]["cpu_fraction"] or b["memory_bytes"] > doc["budget"]["memory_bytes"]
        assert over
    assert "where each design stops scaling" in doc["stdout"]
    assert [v["variant"] for v in doc["sensitivity"]][0] == "as stated"
    assert set(doc["sensitivity"][0]["breaks"]) == set(SCALE_DESIGNS)
    basis = {b["figure"] for b in doc["basis"]}
    assert {"turns per node", "chunk", "stores", "S3"} <= basis
    assert doc["s3"]["puts_per_s_per_node"] > 0 and designs["mesh"]["rows"][1]["s3_usd_per_month"] > 0


def test_scale_out_assumptions_are_flags(tmp_path):
    """Halving the turn rate halves the events to follow: no design breaks sooner, and the stated
    workload in the JSON is the one given."""
    base = scale_out(tmp_path, "--max-nodes", "5000")
    slow = scale_out(tmp_path, "--max-nodes", "5000", "--turns-per-s", "5", "--put-usd-per-1k", "0.01")
    assert slow["fleet"]["turns_per_s"] == 5 and slow["fleet"]["put_usd_per_1k"] == 0.01
    assert slow["rates"]["events_per_s"] == pytest.approx(base["rates"]["events_per_s"] / 2)
    for b, s in zip(base["designs"], slow["designs"]):
        if b["break"] is None:
            assert s["break"] is None
        elif s["break"] is not None:
            assert s["break"]["nodes"] >= b["break"]["nodes"]


def test_multiturn_help_names_the_multi_node_mode_and_its_set_ups():
    text = bench_help("multiturn.py")
    for phrase in (
        "--nodes",
        "round-robin (no KV awareness)",
        "islands (each node RAM + fs, no peers)",
        "RAM + fs + peers",
        "one shared S3 bucket",
        "PEER included",
        "--peer-transport",
        "--settle-s",
    ):
        assert phrase in text, f"bench/multiturn.py --help does not mention {phrase!r}:\n{text}"


def test_multiturn_nodes_dry_run_plans_the_nodes(tmp_path):
    out = tmp_path / "plan.json"
    proc = run_bench("multiturn", "--nodes", "3", "--dry-run", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert "results" not in doc and doc["benchmark"] == "multiturn-nodes" and doc["nodes"] == 3
    assert [c["key"] for c in doc["configs"]] == ["none", "ram+fs", "ram+fs+peer", "ram+fs+s3"]
    tiers = {c["key"]: c["tiers"] for c in doc["configs"]}
    assert tiers["ram+fs+peer"] == ["gpu", "ram", "fs", "peer"] and "peer" not in tiers["ram+fs"]
    assert "round robin" in doc["routing"] and doc["sizes_in_conversations"]["ram"] == 64
    assert doc["model"]["model_key"] == "qwen3.6-35b-a3b" and doc["measured"] and doc["modelled"]
    assert "routing" in proc.stdout and "MFU" in proc.stdout


def test_multiturn_directory_dry_run_plans_its_set_ups(tmp_path):
    """--directory: islands, the directory's fleet and one node with the fleet's RAM + fs, named in
    the plan (no cluster started for a dry run)."""
    assert "--directory" in bench_help("multiturn.py")
    out = tmp_path / "plan.json"
    proc = run_bench("multiturn", "--nodes", "4", "--directory", "--dry-run", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["nodes"] == 4 and "Redis Cluster" in doc["directory"] and "results" not in doc
    configs = {c["key"]: c for c in doc["configs"]}
    assert list(configs) == ["none", "ram+fs", "ram+fs+dir", "pooled"]
    assert configs["ram+fs+dir"]["directory"] and configs["ram+fs+dir"]["tiers"] == ["gpu", "ram", "fs", "peer"]
    assert configs["pooled"]["pooled"] and "peer" not in configs["pooled"]["tiers"]
    assert "no static peers" in proc.stdout and "one node, fleet's RAM + fs" in proc.stdout


def test_multiturn_nodes_small_run_reports_peer_hits_and_rows(tmp_path):
    """A tiny real cluster: 2 daemons, 4 conversations of 3 turns, every set-up (the shared bucket on
    radosgw, or moto_server where Ceph is missing). A turn always lands on the other node, so only
    the peer tier and the shared bucket find the previous turn's chunks."""
    out = tmp_path / "run.json"
    proc = run_bench(
        "multiturn",
        "--nodes",
        "2",
        "--conversations",
        "4",
        "--initial-tokens",
        "8192",
        "--turn-tokens",
        "4096",
        "--turns",
        "3",
        "--think-s",
        "0.5",
        "--gpu-tokens",
        "16384",
        "--ram-conversations",
        "2",
        "--fs-conversations",
        "8",
        "--s3-fs-conversations",
        "2",
        "--settle-s",
        "0.5",
        "--no-limits",
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        str(out),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    runs = {r["config"]: r for r in doc["results"]}
    assert set(runs) == {"none", "ram+fs", "ram+fs+peer", "ram+fs+s3"}
    assert not any(r["skipped"] for r in runs.values()), [r["skipped"] for r in runs.values()]
    peers, islands, s3 = runs["ram+fs+peer"], runs["ram+fs"], runs["ram+fs+s3"]
    assert all(r["corrupt_chunks"] == 0 for r in runs.values())
    assert peers["hit_rate"]["peer"] > 0 and islands["hit_rate"]["peer"] == 0 and s3["hit_rate"]["s3"] > 0
    assert peers["hit_rate_overall"] > islands["hit_rate_overall"]
    # what the lookups called peer hits came over the wire: one node received what another served
    peer_chunks = peers["hit_tokens"]["peer"] // 4096
    assert peers["peers"]["received_chunks"] >= peer_chunks > 0
    assert peers["peers"]["served_chunks"] == peers["peers"]["received_chunks"]
    assert all(node["turns"] > 0 for node in peers["per_node"]) and len(peers["per_node"]) == 2

    targeted = [r for r in doc["rows"] if r["target"] is not None]
    assert {r["name"] for r in targeted} == {
        "peers: hit rate, 2 nodes, 4 conversations",
        "peers vs islands (no peers), 2 nodes, 4 conversations",
    }
    for r in doc["rows"]:
        assert set(r) >= {"name", "value", "baseline", "ratio", "target", "status", "limit"}
        if r["target"] is not None:
            assert r["status"] == ("PASS" if r["ratio"] >= r["target"] else "MISS")
    assert doc["load_average"]["max"] >= doc["load_average"]["min"] > 0
    assert doc["model"]["transfer"] == "region"  # (the default: vLLM's kvstored tier)
    assert "targets and ratios" in proc.stdout and "raw TCP on loopback" in proc.stdout


@pytest.mark.vllm  # Dynamo's router venv comes with vllm-deps
def test_multiturn_nodes_kv_route_follows_dynamos_index(tmp_path):
    """--route kv: the same tiny cluster routed by Dynamo's indexer fed by the daemons' ZMQ events,
    beside round robin. Each conversation stays on the node that holds its chunks, so it finds
    them there: no peer fetches, where round robin fetches every later turn from the other node."""
    out = tmp_path / "run.json"
    proc = run_bench(
        "multiturn",
        *("--nodes", "2", "--route", "kv", "--configs", "ram+fs+peer", "--conversations", "4"),
        *("--initial-tokens", "8192", "--turn-tokens", "4096", "--turns", "3", "--think-s", "0.5"),
        *("--gpu-tokens", "16384", "--ram-conversations", "2", "--fs-conversations", "8", "--settle-s", "0.5"),
        *("--no-limits", "--workdir", str(tmp_path / "work"), "--json", str(out)),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    (rr,), (kv,) = doc["results"], doc["kv_results"]
    assert (rr["route"], kv["route"]) == ("rr", "kv") and not rr["skipped"] and not kv["skipped"]
    assert kv["kv_routed"] > 0 and kv["corrupt_chunks"] == 0
    assert rr["peers"]["received_chunks"] > 0 and kv["peers"]["received_chunks"] < rr["peers"]["received_chunks"]
    assert kv["hit_rate"]["peer"] < rr["hit_rate"]["peer"]
    assert kv["hit_rate_overall"] >= rr["hit_rate_overall"]
    assert "routing: round robin vs KV-aware" in proc.stdout


@pytest.mark.vllm
@pytest.mark.parametrize("flag", ["--load-batch", "--store-batch"])
def test_vllm_tier_refuses_a_batch_larger_than_vllms_cpu_tier(flag):
    # 200 x 2 MiB is more than the 256 MiB CPU tier: the run would wait for room that never frees.
    proc = run_bench("vllm_tier", flag, "200", "--primary", "256MiB")
    assert proc.returncode == 2, proc.stderr
    assert f"{flag} 200 x 2 MiB chunks does not fit vLLM's CPU tier" in proc.stderr
    assert "use at most 128" in proc.stderr
