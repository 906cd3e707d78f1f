# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The data plane's orders and receipts in and out of the control plane's protobuf messages
(pure). Only these small descriptions travel over gRPC: the chunk bytes never do."""

from __future__ import annotations

from collections.abc import Sequence

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


def fetch_response(result: SendResult, incarnation: int) -> pb.FetchResponse:
    return pb.FetchResponse(
        outcome=SEND_OUTCOMES[result.outcome],
        detail=result.detail,
        incarnation=incarnation,
        receipts=[
            pb.PeerReceipt(transfer_id=r.transfer_id, found=r.found, length=r.length, checksum=r.checksum)
            for r in result.receipts
        ],
    )


def receipts_of(response: pb.FetchResponse) -> list[Receipt]:
    """The receipts of a sent order; FetchRefused when it was not sent."""
    outcome = _FROM_PROTO.get(response.outcome)
    if outcome is not SendOutcome.SENT:
        name = outcome.value if outcome else str(response.outcome)
        raise FetchRefused(f"{name}: {response.detail}")
    return [Receipt(r.transfer_id, r.found, r.length, r.checksum) for r in response.receipts]
