"""The execution boundary on Docker, end to end: a real daemon, real dockerd, the real
client. Each test states the behaviour the issue asks to be shown."""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from pathlib import Path

import grpc
import pytest

from sandboxd_client import errors
from sandboxd_client import client as client_module
from sandboxd_contract.calls import build_call
from sandboxd_contract.canonical import event_hash
from sandboxd_contract.pb import sandboxd_pb2 as pb

from .conftest import (BACKENDS, BUSYBOX_IMAGE, DAEMON_ENV, DAEMON_SECRET, WORKSPACE_UID, AdapterClient, call,
                       leftover_sandboxes, sh, wait_for)


def test_output_arrives_while_the_command_runs(client, workspace):
    arrivals = []
    for event in client.execute(call(workspace, sh("echo first; sleep 2; echo second"))):
        if event.WhichOneof("kind") == "output":
            arrivals.append((time.monotonic(), event.output.data))
    assert b"".join(d for _, d in arrivals) == b"first\nsecond\n"
    first_at = next(t for t, d in arrivals if b"first" in d)
    second_at = next(t for t, d in arrivals if b"second" in d)
    assert second_at - first_at > 1.5, "the first line must be delivered before the second is printed"


def test_stream_order_and_offsets(client, workspace):
    events = list(client.execute(call(workspace, sh("printf abc; printf def >&2; printf ghi"))))
    kinds = [e.WhichOneof("kind") for e in events]
    assert kinds[0] == "accepted" and kinds[1] == "started" and kinds[-1] == "finished"
    assert set(kinds[2:-1]) <= {"output"}
    offsets = {pb.OUTPUT_STREAM_STDOUT: 0, pb.OUTPUT_STREAM_STDERR: 0}
    for e in events[2:-1]:
        assert e.output.offset == offsets[e.output.stream]
        offsets[e.output.stream] += len(e.output.data)
    assert offsets == {pb.OUTPUT_STREAM_STDOUT: 6, pb.OUTPUT_STREAM_STDERR: 3}
    assert all(e.tool_call_id == events[0].tool_call_id for e in events)


def test_a_command_that_closes_its_stdout_early_still_delivers_the_rest(client, workspace):
    out = client.run(call(workspace, sh("echo early; exec 1>&-; sleep 0.5; echo late >&2; exit 3")))
    assert out.stdout == b"early\n" and out.stderr == b"late\n"
    assert out.result.exit_code == 3


def test_a_command_cannot_read_back_or_replace_its_own_output_streams(client, workspace):
    # Reading its stdout pipe back would hide printed output from the record.
    script = """
import os
def attempt(fn):
    try:
        fn(); return "ok"
    except OSError as e:
        return type(e).__name__
print("proc-read", attempt(lambda: open("/proc/self/fd/1", "rb")), flush=True)
print("proc-read-err", attempt(lambda: open("/proc/self/fd/2", "rb")), flush=True)
stdio = "/dev/sandboxd/stdio"
if os.path.isdir(stdio):  # Docker: the FIFOs the shim hands the command
    print("fifo-read", attempt(lambda: open(stdio + "/stdout", "rb")), flush=True)
    print("fifo-chmod", attempt(lambda: os.chmod(stdio + "/stdout", 0o666)), flush=True)
    print("fifo-unlink", attempt(lambda: os.unlink(stdio + "/stdout")), flush=True)
    print("fifo-create", attempt(lambda: os.mkfifo(stdio + "/other")), flush=True)
print("end", flush=True)
"""
    out = client.run(call(workspace, ["python3", "-c", script]))
    lines = out.stdout.decode().splitlines()
    assert out.result.exit_code == 0, out.stderr
    assert lines[:2] == ["proc-read PermissionError", "proc-read-err PermissionError"]
    if client.adapter == "docker":
        assert lines[2:6] == ["fifo-read PermissionError", "fifo-chmod OSError", "fifo-unlink OSError",
                              "fifo-create OSError"], lines
    assert lines[-1] == "end"


def test_without_the_shim_docker_output_comes_over_the_attach_socket(spare_daemon, docker_engine):
    # The shim (and with it the output FIFOs) missing: calls that need it are refused,
    # the others still stream and finish through the attach socket.
    d = spare_daemon(shim_binary="/nonexistent/sandbox-shim").start()
    ws = d.new_workspace()
    with d.client() as c:
        arrivals = []
        for event in c.execute(call(ws, sh("echo out; echo err >&2; sleep 1; echo late; exit 4"),
                                    {"audit": {"recordFileAccess": False}})):
            if event.WhichOneof("kind") == "output":
                arrivals.append((time.monotonic(), event.output.stream, event.output.data))
            elif event.WhichOneof("kind") == "finished":
                result = event.finished.result
        assert result.exit_code == 4
        assert b"".join(d for _, s, d in arrivals if s == pb.OUTPUT_STREAM_STDOUT) == b"out\nlate\n"
        assert b"".join(d for _, s, d in arrivals if s == pb.OUTPUT_STREAM_STDERR) == b"err\n"
        assert arrivals[-1][0] - arrivals[0][0] > 0.5, "output is streamed, not delivered at the end"
        with pytest.raises(errors.Unavailable):
            c.run(call(ws, ["true"]))  # file-access recording (the default) needs the shim
    assert not leftover_sandboxes(docker_engine, d)


def test_exit_code_and_stderr_pass_through(client, workspace):
    out = client.run(call(workspace, sh("echo to-out; echo oops >&2; exit 7")))
    r = out.result
    assert (r.exit_code, r.status, r.error.code) == (7, "error", "NONZERO_EXIT")
    assert out.stdout == b"to-out\n" and out.stderr == b"oops\n"
    assert r.stdout_preview == "to-out\n" and r.stderr_preview == "oops\n"
    assert not r.timed_out and not r.oom_killed and r.signal == ""


def test_success_result_shape(client, workspace):
    r = client.run(call(workspace, ["cat", "/workspace/README.md"])).result
    assert (r.status, r.exit_code) == ("success", 0)
    assert r.stdout_preview == "hello workspace\n"
    assert r.usage.latency_ms > 0 and r.usage.peak_memory_bytes > 0
    assert r.usage.output_bytes == len("hello workspace\n")
    assert r.provenance.event_id and list(r.provenance.artifact_refs) == [a.artifact_id for a in r.artifacts]


def test_stdin_reaches_the_command(client, workspace):
    out = client.run(call(workspace, ["sh", "-c", "tr a-z A-Z"], stdin=b"shout this\n"))
    assert out.stdout == b"SHOUT THIS\n"


def test_writes_only_inside_write_roots_and_owned_by_the_workspace_owner(client, daemon):
    ws = daemon.new_workspace({"src/a.py": "x = 1\n", "out/.keep": ""})
    policy = {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"]}}
    script = (
        "echo new > /workspace/out/made.txt && echo wrote-out; "
        "echo bad > /workspace/src/a.py || echo denied-src; "
        "echo bad > /workspace/evil.txt || echo denied-root; "
        "echo bad > /etc/evil || echo denied-image; "
        "echo tmp > /tmp/t && echo wrote-tmp"
    )
    out = client.run(call(ws, sh(script), policy))
    assert out.stdout.split() == [b"wrote-out", b"denied-src", b"denied-root", b"denied-image", b"wrote-tmp"]
    assert b"Read-only file system" in out.stderr
    made = ws / "out" / "made.txt"
    assert made.read_text() == "new\n"
    assert (made.stat().st_uid, made.stat().st_gid) == (WORKSPACE_UID, WORKSPACE_UID)
    assert (ws / "src" / "a.py").read_text() == "x = 1\n"
    assert not (ws / "evil.txt").exists()


def test_unlisted_parts_of_the_workspace_are_invisible(client, daemon):
    ws = daemon.new_workspace({"docs/guide.md": "guide\n", "private/notes.txt": "hidden\n"})
    policy = {"filesystem": {"readRoots": ["docs"], "writeRoots": []}}
    out = client.run(call(ws, sh("ls -A /workspace; cat /workspace/docs/guide.md; cat /workspace/private/notes.txt"), policy))
    assert out.stdout.split() == [b"docs", b"guide"]
    assert out.result.exit_code != 0 and b"No such file" in out.stderr
    out = client.run(call(ws, sh("touch /workspace/new"), policy))
    assert out.result.exit_code != 0, "the stand-in /workspace must not be writable"


def test_blocked_paths_cannot_be_read_by_any_alias(client, daemon):
    ws = daemon.new_workspace({"app.py": "ok\n", "secret.txt": "TOPSECRET\n", "keys/id_rsa": "PRIVATEKEY\n"})
    os.symlink("secret.txt", ws / "alias")
    policy = {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace"][:0],
                             "blockedPaths": ["secret.txt", "/workspace/keys/"]}}
    probes = [
        "cat /workspace/secret.txt", "cat //workspace//secret.txt", "cat /workspace/./secret.txt",
        "cat /workspace/keys/../secret.txt", "cd /workspace && cat /proc/self/cwd/secret.txt",
        "cat /workspace/alias", "cat /workspace/keys/id_rsa", "ls /workspace/keys",
        "cat /proc/1/root/workspace/secret.txt",
    ]
    script = "; ".join(f"{p} 2>/dev/null" for p in probes) + "; cat /workspace/app.py"
    out = client.run(call(ws, sh(script), policy))
    assert b"TOPSECRET" not in out.stdout and b"PRIVATEKEY" not in out.stdout
    assert out.stdout == b"ok\n"


def test_blocked_path_survives_renaming_its_parent(client, daemon):
    ws = daemon.new_workspace({"conf/secret.env": "TOKEN=abc\n"})
    os.chown(ws / "conf", WORKSPACE_UID, WORKSPACE_UID)
    policy = {"filesystem": {"writeRoots": ["/workspace"], "blockedPaths": ["conf/secret.env"]}}
    out = client.run(call(ws, sh("mv /workspace/conf /workspace/moved 2>&1; cat /workspace/moved/secret.env /workspace/conf/secret.env 2>&1; ln /workspace/moved/secret.env /workspace/hl 2>&1; true"), policy))
    assert b"TOKEN=abc" not in out.stdout
    # The file itself is untouched on the host, wherever its parent now is.
    survivors = [p.read_text() for p in (ws / "conf" / "secret.env", ws / "moved" / "secret.env") if p.exists()]
    assert survivors == ["TOKEN=abc\n"]


def test_hard_linked_blocked_file_is_refused(client, daemon, docker_engine):
    ws = daemon.new_workspace({"secret.txt": "s\n"})
    os.link(ws / "secret.txt", ws / "innocent.txt")
    with pytest.raises(errors.FailedPrecondition) as exc:
        client.run(call(ws, ["true"], {"filesystem": {"readRoots": ["/workspace"], "blockedPaths": ["secret.txt"]}}))
    assert "policy.filesystem.blockedPaths[0]" in exc.value.message and "hard link" in exc.value.message
    assert not leftover_sandboxes(docker_engine, daemon)


def test_timeout_kills_the_whole_tree_within_a_second(client, workspace, docker_engine, daemon):
    start = time.monotonic()
    # A background child that outlives its parent shell, and a foreground sleep.
    out = client.run(call(workspace, sh("(sleep 300 &) ; sleep 300 & sleep 300"), {"process": {"timeoutMs": 1500}}))
    elapsed = time.monotonic() - start
    r = out.result
    assert r.timed_out and r.status == "error" and r.error.code == "TIMEOUT" and r.signal == "SIGKILL"
    assert r.usage.latency_ms < 1500 + 1000
    assert elapsed < 1.5 + 1.0 + 1.0, "timeout + 1 s kill budget + container start"
    assert not leftover_sandboxes(docker_engine, daemon)


def test_background_children_end_with_the_command(client, workspace):
    start = time.monotonic()
    out = client.run(call(workspace, sh("sleep 300 & echo main-done"), {"process": {"timeoutMs": 60000}}))
    assert out.stdout == b"main-done\n" and out.result.exit_code == 0
    assert time.monotonic() - start < 10, "a background child must not keep the call alive"


def test_memory_bomb_is_reported_as_oom_killed(client, workspace):
    bomb = "a = []\nwhile True:\n    a.append(bytearray(8 * 1024 * 1024))\n"
    r = client.run(call(workspace, ["python3", "-c", bomb], {"process": {"maxMemoryMb": 64, "timeoutMs": 30000}})).result
    assert r.oom_killed and r.status == "error" and r.error.code == "OOM_KILLED"
    assert r.exit_code == 137 and not r.timed_out
    assert r.usage.peak_memory_bytes >= 60 * 2**20


def test_fork_bomb_hits_the_pids_limit_and_the_daemon_stays_healthy(client, workspace, daemon):
    bomb = "i=0; while [ $i -lt 200 ]; do sleep 20 & i=$((i+1)); done; echo spawned; ps -e --no-headers | wc -l"
    out = client.run(call(workspace, sh(bomb), {"process": {"maxPids": 32, "timeoutMs": 8000}}))
    assert b"fork" in out.stderr.lower() or b"resource temporarily unavailable" in out.stderr.lower()
    assert daemon.healthy()
    assert client.run(call(workspace, ["echo", "still fine"])).stdout == b"still fine\n"


def test_output_flood_is_capped_flagged_and_does_not_deadlock(client, workspace):
    policy = {"process": {"maxStdoutBytes": 1_000_000, "maxStderrBytes": 1000, "timeoutMs": 60000}}
    out = client.run(call(workspace, sh("head -c 50000000 /dev/zero; head -c 100000 /dev/zero >&2; echo done >&2"), policy))
    r = out.result
    assert r.exit_code == 0 and r.status == "partial" and r.error.code == "OUTPUT_TRUNCATED"
    assert r.stdout_truncated and r.stderr_truncated
    assert len(out.stdout) == 1_000_000 and len(out.stderr) == 1000
    assert r.usage.output_bytes == 50_000_000 + 100_000 + 5
    sizes = {a.kind: a.size_bytes for a in r.artifacts}
    assert sizes == {"stdout": 1_000_000, "stderr": 1000}


def test_the_daemons_environment_is_not_visible(client, workspace):
    out = client.run(call(workspace, sh("env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'"),
                          {"environment": {"inheritedEnv": ["TZ"], "injectedEnv": {"GREETING": "hi"}}}))
    assert DAEMON_SECRET.encode() not in out.stdout
    env = dict(line.split("=", 1) for line in out.stdout.decode().splitlines() if "=" in line)
    assert env["GREETING"] == "hi" and env["TZ"] == "Europe/Berlin"
    assert "SANDBOXD_TEST_DAEMON_SECRET" not in env


def test_inheriting_a_name_outside_the_allowlist_is_refused(client, workspace):
    with pytest.raises(errors.PermissionDenied) as exc:
        client.run(call(workspace, ["env"], {"environment": {"inheritedEnv": ["SANDBOXD_TEST_DAEMON_SECRET"]}}))
    assert "policy.environment.inheritedEnv[0]" in exc.value.message


def test_inheriting_an_allowed_name_the_daemon_lacks_leaves_it_unset(client, workspace):
    assert "LC_ALL" not in DAEMON_ENV
    out = client.run(call(workspace, sh("env"), {"environment": {"inheritedEnv": ["LC_ALL", "TZ"]}}))
    env = dict(line.split("=", 1) for line in out.stdout.decode().splitlines() if "=" in line)
    assert out.result.exit_code == 0 and "LC_ALL" not in env and env["TZ"] == "Europe/Berlin"


def test_identity_is_unprivileged(client, workspace):
    out = client.run(call(workspace, sh("id -u; id -g; grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status")))
    lines = out.stdout.decode().split("\n")
    assert lines[0] == str(WORKSPACE_UID) and lines[1] == str(WORKSPACE_UID)
    status = dict(l.split(":\t") for l in lines[2:] if l)
    assert status["CapEff"] == "0000000000000000" and status["CapPrm"] == "0000000000000000"
    assert status["CapBnd"] == "0000000000000000"
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"


def _interfaces(out) -> list[str]:
    return sorted(line.split(":")[0].strip() for line in out.stdout.decode().splitlines()[2:])


def test_egress_none_has_only_loopback(client, workspace):
    assert _interfaces(client.run(call(workspace, ["cat", "/proc/net/dev"]))) == ["lo"]


def test_egress_open_has_a_network_interface(spare_daemon):
    # denyPrivateNetworks false is the operator's to allow (egress.private_networks_principals).
    d = spare_daemon(egress={"private_networks_principals": ["root"]}).start()
    workspace = d.new_workspace({"README.md": "hello workspace\n"})
    open_policy = {"network": {"egress": "open", "denyPrivateNetworks": False}}
    for adapter in BACKENDS:
        with AdapterClient(str(d.socket), adapter) as client:
            if adapter == "nsjail":
                # nsjail has no network of its own to give: refused, never run on the host's.
                with pytest.raises(errors.Unimplemented) as exc:
                    client.run(call(workspace, ["true"], open_policy))
                assert "policy.network.egress" in exc.value.message
                continue
            assert "eth0" in _interfaces(client.run(call(workspace, ["cat", "/proc/net/dev"], open_policy)))


def test_egress_open_that_must_deny_private_networks_has_no_network_but_the_proxy(client, workspace):
    # 'open' with denyPrivateNetworks (the default) goes through the egress proxy, which
    # checks resolved addresses; the sandbox itself has no route anywhere.
    out = client.run(call(workspace, ["python3", "-c", "import os, socket; print(os.environ['HTTPS_PROXY']); "
                                      "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                                      "s.connect(('127.0.0.1', 9)); print(s.getsockname()[0])"],
                          {"network": {"egress": "open"}}))
    assert out.result.status == "success", out.stderr
    assert out.stdout.decode().split() == ["http://127.0.0.1:3128", "127.0.0.1"]


def test_bad_allow_domain_pattern_is_refused_before_anything_starts(client, workspace, docker_engine, daemon):
    with pytest.raises(errors.InvalidArgument) as exc:
        client.run(call(workspace, ["true"], {"network": {"egress": "allowlist",
                                                            "allowDomains": ["pypi.test", "*.com"]}}))
    assert "policy.network.allowDomains[1]" in exc.value.message and "top-level" in exc.value.message
    assert not leftover_sandboxes(docker_engine, daemon)


def test_artifacts_download_with_matching_sha256(client, workspace):
    out = client.run(call(workspace, sh("seq 1 20000; echo problem >&2")))
    expected_stdout = "".join(f"{i}\n" for i in range(1, 20001)).encode()
    refs = {a.kind: a for a in client.list_artifacts(out.tool_call_id)}
    assert set(refs) == {"stdout", "stderr"}
    for kind, content in (("stdout", expected_stdout), ("stderr", b"problem\n")):
        buf = io.BytesIO()
        ref = client.download_artifact(refs[kind].artifact_id, buf)
        assert buf.getvalue() == content
        assert ref.content_hash == "sha256:" + hashlib.sha256(content).hexdigest() == refs[kind].content_hash
        assert ref.size_bytes == len(content) and ref.tool_call_id == out.tool_call_id and ref.event_id


def test_event_chain_is_complete_ordered_and_hashes_verify(client, workspace):
    out = client.run(call(workspace, sh("echo hi; echo err >&2")))
    trace = client.get_trace(out.tool_call_id)
    assert [e.type for e in trace] == [
        "ToolCallRequested", "ToolArgsValidated", "ToolPolicyChecked", "ToolSandboxPrepared", "ToolCallStarted",
        "ToolCallFinished", "ToolResultValidated", "ArtifactPersisted", "ArtifactPersisted"]
    assert trace[0].parent_event_id == ""
    for prev, cur in zip(trace, trace[1:]):
        assert cur.parent_event_id == prev.event_id and cur.seq > prev.seq
    for e in trace:
        assert e.hash == event_hash(e.seq, e.event_id, e.tool_call_id, e.type, e.time, e.parent_event_id,
                                    e.payload_json, e.prev_hash)
    recorded = json.loads(trace[6].payload_json)["result"]
    assert recorded["exitCode"] == 0 and recorded["toolCallId"] == out.tool_call_id
    assert out.result.provenance.event_id == trace[6].event_id
    persisted = {json.loads(e.payload_json)["artifactId"] for e in trace[7:]}
    assert persisted == {a.artifact_id for a in out.result.artifacts}
    assert {a.event_id for a in out.result.artifacts} == {e.event_id for e in trace[7:]}


@pytest.mark.parametrize("policy, code, field", [
    ({"process": {"timeoutMs": 10**9}}, grpc.StatusCode.INVALID_ARGUMENT, "policy.process.timeoutMs"),
    ({"process": {"maxMemoryMb": 10**7}}, grpc.StatusCode.INVALID_ARGUMENT, "policy.process.maxMemoryMb"),
    ({"network": {"egress": "everywhere"}}, grpc.StatusCode.INVALID_ARGUMENT, "policy.network.egress"),
    ({"filesystem": {"writeRoots": ["/etc"]}}, grpc.StatusCode.INVALID_ARGUMENT, "policy.filesystem.writeRoots[0]"),
    ({"filesystem": {"readRoots": ["../../etc"]}}, grpc.StatusCode.INVALID_ARGUMENT, "policy.filesystem.readRoots[0]"),
    ({"filesystem": {"readRoots": ["/workspace/missing"]}}, grpc.StatusCode.FAILED_PRECONDITION, "policy.filesystem.readRoots[0]"),
])
def test_invalid_policies_are_refused_with_field_and_no_container(client, workspace, docker_engine, daemon, policy, code, field):
    with pytest.raises(errors.SandboxdClientError) as exc:
        client.run(call(workspace, ["true"], policy))
    assert exc.value.code == code and field in exc.value.message
    assert not leftover_sandboxes(docker_engine, daemon)
    trace = client.get_trace(exc.value.tool_call_id)
    assert [e.type for e in trace] == ["ToolCallRequested", "ToolCallRejected"]
    rejected = json.loads(trace[1].payload_json)
    assert rejected["field"] == field and rejected["code"] == code.name


def test_a_refused_call_reserves_no_id(client, workspace):
    """Refusals are recorded under ids of their own: another tenant cannot take the id a
    caller will use with a call that never runs (nor a caller lose its own by a typo)."""
    chosen = f"tc-chosen-{os.urandom(6).hex()}"
    for bad in ({"filesystem": {"readRoots": ["/workspace/missing"]}}, {"process": {"timeoutMs": 10**9}}):
        with pytest.raises(errors.SandboxdClientError) as exc:
            client.run(call(workspace, ["true"], bad, toolCallId=chosen))
        assert exc.value.tool_call_id and exc.value.tool_call_id != chosen
        rejected = json.loads(client.get_trace(exc.value.tool_call_id)[1].payload_json)
        assert rejected["requestedToolCallId"] == chosen
    ok = client.run(call(workspace, ["true"], toolCallId=chosen))
    assert ok.tool_call_id == chosen and ok.result.status == "success"


def test_a_huge_refused_request_is_kept_as_prefixes_and_digests(client, workspace):
    """One refusal of a request with megabytes in it used to grow the log by megabytes,
    forever: a refusal keeps each long string's prefix, length and digest."""
    big = "x" * (8 * 2**20)
    many = ["y" * 100_000] * 100  # each argument allowed, together over max_argv_bytes
    for request, field in ((call(workspace, ["true"], toolId=big), "toolId"),
                           (call(workspace, ["echo", *many]), "argv")):
        with pytest.raises(errors.InvalidArgument) as exc:
            client.run(request)
        assert field in exc.value.message
        trace = client.get_trace(exc.value.tool_call_id)
        assert sum(len(e.payload_json) for e in trace) < 64 * 1024
    requested = json.loads(trace[0].payload_json)
    assert requested["argv"][1].endswith(f"...[100000 characters, sha256:{hashlib.sha256(many[0].encode()).hexdigest()}]")
    assert requested["argv"][-1] == "...[37 more items]"


@pytest.mark.parametrize("patch, field", [
    ({"workspace": "/tmp\x00/etc"}, "workspace"),
    ({"runtime": {"image": "sandboxd/busybox\x00"}}, "runtime.image"),
    ({"credentialRefs": [{"bindingId": "gh", "filePath": "/tmp/x\x00y"}]}, "credentialRefs[0].filePath"),
])
def test_nul_bytes_are_invalid_arguments_naming_the_field(client, workspace, patch, field):
    with pytest.raises(errors.InvalidArgument) as exc:
        client.run({**call(workspace, ["true"]), **patch})
    assert exc.value.message.startswith(f"{field}:") and "NUL" in exc.value.message


def test_a_cancel_reason_is_bounded(client):
    """The reason goes into the call's recorded result: it has a maximum."""
    with pytest.raises(errors.InvalidArgument) as exc:
        client.cancel("tc-whatever", "x" * 1025)
    assert exc.value.message.startswith("reason:")
    with pytest.raises(errors.NotFound):
        client.cancel("tc-whatever", "x" * 1024)


def test_malformed_calls_are_refused(client, workspace):
    cases = [(call(workspace, []), "argv"), ({**call(workspace, ["true"]), "toolId": ""}, "toolId"),
             (call(workspace, ["true"], toolCallId="bad id with spaces"), "toolCallId")]
    for raw, field in cases:
        with pytest.raises(errors.InvalidArgument) as exc:
            client.run(raw)
        assert exc.value.message.startswith(field + ":"), exc.value.message
        assert exc.value.tool_call_id, "the refusal names the trace it was recorded under"


def test_workspaces_outside_the_roots_are_refused(client, daemon, docker_engine, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.chown(outside, WORKSPACE_UID, WORKSPACE_UID)
    inside = daemon.new_workspace()
    escape_link = daemon.workspace_root / f"{inside.name}-link"
    os.symlink(outside, escape_link)
    os.symlink("/etc", inside / "etc-link")
    root_owned = daemon.new_workspace(uid=0)
    cases = [
        (str(outside), {}, grpc.StatusCode.PERMISSION_DENIED, "workspace"),
        (f"{inside}/../../{outside.parent.name}/{outside.name}", {}, grpc.StatusCode.PERMISSION_DENIED, "workspace"),
        (str(escape_link), {}, grpc.StatusCode.PERMISSION_DENIED, "workspace"),
        (str(daemon.workspace_root), {}, grpc.StatusCode.PERMISSION_DENIED, "workspace"),
        (str(inside), {"filesystem": {"readRoots": ["etc-link"]}}, grpc.StatusCode.PERMISSION_DENIED, "policy.filesystem.readRoots[0]"),
        (str(root_owned), {}, grpc.StatusCode.PERMISSION_DENIED, "workspace"),
        ("relative/path", {}, grpc.StatusCode.INVALID_ARGUMENT, "workspace"),
    ]
    for ws, policy, code, field in cases:
        with pytest.raises(errors.SandboxdClientError) as exc:
            client.run(call(ws, ["true"], policy))
        assert exc.value.code == code, (ws, exc.value.message)
        assert field in exc.value.message
    assert not leftover_sandboxes(docker_engine, daemon)


def test_unauthorized_and_expired_calls_are_refused(client, workspace):
    with pytest.raises(errors.PermissionDenied) as exc:
        client.run(call(workspace, ["true"], authorization={"status": "denied"}))
    assert "authorization.status" in exc.value.message
    # "granted" is a claim that needs a signed grant behind it (test_approvals.py has the
    # signed, expired and forged ones).
    with pytest.raises(errors.PermissionDenied) as exc:
        client.run(call(workspace, ["true"], authorization={"status": "granted", "expiresAt": "2020-01-01T00:00:00Z"}))
    assert "authorization.grantId" in exc.value.message


def test_images_outside_the_allowlist_or_absent_are_refused(client, workspace):
    with pytest.raises(errors.PermissionDenied):
        client.run(call(workspace, ["true"], image="debian:latest"))
    with pytest.raises(errors.FailedPrecondition) as exc:
        client.run(call(workspace, ["true"], image="sandboxd/does-not-exist:1"))
    assert "runtime.image" in exc.value.message


def test_a_reused_tool_call_id_is_refused(client, workspace):
    tool_call_id = f"tc-reuse-{client.adapter}"
    client.run(call(workspace, ["true"], toolCallId=tool_call_id))
    kept = [e.event_id for e in client.get_trace(tool_call_id)]
    with pytest.raises(errors.AlreadyExists) as exc:
        client.run(call(workspace, ["true"], toolCallId=tool_call_id))
    assert [e.event_id for e in client.get_trace(tool_call_id)] == kept  # the id stays the first call's
    refused = client.get_trace(exc.value.tool_call_id)
    assert [e.type for e in refused] == ["ToolCallRequested", "ToolCallRejected"]
    rejected = json.loads(refused[1].payload_json)
    assert (rejected["code"], rejected["field"], rejected["requestedToolCallId"]) == (
        "ALREADY_EXISTS", "toolCallId", tool_call_id)


def test_client_disconnect_mid_stream_leaves_no_container(client, workspace, docker_engine, daemon):
    stream = client.execute(call(workspace, sh("echo up; sleep 60")))
    it = iter(stream)
    tool_call_id = ""
    for event in it:
        tool_call_id = event.tool_call_id
        if event.WhichOneof("kind") == "output":
            break
    assert leftover_sandboxes(docker_engine, daemon), "the sandbox should be running now"
    stream.cancel()
    assert wait_for(lambda: not leftover_sandboxes(docker_engine, daemon), timeout_s=10)
    trace = wait_for(lambda: [e for e in client.get_trace(tool_call_id) if e.type == "ToolResultValidated"])
    assert json.loads(trace[0].payload_json)["result"]["status"] == "cancelled"


def test_run_answers_with_the_result_and_the_output_in_one_message(client, workspace):
    request = pb.RunRequest(call=build_call(call(workspace, sh("printf abc; printf def >&2; exit 3"),
                                                 runtime={"adapter": client.adapter})))
    response = client._exec.Run(request)
    assert (response.result.exit_code, response.result.status) == (3, "error")
    assert (response.stdout, response.stderr, response.output_inline) == (b"abc", b"def", True)
    trace = client.get_trace(response.tool_call_id)
    assert response.event_id == next(e.event_id for e in trace if e.type == "ToolCallFinished")
    assert [e.type for e in trace][-2:] == ["ArtifactPersisted", "ArtifactPersisted"]


def test_run_leaves_output_past_its_inline_limit_in_the_artifacts(client, workspace, monkeypatch):
    script = "head -c 5000 /dev/zero | tr '\\0' x"
    request = pb.RunRequest(call=build_call(call(workspace, sh(script), runtime={"adapter": client.adapter})),
                            max_inline_output_bytes=4000)
    response = client._exec.Run(request)
    assert response.result.status == "success"
    assert (response.stdout, response.output_inline) == (b"", False)
    # Unasked, at most 3 MiB comes inline: under gRPC's usual 4 MiB receive limit.
    request = pb.RunRequest(call=build_call(call(workspace, sh("head -c 3200000 /dev/zero"),
                                                 runtime={"adapter": client.adapter})))
    assert not client._exec.Run(request).output_inline
    # The client fetches what was not inline.
    monkeypatch.setattr(client_module, "RUN_INLINE_BYTES", 1000)
    big = client.run(call(workspace, sh("head -c 5000 /dev/zero | tr '\\0' y; echo done >&2")))
    assert big.result.status == "success" and (big.stdout, big.stderr) == (b"y" * 5000, b"done\n")


def test_a_run_whose_caller_goes_away_is_cancelled_and_leaves_no_sandbox(client, workspace, docker_engine, daemon):
    tool_call_id = f"tc-run-gone-{client.adapter}"
    with pytest.raises(errors.DeadlineExceeded):
        client.run(call(workspace, sh("sleep 60"), toolCallId=tool_call_id), timeout_s=1.5)
    assert wait_for(lambda: not leftover_sandboxes(docker_engine, daemon), timeout_s=10)
    trace = wait_for(lambda: [e for e in client.get_trace(tool_call_id) if e.type == "ToolResultValidated"])
    result = json.loads(trace[0].payload_json)["result"]
    assert result["status"] == "cancelled" and result["error"]["message"] == "the client went away"


def test_cancel_rpc_stops_a_running_call(client, workspace, docker_engine, daemon):
    stream = iter(client.execute(call(workspace, sh("sleep 60"))))
    first = next(stream)
    assert first.WhichOneof("kind") == "accepted"
    assert next(stream).WhichOneof("kind") == "started"
    assert client.cancel(first.tool_call_id, "test says stop")
    finished = [e for e in stream if e.WhichOneof("kind") == "finished"][0].finished.result
    assert finished.status == "cancelled" and finished.error.message == "test says stop"
    assert not leftover_sandboxes(docker_engine, daemon)
    assert client.cancel(first.tool_call_id) is False
    with pytest.raises(errors.NotFound):
        client.cancel("tc-never-existed")


def test_file_size_limit(client, workspace):
    out = client.run(call(workspace, sh("head -c 3000000 /dev/zero > /tmp/big; echo rc=$?; wc -c < /tmp/big"),
                          {"process": {"maxFileSizeMb": 1}}))
    assert out.stdout.split()[-1] == b"1048576"


def test_temp_dir_size_limit(client, workspace):
    out = client.run(call(workspace, sh("head -c 20000000 /dev/zero > /tmp/fill; echo rc=$?"), {"process": {"maxTmpSizeMb": 8}}))
    assert b"No space left on device" in out.stderr and b"rc=1" in out.stdout


def test_cpu_quota_limits_cpu_time(client, workspace):
    burn = "import time\nt=time.time()\nwhile time.time()-t<2: pass\n"
    r = client.run(call(workspace, ["python3", "-c", burn], {"process": {"cpuMillicores": 250}})).result
    assert r.exit_code == 0
    # 2 s of wall time at a quarter of a core: about 500 ms of CPU, never the full 2000;
    # over the whole call (a slow host's interpreter start included), a quarter of its
    # wall time plus the scheduler's slack (a slice per CPU per period).
    assert 200 <= r.usage.cpu_ms <= 0.375 * r.usage.latency_ms, (r.usage.cpu_ms, r.usage.latency_ms)


def test_busybox_image_runs(client, workspace):
    out = client.run(call(workspace, ["echo", "tiny"], image=BUSYBOX_IMAGE))
    assert out.stdout == b"tiny\n"


def test_explain_policy_materializes_without_running(client, daemon, docker_engine):
    ws = daemon.new_workspace({"secret.txt": "s", "out/.keep": ""})
    resp = client.explain({"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["out"], "blockedPaths": ["secret.txt", "nope"]},
                           "process": {"maxMemoryMb": 128}}, str(ws))
    spec = json.loads(resp.spec_json)
    mounts = {m["target"]: m for m in spec["mounts"]}
    assert mounts["/workspace"]["read_only"] and not mounts["/workspace/out"]["read_only"]
    assert mounts["/workspace/secret.txt"]["read_only"] and mounts["/tmp"]["type"] == "tmpfs"
    assert spec["memory_bytes"] == 128 * 2**20 and spec["cap_drop"] == ["ALL"] and spec["network_mode"] == "none"
    assert any("nope" in n for n in resp.notes)
    assert json.loads(resp.effective_policy_json)["writeRoots"] == ["/workspace/out"]
    assert not leftover_sandboxes(docker_engine, daemon)


def test_health_and_reflection_answer(daemon):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    assert daemon.healthy()
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"sandboxd.v1.ExecutionService", "sandboxd.v1.ArtifactService", "sandboxd.v1.TraceService",
            "grpc.health.v1.Health"} <= names


def test_a_call_that_writes_a_workspace_runs_alone_on_it(client, daemon):
    # Its writes could turn a directory into a symlink between another call's host checks
    # and that call's mounts; so no other call mounts the workspace while it runs.
    ws = daemon.new_workspace({"out/.keep": "", "a.txt": "a\n"})
    writer = iter(client.execute(call(ws, sh("echo up; sleep 30"),
                                      {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"]}})))
    writer_id = ""
    for event in writer:
        writer_id = event.tool_call_id
        if event.WhichOneof("kind") == "output":
            break
    with pytest.raises(errors.Aborted) as exc:
        client.run(call(ws, ["cat", "/workspace/a.txt"]))
    assert "workspace" in exc.value.message and writer_id in exc.value.message
    other = daemon.new_workspace({"b.txt": "b\n"})
    assert client.run(call(other, ["cat", "/workspace/b.txt"])).stdout == b"b\n", "other workspaces are unaffected"
    assert client.cancel(writer_id, "done")
    list(writer)
    # Readers share a workspace freely once no writer holds it.
    reader = iter(client.execute(call(ws, sh("echo up; sleep 30"))))
    for event in reader:
        if event.WhichOneof("kind") == "output":
            reader_id = event.tool_call_id
            break
    assert client.run(call(ws, ["cat", "/workspace/a.txt"])).stdout == b"a\n"
    client.cancel(reader_id, "done")
    list(reader)


def _running(client, ws, policy) -> tuple[str, object]:
    stream = iter(client.execute(call(ws, sh("echo up; sleep 30"), policy)))
    for event in stream:
        if event.WhichOneof("kind") == "output":
            return event.tool_call_id, stream
    raise AssertionError("the call never printed")


def test_nested_workspaces_count_as_one_for_the_writer_rule(client, daemon):
    """A writer of /a can swap what a call on /a/inner mounts, and a writer of /a/inner
    what a call on /a finds: both directions are one workspace. A sibling whose name
    merely starts the same is another."""
    outer = daemon.new_workspace({"inner/x.txt": "x\n", "out/.keep": ""})
    inner = outer / "inner"
    sibling = Path(f"{outer}-sibling")
    sibling.mkdir()
    (sibling / "s.txt").write_text("s\n")
    os.chown(sibling, WORKSPACE_UID, WORKSPACE_UID)
    os.chown(sibling / "s.txt", WORKSPACE_UID, WORKSPACE_UID)
    write_outer = {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/inner"]}}
    writer_id, writer = _running(client, outer, write_outer)
    with pytest.raises(errors.Aborted) as exc:
        client.run(call(inner, ["cat", "/workspace/x.txt"]))
    assert writer_id in exc.value.message
    assert client.run(call(sibling, ["cat", "/workspace/s.txt"])).stdout == b"s\n"
    client.cancel(writer_id, "done")
    list(writer)
    writer_id, writer = _running(client, inner, {"filesystem": {"writeRoots": ["/workspace"]}})
    with pytest.raises(errors.Aborted) as exc:
        client.run(call(outer, ["cat", "/workspace/inner/x.txt"]))
    assert writer_id in exc.value.message
    client.cancel(writer_id, "done")
    list(writer)


def test_a_workspace_whose_group_is_root_is_refused(client, daemon):
    ws = daemon.new_workspace()
    os.chown(ws, WORKSPACE_UID, 0)
    with pytest.raises(errors.PermissionDenied) as exc:
        client.run(call(ws, ["true"]))
    assert "workspace" in exc.value.message and "group" in exc.value.message


def test_every_argument_reaches_the_command_exactly(client, workspace):
    # nsjail gets the command in its config file: nothing in an argument may end the
    # string it is written in, or add to the config.
    args = ['say "hi"', "back\\slash", "two\nlines", "caf\u00e9 \u2603", '" } mount { src: "/" dst: "/host" }', "",
            "\t\x01\x7f", "-" * 3000]
    out = client.run(call(workspace, ["python3", "-c", "import json, sys; print(json.dumps(sys.argv[1:]))", *args]))
    assert out.result.status == "success", out.stderr
    assert json.loads(out.stdout) == args
