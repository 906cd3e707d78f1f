# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The S3 tier beside raw aiobotocore put/get of the same objects."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

import numpy as np

from bench.lib.report import GIB
from bench.lib.s3 import raw_config, start_s3
from bench.tiers.common import (
    TARGET_S3,
    Pair,
    Pool,
    chunk_ids,
    drive,
    measure,
    on_loop,
    rotated,
    say,
    tier_load,
    tier_store,
)
from bench.tiers.profile import profiled
from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES

TARGET_PUTS_FEWER = 10.0  # packed PUT requests per GiB written down vs one object per chunk


def tier_s3_config(tier) -> Any:
    """The started tier's client configuration (the baseline uses exactly the tier's transport
    settings: timeouts, pool size, checksum and payload-signing choices); None if unreadable."""
    client = getattr(tier, "_client", None)
    return getattr(getattr(client, "meta", None), "config", None)


@contextlib.asynccontextmanager
async def raw_client(endpoint, config):
    from aiobotocore.session import get_session

    async with get_session().create_client("s3", config=config, **endpoint.client_kwargs()) as client:
        yield client


async def raw_s3_store(client, bucket: str, keys: list[str], bodies: list[bytes], inflight: int) -> float:
    async def op(i: int) -> None:
        await client.put_object(Bucket=bucket, Key=keys[i], Body=bodies[i])

    return await drive(len(keys), inflight, op)


async def raw_s3_load(client, bucket: str, keys: list[str], expected: int, inflight: int) -> float:
    async def op(i: int) -> None:
        response = await client.get_object(Bucket=bucket, Key=keys[i])
        async with response["Body"] as stream:
            data = await stream.read()
        if len(data) != expected:
            raise RuntimeError(f"raw GET {keys[i]}: {len(data)} bytes, expected {expected}")

    return await drive(len(keys), inflight, op)


async def packed_store(tier, chunks, views, size: int, inflight: int) -> float:
    """The packed tier's writes and the flush of its last pack: until every byte is in S3."""
    t0 = time.perf_counter()
    await tier_store(tier, chunks, views, size, inflight)
    await tier.flush()
    return time.perf_counter() - t0


def bench_s3(runner: asyncio.Runner, args, src: Pool, dst: Pool, notes: list[str]) -> tuple[list[Pair], dict]:
    from kvstored.tiers.s3 import S3Tier
    from kvstored.tiers.s3pack import PackedS3Tier

    n, size = args.s3_chunks, args.chunk_bytes
    nbytes = n * size
    inflight = args.s3_inflight
    server = start_s3(args.s3, args.memstore_bytes)
    say(
        f"  S3 endpoint: {'Ceph radosgw (memstore OSD)' if server.is_rgw else 'moto_server'} at "
        f"{server.endpoint.url}, up in {server.started_s:.1f} s"
    )
    if server.note:
        notes.append(server.note)
    bucket = f"kvstored-bench-tiers-{os.getpid()}"
    chunks = chunk_ids(n, "s3")
    raw_keys = ["raw/" + chunkfile.chunk_relpath(c) for c in chunks]
    # the same object bytes the tier PUTs (header + payload), built before timing
    bodies = [
        b"".join([chunkfile.encode_header(c, size, chunkfile.checksum([v], size)), v])
        for c, v in zip(chunks, src.views)
    ]
    store = Pair("s3 store", TARGET_S3)
    load = Pair("s3 load", TARGET_S3)
    # packs (32 MiB, the default) against the same raw rows: PUTs of 2 MiB objects, GETs of them
    pstore = Pair("s3 packed store", TARGET_S3, raw=store.raw)
    pload = Pair("s3 packed load (ranged)", TARGET_S3, raw=load.raw)
    puts: dict[str, list[int]] = {"one object per chunk": [], "packed": []}
    stats: dict[str, Any] = {}
    profile: dict[str, Any] = {}
    try:
        ep = server.endpoint
        pids = server.pids()
        server.new_bucket(bucket)
        settings = dict(max_concurrency=inflight, timeout_s=args.s3_timeout, create_bucket=False, **ep.tier_kwargs())
        for rnd in range(args.rounds + (1 if args.profile else 0)):
            profiling = rnd == args.rounds  # the extra round of --profile: cProfile on the loop thread
            # both clients are opened before timing (creating one costs ~0.1-0.3 s of CPU)
            tier = S3Tier("bench", bucket, prefix="tier/", **settings)
            packed = PackedS3Tier("bench-packed", bucket, prefix="packed/", pack_poll_s=0, **settings)
            stack = contextlib.AsyncExitStack()
            runner.run(tier.start())
            runner.run(packed.start())
            try:
                config = tier_s3_config(tier)
                if config is None:
                    config = raw_config(inflight, args.s3_timeout)
                    if rnd == 0:
                        notes.append(
                            "s3: could not read the tier's client configuration; the raw client uses "
                            "bench/tiers.py's copy of it (may differ from kvstored/tiers/s3.py)"
                        )
                client = runner.run(stack.enter_async_context(raw_client(ep, config)))
                stores = [
                    ("tier store", store.tier, on_loop(runner, tier_store, tier, chunks, src.views, size, inflight)),
                    (
                        "packed store",
                        pstore.tier,
                        on_loop(runner, packed_store, packed, chunks, src.views, size, inflight),
                    ),
                    ("raw store", store.raw, on_loop(runner, raw_s3_store, client, bucket, raw_keys, bodies, inflight)),
                ]
                loads = [
                    ("tier load", load.tier, on_loop(runner, tier_load, tier, chunks, dst.views, size, inflight)),
                    ("packed load", pload.tier, on_loop(runner, tier_load, packed, chunks, dst.views, size, inflight)),
                    (
                        "raw load",
                        load.raw,
                        on_loop(runner, raw_s3_load, client, bucket, raw_keys, HEADER_BYTES + size, inflight),
                    ),
                ]
                if profiling:
                    for name, _, fn in stores + loads:
                        profile[name] = profiled(nbytes, fn)
                    continue
                for name, samples, fn in rotated(stores, rnd):
                    sent = {"tier store": tier.requests, "packed store": packed.requests}
                    samples.append(measure(nbytes, fn, pids))
                    if name == "tier store":
                        puts["one object per chunk"].append(tier.requests - sent[name])
                    elif name == "packed store":
                        puts["packed"].append(packed.requests - sent[name])
                for _, samples, fn in rotated(loads, rnd):
                    if rnd == 0:
                        dst.array[:nbytes] = 0
                    samples.append(measure(nbytes, fn, pids))
                    if rnd == 0 and samples in (load.tier, pload.tier):
                        if not np.array_equal(dst.array[:nbytes], src.array[:nbytes]):
                            raise RuntimeError("s3 tier loaded bytes differ from the source")
                say(
                    f"  s3 round {rnd}: store tier {store.tier[-1].gib_s:.2f} raw {store.raw[-1].gib_s:.2f} | "
                    f"load tier {load.tier[-1].gib_s:.2f} raw {load.raw[-1].gib_s:.2f} GiB/s "
                    f"(tier: {tier.requests} requests, {tier.counters.errors} errors) | packed: store "
                    f"{pstore.tier[-1].gib_s:.2f} load {pload.tier[-1].gib_s:.2f} GiB/s, "
                    f"{puts['packed'][-1]} PUTs against {puts['one object per chunk'][-1]}"
                )
                stats[f"round{rnd}"] = {
                    "requests": tier.requests,
                    "errors": tier.counters.errors,
                    "skipped": tier.skipped,
                }
            finally:
                runner.run(stack.aclose())
                runner.run(tier.close())
                runner.run(packed.close())
                server.empty_bucket(bucket, delete=False)
    finally:
        server.stop()
    # start() sends HEAD bucket + warm-up PUT + DELETE; then one PUT and one GET per chunk
    retried = sum(v["requests"] for v in stats.values()) - args.rounds * (3 + 2 * n)
    if retried > 0:
        notes.append(f"s3: the tier sent {retried} requests beyond one per operation (retries)")
    info = {
        "server": server.kind,
        "chunks": n,
        "chunk_bytes": size,
        "inflight": inflight,
        "timeout_s": args.s3_timeout,
        "tier_stats": stats,
        "put_requests_per_gib": {k: [n * GIB / nbytes for n in v] for k, v in puts.items()},
        "profile": profile,
    }
    if puts["packed"]:
        fewer = min(puts["one object per chunk"]) / max(max(puts["packed"]), 1)
        verdict = "PASS" if fewer >= TARGET_PUTS_FEWER else "MISS"
        say(
            f"  s3 PUT requests per GiB written down: one object per chunk "
            f"{max(puts['one object per chunk']) * GIB / nbytes:.0f}, packed {max(puts['packed']) * GIB / nbytes:.0f} "
            f"({fewer:.1f}x fewer; target >= {TARGET_PUTS_FEWER:.0f}x: {verdict})"
        )
        info["puts_fewer"] = fewer
    return [store, load, pstore, pload], info
