# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Reports: rows with their baselines, ratios and PASS/MISS, one table printer, the machine, the
load average, JSON output, timing arithmetic."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.limits import GIB, MIB, glibc_non_temporal_threshold

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Row:
    name: str
    value: float
    unit: str  # "GiB/s", "ms", "share", "tokens/s"
    baseline_name: str = ""
    baseline: float | None = None
    target: float | None = None  # ratio target
    higher_is_better: bool = True  # GiB/s: ratio >= target; latency: ratio <= target
    median: float | None = None
    note: str = ""
    limit: str = ""  # the physical limit the row is bounded by, in words (printed when given)

    @property
    def ratio(self) -> float | None:
        return None if self.baseline in (None, 0) else self.value / self.baseline

    @property
    def status(self) -> str:
        if self.target is None or self.ratio is None:
            return ""
        ok = self.ratio >= self.target if self.higher_is_better else self.ratio <= self.target
        return "PASS" if ok else "MISS"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "status": self.status or None}


def _fmt(v: float | None, unit: str) -> str:
    return "" if v is None else f"{v:.{3 if unit == 'ms' else 2}f} {unit}"


def print_aligned(table: Sequence[Sequence[str]], right: set[int], file=None) -> None:
    """A header row, a rule, then the rows; columns in `right` are right-aligned."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    print(line(table[0]), "  ".join("-" * w for w in widths), *map(line, table[1:]), sep="\n", file=file or sys.stdout)


def print_table(rows: Sequence[Row], title: str = "", file=None) -> None:
    extra = ["bounded by"] if any(r.limit for r in rows) else []
    table = [["measurement", "value", "median", "baseline", "baseline value", "ratio", "target", "result", *extra]]
    for r in rows:
        cells = [r.name, _fmt(r.value, r.unit), _fmt(r.median, r.unit), r.baseline_name, _fmt(r.baseline, r.unit)]
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else ""
        target = f"{'>=' if r.higher_is_better else '<='} {r.target:.2f}x" if r.target is not None else ""
        table.append([*cells, ratio, target, r.status, *([r.limit] if extra else [])])
    if title:
        print(title, file=file)
    print_aligned(table, right={1, 2, 4, 5}, file=file)
    for r in rows:
        if r.note:
            print(f"  * {r.name}: {r.note}", file=file)


def fmt_bytes(n: float, grouped: bool = False) -> str:
    """`grouped`: thousands separators (1,024.0 GiB)."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}" if grouped else f"{n / size:.1f} {unit}"
    return f"{n:,.0f} B" if grouped else f"{int(n)} B"


def machine_info() -> dict[str, Any]:
    import grpc

    cpuinfo = ""
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text()
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    return {
        "cpu_model": models[0] if models else "",
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "glibc": "-".join(platform.libc_ver()),
        "numpy": np.__version__,
        "grpcio": grpc.__version__,
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "git": git_revision(),
        "glibc_non_temporal_threshold": glibc_non_temporal_threshold(),
    }


def git_revision() -> str:
    """HEAD of the checkout, with '+dirty' when tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=5).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "-uno") else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def load_average() -> float:
    """1-minute load average: above ~1 on an idle machine, other work is competing for the CPUs."""
    return os.getloadavg()[0]


def write_json(path: str | os.PathLike, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2, default=str) + "\n")


def percentile(values: Sequence[float], p: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), p))


@dataclass
class Stats:
    best: float
    median: float
    worst: float
    samples: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, samples: Iterable[float], higher_is_better: bool = True) -> Stats:
        s = list(samples)
        hi, lo = max(s), min(s)
        return cls(hi if higher_is_better else lo, statistics.median(s), lo if higher_is_better else hi, s)


def aggregate_gib_s(total_bytes: int, windows: Sequence[tuple[float, float]]) -> float:
    """Throughput of processes that ran concurrently: bytes / (last end - first start) (perf_counter
    is CLOCK_MONOTONIC, system-wide, so windows from several processes combine)."""
    return total_bytes / (max(w[1] for w in windows) - min(w[0] for w in windows)) / GIB
