# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""S3 tier against moto_server (a real HTTP S3 endpoint in a subprocess), plus its pure helpers.

Faults are real too: a closed port for a dead endpoint, a proxy answering 503 SlowDown for
throttling. Assertions count requests, never time them.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
import threading

import pytest

from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored.chunks.chunkfile import parse_relpath as _parse_key
from kvstored.chunks.ids import RemovalCause
from kvstored.chunks.receiver import RecordReceiver
from kvstored.errors import TierUnavailable
from kvstored.io.breaker import BreakerState, CircuitBreaker
from kvstored.tiers.base import AdmissionPolicy, TierUsage, WriteOutcome
from kvstored.tiers.resilience import Backoff, NegativeCache
from kvstored.tiers.s3 import S3Tier, S3TierError
from tests.support.ports import free_port
from tests.support.s3 import FaultProxy, MotoServer

PAGE = 4096
FAST_BACKOFF = Backoff(attempts=4, base_s=0.005, cap_s=0.02)


# -- fixtures and helpers -----------------------------------------------------------------


@pytest.fixture
def make_tier(s3_tiers):
    """Start S3 tiers on the test's bucket (moto endpoint unless told otherwise); closed at the end."""

    async def make(start: bool = True, **kwargs) -> S3Tier:
        return await s3_tiers(S3Tier, start, **{"backoff": FAST_BACKOFF, **kwargs})

    return make


class Pages:
    """Page-aligned views over an anonymous mmap, chopped into pieces of `split` pages each."""

    def __init__(self, split: list[int]) -> None:
        self.mm = mmap.mmap(-1, sum(split) * PAGE)
        whole = memoryview(self.mm)
        self.views, offset = [], 0
        for pages in split:
            self.views.append(whole[offset : offset + pages * PAGE])
            offset += pages * PAGE

    def fill(self, data: bytes) -> None:
        self.mm[: len(data)] = data

    def bytes(self, size: int) -> bytes:
        return self.mm[:size]


def new_chunk(ns: str = "0123456789abcdef0123456789abcdef"):
    return ns, os.urandom(16)


async def stored(tier: S3Tier, chunk, size: int = 3 * PAGE - 100, split=(2, 1)) -> bytes:
    data = os.urandom(size)
    pages = Pages(list(split))
    pages.fill(data)
    assert await tier.write(chunk, pages.views, size) is WriteOutcome.WRITTEN
    return data


async def exists(raw, bucket: str, key: str) -> bool:
    try:
        await raw.head_object(Bucket=bucket, Key=key)
        return True
    except raw.exceptions.ClientError as exc:
        assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 404
        return False


# -- data path ------------------------------------------------------------------------------


async def test_round_trip_is_byte_exact_across_views(make_tier, raw, bucket):
    tier = await make_tier(prefix="kv/")
    chunk = new_chunk()
    size = 6 * PAGE - 123
    data = os.urandom(size)
    src = Pages([1, 3, 2])
    src.fill(data)

    assert await tier.write(chunk, src.views, size) is WriteOutcome.WRITTEN
    key = "kv/" + chunkfile.chunk_relpath(chunk)
    obj = await raw.get_object(Bucket=bucket, Key=key)
    body = await obj["Body"].read()
    assert len(body) == HEADER_BYTES + size and body[HEADER_BYTES:] == data
    header = chunkfile.decode_header(body[:HEADER_BYTES])
    assert (header.namespace_id, header.key, header.payload_len) == (chunk[0], chunk[1], size)

    dst = Pages([2, 2, 1, 1])
    assert await tier.read(chunk, dst.views, size)
    assert dst.bytes(size) == data
    assert await tier.write(chunk, src.views, size) is WriteOutcome.ALREADY_PRESENT
    c = tier.counters
    assert (c.writes, c.written_bytes, c.reads, c.read_bytes, c.errors) == (1, size, 1, size, 0)
    assert tier.usage() == TierUsage(0, HEADER_BYTES + size, 1)

    # a second daemon (fresh index) finds it with a HEAD and reads the same bytes
    other = await make_tier(prefix="kv/")
    assert await other.contains([chunk, new_chunk()]) == [True, False]
    dst2 = Pages([6])
    assert await other.read(chunk, dst2.views, size)
    assert dst2.bytes(size) == data
    assert (other.counters.lookups, other.counters.hits) == (2, 1)


async def test_read_of_a_missing_chunk_is_a_plain_miss(make_tier):
    tier = await make_tier()
    pages = Pages([2])
    assert not await tier.read(new_chunk(), pages.views, PAGE)
    assert (tier.counters.reads, tier.counters.errors, tier.counters.checksum_failures) == (0, 0, 0)


def _flip_payload_byte(body: bytes, chunk) -> bytes:
    return body[: HEADER_BYTES + 5] + bytes([body[HEADER_BYTES + 5] ^ 1]) + body[HEADER_BYTES + 6 :]


def _other_chunks_header(body: bytes, chunk) -> bytes:
    size = len(body) - HEADER_BYTES
    payload = body[HEADER_BYTES:]
    other = (chunk[0], bytes(16))
    return chunkfile.encode_header(other, size, chunkfile.checksum([payload], size)) + payload


@pytest.mark.parametrize(
    "damage",
    [
        _flip_payload_byte,
        lambda body, chunk: body[:-1],  # truncated
        lambda body, chunk: body + b"x",  # too long
        lambda body, chunk: body[:HEADER_BYTES],  # header only
        lambda body, chunk: b"\0" * len(body),  # garbage of the right length
        _other_chunks_header,
    ],
    ids=["flipped-byte", "truncated", "too-long", "header-only", "zeros", "other-chunk"],
)
async def test_corrupt_object_is_counted_removed_and_never_served(make_tier, raw, bucket, damage):
    tier = await make_tier()
    removed = []
    tier.removal_listener = lambda t, chunk, cause: removed.append((chunk, cause))
    chunk = new_chunk()
    size = 2 * PAGE + 7
    await stored(tier, chunk, size)
    key = chunkfile.chunk_relpath(chunk)
    good = await (await raw.get_object(Bucket=bucket, Key=key))["Body"].read()
    await raw.put_object(Bucket=bucket, Key=key, Body=damage(good, chunk))

    dst = Pages([3])
    dst.fill(b"\xaa" * 3 * PAGE)
    assert not await tier.read(chunk, dst.views, size)
    assert tier.counters.checksum_failures == 1 and tier.counters.reads == 0
    assert removed == [(chunk, RemovalCause.CORRUPT)]
    assert not await exists(raw, bucket, key)
    assert await tier.contains([chunk]) == [False]
    assert tier.usage().chunks == 0


async def test_remove_deletes_the_object(make_tier, raw, bucket):
    tier = await make_tier()
    chunk = new_chunk()
    await stored(tier, chunk)
    assert await tier.remove(chunk)
    assert not await exists(raw, bucket, chunkfile.chunk_relpath(chunk))
    assert await tier.contains([chunk]) == [False]
    assert tier.usage() == TierUsage(0, 0, 0)
    assert not await tier.remove(chunk)  # just seen missing: nothing to delete


async def test_a_failed_delete_is_reported_and_the_object_is_never_found_again(make_tier, moto, raw, bucket):
    async with FaultProxy(moto.url, status=403, code="AccessDenied") as proxy:
        tier = await make_tier(endpoint_url=proxy.url, negative_cache_s=0)
        chunk = new_chunk()
        await stored(tier, chunk)
        proxy.fail_next = 1
        with pytest.raises(TierUnavailable, match="could not delete"):
            await tier.remove(chunk)
        assert await exists(raw, bucket, chunkfile.chunk_relpath(chunk))  # still there...
        assert await tier.contains([chunk]) == [False]  # ...but deleted as far as anyone asks
        assert tier.holds([chunk]) == [False]
        assert not await tier.read(chunk, Pages([3]).views, 3 * PAGE - 100)
        data = await stored(tier, chunk)  # a new value replaces it
        assert await tier.contains([chunk]) == [True]
        dst = Pages([3])
        assert await tier.read(chunk, dst.views, len(data)) and dst.bytes(len(data)) == data


@pytest.mark.parametrize("lookup", ["read", "contains"])
async def test_a_lookup_answered_before_a_remove_does_not_index_the_deleted_chunk(
    make_tier, raw, bucket, monkeypatch, lookup
):
    tier = await make_tier(capacity_bytes=1 << 30)
    chunk, size = new_chunk(), 3 * PAGE - 100
    await stored(await make_tier(), chunk, size)  # written by another daemon: not indexed here
    method = "get_object" if lookup == "read" else "head_object"
    real = getattr(tier._client, method)
    answered, go_on = asyncio.Event(), asyncio.Event()

    async def late(**kwargs):  # the answer arrives, and is handled after the remove
        response = await real(**kwargs)
        answered.set()
        await go_on.wait()
        return response

    monkeypatch.setattr(tier._client, method, late)
    if lookup == "read":
        looking = asyncio.ensure_future(tier.read(chunk, Pages([3]).views, size))
    else:
        looking = asyncio.ensure_future(tier.contains([chunk]))
    await answered.wait()
    assert await tier.remove(chunk)
    go_on.set()
    await looking
    assert not await exists(raw, bucket, chunkfile.chunk_relpath(chunk))
    assert tier.holds([chunk]) == [False] and tier.usage().chunks == 0
    monkeypatch.setattr(tier._client, method, real)
    assert await stored(tier, chunk, size)  # a Put of it is written, not answered ALREADY_PRESENT


async def test_concurrent_writes_of_one_chunk_send_one_put(make_tier):
    tier = await make_tier()
    chunk = new_chunk()
    pages = Pages([2])
    pages.fill(os.urandom(2 * PAGE))
    before = tier.requests
    outcomes = await asyncio.gather(*(tier.write(chunk, pages.views, 2 * PAGE) for _ in range(5)))
    assert sorted(o.name for o in outcomes) == ["ALREADY_PRESENT"] * 4 + ["WRITTEN"]
    assert tier.requests - before == 1


async def test_a_put_body_is_encoded_off_the_loop_and_a_get_body_lands_in_pieces(make_tier, monkeypatch):
    """A PUT's checksum runs in the tier's threads, as the fs tier's does (a 2 MiB chunk on the
    loop stalls every other request), and its body is read from the chunk's pages. A GET's body
    is never held whole: each piece the connection delivers goes straight into the views and the
    running checksum (one copy, a few microseconds of the loop per piece), verified once the last
    piece is in."""
    tier = await make_tier()
    loop_thread = threading.current_thread()
    threads: list[threading.Thread] = []
    real_checksum = chunkfile.checksum

    def checksum(views, size: int) -> int:  # the real one, noting where it runs
        threads.append(threading.current_thread())
        return real_checksum(views, size)

    monkeypatch.setattr(chunkfile, "checksum", checksum)
    pieces: list[int] = []
    real_feed = RecordReceiver.feed

    def feed(self, piece) -> None:
        pieces.append(len(piece))
        real_feed(self, piece)

    monkeypatch.setattr(RecordReceiver, "feed", feed)
    chunk = new_chunk()
    size = 512 * PAGE  # 2 MiB
    data = await stored(tier, chunk, size, split=(256, 256))
    assert len(threads) == 1 and loop_thread not in threads
    dst = Pages([300, 212])
    assert await tier.read(chunk, dst.views, size) and dst.bytes(size) == data
    assert sum(pieces) == HEADER_BYTES + size and max(pieces) < size


async def test_a_closed_tier_refuses_writes_and_reads_without_raising(make_tier):
    tier = await make_tier()
    chunk = new_chunk()
    await stored(tier, chunk)
    await tier.close()
    pages = Pages([3])
    assert await tier.write(new_chunk(), pages.views, 100) is WriteOutcome.FAILED
    assert await tier.read(chunk, pages.views, 3 * PAGE - 100) is False


# -- lookups: index, negative cache, batching ----------------------------------------------------


async def test_contains_answers_known_chunks_without_requests(make_tier):
    tier = await make_tier()
    chunks = [new_chunk() for _ in range(3)]
    for chunk in chunks:
        await stored(tier, chunk)
    before = tier.requests
    assert await tier.contains(chunks) == [True, True, True]
    assert tier.holds(chunks + [new_chunk()]) == [True, True, True, False]  # what a store asks
    assert tier.requests == before


async def test_negative_cache_spares_repeated_lookups_and_a_write_clears_it(make_tier):
    tier = await make_tier(negative_cache_s=60.0)
    writer = await make_tier()
    chunk = new_chunk()
    assert await tier.contains([chunk]) == [False]
    before = tier.requests
    assert await tier.contains([chunk, chunk]) == [False, False]
    assert tier.requests == before  # cached miss: no HEAD

    await stored(writer, chunk)  # another daemon writes it: this one trusts its cache for now
    assert await tier.contains([chunk]) == [False]
    await stored(tier, chunk)  # our own write clears the negative entry
    assert await tier.contains([chunk]) == [True]


async def test_negative_entries_expire(make_tier):
    tier = await make_tier(negative_cache_s=0.05)
    writer = await make_tier()
    chunk = new_chunk()
    assert await tier.contains([chunk]) == [False]
    await stored(writer, chunk)
    await asyncio.sleep(0.1)
    assert await tier.contains([chunk]) == [True]


async def test_contains_heads_misses_concurrently_within_the_bound(make_tier, moto):
    async with FaultProxy(moto.url) as proxy:
        writer = await make_tier(endpoint_url=proxy.url)
        present = [new_chunk() for _ in range(10)]
        for chunk in present:
            await stored(writer, chunk)
        tier = await make_tier(endpoint_url=proxy.url, max_concurrency=4)
        absent = [new_chunk() for _ in range(30)]
        asked = present + absent + present[:3]  # duplicates are asked once
        proxy.max_in_flight = 0
        seen = proxy.seen
        assert await tier.contains(asked) == [True] * 10 + [False] * 30 + [True] * 3
        assert proxy.seen - seen == 40
        assert 2 <= proxy.max_in_flight <= 4
        assert (tier.counters.lookups, tier.counters.hits) == (43, 13)


# -- capacity ---------------------------------------------------------------------------------


async def test_capacity_evicts_least_recently_used_objects(make_tier, raw, bucket):
    size = PAGE
    tier = await make_tier(capacity_bytes=3 * (HEADER_BYTES + size))
    removed = []
    tier.removal_listener = lambda t, chunk, cause: removed.append((chunk, cause))
    a, b, c, d = (new_chunk() for _ in range(4))
    for chunk in (a, b, c):
        await stored(tier, chunk, size, split=(1,))
    assert await tier.contains([a]) == [True]  # a is now more recent than b
    await stored(tier, d, size, split=(1,))

    assert removed == [(b, RemovalCause.EVICTED)]
    assert tier.counters.evictions == 1
    assert [await exists(raw, bucket, chunkfile.chunk_relpath(x)) for x in (a, b, c, d)] == [True, False, True, True]
    assert tier.usage() == TierUsage(3 * (HEADER_BYTES + size), 3 * (HEADER_BYTES + size), 3)

    big = Pages([6])  # header + 6 pages > capacity
    assert await tier.write(new_chunk(), big.views, 6 * PAGE) is WriteOutcome.REJECTED_FULL
    assert tier.counters.rejected_full == 1


async def test_start_lists_the_prefix_to_rebuild_the_lru_index(make_tier, raw, bucket):
    size = PAGE
    obj = HEADER_BYTES + size
    first = await make_tier(prefix="p/", capacity_bytes=10 * obj)
    oldest = new_chunk()
    await stored(first, oldest, size, split=(1,))
    await asyncio.sleep(1.1)  # moto's LastModified has whole seconds
    newer = [new_chunk() for _ in range(2)]
    for chunk in newer:
        await stored(first, chunk, size, split=(1,))
    await first.close()
    await raw.put_object(Bucket=bucket, Key="p/notes.txt", Body=b"not a chunk")
    await raw.put_object(Bucket=bucket, Key="elsewhere/" + chunkfile.chunk_relpath(new_chunk()), Body=b"x")

    second = await make_tier(prefix="p/", capacity_bytes=3 * obj)
    assert second.usage() == TierUsage(3 * obj, 3 * obj, 3)
    before = second.requests
    assert await second.contains([oldest, *newer]) == [True, True, True]
    assert second.requests == before  # answered from the index
    await stored(second, new_chunk(), size, split=(1,))  # the oldest object makes room
    assert not await exists(raw, bucket, "p/" + chunkfile.chunk_relpath(oldest))
    assert all([await exists(raw, bucket, "p/" + chunkfile.chunk_relpath(x)) for x in newer])

    third = await make_tier(prefix="p/", capacity_bytes=2 * obj)  # over capacity at start: shrinks
    assert third.usage() == TierUsage(2 * obj, 2 * obj, 2)
    assert third.counters.evictions == 1


async def test_a_chunk_written_again_while_its_eviction_starts_survives_it(make_tier, raw, bucket):
    """Writing b evicts a; a is written again at once. The new copy of a must wait for a's DELETE,
    not be removed by it (the index would then claim an object that is gone)."""
    size = PAGE
    tier = await make_tier(capacity_bytes=2 * HEADER_BYTES + 4 * size)
    a, b, c = (new_chunk() for _ in range(3))
    await stored(tier, a, 3 * size, split=(3,))
    await stored(tier, c, size, split=(1,))
    # b evicts a, which frees room for the smaller new copy of a without evicting anything
    data = os.urandom(size)
    pages = Pages([1])
    pages.fill(data)
    outcomes = await asyncio.gather(stored(tier, b, size, split=(1,)), tier.write(a, pages.views, size))
    assert outcomes[1] is WriteOutcome.WRITTEN
    assert await exists(raw, bucket, chunkfile.chunk_relpath(a))
    dst = Pages([1])
    assert await tier.read(a, dst.views, size) and dst.bytes(size) == data


async def test_second_eviction_admission(make_tier):
    tier = await make_tier(admission=AdmissionPolicy.SECOND_EVICTION)
    chunk = new_chunk()
    pages = Pages([1])
    assert await tier.write(chunk, pages.views, PAGE) is WriteOutcome.REJECTED_ADMISSION
    assert await tier.write(chunk, pages.views, PAGE) is WriteOutcome.WRITTEN


# -- bucket handling --------------------------------------------------------------------------


async def test_start_creates_the_bucket_or_refuses_a_missing_one(make_tier, raw, bucket):
    with pytest.raises(S3TierError, match="NoSuchBucket|404|Not Found"):
        await make_tier(create_bucket=False)
    tier = await make_tier()
    await raw.head_bucket(Bucket=bucket)
    await stored(tier, new_chunk())
    keys = [o["Key"] for o in (await raw.list_objects_v2(Bucket=bucket)).get("Contents", [])]
    assert len(keys) == 1 and keys[0].endswith(".kv")  # the warm-up object is gone


# -- retries and the circuit breaker ---------------------------------------------------------------


@pytest.mark.parametrize("status,code", [(503, "SlowDown"), (500, "InternalError"), (400, "RequestTimeout")])
async def test_throttling_and_5xx_are_retried(make_tier, moto, status, code):
    async with FaultProxy(moto.url, status=status, code=code) as proxy:
        tier = await make_tier(endpoint_url=proxy.url)
        chunk = new_chunk()
        proxy.fail_next = 2
        seen = proxy.seen
        data = await stored(tier, chunk)
        assert (proxy.seen - seen, proxy.failed) == (3, 2)
        proxy.fail_next = 3
        dst = Pages([3])
        assert await tier.read(chunk, dst.views, len(data))
        assert dst.bytes(len(data)) == data
        assert tier.counters.errors == 0


async def test_retries_are_bounded(make_tier, moto):
    async with FaultProxy(moto.url) as proxy:
        tier = await make_tier(endpoint_url=proxy.url)
        proxy.fail_next = 100
        seen = proxy.seen
        pages = Pages([1])
        assert await tier.write(new_chunk(), pages.views, PAGE) is WriteOutcome.FAILED
        assert proxy.seen - seen == FAST_BACKOFF.attempts
        assert tier.counters.errors == 1 and tier.available  # one failure does not open the breaker


async def test_client_errors_are_not_retried(make_tier, moto):
    async with FaultProxy(moto.url, status=403, code="AccessDenied") as proxy:
        tier = await make_tier(endpoint_url=proxy.url, breaker_failures=1)
        proxy.fail_next = 1
        seen = proxy.seen
        pages = Pages([1])
        assert await tier.write(new_chunk(), pages.views, PAGE) is WriteOutcome.FAILED
        assert proxy.seen - seen == 1
        assert tier.available  # the endpoint answered: the breaker stays closed


async def test_dead_endpoint_opens_the_breaker_until_it_comes_back(make_tier):
    port = free_port()  # nothing listens here
    tier = await make_tier(endpoint_url=f"http://127.0.0.1:{port}", breaker_failures=3, breaker_reset_s=0.3)
    assert not tier.available  # start() could not reach it: open at once, start() did not raise
    sent = tier.requests
    assert sent >= 1
    chunks = [new_chunk() for _ in range(10)]
    pages = Pages([1])
    assert await tier.contains(chunks) == [False] * 10
    assert await tier.write(chunks[0], pages.views, PAGE) is WriteOutcome.FAILED
    assert not await tier.read(chunks[0], pages.views, PAGE)
    assert tier.requests == sent  # no network while open
    assert tier.skipped == 3

    with MotoServer(port=port):
        while not tier.available:  # breaker_reset_s passes
            await asyncio.sleep(0.05)
        data = os.urandom(PAGE)
        pages.fill(data)
        assert await tier.write(chunks[0], pages.views, PAGE) is WriteOutcome.WRITTEN  # probe: bucket made
        dst = Pages([1])
        assert await tier.read(chunks[0], dst.views, PAGE) and dst.bytes(PAGE) == data
        assert await tier.contains(chunks[:2]) == [True, False]
        assert tier.available


async def test_black_hole_costs_one_timeout_per_batch_then_nothing(make_tier, moto):
    async with FaultProxy(moto.url) as proxy:
        tier = await make_tier(endpoint_url=proxy.url, timeout_s=0.5, breaker_failures=3, breaker_reset_s=60)
        proxy.hang = True
        seen = proxy.seen
        assert await tier.contains([new_chunk() for _ in range(8)]) == [False] * 8
        attempts = proxy.seen - seen
        # at most one attempt each: the timeout spent the whole deadline (under load some never
        # reach the proxy before it passes)
        assert 1 <= attempts <= 8
        assert not tier.available
        pages = Pages([1])
        assert await tier.contains([new_chunk()]) == [False]
        assert await tier.write(new_chunk(), pages.views, PAGE) is WriteOutcome.FAILED
        assert not await tier.read(new_chunk(), pages.views, PAGE)
        assert proxy.seen - seen == attempts  # the breaker is open: nothing reaches S3


async def test_black_hole_at_start_is_not_fatal(make_tier):
    hung: list[asyncio.StreamWriter] = []

    async def never_answer(reader, writer):
        hung.append(writer)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        tier = await make_tier(endpoint_url=f"http://127.0.0.1:{port}", timeout_s=0.3)
        assert not tier.available and tier.requests == 1
        assert await tier.contains([new_chunk()]) == [False] and tier.requests == 1
    finally:
        for writer in hung:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_endpoint_dying_later_costs_breaker_failures_calls_then_none(make_tier):
    server = MotoServer()
    endpoint = server.start()
    try:
        tier = await make_tier(endpoint_url=endpoint.url, breaker_failures=3, breaker_reset_s=0.3)
        chunk = new_chunk()
        data = await stored(tier, chunk, PAGE, split=(1,))
        server.stop()
        dst = Pages([1])
        for _ in range(3):
            assert tier.available
            assert not await tier.read(chunk, dst.views, PAGE)
        assert not tier.available
        assert tier.holds([chunk]) == [False]  # a load could not bring it up: a store keeps it in RAM
        sent, errors = tier.requests, tier.counters.errors
        for _ in range(20):
            assert not await tier.read(chunk, dst.views, PAGE)
            assert await tier.contains([new_chunk()]) == [False]
        assert tier.requests == sent and tier.counters.errors == errors == 3

        server = MotoServer(port=server.port)  # a fresh server (moto forgets everything)
        server.start()
        while not tier.available:
            await asyncio.sleep(0.05)
        assert not await tier.read(chunk, dst.views, PAGE)  # the probe re-made the bucket; the object is gone
        assert await tier.write(chunk, _views_of(data), PAGE) is WriteOutcome.WRITTEN
        assert await tier.read(chunk, dst.views, PAGE) and dst.bytes(PAGE) == data
    finally:
        server.stop()


def _views_of(data: bytes) -> list[memoryview]:
    pages = Pages([-(-len(data) // PAGE)])
    pages.fill(data)
    return pages.views


async def test_closed_tier_fails_fast(make_tier):
    tier = await make_tier()
    await tier.close()
    pages = Pages([1])
    assert not tier.available
    assert await tier.write(new_chunk(), pages.views, PAGE) is WriteOutcome.FAILED
    assert await tier.contains([new_chunk()]) == [False]


# -- pure helpers ---------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_probes_once():
    clock = FakeClock()
    breaker = CircuitBreaker(3, 5.0, clock)
    for _ in range(2):
        breaker.record(breaker.allow(), False)
    breaker.record(breaker.allow(), True)  # a success resets the count
    permits = [breaker.allow() for _ in range(3)]
    for permit in permits:
        breaker.record(permit, False)
    assert breaker.state is BreakerState.OPEN and breaker.allow() is None and not breaker.would_allow()
    clock.now += 4.9
    assert breaker.allow() is None
    clock.now += 0.1
    assert breaker.state is BreakerState.HALF_OPEN and breaker.would_allow()
    probe = breaker.allow()
    assert probe is not None and probe.probe
    assert breaker.allow() is None  # one probe at a time
    breaker.record(probe, False)  # failed probe: open for another reset_s
    assert breaker.allow() is None
    clock.now += 5.0
    probe = breaker.allow()
    breaker.abandon(probe)  # cancelled probe: the next call probes at once
    probe = breaker.allow()
    breaker.record(permits[0], True)  # a late verdict of an old call changes nothing
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record(probe, True)
    assert breaker.state is BreakerState.CLOSED and breaker.times_opened == 1


def test_negative_cache_expires_and_stays_bounded():
    clock = FakeClock()
    cache = NegativeCache(1.0, max_entries=3, clock=clock)
    cache.add("a")
    clock.now += 0.5
    cache.add("b")
    assert "a" in cache and "b" in cache
    clock.now += 0.6
    assert "a" not in cache and "b" in cache
    cache.discard("b")
    assert "b" not in cache
    for key in "cdef":
        cache.add(key)
    assert len(cache) == 3 and "c" not in cache and "f" in cache
    off = NegativeCache(0.0, clock=clock)
    off.add("x")
    assert "x" not in off


def test_backoff_grows_and_is_capped():
    backoff = Backoff(attempts=5, base_s=0.1, cap_s=0.5)
    assert [backoff.delay(n, rng=lambda: 1.0) for n in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    assert backoff.delay(3, rng=lambda: 0.0) == 0.0


def test_object_names_parse_back_to_chunks():
    chunk = new_chunk()
    assert _parse_key(chunkfile.chunk_relpath(chunk)) == chunk
    for name in ("notes.txt", "_kvstored/warmup", "ns/ab/cd/abce00.kv", "ns/ab/cd/ABCD00.kv", "a/b/ns/ab/cd/abcd.kv"):
        assert _parse_key(name) is None


# -- namespace records and clearing a namespace -----------------------------------------------


async def test_namespace_records_live_under_the_prefix_and_are_not_chunks(make_tier, raw, bucket):
    tier = await make_tier(prefix="node-a/", capacity_bytes=1 << 30)
    ns_id = "0123456789abcdef0123456789abcdef"
    await tier.save_namespace_record(ns_id, b'{"format": 1}')
    assert await exists(raw, bucket, f"node-a/_kvstored/namespaces/{ns_id}.json")
    assert await tier.namespace_records() == {ns_id: b'{"format": 1}'}
    restarted = await make_tier(prefix="node-a/", capacity_bytes=1 << 30)  # lists the prefix at start
    assert restarted.usage().chunks == 0 and await restarted.namespace_records() == {ns_id: b'{"format": 1}'}
    await tier.remove_namespace_record(ns_id)
    assert await tier.namespace_records() == {}
    assert not await exists(raw, bucket, f"node-a/_kvstored/namespaces/{ns_id}.json")


async def test_namespace_chunks_lists_objects_an_unbounded_tier_never_saw(make_tier):
    writer = await make_tier()
    ns, other = "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"
    chunks = [new_chunk(ns) for _ in range(3)]
    for chunk in chunks + [new_chunk(other)]:
        await stored(writer, chunk)
    fresh = await make_tier()  # no capacity: no listing at start, an empty index
    assert fresh.known_chunks(ns) == []
    assert sorted(await fresh.namespace_chunks(ns)) == sorted(chunks)


async def test_namespace_records_of_an_unreachable_endpoint_raise_tier_unavailable(make_tier):
    tier = await make_tier(endpoint_url=f"http://127.0.0.1:{free_port()}", timeout_s=0.5, breaker_failures=1)
    with pytest.raises(TierUnavailable, match="cannot list"):
        await tier.namespace_records()
    with pytest.raises(TierUnavailable, match="cannot list"):
        await tier.namespace_chunks("0123456789abcdef0123456789abcdef")


# -- preflight (before the daemon populates its RAM tier) -----------------------------------


async def test_preflight_checks_the_bucket_once_for_the_start(make_tier, raw, bucket):
    tier = await make_tier(start=False)
    said = await tier.preflight()
    assert said.endswith(": credentials and bucket checked") and f"bucket {bucket!r}" in said
    await raw.head_bucket(Bucket=bucket)  # created by the preflight (create_bucket)
    sent = tier.requests
    await tier.start()
    assert tier.requests == sent  # no capacity: nothing to list, the bucket is not asked again
    chunk = new_chunk()
    data = await stored(tier, chunk)
    pages = Pages([3])
    assert await tier.read(chunk, pages.views, len(data)) and pages.bytes(len(data)) == data


async def test_preflight_refuses_a_missing_bucket_it_may_not_create(make_tier):
    tier = await make_tier(start=False, create_bucket=False)
    with pytest.raises(S3TierError, match=r"is not usable: rejected: NoSuchBucket"):
        await tier.preflight()


async def test_preflight_of_an_endpoint_that_does_not_answer_lets_the_tier_start_without_it(make_tier):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens: refused
    tier = await make_tier(start=False, endpoint_url=f"http://127.0.0.1:{port}", timeout_s=1.0)
    said = await tier.preflight()
    assert "unreachable" in said and "starting without it, probed every" in said
    await tier.start()  # returns at once: the breaker probes later
    assert not tier.available
