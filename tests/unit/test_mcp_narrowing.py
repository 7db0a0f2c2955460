"""What an MCP tool call may ask of the operator's policy (pure): a shorter timeout and
paths the policy shows; anything more is refused naming the argument."""

from __future__ import annotations

import pytest

from sandboxd_client.mcp.narrowing import (OperatorPolicy, Refusal, command_policy, command_timeout, normalized,
                                           readable_path, workspace_path, writable_path)


def op(policy=None, default_timeout_ms=60_000) -> OperatorPolicy:
    return OperatorPolicy.of(policy or {}, default_timeout_ms)


def test_the_timeout_is_written_into_the_policy_and_is_the_ceiling():
    assert op().policy["process"]["timeoutMs"] == 60_000 and op().timeout_ms == 60_000
    given = op({"process": {"timeoutMs": 5000, "maxMemoryMb": 256}})
    assert given.timeout_ms == 5000 and given.policy["process"] == {"timeoutMs": 5000, "maxMemoryMb": 256}
    with pytest.raises(ValueError):
        op({"process": {"timeoutMs": -1}})


def test_a_tool_call_may_shorten_the_timeout_never_lengthen_it():
    o = op({"process": {"timeoutMs": 5000}})
    assert command_timeout(o, None) == 5000
    assert command_timeout(o, 5000) == 5000 and command_timeout(o, 1) == 1
    with pytest.raises(Refusal) as refused:
        command_timeout(o, 5001)
    assert refused.value.argument == "timeout_ms" and "5001 ms" in refused.value.reason and "5000" in str(refused.value)
    assert command_timeout(o, None, default_ms=30_000) == 5000  # a tool's default never above it either
    assert command_timeout(op(), None, default_ms=30_000) == 30_000


def test_command_policy_changes_only_per_command_parts_and_never_raises_a_cap():
    o = op({"filesystem": {"writeRoots": ["/workspace"]}, "process": {"timeoutMs": 9000, "maxStdoutBytes": 100}})
    p = command_policy(o, 1000, max_stdout_bytes=5000)
    assert p["process"] == {"timeoutMs": 1000, "maxStdoutBytes": 100}
    assert p["filesystem"] == o.policy["filesystem"] and o.policy["process"]["timeoutMs"] == 9000  # a copy
    assert command_policy(op(), 1000, max_stdout_bytes=5000)["process"]["maxStdoutBytes"] == 5000
    with pytest.raises(Refusal):
        command_policy(o, 9001)


@pytest.mark.parametrize("path", ["../etc/passwd", "/etc/passwd", "a/../../x", "/workspace/../root", "/", "/tmp/x",
                                  "/workspacex/y"])
def test_paths_outside_the_workspace_are_refused(path):
    with pytest.raises(Refusal) as refused:
        workspace_path(op(), path, "path")
    assert refused.value.argument == "path" and "outside the workspace" in refused.value.reason


def test_paths_inside_are_normalized():
    assert normalized("src/../README.md") == "/workspace/README.md"
    assert normalized("//workspace//a/./b") == "/workspace/a/b"
    assert workspace_path(op(), ".", "cwd") == "/workspace"
    for bad in ("a\x00b", "", "  "):
        with pytest.raises(Refusal):
            workspace_path(op(), bad, "path")


def test_reads_only_where_the_policy_shows_the_workspace():
    parts = op({"filesystem": {"readRoots": ["src"], "writeRoots": ["/workspace/out"]}})
    assert readable_path(parts, "src/app.py", "path") == "/workspace/src/app.py"
    assert readable_path(parts, "out/x", "path") == "/workspace/out/x"
    assert readable_path(parts, ".", "path") == "/workspace"  # above the roots: lists what they show
    with pytest.raises(Refusal) as refused:
        readable_path(parts, "README.md", "path")
    assert "not visible" in refused.value.reason and "/workspace/src" in refused.value.reason
    assert readable_path(op(), "README.md", "path") == "/workspace/README.md"  # no section: all readable


def test_writes_only_under_the_write_roots():
    with pytest.raises(Refusal) as refused:
        writable_path(op(), "a.txt", "path")
    assert "no write roots" in refused.value.reason
    some = op({"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["out", "/tmp"]}})
    assert writable_path(some, "out/a.txt", "path") == "/workspace/out/a.txt"
    for path, why in (("README.md", "write roots are /workspace/out"),
                      ("/tmp/x", "outside the workspace"), (".", "the workspace itself")):
        with pytest.raises(Refusal) as refused:
            writable_path(some, path, "path")
        assert why in refused.value.reason, (path, refused.value.reason)
    assert op({"filesystem": {"writeRoots": ["/workspace"]}}).writes_workspace
    assert some.writes_workspace and not op().writes_workspace


def test_blocked_paths_are_refused_by_name():
    o = op({"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace"], "blockedPaths": [".env"]}})
    for path in (".env", ".env/x"):
        with pytest.raises(Refusal) as refused:
            readable_path(o, path, "path")
        assert "blocked" in refused.value.reason and "/workspace/.env" in refused.value.reason
    assert readable_path(o, ".", "path") == "/workspace"  # the directory above it: the sandbox hides it
    assert readable_path(o, ".envrc", "path") == "/workspace/.envrc"
