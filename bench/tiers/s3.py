# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The S3 tier beside raw aiobotocore put/get of the same objects."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import numpy as np

from bench.lib.s3 import raw_config, start_s3
from bench.tiers.common import (
    TARGET_S3,
    Pair,
    Pool,
    chunk_ids,
    drive,
    measure,
    rotated,
    say,
    tier_load,
    tier_store,
)
from bench.tiers.profile import profiled
from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES


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


def bench_s3(runner: asyncio.Runner, args, src: Pool, dst: Pool, notes: list[str]) -> tuple[list[Pair], dict]:
    from kvstored.tiers.s3 import S3Tier

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
    stats: dict[str, Any] = {}
    profile: dict[str, Any] = {}
    try:
        ep = server.endpoint
        pids = server.pids()
        server.new_bucket(bucket)
        for rnd in range(args.rounds + (1 if args.profile else 0)):
            profiling = rnd == args.rounds  # the extra round of --profile: cProfile on the loop thread
            # both clients are opened before timing (creating one costs ~0.1-0.3 s of CPU)
            tier = S3Tier(
                "bench",
                bucket,
                prefix="tier/",
                max_concurrency=inflight,
                timeout_s=args.s3_timeout,
                create_bucket=False,
                **ep.tier_kwargs(),
            )
            stack = contextlib.AsyncExitStack()
            runner.run(tier.start())
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
                    ("tier store", store.tier, lambda: runner.run(tier_store(tier, chunks, src.views, size, inflight))),  # noqa: B023 - called this round
                    (
                        "raw store",
                        store.raw,
                        lambda: runner.run(raw_s3_store(client, bucket, raw_keys, bodies, inflight)),  # noqa: B023
                    ),  # the lambdas are called this round (B023)
                ]
                loads = [
                    ("tier load", load.tier, lambda: runner.run(tier_load(tier, chunks, dst.views, size, inflight))),  # noqa: B023 - called this round
                    (
                        "raw load",
                        load.raw,
                        lambda: runner.run(raw_s3_load(client, bucket, raw_keys, HEADER_BYTES + size, inflight)),  # noqa: B023
                    ),  # the lambdas are called this round (B023)
                ]
                if profiling:
                    for name, _, fn in stores + loads:
                        profile[name] = profiled(nbytes, fn)
                    continue
                for _, samples, fn in rotated(stores, rnd):
                    samples.append(measure(nbytes, fn, pids))
                if rnd == 0:
                    dst.array[:nbytes] = 0
                for _, samples, fn in rotated(loads, rnd):
                    samples.append(measure(nbytes, fn, pids))
                    if rnd == 0 and samples is load.tier:
                        if not np.array_equal(dst.array[:nbytes], src.array[:nbytes]):
                            raise RuntimeError("s3 tier loaded bytes differ from the source")
                say(
                    f"  s3 round {rnd}: store tier {store.tier[-1].gib_s:.2f} raw {store.raw[-1].gib_s:.2f} | "
                    f"load tier {load.tier[-1].gib_s:.2f} raw {load.raw[-1].gib_s:.2f} GiB/s "
                    f"(tier: {tier.requests} requests, {tier.counters.errors} errors)"
                )
                stats[f"round{rnd}"] = {
                    "requests": tier.requests,
                    "errors": tier.counters.errors,
                    "skipped": tier.skipped,
                }
            finally:
                runner.run(stack.aclose())
                runner.run(tier.close())
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
        "profile": profile,
    }
    return [store, load], info
