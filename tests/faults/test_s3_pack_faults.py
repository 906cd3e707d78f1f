# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Packed S3 objects on a real radosgw (one Ceph cluster for the module).

- Capacity: whole packs expire oldest first; each pack's live fraction falls as its chunks are
  deleted, and a restart on the bucket sees the same.
- Packs damaged under a reader: a record corrupted, a pack truncated, a pack deleted. Each is a
  miss, never wrong bytes; the index drops what it can no longer serve; the rest still serves.
- A full bucket quota: the pack's PUT is refused, its chunks are reported dropped, the breaker
  stays closed (the gateway answered) and nothing hangs; packs stored before still serve.
- Two real daemons on one bucket (default config: packs): a chunk stored by one is a hit for the
  other within seconds, byte-exact; a chunk deleted through one is a miss on the other within
  seconds.
- A daemon killed with SIGKILL in the middle of write-downs: the bucket holds whole packs only
  (every index decodes), and a daemon started on it serves exact bytes or misses.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import subprocess
import threading
import time
import uuid

import numpy as np
import pytest
from aiobotocore.session import get_session

from kvstored.chunks import packfile
from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored.chunks.packfile import PACKS_DIR
from kvstored.tiers.base import WriteOutcome
from kvstored.tiers.s3pack import PackedS3Tier
from kvstored_client import Tier
from tests.support.data import make_keys, payloads
from tests.support.s3 import radosgw_or_fail
from tests.support.wait import wait_for

pytestmark = pytest.mark.radosgw

PAGE = 4096
CHUNK = 256 << 10
RECORD = HEADER_BYTES + CHUNK
PACK = 1 << 20  # three records per pack


@pytest.fixture(scope="module")
def rgw():
    with radosgw_or_fail() as (gateway, endpoint):
        yield gateway, endpoint


@pytest.fixture
def bucket() -> str:
    return f"kv-{uuid.uuid4().hex[:16]}"


@pytest.fixture
async def raw(rgw):
    async with get_session().create_client("s3", **rgw[1].client_kwargs()) as client:
        yield client


@pytest.fixture
async def make_tier(rgw, bucket):
    tiers: list[PackedS3Tier] = []

    async def make(**kwargs) -> PackedS3Tier:
        options = {
            **rgw[1].tier_kwargs(),
            "bucket": bucket,
            "timeout_s": 10.0,
            "pack_bytes": PACK,
            "pack_age_s": 30.0,
            "pack_poll_s": 0,
            **kwargs,
        }
        tier = PackedS3Tier("s3", **options)
        tiers.append(tier)
        await tier.start()
        return tier

    yield make
    for tier in tiers:
        await tier.close()


def slot() -> tuple[mmap.mmap, list[memoryview]]:
    mm = mmap.mmap(-1, CHUNK)
    return mm, [memoryview(mm)]


async def write(tier, chunk) -> bytes:
    data = os.urandom(CHUNK)
    mm, views = slot()
    mm[:] = data
    assert await tier.write(chunk, views, CHUNK) is WriteOutcome.WRITTEN
    return data


async def read(tier, chunk) -> bytes | None:
    mm, views = slot()
    return mm[:] if await tier.read(chunk, views, CHUNK) else None


async def packs_in(raw, bucket: str, prefix: str = "") -> list[tuple[str, int]]:
    found, token = [], None
    while True:
        kwargs = {
            "Bucket": bucket,
            "Prefix": f"{prefix}{PACKS_DIR}/",
            **({"ContinuationToken": token} if token else {}),
        }
        page = await raw.list_objects_v2(**kwargs)
        found += [(o["Key"], int(o["Size"])) for o in page.get("Contents", ())]
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated"):
            return sorted(found)


async def body_of(raw, bucket: str, key: str) -> bytes:
    response = await raw.get_object(Bucket=bucket, Key=key)
    async with response["Body"] as stream:
        return await stream.read()


def new_chunk(i: int):
    return "packfaults", uuid.uuid4().bytes + bytes([i])


async def test_damaged_packs_are_misses_never_wrong_bytes_and_the_index_heals(make_tier, raw, bucket):
    tier = await make_tier()
    chunks = [new_chunk(i) for i in range(12)]  # four packs of three
    data = {c: await write(tier, c) for c in chunks}
    await tier.flush()
    packs = await packs_in(raw, bucket)
    assert len(packs) == 4 and tier.packs_written == 4
    reader = await make_tier()  # a second daemon: its index comes from the packs' own indexes
    assert await reader.contains(chunks) == [True] * 12
    (corrupt, _), (truncated, _), (deleted, _), _intact = packs
    body = bytearray(await body_of(raw, bucket, corrupt))
    body[HEADER_BYTES + 1000] ^= 0x55  # the first record's payload
    await raw.put_object(Bucket=bucket, Key=corrupt, Body=bytes(body))
    await raw.put_object(Bucket=bucket, Key=truncated, Body=(await body_of(raw, bucket, truncated))[: RECORD // 2])
    await raw.delete_object(Bucket=bucket, Key=deleted)

    for t in (tier, reader):
        served = {c: await read(t, c) for c in chunks}
        for c, got in served.items():
            assert got is None or got == data[c]  # never wrong bytes
        hits = [got is not None for got in served.values()]
        # pack 1 lost its first record only; packs 2 (truncated) and 3 (deleted) are gone whole
        assert hits == [False, True, True] + [False] * 6 + [True] * 3
        assert await t.contains(chunks) == hits  # the index healed: no request for them again
        requests = t.requests
        assert [await read(t, c) for c in chunks[3:9]] == [None] * 6 and t.requests == requests
        # (the reader finds the truncated pack already deleted by the first tier: gone, not damaged)
        assert t.counters.checksum_failures >= 1 and t.packs_dropped == 2
    await tier.flush()
    await reader.flush()
    assert truncated not in dict(await packs_in(raw, bucket))  # damaged: deleted


async def test_capacity_expires_whole_packs_oldest_first_and_shows_each_packs_live_fraction(make_tier, raw, bucket):
    pack_object = 3 * RECORD + 4096  # three records and their index (well under a page)
    tier = await make_tier(capacity_bytes=2 * pack_object + RECORD)
    chunks = [new_chunk(i) for i in range(9)]  # three packs of three; room for two
    data = {}
    for c in chunks:
        data[c] = await write(tier, c)
        await asyncio.sleep(0.002)  # (pack names carry milliseconds: keep them ordered)
    await tier.flush()  # the three PUTs may all be in flight at once: the last to land expires
    assert tier.packs_expired == 1 and len(await packs_in(raw, bucket)) == 2
    assert await tier.contains(chunks) == [False] * 3 + [True] * 6
    assert tier.usage().used_bytes <= tier.capacity_bytes
    usage = tier.pack_usage()
    assert (usage.packs, usage.live_bytes, usage.by_live_quarter) == (2, 6 * RECORD, (0, 0, 0, 2))
    await tier.remove(chunks[3])  # one record of the older pack dead: 2/3 of it live
    usage = tier.pack_usage()
    assert (usage.live_bytes, usage.by_live_quarter) == (5 * RECORD, (0, 0, 1, 1))
    (older, size), _newer = await packs_in(raw, bucket)
    assert tier.live_fraction(older) == pytest.approx(2 * RECORD / size)
    for c in chunks[4:]:
        assert await read(tier, c) == data[c]
    restarted = await make_tier(capacity_bytes=2 * pack_object + RECORD)  # the tombstone holds
    assert restarted.pack_usage().by_live_quarter == (0, 0, 1, 1)
    assert await restarted.contains(chunks) == [False] * 4 + [True] * 5


def radosgw_admin(gateway, *args: str) -> None:
    subprocess.run(["radosgw-admin", "-c", str(gateway.dir / "ceph.conf"), *args], check=True, timeout=60)


async def test_a_full_bucket_quota_drops_the_pack_without_opening_the_breaker(rgw, make_tier, raw, bucket):
    gateway, _ = rgw
    tier = await make_tier()
    first = [new_chunk(i) for i in range(3)]
    data = {c: await write(tier, c) for c in first}
    await tier.flush()
    stored = sum(size for _k, size in await packs_in(raw, bucket))
    radosgw_admin(gateway, "quota", "set", "--quota-scope=bucket", f"--bucket={bucket}", f"--max-size={stored + 4096}")
    radosgw_admin(gateway, "quota", "enable", "--quota-scope=bucket", f"--bucket={bucket}")
    removed: list = []
    tier.removal_listener = lambda _t, chunk, _cause: removed.append(chunk)
    refused = [new_chunk(10 + i) for i in range(3)]
    deadline = time.monotonic() + 120  # radosgw applies a new quota within its cache refresh
    while not removed and time.monotonic() < deadline:
        batch = [new_chunk(20 + i) for i in range(3)]
        for c in batch:
            await write(tier, c)
        await tier.flush()
        refused = batch
        await asyncio.sleep(1)
    assert removed == refused, "radosgw never enforced the bucket quota"
    assert tier.available and tier.counters.errors >= 1  # refused, not unreachable
    assert await tier.contains(refused) == [False] * 3
    for c in first:
        assert await read(tier, c) == data[c]


async def test_a_frozen_then_stopped_radosgw_costs_a_few_timeouts_then_nothing(rgw, make_tier):
    gateway, _ = rgw
    failures, reset_s, reads = 3, 2.0, 30
    tier = await make_tier(timeout_s=1.0, breaker_failures=failures, breaker_reset_s=reset_s, pack_uploads=1)
    chunks = [new_chunk(i) for i in range(6)]
    data = {c: await write(tier, c) for c in chunks}
    await tier.flush()
    for phase in ("frozen", "stopped"):
        before, started = tier.counters.errors, time.monotonic()
        if phase == "frozen":
            with gateway.gateway_frozen():
                got = [await read(tier, chunks[i % 6]) for i in range(reads)]
                # writes go on into memory, then fail fast once the breaker is open: no hang
                outcomes = [await tier.write(new_chunk(50 + i), slot()[1], CHUNK) for i in range(8)]
        else:
            gateway.stop_gateway()
            try:
                got = [await read(tier, chunks[i % 6]) for i in range(reads)]
                outcomes = [await tier.write(new_chunk(60 + i), slot()[1], CHUNK) for i in range(8)]
            finally:
                gateway.start_gateway()
        elapsed = time.monotonic() - started
        failed = tier.counters.errors - before
        assert got == [None] * reads  # misses, never wrong bytes
        assert WriteOutcome.FAILED in outcomes
        assert 1 <= failed <= failures + 2 + int(elapsed / reset_s) < reads, (phase, failed, elapsed)

        async def back():
            return await read(tier, chunks[0]) == data[chunks[0]]

        deadline = time.monotonic() + 120
        while not await back():
            assert time.monotonic() < deadline, f"the tier never served again after radosgw was {phase}"
            await asyncio.sleep(0.5)
    for c in chunks:  # the index kept them through the outage
        assert await read(tier, c) == data[c]


# -- real daemons -----------------------------------------------------------------------------


def s3_tier(endpoint, bucket: str, **options: str) -> str:
    spec = {
        "kind": "s3",
        "bucket": bucket,
        "endpoint_url": endpoint.url,
        "access_key": endpoint.access_key,
        "secret_key": endpoint.secret_key,
        "region": "us-east-1",
        "pack_bytes": "1MiB",
        "pack_age_s": "0.2",
        "pack_poll_s": "0.5",
        **options,
    }
    return ",".join(f"{k}={v}" for k, v in spec.items())


def test_two_daemons_on_one_bucket_share_packed_chunks_within_seconds(daemon_factory, rgw, ns_name):
    _, endpoint = rgw
    bucket = f"kv-{uuid.uuid4().hex[:8]}"
    args = ["--write-policy", "write-through", "--tiers", s3_tier(endpoint, bucket)]
    a = daemon_factory(args, cpu_bytes="8MiB")
    b = daemon_factory(args, cpu_bytes="8MiB")
    keys = make_keys(ns_name, 12)
    with a.client() as ca, b.client() as cb:
        ns_a = ca.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        ns_b = cb.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        assert cb.lookup(ns_b, keys).prefix_hits == 0
        assert ca.store(ns_a, keys, payloads(keys, CHUNK)).stored == 12
        # packs sent within pack_age_s, listed by b within pack_poll_s: seconds, not a restart
        assert wait_for(lambda: cb.lookup(ns_b, keys).prefix_hits == 12, 30), "b never saw a's packs"
        out = np.zeros((12, CHUNK), dtype=np.uint8)
        assert cb.load(ns_b, keys, out) == 12
        assert np.array_equal(out, payloads(keys, CHUNK))
        # b stored none of them: every hit came out of a's packs (some promoted to b's RAM by now)
        s3_b = next(t for t in b.stats().tiers if t.name == "s3")
        assert s3_b.stored_chunks == 0 and s3_b.loaded_chunks >= 1

        # a Delete on a: b stops serving them within seconds (a's next manifest names them). b
        # never looks them up before that (a lookup hit would promote them into b's RAM).
        def s3_chunks_of_b() -> int:
            return next(t for t in b.stats().tiers if t.name == "s3").chunks

        deleted = make_keys(ns_name, 3, start=12)
        assert ca.store(ns_a, deleted, payloads(deleted, CHUNK)).stored == 3
        assert wait_for(lambda: s3_chunks_of_b() == 15, 30), "b never saw a's new packs"
        assert ca.delete(ns_a, deleted) == 3
        assert wait_for(lambda: s3_chunks_of_b() == 12, 30), "b still serves the chunks a deleted"
        assert cb.lookup(ns_b, deleted).tiers == [Tier.NONE] * 3
        assert cb.lookup(ns_b, keys).prefix_hits == 12  # the others still served


def test_a_daemon_killed_mid_write_down_leaves_whole_packs_only(daemon_factory, rgw, ns_name):
    _, endpoint = rgw
    bucket = f"kv-{uuid.uuid4().hex[:8]}"
    args = ["--write-policy", "write-through", "--tiers", s3_tier(endpoint, bucket, pack_age_s="0.05")]
    a = daemon_factory(args, cpu_bytes="4MiB")
    keys = make_keys(ns_name, 400)
    stop = threading.Event()
    sent: list[bytes] = []

    def store() -> None:
        with a.client(deadline_s=5.0) as c:
            ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
            for i in range(0, len(keys), 4):
                if stop.is_set():
                    return
                try:
                    c.store(ns, keys[i : i + 4], payloads(keys[i : i + 4], CHUNK))
                except Exception:  # noqa: BLE001 - the daemon is killed under it
                    return
                sent.extend(keys[i : i + 4])

    storer = threading.Thread(target=store)
    storer.start()
    assert wait_for(lambda: len(sent) >= 80, 60), "the daemon stored nothing"
    a.kill()  # SIGKILL: packs open, being PUT, and sent
    stop.set()
    storer.join(30)

    # what the bucket holds: whole packs, each index readable (a PUT is all or nothing)
    async def check_bucket() -> int:
        async with get_session().create_client("s3", **endpoint.client_kwargs()) as client:
            packs = await packs_in(client, bucket)
            for key, size in packs:
                entries = packfile.decode_index(await body_of(client, bucket, key), size)
                assert isinstance(entries, list) and entries
            return len(packs)

    assert asyncio.run(check_bucket()) >= 1

    b = daemon_factory(args, cpu_bytes="4MiB")
    with b.client() as c:
        ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
        looked = c.lookup(ns, keys)
        hits = [k for k, t in zip(keys, looked.tiers) if t == Tier.S3]
        assert hits, "no chunk of the killed daemon reached S3"
        assert set(hits) <= set(sent)
        out = np.zeros((1, CHUNK), dtype=np.uint8)
        for key in hits:
            if c.load(ns, [key], out) == 1:  # a hit, exact; or a miss
                assert np.array_equal(out[0], payloads([key], CHUNK)[0])
