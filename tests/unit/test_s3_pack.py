# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Packed S3 tier: the pack format and index (pure), and the tier against moto_server.

Damage is done to real objects through a raw client; assertions count requests and check bytes,
never time anything (waits for a poll are bounded loops on an outcome).
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
from botocore.exceptions import ClientError

from kvstored.chunks import chunkfile, packfile
from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored.chunks.ids import RemovalCause
from kvstored.chunks.packfile import PACKS_DIR, CorruptPack, NeedTail, PackEntry, UnsupportedPack
from kvstored.errors import TierUnavailable
from kvstored.tiers import s3, s3pack
from kvstored.tiers.base import WriteOutcome
from kvstored.tiers.packindex import PackIndex
from kvstored.tiers.resilience import Backoff
from kvstored.tiers.s3 import S3Tier
from kvstored.tiers.s3pack import PackedS3Tier
from tests.support.ports import free_port
from tests.support.s3 import MotoServer

PAGE = 4096
SIZE = 3 * PAGE - 100  # payload bytes of the test chunks (a record is HEADER_BYTES + SIZE)
RECORD = HEADER_BYTES + SIZE
FAST_BACKOFF = Backoff(attempts=3, base_s=0.005, cap_s=0.02)


# -- the format and the index (pure) --------------------------------------------------------


def entry(i: int, offset: int, size: int = 100) -> PackEntry:
    return PackEntry(("ns", bytes([i]) * 16), offset, size, 1000 + i)


def test_index_round_trips_and_names_sort_by_time():
    entries = [entry(0, 0), entry(1, HEADER_BYTES + 100, 7)]
    records_end = 2 * HEADER_BYTES + 107
    tail = packfile.encode_index(entries, records_end)
    assert packfile.decode_index(tail, records_end + len(tail)) == entries
    # from a longer tail (the records' last bytes in front of it) as well
    assert packfile.decode_index(b"x" * 50 + tail, records_end + len(tail)) == entries
    # a tail that starts inside the index asks for the whole of it
    assert packfile.decode_index(tail[-packfile.TRAILER_BYTES :], records_end + len(tail)) == NeedTail(len(tail))
    old, new = packfile.pack_name(1_000, 7, 1), packfile.pack_name(2_000, 3, 9)
    assert old < packfile.time_marker(1_500) < new
    assert packfile.parse_pack_name(new) == 2_000
    assert packfile.parse_pack_name("nope.kvp") is None
    assert chunkfile.parse_relpath(f"{PACKS_DIR}/{new}") is None  # never taken for a chunk


@pytest.mark.parametrize(
    "damage",
    ["flip_trailer", "flip_index", "wrong_length", "overlap", "truncated", "version"],
)
def test_damaged_indexes_are_refused(damage):
    entries = [entry(0, 0), entry(1, HEADER_BYTES + 100)]
    records_end = 2 * (HEADER_BYTES + 100)
    if damage == "overlap":
        entries[1] = entry(1, 50)
    tail = bytearray(packfile.encode_index(entries, records_end))
    size = records_end + len(tail)
    if damage == "flip_trailer":
        tail[-10] ^= 1
    elif damage == "flip_index":
        tail[5] ^= 1
    elif damage == "wrong_length":
        size += 1
    elif damage == "truncated":
        tail = tail[:-3]
    elif damage == "version":
        tail = bytearray(_with_version(bytes(tail), 99))
    with pytest.raises(UnsupportedPack if damage == "version" else CorruptPack):
        packfile.decode_index(bytes(tail), size)


def _with_version(tail: bytes, version: int) -> bytes:
    import struct
    import zlib

    fixed = struct.Struct("<8sHHIIIQ")
    start = len(tail) - packfile.TRAILER_BYTES
    fields = list(fixed.unpack_from(tail, start))
    fields[1] = version
    trailer = fixed.pack(*fields)
    return tail[:start] + trailer + struct.pack("<I", zlib.crc32(trailer))


def test_pack_index_live_fraction_expiry_and_newest_copy_wins():
    index = PackIndex()
    a = [entry(i, i * (HEADER_BYTES + 100)) for i in range(4)]
    assert index.add("p1", 10 * HEADER_BYTES, 1, a) == [e.chunk for e in a]
    b = [entry(3, 0), entry(9, HEADER_BYTES + 100)]  # chunk 3 again: the newer p2 serves it now
    assert index.add("p2", 5 * HEADER_BYTES, 2, b) == [b[0].chunk, b[1].chunk]
    assert index.find(a[3].chunk)[0].key == "p2"
    old = [entry(9, 0)]  # an older copy indexed later (a listing's order): p2 keeps serving it
    assert index.add("p0", HEADER_BYTES, 0, old) == []
    assert index.find(old[0].chunk)[0].key == "p2" and index.drop_pack("p0") is not None
    assert index.used_bytes == 15 * HEADER_BYTES
    p1 = index.pack("p1")
    assert p1.live_fraction == pytest.approx(3 * (HEADER_BYTES + 100) / (10 * HEADER_BYTES))
    assert index.drop_chunk(a[0].chunk) is None
    assert p1.live_fraction == pytest.approx(2 * (HEADER_BYTES + 100) / (10 * HEADER_BYTES))
    index.drop_chunk(a[1].chunk)
    assert index.drop_chunk(a[2].chunk) is p1  # no live chunk left: the caller deletes it
    # expiry takes whole packs, oldest first, with their chunks
    index.add("p0", HEADER_BYTES, 0, [entry(7, 0)])
    victims = index.expire(index.used_bytes - 1)
    assert [p.key for p in victims] == ["p0"]
    assert entry(7, 0).chunk not in index
    assert [p.key for p in index.expire(0)] == ["p1", "p2"] and len(index) == 0 and index.used_bytes == 0


def test_pack_index_keeps_every_copy_of_a_chunk_for_its_delete():
    index = PackIndex()
    x, y = entry(1, 0), entry(2, HEADER_BYTES + 100)
    index.add("pb", 1000, 2, [x])  # two daemons packed x
    index.add("pa", 1000, 1, [x, y])
    assert [p.key for p in index.copies(x.chunk)] == ["pb", "pa"] and index.find(x.chunk)[0].key == "pb"
    assert index.drop_copy(x.chunk, "pa") is None  # a deletion naming pa: pb still serves x
    assert index.find(x.chunk)[0].key == "pb" and [p.key for p in index.copies(x.chunk)] == ["pb"]
    index.add("pc", 1000, 0, [x])
    assert index.drop_chunk(x.chunk) is index.pack("pb")  # a delete here: every copy goes
    assert index.copies(x.chunk) == [] and x.chunk not in index
    assert index.drop_pack("pc").spare == {} and index.copies(y.chunk) == [index.pack("pa")]


def test_expiry_passes_no_pack_still_in_flight_and_the_live_summary_counts_each_pack():
    index = PackIndex()
    index.add("p2", 100, 2, [entry(0, 0, 50), entry(1, 60, 40)])  # landed before p1 (in flight)
    assert index.expire(0, before_ms=1) == []  # p1 is older: it goes first, once it lands
    index.add("p1", 100, 1, [entry(2, 0, 90)])
    assert [p.key for p in index.expire(150, before_ms=3)] == ["p1"]
    index.drop_chunk(entry(0, 0).chunk)
    live, bands = index.live_summary(4)
    assert live == HEADER_BYTES + 40 and bands == [0, 0, 0, 1]  # (records of HEADER_BYTES + size: > 100)
    index.add("p3", 4 * (HEADER_BYTES + 40), 3, [entry(5, 0, 40)])
    assert index.live_summary(4) == (2 * (HEADER_BYTES + 40), [0, 1, 0, 1])


def test_a_pack_stream_reads_its_parts_back_to_back_from_any_position():
    parts = [b"a" * 5, b"", b"bc" * 3, b"xyz"]
    whole = b"".join(parts)
    stream = s3.PartsStream(parts)
    assert stream.seek(0, os.SEEK_END) == len(whole) and stream.tell() == len(whole) and stream.read(4) == b""
    stream.seek(0)
    got = []
    while chunk := stream.read(4):  # pieces across part boundaries
        got.append(chunk)
    assert b"".join(got) == whole and max(map(len, got)) == 4
    stream.seek(3)
    assert stream.read() == whole[3:]
    buffer = bytearray(6)
    stream.seek(len(whole) - 4)
    assert stream.readinto(buffer) == 4 and buffer[:4] == whole[-4:]


# -- the tier against moto ------------------------------------------------------------------


@pytest.fixture
def make_tier(s3_tiers):
    async def make(cls=PackedS3Tier, start: bool = True, **kwargs) -> S3Tier:
        options = {"backoff": FAST_BACKOFF, **kwargs}
        if cls is PackedS3Tier:
            options = {"pack_bytes": 4 * RECORD, "pack_age_s": 30.0, "pack_poll_s": 0, **options}
        return await s3_tiers(cls, start, **options)

    return make


class Slot:
    def __init__(self, size: int = SIZE) -> None:
        import mmap

        self.mm = mmap.mmap(-1, -(-size // PAGE) * PAGE)
        self.views = [memoryview(self.mm)]
        self.size = size

    def bytes(self) -> bytes:
        return self.mm[: self.size]


def chunk_of(i: int):
    return ("0123456789abcdef0123456789abcdef", uuid.uuid4().bytes + bytes([i]))


async def write(tier, chunk, size: int = SIZE) -> bytes:
    data = os.urandom(size)
    slot = Slot(size)
    slot.mm[:size] = data
    assert await tier.write(chunk, slot.views, size) is WriteOutcome.WRITTEN
    return data


async def read(tier, chunk, size: int = SIZE) -> bytes | None:
    slot = Slot(size)
    return slot.bytes() if await tier.read(chunk, slot.views, size) else None


async def pack_keys(raw, bucket) -> list[tuple[str, int]]:
    page = await raw.list_objects_v2(Bucket=bucket, Prefix=f"kv/{PACKS_DIR}/")
    return [(o["Key"], int(o["Size"])) for o in page.get("Contents", ())]


async def one_pack(tier, raw, bucket, n: int) -> tuple[list, tuple[str, int]]:
    """Chunks 0..n-1 written and sent as one pack: the chunks, and the pack's (key, size)."""
    chunks = [chunk_of(i) for i in range(n)]
    for c in chunks:
        await write(tier, c)
    await tier.flush()
    ((key, size),) = await pack_keys(raw, bucket)
    return chunks, (key, size)


async def test_chunks_fill_packs_one_put_each_and_read_back_exact(make_tier, raw, bucket):
    tier = await make_tier(prefix="kv/")
    chunks = [chunk_of(i) for i in range(10)]
    before = tier.requests
    data = {c: await write(tier, c) for c in chunks}
    assert await read(tier, chunks[9]) == data[chunks[9]]  # still in memory: served from there
    await tier.flush()
    # 10 records of which 4 fit a pack: 3 packs, one PUT each, no other request
    assert tier.requests - before == 3 and tier.packs_written == 3
    keys = await pack_keys(raw, bucket)
    assert len(keys) == 3 and all(size > 0 for _k, size in keys)
    assert await tier.contains(chunks) == [True] * 10
    requests = tier.requests
    for c in chunks:
        assert await read(tier, c) == data[c]
    assert tier.requests - requests == 10  # one ranged GET per chunk
    assert await tier.write(chunks[0], Slot().views, SIZE) is WriteOutcome.ALREADY_PRESENT
    assert tier.usage().chunks == 10 and tier.usage().used_bytes == sum(size for _k, size in keys)

    # a daemon started later rebuilds the index from the packs' own indexes: same chunks, same bytes
    other = await make_tier(prefix="kv/")
    assert await other.contains([*chunks, chunk_of(99)]) == [True] * 10 + [False]
    assert await read(other, chunks[4]) == data[chunks[4]]


async def until(check, polls: int = 400) -> None:
    for _ in range(polls):  # a bounded wait on an outcome, never a time threshold
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("never happened")


async def test_a_running_daemon_learns_new_packs_from_the_writers_manifest(make_tier, raw, bucket, monkeypatch):
    # A long timeout_s puts the orphan age (3 polls + timeout_s) past the test: on a loaded machine
    # the reader must still learn the packs from the manifest, not from the orphan reads.
    reader = await make_tier(prefix="kv/", pack_poll_s=0.05, timeout_s=60.0)
    footer_reads = []
    read_index = reader._read_index

    async def counted(key, size, send):
        footer_reads.append(key)
        return await read_index(key, size, send)

    reader._read_index = counted
    writer = await make_tier(prefix="kv/", pack_poll_s=0.05)
    chunks = [chunk_of(i) for i in range(6)]
    data = {c: await write(writer, c) for c in chunks}
    assert await reader.contains(chunks) == [False] * 6
    await writer.flush()

    async def all_found():
        return await reader.contains(chunks) == [True] * 6

    await until(all_found)
    assert await read(reader, chunks[5]) == data[chunks[5]]
    assert reader.packs_found == 2 and reader.manifests_read >= 1 and footer_reads == []
    assert writer.manifests_written >= 1
    monkeypatch.setattr(s3pack, "MANIFEST_TTL_MS", 0)  # the writer deletes its manifests at its next poll
    listing = lambda: raw.list_objects_v2(Bucket=bucket, Prefix=f"kv/{packfile.MANIFESTS_DIR}/")  # noqa: E731

    async def pruned():
        return (await listing()).get("KeyCount", 0) == 0

    await until(pruned)


async def test_a_running_daemon_stops_serving_a_chunk_another_deleted_after_one_poll(make_tier, raw, bucket):
    reader = await make_tier(prefix="kv/", pack_poll_s=0.05)
    writer = await make_tier(prefix="kv/", pack_poll_s=0.05)
    removed = []
    reader.removal_listener = lambda _t, chunk, cause: removed.append((chunk, cause))
    chunks = [chunk_of(i) for i in range(3)]
    data = {c: await write(writer, c) for c in chunks}
    await writer.flush()
    ((key, size),) = await pack_keys(raw, bucket)

    async def all_found():
        return await reader.contains(chunks) == [True] * 3

    await until(all_found)
    assert await read(reader, chunks[0]) == data[chunks[0]]
    # nothing written or deleted since: the writer's polls PUT no manifest
    written, polls = writer.manifests_written, reader.manifests_read
    for _ in range(5):  # a few polls
        await asyncio.sleep(0.05)
    assert writer.manifests_written == written
    assert await writer.remove(chunks[0])

    async def gone():
        return await reader.contains(chunks) == [False, True, True]

    await until(gone)
    assert reader.manifests_read > polls and removed == [(chunks[0], RemovalCause.DELETED)]
    requests = reader.requests
    assert await read(reader, chunks[0]) is None and reader.requests == requests  # no GET for it
    assert await read(reader, chunks[1]) == data[chunks[1]]
    assert reader.live_fraction(key) == pytest.approx(2 * RECORD / size) == writer.live_fraction(key)
    # each daemon deletes one of the two left: both see the pack emptied, and it is deleted
    assert await writer.remove(chunks[1]) and await reader.remove(chunks[2])

    async def pack_deleted():
        return await pack_keys(raw, bucket) == [] and reader.live_fraction(key) is writer.live_fraction(key) is None

    await until(pack_deleted)
    assert await reader.contains(chunks) == await writer.contains(chunks) == [False] * 3


async def test_a_chunk_deleted_while_its_pack_is_sent_stays_deleted_everywhere(make_tier, raw, bucket):
    reader = await make_tier(prefix="kv/", pack_poll_s=0.05)
    writer = await make_tier(prefix="kv/", pack_poll_s=0.05)
    kept, deleted = chunk_of(0), chunk_of(1)
    data = await write(writer, kept)
    await write(writer, deleted)
    writer._seal()  # the pack's PUT is under way (its records are in the object)
    assert await writer.remove(deleted)
    await writer.flush()
    assert await writer.contains([kept, deleted]) == [True, False]

    async def found():
        return (await reader.contains([kept]))[0]

    await until(found)
    assert await reader.contains([deleted]) == [False]
    assert await read(reader, kept) == data
    restarted = await make_tier(prefix="kv/")  # its tombstone keeps a rebuild from serving it
    assert await restarted.contains([kept, deleted]) == [True, False]


async def test_packs_no_manifest_announced_are_read_from_their_own_end(make_tier):
    reader = await make_tier(prefix="kv/", pack_poll_s=0.05, timeout_s=1.0)
    writer = await make_tier(prefix="kv/")  # pack_poll_s = 0: it never announces its packs
    chunk = chunk_of(0)
    data = await write(writer, chunk)
    await writer.flush()

    async def found():
        return (await reader.contains([chunk]))[0]

    await until(found)
    assert await read(reader, chunk) == data
    assert reader.packs_found == 1 and reader.manifests_read == 0


def test_manifests_round_trip_and_refuse_damage():
    entries = [entry(0, 0), entry(1, HEADER_BYTES + 100)]
    records_end = 2 * (HEADER_BYTES + 100)
    index = packfile.encode_index(entries, records_end)
    name = packfile.pack_name(5_000, 1, 2)
    deleted = [(name, [("ns", b"k1"), ("other", bytes(32))])]
    body = packfile.encode_manifest([(name, records_end + len(index), 5_000, index)], deleted)
    manifest = packfile.decode_manifest(body)
    (announced,) = manifest.packs
    assert manifest.deleted == deleted
    assert (announced.name, announced.size, announced.created_ms, announced.entries) == (
        name,
        records_end + len(index),
        5_000,
        entries,
    )
    assert packfile.writer_of(packfile.pack_name(1, 0xABC, 3, packfile.MANIFEST_SUFFIX)) == 0xABC
    for damaged in (body[:-1], body[:10] + bytes([body[10] ^ 1]) + body[11:]):
        with pytest.raises(CorruptPack):
            packfile.decode_manifest(damaged)
    assert packfile.decode_manifest(packfile.encode_manifest([], deleted)).deleted == deleted  # deletes only


async def test_an_open_pack_is_sent_once_it_is_pack_age_s_old(make_tier):
    tier = await make_tier(prefix="kv/", pack_age_s=0.05)
    await write(tier, chunk_of(0))
    for _ in range(400):
        if tier.packs_written:
            break
        await asyncio.sleep(0.05)
    assert tier.packs_written == 1


async def overwrite(raw, bucket, key: str, body: bytes) -> None:
    await raw.put_object(Bucket=bucket, Key=key, Body=body)


async def get(raw, bucket, key: str) -> bytes:
    response = await raw.get_object(Bucket=bucket, Key=key)
    return await response["Body"].read()


async def test_a_corrupt_record_is_a_miss_and_leaves_the_index_the_others_still_serve(make_tier, raw, bucket):
    tier = await make_tier(prefix="kv/")
    chunks = [chunk_of(i) for i in range(3)]
    data = {c: await write(tier, c) for c in chunks}
    await tier.flush()
    removed = []
    tier.removal_listener = lambda _t, chunk, cause: removed.append((chunk, cause))
    ((key, _size),) = await pack_keys(raw, bucket)
    body = bytearray(await get(raw, bucket, key))
    body[RECORD + HEADER_BYTES + 10] ^= 0xFF  # in the second record's payload
    await overwrite(raw, bucket, key, bytes(body))
    assert await read(tier, chunks[1]) is None
    assert tier.counters.checksum_failures == 1 and removed == [(chunks[1], RemovalCause.CORRUPT)]
    assert await tier.contains(chunks) == [True, False, True]
    assert await read(tier, chunks[0]) == data[chunks[0]] and await read(tier, chunks[2]) == data[chunks[2]]
    assert tier.live_fraction(key) == pytest.approx(2 * RECORD / len(body))


async def test_a_truncated_pack_is_a_miss_dropped_whole_and_deleted(make_tier, raw, bucket):
    tier = await make_tier(prefix="kv/")
    chunks, (key, size) = await one_pack(tier, raw, bucket, 2)
    await overwrite(raw, bucket, key, (await get(raw, bucket, key))[: RECORD + 100])
    assert await read(tier, chunks[1]) is None
    assert await tier.contains(chunks) == [False, False]
    await tier.flush()  # the deletion is tracked like an upload
    assert await pack_keys(raw, bucket) == []
    assert tier.packs_dropped == 1


async def test_a_pack_with_a_damaged_index_is_deleted_at_start(make_tier, raw, bucket):
    writer = await make_tier(prefix="kv/")
    chunk = chunk_of(0)
    await write(writer, chunk)
    await writer.flush()
    ((key, _size),) = await pack_keys(raw, bucket)
    body = bytearray(await get(raw, bucket, key))
    body[-20] ^= 1
    await overwrite(raw, bucket, key, bytes(body))
    other = await make_tier(prefix="kv/")
    assert await other.contains([chunk]) == [False]
    assert other.counters.checksum_failures == 1 and await pack_keys(raw, bucket) == []


async def test_a_pack_deleted_under_a_reader_is_a_miss_and_the_index_heals(make_tier, raw, bucket):
    tier = await make_tier(prefix="kv/")
    chunks, (key, _size) = await one_pack(tier, raw, bucket, 2)
    await raw.delete_object(Bucket=bucket, Key=key)
    assert await read(tier, chunks[0]) is None
    assert await tier.contains(chunks) == [False, False]
    requests = tier.requests
    assert await read(tier, chunks[1]) is None and tier.requests == requests  # known gone: no request


async def test_capacity_expires_whole_packs_oldest_first(make_tier, raw, bucket):
    pack_object = 4 * RECORD + 4 * 100  # 4 records and their index (well under 400 bytes)
    tier = await make_tier(prefix="kv/", capacity_bytes=2 * pack_object + RECORD)
    removed = []
    tier.removal_listener = lambda _t, chunk, cause: removed.append((chunk, cause))
    chunks = [chunk_of(i) for i in range(12)]
    for c in chunks:
        await write(tier, c)
        await asyncio.sleep(0.002)  # (pack names carry milliseconds: keep them ordered)
    await tier.flush()
    assert tier.packs_expired == 1 and tier.counters.evictions == 4
    assert [c for c, _cause in removed] == chunks[:4]
    assert await tier.contains(chunks) == [False] * 4 + [True] * 8
    assert len(await pack_keys(raw, bucket)) == 2
    assert tier.usage().used_bytes <= tier.capacity_bytes


async def test_removing_every_chunk_of_a_pack_deletes_it(make_tier, raw, bucket):
    tier = await make_tier(prefix="kv/")
    chunks = [chunk_of(i) for i in range(2)]
    for c in chunks:
        await write(tier, c)
    unsent = chunk_of(9)
    await write(tier, unsent)
    assert await tier.remove(unsent)  # still in memory: never part of the object
    await tier.flush()
    ((key, _size),) = await pack_keys(raw, bucket)
    assert await tier.remove(chunks[0])
    assert tier.live_fraction(key) == pytest.approx(RECORD / _size)
    assert await tier.remove(chunks[1])
    await tier.flush()
    assert await pack_keys(raw, bucket) == [] and tier.usage().chunks == 0


async def test_a_deleted_packed_chunk_stays_deleted_across_a_restart(make_tier, raw, bucket):
    tier = await make_tier(prefix="kv/")
    kept, deleted = chunk_of(0), chunk_of(1)
    data = await write(tier, kept)
    await write(tier, deleted)
    await tier.flush()
    assert await tier.remove(deleted) and await tier.contains([kept, deleted]) == [True, False]
    restarted = await make_tier(prefix="kv/")  # the record is still in the pack: its tombstone counts
    assert await restarted.contains([kept, deleted]) == [True, False]
    assert await read(restarted, kept) == data
    # once the pack is gone, a start deletes its tombstones as well
    assert await restarted.remove(kept)
    await restarted.flush()
    await make_tier(prefix="kv/")
    listing = await raw.list_objects_v2(Bucket=bucket, Prefix=f"kv/{packfile.TOMBSTONES_DIR}/")
    assert listing.get("KeyCount", 0) == 0


async def test_a_delete_tombstones_every_copy_two_daemons_packed(make_tier, raw, bucket):
    a = await make_tier(prefix="kv/", pack_poll_s=0.05)
    b = await make_tier(prefix="kv/", pack_poll_s=0.05)
    chunk = chunk_of(0)
    await write(a, chunk)
    await write(b, chunk)  # before either sees the other's pack
    await a.flush()
    await b.flush()

    async def both_known():
        return a.pack_usage().packs == 2 and b.pack_usage().packs == 2

    await until(both_known)
    assert await a.remove(chunk)

    async def gone_on_b():
        return (await b.contains([chunk])) == [False]

    await until(gone_on_b)
    restarted = await make_tier(prefix="kv/")
    assert await restarted.contains([chunk]) == [False]


def fail_tombstones(tier, times: int = 1) -> None:
    """The next `times` tombstone PUTs of the tier are refused (403)."""
    real, left = tier._client.put_object, [times]

    async def put_object(**kwargs):
        if kwargs["Key"].startswith(f"kv/{packfile.TOMBSTONES_DIR}/") and left[0] > 0:
            left[0] -= 1
            error = {"Error": {"Code": "AccessDenied", "Message": "no"}, "ResponseMetadata": {"HTTPStatusCode": 403}}
            raise ClientError(error, "PutObject")
        return await real(**kwargs)

    tier._client.put_object = put_object


async def tombstone_keys(raw, bucket) -> list[str]:
    page = await raw.list_objects_v2(Bucket=bucket, Prefix=f"kv/{packfile.TOMBSTONES_DIR}/")
    return [o["Key"] for o in page.get("Contents", ())]


async def test_a_delete_whose_tombstone_failed_raises_until_it_is_stored(make_tier, raw, bucket):
    tier = await make_tier(prefix="kv/")
    kept, deleted = chunk_of(0), chunk_of(1)
    await write(tier, kept)
    await write(tier, deleted)
    await tier.flush()
    fail_tombstones(tier)
    with pytest.raises(TierUnavailable, match=f"cannot store tombstone kv/{packfile.TOMBSTONES_DIR}/"):
        await tier.remove(deleted)
    assert await tier.contains([deleted]) == [False] and await tombstone_keys(raw, bucket) == []
    assert await tier.remove(deleted)  # the client's retry stores it
    assert len(await tombstone_keys(raw, bucket)) == 1
    data = await write(tier, deleted)  # stored again, with other bytes
    await tier.flush()
    restarted = await make_tier(prefix="kv/")
    assert await restarted.contains([kept, deleted]) == [True, True]
    assert await read(restarted, deleted) == data


async def test_a_rebuild_serves_the_newest_copy_of_a_chunk_whose_tombstone_is_lost(make_tier, raw, bucket):
    tier = await make_tier(prefix="kv/")
    chunk = chunk_of(0)
    await write(tier, chunk)
    await write(tier, chunk_of(1))  # (the pack is not emptied by the delete)
    await tier.flush()
    assert await tier.remove(chunk)
    for key in await tombstone_keys(raw, bucket):
        await raw.delete_object(Bucket=bucket, Key=key)
    await asyncio.sleep(0.002)  # (pack names carry milliseconds: the new one sorts after)
    data = await write(tier, chunk)
    await tier.flush()
    assert len(await pack_keys(raw, bucket)) == 2
    restarted = await make_tier(prefix="kv/")
    assert await read(restarted, chunk) == data


async def test_a_delete_during_its_packs_upload_returns_once_the_tombstone_is_stored(make_tier, raw, bucket):
    tier = await make_tier(prefix="kv/")
    kept, deleted = chunk_of(0), chunk_of(1)
    await write(tier, kept)
    await write(tier, deleted)
    fail_tombstones(tier)
    tier._seal()  # the pack's PUT is under way (its records are in the object)
    with pytest.raises(TierUnavailable, match="cannot store tombstone"):
        await tier.remove(deleted)
    assert await tier.remove(deleted)
    assert len(await tombstone_keys(raw, bucket)) == 1  # before any flush: a crash now loses nothing
    restarted = await make_tier(prefix="kv/")
    assert await restarted.contains([kept, deleted]) == [True, False]


class _Scanned(dict):
    """A dict that counts the entries iterated over (in any way)."""

    def __init__(self) -> None:
        super().__init__()
        self.scanned = 0

    def _count(self, entries):
        for item in entries:
            self.scanned += 1
            yield item

    def __iter__(self):
        return self._count(super().__iter__())

    def keys(self):
        return self._count(super().keys())

    def values(self):
        return self._count(super().values())

    def items(self):
        return self._count(super().items())


async def test_deleting_many_packed_chunks_names_each_once_and_scans_no_owed_tombstones():
    # A namespace-sized delete (remove_all runs the removes at once): the work is counted, never
    # timed. No endpoint: a client that records the tombstone PUTs.
    tier = PackedS3Tier("s3", "bucket", pack_poll_s=0)
    packs, per_pack, namespace = 20, 8, "0123456789abcdef0123456789abcdef"
    chunks = []
    for p in range(packs):
        mine = [(namespace, bytes([p, i]) * 8) for i in range(per_pack)]
        kept = (namespace, bytes([p, 255]) * 8)  # (no pack empties: no DELETE of a pack)
        entries = [PackEntry(c, i * RECORD, SIZE, 0) for i, c in enumerate([*mine, kept])]
        tier._packs.add(tier._packs_prefix + packfile.pack_name(1000 + p, 7, p), 100 * RECORD, 1000 + p, entries)
        chunks += mine
    tombstones = []

    class Client:
        async def put_object(self, **kwargs):
            await asyncio.sleep(0)  # (the other removes run while a PUT is under way)
            tombstones.append((kwargs["Key"], packfile.decode_tombstone(kwargs["Body"])))

    async def call(request):
        return await request()

    tier._client, tier._call = Client(), call
    tier._owed = owed = _Scanned()
    assert await asyncio.gather(*(tier.remove(c) for c in chunks)) == [True] * len(chunks)
    named = [c for _key, names in tombstones for c in names]
    assert sorted(named) == sorted(chunks)  # each chunk in one tombstone: none carries another's again
    assert len(tombstones) == packs  # the removes of a pack joined one PUT
    assert owed.scanned == 0  # a remove finds what it owes by chunk: no pass over every pack owed
    assert tier._owed == {} and tier._owed_by == {}
    assert not any(c in tier._packs for c in chunks) and len(tier._packs) == packs


async def tombstones_stored(raw, bucket) -> list[list]:
    return [packfile.decode_tombstone(await get(raw, bucket, key)) for key in await tombstone_keys(raw, bucket)]


async def test_a_tombstone_names_its_callers_chunks_not_every_one_still_owed(make_tier, raw, bucket):
    tier = await make_tier(prefix="kv/")
    chunks, (key, _size) = await one_pack(tier, raw, bucket, 3)
    fail_tombstones(tier)
    with pytest.raises(TierUnavailable, match="cannot store tombstone"):
        await tier.remove(chunks[0])
    assert await tier.remove(chunks[1])  # chunks[0]'s tombstone is left to its own retry
    assert await tombstones_stored(raw, bucket) == [[chunks[1]]]
    assert tier._owed == {key: {chunks[0]}} and tier._owed_by == {chunks[0]: {key}}
    assert await tier.remove(chunks[0])
    assert sorted(map(tuple, await tombstones_stored(raw, bucket))) == sorted([(chunks[0],), (chunks[1],)])
    assert tier._owed == {} and tier._owed_by == {}
    restarted = await make_tier(prefix="kv/")
    assert await restarted.contains(chunks) == [False, False, True]


async def test_a_corrupt_copy_leaves_the_older_copies_for_a_delete_to_tombstone(make_tier, raw, bucket):
    a = await make_tier(prefix="kv/")
    b = await make_tier(prefix="kv/")  # started before a's pack is stored: packs the chunk again
    chunk = chunk_of(0)
    await write(a, chunk)
    await write(a, chunk_of(1))  # (the older pack is not emptied by the delete: it needs a tombstone)
    await a.flush()
    await asyncio.sleep(0.002)  # (pack names carry milliseconds: b's sorts after)
    await write(b, chunk)
    await b.flush()
    tier = await make_tier(prefix="kv/")  # indexes both copies; the newer one serves
    older, newer = sorted(key for key, _size in await pack_keys(raw, bucket))
    pack, record = tier._packs.find(chunk)
    assert pack.key == newer and [p.key for p in tier._packs.copies(chunk)] == [older, newer]
    body = bytearray(await get(raw, bucket, newer))
    body[record.offset + HEADER_BYTES + 10] ^= 0xFF
    await overwrite(raw, bucket, newer, bytes(body))
    assert await read(tier, chunk) is None and tier.counters.checksum_failures == 1
    assert [p.key for p in tier._packs.copies(chunk)] == [older]  # only the corrupt copy is forgotten
    assert await tier.remove(chunk)
    await tier.flush()
    assert await tombstones_stored(raw, bucket) == [[chunk]]  # the older copy's
    restarted = await make_tier(prefix="kv/")
    assert await restarted.contains([chunk]) == [False]


def test_a_200_is_the_range_asked_for_when_that_was_the_whole_object():
    whole = {"ResponseMetadata": {"HTTPStatusCode": 200}, "ContentLength": 500}
    s3.check_range(whole, 0, 500)  # bytes=0-499 of a 500-byte object: HTTP allows a 200
    for start, length in ((0, 400), (100, 400)):  # a part of the object: the Range was ignored
        with pytest.raises(s3.S3Failure, match="Range not honoured"):
            s3.check_range(whole, start, length)
    part = {"ResponseMetadata": {"HTTPStatusCode": 206}, "ContentRange": "bytes 100-199/500", "ContentLength": 100}
    s3.check_range(part, 100, 100)
    with pytest.raises(s3.S3Failure):
        s3.check_range(part, 0, 100)


async def test_a_small_packs_index_is_read_from_a_200_with_the_whole_object(make_tier, raw, bucket, monkeypatch):
    reader = await make_tier(prefix="kv/")
    writer = await make_tier(prefix="kv/")
    chunks = [chunk_of(i) for i in range(2)]
    data = [await write(writer, c) for c in chunks]
    await writer.flush()
    listing = await pack_keys(raw, bucket)
    assert listing[0][1] <= packfile.TAIL_BYTES  # its index is read with a Range of the whole object
    real = reader._client.get_object

    async def get_object(**kwargs):
        if kwargs.get("Range", "").startswith("bytes=0-"):  # a server answering it 200, whole
            kwargs.pop("Range")
        return await real(**kwargs)

    monkeypatch.setattr(reader._client, "get_object", get_object)
    await reader._adopt(listing, reader._call)
    assert await reader.contains(chunks) == [True, True] and reader._retry_index == {}
    assert reader.packs_dropped == 0 and reader.counters.errors == 0
    monkeypatch.setattr(reader._client, "get_object", real)
    assert [await read(reader, c) for c in chunks] == data


async def test_a_server_ignoring_range_fails_the_read_and_keeps_the_pack(make_tier, raw, bucket, monkeypatch):
    tier = await make_tier(prefix="kv/")
    chunks = [chunk_of(i) for i in range(4)]
    data = [await write(tier, c) for c in chunks]
    await tier.flush()
    real = tier._client.get_object

    async def get_object(**kwargs):
        kwargs.pop("Range", None)  # a proxy dropping the header: 200 and the whole object (HTTP allows it)
        return await real(**kwargs)

    monkeypatch.setattr(tier._client, "get_object", get_object)
    assert await read(tier, chunks[0]) is None
    await tier.flush()  # (a deletion would be a tracked task)
    assert len(await pack_keys(raw, bucket)) == 1 and tier.packs_dropped == 0
    assert tier.counters.errors == 1 and tier.counters.checksum_failures == 0
    monkeypatch.setattr(tier._client, "get_object", real)
    assert await tier.contains(chunks) == [True] * 4
    assert await read(tier, chunks[0]) == data[0]


def test_tombstones_round_trip_and_refuse_damage():
    chunks = [("ns", b"k1"), ("other", bytes(32))]
    body = packfile.encode_tombstone(chunks)
    assert packfile.decode_tombstone(body) == chunks
    with pytest.raises(CorruptPack):
        packfile.decode_tombstone(body[:-1])


async def test_one_object_chunks_already_in_the_bucket_are_still_served(make_tier):
    old = await make_tier(cls=S3Tier, prefix="kv/")
    chunk = chunk_of(0)
    data = await write(old, chunk)
    tier = await make_tier(prefix="kv/")
    assert await tier.contains([chunk]) == [True]
    assert await read(tier, chunk) == data
    assert await tier.write(chunk, Slot().views, SIZE) is WriteOutcome.ALREADY_PRESENT
    assert await tier.namespace_chunks(chunk[0]) == [chunk]
    assert await tier.remove(chunk) and await tier.contains([chunk]) == [False]


async def test_a_dead_endpoint_opens_the_breaker_and_writes_fail_fast(make_tier):
    port = free_port()  # nothing listens there
    tier = await make_tier(
        endpoint_url=f"http://127.0.0.1:{port}", timeout_s=0.5, breaker_failures=1, breaker_reset_s=60
    )
    assert not tier.available
    requests = tier.requests
    assert await tier.write(chunk_of(0), Slot().views, SIZE) is WriteOutcome.FAILED
    assert await tier.contains([chunk_of(1)]) == [False]
    assert tier.requests == requests


async def test_a_pack_that_cannot_be_stored_reports_its_chunks_removed(make_tier, bucket):
    moto2 = MotoServer()
    endpoint = moto2.start()
    try:
        tier = await make_tier(**endpoint.tier_kwargs(), timeout_s=1.0, breaker_failures=10)
        removed = []
        tier.removal_listener = lambda _t, chunk, cause: removed.append(chunk)
        chunk = chunk_of(0)
        await write(tier, chunk)
    finally:
        moto2.stop()
    await tier.flush()
    assert removed == [chunk] and tier.counters.errors == 1
    assert await tier.contains([chunk]) == [False]


# -- config ---------------------------------------------------------------------------------


def test_pack_options_go_through_the_one_config_and_are_range_checked():
    from kvstored.config import ConfigError, load_config
    from kvstored.tiers.config import TierContext
    from kvstored.tiers.registry import S3

    (cfg,) = load_config({"tiers": ["kind=s3,bucket=kv,pack_bytes=8MiB,pack_age_s=0.25,pack_uploads=2"]}, {}).tiers
    assert (cfg.pack_bytes, cfg.pack_age_s, cfg.pack_uploads, cfg.pack_poll_s) == (8 << 20, 0.25, 2, 2.0)
    assert type(S3.build(cfg, TierContext())) is PackedS3Tier
    (off,) = load_config({}, {"KVSTORED_TIERS": "kind=s3,bucket=kv,pack_bytes=0"}).tiers
    assert type(S3.build(off, TierContext())) is S3Tier
    for spec, named in (
        ("pack_bytes=512KiB", "pack_bytes"),
        ("pack_bytes=2GiB", "pack_bytes"),
        ("bytes=40MiB", "twice pack_bytes"),
        ("pack_uploads=0", "pack_uploads"),
        ("pack_poll_s=-1", "pack_poll_s"),
    ):
        with pytest.raises(ConfigError, match=named):
            load_config({"tiers": [f"kind=s3,bucket=kv,{spec}"]}, {})
