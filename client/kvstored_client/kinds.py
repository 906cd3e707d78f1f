# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Enums that cross the wire, for the daemon and the client alike, valued by the generated protobuf
enums (kvstored.v1): a value cannot drift from the proto, and a proto value without a member here
fails at import (below), not when a daemon first sends it."""

from __future__ import annotations

import enum
from typing import Any

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb


class TierKind(enum.IntEnum):
    """Where a chunk is (kvstored.v1.TierKind); NONE (0) is a miss."""

    NONE = pb.TIER_KIND_UNSPECIFIED
    RAM = pb.TIER_KIND_RAM
    FS = pb.TIER_KIND_FS
    S3 = pb.TIER_KIND_S3
    PEER = pb.TIER_KIND_PEER


class StoreOutcome(enum.IntEnum):
    """What a store did with one key (kvstored.v1.StoreOutcome)."""

    UNKNOWN = pb.STORE_OUTCOME_UNSPECIFIED  # a daemon too old to say
    STORED = pb.STORE_OUTCOME_STORED  # copied in by this call
    ALREADY_PRESENT = pb.STORE_OUTCOME_ALREADY_PRESENT
    IN_PROGRESS = pb.STORE_OUTCOME_IN_PROGRESS  # another writer is storing it
    DROPPED = pb.STORE_OUTCOME_DROPPED  # no space, or the daemon unavailable


class DropReason(enum.IntEnum):
    """Why a store did not store a chunk (kvstored.v1.DropReason); NONE (0): not dropped."""

    NONE = pb.DROP_REASON_UNSPECIFIED
    RAM_FULL = pb.DROP_REASON_RAM_FULL  # RAM held by leased, reserved and being-written-down chunks
    QUOTA_FULL = pb.DROP_REASON_QUOTA_FULL  # the same within the namespace's or its tenant's quota
    IN_PROGRESS = pb.DROP_REASON_IN_PROGRESS  # another writer is storing it
    NOT_VISIBLE = pb.DROP_REASON_NOT_VISIBLE  # a tenant namespace this session did not register
    UNAVAILABLE = pb.DROP_REASON_UNAVAILABLE  # the client's own: daemon unreachable, slow, or too late to start

    @property
    def label(self) -> str:
        """The name metrics and logs use: "ram_full", "quota_full", ..."""
        return self.name.lower()


class LoadInto(enum.IntEnum):
    """Where the load that follows a lookup copies its chunks (kvstored.v1.LoadInto): POOL loads
    (Acquire) need their chunks in RAM, so the lookup makes room for them; REGION loads
    (LoadToRegion) take hits below RAM through staging memory when RAM is full."""

    POOL = pb.LOAD_INTO_POOL
    REGION = pb.LOAD_INTO_REGION


def missing_members(mirror: type[enum.IntEnum], proto_enum: Any) -> list[str]:
    """The proto enum's value names that `mirror` has no member for."""
    have = {int(member) for member in mirror}
    return [name for name, value in proto_enum.items() if value not in have]


for _mirror, _proto in (
    (TierKind, pb.TierKind),
    (StoreOutcome, pb.StoreOutcome),
    (DropReason, pb.DropReason),
    (LoadInto, pb.LoadInto),
):
    if missing_members(_mirror, _proto):
        raise ImportError(
            f"kvstored_client.kinds.{_mirror.__name__} has no member for "
            f"{', '.join(missing_members(_mirror, _proto))}: add it (the proto has it)"
        )
