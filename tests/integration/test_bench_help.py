"""Each benchmark's --help says what it compares (the multi-turn one: the article's workload, with
defaults that are that workload)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support.daemon import REPO_ROOT, clean_env

COMPARED = {
    "compare.py": ["Redis 7 GET/SET", "raw memcpy", "raw O_DIRECT", "fs tier", "local"],
    "local_path.py": ["pool mapping", "region registration", "memcpy", "empty gRPC round trip"],
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
