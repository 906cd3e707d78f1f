# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The calibration's command line: `python -m bench.scale_calibrate`."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.lib.report import machine_info, write_json
from bench.scale_calibrate.common import DEFAULT_OUT, README_BYTES_PER_ENTRY, SINGLE_EVENTS, SMALL, loadavg
from bench.scale_calibrate.daemons import Pair
from bench.scale_calibrate.directory import measure_directory
from bench.scale_calibrate.events import (
    coalescing_lines,
    fill_lifecycle,
    measure_coalescing,
    measure_events,
    measure_quiet_streams,
)
from bench.scale_calibrate.in_process import measure_in_process
from bench.scale_calibrate.lookups import measure_lookups_and_fetch, measure_s3
from bench.scale_calibrate.subscribers import measure_grpc_floor

OPTIONS: list[tuple[str, object, str]] = [  # (flag, default: of the flag's type, False: a switch, help)
    ("--out", str(DEFAULT_OUT), "the calibration JSON to write"),
    ("--entries", 100_000, "remote entries B's index grows by for the memory measurement (4 KiB chunks on A)"),
    ("--subscribers", 16, "extra WatchEvents streams on A (publisher cost)"),
    ("--coalesced-subscribers", 64, "extra coalesced WatchEvents streams on A in the coalescing phase"),
    ("--batch", 50, "chunks per store in the lifecycle phase (a turn's new chunks, as scale_out.py assumes)"),
    ("--reps", 60, "samples per latency"),
    ("--s3", "auto", "the S3 server for PUT/GET latency (auto: radosgw if Ceph starts here, else moto)"),
    ("--s3-chunk-mib", 2, "object size for S3 PUT/GET latency"),
    ("--turns", 60, "stores of --batch chunks per follower mode in the coalescing phase"),
    ("--turn-rate", 10.0, "stores per second in the coalescing phase (the model's turns)"),
    ("--only-coalescing", False, "run the coalescing phase alone (A filled first), print it; writes no JSON"),
    ("--only-directory", False, "measure the fleet directory's costs alone into --out's existing JSON"),
    ("--only-quiet-streams", False, "measure the quiet streams' CPU alone, print the break points it gives"),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scale_calibrate",
        description="Measure, on two real kvstored daemons with peer tiers on loopback, the per-operation costs "
        "bench/scale_out.py models a fleet with: index memory per remote entry (RSS growth, and "
        "tracemalloc beside the README's 171 B/entry), event bytes and follower CPU per event and per key "
        "on the WatchEvents stream, publisher CPU per subscriber, local Lookup cost per key, a remote "
        "Lookup over TCP, the peer fetch round trip, the fleet directory's heartbeat, writes and lookups "
        "against a real Redis Cluster, and S3 PUT/GET latency per chunk (radosgw, else "
        "moto). Writes a calibration JSON with the machine and the load average.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for flag, default, text in OPTIONS:
        if flag == "--s3":
            parser.add_argument(flag, choices=("auto", "radosgw", "moto", "none"), default=default, help=text)
        elif isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=text)
        else:
            parser.add_argument(flag, type=type(default), default=default, help=text)
    args = parser.parse_args(argv)
    if shutil.which("ss") is None:
        print("scale_calibrate: needs `ss` (iproute2) to read what B's TCP socket received", file=sys.stderr)
        return 2
    if args.only_coalescing:
        return only_coalescing(args)
    if args.only_quiet_streams:
        return only_quiet_streams(args)
    if args.only_directory:
        merged = json.loads(Path(args.out).read_text())
        merged["directory"] = measure_directory(args.reps) | {"load_average": loadavg()}
        write_json(args.out, merged)
        print(f"wrote the directory's costs into {args.out}")
        return 0
    started = time.monotonic()
    load = {"start": loadavg()}
    doc: dict[str, Any] = {
        "schema": 1,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "parameters": vars(args),
    }
    # Every 4 KiB chunk of the event phases stays in A's RAM, below its write-back headroom (5%).
    small_chunks = 2 * SINGLE_EVENTS + args.entries + args.entries // 4 + 200
    pair = Pair(f"{(small_chunks * SMALL * 10 // 9 + (32 << 20)) >> 20}MiB")
    crowds = (args.subscribers, args.coalesced_subscribers)
    try:
        pair.start()
        doc["events"] = measure_events(pair, args.entries, args.subscribers, args.batch)
        load["after_events"] = loadavg()
        doc["coalescing"] = measure_coalescing(pair, args.batch, args.turns, args.turn_rate, *crowds)
        doc["coalescing"]["grpc_floor"] = measure_grpc_floor()
        load["after_coalescing"] = loadavg()
        doc["lookup"] = measure_lookups_and_fetch(pair, args.reps)
        load["after_lookups"] = loadavg()
    finally:
        pair.close()
    doc["directory"] = measure_directory(args.reps)
    load["after_directory"] = loadavg()
    doc["in_process"] = measure_in_process()
    doc["s3"] = measure_s3(args.s3, args.s3_chunk_mib << 20, max(8, args.reps // 4))
    load["end"] = loadavg()
    doc["load_average"] = load
    doc["duration_s"] = round(time.monotonic() - started, 1)
    write_json(args.out, doc)
    print_lines(summary(doc))
    start, end = load["start"][0], load["end"][0]
    print(f"wrote {args.out} ({doc['duration_s']} s; load average {start} at the start, {end} at the end)")
    return 0


def only_coalescing(args: argparse.Namespace) -> int:
    pair = Pair("64MiB")
    try:
        pair.start()
        with pair.a.client() as kv:
            fill_lifecycle(pair, kv, args.batch, "filling A's RAM and fs")
        crowds = (args.subscribers, args.coalesced_subscribers)
        doc = measure_coalescing(pair, args.batch, args.turns, args.turn_rate, *crowds)
    finally:
        pair.close()
    print_lines(coalescing_lines(doc), width=0)
    return 0


def only_quiet_streams(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from bench.scale_out.designs import Model, break_point, designs
    from bench.scale_out.fleet import Budget, Costs, Fleet

    pair = Pair("64MiB")
    try:
        pair.start()
        quiet = measure_quiet_streams(pair, args.subscribers)
    finally:
        pair.close()
    per_stream = quiet["server_idle_cpu_s_per_s_per_stream"]
    costs = replace(Costs.from_calibration(json.loads(Path(args.out).read_text())), stream_idle_s_per_s=2 * per_stream)
    model = Model(Fleet(), Budget(), costs)
    breaks = {d.key: break_point(d, model.budget, 10_000) for d in designs(model)}
    print(
        f"  a quiet stream: {per_stream * 1e6:.1f} us/s (windows without {quiet['quiet_cpu_s_per_s_without']}, with "
        f"{quiet['quiet_cpu_s_per_s_with']}, load average {loadavg()[0]})"
    )
    print("  break points: " + ", ".join(f"{k} {b['nodes'] if b else '> 10,000'}" for k, b in breaks.items()))
    return 0


def print_lines(lines: list[tuple[str, str]], width: int | None = None) -> None:
    """`  name  figures`, the names padded to `width` (None: the longest's)."""
    width = max(len(k) for k, _ in lines) if width is None else width
    for k, v in lines:
        print(f"  {k.ljust(width)}  {v}")


def summary(doc: dict[str, Any]) -> list[tuple[str, str]]:
    ev, ip, look, s3 = doc["events"], doc["in_process"], doc["lookup"], doc["s3"]
    fit, life, mem = ev["fit"], ev["lifecycle"], ev["index_memory"]
    traced, peers = ip["index_tracemalloc"], ip["contains"]["by_peers"]
    lines = {
        "index memory per entry, B's RSS": f"{mem['rss_bytes_per_entry']:.0f} B (second half "
        f"{mem['rss_bytes_per_entry_second_half']:.0f} B; README {README_BYTES_PER_ENTRY} B)",
        "index memory per entry, tracemalloc": f"{traced['bytes_per_entry_5_peers']:.0f} B "
        f"(+{traced['fit_slot_ge_7']['bytes_per_slot']:.3f} B per slot of the holder)",
        "event payload bytes": f"{fit['payload_bytes_per_event']:.0f} B/event + "
        f"{fit['payload_bytes_per_key']:.1f} B/key",
        "follower CPU": f"{fit['follower_cpu_s_per_event'] * 1e6:.1f} us/event + "
        f"{fit['follower_cpu_s_per_key'] * 1e6:.2f} us/key",
        "publisher CPU per subscriber": f"{fit['publisher_cpu_s_per_event_per_subscriber'] * 1e6:.1f} us/event, "
        f"{fit['publisher_cpu_s_per_key_per_subscriber'] * 1e6:.2f} us/key",
        "a chunk's life (RAM -> fs, full)": f"{life['events_per_chunk']:.2f} events, "
        f"{life['keys_per_chunk']:.2f} keys, {life['payload_bytes_per_chunk']:.0f} B, "
        f"{life['follower_cpu_s_per_chunk'] * 1e6:.0f} us of B's CPU",
        "stream memory": f"server {ev['streams']['server_bytes_per_stream'] / 1024:.0f} KiB, "
        f"client {ev['streams']['client_bytes_per_stream'] / 1024:.0f} KiB",
        "local Lookup": f"{look['local']['one_key_ms']:.3f} ms + {look['local']['per_key_us']:.2f} us/key",
        "remote Lookup over TCP": f"{look['remote']['one_key_ms']:.3f} ms (64 keys {look['remote']['keys_64_ms']:.3f} "
        f"ms, server CPU {look['remote']['server_cpu_ms_per_call']:.3f} ms)",
        "peer fetch round trip": f"{look['fetch']['round_trip_ms']:.3f} ms",
        "peer tier contains, 1 -> 1000 peers": f"{peers[0]['per_call_us']:.1f} -> {peers[-1]['per_call_us']:.1f} us "
        f"per call, {peers[0]['per_key_us']:.2f} -> {peers[-1]['per_key_us']:.2f} us per key",
        "rendezvous owner choice": f"{ip['rendezvous']['us_per_node']:.3f} us per node per group",
    }
    if s3.get("server"):
        lines[f"S3 ({s3['server']})"] = (
            f"PUT {s3['put_chunk_ms']:.1f} ms, GET {s3['get_chunk_ms']:.1f} ms per {s3['chunk_bytes'] >> 20} MiB; "
            f"4 KiB: PUT {s3['put_small_ms']:.1f}, GET {s3['get_small_ms']:.1f} ms"
        )
    return [*lines.items(), *coalescing_lines(doc["coalescing"])]
