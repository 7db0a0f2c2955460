"""The daemon under systemd's notification protocol, for real: a daemon started with
NOTIFY_SOCKET naming a datagram socket this test binds (a path, and an abstract name)
says READY=1 only once it answers calls and STOPPING=1 when SIGTERM begins its stop;
the socket's name reaches no sandbox and no helper the daemon starts. And the unit
file (deploy/systemd/sandboxd.service) passes systemd's own verifier."""

from __future__ import annotations

import hashlib
import shutil
import signal
import socket
import subprocess
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from sandboxd.api.server import serving
from sandboxd_client import errors
from sandboxd_testing import SANDBOXD, TIME_SCALE, make_daemon

from .conftest import BACKENDS, DAEMON_ENV, AdapterClient, call, public_tmpdir, stop_and_clean

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "sandboxd.service"
START_TIMEOUT_S = 60.0 * TIME_SCALE
# A credential whose value is what its command saw of NOTIFY_SOCKET: the one helper the
# daemon starts with its own environment.
SEEN_BY_HELPER = ["/bin/sh", "-c", 'printf %s "${NOTIFY_SOCKET-unset}"']


def bind_receiver(kind: str, base: Path) -> tuple[str, socket.socket]:
    """systemd's side: a datagram socket, and the NOTIFY_SOCKET value that names it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if kind == "path":
        address = value = str(base / "notify.sock")
    else:
        name = f"sandboxd-test-notify-{uuid.uuid4().hex}"
        address, value = "\0" + name, "@" + name
    sock.bind(address)
    sock.settimeout(START_TIMEOUT_S)
    return value, sock


@pytest.fixture
def base():
    path = public_tmpdir("sandboxd-notify-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_ready_comes_once_the_daemon_answers_and_stopping_on_sigterm(kind, base, docker_engine):
    value, receiver = bind_receiver(kind, base)
    d = make_daemon(base / "d", env={**DAEMON_ENV, "NOTIFY_SOCKET": value})
    starter = threading.Thread(target=d.start, kwargs={"timeout_s": START_TIMEOUT_S}, daemon=True)
    try:
        with receiver:
            starter.start()
            ready = receiver.recv(4096)
            # Asked the moment READY arrives, before anything else of the test waits: it answers.
            assert serving(d.socket), d.log()
            assert ready.startswith(b"READY=1\n"), ready
            assert f"STATUS=serving on {d.socket}".encode() in ready
            starter.join(START_TIMEOUT_S)
            assert d.proc is not None and d.daemon_id, d.log()
            ws = d.new_workspace()
            with d.client() as c:
                out = c.run(call(ws, ["true"]))
            assert out.result.status == "success"

            d.proc.send_signal(signal.SIGTERM)
            assert receiver.recv(4096).startswith(b"STOPPING=1\n")
            assert d.stop() == 0
    finally:
        stop_and_clean(d, docker_engine, base / "d")


@pytest.fixture(scope="module")
def notified_daemon(docker_engine):
    """A daemon started as systemd would (NOTIFY_SOCKET set) that would pass the variable
    on wherever it could: allowlisted for sandboxes to inherit, and a credential command
    (a helper started with the daemon's environment) that reports what it saw."""
    base = public_tmpdir("sandboxd-notify-env-")
    value, receiver = bind_receiver("path", base)
    d = make_daemon(base / "d", env={**DAEMON_ENV, "NOTIFY_SOCKET": value},
                    inheritable_env=["LANG", "NOTIFY_SOCKET"],
                    credentials={"seen": {"command": SEEN_BY_HELPER, "principals": ["root"]}})
    with receiver:
        d.start(timeout_s=START_TIMEOUT_S)
        yield d, value
        stop_and_clean(d, docker_engine, base / "d")
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=BACKENDS)
def nc(notified_daemon, request):
    c = AdapterClient(str(notified_daemon[0].socket), request.param)
    yield c
    c.close()


def test_a_sandbox_environment_has_no_notify_socket(nc, notified_daemon):
    d, _ = notified_daemon
    out = nc.run(call(d.new_workspace(), ["env"]))
    assert out.result.status == "success", out.stderr
    assert b"NOTIFY_SOCKET" not in out.stdout
    assert b"PATH=" in out.stdout  # the environment was printed


def test_an_allowlisted_notify_socket_is_not_there_to_inherit(nc, notified_daemon):
    """Even an operator's allowlist cannot hand it on: the daemon no longer has it."""
    d, _ = notified_daemon
    c = call(d.new_workspace(), ["env"], {"environment": {"inheritedEnv": ["NOTIFY_SOCKET"]}})
    try:
        out = nc.run(c)
    except errors.PermissionDenied as exc:  # named, but absent from the daemon's environment
        assert "NOTIFY_SOCKET" in str(exc)
        return
    assert b"NOTIFY_SOCKET" not in out.stdout, out.stdout


def test_a_helper_the_daemon_starts_does_not_inherit_it(nc, notified_daemon):
    d, notify_socket = notified_daemon
    c = call(d.new_workspace(), ["python3", "-c", textwrap.dedent("""
        import hashlib, os
        print(hashlib.sha256(os.environ["SEEN"].encode()).hexdigest())
    """)], {"environment": {"secretEnvAllowed": True}})
    c["credentialRefs"] = [{"bindingId": "seen", "envName": "SEEN"}]
    out = nc.run(c)
    assert out.result.status == "success", out.stderr
    seen = out.stdout.decode().strip()
    assert seen != hashlib.sha256(notify_socket.encode()).hexdigest(), "the helper had NOTIFY_SOCKET"
    assert seen == hashlib.sha256(b"unset").hexdigest()


def test_the_unit_passes_systemd_analyze_verify(tmp_path):
    """systemd's own reading of the unit, without a running systemd: every key known,
    every value parsed, the ExecStart binary executable (here: the venv's sandboxd)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is missing: apt-get install systemd (it is not started, only its tools used)")
    text = UNIT.read_text()
    assert "ExecStart=/opt/sandboxd/bin/sandboxd " in text
    unit = tmp_path / "sandboxd.service"
    unit.write_text(text.replace("ExecStart=/opt/sandboxd/bin/sandboxd ", f"ExecStart={SANDBOXD} "))
    done = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), done.stderr + done.stdout
