# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The S3 tier (one object per chunk, and packed) beside raw aiobotocore put/get of the same objects."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

import numpy as np

from bench.lib.report import GIB
from bench.lib.s3 import start_s3
from bench.tiers.common import (
    Pair,
    Pool,
    chunk_ids,
    drive,
    header_pages,
    measure,
    on_loop,
    rotated,
    say,
    tier_load,
    tier_store,
)
from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES

TARGET_S3 = 0.85
TARGET_PUTS_FEWER = 10.0  # packed PUT requests per GiB written down vs one object per chunk


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
    from aiobotocore.session import get_session

    from kvstored.tiers.s3 import S3Tier
    from kvstored.tiers.s3pack import PackedS3Tier

    n, size, inflight = args.s3_chunks, args.chunk_bytes, args.s3_inflight
    nbytes = n * size
    server = start_s3(args.s3, args.memstore_bytes)
    kind = "Ceph radosgw (memstore OSD)" if server.is_rgw else "moto_server"
    say(f"  S3 endpoint: {kind} at {server.endpoint.url}, up in {server.started_s:.1f} s")
    if server.note:
        notes.append(server.note)
    bucket = f"kvstored-bench-tiers-{os.getpid()}"
    chunks = chunk_ids(n, "s3")
    raw_keys = ["raw/" + chunkfile.chunk_relpath(c) for c in chunks]
    # the same object bytes the tier PUTs (header + payload), built before timing
    bodies = [b"".join([h, v]) for h, v in zip(header_pages(chunks, src.views, size), src.views)]
    store, load = Pair("s3 store", TARGET_S3), Pair("s3 load", TARGET_S3)
    # packs (32 MiB, the default) against the same raw rows: PUTs of one object per chunk, GETs of them
    pstore = Pair("s3 packed store", TARGET_S3, raw=store.raw)
    pload = Pair("s3 packed load (ranged)", TARGET_S3, raw=load.raw)
    puts: dict[str, list[int]] = {"one object per chunk": [], "packed": []}
    stats: dict[str, Any] = {}
    try:
        ep, pids = server.endpoint, server.pids()
        server.new_bucket(bucket)
        settings = dict(max_concurrency=inflight, timeout_s=args.s3_timeout, create_bucket=False, **ep.tier_kwargs())
        for rnd in range(args.rounds):
            # both clients are opened before timing (creating one costs ~0.1-0.3 s of CPU)
            tier = S3Tier("bench", bucket, prefix="tier/", **settings)
            packed = PackedS3Tier("bench-packed", bucket, prefix="packed/", pack_poll_s=0, **settings)
            stack = contextlib.AsyncExitStack()
            runner.run(tier.start())
            runner.run(packed.start())
            try:
                # the raw client uses exactly the tier's transport settings (timeouts, pool, checksums)
                session = get_session().create_client("s3", config=tier._client.meta.config, **ep.client_kwargs())
                client = runner.run(stack.enter_async_context(session))
                stores = [  # (samples, phase, the tier whose PUTs are counted)
                    (store.tier, on_loop(runner, tier_store, tier, chunks, src.views, size, inflight), tier),
                    (pstore.tier, on_loop(runner, packed_store, packed, chunks, src.views, size, inflight), packed),
                    (store.raw, on_loop(runner, raw_s3_store, client, bucket, raw_keys, bodies, inflight), None),
                ]
                loads = [
                    (load.tier, on_loop(runner, tier_load, tier, chunks, dst.views, size, inflight)),
                    (pload.tier, on_loop(runner, tier_load, packed, chunks, dst.views, size, inflight)),
                    (load.raw, on_loop(runner, raw_s3_load, client, bucket, raw_keys, HEADER_BYTES + size, inflight)),
                ]
                for samples, fn, counted in rotated(stores, rnd):
                    sent = counted.requests if counted else 0
                    samples.append(measure(nbytes, fn, pids))
                    if counted:
                        puts["packed" if counted is packed else "one object per chunk"].append(counted.requests - sent)
                for samples, fn in rotated(loads, rnd):
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
                stats[f"round{rnd}"] = dict(requests=tier.requests, errors=tier.counters.errors, skipped=tier.skipped)
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
    per_gib = {k: [p * GIB / nbytes for p in v] for k, v in puts.items()}
    info = {
        "server": server.kind,
        "chunks": n,
        "chunk_bytes": size,
        "inflight": inflight,
        "timeout_s": args.s3_timeout,
        "tier_stats": stats,
        "put_requests_per_gib": per_gib,
    }
    if puts["packed"]:
        fewer = min(puts["one object per chunk"]) / max(max(puts["packed"]), 1)
        say(
            f"  s3 PUT requests per GiB written down: one object per chunk {max(per_gib['one object per chunk']):.0f}, "
            f"packed {max(per_gib['packed']):.0f} ({fewer:.1f}x fewer; target >= {TARGET_PUTS_FEWER:.0f}x: "
            f"{'PASS' if fewer >= TARGET_PUTS_FEWER else 'MISS'})"
        )
        info["puts_fewer"] = fewer
    return [store, load, pstore, pload], info
