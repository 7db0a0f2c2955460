"""The high-level client's pure parts (sandboxd_client.sandbox_*): the arguments checked
before anything is sent, the call a command makes (in its lease's pool), results and
their messages, the stream's events made into chunks, the file operations' scripts (run
here for real, by dash and by busybox's sh) and what their answers mean, the write-root
check, the acquire's retry clock; and the async client's parity with the blocking one."""

from __future__ import annotations

import inspect
import os
import stat
import subprocess
import typing
from pathlib import Path, PurePosixPath

import pytest

from sandboxd.pools.template import policy_class
from sandboxd.core.settings import LimitSettings
from sandboxd.policy.models import parse_call, resolve_policy
from sandboxd_client import (AsyncSandbox, AsyncSandboxdClient, CommandFailed, CommandResult, PathNotWritable,
                             Sandbox, SandboxdClient, errors)
from sandboxd_client import sandbox_errors as E
from sandboxd_client import sandbox_files as files
from sandboxd_client.aio import AsyncExecuteStream
from sandboxd_client.client import CallOutcome
from sandboxd_client.sandbox_call import (DEFAULT_TOOL_ID, RETRY_DELAYS_S, AcquireWait, SandboxSettings,
                                          checked_argv, command_call)
from sandboxd_client.sandbox_result import (MESSAGE_ARGV_CHARS, MESSAGE_STDERR_CHARS, OutputChunk, StreamCollector,
                                            failure_message)
from sandboxd_contract.calls import build_call
from sandboxd_contract.pb import sandboxd_pb2 as pb

WRITE_OUT = {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"]},
             "environment": {"injectedEnv": {"BASE": "1"}}}
SHELLS = [["dash"], ["busybox", "sh"]]


def settings(**options) -> SandboxSettings:
    return SandboxSettings.checked("/srv/ws", WRITE_OUT, **options)


# ------------------------------------------------------------------ arguments


@pytest.mark.parametrize("argv, error, words", [
    ("pytest -q", TypeError, "['sh', '-c', 'pytest -q']"),
    (b"ls", TypeError, "not one string"),
    ([], ValueError, "argv: empty"),
    ([""], ValueError, "argv[0]: empty"),
    (["ls", 3], TypeError, "argv[1]: a string, not int"),
    (["ls", "a\x00b"], ValueError, "argv[1]: contains a NUL byte"),
])
def test_argv_is_a_list_of_strings_never_a_shell_line(argv, error, words):
    with pytest.raises(error) as refused:
        checked_argv(argv)
    assert words in str(refused.value)


def test_argv_from_any_sequence():
    assert checked_argv(("ls", "-l")) == ["ls", "-l"]


@pytest.mark.parametrize("options, words", [
    ({"adapter": "runc"}, "adapter: 'runc' is not one of docker, nsjail"),
    ({"lease_ms": -1}, "lease_ms: a whole number"),
    ({"wait_ms": True}, "wait_ms: a whole number"),
    ({"wait_ms": 1.5}, "wait_ms: a whole number"),
    ({"tool_id": ""}, "tool_id: must not be empty"),
])
def test_sandbox_settings_are_checked_naming_the_argument(options, words):
    with pytest.raises(ValueError) as refused:
        settings(**options)
    assert words in str(refused.value)


def test_workspace_and_policy_forms():
    with pytest.raises(ValueError, match="workspace: a directory path"):
        SandboxSettings.checked("")
    with pytest.raises(TypeError, match="policy: a mapping"):
        SandboxSettings.checked("/srv/ws", ["not", "a", "policy"])
    assert SandboxSettings.checked(Path("/srv/ws")).workspace == "/srv/ws"
    message = pb.SandboxPolicy(filesystem=pb.FilesystemPolicy(write_roots=["/workspace/out"]))
    assert SandboxSettings.checked("/srv/ws", message).policy == {"filesystem": {"writeRoots": ["/workspace/out"]}}
    # The caller's dict is copied: changing it later changes no sandbox.
    mine = {"filesystem": {"writeRoots": ["/workspace/out"]}}
    held = SandboxSettings.checked("/srv/ws", mine)
    mine["filesystem"]["writeRoots"].append("/workspace")
    assert held.policy == {"filesystem": {"writeRoots": ["/workspace/out"]}}


def test_a_sandbox_takes_a_socket_or_a_client_and_runs_nothing_until_open():
    with pytest.raises(ValueError, match="socket, client: give one"):
        Sandbox("/srv/ws", socket="/run/x.sock", client=object())
    not_async = SandboxdClient.__new__(SandboxdClient)  # (no channel: only its type is looked at)
    with pytest.raises(TypeError, match="client: AsyncSandbox takes a AsyncSandboxdClient, not a "
                                        "SandboxdClient"):
        AsyncSandbox("/srv/ws", client=not_async)
    with pytest.raises(TypeError, match="client: Sandbox takes a SandboxdClient, not a str"):
        Sandbox("/srv/ws", client="/run/x.sock")
    for sandbox in (Sandbox("/srv/ws"), AsyncSandbox("/srv/ws")):
        with pytest.raises(RuntimeError, match="is not open: use it in a `with` block"):
            sandbox.lease_id
    with pytest.raises(RuntimeError, match="not open"):
        Sandbox("/srv/ws").run(["true"])


# ------------------------------------------------------------------ a command's call


def test_a_command_call_is_the_sandboxs_policy_with_its_own_parts_only():
    s = settings(image="sandboxd/busybox:latest", adapter="nsjail", session_id="sess-1")
    call = command_call(s, "lease_abc", ["pytest", "-q"], cwd="/workspace/out", timeout_ms=5000,
                        stdin="input\n", env={"MODE": "test"}, max_stdout_bytes=1024)
    assert call["runtime"] == {"image": "sandboxd/busybox:latest", "adapter": "nsjail", "leaseId": "lease_abc"}
    assert (call["toolId"], call["argv"], call["cwd"], call["stdin"]) == (DEFAULT_TOOL_ID, ["pytest", "-q"],
                                                                          "/workspace/out", b"input\n")
    assert (call["workspace"], call["sessionId"]) == ("/srv/ws", "sess-1")
    assert call["policy"]["process"] == {"timeoutMs": 5000, "maxStdoutBytes": 1024}
    assert call["policy"]["environment"]["injectedEnv"] == {"BASE": "1", "MODE": "test"}
    assert call["authorization"] == {"status": "not_required"}
    assert WRITE_OUT["environment"]["injectedEnv"] == {"BASE": "1"} and "process" not in WRITE_OUT  # untouched
    assert build_call(call).runtime.lease_id == "lease_abc"  # a valid PreparedToolCall
    # The daemon matches a leased call to its pool by the policy minus each command's
    # own parts: the command's call is in the pool its Sandbox acquired from.
    bare = command_call(s, "lease_abc", ["true"])
    assert "policy" in bare and bare["policy"] == WRITE_OUT and "cwd" not in bare and "stdin" not in bare
    limits = LimitSettings(max_cpu_millicores=8000)

    def pool_class(c):
        return policy_class(resolve_policy(parse_call(c), limits, {}))

    assert pool_class(call) == pool_class(bare)
    assert pool_class(call) != pool_class(command_call(SandboxSettings.checked("/srv/ws"), "lease_abc", ["true"]))


def test_a_command_without_a_policy_sends_only_its_own_parts():
    s = SandboxSettings.checked("/srv/ws")
    assert "policy" not in command_call(s, "l", ["true"])
    assert command_call(s, "l", ["true"], timeout_ms=10)["policy"] == {"process": {"timeoutMs": 10}}


@pytest.mark.parametrize("options, error, words", [
    ({"timeout_ms": 0}, ValueError, "timeout_ms: a whole number of milliseconds above 0"),
    ({"timeout_ms": True}, ValueError, "timeout_ms"),
    ({"max_stdout_bytes": -5}, ValueError, "max_stdout_bytes: a whole number of bytes above 0"),
    ({"cwd": ""}, ValueError, "cwd: a sandbox path"),
    ({"stdin": 42}, TypeError, "stdin: bytes or str, not int"),
    ({"env": ["A=1"]}, TypeError, "env: a mapping of names to values, not list"),
    ({"env": {"A": 1}}, TypeError, "env['A']: names and values are strings"),
])
def test_a_commands_options_are_checked_before_anything_is_sent(options, error, words):
    with pytest.raises(error) as refused:
        command_call(settings(), "lease_abc", ["true"], **options)
    assert words in str(refused.value)


def test_an_authorizer_makes_each_calls_authorization_from_the_call():
    seen = []

    def authorize(call):
        seen.append(call)
        return {"status": "granted", "grantId": "g-1", "approvalDigest": f"for {call['argv'][0]}"}

    call = command_call(settings(authorize=authorize), "lease_abc", ["make", "test"], stdin=b"x")
    assert call["authorization"] == {"status": "granted", "grantId": "g-1", "approvalDigest": "for make"}
    assert "authorization" not in seen[0] and seen[0]["argv"] == ["make", "test"] and seen[0]["stdin"] == b"x"
    seen[0]["argv"].append("changed")  # the authorizer got a copy
    assert call["argv"] == ["make", "test"]


# ------------------------------------------------------------------ results


def tool_result(**fields) -> pb.ToolResult:
    return pb.ToolResult(tool_call_id="tc_1", **fields)


def test_a_result_has_the_tool_results_fields_and_the_whole_output():
    raw = tool_result(status="error", exit_code=2, signal="", timed_out=False, stdout_truncated=True,
                      error=pb.ToolError(code="NONZERO_EXIT", message="the command exited with 2", retryable=False),
                      artifacts=[pb.ArtifactRef(artifact_id="art_1", kind="stdout", uri="file://x",
                                                content_hash="sha256:ab", size_bytes=3, summary="3 bytes")])
    r = CommandResult.from_outcome(["make"], CallOutcome("tc_1", raw, b"out\xff", b"err"))
    assert (r.tool_call_id, r.status, r.exit_code, r.stdout, r.stderr) == ("tc_1", "error", 2, b"out\xff", b"err")
    assert r.text == "out\ufffd" and r.stderr_text == "err" and r.stdout_truncated and not r.ok
    assert (r.error.code, r.error.message, r.error.retryable) == ("NONZERO_EXIT", "the command exited with 2", False)
    [art] = r.artifacts
    assert (art.artifact_id, art.kind, art.content_hash, art.size_bytes) == ("art_1", "stdout", "sha256:ab", 3)
    assert r.raw is raw and r.argv == ("make",)
    assert CommandResult.of(["true"], tool_result(status="success"), b"", b"").error is None


def test_a_result_names_the_files_the_command_changed_and_its_diff():
    raw = tool_result(status="success", artifacts=[
        pb.ArtifactRef(artifact_id="art_out", kind="stdout"),
        pb.ArtifactRef(artifact_id="art_f", kind="file", path="/workspace/b", change="renamed",
                       previous_path="/workspace/a", file_mode="0644"),
        pb.ArtifactRef(artifact_id="art_d", kind="diff")])
    r = CommandResult.of(["mv", "a", "b"], raw, b"", b"")
    [moved] = r.changed_files
    assert (moved.path, moved.change, moved.previous_path, moved.file_mode) == ("/workspace/b", "renamed",
                                                                               "/workspace/a", "0644")
    assert r.diff is not None and r.diff.artifact_id == "art_d"
    assert CommandResult.of(["true"], tool_result(status="success"), b"", b"").diff is None


@pytest.mark.parametrize("status, exit_code, ok", [("success", 0, True), ("partial", 0, True), ("error", 1, False),
                                                    ("error", -1, False), ("cancelled", 0, False)])
def test_check_passes_a_command_that_ran_and_exited_0(status, exit_code, ok):
    r = CommandResult.of(["x"], tool_result(status=status, exit_code=exit_code), b"", b"")
    assert r.ok is ok
    if ok:
        assert r.check() is r
    else:
        with pytest.raises(CommandFailed) as failed:
            r.check()
        assert failed.value.result is r and failed.value.tool_call_id == "tc_1"
        assert isinstance(failed.value, errors.SandboxdClientError)


@pytest.mark.parametrize("fields, words", [
    ({"timed_out": True, "exit_code": 137, "error": pb.ToolError(code="TIMEOUT", message="killed after 300 ms")},
     "make -j4 timed out (TIMEOUT: killed after 300 ms); call tc_1"),
    ({"oom_killed": True, "exit_code": 137}, "was killed at its memory limit"),
    ({"status": "cancelled"}, "was cancelled"),
    ({"exit_code": -1, "error": pb.ToolError(code="BACKEND_FAILED", message="no such image")},
     "could not run (BACKEND_FAILED: no such image)"),
    ({"exit_code": 2}, "make -j4 exited with 2; call tc_1"),
])
def test_a_failure_message_says_the_first_cause(fields, words):
    r = CommandResult.of(["make", "-j4"], tool_result(**{"status": "error", **fields}), b"", b"")
    assert words in failure_message(r)


def test_a_failure_message_shows_the_end_of_stderr_and_a_short_argv():
    stderr = b"early line\n" + b"x" * MESSAGE_STDERR_CHARS + b"\nthe last line\n"
    long_argv = ["echo", "y" * (2 * MESSAGE_ARGV_CHARS)]
    message = failure_message(CommandResult.of(long_argv, tool_result(status="error", exit_code=1), b"", stderr))
    first, _, rest = message.partition("\n")
    assert len(first.split(" exited")[0]) == MESSAGE_ARGV_CHARS and first.split(" exited")[0].endswith("...")
    assert rest.startswith("stderr (its end):\n") and rest.endswith("the last line") and "early line" not in rest
    short = failure_message(CommandResult.of(["false"], tool_result(status="error", exit_code=1), b"", b"why\n"))
    assert short.endswith("\nstderr:\nwhy")


def test_a_results_repr_is_one_short_line_without_the_output():
    r = CommandResult.of(["cat", "big"], tool_result(status="success"), b"s" * 100_000, b"")
    assert repr(r) == ("CommandResult(argv='cat big', status='success', exit_code=0, stdout=100000 bytes, "
                       "stderr=0 bytes, tool_call_id='tc_1')")


def event(kind: str, **fields) -> pb.ExecuteEvent:
    return pb.ExecuteEvent(tool_call_id="tc_s", **{kind: fields.pop("message")}, **fields)


def test_a_streams_events_become_chunks_and_then_its_result():
    collector = StreamCollector(["sh", "-c", "x"])
    events = [event("accepted", message=pb.CallAccepted(tool_call_id="tc_s", backend="docker")),
              event("started", message=pb.CallStarted(sandbox_id="sbx")),
              event("output", message=pb.OutputChunk(stream=pb.OUTPUT_STREAM_STDOUT, offset=0, data=b"one\n")),
              event("output", message=pb.OutputChunk(stream=pb.OUTPUT_STREAM_STDERR, offset=0, data=b"err\n")),
              event("output", message=pb.OutputChunk(stream=pb.OUTPUT_STREAM_STDOUT, offset=4, data=b"two\n"))]
    chunks = [c for c in map(collector.add, events) if c is not None]
    assert chunks == [OutputChunk("stdout", b"one\n", 0), OutputChunk("stderr", b"err\n", 0),
                      OutputChunk("stdout", b"two\n", 4)]
    assert chunks[0].text == "one\n" and not collector.finished
    with pytest.raises(errors.SandboxdClientError, match="call tc_s: the stream ended without a result"):
        collector.final()
    collector.add(event("finished", message=pb.CallFinished(result=tool_result(status="success"))))
    result = collector.final()
    assert (result.stdout, result.stderr, result.tool_call_id) == (b"one\ntwo\n", b"err\n", "tc_1")
    with pytest.raises(errors.SandboxdClientError, match="unknown stream"):
        collector.add(event("output", message=pb.OutputChunk(stream=pb.OUTPUT_STREAM_UNSPECIFIED, data=b"?")))


# ------------------------------------------------------------------ files: paths and the write check


@pytest.mark.parametrize("given, path", [
    ("/workspace/a.txt", "/workspace/a.txt"), ("a.txt", "/workspace/a.txt"), ("out/../b", "/workspace/b"),
    ("//workspace//x/./y/", "/workspace/x/y"), (PurePosixPath("/tmp/z"), "/tmp/z"), ("../etc/passwd", "/etc/passwd"),
])
def test_a_sandbox_path_is_absolute_and_normalized(given, path):
    assert files.sandbox_path(given) == path


@pytest.mark.parametrize("given, error", [("", ValueError), ("a\x00b", ValueError), (b"/workspace", TypeError)])
def test_a_sandbox_path_is_refused_when_it_cannot_be_one(given, error):
    with pytest.raises(error, match="^path: "):
        files.sandbox_path(given)


def test_a_write_is_allowed_under_a_write_root_or_the_temp_dir_only():
    view = files.WritableView.from_effective_policy({"writeRoots": ["/workspace/out", "/workspace/build"],
                                                     "tempDir": "/tmp", "blockedPaths": ["/workspace/out/.git"]})
    for allowed in ("/workspace/out/a", "/workspace/out", "/workspace/build/x/y", "/tmp/scratch", "/tmp"):
        assert view.refusal(allowed) is None, allowed
    for refused in ("/workspace/outside", "/workspace/a", "/workspace", "/etc/passwd", "/tmpfile"):
        assert view.refusal(refused) == (f"{refused} is not under the sandbox's write roots (/workspace/out, "
                                         "/workspace/build) nor its tempDir (/tmp): the policy's "
                                         "filesystem.writeRoots say where a command may write")
    assert "blocked path" in view.refusal("/workspace/out/.git/config")
    read_only = files.WritableView.from_effective_policy({"writeRoots": [], "tempDir": "/tmp"})
    assert "write roots (none)" in read_only.refusal("/workspace/a")


def test_file_errors_are_client_errors_and_the_matching_os_errors():
    cases = [(E.SandboxFileNotFound, FileNotFoundError, errors.NotFound),
             (E.SandboxIsADirectory, IsADirectoryError, errors.FailedPrecondition),
             (E.SandboxNotADirectory, NotADirectoryError, errors.FailedPrecondition),
             (E.SandboxPermissionError, PermissionError, errors.PermissionDenied),
             (PathNotWritable, PermissionError, errors.PermissionDenied),
             (E.SandboxOutputTruncated, E.SandboxFileError, errors.ResourceExhausted)]
    for cls, builtin, client_error in cases:
        exc = cls("/workspace/x: why", "/workspace/x", "tc_9")
        assert isinstance(exc, builtin) and isinstance(exc, client_error)
        assert (str(exc), exc.message, exc.path, exc.tool_call_id) == ("/workspace/x: why",) * 2 + ("/workspace/x",
                                                                                                     "tc_9")
        assert exc.code == client_error.code


# ------------------------------------------------------------------ files: the scripts, run here


def run_script(shell: list[str], command: files.FileCommand, cwd: Path) -> CommandResult:
    """A file command's script run by `shell` on this host, its answer as a result."""
    argv = command.argv
    assert argv[:2] == ["/bin/sh", "-c"]
    p = subprocess.run(shell + argv[1:], input=command.stdin or b"", capture_output=True, cwd=cwd)
    status = "success" if p.returncode == 0 else "error"
    return CommandResult.of(argv, tool_result(status=status, exit_code=p.returncode), p.stdout, p.stderr)


@pytest.fixture(params=SHELLS, ids=lambda s: s[0])
def shell(request):
    return request.param


def test_the_read_script_answers_by_exit_status(shell, tmp_path):
    (tmp_path / "f").write_bytes(b"\x00content\xff")
    (tmp_path / "d").mkdir()
    read = lambda p: files.read_outcome(p, run_script(shell, files.read_command(p), tmp_path))  # noqa: E731
    assert read(str(tmp_path / "f")) == b"\x00content\xff"
    with pytest.raises(E.SandboxFileNotFound, match="no such file in the sandbox"):
        read(str(tmp_path / "missing"))
    with pytest.raises(E.SandboxIsADirectory):
        read(str(tmp_path / "d"))


def test_the_write_script_writes_stdin_and_answers_by_exit_status(shell, tmp_path):
    def write(path, data, parents=False):
        files.write_outcome(path, run_script(shell, files.write_command(path, data, parents), tmp_path))

    write(str(tmp_path / "new"), "text é\n")
    assert (tmp_path / "new").read_bytes() == "text é\n".encode()
    write(str(tmp_path / "new"), b"")
    assert (tmp_path / "new").read_bytes() == b""
    write(str(tmp_path / "a" / "b" / "c"), bytearray(b"deep"), parents=True)
    assert (tmp_path / "a" / "b" / "c").read_bytes() == b"deep"
    with pytest.raises(E.SandboxFileNotFound, match=r"/nope: no such directory in the sandbox \(parents=True"):
        write(str(tmp_path / "nope" / "x"), "x")
    with pytest.raises(E.SandboxIsADirectory):
        write(str(tmp_path / "a"), "x")
    with pytest.raises(E.SandboxNotADirectory):
        write(str(tmp_path / "new" / "x"), "x")
    os.symlink("/proc/version", tmp_path / "link-to-proc")  # a file no one may write, even root
    with pytest.raises(PathNotWritable, match="the sandbox refused the write") as refused:
        write(str(tmp_path / "link-to-proc"), "x")
    assert "the sandbox said:" in refused.value.message
    with pytest.raises(TypeError, match="data: bytes or str, not int"):
        files.write_command("/workspace/x", 5)
    assert not (tmp_path / "nope").exists()


def test_the_list_script_lists_every_name_once_with_its_kind(shell, tmp_path):
    names = ["plain", ".hidden", "..dots", "-dash", "new\nline", "sp ace", "*", "é"]
    for name in names:
        (tmp_path / name).write_bytes(b"12345")
    (tmp_path / "sub").mkdir()
    (tmp_path / "link").symlink_to("nowhere")  # dangling: listed as the link it is
    os.mkfifo(tmp_path / "fifo")
    os.chmod(tmp_path / "plain", 0o640)
    entries = files.list_outcome(str(tmp_path), run_script(shell, files.list_command(str(tmp_path)), tmp_path))
    by_name = {e.name: e for e in entries}
    assert sorted(by_name) == sorted(names + ["sub", "link", "fifo"]) == [e.name for e in entries]
    assert by_name["plain"].is_file and by_name["plain"].size == 5 and by_name["plain"].mode == 0o640
    assert by_name["sub"].is_dir and by_name["link"].kind == "symlink" and by_name["fifo"].kind == "other"
    assert by_name["new\nline"].path == f"{tmp_path}/new\nline"
    assert abs(by_name["plain"].modified - (tmp_path / "plain").stat().st_mtime) < 2
    empty = tmp_path / "sub"
    assert files.list_outcome(str(empty), run_script(shell, files.list_command(str(empty)), tmp_path)) == []
    with pytest.raises(E.SandboxNotADirectory):
        files.list_outcome(str(tmp_path / "plain"),
                           run_script(shell, files.list_command(str(tmp_path / "plain")), tmp_path))
    with pytest.raises(E.SandboxFileNotFound):
        files.list_outcome(str(tmp_path / "gone"),
                           run_script(shell, files.list_command(str(tmp_path / "gone")), tmp_path))


def test_a_listing_whose_parts_disagree_is_refused():
    with pytest.raises(errors.SandboxdClientError, match="changed while it was listed"):
        files.parse_listing("/workspace", b"./a\x00./b\x00" + b"81a4 1 0\n")
    assert files.parse_listing("/workspace", b"") == []
    [entry] = files.parse_listing("/w", b"./x\x00" + f"{stat.S_IFDIR | 0o755:x} 4096 17\n".encode())
    assert (entry.name, entry.path, entry.kind, entry.mode, entry.size, entry.modified) == \
        ("x", "/w/x", "directory", 0o755, 4096, 17)


def answer(exit_code: int, *, status: str = "", stdout: bytes = b"", **fields) -> CommandResult:
    status = status or ("success" if exit_code == 0 else "error")
    return CommandResult.of(["sh"], tool_result(status=status, exit_code=exit_code, **fields), stdout, b"")


def test_a_helper_that_did_not_run_to_its_end_is_a_failed_command_whatever_its_code():
    with pytest.raises(CommandFailed, match="timed out"):
        files.read_outcome("/workspace/x", answer(files.EXIT_NOT_FOUND, timed_out=True))
    with pytest.raises(CommandFailed, match="could not run"):
        files.write_outcome("/workspace/x", answer(-1))
    with pytest.raises(CommandFailed, match="exited with 1"):
        files.list_outcome("/workspace", answer(1))


def test_output_past_its_cap_is_refused_not_returned_cut():
    with pytest.raises(E.SandboxOutputTruncated, match="larger than the command's output cap"):
        files.read_outcome("/workspace/big", answer(0, status="partial", stdout=b"x" * 10, stdout_truncated=True))
    with pytest.raises(E.SandboxOutputTruncated, match="listing"):
        files.list_outcome("/workspace", answer(0, status="partial", stdout=b"", stdout_truncated=True))
    assert files.read_command("/workspace/big", 10).max_stdout_bytes == 10


# ------------------------------------------------------------------ the acquire's retry clock


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_an_acquire_is_retried_with_growing_delays_until_wait_ms_is_spent():
    clock = Clock()
    wait = AcquireWait(1000, clock)
    assert wait.remaining_ms() == 1000
    delays = []
    while (delay := wait.next_delay()) is not None:
        delays.append(delay)
        clock.now += delay
    assert delays == [0.05, 0.1, 0.2, 0.4, pytest.approx(0.25)] and list(RETRY_DELAYS_S[:4]) == delays[:4]
    assert wait.remaining_ms() == 0  # the last try is made at the deadline
    long = AcquireWait(5000, clock)
    later = [long.next_delay() for _ in range(8)]
    assert later[-1] == RETRY_DELAYS_S[-1] == max(later)  # no delay grows past the last
    assert AcquireWait(0, clock).next_delay() is None and AcquireWait(0, clock).remaining_ms() == 0


# ------------------------------------------------------------------ the async client's parity


def public_methods(cls) -> dict[str, object]:
    return {name: member for name, member in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def test_the_async_client_has_every_method_of_the_blocking_one():
    blocking, asynchronous = public_methods(SandboxdClient), public_methods(AsyncSandboxdClient)
    assert set(blocking) <= set(asynchronous), set(blocking) - set(asynchronous)
    for name, method in asynchronous.items():
        if name in ("execute", "stream_output"):  # streams: `async for` over what they return
            assert typing.get_type_hints(method)["return"] is AsyncExecuteStream, name
        elif name in ("export_events", "iter_calls"):
            assert inspect.isasyncgenfunction(method), name
        else:
            assert inspect.iscoroutinefunction(method), name
        assert list(inspect.signature(method).parameters) == list(inspect.signature(blocking[name]).parameters), name


def test_the_async_sandbox_has_every_method_of_the_blocking_one():
    blocking, asynchronous = public_methods(Sandbox), public_methods(AsyncSandbox)
    assert set(blocking) == set(asynchronous)
    for name in blocking:
        if name != "stream":
            assert inspect.iscoroutinefunction(asynchronous[name]), name
        assert list(inspect.signature(asynchronous[name]).parameters) == \
            list(inspect.signature(blocking[name]).parameters), name
