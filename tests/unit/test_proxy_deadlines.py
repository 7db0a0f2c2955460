"""The egress proxy's framers say since when they hold an incomplete framing element
(`pending_since`, on the clock they are given): a request head inside a tunnel, a
chunk-size line, a body's last chunk and trailer. The relay holds each such element to
the head timeout from its first byte (tests/integration/test_egress_deadlines.py, for
real); here the clock is the test's own, so nothing waits. Pure code."""

from __future__ import annotations

import pytest

from sandboxd.egress.http import BodyFramer, TunnelRequests, parse_request, refusal_response


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def feed_at(framer, clock: Clock, at: float, data: bytes) -> bytes:
    clock.now = at
    return framer.feed(data)


HEAD = b"GET /a HTTP/1.1\r\nHost: a.test\r\n\r\n"


def test_a_tunnels_later_head_is_held_from_its_first_byte():
    clock = Clock()
    t = TunnelRequests("a.test", 80, clock)
    assert t.pending_since is None
    feed_at(t, clock, 101, HEAD)
    assert t.checked == 1 and t.pending_since is None  # whole: nothing held
    # The second head trickles in: its clock starts at its first byte and does not move
    # however many bytes follow.
    feed_at(t, clock, 150, b"G")
    for i, byte in enumerate(b"ET /b HTTP/1.1\r\nHost: a.test\r\n"):
        feed_at(t, clock, 150.3 + i * 0.3, bytes([byte]))
        assert t.pending_since == 150
    feed_at(t, clock, 170, b"\r\n")
    assert t.checked == 2 and t.pending_since is None


def test_a_head_begun_in_the_read_that_ended_the_one_before_is_held_from_that_read():
    clock = Clock()
    t = TunnelRequests("a.test", 80, clock)
    feed_at(t, clock, 101, b"GET /a HTTP/1.1\r\n")
    assert t.pending_since == 101
    feed_at(t, clock, 120, b"Host: a.test\r\n\r\nGET /b")  # the first ends, the second begins
    assert t.checked == 1 and t.pending_since == 120


def test_empty_lines_between_requests_hold_nothing():
    # A client may send CRLF after a body (RFC 9112 2.2); an idle keep-alive after it is
    # the relay's idle timeout's, not a head's.
    clock = Clock()
    t = TunnelRequests("a.test", 80, clock)
    feed_at(t, clock, 101, HEAD + b"\r\n")
    assert t.pending_since is None
    feed_at(t, clock, 102, b"\r")  # half an empty line is held, though
    assert t.pending_since == 102
    feed_at(t, clock, 103, b"\n")
    assert t.pending_since is None


def test_a_tunnels_body_framing_is_held_and_its_refusal_closes_the_tunnel():
    clock = Clock()
    t = TunnelRequests("a.test", 80, clock)
    feed_at(t, clock, 101, b"POST /b HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert t.pending_since is None  # at the body, nothing of it yet
    feed_at(t, clock, 110, b"ff")
    assert t.pending_since == 110
    refusal = t.timed_out(30)
    assert (refusal.status, refusal.rule) == (0, "framing-timeout")
    assert "within 30 s" in refusal.reason


def test_a_tunnels_head_refusal():
    clock = Clock()
    t = TunnelRequests("a.test", 80, clock)
    feed_at(t, clock, 101, b"GET /a")
    refusal = t.timed_out(2.5)
    assert (refusal.status, refusal.rule) == (0, "head-timeout")
    assert "within 2.5 s of its first byte" in refusal.reason


def chunked_framer(clock: Clock) -> BodyFramer:
    req = parse_request(b"POST http://a.test/ HTTP/1.1\r\nTransfer-Encoding: chunked")
    return BodyFramer(req, clock)


def test_a_chunk_size_line_is_held_from_its_first_byte():
    clock = Clock()
    body = chunked_framer(clock)
    assert body.pending_since is None
    feed_at(body, clock, 101, b"1")
    assert body.pending_since == 101
    feed_at(body, clock, 102, b"0")
    assert body.pending_since == 101  # the same line
    assert feed_at(body, clock, 103, b"\r\n" + b"x" * 8) == b"8\r\nxxxxxxxx\r\n"
    assert body.pending_since is None  # chunk data is passed on as it comes: nothing held
    feed_at(body, clock, 104, b"x" * 8 + b"\r\n5")  # the chunk ends, the next line begins
    assert body.pending_since == 104


def test_the_last_chunk_and_trailer_are_held_until_the_end():
    clock = Clock()
    body = chunked_framer(clock)
    feed_at(body, clock, 101, b"3\r\nabc\r\n")
    assert body.pending_since is None
    feed_at(body, clock, 110, b"0\r\nX-Tr")
    assert body.pending_since == 110
    feed_at(body, clock, 115, b"ailer: 1\r\n")
    assert body.pending_since == 110
    assert feed_at(body, clock, 120, b"\r\n") == b"0\r\n\r\n"
    assert body.done and body.pending_since is None


def test_a_content_length_body_is_never_held():
    clock = Clock()
    body = BodyFramer(parse_request(b"POST http://a.test/ HTTP/1.1\r\nContent-Length: 10"), clock)
    for i in range(9):
        feed_at(body, clock, 101 + i, b"x")
        assert body.pending_since is None


def test_a_plain_requests_body_refusal_is_a_request_timeout():
    refusal = chunked_framer(Clock()).timed_out(30)
    assert (refusal.status, refusal.rule, refusal.decision) == (408, "framing-timeout", "allowed")
    assert refusal_response(408, refusal.rule, refusal.reason).startswith(b"HTTP/1.1 408 Request Timeout\r\n")


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_the_head_clock_does_not_depend_on_how_the_stream_is_cut(cut):
    clock = Clock()
    t = TunnelRequests("a.test", 80, clock)
    stream = HEAD + b"GET /b HTTP/1.1\r\nHost: a.test\r\n"
    for i in range(0, len(stream), cut):
        feed_at(t, clock, 200 + i, stream[i:i + cut])
    # The second head's first byte is at offset len(HEAD): the read that brought it is
    # when it is held from.
    assert t.pending_since == 200 + len(HEAD) - len(HEAD) % cut
