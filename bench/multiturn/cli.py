# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The multi-turn benchmark's command line and its main: `python -m bench.multiturn` (one node:
plan.OneNode) and `--nodes N` (several: nodes_main.SeveralNodes), planned, swept and reported alike."""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import asdict
from typing import Any

import bench.multiturn
from bench.lib.limits import apply_nt_threshold, nt_threshold_arg
from bench.lib.report import REPO, load_average, machine_info
from bench.multiturn import nodes
from bench.multiturn.limits import Limits, measure_limits
from bench.multiturn.model import CONFIG_BY_KEY, CONFIGS, DEFAULT_MODEL, MODELS, SLOW_DISK, Transfer
from bench.multiturn.nodes_main import SeveralNodes
from bench.multiturn.plan import (
    SLOW_DISK_PREFILL,
    OneNode,
    command_line,
    model_doc,
    print_targets,
    section,
    setup,
    start_sweep_s3,
    targets,
    write_outputs,
)
from bench.multiturn.report import cost_lines, limit_lines, load_summary, model_lines, print_results, scaling_lines

DESCRIPTION = (bench.multiturn.__doc__ or "").split("\n\n")[0]


# -- main -----------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except None (the flag's help says what is derived instead)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def _add(g: argparse._ArgumentGroup, flag: str, default: Any, text: str | None, kind: type | None = None) -> None:
    """A flag whose value has its default's type (`kind` where the default is None: derived)."""
    g.add_argument(flag, type=kind or type(default), default=default, help=text)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.multiturn", description=DESCRIPTION, formatter_class=_HelpFormatter
    )
    g = ap.add_argument_group("workload")
    _add(g, "--initial-tokens", 12 * 1024, "first prompt of every conversation")
    _add(g, "--turn-tokens", 4 * 1024, "tokens each turn appends to the history")
    _add(g, "--turns", 8, "turns per conversation")
    _add(g, "--think-s", 20.0, "mean think time between turns, modelled seconds (uniform 0.5-1.5x)")
    _add(g, "--conversations", "16,32,64,128,192,256", "simultaneous conversations to sweep")
    _add(g, "--chunk-tokens", 4096, "tokens per kvstored chunk (x --kv-bytes-per-token: 2 MiB, as in bench/compare.py)")
    _add(g, "--seed", 0, None)
    g = ap.add_argument_group("modelled GPU and model")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        choices=sorted(MODELS),
        help="the modelled model and GPUs: qwen3.6-35b-a3b (the seed's: 2x H100, TP=2, 20 KiB of KV per "
        "token, 50,000 prefill tokens/s) or llama-3.1-8b (one H100, 128 KiB per token, 16,000 "
        "tokens/s); every figure derived from it is printed with its basis",
    )
    kv_text = "KV bytes per token of the modelled model (default: the model's, from its attention layers)"
    _add(g, "--model-kv-bytes-per-token", None, kv_text, int)
    _add(g, "--kv-bytes-per-token", 512, "KV bytes per token that really move through kvstored (the scale)")
    prefill_text = (
        "modelled prefill rate (default: the model's, from FLOPs per token, the GPUs' bf16 peak and an assumed MFU)"
    )
    _add(g, "--prefill-tokens-per-s", None, prefill_text, float)
    gpu_text = (
        "GPU prefix cache capacity, in conversations at their last turn (default: derived from HBM minus weights)"
    )
    _add(g, "--gpu-conversations", None, gpu_text, float)
    _add(g, "--gpu-tokens", None, "GPU prefix cache capacity in tokens (overrides --gpu-conversations)", int)
    serial_text = "loads on the GPU's timeline instead of beside it (a pessimistic engine)"
    g.add_argument("--serial-loads", action="store_true", help=serial_text)
    g.add_argument(
        "--transfer",
        type=Transfer,
        choices=list(Transfer),
        default=Transfer.REGION,
        metavar="{region,pool}",
        help="how the engine moves chunks: region (vLLM's kvstored tier, mode 1: StoreFromRegion, "
        "LoadToRegion) or pool (the direct spec, mode 2: pool mapping)",
    )
    g = ap.add_argument_group("kvstored tiers")
    g.add_argument(
        "--configs",
        help=f"among {', '.join(CONFIG_BY_KEY)} (default: {', '.join(c.key for c in CONFIGS)}; with --nodes: "
        f"{', '.join(nodes.CONFIG_KEYS)}; with --nodes --directory: {', '.join(nodes.DIRECTORY_KEYS)}; "
        f"with --slow-disk: {', '.join(c.key for c in SLOW_DISK)})",
    )
    g.add_argument(
        "--slow-disk",
        action="store_true",
        help=f"preset: RAM alone vs RAM + a disk slower than recomputing with the recompute gate on vs "
        f"off (recompute_gate=false): configs {', '.join(c.key for c in SLOW_DISK)}, the prefill rate "
        f"registered with the namespace (the daemon's gate applies), and, unless --prefill-tokens-per-s "
        f"is given, {SLOW_DISK_PREFILL:g}x the model's prefill rate: this machine has no cgroup io.max "
        "(cgroup v2 without the io controller) and no device-mapper, so the break-even is raised above "
        "its disk instead of the disk throttled below the break-even",
    )
    g.add_argument(
        "--register-rates",
        action="store_true",
        help="register the modelled prefill rate with every namespace (the model's break-even, in the real "
        "bytes per token), as an engine with prefill_tokens_per_s configured does: the daemon's recompute gate "
        "then reports hits below RAM, peers included, only where loading them beats recomputing (--slow-disk "
        "implies it; without it nothing is registered and every hit counts)",
    )
    ram_text = f"RAM tier size, in conversations (default: 128; with --nodes: {nodes.RAM_CONVERSATIONS:g} per node)"
    _add(g, "--ram-conversations", None, ram_text, float)
    fs_text = "fs tier size in RAM + fs, in conversations (with --nodes: per node, also with peers)"
    _add(g, "--fs-conversations", 512, fs_text, float)
    s3_fs_text = "fs tier size in RAM + fs + S3, in conversations (smaller: S3 takes the overflow)"
    _add(g, "--s3-fs-conversations", 128, s3_fs_text, float)
    g.add_argument(
        "--s3",
        default="auto",
        choices=("auto", "radosgw", "moto"),
        help="S3 server: radosgw via tests/support/s3.py, moto_server, or auto (radosgw, else moto)",
    )
    workdir_text = "fs tier roots and the raw O_DIRECT files go under here (each removed after use)"
    _add(g, "--workdir", str(REPO / "results" / "tmp"), workdir_text)
    no_limits_text = "skip measuring memcpy, raw O_DIRECT and raw S3 GET (the physical limits)"
    g.add_argument("--no-limits", action="store_true", help=no_limits_text)
    g = ap.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="write the results as JSON")
    g.add_argument("--plot", metavar="PATH", help="write the chart (PNG) here")
    dry_text = "print the model, the sizes and the scaling (and write them with --json), run nothing"
    g.add_argument("--dry-run", action="store_true", help=dry_text)
    nt_threshold_arg(g)
    nodes.add_arguments(ap)
    return ap


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
        f"{info['mem_total_gib']} GiB, kernel {info['kernel']}, git {info['git']}, load average {load_start:.2f}"
        + mode.header_tail(info)
    )
    scale = scaling_lines(w, m, p.sizes, args.ram_conversations, args.fs_conversations, args.s3_fs_conversations)
    scale = mode.scaling(scale, p)
    for line in mode.intro() + model_lines(m, p.basis) + scale + mode.outro(p):
        print("  " + line, flush=True)

    doc: dict[str, Any] = {
        "benchmark": mode.benchmark,
        "command": command_line(argv),
        "machine": info,
        "workload": asdict(w),
        "model": model_doc(m, MODELS[args.model], p.derivation, p.basis),
        "configs": [mode.config_doc(c) for c in mode.configs],
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
        mode.enter(stack)
        s3, s3_note = start_sweep_s3(args.s3, mode.configs, p.counts, w, m, mode.moto, mode.s3_skipped)
        if s3 is not None:
            stack.callback(s3.stop)
        limits = Limits(raw_tcp=[] if args.nodes > 1 else None)
        batch = w.final_tokens // w.chunk_tokens  # one load call carries at most a turn's reusable chunks
        measure = None if args.no_limits else lambda: measure_limits(limits, p.workdir, p.chunk_bytes, batch, s3)
        results, more, total_s = mode.sweep(p, s3, s3_note, measure)
    load = load_summary(results + more, load_start, load_average())

    print()
    print_results(results, mode.layout)
    section(mode.daemon_title, mode.daemon_lines(results))
    for title, lines in mode.after_daemons(results, m):
        section(title, lines)
    limits_title = "physical limits of this machine (measured at the start and at the end of the sweep):"
    section(limits_title, limit_lines(limits, p.chunk_bytes))
    costs = cost_lines(results, m, limits, mode.cost_configs)
    section("cost of a token loaded from each tier (marginal rate, at the largest count measured):", costs)
    bounds = mode.bound_lines(results, m, limits)
    section(mode.bounds_title, bounds)
    for title, lines in mode.after_bounds(results, more):
        section(title, lines)
    print()
    rows = mode.target_rows(p, results, limits)
    print_targets(rows, m.model_name + mode.title, load, info["cpus"], total_s)

    doc.update(
        {
            "s3_server": s3_note,
            **mode.run_doc(s3, more),
            "results": [asdict(r) for r in results],
            "rows": rows,
            "targets": targets(rows),
            "limits": limits.to_json(),
            "tier_costs": costs,
            "bounds": bounds,
            "load_average": load,
            "sweep_s": total_s,
        }
    )
    write_outputs(doc, args.json, args.plot)
    return 0
