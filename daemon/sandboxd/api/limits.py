"""Caps on what one caller may hold of the gRPC server, and a watchdog on streams.

The sync server runs every RPC on a worker thread, and holds it until the handler
returns: a call until it ends, a stream until its last message has gone out (a client
that stops reading blocks the send) or until the client stops it. So every RPC takes a
slot of its caller first, refused at once with RESOURCE_EXHAUSTED rather than queued:
Execute and Run one of the principal's call quota, any other stream a stream slot,
anything else a unary slot; every caller that is no principal shares one small pool of
slots. The server has a worker for every slot there is (`worker_count`), so no caller
can take another's threads. A stream whose client does not take a message within the
send timeout, or (client streams) sends nothing within the idle timeout, is cancelled."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from sandboxd.api.errors import TOOL_CALL_ID_KEY
from sandboxd.core.errors import ResourceExhausted, SandboxdError, Unauthenticated
from sandboxd.core.settings import DaemonSettings
from sandboxd.policy.principal import Principal

log = logging.getLogger("sandboxd.limits")
SANDBOXD_PREFIX = "/sandboxd.v1."
# How long a refused call's request message is waited for, to record what was refused.
REFUSED_READ_S = 5.0
CALL_METHODS = frozenset({"/sandboxd.v1.ExecutionService/Execute", "/sandboxd.v1.ExecutionService/Run"})
CALL, STREAM, UNARY, ANONYMOUS = "calls", "streams", "unary calls", "unauthenticated"


def worker_count(settings: DaemonSettings) -> int:
    """Threads enough for every slot of every caller at once, plus headroom for the
    moment it takes to refuse an RPC over its caller's cap."""
    rpc = settings.rpc_limits
    total = rpc.unauthenticated_rpcs + rpc.worker_headroom
    for name in set(settings.principals.values()):
        calls = min(settings.quotas.concurrent_calls_for(name), settings.max_concurrent_calls)
        total += calls + rpc.streams_per_principal + rpc.unary_calls_per_principal
    return total


class Slots:
    """A counter per (caller, kind) that refuses past its limit instead of waiting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], int] = {}

    def take(self, key: tuple[str, str], limit: int) -> bool:
        with self._lock:
            n = self._held.get(key, 0)
            if n >= limit:
                return False
            self._held[key] = n + 1
            return True

    def give(self, key: tuple[str, str]) -> None:
        with self._lock:
            n = self._held.get(key, 0) - 1
            if n > 0:
                self._held[key] = n
            else:
                self._held.pop(key, None)

    def held(self, key: tuple[str, str]) -> int:
        with self._lock:
            return self._held.get(key, 0)


class _Watched:
    __slots__ = ("context", "timeout_s", "what", "since", "cancelled")

    def __init__(self, context, timeout_s: float, what: str):
        self.context, self.timeout_s, self.what = context, timeout_s, what
        self.since: float | None = None  # waiting on the client since
        self.cancelled = False


class StreamWatchdog:
    """Cancels an RPC that has waited on its client for too long: a response message the
    client's flow control has not taken, or the next message of a client stream. One
    thread for the daemon, looking a few times a second while any stream is open; a
    message costs two attribute stores."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, tick_s: float = 0.25):
        self._clock = clock
        self._tick_s = tick_s
        self._cond = threading.Condition()
        self._watched: set[_Watched] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rpc-watchdog", daemon=True)
        self._thread.start()

    def _watch(self, context, timeout_s: float, what: str) -> _Watched:
        w = _Watched(context, timeout_s, what)
        with self._cond:
            self._watched.add(w)
            self._cond.notify()
        return w

    def _forget(self, w: _Watched) -> None:
        with self._cond:
            self._watched.discard(w)

    def stop(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._watched:
                    self._cond.wait()  # nothing to watch: asleep
                if self._closed:
                    return
                tick = min([self._tick_s] + [w.timeout_s / 4 for w in self._watched])
                self._cond.wait(tick)
                now = self._clock()
                overdue = [w for w in self._watched
                           if not w.cancelled and w.since is not None and now - w.since > w.timeout_s]
                for w in overdue:
                    w.cancelled = True
            for w in overdue:
                log.warning("cancelled an RPC (%s): %s", w.context.peer(), w.what)
                try:
                    w.context.cancel()  # the blocked send (or receive) returns at once
                except Exception:  # noqa: BLE001 - the RPC may have ended meanwhile
                    log.debug("cancelling an overdue RPC failed", exc_info=True)

    def responses(self, iterator: Iterator, context, timeout_s: float) -> Iterator:
        """`iterator`'s messages; each must be taken by the client within timeout_s.
        (The server asks for the next message only once the last one has been sent, so
        the wait is from the yield to the next resumption.)"""
        w = self._watch(context, timeout_s, f"the client took no message within {timeout_s:g} s")
        clock = self._clock
        try:
            for message in iterator:
                w.since = clock()
                yield message
                w.since = None
                if w.cancelled:
                    return
        finally:
            self._forget(w)
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def requests(self, iterator: Iterator, context, timeout_s: float) -> Iterator:
        """A client stream whose client must send its next message within timeout_s."""
        w = self._watch(context, timeout_s, f"the client sent nothing within {timeout_s:g} s")
        try:
            while True:
                w.since = self._clock()
                try:
                    message = next(iterator)
                except StopIteration:
                    return
                finally:
                    w.since = None
                if w.cancelled:
                    return
                yield message
        finally:
            self._forget(w)


class LimitInterceptor(grpc.ServerInterceptor):
    """Takes the caller's slot before any handler runs (and gives it back when the
    handler is done), and puts every stream under the watchdog. `refused(method,
    request, principal, exc)` records a refused call (Execute or Run) on the log."""

    def __init__(self, settings: DaemonSettings, authenticate: Callable[[Any], Principal],
                 refused: Callable[[str, Any, Principal, SandboxdError], None] | None = None,
                 watchdog: StreamWatchdog | None = None):
        self._settings = settings
        self._authenticate = authenticate
        self._refused = refused
        self.slots = Slots()
        self.watchdog = watchdog or StreamWatchdog()

    def _limit(self, kind: str, principal: Principal | None) -> int:
        rpc = self._settings.rpc_limits
        if principal is None:
            return rpc.unauthenticated_rpcs
        if kind == CALL:
            return min(self._settings.quotas.concurrent_calls_for(principal.name), self._settings.max_concurrent_calls)
        return rpc.streams_per_principal if kind == STREAM else rpc.unary_calls_per_principal

    def _take(self, method: str, streaming: bool, request, context,
              read_request: Callable[[], Any] | None = None) -> tuple[str, str]:
        """The slot taken for this RPC; aborts the RPC when there is none. Taken before
        the request's message is read (`read_request` reads it, for the record of a
        refused call, under a short timeout): grpc reads a unary request on the worker
        thread, so a client that never finished its message held a worker before any
        slot was taken."""
        try:
            principal: Principal | None = self._authenticate(context)
        except Unauthenticated as exc:
            if method.startswith(SANDBOXD_PREFIX):  # nothing of the daemon's answers it
                context.abort(grpc.StatusCode.UNAUTHENTICATED, exc.message)
            principal = None  # health and reflection: from the shared pool
        kind = ANONYMOUS if principal is None else CALL if method in CALL_METHODS else STREAM if streaming else UNARY
        key = ("" if principal is None else principal.name, kind)
        limit = self._limit(kind, principal)
        if self.slots.take(key, limit):
            return key
        who = "callers that are no principal" if principal is None else principal.name
        refusal = ResourceExhausted(f"{who} already hold{'' if principal is None else 's'} {limit} {kind}, "
                                    f"the most at once (its quota)")
        if kind == CALL and principal is not None and self._refused is not None:
            if request is None and read_request is not None:
                try:
                    request = read_request()
                except Exception:  # noqa: BLE001 - cut off while waiting: recorded without it
                    request = None
            self._refused(method, request, principal, refusal)  # sets refusal.tool_call_id
        if refusal.tool_call_id:
            context.set_trailing_metadata(((TOOL_CALL_ID_KEY, refusal.tool_call_id),))
        log.info("refused %s: %s", method, refusal.message)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message)
        raise AssertionError("unreachable")  # abort raises

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        rpc = self._settings.rpc_limits
        take, give, dog = self._take, self.slots.give, self.watchdog

        def read_one(requests, context, timeout_s: float):
            """A unary method's one request message, read after its slot is taken, under
            the client-stream idle timeout (a client that never finishes it is cut off)."""
            request = next(iter(dog.requests(requests, context, timeout_s)), None)
            if request is None:
                context.abort(grpc.StatusCode.CANCELLED, "the client sent no request message")
            return request

        def unary_in(behavior, streaming):
            # Served as client-streaming (the wire is the same): grpc reads nothing before
            # the slot is taken, and the one message then comes under the idle timeout.
            def refused_request(requests, context):
                return lambda: next(iter(dog.requests(requests, context, REFUSED_READ_S)), None)

            if not streaming:
                def unary_unary(requests, context):
                    key = take(method, False, None, context, refused_request(requests, context))
                    try:
                        return behavior(read_one(requests, context, rpc.stream_idle_timeout_s), context)
                    finally:
                        give(key)
                return unary_unary

            def unary_stream(requests, context):
                key = take(method, True, None, context, refused_request(requests, context))
                try:
                    request = read_one(requests, context, rpc.stream_idle_timeout_s)
                    yield from dog.responses(behavior(request, context), context, rpc.stream_send_timeout_s)
                finally:
                    give(key)
            return unary_stream

        def stream_in(behavior, streaming):
            if not streaming:
                def stream_unary(requests, context):
                    key = take(method, True, None, context)
                    try:
                        return behavior(dog.requests(requests, context, rpc.stream_idle_timeout_s), context)
                    finally:
                        give(key)
                return stream_unary

            def stream_stream(requests, context):
                key = take(method, True, None, context)
                try:
                    yield from dog.responses(
                        behavior(dog.requests(requests, context, rpc.stream_idle_timeout_s), context),
                        context, rpc.stream_send_timeout_s)
                finally:
                    give(key)
            return stream_stream

        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.stream_unary_rpc_method_handler(unary_in(handler.unary_unary, False), **kw)
        if handler.unary_stream:
            return grpc.stream_stream_rpc_method_handler(unary_in(handler.unary_stream, True), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(stream_in(handler.stream_unary, False), **kw)
        return grpc.stream_stream_rpc_method_handler(stream_in(handler.stream_stream, True), **kw)
