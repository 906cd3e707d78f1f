# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The multi-turn benchmark's command line and its main: `python -m bench.multiturn` (one node:
plan.OneNode) and `--nodes N` (several: nodes_main.SeveralNodes), planned, swept and reported alike."""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import bench.multiturn
from bench.lib.limits import apply_nt_threshold, nt_threshold_arg
from bench.lib.report import REPO, load_average, machine_info, write_json
from bench.multiturn import nodes, report
from bench.multiturn.limits import Limits, measure_limits
from bench.multiturn.model import CONFIG_BY_KEY, CONFIGS, DEFAULT_MODEL, MODELS, SLOW_DISK, Transfer
from bench.multiturn.nodes_main import SeveralNodes
from bench.multiturn.plan import SLOW_DISK_PREFILL, OneNode, setup, start_sweep_s3


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except None (the flag's help says what is derived instead)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def _add(g: argparse._ArgumentGroup, flag: str, default: Any, text: str | None, kind: type | None = None) -> None:
    """A flag whose value has its default's type (`kind` where the default is None: derived)."""
    g.add_argument(flag, type=kind or type(default), default=default, help=text)


def build_parser() -> argparse.ArgumentParser:
    description = (bench.multiturn.__doc__ or "").split("\n\n")[0]
    ap = argparse.ArgumentParser("python -m bench.multiturn", description=description, formatter_class=_HelpFormatter)
    g = ap.add_argument_group("workload")
    _add(g, "--initial-tokens", 12 * 1024, "first prompt of every conversation")
    _add(g, "--turn-tokens", 4 * 1024, "tokens each turn appends to the history")
    _add(g, "--turns", 8, "turns per conversation")
    _add(g, "--think-s", 20.0, "mean think time between turns, modelled seconds (uniform 0.5-1.5x)")
    _add(g, "--conversations", "16,32,64,128,192,256", "simultaneous conversations to sweep")
    _add(g, "--chunk-tokens", 4096, "tokens per kvstored chunk (x --kv-bytes-per-token: 2 MiB, as bench/compare.py)")
    _add(g, "--seed", 0, None)
    g = ap.add_argument_group("modelled GPU and model")
    models = "qwen3.6-35b-a3b (2x H100, TP=2) or llama-3.1-8b (one H100); derived figures are printed with their basis"
    g.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS), help=models)
    _add(g, "--model-kv-bytes-per-token", None, "KV bytes per token of the model (default: from its layers)", int)
    _add(g, "--kv-bytes-per-token", 512, "KV bytes per token that really move through kvstored (the scale)")
    _add(g, "--prefill-tokens-per-s", None, "modelled prefill rate (default: from FLOPs/token, bf16 peak, MFU)", float)
    gpu_text = "GPU prefix cache, in conversations at their last turn (default: from HBM minus weights)"
    _add(g, "--gpu-conversations", None, gpu_text, float)
    _add(g, "--gpu-tokens", None, "GPU prefix cache in tokens (overrides --gpu-conversations)", int)
    g.add_argument("--serial-loads", action="store_true", help="loads on the GPU's timeline instead of beside it")
    transfer = "how chunks move: region (vLLM's kvstored tier, mode 1) or pool (the direct spec, mode 2)"
    g.add_argument("--transfer", type=Transfer, choices=list(Transfer), default="region", help=transfer)
    g = ap.add_argument_group("kvstored tiers")
    keys = [", ".join(k) for k in (CONFIG_BY_KEY, [c.key for c in CONFIGS], nodes.CONFIG_KEYS, nodes.DIRECTORY_KEYS)]
    configs = f"among {keys[0]} (default: {keys[1]}; with --nodes: {keys[2]}; with --nodes --directory: {keys[3]}"
    g.add_argument("--configs", help=f"{configs}; with --slow-disk: {', '.join(c.key for c in SLOW_DISK)})")
    slow = "preset: RAM alone vs RAM + a disk slower than recomputing, recompute gate on vs off; the prefill rate "
    slow += f"registered, x{SLOW_DISK_PREFILL:g} the model's unless given (docs/benchmarks.md: a disk slower than ...)"
    g.add_argument("--slow-disk", action="store_true", help=slow)
    rates = "register the modelled prefill rate with every namespace: the daemon's recompute gate applies"
    g.add_argument("--register-rates", action="store_true", help=rates)
    ram_text = f"RAM tier size, in conversations (default: 128; with --nodes: {nodes.RAM_CONVERSATIONS:g} per node)"
    _add(g, "--ram-conversations", None, ram_text, float)
    _add(g, "--fs-conversations", 512, "fs tier size in RAM + fs, in conversations (with --nodes: per node)", float)
    _add(g, "--s3-fs-conversations", 128, "fs tier size in RAM + fs + S3, in conversations", float)
    g.add_argument("--s3", default="auto", choices=("auto", "radosgw", "moto"), help="S3 server (auto: radosgw, moto)")
    _add(g, "--workdir", str(REPO / "results" / "tmp"), "fs tier roots and raw O_DIRECT files go here (removed after)")
    g.add_argument("--no-limits", action="store_true", help="skip measuring memcpy, raw O_DIRECT and raw S3 GET")
    g = ap.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="write the results as JSON")
    g.add_argument("--plot", metavar="PATH", help="write the chart (PNG) here")
    g.add_argument("--dry-run", action="store_true", help="print the model, sizes and scaling (and --json), no run")
    nt_threshold_arg(g)
    nodes.add_arguments(ap)
    return ap


def section(title: str, lines: list[str]) -> None:
    print(f"\n{title}", *("  " + line for line in lines), sep="\n")


def write_outputs(doc: dict[str, Any], json_path: str | None, plot_path: str | None) -> None:
    if json_path:
        write_json(json_path, doc)
        print(f"JSON written to {json_path}")
    if plot_path:
        from bench.plot import plot_multiturn

        plot_multiturn(doc, plot_path)
        print(f"plot written to {plot_path}")


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    apply_nt_threshold(args.nt_threshold)
    if args.ram_conversations is None:
        args.ram_conversations = nodes.RAM_CONVERSATIONS if args.nodes > 1 else 128.0
    if args.directory and args.nodes < 2:
        ap.error("--directory needs --nodes N (N >= 2)")
    mode = SeveralNodes(ap, args) if args.nodes > 1 else OneNode(ap, args)
    p = setup(ap, args, mode.register_rates)
    w, m = p.w, p.m

    info = machine_info()
    load_start = load_average()
    print(
        f"kvstored multi-turn benchmark{mode.title} -- {info['cpu_model']}, {info['cpus']} CPUs, "
        f"{info['mem_total_gib']} GiB, kernel {info['kernel']}, git {info['git']}, load average {load_start:.2f}, "
        f"GLIBC_TUNABLES={info['glibc_tunables'] or '(none)'}"
    )
    lines, scale = mode.plan_lines(p)
    print(*("  " + line for line in lines), sep="\n", flush=True)

    doc: dict[str, Any] = {
        "benchmark": mode.benchmark,
        "command": " ".join([Path(sys.executable).name, *sys.argv] if argv is None else argv),
        "machine": info,
        "workload": asdict(w),
        "model": {
            **asdict(m),
            "byte_scale": m.byte_scale,
            "spec": asdict(MODELS[args.model]),
            "derivation": p.derivation,
            "basis": [asdict(b) for b in p.basis],
        },
        "configs": [
            {"key": c.key, "label": c.label, "tiers": list(c.tiers), **{f: getattr(c, f) for f in mode.config_flags}}
            for c in mode.configs
        ],
        mode.sizes_key: asdict(p.sizes),
        "sizes_in_conversations": p.sizes_conv,
        "scaling": scale,
        **mode.plan_doc(),
        "registered_prefill_tokens_per_s": m.gate_prefill_tokens_per_s,
    }
    if args.dry_run:
        write_outputs(doc, args.json, None)
        return 0

    p.workdir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        s3, s3_note = start_sweep_s3(args.s3, p, mode.configs)
        if s3 is not None:
            stack.callback(s3.stop)
        limits = Limits(raw_tcp=[] if args.nodes > 1 else None)
        batch = w.final_tokens // w.chunk_tokens  # one load call carries at most a turn's reusable chunks
        measure = None if args.no_limits else lambda: measure_limits(limits, p.workdir, p.chunk_bytes, batch, s3)
        results, more, total_s = mode.sweep(p, s3, s3_note, measure)
    load = report.load_summary(results + more, load_start, load_average())

    print()
    report.print_results(results, mode)
    section(mode.daemon_title, mode.daemon_lines(results))
    section(
        "physical limits of this machine (at the start and the end of the sweep):",
        report.limit_lines(limits, p.chunk_bytes),
    )
    costs = report.cost_lines(results, m, limits, mode.cost_configs)
    section("cost of a token loaded from each tier (marginal rate, at the largest count measured):", costs)
    bounds = mode.bound_lines(results, m, limits)
    section(mode.bounds_title, bounds)
    for title, lines in mode.sections(results, more, m):
        section(title, lines)
    rows = mode.target_rows(p, results, limits)
    print(
        f"\ntargets and ratios ({m.model_name}{mode.title}; load average over the sweep {load['min']:.1f}-"
        f"{load['max']:.1f}, mean {load['mean']:.1f}, on {info['cpus']} CPUs):"
    )
    report.print_rows(rows)
    print(f"sweep took {total_s:.0f} s; load average {load['start']:.2f} at start, {load['end']:.2f} at end")
    targets = [
        {"text": f"{r['name']}: {r['ratio']:.2f}x (target >= {r['target']:g}x)", "met": r["status"] == "PASS"}
        for r in rows
        if r["target"] is not None and r["ratio"] is not None
    ]
    doc |= {
        "s3_server": s3_note,
        **mode.run_doc(s3, more),
        "results": [asdict(r) for r in results],
        "rows": rows,
        "targets": targets,
        "limits": limits.to_json(),
        "tier_costs": costs,
        "bounds": bounds,
        "load_average": load,
        "sweep_s": total_s,
    }
    write_outputs(doc, args.json, args.plot)
    return 0
