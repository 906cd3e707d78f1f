# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""From the flags to the workload, the modelled model and the tier sizes; where the outputs go
(one node and several alike)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from bench.lib.report import GIB, write_json
from bench.lib.s3 import S3, start_s3
from bench.multiturn.model import MODELS, Basis, Config, Model, ModelSpec, Sizes, Workload, derive_model
from bench.multiturn.report import print_rows


class _Run(Protocol):
    skipped: str


R = TypeVar("R", bound=_Run)
C = TypeVar("C", bound=Config)


def parse_counts(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def select_configs(
    ap: argparse.ArgumentParser, text: str | None, default: Sequence[str], by_key: Mapping[str, C], unknown: str
) -> list[C]:
    """The set-ups --configs names (`default` without it); an unknown key is a usage error
    ("unknown {unknown} [keys]; choose among ...")."""
    keys = [c.strip() for c in (text or ",".join(default)).split(",") if c.strip()]
    bad = [c for c in keys if c not in by_key]
    if bad:
        ap.error(f"unknown {unknown.format(bad=bad)}; choose among {', '.join(by_key)}")
    return [by_key[c] for c in keys]


def print_targets(
    rows: Sequence[dict[str, Any]], heading: str, load: dict[str, float], cpus: int, sweep_s: float
) -> None:
    """The target rows under their heading, then what the sweep took (one node and several alike)."""
    print(
        f"targets and ratios ({heading}; load average over the sweep {load['min']:.1f}-{load['max']:.1f}, "
        f"mean {load['mean']:.1f}, on {cpus} CPUs):"
    )
    print_rows(rows)
    print(f"sweep took {sweep_s:.0f} s; load average {load['start']:.2f} at start, {load['end']:.2f} at end")


def setup(
    ap: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[Workload, Model, list[Basis], dict[str, float], Sizes, dict[str, float]]:
    """The workload, the modelled model (with its basis and derivation) and the tier sizes from the
    flags; argparse errors for what does not fit together."""
    w = Workload(args.initial_tokens, args.turn_tokens, args.turns, args.think_s, args.chunk_tokens, args.seed)
    if w.final_tokens // w.chunk_tokens < 1:
        ap.error("--chunk-tokens is larger than the last prompt")
    for flag in ("model_kv_bytes_per_token", "prefill_tokens_per_s", "gpu_tokens", "gpu_conversations"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            ap.error(f"--{flag.replace('_', '-')} must be positive")
    m, basis, derivation = derive_model(
        MODELS[args.model],
        w,
        args.kv_bytes_per_token,
        args.serial_loads,
        args.model_kv_bytes_per_token,
        args.prefill_tokens_per_s,
        args.gpu_tokens,
        args.gpu_conversations,
    )
    m = replace(m, transfer=args.transfer)
    if m.gpu_tokens < w.final_tokens:
        ap.error(f"the GPU cache ({m.gpu_tokens:,} tokens) must hold at least one whole prompt ({w.final_tokens:,})")
    conv_bytes = w.final_tokens * m.kv_bytes_per_token
    sizes = Sizes(
        ram_bytes=int(args.ram_conversations * conv_bytes),
        fs_bytes=int(args.fs_conversations * conv_bytes),
        s3_fs_bytes=int(args.s3_fs_conversations * conv_bytes),
    )
    sizes_conv = {
        "gpu": m.gpu_tokens / w.final_tokens,
        "ram": args.ram_conversations,
        "fs": args.fs_conversations,
        "s3_fs": args.s3_fs_conversations,
    }
    return w, m, basis, derivation, sizes, sizes_conv


def write_outputs(doc: dict[str, Any], json_path: str | None, plot_path: str | None) -> None:
    """The run's JSON and chart, where asked for (the multi-node mode writes its own the same way)."""
    if json_path:
        write_json(json_path, doc)
        print(f"JSON written to {json_path}")
    if plot_path:
        from bench.plot import plot_multiturn

        plot_multiturn(doc, plot_path)
        print(f"plot written to {plot_path}")


def command_line(argv: Sequence[str] | None) -> str:
    return " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv)


def model_doc(m: Model, spec: ModelSpec, derivation: dict[str, float], basis: Sequence[Basis]) -> dict[str, Any]:
    return {
        **asdict(m),
        "transfer": m.transfer.value,
        "byte_scale": m.byte_scale,
        "spec": asdict(spec),
        "derivation": derivation,
        "basis": [asdict(b) for b in basis],
    }


def start_sweep_s3(
    kind: str, configs: Sequence[Config], counts: Sequence[int], w: Workload, m: Model, moto: str, skipped: str
) -> tuple[S3 | None, str]:
    """The S3 server of a sweep whose configurations use one, and the line that says which (printed)."""
    if not any(c.uses("s3") for c in configs):
        return None, ""
    # radosgw keeps objects in a memstore OSD (RAM): room for the largest run's write-downs
    memstore = int(max(counts) * w.final_tokens * m.kv_bytes_per_token * 1.5) + GIB
    s3: S3 | None = None
    try:
        s3 = start_s3(kind, memstore)
        note = "S3: Ceph radosgw (memstore OSD) on loopback" if s3.is_rgw else f"S3: {moto} on loopback"
    except RuntimeError as exc:
        note = f"{skipped}: {exc}"
    print("  " + note, flush=True)
    return s3, note


def sweep(
    counts: Sequence[int],
    configs: Sequence[C],
    s3: S3 | None,
    s3_note: str,
    run: Callable[[C, int], R],
    skipped: Callable[[C, int, str], R],
    status: Callable[[R], str],
    measure: Callable[[], None] | None,
    width: int,
) -> tuple[list[R], float]:
    """Every configuration at every count (the limits measured before and after, unless None), one
    progress line per run; the S3 server is stopped at the end. Returns the results and the seconds."""
    results: list[R] = []
    t_start = time.perf_counter()
    try:
        if measure is not None:
            measure()
        for count in counts:
            for config in configs:
                r = skipped(config, count, s3_note) if config.uses("s3") and s3 is None else run(config, count)
                results.append(r)
                took = f"[{time.perf_counter() - t_start:6.0f} s]"
                print(f"  {took} {config.label:>{width}} x {count:>3}: {r.skipped or status(r)}", flush=True)
        if measure is not None:
            measure()
    finally:
        if s3 is not None:
            s3.stop()
    return results, time.perf_counter() - t_start


def section(title: str, lines: Sequence[str]) -> None:
    print()
    print(title)
    for line in lines:
        print("  " + line)


def targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"text": f"{r['name']}: {r['ratio']:.2f}x (target >= {r['target']:g}x)", "met": r["status"] == "PASS"}
        for r in rows
        if r["target"] is not None and r["ratio"] is not None
    ]
