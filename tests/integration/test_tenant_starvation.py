"""One tenant's load never starves another's (settings.rpc_limits, rpc_limits.py, the
relay's connection caps): streams that hold a worker thread, a client that stops
reading, a burst of calls, and connections from a uid that is no principal."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sandboxd_testing import TEST_BACKENDS, prepared_call, wait_for
from sandboxd_client import AsyncSandboxdClient, errors
from sandboxd_contract.calls import build_call
from sandboxd_contract.pb import sandboxd_pb2 as pb
from sandboxd_contract.pb import sandboxd_pb2_grpc as pb_grpc

ALICE, BOB, STRANGER = 1000, 1001, 1002
PRINCIPALS = {0: "root", ALICE: "alice", BOB: "bob"}
BACKEND = TEST_BACKENDS[-1]  # a call's backend does not matter here; nsjail's are quicker


@contextmanager
def channel_as(d, uid: int, **options):
    """A connection of its own made as `uid` (the relay reads its peer credentials)."""
    opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20),
            *options.items()]
    os.seteuid(uid)
    try:
        ch = grpc.insecure_channel(f"unix:{d.socket}", options=opts)
        grpc.channel_ready_future(ch).result(timeout=10)
    finally:
        os.seteuid(0)
    try:
        yield ch
    finally:
        ch.close()


def connect_raw(d, uid: int) -> socket.socket:
    os.seteuid(uid)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(d.socket))
    finally:
        os.seteuid(0)
    return s


def closed_by_daemon(s: socket.socket, wait_s: float) -> bool:
    """Whether the daemon ends the connection within wait_s (what gRPC sent first, its
    SETTINGS, read and dropped)."""
    deadline = time.monotonic() + wait_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            if s.recv(4096) == b"":
                return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True
    return False


def a_call(ws, argv, **policy) -> pb.PreparedToolCall:
    c = prepared_call(ws, argv, policy or None)
    c["runtime"]["adapter"] = BACKEND
    return build_call(c)


def big_artifact(ch, ws) -> str:
    """Alice's stdout artifact of 16 MB: 61 messages of a download."""
    out = pb_grpc.ExecutionServiceStub(ch).Run(pb.RunRequest(
        call=a_call(ws, ["head", "-c", "16000000", "/dev/zero"]), max_inline_output_bytes=1), timeout=120)
    return out.result.artifacts[0].artifact_id


def answers_within(fn, limit_s: float = 1.0) -> float:
    t = time.monotonic()
    fn(limit_s)
    took = time.monotonic() - t
    assert took < limit_s
    return took


def test_a_flood_of_streams_never_starves_another_tenant(spare_daemon):
    d = spare_daemon(principals=PRINCIPALS, socket_mode=0o666,
                     rpc_limits={"streams_per_principal": 4, "stream_send_timeout_s": 30}).start()
    alice_ws, bob_ws = d.new_workspace(uid=ALICE), d.new_workspace(uid=BOB)
    with channel_as(d, ALICE) as a1, channel_as(d, ALICE) as a2, channel_as(d, BOB) as b:
        artifact = big_artifact(a1, alice_ws)
        mine = pb_grpc.ExecutionServiceStub(b).Run(pb.RunRequest(call=a_call(bob_ws, ["true"])), timeout=60)
        # Alice floods: watches that never end, and downloads she reads one chunk of.
        streams = []
        for i in range(100):
            ch = (a1, a2)[i % 2]
            if i % 5:
                streams.append(health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=60))
            else:
                streams.append(pb_grpc.ArtifactServiceStub(ch).DownloadArtifact(
                    pb.DownloadArtifactRequest(artifact_id=artifact), timeout=60))
        time.sleep(1)
        audit, traces = pb_grpc.AuditServiceStub(b), pb_grpc.TraceServiceStub(b)
        for _ in range(5):  # bob is answered at once, every time
            answers_within(lambda t: audit.QueryCalls(pb.QueryCallsRequest(), timeout=t))
            answers_within(lambda t: traces.GetTrace(pb.GetTraceRequest(tool_call_id=mine.tool_call_id), timeout=t))
        held, refused = [], []
        for stream in streams:
            try:
                next(stream)
                held.append(stream)
            except grpc.RpcError as err:
                refused.append(err.code())
        assert len(held) == 4, "a principal holds at most its stream cap"
        assert set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        for stream in held:
            stream.cancel()
        # Her slots come back once her streams have ended.
        assert wait_for(lambda: _watch_once(a1), timeout_s=10)


def _watch_once(ch) -> bool:
    stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=5)
    try:
        next(stream)
        return True
    except grpc.RpcError:
        return False
    finally:
        stream.cancel()


def test_a_stream_whose_client_stops_reading_ends_after_the_send_timeout(spare_daemon):
    d = spare_daemon(principals=PRINCIPALS, socket_mode=0o666,
                     rpc_limits={"streams_per_principal": 2, "stream_send_timeout_s": 2}).start()
    ws = d.new_workspace(uid=ALICE)
    # A client that never widens its flow-control window: the daemon's sends block.
    with channel_as(d, ALICE, **{"grpc.http2.bdp_probe": 0}) as ch:
        artifact = big_artifact(ch, ws)
        stub = pb_grpc.ArtifactServiceStub(ch)
        stalled = [stub.DownloadArtifact(pb.DownloadArtifactRequest(artifact_id=artifact), timeout=60)
                   for _ in range(2)]
        for s in stalled:
            next(s)
        with pytest.raises(grpc.RpcError) as over:
            next(stub.DownloadArtifact(pb.DownloadArtifactRequest(artifact_id=artifact), timeout=60))
        assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "streams" in over.value.details()
        time.sleep(4)  # not reading: past the send timeout
        for s in stalled:  # what was buffered, then the end the daemon chose
            with pytest.raises(grpc.RpcError) as ended:
                for _ in s:
                    pass
            assert ended.value.code() == grpc.StatusCode.CANCELLED
        # The slots are free again: a whole download goes through.
        got = sum(len(c.data) for c in stub.DownloadArtifact(pb.DownloadArtifactRequest(artifact_id=artifact),
                                                              timeout=60))
        assert got == 16_000_000
    assert "the client took no message within 2 s" in d.log_path.read_text()


def test_every_call_of_a_burst_is_answered_and_on_the_log(spare_daemon):
    """gRPC core cancels, unrecorded, what arrives past its queue of pending RPCs (1,000
    by default): 2,000 at once got ~10% CANCELLED with no id and no record."""
    d = spare_daemon().start()
    ws = d.new_workspace()

    async def burst():
        async with AsyncSandboxdClient(str(d.socket)) as c:
            async def one():
                try:
                    return (await c.run(prepared_call(ws, ["true"], runtime={
                        "adapter": BACKEND, "image": "sandboxd/busybox:latest"}))).tool_call_id, "OK"
                except errors.SandboxdClientError as exc:
                    return exc.tool_call_id, type(exc).__name__
            return await asyncio.gather(*(one() for _ in range(2000)))

    results = asyncio.run(burst())
    kinds = {kind for _, kind in results}
    assert kinds <= {"OK", "ResourceExhausted"}, kinds
    ids = [i for i, _ in results]
    assert all(ids) and len(set(ids)) == 2000
    with d.client() as c:
        refused = [i for i, kind in results if kind == "ResourceExhausted"]
        for tool_call_id in refused[:: max(1, len(refused) // 20)]:
            types = [e.type for e in c.get_trace(tool_call_id)]
            assert types == ["ToolCallRequested", "ToolCallRejected"], types


def _threads_and_fds(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def test_connections_of_a_uid_that_is_no_principal_are_bounded_and_closed_when_idle(spare_daemon):
    d = spare_daemon(principals=PRINCIPALS, socket_mode=0o666,
                     rpc_limits={"unauthenticated_connections": 4, "unauthenticated_idle_timeout_s": 2,
                                 "connections_per_principal": 6}).start()
    pid = d.proc.pid
    base_threads, base_fds = _threads_and_fds(pid)
    t0 = time.monotonic()
    quiet = [connect_raw(d, STRANGER) for _ in range(100)]
    kept = [s for s in quiet if not closed_by_daemon(s, 0.3)]
    assert len(kept) == 4, "at most 4 connections of uids that are no principal"
    threads, fds = _threads_and_fds(pid)
    assert threads - base_threads <= 2 * 4 + 2 and fds - base_fds <= 7 * 4 + 4, (threads, fds)
    # The 4 it kept, it closes once they have been silent for 2 s.
    assert all(closed_by_daemon(s, 10) for s in kept)
    assert 1.8 < time.monotonic() - t0 < 8
    assert wait_for(lambda: _threads_and_fds(pid)[0] <= base_threads + 1, timeout_s=5)
    # A principal's connections have a cap of their own, and a stranger's flood never
    # touched them.
    alice = [connect_raw(d, ALICE) for _ in range(10)]
    assert sum(1 for s in alice if not closed_by_daemon(s, 0.3)) == 6
    with channel_as(d, BOB) as b:
        pb_grpc.AuditServiceStub(b).QueryCalls(pb.QueryCallsRequest(), timeout=2)
    # And a stranger still hears why, in a status, not a dropped connection.
    with channel_as(d, STRANGER) as s:
        with pytest.raises(grpc.RpcError) as exc:
            pb_grpc.AuditServiceStub(s).QueryCalls(pb.QueryCallsRequest(), timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for s in quiet + alice:
        s.close()


def test_callers_that_are_no_principal_share_a_few_slots(spare_daemon):
    """Health and reflection answer anyone; their streams hold a worker: every caller
    that is no principal together holds at most unauthenticated_rpcs of them."""
    d = spare_daemon(principals=PRINCIPALS, socket_mode=0o666,
                     rpc_limits={"unauthenticated_rpcs": 3, "unauthenticated_connections": 4,
                                 "unauthenticated_idle_timeout_s": 30}).start()
    with channel_as(d, STRANGER) as s, channel_as(d, BOB) as b:
        held, codes = [], []
        for _ in range(40):
            w = health_pb2_grpc.HealthStub(s).Watch(health_pb2.HealthCheckRequest(), timeout=60)
            try:
                next(w)
                held.append(w)
            except grpc.RpcError as err:
                codes.append(err.code())
        assert len(held) == 3 and set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        answers_within(lambda t: pb_grpc.AuditServiceStub(b).QueryCalls(pb.QueryCallsRequest(), timeout=t))
        for w in held:
            w.cancel()


def test_retries_attached_to_a_running_call_count_against_the_call_cap(spare_daemon):
    """Each Execute holds a worker while it streams, an idempotent retry attached to a
    running call too: the third of a principal capped at 2 is refused, and recorded."""
    d = spare_daemon(principals=PRINCIPALS, socket_mode=0o666, quotas={"concurrent_calls": 2}).start()
    ws = d.new_workspace(uid=ALICE)
    call = a_call(ws, ["sleep", "30"])
    call.runtime.idempotency_key = "retry-me"
    with channel_as(d, ALICE) as ch:
        stub = pb_grpc.ExecutionServiceStub(ch)
        first = stub.Execute(pb.ExecuteRequest(call=call), timeout=60)
        assert next(first).HasField("accepted")
        again = stub.Execute(pb.ExecuteRequest(call=call), timeout=60)
        next(again)  # attached to the first
        third = stub.Execute(pb.ExecuteRequest(call=call), timeout=60)
        with pytest.raises(grpc.RpcError) as exc:
            next(third)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        refused_id = dict(exc.value.trailing_metadata())["sandboxd-tool-call-id"]
        trace = pb_grpc.TraceServiceStub(ch).GetTrace(pb.GetTraceRequest(tool_call_id=refused_id), timeout=10)
        assert [e.type for e in trace.events] == ["ToolCallRequested", "ToolCallRejected"]
        assert '"code":"RESOURCE_EXHAUSTED"' in trace.events[1].payload_json.replace(" ", "")
        first.cancel()
        again.cancel()


def test_requests_that_never_finish_their_message_hold_no_worker_past_the_cap(spare_daemon):
    """grpc reads a unary request's message on a worker thread: a client that sends the
    headers and never the message held a worker before any cap applied. Now the slot is
    taken first, the rest are refused at once, and the message comes under the idle
    timeout."""
    d = spare_daemon(principals=PRINCIPALS, socket_mode=0o666,
                     rpc_limits={"unary_calls_per_principal": 4, "stream_idle_timeout_s": 3}).start()
    bob_ws = d.new_workspace(uid=BOB)
    never = threading.Event()

    def no_message():
        never.wait()  # the request message never comes
        yield from ()

    with channel_as(d, ALICE) as a, channel_as(d, BOB) as b:
        mine = pb_grpc.ExecutionServiceStub(b).Run(pb.RunRequest(call=a_call(bob_ws, ["true"])), timeout=60)
        stalled = [a.stream_unary("/sandboxd.v1.AuditService/QueryCalls", request_serializer=lambda m: m,
                                  response_deserializer=pb.QueryCallsResponse.FromString).future(no_message(),
                                                                                                 timeout=30)
                   for _ in range(200)]
        time.sleep(1)
        audit, traces = pb_grpc.AuditServiceStub(b), pb_grpc.TraceServiceStub(b)
        for _ in range(3):
            answers_within(lambda t: audit.QueryCalls(pb.QueryCallsRequest(), timeout=t))
            answers_within(lambda t: traces.GetTrace(pb.GetTraceRequest(tool_call_id=mine.tool_call_id), timeout=t))
        codes = [f.exception(timeout=30).code() for f in stalled]
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 196, "four hold a slot, the rest are refused"
        assert codes.count(grpc.StatusCode.CANCELLED) == 4, "the four are cut off after the idle timeout"
        never.set()


def test_a_call_refused_before_its_message_came_is_on_the_log_all_the_same(spare_daemon):
    """Over its cap, a Run whose request message never comes is refused after the
    short wait for it, and recorded: who and why, with nothing of what it asked."""
    d = spare_daemon(principals=PRINCIPALS, socket_mode=0o666, quotas={"concurrent_calls": 1}).start()
    ws = d.new_workspace(uid=ALICE)
    never = threading.Event()

    def no_message():
        never.wait()
        yield from ()

    with channel_as(d, ALICE) as ch:
        running = pb_grpc.ExecutionServiceStub(ch).Execute(pb.ExecuteRequest(call=a_call(ws, ["sleep", "30"])),
                                                           timeout=60)
        assert next(running).HasField("accepted")
        stalled = ch.stream_unary("/sandboxd.v1.ExecutionService/Run", request_serializer=lambda m: m,
                                  response_deserializer=pb.RunResponse.FromString)
        with pytest.raises(grpc.RpcError) as exc:
            stalled(no_message(), timeout=30)
        never.set()
        # Cut off once the wait for its message ran out (the watchdog cancels it).
        assert exc.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)
        running.cancel()
    with d.client() as root:  # an admin reads the whole log
        events = list(root.export_events())
    refused = [e for e in events if e.type == "ToolCallRejected" and "RESOURCE_EXHAUSTED" in e.payload_json]
    assert len(refused) == 1, [e.type for e in events]
    requested = [e for e in events if e.tool_call_id == refused[0].tool_call_id and e.type == "ToolCallRequested"]
    assert '"principal":"alice"' in requested[0].payload_json.replace(" ", "")
