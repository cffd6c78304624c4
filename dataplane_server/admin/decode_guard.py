"""Request bytes that do not decode are INVALID_ARGUMENT, not gRPC's default INTERNAL.

grpc-python answers a request its deserializer cannot parse with INTERNAL
("Exception deserializing request!"), which reads as a server bug. This
interceptor swaps each unary-request handler's deserializer for one that
returns a marker on failure, and the handler then aborts with
INVALID_ARGUMENT naming the method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

_UNDECODABLE = object()


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception:  # noqa: BLE001 - any parse failure is the caller's bad bytes
            return _UNDECODABLE

    return parse


def _guarded(behavior: Callable, method: str) -> Callable:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        if request is _UNDECODABLE:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{method}: request bytes do not decode"
            )
        return behavior(request, context)

    return handle


class DecodeErrorsAsInvalidArgument(grpc.ServerInterceptor):
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        deserialize = _tolerant(handler.request_deserializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _guarded(handler.unary_stream, method),
                request_deserializer=deserialize,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            _guarded(handler.unary_unary, method),
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )
