# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Client-side exception tree. `retryable` says whether trying again later can succeed."""

from __future__ import annotations

import grpc

ERROR_KIND_KEY = "kvstored-error"
OLDEST_SEQ_KEY = "kvstored-oldest-seq"  # trailing metadata of an OUT_OF_RANGE WatchEvents: resume here
INCARNATION_KEY = "kvstored-incarnation"  # initial metadata of WatchEvents: the daemon run its seqs are of


class KvstoredError(Exception):
    retryable = False


class Unavailable(KvstoredError):
    """The daemon is down, restarting, or did not answer within the deadline."""

    retryable = True


class DeadlineExceeded(Unavailable):
    """No answer within the call's deadline (the daemon may be slow rather than gone)."""


class TierUnavailable(Unavailable):
    """A tier below RAM could not carry out the request (e.g. an S3 DELETE failed): retry it.
    The daemon itself is fine."""


class TransferNotStarted(Unavailable):
    """The daemon could not start a region transfer before its deadline: nothing was copied."""


class TransferOutcomeUnknown(KvstoredError):
    """A region transfer was sent but got no answer: none even well past its deadline (the
    daemon may still be copying), or the daemon died / the connection broke before it answered
    (it may have copied part of the batch). The region's bytes at the transfer's offsets are not
    to be trusted (nor overwritten while the daemon may still be copying)."""

    retryable = True


class InvalidArgument(KvstoredError):
    pass


class NotFound(KvstoredError):
    pass


class UnknownNamespace(NotFound):
    pass


class UnknownSession(NotFound):
    retryable = True


class UnknownRegion(NotFound):
    pass


class RegionFileMissing(NotFound):
    pass


class FailedPrecondition(KvstoredError):
    pass


class HandleNotHeld(FailedPrecondition):
    pass


class RegionShrunk(FailedPrecondition):
    """The region file is smaller than when it was registered: register it again."""


class ResourceExhausted(KvstoredError):
    pass


class BatchTooLarge(ResourceExhausted):
    pass


class PoolExhausted(ResourceExhausted):
    retryable = True


class InternalError(KvstoredError):
    pass


_BY_KIND = {
    cls.__name__: cls
    for cls in (
        UnknownNamespace,
        UnknownSession,
        UnknownRegion,
        RegionFileMissing,
        HandleNotHeld,
        RegionShrunk,
        BatchTooLarge,
        PoolExhausted,
        TransferNotStarted,
        TierUnavailable,
    )
}
_BY_CODE = {
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Unavailable,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}


# Statuses gRPC itself gives a call that broke off (the daemon's own answers carry ERROR_KIND_KEY).
_BROKEN_OFF = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.DATA_LOSS,
    }
)
_NO_CONNECTION = "failed to connect to all addresses"  # gRPC's words when no connection could carry the call


def never_sent(exc: grpc.RpcError) -> bool:
    """The call failed before it was sent: gRPC had no connection to the daemon to put it on."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and (exc.details() or "").startswith(_NO_CONNECTION)


def may_have_run(exc: grpc.RpcError) -> bool:
    """Whether the daemon may have carried out (part of) a call that failed: it was sent, and
    what ended it is not the daemon's answer but a broken connection, a dead daemon or a timeout."""
    if _kind(exc):
        return False
    return exc.code() in _BROKEN_OFF and not never_sent(exc)


def _kind(exc: grpc.RpcError) -> str:
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_KIND_KEY:
            return value
    return ""


def from_code(code_name: str, message: str, kind: str = "") -> KvstoredError:
    if kind in _BY_KIND:
        return _BY_KIND[kind](message)
    code = getattr(grpc.StatusCode, code_name, None)
    return _BY_CODE.get(code, InternalError)(message)


def from_rpc_error(exc: grpc.RpcError) -> KvstoredError:
    """Map a failed call (sync or aio) to the exception tree; keeps the daemon's message."""
    code = exc.code()
    return from_code(code.name if code else "UNKNOWN", exc.details() or str(code), _kind(exc))
