"""The one place that turns domain errors into gRPC status codes.

The error's class name also travels as trailing metadata (`kvstored-error`), so clients can
react to the kind of failure (re-open a session, re-register a namespace) without parsing text.
"""

from __future__ import annotations

import logging

import grpc

from kvstored import errors
from kvstored_client.errors import ERROR_KIND_KEY  # the client reads it: one definition

log = logging.getLogger(__name__)

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
}


def status_for(exc: errors.KvstoredError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


async def abort_for(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(exc, errors.KvstoredError):
        context.set_trailing_metadata(((ERROR_KIND_KEY, type(exc).__name__),))
        await context.abort(status_for(exc), str(exc))
    log.error("internal error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see daemon log")


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps unary and server-streaming handlers: KvstoredError -> its status; anything else ->
    INTERNAL, logged."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is not None and handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context: grpc.aio.ServicerContext):
                try:
                    return await inner(request, context)
                except Exception as exc:
                    await abort_for(exc, context, method)

            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler is not None and handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request, context: grpc.aio.ServicerContext):
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except Exception as exc:
                    await abort_for(exc, context, method)

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
