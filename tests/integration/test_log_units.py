# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Sizes in the daemon's logs are in human units (64.0 MiB, not 67108864): checked on a real
daemon's start-up lines, and for every log call in kvstored/ that passes a byte count."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

from tests.support.daemon import REPO_ROOT, short_tmpdir

LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}
BYTE_WORDS = ("bytes", "size", "capacity")


def test_start_up_lines_use_human_sizes(daemon_factory):
    root = short_tmpdir("kvlog")
    try:
        d = daemon_factory(["--tiers", f"kind=fs,root={root},bytes=64MiB"], cpu_bytes="16MiB")
        d.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert "RAM tier 16.0 MiB" in d.log
    fs_line = r"fs tier fs: 0 chunks, 0 B on disk under \S+ \(capacity 64\.0 MiB, O_DIRECT (on|off)\)"
    assert re.search(fs_line, d.log), d.log
    assert not re.search(r"\b\d{4,} bytes|capacity \d+[,)]", d.log), d.log  # e.g. "capacity 67108864)"


def test_every_log_call_formats_byte_counts():
    """A log call whose argument is a byte count (a name with bytes/size/capacity) goes through
    format_size; counts of things (chunks, objects) stay numbers."""
    raw = []
    for path in sorted((REPO_ROOT / "kvstored").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in LOG_METHODS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in ("log", "logger")
            ):
                continue
            for arg in node.args[1:]:
                text = ast.unparse(arg)
                words = re.split(r"[^a-z]+|_", text.lower())  # qsize() is a count, pool_bytes a size
                if any(w in words for w in BYTE_WORDS) and "format_size" not in text:
                    raw.append(f"{Path(path).relative_to(REPO_ROOT)}:{node.lineno}: {text}")
    assert not raw, "log calls printing raw byte counts (use kvstored.sizes.format_size):\n" + "\n".join(raw)
