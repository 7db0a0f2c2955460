"""sandboxd_client: error mapping, build_call, and the CLI's pure parts."""

from __future__ import annotations

import base64
import copy
import json

import grpc
import pytest
from google.protobuf import json_format

import sandboxd.core.errors as daemon_errors
from sandboxd.api.errors import status_code
from sandboxd_client import cli
from sandboxd_client import errors as E
from sandboxd_client.client import build_call, default_socket, to_json
from sandboxd_contract.pb import sandboxd_pb2 as pb


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details="", metadata=(), metadata_raises=False):
        self._code, self._details, self._md, self._raises = code, details, metadata, metadata_raises

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        if self._raises:
            raise RuntimeError("no metadata on a transport failure")
        return self._md


# ------------------------------------------------------------------ errors.from_rpc_error


EXPECTED = {
    grpc.StatusCode.INVALID_ARGUMENT: E.InvalidArgument,
    grpc.StatusCode.PERMISSION_DENIED: E.PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: E.Unauthenticated,
    grpc.StatusCode.NOT_FOUND: E.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: E.AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: E.FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: E.ResourceExhausted,
    grpc.StatusCode.ABORTED: E.Aborted,
    grpc.StatusCode.UNIMPLEMENTED: E.Unimplemented,
    grpc.StatusCode.UNAVAILABLE: E.Unavailable,
    grpc.StatusCode.CANCELLED: E.Cancelled,
    grpc.StatusCode.DEADLINE_EXCEEDED: E.DeadlineExceeded,
    grpc.StatusCode.INTERNAL: E.Internal,
}


@pytest.mark.parametrize("code", list(grpc.StatusCode), ids=lambda c: c.name)
def test_every_status_code_maps(code):
    exc = E.from_rpc_error(FakeRpcError(code, "the details"))
    want = EXPECTED.get(code, E.SandboxdClientError)
    assert type(exc) is want
    assert isinstance(exc, E.SandboxdClientError)
    assert exc.code == code
    assert exc.message == "the details" and str(exc) == "the details"


def test_unmapped_code_does_not_change_the_class_attribute():
    E.from_rpc_error(FakeRpcError(grpc.StatusCode.DATA_LOSS, "x"))
    assert E.SandboxdClientError.code == grpc.StatusCode.UNKNOWN


@pytest.mark.parametrize("cls", [c for c in vars(daemon_errors).values()
                                 if isinstance(c, type) and issubclass(c, daemon_errors.SandboxdError)])
def test_every_daemon_error_has_a_client_class(cls):
    code = status_code(cls)  # the status the daemon's interceptor sends for it
    exc = E.from_rpc_error(FakeRpcError(code, "m"))
    assert exc.code == code
    if cls is not daemon_errors.SandboxdError:
        assert type(exc) is not E.SandboxdClientError, f"{cls.__name__} ({code.name}) has no client class"


def test_tool_call_id_from_trailing_metadata():
    exc = E.from_rpc_error(FakeRpcError(grpc.StatusCode.PERMISSION_DENIED, "no",
                                        metadata=(("other", "x"), ("sandboxd-tool-call-id", "tc_123"))))
    assert exc.tool_call_id == "tc_123"


def test_no_metadata():
    assert E.from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "x", metadata=None)).tool_call_id == ""
    assert E.from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "x", metadata_raises=True)).tool_call_id == ""


def test_empty_details_fall_back_to_code_name():
    assert E.from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "")).message == "UNAVAILABLE"


def test_bare_rpc_error():
    exc = E.from_rpc_error(grpc.RpcError("transport broke"))
    assert type(exc) is E.SandboxdClientError
    assert exc.code == grpc.StatusCode.UNKNOWN
    assert "transport broke" in exc.message


# ------------------------------------------------------------------ build_call


CALL = {
    "toolCallId": "tc-1",
    "toolId": "shell",
    "argv": ["sh", "-c", "echo hi"],
    "workspace": "/home/alice/project",
    "policy": {
        "filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"], "tempDir": "/tmp"},
        "network": {"egress": "none", "denyPrivateNetworks": True},
        "environment": {"inheritedEnv": ["TZ"], "injectedEnv": {"A": "1"}},
        "process": {"timeoutMs": 5000, "maxMemoryMb": "256"},
    },
    "authorization": {"status": "granted", "grantId": "g-1", "expiresAt": "2030-01-01T00:00:00Z"},
    "runtime": {"adapter": "docker", "image": "sandboxd/default:latest"},
}


def test_build_call_from_camel_case():
    m = build_call(CALL)
    assert isinstance(m, pb.PreparedToolCall)
    assert m.tool_call_id == "tc-1" and m.tool_id == "shell"
    assert list(m.argv) == ["sh", "-c", "echo hi"]
    assert list(m.policy.filesystem.read_roots) == ["/workspace"]
    assert m.policy.HasField("filesystem")
    assert m.policy.network.HasField("deny_private_networks") and m.policy.network.deny_private_networks
    assert dict(m.policy.environment.injected_env) == {"A": "1"}
    assert m.policy.process.timeout_ms == 5000 and m.policy.process.max_memory_mb == 256
    assert m.authorization.grant_id == "g-1"
    assert m.runtime.image == "sandboxd/default:latest"
    assert m.stdin == b""


def test_build_call_unset_filesystem_stays_unset():
    m = build_call({"toolId": "t", "argv": ["x"], "workspace": "/w"})
    assert not m.policy.HasField("filesystem")
    assert not m.policy.network.HasField("deny_private_networks")


@pytest.mark.parametrize("stdin", [b"\x00binary\xff", bytearray(b"\x00binary\xff"),
                                   base64.b64encode(b"\x00binary\xff").decode()])
def test_build_call_stdin(stdin):
    assert build_call({**CALL, "stdin": stdin}).stdin == b"\x00binary\xff"


def test_build_call_does_not_mutate_its_input():
    data = copy.deepcopy({**CALL, "stdin": b"x"})
    before = copy.deepcopy(data)
    build_call(data)
    assert data == before


def test_build_call_passes_messages_through():
    m = pb.PreparedToolCall(tool_id="t")
    assert build_call(m) is m


def test_build_call_refuses_unknown_fields():
    with pytest.raises(json_format.ParseError):
        build_call({**CALL, "bogus": 1})


def test_to_json_round_trip():
    d = to_json(build_call(CALL))
    assert d["toolCallId"] == "tc-1"
    assert d["policy"]["process"]["timeoutMs"] == "5000"  # uint64 as a string, per proto3 JSON
    assert d["cwd"] == ""  # fields without presence are printed
    assert build_call(d) == build_call(CALL)


def test_default_socket(monkeypatch):
    monkeypatch.delenv("SANDBOXD_SOCKET", raising=False)
    assert default_socket() == "/run/sandboxd/sandboxd.sock"
    monkeypatch.setenv("SANDBOXD_SOCKET", "/tmp/x.sock")
    assert default_socket() == "/tmp/x.sock"


# ------------------------------------------------------------------ cli


@pytest.mark.parametrize("fields, code", [
    ({"status": "success", "exit_code": 0}, 0),
    ({"status": "error", "exit_code": 3}, 3),
    ({"status": "error", "exit_code": 255}, 255),
    ({"status": "error", "exit_code": 137, "timed_out": True, "signal": "SIGKILL"}, 124),
    ({"status": "error", "exit_code": 137, "oom_killed": True}, 137),
    ({"status": "error", "exit_code": 0, "oom_killed": True}, 137),
    ({"status": "error", "exit_code": 137, "timed_out": True, "oom_killed": True}, 124),
    ({"status": "cancelled", "exit_code": 137}, 130),
    ({"status": "cancelled", "exit_code": -1}, 130),
    ({"status": "error", "exit_code": -1}, 125),
    ({"status": "error", "exit_code": -7}, 125),
    ({"status": "partial", "exit_code": 0}, 0),
])
def test_exit_code_for(fields, code):
    assert cli.exit_code_for(pb.ToolResult(**fields)) == code


def test_load_policy_json(tmp_path):
    p = tmp_path / "policy.json"
    p.write_text(json.dumps({"filesystem": {"readRoots": ["/workspace"]}, "process": {"timeoutMs": "5000"}}))
    assert cli.load_policy(str(p)) == {"filesystem": {"readRoots": ["/workspace"]}, "process": {"timeoutMs": "5000"}}


def test_load_policy_yaml(tmp_path):
    p = tmp_path / "policy.yaml"
    p.write_text("filesystem:\n  readRoots: [/workspace]\n  blockedPaths:\n    - .env\nnetwork:\n  egress: none\n"
                 "process:\n  timeoutMs: 5000\n")
    assert cli.load_policy(str(p)) == {"filesystem": {"readRoots": ["/workspace"], "blockedPaths": [".env"]},
                                       "network": {"egress": "none"}, "process": {"timeoutMs": 5000}}


@pytest.mark.parametrize("text", ["[1, 2]", "just a string", "", "42"])
def test_load_policy_refuses_non_mapping(tmp_path, text):
    p = tmp_path / "policy.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match="mapping"):
        cli.load_policy(str(p))


def test_loaded_policy_builds_a_call(tmp_path):
    p = tmp_path / "policy.yaml"
    p.write_text("filesystem:\n  readRoots: [/workspace]\nprocess:\n  maxMemoryMb: 128\n")
    m = build_call({"toolId": "t", "argv": ["x"], "workspace": "/w", "policy": cli.load_policy(str(p))})
    assert m.policy.process.max_memory_mb == 128


def test_cli_exec_without_command_is_refused(capsys):
    assert cli.main(["exec", "--"]) == cli.EXIT_REFUSED
    assert "needs a command" in capsys.readouterr().err


def test_cli_exec_with_bad_env_is_refused(capsys):
    assert cli.main(["exec", "--env", "NOEQUALS", "--", "true"]) == cli.EXIT_REFUSED
    assert "NAME=VALUE" in capsys.readouterr().err


def test_cli_exec_with_missing_policy_file_is_refused(tmp_path, capsys):
    assert cli.main(["exec", "--policy", str(tmp_path / "nope.yaml"), "--", "true"]) == cli.EXIT_REFUSED
    assert "nope.yaml" in capsys.readouterr().err


def test_cli_parser_requires_a_command():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([])


@pytest.mark.parametrize("text, flag", [("process:\n", ["--timeout-ms", "5"]),
                                        ("environment:\n", ["--env", "A=1"])])
def test_cli_exec_with_null_policy_section_does_not_crash(tmp_path, capsys, text, flag):
    # `process:` with no value loads as None; cmd_exec then does None["timeoutMs"] = ...
    # and dies with a TypeError traceback instead of a sandboxctl error and exit 125.
    p = tmp_path / "policy.yaml"
    p.write_text(text)
    code = cli.main(["exec", "--socket", str(tmp_path / "no-daemon.sock"), "--policy", str(p), *flag, "--", "true"])
    assert code == cli.EXIT_REFUSED
    assert "sandboxctl:" in capsys.readouterr().err


def test_a_file_access_event_reads_as_one_line_in_every_form():
    reads = {"reads": [[f"/workspace/f{i}", 1] for i in range(5)]}
    assert cli.file_access_line(reads) == (
        "5 read: read /workspace/f0, read /workspace/f1, read /workspace/f2, and 2 more")
    entries = {"accesses": [{"path": "/workspace/new", "operation": "create"},
                            {"path": "/workspace/a", "operation": "rename", "renamedTo": "/workspace/b"}]}
    assert cli.file_access_line(entries) == (
        "1 create, 1 rename: create /workspace/new, rename /workspace/a -> /workspace/b")
    assert cli.file_access_line({"path": "/workspace/x", "operation": "write"}) == "1 write: write /workspace/x"
    incomplete = {"accesses": [], "incomplete": ["the kernel's event queue overflowed"]}
    assert cli.file_access_line(incomplete) == "incomplete: the kernel's event queue overflowed"
    assert cli.file_access_line({}) == "no accesses"


def test_names_from_a_sandbox_cannot_forge_or_erase_a_trace_line():
    forged = "/workspace/x\n       9  2026-12-03T00:00:00Z  ToolCallFinished  ev_fake  ok\x1b[2K\r"
    line = cli.file_access_line({"reads": [[forged, 1]], "incomplete": ["a \x1b[1A reason"]})
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert "/workspace/x\\n       9" in line and "\\u001b[2K" in line  # escaped, still readable
    attempt = {"protocol": "connect", "host": "evil.test\n   ok", "port": 443, "decision": "denied\x1b[2K",
               "rule": "not-allowed", "reason": "x\ry"}
    assert not {"\n", "\r", "\x1b"} & set(cli.network_line(attempt))
