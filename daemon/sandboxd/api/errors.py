"""Daemon errors become gRPC statuses here and nowhere else: SandboxdError -> the status
its class names (core/errors.py), anything else -> INTERNAL without details."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from sandboxd.core.errors import SandboxdError

log = logging.getLogger("sandboxd.api.errors")
# Trailing metadata naming the call an RPC made (or refused): the client reads it back.
TOOL_CALL_ID_KEY = "sandboxd-tool-call-id"

Behavior = Callable[[Any, grpc.ServicerContext], Any]


def status_code(exc: SandboxdError | type[SandboxdError]) -> grpc.StatusCode:
    return grpc.StatusCode[exc.status]


def abort(context: grpc.ServicerContext, exc: SandboxdError) -> None:
    """Ends the RPC with exc's status (raises, as context.abort does)."""
    if exc.tool_call_id:
        context.set_trailing_metadata(((TOOL_CALL_ID_KEY, exc.tool_call_id),))
    context.abort(status_code(exc), exc.message)


def _unexpected(context: grpc.ServicerContext, behavior: Behavior) -> None:
    """Called from an `except` block: the bare raise re-raises what it caught."""
    if context.code() is not None:  # already aborted deliberately
        raise
    log.exception("unhandled error in %s", getattr(behavior, "__name__", "handler"))
    context.abort(grpc.StatusCode.INTERNAL, "internal error")


def _wrap_unary(behavior: Behavior) -> Behavior:
    def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(request, context)
        except SandboxdError as exc:
            abort(context, exc)
        except Exception:
            _unexpected(context, behavior)
    return wrapper


def _wrap_stream(behavior: Behavior) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
    def wrapper(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(request, context)
        except SandboxdError as exc:
            abort(context, exc)
        except Exception:
            _unexpected(context, behavior)
    return wrapper


class ErrorInterceptor(grpc.ServerInterceptor):
    """Every sandboxd handler's errors translated (see the module's docstring)."""

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer)
        return handler
