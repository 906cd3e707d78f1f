# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The multi-turn benchmark's command line: `python -m bench.multiturn` (one node) and
`--nodes N` (bench/multiturn/nodes.py)."""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import bench.multiturn
from bench.lib.limits import apply_nt_threshold, nt_threshold_arg
from bench.lib.report import REPO, fmt_bytes, load_average, machine_info
from bench.multiturn import nodes, nodes_main
from bench.multiturn.bounds import bound_lines, slow_disk_lines
from bench.multiturn.limits import Limits, measure_limits
from bench.multiturn.model import CONFIG_BY_KEY, CONFIGS, DEFAULT_MODEL, MODELS, SLOW_DISK, Transfer
from bench.multiturn.plan import (
    command_line,
    model_doc,
    parse_counts,
    print_targets,
    section,
    select_configs,
    setup,
    start_sweep_s3,
    sweep,
    targets,
    write_outputs,
)
from bench.multiturn.report import (
    cost_lines,
    daemon_lines,
    limit_lines,
    load_summary,
    model_lines,
    print_results,
    scaling_lines,
    target_rows,
)
from bench.multiturn.runs import RunResult, run_one

DESCRIPTION = (bench.multiturn.__doc__ or "").split("\n\n")[0]
SLOW_DISK_PREFILL = 4.0  # x the model's prefill rate: the seed's break-even 0.95 -> 3.8 GiB/s, above the fs tier here


# -- main -----------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except None (the flag's help says what is derived instead)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.multiturn", description=DESCRIPTION, formatter_class=_HelpFormatter
    )
    g = ap.add_argument_group("workload")
    g.add_argument("--initial-tokens", type=int, default=12 * 1024, help="first prompt of every conversation")
    g.add_argument("--turn-tokens", type=int, default=4 * 1024, help="tokens each turn appends to the history")
    g.add_argument("--turns", type=int, default=8, help="turns per conversation")
    g.add_argument(
        "--think-s", type=float, default=20.0, help="mean think time between turns, modelled seconds (uniform 0.5-1.5x)"
    )
    g.add_argument("--conversations", default="16,32,64,128,192,256", help="simultaneous conversations to sweep")
    g.add_argument(
        "--chunk-tokens",
        type=int,
        default=4096,
        help="tokens per kvstored chunk (x --kv-bytes-per-token: 2 MiB, as in bench/compare.py)",
    )
    g.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("modelled GPU and model")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        choices=sorted(MODELS),
        help="the modelled model and GPUs: qwen3.6-35b-a3b (the seed's: 2x H100, TP=2, 20 KiB of KV per "
        "token, 50,000 prefill tokens/s) or llama-3.1-8b (one H100, 128 KiB per token, 16,000 "
        "tokens/s); every figure derived from it is printed with its basis",
    )
    g.add_argument(
        "--model-kv-bytes-per-token",
        type=int,
        default=None,
        help="KV bytes per token of the modelled model (default: the model's, from its attention layers)",
    )
    g.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=512,
        help="KV bytes per token that really move through kvstored (the scale)",
    )
    g.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=None,
        help="modelled prefill rate (default: the model's, from FLOPs per token, the GPUs' bf16 peak and "
        "an assumed MFU)",
    )
    g.add_argument(
        "--gpu-conversations",
        type=float,
        default=None,
        help="GPU prefix cache capacity, in conversations at their last turn (default: derived from HBM minus weights)",
    )
    g.add_argument(
        "--gpu-tokens",
        type=int,
        default=None,
        help="GPU prefix cache capacity in tokens (overrides --gpu-conversations)",
    )
    g.add_argument(
        "--serial-loads",
        action="store_true",
        help="loads on the GPU's timeline instead of beside it (a pessimistic engine)",
    )
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
        default=None,
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
    g.add_argument(
        "--ram-conversations",
        type=float,
        default=None,
        help=f"RAM tier size, in conversations (default: 128; with --nodes: {nodes.RAM_CONVERSATIONS:g} per node)",
    )
    g.add_argument(
        "--fs-conversations",
        type=float,
        default=512,
        help="fs tier size in RAM + fs, in conversations (with --nodes: per node, also with peers)",
    )
    g.add_argument(
        "--s3-fs-conversations",
        type=float,
        default=128,
        help="fs tier size in RAM + fs + S3, in conversations (smaller: S3 takes the overflow)",
    )
    g.add_argument(
        "--s3",
        default="auto",
        choices=("auto", "radosgw", "moto"),
        help="S3 server: radosgw via tests/support/s3.py, moto_server, or auto (radosgw, else moto)",
    )
    g.add_argument(
        "--workdir",
        default=str(REPO / "results" / "tmp"),
        help="fs tier roots and the raw O_DIRECT files go under here (each removed after use)",
    )
    g.add_argument(
        "--no-limits",
        action="store_true",
        help="skip measuring memcpy, raw O_DIRECT and raw S3 GET (the physical limits)",
    )
    g = ap.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="write the results as JSON")
    g.add_argument("--plot", metavar="PATH", help="write the chart (PNG) here")
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="print the model, the sizes and the scaling (and write them with --json), run nothing",
    )
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
    if args.nodes > 1:
        return nodes_main.main(ap, args, argv)
    if args.slow_disk and args.prefill_tokens_per_s is None:
        args.prefill_tokens_per_s = SLOW_DISK_PREFILL * MODELS[args.model].prefill_tokens_per_s
    default = [c.key for c in (SLOW_DISK if args.slow_disk else CONFIGS)]
    configs = select_configs(ap, args.configs, default, CONFIG_BY_KEY, "configuration(s) {bad}")
    w, m, basis, derivation, sizes, sizes_conv = setup(ap, args)
    m = replace(m, register_rates=args.slow_disk or args.register_rates)
    counts = parse_counts(args.conversations)
    workdir = Path(args.workdir)

    info = machine_info()
    load_start = load_average()
    print(
        f"kvstored multi-turn benchmark -- {info['cpu_model']}, {info['cpus']} CPUs, {info['mem_total_gib']} GiB, "
        f"kernel {info['kernel']}, git {info['git']}, load average {load_start:.2f}, "
        f"GLIBC_TUNABLES={info['glibc_tunables'] or '(none)'}"
    )
    scale = scaling_lines(w, m, sizes, args.ram_conversations, args.fs_conversations, args.s3_fs_conversations)
    for line in model_lines(m, basis) + scale:
        print("  " + line)
    max_bytes = max(counts) * w.reusable_per_conversation * m.kv_bytes_per_token
    print(
        f"  at {max(counts)} conversations: {fmt_bytes(max_bytes)} of reusable KV loaded at most (scaled), "
        f"{max(counts) * w.tokens_per_conversation:,} prompt tokens",
        flush=True,
    )

    doc: dict[str, Any] = {
        "benchmark": "multiturn",
        "command": command_line(argv),
        "machine": info,
        "workload": asdict(w),
        "model": model_doc(m, MODELS[args.model], derivation, basis),
        "configs": [{"key": c.key, "label": c.label, "tiers": list(c.tiers)} for c in configs],
        "sizes": asdict(sizes),
        "sizes_in_conversations": sizes_conv,
        "scaling": scale,
        "slow_disk": args.slow_disk,
        "registered_prefill_tokens_per_s": m.gate_prefill_tokens_per_s,
    }
    if args.dry_run:
        write_outputs(doc, args.json, None)
        return 0

    workdir.mkdir(parents=True, exist_ok=True)
    s3, s3_note = start_sweep_s3(args.s3, configs, counts, w, m, "moto_server (in RAM)", "S3 configuration skipped")
    limits = Limits()
    chunk_bytes = w.chunk_tokens * m.kv_bytes_per_token
    batch = w.final_tokens // w.chunk_tokens  # one load call carries at most a turn's reusable chunks
    results, total_s = sweep(
        counts,
        configs,
        s3,
        s3_note,
        lambda config, n: run_one(config, n, w, m, sizes, workdir, s3),
        lambda config, n, note: RunResult(config.key, n, skipped=note),
        lambda r: (
            f"hit {100 * r.hit_rate_overall:.1f}%  {r.throughput_tokens_s:,.0f} tokens/s  "
            f"TTFT p50 {r.ttft_p50_s:.2f} s p99 {r.ttft_p99_s:.2f} s  wall {r.wall_s:.1f} s  "
            f"load {r.load_average[1]:.1f}"
        ),
        None if args.no_limits else lambda: measure_limits(limits, workdir, chunk_bytes, batch, s3),
        max(len(c.label) for c in CONFIG_BY_KEY.values()),
    )
    load = load_summary(results, load_start, load_average())

    print()
    print_results(results)
    section("daemon counters per run (Stats deltas; bytes are the scaled bytes):", daemon_lines(results))
    if args.slow_disk:
        section(
            "slow disk: RAM + fs with the recompute gate on and off, against RAM alone:", slow_disk_lines(results, m)
        )
    section("physical limits of this machine (measured at the start and at the end of the sweep):", limit_lines(limits))
    costs = cost_lines(results, m, limits)
    section("cost of a token loaded from each tier (marginal rate, at the largest count measured):", costs)
    bounds = bound_lines(results, m, limits)
    section("what bounds RAM + fs at the largest count:", bounds)
    print()
    rows = target_rows(results, m, limits, sizes_conv)
    print_targets(rows, m.model_name, load, info["cpus"], total_s)

    doc.update(
        {
            "s3_server": s3_note,
            "s3_endpoint": s3.endpoint.url if s3 is not None else "",
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
