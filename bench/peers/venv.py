# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A peer's own venv under .venv/peers/<name>, made by the bench and reused while its install
steps are unchanged (a stamp file holds them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.lib.report import REPO

ROOT = REPO / ".venv" / "peers"


def ensure(name: str, steps: list[list[str]], check: str) -> Path:
    """The venv's python, after `pip install` of each step (in order) unless a stamp of the same
    steps is there and `check` (python code) runs; raises RuntimeError with pip's last lines."""
    venv = ROOT / name
    python = venv / "bin" / "python"
    stamp = venv / "kvstored-bench-steps.json"
    want = json.dumps(steps)
    if python.exists() and stamp.exists() and stamp.read_text() == want and _runs(python, check):
        print(f"  {name}: venv {venv.relative_to(REPO)} reused", flush=True)
        return python
    print(f"  {name}: making venv {venv.relative_to(REPO)}: " + "; ".join(" ".join(s) for s in steps), flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for step in steps:
        r = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *step],
            capture_output=True,
            text=True,
        )
        if r.returncode:
            tail = [ln for ln in (r.stdout + r.stderr).splitlines() if not ln.startswith("WARNING: Location")]
            raise RuntimeError(f"pip install {' '.join(step)} failed: {' | '.join(tail[-3:])}")
    if not _runs(python, check):
        raise RuntimeError(f"installed, but `{check}` fails in {venv}")
    stamp.write_text(want)
    return python


def _runs(python: Path, code: str) -> bool:
    r = subprocess.run([str(python), "-c", code], capture_output=True, cwd=REPO, timeout=120)
    return r.returncode == 0
