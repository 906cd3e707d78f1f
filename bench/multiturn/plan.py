# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""From the flags to the workload, the modelled model and the tier sizes; where the outputs go
(one node and several alike)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from bench.lib.report import write_json
from bench.multiturn.model import MODELS, Basis, Model, Sizes, Workload, derive_model


def parse_counts(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


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
