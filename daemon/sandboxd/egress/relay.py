"""The egress proxy's byte relay, past its checks: the two transports are handed to two
small protocols that write what one side receives straight into the other (no stream
buffers), with back-pressure from each side's write buffer to the other's reading.
The upstream direction may go through a framer (proxy_http.BodyFramer or
TunnelRequests): only what it returns is forwarded, and a refusal it raises ends the
upstream connection at once, after what the framer had checked before it (so the
destination gets the same bytes however the client's stream was cut into reads).

Two clocks bound what the relay holds: a framing element the framer holds incomplete
(a request head inside a tunnel, a chunk-size line, a trailer) must be whole within
`head_timeout_s` of its first byte, like the first head (a deadline, however the bytes
trickle in), or the connection is refused; and a connection on which nothing moved
either way for `idle_timeout_s` is closed."""

from __future__ import annotations

import asyncio
from typing import Protocol, cast

from sandboxd.egress.http import HEAD_TIMEOUT_S, ProxyRefusal, response_status

# How long a finished connection may take to flush to a peer that reads slowly.
FLUSH_GRACE_S = 30.0
# A relayed connection on which no byte moved either way for this long is closed (a
# body or a tunnel may be slow, never still: squid's read_timeout).
RELAY_IDLE_TIMEOUT_S = 15 * 60.0


class Framer(Protocol):
    def feed(self, data: bytes) -> bytes: ...

    def feed_eof(self) -> None: ...

    @property
    def pending_since(self) -> float | None: ...

    def timed_out(self, timeout_s: float) -> ProxyRefusal: ...


class Counts(Protocol):
    protocol: str
    status: int
    bytes_up: int
    bytes_down: int
    error: str


class _Pipe:
    """One direction of a tunnel: what `source` delivers is written to `sink`."""

    def __init__(self, rec: Counts, *, up: bool, done: asyncio.Future, framer: Framer | None = None,
                 head_timeout_s: float = HEAD_TIMEOUT_S):
        self.rec, self.up, self.done = rec, up, done
        self.finished = False
        self.framer = framer
        self.refusal: ProxyRefusal | None = None
        self._loop = asyncio.get_running_loop()
        self.last_read = self._loop.time()
        self._head_timeout_s = head_timeout_s
        self._held_since: float | None = None  # the framer's pending_since the timer is set for
        self._held_timer: asyncio.TimerHandle | None = None

    def pair(self, *, sink: asyncio.Transport, source: asyncio.Transport, peer: "_Pipe") -> None:
        self.sink, self.source, self.peer = sink, source, peer

    def data_received(self, data: bytes) -> None:
        self.last_read = self._loop.time()
        if self.refusal is not None:
            return
        if self.framer is not None:
            try:
                data = self.framer.feed(data)
            except ProxyRefusal as refusal:
                self._refuse(refusal)
                return
            self.watch_framing()
            if not data:
                return
        if self.up:
            self.rec.bytes_up += len(data)
        else:
            if self.rec.protocol == "http" and not self.rec.bytes_down:
                self.rec.status = response_status(data)
            self.rec.bytes_down += len(data)
        if not self.sink.is_closing():
            self.sink.write(data)

    def eof_received(self) -> None:
        if self.framer is not None and self.refusal is None:
            try:
                self.framer.feed_eof()
            except ProxyRefusal as refusal:
                self.refusal = refusal  # recorded; the origin sees the end as it is
        self.finished = True
        if not self.sink.is_closing() and self.sink.can_write_eof():
            self.sink.write_eof()
        if self.peer.finished:
            self._end()

    def watch_framing(self) -> None:
        """(Re)sets the deadline of the element the framer holds incomplete, if any."""
        since = self.framer.pending_since if self.framer is not None else None
        if since == self._held_since:
            return
        self.stop_timers()
        self._held_since = since
        if since is not None:
            self._held_timer = self._loop.call_at(since + self._head_timeout_s, self._held_too_long)

    def _held_too_long(self) -> None:
        self._held_timer = None
        if self.framer is not None and self.refusal is None and not self.done.done():
            self._refuse(self.framer.timed_out(self._head_timeout_s))

    def stop_timers(self) -> None:
        if self._held_timer is not None:
            self._held_timer.cancel()
            self._held_timer = None

    def _refuse(self, refusal: ProxyRefusal) -> None:
        """Nothing more of this connection reaches the destination: what was checked
        before the refused input goes, then the connection is closed and no longer read
        (the client side stays open, for an answer if none was relayed yet)."""
        self.refusal = refusal
        self.source.pause_reading()
        if refusal.forward and not self.sink.is_closing():
            self.rec.bytes_up += len(refusal.forward)
            self.sink.write(refusal.forward)
        # close, not abort: an abort would drop the checked bytes still buffered, and what
        # the destination got would then depend on timing. Nothing writes to it again
        # (this pipe ignores its source from now on); close_soon bounds the flush.
        close_soon(self.sink)
        self.finished = self.peer.finished = True
        self._end()

    def lost(self) -> None:
        """The source is gone: nothing more will flow either way."""
        self.finished = self.peer.finished = True
        self._end()

    def _end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


class _Sink(asyncio.Protocol):
    """The protocol of the transport that feeds `pipe`; its own write buffer filling
    up pauses the other side's reading."""

    def __init__(self, pipe: _Pipe):
        self.pipe = pipe

    def data_received(self, data: bytes) -> None:
        self.pipe.data_received(data)

    def eof_received(self) -> bool:
        self.pipe.eof_received()
        return True  # keep our writing side open: the other direction may still flow

    def connection_lost(self, exc) -> None:
        self.pipe.lost()

    def pause_writing(self) -> None:
        # Our transport (the sink of the peer pipe) is full: stop reading its source.
        self.pipe.peer.source.pause_reading()

    def resume_writing(self) -> None:
        if not self.pipe.peer.source.is_closing() and self.pipe.peer.refusal is None:
            self.pipe.peer.source.resume_reading()


async def relay(rec: Counts, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                upstream_reader: asyncio.StreamReader, upstream: asyncio.StreamWriter,
                framer: Framer | None = None, *, head_timeout_s: float = HEAD_TIMEOUT_S,
                idle_timeout_s: float = RELAY_IDLE_TIMEOUT_S) -> None:
    """Bytes both ways until both ends are done, a framing element is held past
    head_timeout_s or nothing moves for idle_timeout_s; raises the framer's refusal, if any."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    # Socket transports, which read as well as write (typed as write transports).
    client_t, up_t = cast(asyncio.Transport, writer.transport), cast(asyncio.Transport, upstream.transport)
    to_up = _Pipe(rec, up=True, done=done, framer=framer, head_timeout_s=head_timeout_s)
    to_client = _Pipe(rec, up=False, done=done)
    idle = _IdleWatch(loop, done, (to_up, to_client), idle_timeout_s)
    try:
        await _run(client_t, up_t, reader, upstream_reader, to_up, to_client, done)
    finally:
        idle.stop()
        to_up.stop_timers()
    if idle.expired:
        rec.error = rec.error or f"nothing moved either way for {idle_timeout_s:g} s: closed"
    if to_up.refusal is not None:
        raise to_up.refusal


class _IdleWatch:
    """Ends the relay (`done`) once neither pipe has read anything for `timeout_s`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future, pipes: tuple[_Pipe, _Pipe],
                 timeout_s: float):
        self._loop, self._done, self._pipes, self._timeout_s = loop, done, pipes, timeout_s
        self.expired = False
        self._timer = loop.call_later(timeout_s, self._check)

    def _check(self) -> None:
        left = max(p.last_read for p in self._pipes) + self._timeout_s - self._loop.time()
        if left > 0:
            self._timer = self._loop.call_later(left, self._check)
        elif not self._done.done():
            self.expired = True
            self._done.set_result(None)

    def stop(self) -> None:
        self._timer.cancel()


async def _run(client_t: asyncio.Transport, up_t: asyncio.Transport, reader: asyncio.StreamReader,
               upstream_reader: asyncio.StreamReader, to_up: _Pipe, to_client: _Pipe, done: asyncio.Future) -> None:
    to_up.pair(sink=up_t, source=client_t, peer=to_client)
    to_client.pair(sink=client_t, source=up_t, peer=to_up)
    # What the stream readers already buffered goes first.
    # (Their private buffers: the transport is handed over below.)
    for stream_reader, pipe in ((reader, to_up), (upstream_reader, to_client)):
        buffered = bytes(stream_reader._buffer)  # type: ignore[attr-defined]  # noqa: SLF001
        stream_reader._buffer.clear()  # type: ignore[attr-defined]  # noqa: SLF001
        eof = stream_reader.at_eof() or stream_reader._eof  # type: ignore[attr-defined]  # noqa: SLF001
        if buffered:
            pipe.data_received(buffered)
        if eof:
            pipe.eof_received()
    to_up.watch_framing()  # an element the framer held before the relay began (a tunnel's next head)
    client_t.set_protocol(_Sink(to_up))
    up_t.set_protocol(_Sink(to_client))
    for t in (client_t, up_t):
        if not t.is_closing() and to_up.refusal is None:
            t.resume_reading()
    await done


def close_soon(transport: asyncio.WriteTransport) -> None:
    """Closes after flushing what is buffered, but never waits on the peer for long."""
    if transport.is_closing() and not transport.get_write_buffer_size():
        return
    transport.close()
    if transport.get_write_buffer_size():
        asyncio.get_running_loop().call_later(FLUSH_GRACE_S, transport.abort)
