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
    "compare.py": ["Redis 7 GET/SET", "raw memcpy", "raw O_DIRECT", "fs tier", "local"],
    "local_path.py": ["pool mapping", "region registration", "memcpy", "empty gRPC round trip"],
    "peer.py": ["peer tier", "raw TCP socket", "raw ucxx", "fs tier", "S3 tier", "radosgw"],
    "multiturn.py": ["12K-token first prompt", "4K more tokens per turn", "8 turns", "20 s think time",
                     "no offload", "RAM + fs + S3"],
    "tiers.py": ["raw O_DIRECT", "raw aiobotocore", "fs tier", "S3 tier"],
    "vllm_tier.py": ["vLLM's built-in fs tier", "TieringOffloadingManager"],
}


def bench_help(script: str) -> str:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / script), "--help"], capture_output=True,
                          text=True, timeout=300, env=clean_env(), cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.split())  # argparse wraps lines


@pytest.mark.parametrize("script", sorted(COMPARED))
def test_help_says_what_is_compared(script):
    text = bench_help(script)
    missing = [phrase for phrase in COMPARED[script] if phrase not in text]
    assert not missing, f"bench/{script} --help does not mention {missing}:\n{text}"


def test_multiturn_defaults_are_the_workload_its_help_names():
    text = bench_help("multiturn.py")
    options = re.split(r" (?=--[a-z][\w-]* [A-Z_]+ )", text[text.index("options:"):])
    defaults = {}
    for option in options:
        found = re.match(r"--([\w-]+) [A-Z_]+ .*\(default: ([^)]+)\)", option)
        if found:
            defaults[found[1]] = found[2]
    assert (defaults["initial-tokens"], defaults["turn-tokens"], defaults["turns"], defaults["think-s"]) == (
        str(12 * 1024), str(4 * 1024), "8", "20.0")
    assert defaults["conversations"].split(",")[0] == "16" and defaults["conversations"].split(",")[-1] == "256"


def test_multiturn_model_flag_names_both_models_and_defaults_to_the_seeds():
    text = bench_help("multiturn.py")
    found = re.search(r"--model \{([^}]*)\}.*?\(default: ([^)]+)\)", text[text.index("options:"):])
    assert found, text
    assert set(found[1].split(",")) == {"qwen3.6-35b-a3b", "llama-3.1-8b"}
    assert found[2] == "qwen3.6-35b-a3b"
    for flag in ("--model-kv-bytes-per-token", "--prefill-tokens-per-s", "--gpu-tokens", "--gpu-conversations"):
        assert flag in text


def dry_run(tmp_path, *args: str) -> dict:
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "multiturn.py"), "--dry-run", "--json", str(out),
                           *args], capture_output=True, text=True, timeout=300, env=clean_env(), cwd=REPO_ROOT)
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


def test_multiturn_small_run_reports_rows_with_their_limits(tmp_path):
    """A tiny sweep against a real daemon (RAM of one conversation, so the fs tier serves loads):
    the JSON has the target rows (name, value, baseline, ratio, target, status) and what bounds each."""
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "multiturn.py"), "--conversations", "4", "--configs",
         "none,ram,ram+fs", "--initial-tokens", "8192", "--turn-tokens", "4096", "--turns", "3", "--think-s", "0.5",
         "--gpu-tokens", "16384", "--ram-conversations", "1", "--fs-conversations", "8", "--no-limits",
         "--workdir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=clean_env(), cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    targeted = [r for r in doc["rows"] if r["target"] is not None]
    assert {r["name"] for r in targeted} == {"RAM + fs hit rate, 4 conversations",
                                             "RAM + fs vs no offload, 4 conversations",
                                             "RAM + fs vs RAM alone, 4 conversations"}
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
    assert "targets and ratios" in proc.stdout and "bounded by" in proc.stdout
