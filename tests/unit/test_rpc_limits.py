"""rpc_limits: slots refused past their limit, the watchdog that cancels an RPC waiting
on its client too long, and a worker for every slot."""

from __future__ import annotations

import threading
import time

import pytest

from sandboxd.api.limits import Slots, StreamWatchdog, worker_count
from sandboxd.core.settings import DaemonSettings


class Context:
    """The two things the watchdog asks of a grpc.ServicerContext."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def peer(self) -> str:
        return "unix:test"

    def cancel(self) -> None:
        self.cancelled.set()


def test_slots_refuse_past_the_limit_and_come_back():
    slots = Slots()
    key = ("alice", "streams")
    assert all(slots.take(key, 3) for _ in range(3))
    assert not slots.take(key, 3)
    assert slots.take(("bob", "streams"), 3), "another caller's slots are its own"
    slots.give(key)
    assert slots.held(key) == 2
    assert slots.take(key, 3)
    for _ in range(3):
        slots.give(key)
    assert slots.held(key) == 0


def test_slots_hold_under_contention():
    slots, key, taken = Slots(), ("alice", "unary calls"), []

    def grab():
        for _ in range(1000):
            if slots.take(key, 5):
                taken.append(1)
                slots.give(key)

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert slots.held(key) == 0 and taken


@pytest.fixture
def watchdog():
    dog = StreamWatchdog()
    yield dog
    dog.stop()


def test_a_response_the_client_never_takes_is_cancelled(watchdog):
    ctx = Context()
    stream = watchdog.responses(iter([b"one", b"two"]), ctx, timeout_s=0.2)
    assert next(stream) == b"one"  # ... and the server's send of it blocks
    assert ctx.cancelled.wait(2)
    # The send returns once cancelled: the stream ends there.
    assert list(stream) == []


def test_responses_taken_in_time_are_never_cancelled(watchdog):
    ctx = Context()
    out = []
    for message in watchdog.responses(iter(range(50)), ctx, timeout_s=0.2):
        out.append(message)
        time.sleep(0.01)
    assert out == list(range(50))
    time.sleep(0.3)
    assert not ctx.cancelled.is_set()


def test_the_handler_taking_its_time_is_not_the_clients_wait(watchdog):
    def slow():
        time.sleep(0.4)  # a quiet command: nothing to send yet
        yield b"late"

    ctx = Context()
    assert list(watchdog.responses(slow(), ctx, timeout_s=0.1)) == [b"late"]
    assert not ctx.cancelled.is_set()


def test_a_client_stream_that_goes_quiet_is_cancelled(watchdog):
    arrived = threading.Event()

    def client():
        yield b"first"
        arrived.wait(5)  # stands for a client that sends nothing more
        yield b"too late"

    ctx = Context()
    requests = watchdog.requests(client(), ctx, timeout_s=0.2)
    assert next(requests) == b"first"
    done = []
    t = threading.Thread(target=lambda: done.append(list(requests)))
    t.start()
    assert ctx.cancelled.wait(2)
    arrived.set()
    t.join(5)
    assert done == [[]], "a message after the cancel is not handed on"


def test_a_closed_stream_closes_its_handler(watchdog):
    closed = []

    def handler():
        try:
            yield b"a"
            yield b"b"
        finally:
            closed.append(True)

    stream = watchdog.responses(handler(), Context(), timeout_s=5)
    next(stream)
    stream.close()
    assert closed == [True]


def test_a_worker_for_every_slot_of_every_caller():
    s = DaemonSettings(principals={0: "root", 1000: "alice", 1001: "bob"},
                       quotas={"concurrent_calls": 16, "per_principal": {"bob": 40}}, max_concurrent_calls=32,
                       rpc_limits={"streams_per_principal": 8, "unary_calls_per_principal": 16,
                                   "unauthenticated_rpcs": 4, "worker_headroom": 8})
    # root and alice: 16 calls; bob: his 40 capped by the daemon's 32.
    assert worker_count(s) == (16 + 8 + 16) * 2 + (32 + 8 + 16) + 4 + 8
    # Two uids of one principal (socket and TLS are one tenant) share its slots.
    same = DaemonSettings(principals={0: "root", 1000: "alice", 1005: "alice"},
                          rpc_limits={"unauthenticated_rpcs": 4, "worker_headroom": 8})
    assert worker_count(same) == 2 * (16 + 8 + 16) + 12
