"""The one place that turns domain errors into gRPC status codes.

The error's class name also travels as trailing metadata (`kvstored-error`), so clients can
react to the kind of failure (re-open a session, re-register a namespace) without parsing text.
"""

from __future__ import annotations

import logging

import grpc

from kvstored import errors

log = logging.getLogger(__name__)

ERROR_KIND_KEY = "kvstored-error"

STATUS: dict[type[errors.KvstoredError], grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UnknownNamespace: grpc.StatusCode.NOT_FOUND,
    errors.UnknownSession: grpc.StatusCode.NOT_FOUND,
    errors.UnknownRegion: grpc.StatusCode.NOT_FOUND,
    errors.RegionFileMissing: grpc.StatusCode.NOT_FOUND,
    errors.HandleNotHeld: grpc.StatusCode.FAILED_PRECONDITION,
    errors.BatchTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PoolExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ShuttingDown: grpc.StatusCode.UNAVAILABLE,
}


def status_for(exc: errors.KvstoredError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every unary handler: KvstoredError -> its status; anything else -> INTERNAL, logged."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        method = handler_call_details.method

        async def unary(request, context: grpc.aio.ServicerContext):
            try:
                return await inner(request, context)
            except errors.KvstoredError as exc:
                context.set_trailing_metadata(((ERROR_KIND_KEY, type(exc).__name__),))
                await context.abort(status_for(exc), str(exc))
            except Exception:
                log.exception("internal error in %s", method)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see daemon log")

        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
