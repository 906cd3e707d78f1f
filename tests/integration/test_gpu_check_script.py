# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""tests/gpu/run.sh, the GPU check, run here as its own CPU dry run.

The GPU machine has no vLLM and none of the daemon's optional packages (aiohttp, pyzmq, msgpack,
aiobotocore, xxhash), so the dry run hides them: a sitecustomize on PYTHONPATH makes importing
them fail in the script and in the daemon it starts. What would break there breaks here first;
only the CUDA calls themselves stay untested.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.daemon import REPO_ROOT, clean_env

ABSENT_ON_GPU_MACHINE = ("vllm", "aiohttp", "zmq", "msgpack", "aiobotocore", "botocore", "xxhash")


def hide_modules(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(f"""
        import sys

        class _Absent:
            names = {ABSENT_ON_GPU_MACHINE!r}

            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in self.names:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU machine)", name=name)
                return None

        sys.meta_path.insert(0, _Absent())
    """)
    )
    return site


def run_check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = clean_env({"PYTHON": sys.executable, "PYTHONPATH": str(hide_modules(tmp_path))})
    return subprocess.run(
        ["bash", str(REPO_ROOT / "tests/gpu/run.sh"), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_hidden_modules_really_are_hidden(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(hide_modules(tmp_path)))
    probe = subprocess.run([sys.executable, "-c", "import aiohttp"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "absent on the GPU machine" in probe.stderr


def test_dry_run_moves_exact_bytes_without_optional_packages(tmp_path):
    result = run_check(tmp_path, "--device", "cpu", "--layers", "2", "--blocks", "64", "--reps", "1")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "byte equality: OK" in out
    for row in (
        "cudaMemcpy, pinned host memory",
        "direct spec worker, contiguous blocks",
        "direct spec worker, scattered blocks",
    ):
        assert row in out
    assert "GiB/s" in out


def test_without_a_gpu_it_says_so(tmp_path):
    result = run_check(tmp_path)
    assert result.returncode != 0
    assert "no CUDA device" in result.stderr
