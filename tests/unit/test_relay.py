"""The relay's byte pump (native/relay.c through transport.RelayPump): bytes both ways,
unchanged and in order, each side's end passed on, and both descriptors closed once
both directions have ended."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time

import pytest

from sandboxd.api.transport import RelayPump
from sandboxd.core import assets
from sandboxd_testing import wait_for

# The relay_library setting's default: the pump `make native` builds into the package.
RELAY_LIBRARY = assets.packaged(assets.RELAY_LIBRARY)


@pytest.fixture(scope="module")
def pump() -> RelayPump:
    return RelayPump(RELAY_LIBRARY)


def open_sockets() -> set[str]:
    """What this process's descriptors point at ("socket:[inode]")."""
    out = set()
    for n in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{n}"))
        except OSError:
            pass  # listdir's own descriptor, closed by now
    return out




@pytest.fixture
def linked(pump):
    """client <-> [relay: a | b] <-> server, as the daemon wires a connection."""
    client, a = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    relayed = {f"socket:[{os.fstat(s.fileno()).st_ino}]" for s in (a, b)}
    pump.relay(a, b)
    assert a.fileno() == -1 and b.fileno() == -1, "the relay owns the descriptors now"
    yield client, server, relayed
    client.close()
    server.close()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def test_bytes_cross_both_ways_in_order(linked):
    client, server, _ = linked
    client.sendall(b"request")
    assert recv_exactly(server, 7) == b"request"
    server.sendall(b"answer one|")
    server.sendall(b"answer two")
    assert recv_exactly(client, 21) == b"answer one|answer two"


def test_a_large_stream_arrives_whole_while_the_other_way_talks(linked):
    client, server, _ = linked
    data = os.urandom(3 << 20) * 4  # 12 MiB: many splices of the 1 MiB pipe
    got = hashlib.sha256()
    received = 0

    def read_all():
        nonlocal received
        while received < len(data):
            chunk = client.recv(1 << 20)
            if not chunk:
                return
            got.update(chunk)
            received += len(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    client.sendall(b"ping")  # the other direction, meanwhile
    server.sendall(data)
    reader.join(30)
    assert received == len(data) and got.digest() == hashlib.sha256(data).digest()
    assert recv_exactly(server, 4) == b"ping"


def test_each_sides_end_reaches_the_other_and_then_both_descriptors_close(linked):
    client, server, relayed = linked
    client.sendall(b"last words")
    client.shutdown(socket.SHUT_WR)
    assert recv_exactly(server, 10) == b"last words"
    assert server.recv(1) == b"", "the client's end is passed on"
    server.sendall(b"still answering")  # a half-closed link still carries the other way
    assert recv_exactly(client, 15) == b"still answering"
    server.close()
    assert client.recv(1) == b"", "the server's end is passed on"
    # Both directions ended: the relay's two descriptors are gone from this process.
    assert wait_for(lambda: not relayed & open_sockets())


def test_the_relay_holds_its_descriptors_while_a_direction_is_open(linked):
    client, server, relayed = linked
    client.shutdown(socket.SHUT_WR)
    assert server.recv(1) == b""
    time.sleep(0.1)
    assert relayed <= open_sockets(), "closed while the server could still answer"
    server.sendall(b"ok")
    assert recv_exactly(client, 2) == b"ok"


def test_a_peer_that_vanishes_ends_the_link(linked):
    client, server, relayed = linked
    server.close()  # the daemon's gRPC side goes away
    assert client.recv(1) == b""
    client.close()
    assert wait_for(lambda: not relayed & open_sockets())


def test_a_daemon_without_the_built_pump_is_refused_with_the_way_to_build_it(tmp_path):
    from sandboxd.api import transport
    from sandboxd.core.errors import FailedPrecondition

    with pytest.raises(FailedPrecondition, match="make native"):
        transport.PeerCredentialRelay(tmp_path / "public.sock", tmp_path / "internal.sock", tmp_path, 0o660,
                                      library=tmp_path / "missing.so")
    assert not (tmp_path / "public.sock").exists()


def test_the_pump_is_loaded_from_the_path_it_is_given(tmp_path):
    """The relay_library setting is the path loaded: nothing found at import time."""
    from sandboxd.core.errors import FailedPrecondition

    elsewhere = tmp_path / "copy" / "libsandboxd-relay.so"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(RELAY_LIBRARY.read_bytes())
    assert RelayPump(elsewhere).counter().add(1) == 1
    missing = tmp_path / "missing" / "libsandboxd-relay.so"
    with pytest.raises(FailedPrecondition, match=str(missing)):
        RelayPump(missing)


def pair_relayed(pump: RelayPump, idle_ms: int = 0, counters=(None, None)):
    client, a = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    relayed = {f"socket:[{os.fstat(s.fileno()).st_ino}]" for s in (a, b)}
    pump.relay(a, b, idle_ms, counters)
    return client, server, relayed


def test_a_client_silent_past_the_idle_time_is_ended_both_ways(pump):
    client, server, relayed = pair_relayed(pump, idle_ms=300)
    try:
        server.sendall(b"SETTINGS")  # the server talking does not keep a silent client
        assert recv_exactly(client, 8) == b"SETTINGS"
        t = time.monotonic()
        client.settimeout(5)
        assert client.recv(1) == b""
        assert 0.25 < time.monotonic() - t < 2
        server.settimeout(5)
        assert server.recv(1) == b""
        assert wait_for(lambda: not relayed & open_sockets())
    finally:
        client.close()
        server.close()


def test_a_client_that_talks_is_never_idle(pump):
    client, server, _ = pair_relayed(pump, idle_ms=300)
    try:
        for i in range(8):
            client.sendall(b"%d" % i)
            assert recv_exactly(server, 1) == b"%d" % i
            time.sleep(0.1)  # 0.8 s in all, never 0.3 s silent
        server.sendall(b"still here")
        assert recv_exactly(client, 10) == b"still here"
    finally:
        client.close()
        server.close()


def test_counters_go_down_when_the_connection_has_ended(pump):
    mine, total = pump.counter(), pump.counter()
    links = []
    for _ in range(3):
        mine.add(1)
        total.add(1)
        links.append(pair_relayed(pump, counters=(mine, total)))
    assert (mine.value, total.value) == (3, 3)
    client, server, _ = links.pop()
    client.close()
    server.close()
    assert wait_for(lambda: (mine.value, total.value) == (2, 2))
    for client, server, _ in links:
        client.close()
        server.close()
    assert wait_for(lambda: (mine.value, total.value) == (0, 0))


def test_the_public_socket_refuses_connections_over_its_caps(tmp_path):
    """uid 0 is a principal here (at most 2 connections); the 3rd is closed at once;
    one ended makes room."""
    from sandboxd.api.transport import ConnectionLimits, PeerCredentialRelay

    internal_dir = tmp_path / "rpc"
    internal_dir.mkdir()
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    upstream.bind(str(internal_dir / "grpc.sock"))
    upstream.listen(16)

    def serve():  # a server that ends each connection once its client has ended it
        while True:
            try:
                conn, _ = upstream.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: (c.recv(1), c.close()), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    relay_ = PeerCredentialRelay(tmp_path / "public.sock", internal_dir / "grpc.sock", internal_dir, 0o600,
                                 limits=ConnectionLimits(frozenset({os.geteuid()}), per_principal=2,
                                                         unauthenticated=1, total=10),
                                 library=RELAY_LIBRARY)
    relay_.start()
    try:
        def connect():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(tmp_path / "public.sock"))
            s.settimeout(0.3)
            return s

        def ended(s) -> bool:
            try:
                return s.recv(1) == b""
            except socket.timeout:
                return False

        first, second, third = connect(), connect(), connect()
        assert not ended(first) and not ended(second)
        assert ended(third)
        assert wait_for(lambda: relay_.connections(os.geteuid()) == 2)
        first.close()
        assert wait_for(lambda: relay_.connections() == 1)
        fourth = connect()
        assert not ended(fourth)
        for s in (second, third, fourth):
            s.close()
    finally:
        relay_.close()
        upstream.shutdown(socket.SHUT_RDWR)
        upstream.close()
