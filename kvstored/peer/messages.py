# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The data plane's orders and receipts in and out of the control plane's protobuf messages
(pure). Only these small descriptions travel over gRPC: the chunk bytes never do.

A receipt also carries the chunk's block identity when the serving daemon knows one, so that a
fetcher that keeps the chunk publishes it as its own (kvstored/events/identity.py). The fetch
reply is the cheapest correct place: only the chunks actually fetched carry one, once, beside
the receipt they need anyway. In the peers' event streams every follower would get (and keep)
~0.3 KB for every chunk of every peer, though it fetches few of them; on the data plane the
identity would need framing of its own on each transport."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstored.events.identity import BlockIdentity
from kvstored.peer.transport import Receipt, SendOrder, SendOutcome, SendResult, Transfer, TransportKind
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

SEND_OUTCOMES = {
    SendOutcome.SENT: pb.SEND_OUTCOME_SENT,
    SendOutcome.NO_LINK: pb.SEND_OUTCOME_NO_LINK,
    SendOutcome.INVALID: pb.SEND_OUTCOME_INVALID,
    SendOutcome.FAILED: pb.SEND_OUTCOME_FAILED,
    SendOutcome.TIMED_OUT: pb.SEND_OUTCOME_TIMED_OUT,
}
_FROM_PROTO = {v: k for k, v in SEND_OUTCOMES.items()}


class FetchRefused(Exception):
    """The serving daemon did not send the order (its outcome and reason in the message)."""


def fetch_request(
    order: SendOrder,
    incarnation: int,
    namespace_id: str,
    chunk_bytes: int,
    key_bytes: int,
    keys: Sequence[bytes],
    timeout_s: float,
) -> pb.FetchRequest:
    return pb.FetchRequest(
        incarnation=incarnation,
        namespace_id=namespace_id,
        chunk_bytes=chunk_bytes,
        key_bytes=key_bytes,
        keys=list(keys),
        transport=order.transport.value,
        link_id=order.link_id,
        transfers=[
            pb.PeerTransfer(transfer_id=t.transfer_id, size=t.size, segments=list(t.segments)) for t in order.transfers
        ],
        timeout_ms=max(1, int(timeout_s * 1000)),
    )


def order_of(request: pb.FetchRequest) -> SendOrder:
    """The order a FetchRequest carries; ValueError for an unknown transport."""
    kind = TransportKind(request.transport)
    transfers = tuple(Transfer(t.transfer_id, t.size, tuple(t.segments)) for t in request.transfers)
    return SendOrder(kind, request.link_id, transfers)


IdentityOf = Callable[[bytes], "BlockIdentity | None"]  # a key's identity in the fetch's namespace


def fetch_response(
    result: SendResult,
    incarnation: int,
    keys: dict[int, bytes] | None = None,
    identity_of: IdentityOf | None = None,
) -> pb.FetchResponse:
    """keys: transfer id -> key; with identity_of, each found chunk's receipt carries its identity."""
    receipts = []
    for r in result.receipts:
        receipt = pb.PeerReceipt(transfer_id=r.transfer_id, found=r.found, length=r.length, checksum=r.checksum)
        key = keys.get(r.transfer_id) if keys is not None and r.found else None
        identity = identity_of(key) if key is not None and identity_of is not None else None
        if identity is not None:
            receipt.identity.CopyFrom(identity_to_pb(identity))
        receipts.append(receipt)
    return pb.FetchResponse(
        outcome=SEND_OUTCOMES[result.outcome], detail=result.detail, incarnation=incarnation, receipts=receipts
    )


def identity_to_pb(identity: BlockIdentity) -> pb.BlockIdentity:
    return pb.BlockIdentity(
        block_hashes=list(identity.block_hashes),
        parent_block_hash=identity.parent_block_hash or 0,
        has_parent=identity.parent_block_hash is not None,
        token_ids=list(identity.token_ids),
        block_size=identity.block_size,
        group_idx=identity.group_idx,
    )


# As the daemon's own Reserve takes (kvstored/server/service.py): a peer's reply is checked alike.
MAX_IDENTITY_TOKENS = 1 << 16


def identities_of(response: pb.FetchResponse, keys: dict[int, bytes]) -> list[tuple[bytes, BlockIdentity]]:
    """(key, identity) for each found chunk whose receipt carries a well-formed identity (one
    that is not is left out: the chunk is then served, not published)."""
    out = []
    for r in response.receipts:
        key = keys.get(r.transfer_id)
        if key is None or not r.found or not r.HasField("identity"):
            continue
        b = r.identity
        if len(b.token_ids) > MAX_IDENTITY_TOKENS:
            continue
        try:
            identity = BlockIdentity.of(
                list(b.block_hashes),
                b.parent_block_hash if b.has_parent else None,
                list(b.token_ids),
                b.block_size,
                b.group_idx,
            )
        except ValueError:
            continue
        out.append((key, identity))
    return out


def receipts_of(response: pb.FetchResponse) -> list[Receipt]:
    """The receipts of a sent order; FetchRefused when it was not sent."""
    outcome = _FROM_PROTO.get(response.outcome)
    if outcome is not SendOutcome.SENT:
        name = outcome.value if outcome else str(response.outcome)
        raise FetchRefused(f"{name}: {response.detail}")
    return [Receipt(r.transfer_id, r.found, r.length, r.checksum) for r in response.receipts]
