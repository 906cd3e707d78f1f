# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""S3 tier against a real Ceph radosgw on loopback (deploy/ceph/start_rgw.sh, one per module).

Needs the Debian packages ceph-mon ceph-osd radosgw curl (deploy/install-system-deps.sh): without
them these tests fail, they are not skipped.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import uuid

import pytest
from aiobotocore.session import get_session

from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored.chunks.ids import RemovalCause
from kvstored.tiers.base import TierUsage, WriteOutcome
from kvstored.tiers.s3 import S3Tier
from tests.support.s3 import radosgw_or_fail

pytestmark = pytest.mark.radosgw

PAGE = 4096
CHUNK = 2 << 20


@pytest.fixture(scope="module")
def rgw():
    with radosgw_or_fail() as (gateway, _):
        yield gateway


@pytest.fixture
def bucket() -> str:
    return f"kv-{uuid.uuid4().hex[:16]}"


@pytest.fixture
async def raw(rgw):
    async with get_session().create_client("s3", **rgw.endpoint.client_kwargs()) as client:
        yield client


@pytest.fixture
async def make_tier(rgw, bucket):
    tiers: list[S3Tier] = []

    async def make(**kwargs) -> S3Tier:
        tier = S3Tier("s3", **{**rgw.endpoint.tier_kwargs(), "bucket": bucket, "timeout_s": 10.0, **kwargs})
        tiers.append(tier)
        await tier.start()
        return tier

    yield make
    for tier in tiers:
        await tier.close()


def slot(size: int, pages_per_view: int = 64) -> tuple[mmap.mmap, list[memoryview]]:
    """A pool slot: page-aligned views of `pages_per_view` pages over an anonymous mmap."""
    pages = -(-size // PAGE)
    mm = mmap.mmap(-1, pages * PAGE)
    whole = memoryview(mm)
    step = pages_per_view * PAGE
    return mm, [whole[i : i + step] for i in range(0, pages * PAGE, step)]


def new_chunk():
    return uuid.uuid4().hex, os.urandom(16)


async def test_round_trip_of_2mib_chunks(make_tier, raw, bucket):
    tier = await make_tier(prefix="node-a/")
    chunks = [new_chunk() for _ in range(8)]
    payloads = [os.urandom(CHUNK) for _ in chunks]
    slots = [slot(CHUNK) for _ in chunks]
    for (mm, _), data in zip(slots, payloads):
        mm[:CHUNK] = data
    outcomes = await asyncio.gather(*(tier.write(c, views, CHUNK) for c, (_, views) in zip(chunks, slots)))
    assert outcomes == [WriteOutcome.WRITTEN] * len(chunks)
    head = await raw.head_object(Bucket=bucket, Key="node-a/" + chunkfile.chunk_relpath(chunks[0]))
    assert head["ContentLength"] == HEADER_BYTES + CHUNK

    reader = await make_tier(prefix="node-a/")  # a fresh index: HEADs, then GETs
    assert await reader.contains(chunks + [new_chunk()]) == [True] * len(chunks) + [False]
    targets = [slot(CHUNK, pages_per_view=7) for _ in chunks]
    assert all(await asyncio.gather(*(reader.read(c, views, CHUNK) for c, (_, views) in zip(chunks, targets))))
    assert [mm[:CHUNK] for mm, _ in targets] == payloads
    assert (reader.counters.reads, reader.counters.read_bytes) == (len(chunks), len(chunks) * CHUNK)
    assert reader.usage() == TierUsage(0, len(chunks) * (HEADER_BYTES + CHUNK), len(chunks))

    assert await tier.remove(chunks[0])
    assert not await reader.read(chunks[0], targets[0][1], CHUNK)


async def test_corrupt_object_is_removed_and_counted(make_tier, raw, bucket):
    tier = await make_tier()
    removed = []
    tier.removal_listener = lambda t, chunk, cause: removed.append((chunk, cause))
    chunk = new_chunk()
    mm, views = slot(CHUNK)
    mm[:CHUNK] = os.urandom(CHUNK)
    assert await tier.write(chunk, views, CHUNK) is WriteOutcome.WRITTEN
    key = chunkfile.chunk_relpath(chunk)
    body = bytearray(await (await raw.get_object(Bucket=bucket, Key=key))["Body"].read())
    body[HEADER_BYTES + CHUNK // 2] ^= 0xFF
    await raw.put_object(Bucket=bucket, Key=key, Body=bytes(body))

    out_mm, out_views = slot(CHUNK)
    assert not await tier.read(chunk, out_views, CHUNK)
    assert tier.counters.checksum_failures == 1 and tier.counters.reads == 0
    assert removed == [(chunk, RemovalCause.CORRUPT)]
    with pytest.raises(raw.exceptions.ClientError):
        await raw.head_object(Bucket=bucket, Key=key)


async def test_capacity_index_survives_a_restart_of_the_daemon(make_tier, raw, bucket):
    obj = HEADER_BYTES + PAGE
    first = await make_tier(capacity_bytes=4 * obj)
    chunks = [new_chunk() for _ in range(4)]
    mm, views = slot(PAGE)
    for chunk in chunks:
        mm[:PAGE] = os.urandom(PAGE)
        assert await first.write(chunk, views, PAGE) is WriteOutcome.WRITTEN
        await asyncio.sleep(0.01)  # distinct LastModified (radosgw keeps milliseconds)
    await first.close()

    second = await make_tier(capacity_bytes=4 * obj)
    assert second.usage() == TierUsage(4 * obj, 4 * obj, 4)
    mm[:PAGE] = os.urandom(PAGE)
    assert await second.write(new_chunk(), views, PAGE) is WriteOutcome.WRITTEN
    with pytest.raises(raw.exceptions.ClientError):  # the oldest object made room
        await raw.head_object(Bucket=bucket, Key=chunkfile.chunk_relpath(chunks[0]))
    assert await second.contains(chunks) == [False, True, True, True]


async def test_gateway_down_fails_fast_and_recovers(rgw, make_tier):
    tier = await make_tier(breaker_failures=3, breaker_reset_s=0.5, timeout_s=5.0)
    chunk = new_chunk()
    mm, views = slot(CHUNK)
    data = os.urandom(CHUNK)
    mm[:CHUNK] = data
    assert await tier.write(chunk, views, CHUNK) is WriteOutcome.WRITTEN

    rgw.stop_gateway()
    try:
        out_mm, out_views = slot(CHUNK)
        for _ in range(3):  # three operations fail (connection refused) ...
            assert not await tier.read(chunk, out_views, CHUNK)
        assert not tier.available
        sent = tier.requests
        for _ in range(10):  # ... and then nothing goes out until breaker_reset_s has passed
            assert await tier.contains([new_chunk()]) == [False]
            assert not await tier.read(chunk, out_views, CHUNK)
            assert await tier.write(new_chunk(), views, CHUNK) is WriteOutcome.FAILED
        assert tier.requests == sent
        assert tier.counters.errors == 3
    finally:
        rgw.start_gateway()

    while not tier.available:
        await asyncio.sleep(0.05)
    assert await tier.read(chunk, out_views, CHUNK)  # the OSD kept the object
    assert out_mm[:CHUNK] == data
    other = new_chunk()
    assert await tier.write(other, views, CHUNK) is WriteOutcome.WRITTEN
    assert await tier.read(other, out_views, CHUNK) and out_mm[:CHUNK] == data
