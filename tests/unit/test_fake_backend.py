"""sandboxd.sandbox.fake: the in-process backend honours the Backend protocol (each verb,
kill, the deadline, failure injection), so that the tests built on it test the code
above it, not the fake."""

from __future__ import annotations

import array
import json
import os
import shutil
import socket
import tempfile
import time
from itertools import count
from pathlib import Path
from typing import Sequence

import pytest

from sandboxd.core.errors import BackendUnavailable, FailedPrecondition, InternalError, PermissionDenied
from sandboxd.policy.preflight import HostPlan
from sandboxd.sandbox.fake import FakeBackend, FakeProcess, FakeSpec
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.sandbox.engine import create_sandbox
from sandboxd.sandbox.protocol import ExitStatus, Process, ResourceUsage, Sandbox, SandboxHandle
from sandboxd.sandbox.spec import Attachments, SandboxIdentity

from .conftest import WORKSPACE_GID, WORKSPACE_UID, resolve

PLAN = HostPlan(workspace="/srv/sandboxd/workspaces/alice", uid=WORKSPACE_UID, gid=WORKSPACE_GID, binds=(), masks=())
_ids = count()


def compile_for(backend: FakeBackend, argv: list[str], *, stdin_open: bool = False, timeout_ms: int = 30_000,
                daemon_id: str = "sd-test") -> FakeSpec:
    policy = resolve({"process": {"timeoutMs": timeout_ms}})
    identity = SandboxIdentity(daemon_id, f"sbx-{next(_ids)}", "tc-1")
    return backend.compile(policy, PLAN, identity, argv=tuple(argv), image="sandboxd/default:latest",
                           stdin_open=stdin_open)


def new_spool(tmp_path: Path, cap: int = 1 << 20) -> OutputSpool:
    return OutputSpool(tmp_path / f"spool-{next(_ids)}", {STDOUT: cap, STDERR: cap}, preview_bytes=64)


def started(backend: FakeBackend, tmp_path: Path, argv: list[str], stdin: bytes = b"",
            **compile_args: object) -> tuple[SandboxHandle, OutputSpool]:
    spec = compile_for(backend, argv, stdin_open=bool(stdin), **compile_args)  # type: ignore[arg-type]
    handle = backend.create(spec)
    spool = new_spool(tmp_path)
    backend.start(handle, spool, stdin)
    return handle, spool


def output(spool: OutputSpool) -> tuple[bytes, bytes]:
    spool.close()
    return spool.summary(STDOUT).path.read_bytes(), spool.summary(STDERR).path.read_bytes()


def run_to_end(backend: FakeBackend, tmp_path: Path, argv: list[str],
               stdin: bytes = b"") -> tuple[ExitStatus, bytes, bytes]:
    handle, spool = started(backend, tmp_path, argv, stdin)
    assert backend.wait(handle, 5.0)
    status, _ = backend.collect(handle)
    backend.destroy(handle)
    out, err = output(spool)
    return status, out, err


# ------------------------------------------------------------------ compile


def test_compile_carries_the_call_and_its_policy():
    backend = FakeBackend()
    spec = compile_for(backend, ["echo", "hi"], stdin_open=True, timeout_ms=1234)
    assert spec.argv == ("echo", "hi") and spec.stdin_open
    assert spec.timeout_ms == 1234 and spec.user == f"{WORKSPACE_UID}:{WORKSPACE_GID}"
    assert (spec.daemon_id, spec.tool_call_id, spec.workspace) == ("sd-test", "tc-1", PLAN.workspace)
    assert spec.fail_at == ""
    # The executor digests every spec's JSON form.
    assert json.loads(json.dumps(spec.to_json_dict()))["argv"] == ["echo", "hi"]
    assert compile_for(backend, ["fail-collect", "echo", "hi"]).fail_at == "collect"
    assert compile_for(backend, ["fail-nothing"]).fail_at == ""


# ------------------------------------------------------------------ the verbs


def test_a_command_runs_and_its_sandbox_is_counted(tmp_path):
    backend = FakeBackend()
    handle, spool = started(backend, tmp_path, ["echo", "hello", "world"])
    assert backend.live == [handle.sandbox_id] and backend.created == 1
    assert backend.wait(handle, 5.0)
    status, usage = backend.collect(handle)
    assert status == ExitStatus(0, "", False) and usage == ResourceUsage(0, 0)
    backend.destroy(handle)
    backend.destroy(handle)  # idempotent
    assert output(spool) == (b"hello world\n", b"")
    assert backend.live == [] and (backend.created, backend.destroyed) == (1, 1)
    assert backend.verbs(handle.sandbox_id) == ["create", "start", "collect", "destroy", "destroy"]


def test_scripts_streams_and_exit_codes(tmp_path):
    backend = FakeBackend()
    status, out, err = run_to_end(backend, tmp_path, ["echo", "a", ";", "echo-err", "b", ";", "exit", "3"])
    assert (status.exit_code, status.signal, out, err) == (3, "", b"a\n", b"b\n")
    status, out, _ = run_to_end(backend, tmp_path, ["cat"], stdin=b"fed in")
    assert (status.exit_code, out) == (0, b"fed in")
    status, out, err = run_to_end(backend, tmp_path, ["nosuch", "x"])
    assert status.exit_code == 127 and b"nosuch: command not found" in err
    status, _, _ = run_to_end(backend, tmp_path, ["oom"])
    assert status == ExitStatus(137, "SIGKILL", True)
    status, out, err = run_to_end(backend, tmp_path, ["bytes", "100000", ";", "bytes", "7", "stderr"])
    assert (len(out), err) == (100000, b"xxxxxxx")


def test_output_past_the_cap_is_truncated_by_the_spool(tmp_path):
    backend = FakeBackend()
    spec = compile_for(backend, ["bytes", "5000"])
    handle = backend.create(spec)
    spool = new_spool(tmp_path, cap=1000)
    backend.start(handle, spool, b"")
    assert backend.wait(handle, 5.0)
    summary = spool.summary(STDOUT)
    assert (summary.produced_bytes, summary.stored_bytes, summary.truncated) == (5000, 1000, True)
    backend.destroy(handle)


def test_a_registered_program_runs_with_its_arguments(tmp_path):
    backend = FakeBackend()

    def greet(proc: FakeProcess, args: Sequence[str]) -> int:
        proc.write(STDOUT, f"hi {args[0]} from {proc.argv[0]}".encode())
        proc.usage = ResourceUsage(cpu_ms=12, peak_memory_bytes=3456)
        return 4

    backend.register("greet", greet)
    handle, spool = started(backend, tmp_path, ["greet", "bob"])
    assert backend.wait(handle, 5.0)
    assert backend.collect(handle) == (ExitStatus(4, "", False), ResourceUsage(12, 3456))
    backend.destroy(handle)
    assert output(spool)[0] == b"hi bob from greet"


def test_a_program_that_raises_crashes_its_command(tmp_path):
    backend = FakeBackend()

    def broken(proc: FakeProcess, args: Sequence[str]) -> int:
        raise RuntimeError("bug in the test")

    backend.register("broken", broken)
    status, _, err = run_to_end(backend, tmp_path, ["broken"])
    assert status.exit_code == 125 and b"RuntimeError: bug in the test" in err


# ------------------------------------------------------------------ kill and the deadline


def test_kill_ends_a_sleeping_command_at_once(tmp_path):
    backend = FakeBackend()
    handle, spool = started(backend, tmp_path, ["echo", "before", ";", "sleep", "30", ";", "echo", "after"])
    assert not backend.wait(handle, 0.05)  # still running
    t0 = time.monotonic()
    backend.kill(handle)
    assert backend.wait(handle, 1.0) and time.monotonic() - t0 < 0.5
    assert backend.collect(handle)[0] == ExitStatus(137, "SIGKILL", False)
    assert handle.reader is not None
    handle.reader.join(1.0)
    assert not handle.reader.is_alive()  # its thread is gone too
    backend.destroy(handle)
    assert output(spool)[0] == b"before\n"  # the rest of the script never ran


def test_a_killed_process_writes_nothing_more(tmp_path):
    backend = FakeBackend()

    def stubborn(proc: FakeProcess, args: Sequence[str]) -> int:
        proc.sleep(30)
        proc.write(STDOUT, b"late")  # after the kill: dropped, as a dead process writes nothing
        return 0

    backend.register("stubborn", stubborn)
    handle, spool = started(backend, tmp_path, ["stubborn"])
    backend.kill(handle)
    assert handle.reader is not None
    handle.reader.join(1.0)
    assert backend.collect(handle)[0].signal == "SIGKILL"
    backend.destroy(handle)
    assert output(spool) == (b"", b"")


def test_kill_before_start_and_after_the_end_changes_nothing(tmp_path):
    backend = FakeBackend()
    spec = compile_for(backend, ["exit", "5"])
    handle = backend.create(spec)
    backend.kill(handle)  # nothing runs yet: a no-op, as with an engine
    backend.start(handle, new_spool(tmp_path), b"")
    assert backend.wait(handle, 5.0)
    backend.kill(handle)  # already ended: its status stays
    assert backend.collect(handle)[0] == ExitStatus(5, "", False)
    backend.destroy(handle)


def test_the_fakes_own_deadline_kills_past_the_timeout(tmp_path):
    backend = FakeBackend(deadline_slack_s=0.0)
    handle, _ = started(backend, tmp_path, ["sleep", "30"], timeout_ms=100)
    t0 = time.monotonic()
    assert backend.wait(handle, 5.0)
    assert time.monotonic() - t0 < 2.0
    assert backend.collect(handle)[0].signal == "SIGKILL"
    assert "deadline" in backend.verbs(handle.sandbox_id)
    backend.destroy(handle)


def test_without_a_deadline_only_a_kill_ends_it(tmp_path):
    backend = FakeBackend(deadline_slack_s=None)
    handle, _ = started(backend, tmp_path, ["sleep", "30"], timeout_ms=100)
    assert not backend.wait(handle, 0.3)
    backend.destroy(handle)  # destroying a running sandbox kills its process
    assert backend.wait(handle, 1.0) and backend.live == []


# ------------------------------------------------------------------ failures


def test_a_failed_create_leaves_nothing(tmp_path):
    backend = FakeBackend()
    with pytest.raises(BackendUnavailable):
        backend.create(compile_for(backend, ["fail-create", "echo", "x"]))
    backend.fail("create", PermissionDenied("no"))
    with pytest.raises(PermissionDenied):
        backend.create(compile_for(backend, ["echo", "x"]))
    assert backend.live == [] and (backend.created, backend.destroyed) == (0, 0)
    handle = backend.create(compile_for(backend, ["echo", "x"]))  # the injection was used up
    assert backend.live == [handle.sandbox_id]


def test_a_failed_start_leaves_the_sandbox_for_destroy(tmp_path):
    backend = FakeBackend()
    handle = backend.create(compile_for(backend, ["fail-start", "echo", "x"]))
    with pytest.raises(InternalError):
        backend.start(handle, new_spool(tmp_path), b"")
    assert backend.live == [handle.sandbox_id]
    with pytest.raises(InternalError, match="never started"):
        backend.collect(handle)
    backend.destroy(handle)
    assert backend.live == []


def test_a_failed_collect_and_a_failed_destroy(tmp_path):
    backend = FakeBackend()
    handle, spool = started(backend, tmp_path, ["fail-destroy", "echo", "x"])
    assert backend.wait(handle, 5.0)
    backend.fail("collect")
    with pytest.raises(InternalError, match="collect failed"):
        backend.collect(handle)
    assert backend.collect(handle)[0].exit_code == 0  # once
    with pytest.raises(InternalError, match="destroy failed"):
        backend.destroy(handle)
    assert backend.live == [handle.sandbox_id] and backend.destroyed == 0  # it leaked
    backend.destroy(handle)
    assert backend.live == [] and backend.destroyed == 1
    assert output(spool)[0] == b"x\n"  # the failure word is not part of the command


def test_injections_count_down_and_name_real_steps():
    backend = FakeBackend()
    backend.fail("check", times=2)
    for _ in range(2):
        with pytest.raises(BackendUnavailable):
            backend.check()
    backend.check()
    backend.available = False
    with pytest.raises(BackendUnavailable, match="switched off"):
        backend.check()
    with pytest.raises(ValueError):
        backend.fail("nap")  # not a Step: refused at run time too


def test_images_resolve_to_a_stable_digest_and_their_names():
    backend = FakeBackend(images={"sandboxd/default:latest": ("sandboxd/default:latest", "other/name:1")})
    digest, names = backend.resolve_image("sandboxd/default:latest")
    assert digest.startswith("sha256:") and digest == backend.image_digest("sandboxd/default:latest")
    assert names == ("sandboxd/default:latest", "other/name:1")
    with pytest.raises(FailedPrecondition) as info:
        backend.resolve_image("sandboxd/absent:latest")
    assert info.value.field == "runtime.image"
    assert FakeBackend().resolve_image("any/thing:1")[1] == ("any/thing:1",)
    backend.fail("resolve_image")
    with pytest.raises(BackendUnavailable):
        backend.resolve_image("sandboxd/default:latest")


def test_reap_orphans_removes_only_that_daemons_sandboxes(tmp_path):
    backend = FakeBackend()
    mine, _ = started(backend, tmp_path, ["sleep", "30"], daemon_id="sd-old")
    other = backend.create(compile_for(backend, ["true"], daemon_id="sd-other"))
    assert backend.reap_orphans("sd-old") == 1
    assert backend.live == [other.sandbox_id]
    assert backend.wait(mine, 1.0)  # its process went with it
    backend.close()
    assert backend.live == [] and backend.destroyed == 2


# ------------------------------------------------------------------ a warm sandbox's supervisor


def _request(conn: socket.socket, argv: list[str], fds: list[int], cwd: str = "/workspace") -> bytes:
    fields = [cwd, str(len(argv)), *argv, "1", "PATH=/bin"]
    conn.sendmsg([b"\0".join(f.encode() for f in fields) + b"\0"],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    return conn.recv(256)


def test_a_warm_sandbox_serves_the_shims_control_protocol(tmp_path):
    backend = FakeBackend()
    control = Path(tempfile.mkdtemp(prefix="sbxf-", dir="/tmp")) / "c.sock"  # short: a socket path
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(control))
    listener.listen(1)
    policy = resolve()
    spec = backend.compile(policy, PLAN, SandboxIdentity("sd-test", "sbx-warm", "pool:k"), argv=("supervisor",),
                           image="sandboxd/default:latest", stdin_open=False,
                           attachments=Attachments(control_host_socket=str(control)))
    handle = backend.create(spec)
    backend.start(handle, new_spool(tmp_path), b"")
    listener.settimeout(5.0)
    conn = listener.accept()[0]
    conn.settimeout(5.0)
    try:
        assert conn.recv(16) == b"R"
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        os.write(in_w, b"piped")
        os.close(in_w)
        assert _request(conn, ["cat", ";", "echo-err", "e", ";", "exit", "3"], [in_r, out_w, err_w]).startswith(b"P ")
        for fd in (in_r, out_w, err_w):
            os.close(fd)  # the supervisor has its own copies
        assert conn.recv(256) == b"X 768"  # exit 3, as a wait status
        assert (os.read(out_r, 100), os.read(err_r, 100)) == (b"piped", b"e\n")
        null = os.open(os.devnull, os.O_RDONLY)
        assert _request(conn, ["true"], [null]).startswith(b"E need three descriptors")
        os.close(null)
        backend.kill(handle)  # the sandbox dies: its supervisor's connection ends
        assert conn.recv(256) == b""
        assert backend.wait(handle, 1.0)
    finally:
        conn.close()
        listener.close()
        backend.destroy(handle)
        shutil.rmtree(control.parent)


# ------------------------------------------------------------------ the Sandbox and Process over an engine


def test_an_engine_sandbox_runs_one_process_and_its_destroy_removes_the_engines_sandbox(tmp_path):
    backend = FakeBackend()
    sandbox: Sandbox = create_sandbox(backend, compile_for(backend, ["echo", "hi", ";", "exit", "4"]))
    assert backend.live == [sandbox.sandbox_id] and sandbox.engine_id == "fake-1"
    assert sandbox.spec.to_json_dict()["argv"] == ["echo", "hi", ";", "exit", "4"]
    spool = new_spool(tmp_path)
    process: Process = sandbox.start(spool, b"")
    assert process.wait(5.0) and process.output_ended()
    assert process.collect() == (ExitStatus(4, "", False), ResourceUsage(0, 0))
    assert backend.live == [sandbox.sandbox_id]  # an ended process leaves its sandbox standing
    sandbox.destroy()
    assert backend.live == [] and (backend.created, backend.destroyed) == (1, 1)
    assert backend.verbs(sandbox.sandbox_id) == ["create", "start", "collect", "destroy"]
    assert output(spool) == (b"hi\n", b"")


def test_an_engine_process_is_killed_through_its_engine(tmp_path):
    backend = FakeBackend()
    sandbox = create_sandbox(backend, compile_for(backend, ["sleep", "30"]))
    process = sandbox.start(new_spool(tmp_path), b"")
    assert not process.wait(0.05) and not process.output_ended()
    assert process.pid() == 0  # the fake has no host process (a real engine: its init's pid)
    process.kill()
    assert process.wait(1.0) and process.collect()[0] == ExitStatus(137, "SIGKILL", False)
    sandbox.destroy()
    assert backend.live == [] and "kill" in backend.verbs(sandbox.sandbox_id)
