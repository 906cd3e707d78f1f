# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Per-call latency as a client saw it, by call kind (lookup, store, load): `record` each call, or
`watch(link)` a vLLM DaemonLink to time each of its calls from issue to answer; p50/p99 printed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.lib.report import percentile, print_aligned

# The kind each data-path RPC belongs to (the direct spec's two calls per transfer count apart).
KIND_OF = {
    "Lookup": "lookup",
    "Touch": "lookup (Touch: hits found in the key index, posted)",
    "StoreFromRegion": "store",
    "Reserve": "store (Reserve)",
    "Commit": "store (Commit)",
    "LoadToRegion": "load",
    "Acquire": "load (Acquire)",
    "Release": "load (Release)",
}


def timed_call(
    call: Callable[[Any], Any],
    ok: Callable[[Any], bool] = lambda _: True,
    what: str = "",
    prepare: Callable[[], Any] = lambda: None,
) -> Callable[[], float]:
    """One call, timed alone: call(prepare()) (set-up untimed), then its answer checked (untimed;
    RuntimeError `what` when ok(answer) is false). Returns the seconds the call took."""

    def run() -> float:
        arg = prepare()
        t0 = time.perf_counter()
        answer = call(arg)
        elapsed = time.perf_counter() - t0
        if not ok(answer):
            raise RuntimeError(f"{what} ({answer})")
        return elapsed

    return run


def interleaved(kinds: dict[str, Callable[[], float]], iters: int, warmup: int) -> dict[str, list[float]]:
    """Each kind's call `warmup` + `iters` times, kind after kind in an order rotated each time (no
    kind always follows the same one); milliseconds of the timed calls, by kind."""
    names = list(kinds)
    samples: dict[str, list[float]] = {k: [] for k in names}
    for i in range(warmup + iters):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            elapsed = kinds[name]()
            if i >= warmup:
                samples[name].append(elapsed * 1e3)
    return samples


class CallLatency:
    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}  # kind -> seconds, one per call

    def record(self, kind: str, seconds: float) -> None:
        self.samples.setdefault(kind, []).append(seconds)  # (list.append: safe from gRPC's threads)

    def watch(self, link: Any) -> None:
        """Time the calls of a kvstored_client.vllm.driver.DaemonLink (its `observe` hook)."""
        link.observe = lambda method, seconds: self.record(KIND_OF.get(method) or method, seconds)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            kind: {"calls": len(v), "p50_ms": percentile(v, 50) * 1e3, "p99_ms": percentile(v, 99) * 1e3}
            for kind, v in self.samples.items()
            if v
        }

    def print(self, title: str, transports: str = "") -> None:
        """A table of p50/p99 per kind; `transports`: how the calls went (fast path / gRPC counts)."""
        summary = self.summary()
        if not summary:
            return
        print(f"{title}{f' ({transports})' if transports else ''}:")
        rows = [
            [k, str(int(s["calls"])), f"{s['p50_ms']:.3f}", f"{s['p99_ms']:.3f}"] for k, s in sorted(summary.items())
        ]
        print_aligned([["call", "calls", "p50 ms", "p99 ms"], *rows], right={1, 2, 3})
