# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The one place that turns domain errors into gRPC status codes.

The error's class name also travels as trailing metadata (`kvstored-error`), so clients can
react to the kind of failure (re-open a session, re-register a namespace) without parsing text.

Bad input never reaches a servicer as an exception of gRPC's own: request bytes that decode to
no message become InvalidRequest here (gRPC would answer UNKNOWN and log a traceback per
request). Status messages are cut to MAX_DETAILS_BYTES: they travel in a trailer, which a
client's gRPC refuses beyond 8 KiB. What a client can trigger at will is logged through a
LogLimiter (one line per kind per interval).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvstored import errors
from kvstored.logs import LogLimiter
from kvstored_client.errors import ERROR_KIND_KEY  # the client reads it: one definition

log = logging.getLogger(__name__)
limited = LogLimiter(log)

MAX_DETAILS_BYTES = 1024  # UTF-8 bytes; percent-encoded in the trailer, at most ~3 KiB

STATUS: dict[type[errors.KvstoredError], grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UnknownNamespace: grpc.StatusCode.NOT_FOUND,
    errors.UnknownSession: grpc.StatusCode.NOT_FOUND,
    errors.UnknownRegion: grpc.StatusCode.NOT_FOUND,
    errors.RegionFileMissing: grpc.StatusCode.NOT_FOUND,
    errors.HandleNotHeld: grpc.StatusCode.FAILED_PRECONDITION,
    errors.RegionShrunk: grpc.StatusCode.FAILED_PRECONDITION,
    errors.RegionNotAllowed: grpc.StatusCode.PERMISSION_DENIED,
    errors.SessionRequired: grpc.StatusCode.FAILED_PRECONDITION,
    errors.BatchTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PoolExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    errors.TierUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.TransferNotStarted: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.WatcherLagged: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PeerIncompatible: grpc.StatusCode.FAILED_PRECONDITION,
    errors.PeerTierDisabled: grpc.StatusCode.FAILED_PRECONDITION,
}


def status_for(exc: errors.KvstoredError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


def bounded(text: str, limit: int = MAX_DETAILS_BYTES) -> str:
    """`text` cut to `limit` UTF-8 bytes (at a character boundary), "..." marking the cut."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode(errors="ignore") + "..."


@dataclass(frozen=True, slots=True)
class Failure:
    """What a client is told about a failed call, whichever transport carried it."""

    code: grpc.StatusCode
    message: str
    kind: str  # the error's class name (ERROR_KIND_KEY)


def failure_for(exc: Exception, method: str) -> Failure:
    """A handler's exception as the client sees it: a KvstoredError -> its status and message;
    anything else -> INTERNAL, logged (the message does not leak internals)."""
    if isinstance(exc, errors.KvstoredError):
        return Failure(status_for(exc), bounded(str(exc)), type(exc).__name__)
    limited.log(f"internal {method}", logging.ERROR, "internal error in %s", method, exc_info=exc)
    return Failure(grpc.StatusCode.INTERNAL, f"internal error in {method}; see daemon log", "InternalError")


async def abort_for(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    failure = failure_for(exc, method)
    context.set_trailing_metadata(((ERROR_KIND_KEY, failure.kind),))
    await context.abort(failure.code, failure.message)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What the request deserializer hands on for bytes that are no request message."""

    problem: str


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None
    message_type = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    type_name = message_type.full_name if message_type is not None else "request message"

    def tolerant(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever else a parser raises on garbage
            return Undecodable(f"the request is not a valid {type_name} ({len(data)} bytes): {exc}")

    return tolerant


def _decoded(request: Any, method: str) -> Any:
    if isinstance(request, Undecodable):
        limited.log(f"undecodable {method}", logging.WARNING, "undecodable request to %s: %s", method, request.problem)
        raise errors.InvalidRequest(request.problem)
    return request


async def _decoded_all(requests: AsyncIterator[Any], method: str) -> AsyncIterator[Any]:
    async for request in requests:
        yield _decoded(request, method)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler: undecodable requests -> InvalidRequest; KvstoredError -> its status;
    anything else -> INTERNAL, logged."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _mapped(handler, handler_call_details.method)


def _mapped(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    codecs = {
        "request_deserializer": _tolerant(handler.request_deserializer),
        "response_serializer": handler.response_serializer,
    }

    def one(request: Any) -> Any:
        return _decoded(request, method)

    def each(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        return _decoded_all(requests, method)

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_guarded(handler.unary_unary, one, method), **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_guarded(handler.stream_unary, each, method), **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_guarded(handler.unary_stream, one, method), **codecs)
    return grpc.stream_stream_rpc_method_handler(_guarded(handler.stream_stream, each, method), **codecs)


def _guarded(inner: Callable[..., Any], decode: Callable[[Any], Any], method: str) -> Callable[..., Any]:
    """`inner` with its request(s) decoded first and its errors mapped to a status, in the same
    style as `inner` (grpc.aio runs an async generator's items, or a coroutine that returns the
    response or writes the stream itself, as the health service's Watch does)."""
    if inspect.isasyncgenfunction(inner):

        async def stream(request, context: grpc.aio.ServicerContext):
            try:
                async for item in inner(decode(request), context):
                    yield item
            except Exception as exc:
                await abort_for(exc, context, method)

        return stream

    async def call(request, context: grpc.aio.ServicerContext):
        try:
            return await inner(decode(request), context)
        except Exception as exc:
            await abort_for(exc, context, method)

    return call
