# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What the daemon and the client must agree on is defined once, or pinned together here."""

from __future__ import annotations

import enum

import numpy as np
import pytest

from kvstored import errors as daemon_errors
from kvstored.chunks import ids
from kvstored.events import bus as events
from kvstored.server import errors as server_errors
from kvstored.shm import copier as daemon_copier
from kvstored.tiers.ram import Extent
from kvstored_client import Tier, buffers, copy_policy, kinds
from kvstored_client import errors as client_errors
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb


@pytest.mark.parametrize(
    ("mirror", "proto_enum"),
    [
        (kinds.TierKind, pb.TierKind),
        (kinds.StoreOutcome, pb.StoreOutcome),
        (kinds.DropReason, pb.DropReason),
        (kinds.LoadInto, pb.LoadInto),
    ],
)
def test_wire_enums_have_exactly_the_proto_values(mirror, proto_enum):
    assert sorted(int(m) for m in mirror) == sorted(proto_enum.values())
    assert kinds.missing_members(mirror, proto_enum) == []


def test_a_proto_value_without_a_member_is_named():
    class Partial(enum.IntEnum):
        NONE = pb.TIER_KIND_UNSPECIFIED
        RAM = pb.TIER_KIND_RAM

    assert kinds.missing_members(Partial, pb.TierKind) == ["TIER_KIND_FS", "TIER_KIND_S3", "TIER_KIND_PEER"]


def test_daemon_and_client_share_one_tier_kind():
    assert ids.TierKind is kinds.TierKind and Tier is kinds.TierKind


@pytest.mark.parametrize(
    ("mirror", "proto_enum", "prefix"),
    [
        (events.EventType, pb.EventType, "EVENT_TYPE_"),
        (events.Cause, pb.EventCause, "EVENT_CAUSE_"),
    ],
)
def test_daemon_event_enums_match_the_proto(mirror, proto_enum, prefix):
    """Still hand-written in kvstored/events/bus.py (not the client's to change): pinned."""
    proto = {name.removeprefix(prefix): value for name, value in proto_enum.items() if value}
    assert {m.name: int(m) for m in mirror} == proto


def test_error_kinds_travel_under_one_key_and_name_daemon_errors():
    assert server_errors.ERROR_KIND_KEY is client_errors.ERROR_KIND_KEY
    for name in client_errors._BY_KIND:  # the daemon sends its error's class name; the client maps it back
        assert issubclass(getattr(daemon_errors, name), daemon_errors.KvstoredError), name


def test_daemon_and_client_split_copies_alike():
    assert daemon_copier.MIN_PART_BYTES == copy_policy.MIN_PART_BYTES
    assert daemon_copier.default_copy_threads is copy_policy.daemon_copy_threads
    client = buffers.ChunkCopier(4)
    view = np.zeros(1, dtype=np.uint8)
    for chunks, chunk_bytes in (
        (2, 1 << 20),
        (3, copy_policy.MIN_PART_BYTES),
        (8, copy_policy.MIN_PART_BYTES // 2),
        (16, 4 << 20),
    ):
        jobs = [daemon_copier.CopyJob(0, [Extent(0, chunk_bytes)]) for _ in range(chunks)]
        pairs: list[tuple[list[Extent], np.ndarray]] = [([], np.broadcast_to(view, chunk_bytes)) for _ in range(chunks)]
        expected = copy_policy.part_count(chunks * chunk_bytes, chunks, 4)
        assert len(daemon_copier.split(jobs, 4)) == len(client._split(pairs)) == expected, (chunks, chunk_bytes)
