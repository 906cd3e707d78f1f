# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Block identities kept beyond the store: the record codec, the fs chunk header's identity area
(real files), what a restarted publisher makes of a tier's records, and the peer fetch reply's
identities (pure messages)."""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import pytest

from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored.chunks.ids import TierKind
from kvstored.events.bus import Cause, EventBus, EventType
from kvstored.events.identity import BlockIdentity, IdentityBook, decode_record, encode_record
from kvstored.events.zmq_publisher import ZmqEventPublisher, ZmqSettings
from kvstored.peer.messages import fetch_response, identities_of
from kvstored.peer.transport import Receipt, SendOutcome, SendResult
from kvstored.tiers.fs import identity_area
from kvstored.tiers.fs.tier import FsTier
from tests.unit.test_fs_tier import Slot, chunk, path_of
from tests.unit.test_zmq_events import NS_A, _key, _stored

FOOTER = struct.Struct("<4sHHII")


def _identity(i: int, parent: int | None = None, big_tokens: bool = False) -> BlockIdentity:
    base = (1 << 40) if big_tokens else 0
    return BlockIdentity.of([4 * i + b + 1 for b in range(4)], parent, [base + t for t in range(64)], 16, group_idx=i)


# -- the record -------------------------------------------------------------------------------


@pytest.mark.parametrize("identity", [_identity(1), _identity(2, parent=1 << 63), _identity(3, 7, big_tokens=True)])
def test_a_record_decodes_to_the_identity_it_was_made_of(identity):
    assert decode_record(encode_record(identity)) == identity


def test_a_record_that_is_not_whole_or_of_another_version_is_refused():
    raw = encode_record(_identity(1, parent=9))
    for bad, why in (
        (b"", "truncated"),
        (raw[:10], "truncated"),
        (raw[:-1], "head says"),
        (raw + b"\0", "head says"),
        (bytes([2]) + raw[1:], "version 2"),
        (raw[:1] + bytes([0x80]) + raw[2:], "unknown flags"),
        (raw[:1] + bytes([0]) + raw[2:], "no parent flag"),
    ):
        with pytest.raises(ValueError, match=why):
            decode_record(bad)
    blocks_off_by_one = bytearray(raw)
    struct.pack_into("<I", blocks_off_by_one, 10, 3)  # 3 blocks, 8 bytes less: the lengths disagree
    with pytest.raises(ValueError):
        decode_record(bytes(blocks_off_by_one[:-8]))


# -- the fs tier keeps it in the chunk file's header --------------------------------------------


async def _tier(root: Path, book: dict | None = None) -> FsTier:
    tier = FsTier("fs", root, 64 << 20, direct_io=False)
    if book is not None:
        tier.identity_of = book.get
    await tier.start()
    return tier


async def _read_back(tier: FsTier) -> dict:
    return {c: r async for batch in tier.identity_records() for c, r in batch}


async def test_a_restarted_fs_tier_reads_each_chunks_record_back(tmp_path):
    slot, size = Slot(), 3 * 4096 + 17
    records = {chunk(i): encode_record(_identity(i)) for i in (1, 2)}
    tier = await _tier(tmp_path, records)
    payloads = {}
    for i in (1, 2, 3):  # chunk 3: stored without an identity
        payloads[i] = slot.fill(size, i)
        assert (await tier.write(chunk(i), slot.views, size)).name == "WRITTEN"
    assert tier.identities_kept == 2
    await tier.close()

    tier = await _tier(tmp_path)
    try:
        found = await _read_back(tier)
        assert found == {chunk(1): records[chunk(1)], chunk(2): records[chunk(2)], chunk(3): None}
        for i in (1, 2, 3):  # and the chunks read as before
            assert await tier.read(chunk(i), slot.views, size) and slot.payload(size) == payloads[i]
    finally:
        await tier.close()


async def test_a_corrupt_or_odd_identity_area_is_doubtful_and_the_chunk_still_reads(tmp_path):
    slot, size = Slot(), 8192
    records = {chunk(i): encode_record(_identity(i)) for i in range(5)}
    tier = await _tier(tmp_path, records)
    payloads = {i: slot.fill(size, i) for i in range(5)}
    for i in range(5):
        slot.fill(size, i)
        await tier.write(chunk(i), slot.views, size)
    await tier.close()

    def patch(i: int, offset: int, data: bytes) -> None:
        with open(path_of(tmp_path, chunk(i)), "r+b") as fh:
            fh.seek(offset)
            fh.write(data)

    at = identity_area.FOOTER_AT
    patch(0, at - 1, b"\xff")  # a flipped byte of the record: its crc fails
    patch(1, at + 4, struct.pack("<H", 9))  # a footer of another version
    patch(2, at + 8, struct.pack("<I", HEADER_BYTES))  # a length running into the header
    patch(3, at, b"XXXX")  # no magic, but not zeros either
    assert FOOTER.size == HEADER_BYTES - at
    tier = await _tier(tmp_path)
    try:
        found = await _read_back(tier)
        assert found == {chunk(i): identity_area.DOUBTFUL for i in range(4)} | {chunk(4): records[chunk(4)]}
        for i in range(5):
            assert await tier.read(chunk(i), slot.views, size) and slot.payload(size) == payloads[i]
        assert tier.counters.checksum_failures == 0
    finally:
        await tier.close()


def test_the_area_is_doubtful_when_the_header_names_another_chunk_or_is_short():
    header = bytearray(chunkfile.encode_header(chunk(1), 10, 0))
    record = encode_record(_identity(1))
    identity_area.place(memoryview(header), record)
    assert identity_area.take(chunk(1), bytes(header)) == record
    assert identity_area.take(chunk(2), bytes(header)) == identity_area.DOUBTFUL
    assert identity_area.take(chunk(1), bytes(header[:100])) == identity_area.DOUBTFUL
    assert identity_area.take(chunk(1), chunkfile.encode_header(chunk(1), 10, 0)) is None


async def test_an_identity_too_big_for_the_header_is_not_kept(tmp_path):
    big = BlockIdentity.of(list(range(1, 65)), None, list(range(64 * 16)), 16)  # 1,024 tokens
    record = encode_record(big)
    assert len(record) > identity_area.room(chunk(1))
    slot = Slot()
    tier = await _tier(tmp_path, {chunk(1): record})
    slot.fill(4096, 1)
    await tier.write(chunk(1), slot.views, 4096)
    assert (tier.identities_kept, tier.identities_unfit) == (0, 1)
    await tier.close()
    tier = await _tier(tmp_path)
    try:
        assert await _read_back(tier) == {chunk(1): None}
    finally:
        await tier.close()


async def test_read_back_lists_only_chunks_still_indexed(tmp_path):
    records = {chunk(i): encode_record(_identity(i)) for i in range(3)}
    slot = Slot()
    tier = await _tier(tmp_path, records)
    for i in range(3):
        slot.fill(4096, i)
        await tier.write(chunk(i), slot.views, 4096)
    await tier.close()
    tier = await _tier(tmp_path)
    try:
        batches = tier.identity_records()
        assert await tier.remove(chunk(1))
        found = {c: r async for batch in batches for c, r in batch}
        assert set(found) == {chunk(0), chunk(2)}
    finally:
        await tier.close()


# -- the publisher after a restart ------------------------------------------------------------


async def test_a_restored_tier_is_published_and_doubtful_records_are_not():
    book = IdentityBook()
    publisher = ZmqEventPublisher(ZmqSettings("inproc://restored", topic="kv", interval_s=3600), book, lambda ns: "m")
    bus = EventBus()
    bus.add_listener(publisher)
    publisher.start()
    try:
        _stored(bus, "ram", TierKind.RAM, NS_A, 2)  # promoted before its record was read: unidentified
        publisher.flush()
        assert publisher.counts.unidentified == 1
        good, bad = encode_record(_identity(1)), encode_record(_identity(3))[:-1]
        publisher.restore(
            "fs",
            TierKind.FS,
            [
                ((NS_A, _key(1)), good),
                ((NS_A, _key(2)), encode_record(_identity(2))),
                ((NS_A, _key(3)), bad),
                ((NS_A, _key(4)), None),
                ((NS_A, _key(5)), identity_area.DOUBTFUL),
            ],
        )
        assert (publisher.counts.restored, publisher.counts.doubtful, publisher.counts.unrecorded) == (2, 2, 1)
        held = sorted(
            (e["block_hashes"][0], e["medium"])
            for _, payload in publisher.snapshot()
            for e in msgpack.unpackb(payload)[1]
            if e["type"] == "BlockStored"
        )
        assert held == [(5, "STORAGE"), (9, "CPU"), (9, "STORAGE")]  # key 2's RAM copy now known too
        # the next interval sends them as stored, and an eviction as removed
        sent = publisher.counts.batches
        publisher.flush()
        assert publisher.counts.batches == sent + 1
        bus.publish(EventType.REMOVED, Cause.EVICTED, "fs", TierKind.FS, [(NS_A, _key(1))])
        publisher.flush()
        assert book.get(NS_A, _key(1)) is None  # gone from every place: forgotten
    finally:
        await publisher.close()


def test_a_restored_tier_publishes_only_the_namespaces_routers_may_see():
    """With events_zmq_tenants off a tenant's live events are not published; neither is what the
    fs tier held of its namespaces before a restart (else routers learn its blocks, and its
    evictions, filtered, never take them back), nor of a namespace not known again."""
    public, tenant, unknown = NS_A, "t" * 32, "u" * 32
    known = {public: True, tenant: False}
    book = IdentityBook()
    publisher = ZmqEventPublisher(
        ZmqSettings("inproc://restored", topic="kv", interval_s=3600),
        book,
        lambda ns: "m",
        publishes=lambda ns: known.get(ns, False),
    )
    bus = EventBus()
    bus.add_listener(publisher)
    publisher.restore("fs", TierKind.FS, [((ns, _key(i)), encode_record(_identity(i))) for i, ns in enumerate(known)])
    publisher.restore("fs", TierKind.FS, [((unknown, _key(2)), encode_record(_identity(2)))])
    _stored(bus, "ram", TierKind.RAM, tenant, 3)  # (the live events, filtered the same way)
    assert (publisher.counts.restored, publisher.counts.withheld) == (1, 2)
    held = [
        e["block_hashes"][0]
        for _, payload in publisher.snapshot()
        for e in msgpack.unpackb(payload)[1]
        if e["type"] == "BlockStored"
    ]
    assert held == [1]
    assert not book.holds(tenant, _key(1)) and not book.holds(unknown, _key(2))


# -- the peer fetch reply ---------------------------------------------------------------------


def test_a_fetch_reply_carries_found_chunks_identities_and_a_malformed_one_is_left_out():
    keys = {10: b"k" * 32, 11: b"l" * 32, 12: b"m" * 32}
    known = {b"k" * 32: _identity(1, parent=5), b"m" * 32: _identity(2)}
    result = SendResult(
        SendOutcome.SENT,
        "",
        (Receipt(10, True, 4096, 1), Receipt(11, True, 4096, 2), Receipt(12, False, 0, 0)),
    )
    response = fetch_response(result, 1, keys, known.get)
    assert [r.HasField("identity") for r in response.receipts] == [True, False, False]  # not found: none
    assert identities_of(response, keys) == [(b"k" * 32, _identity(1, parent=5))]
    response.receipts[0].identity.token_ids.append(1)  # no longer block_size x blocks
    assert identities_of(response, keys) == []
    assert not any(r.HasField("identity") for r in fetch_response(result, 1).receipts)  # no book: none
