"""Overlapping roots on both backends (issue 22, item 6): a path listed as both a read root
and a write root is read-write; a write root inside a read root is the only writable part
of it, and a read root inside a write root a read-only part of it; the effective policy
(recorded, and explained) holds the normalized roots."""

from __future__ import annotations

import json

from sandboxd_client import SandboxdClient

from .conftest import WORKSPACE_UID, call, sh

BOTH = {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace"]}}


def test_a_root_both_read_and_written_is_writable(client, daemon):
    ws = daemon.new_workspace({"src/a.py": "x = 1\n"})
    out = client.run(call(ws, sh("cat /workspace/src/a.py && echo made > /workspace/made.txt "
                                 "&& echo y > /workspace/src/a.py && echo wrote"), BOTH))
    assert out.result.exit_code == 0, out.stderr
    assert out.stdout == b"x = 1\nwrote\n"
    made = ws / "made.txt"
    assert made.read_text() == "made\n"
    assert (made.stat().st_uid, made.stat().st_gid) == (WORKSPACE_UID, WORKSPACE_UID)
    assert (ws / "src" / "a.py").read_text() == "y\n"
    validated = [e for e in client.get_trace(out.tool_call_id) if e.type == "ToolArgsValidated"]
    shown = json.loads(validated[0].payload_json)["effectivePolicy"]
    assert (shown["readRoots"], shown["writeRoots"]) == ([], ["/workspace"])


def test_a_write_root_inside_a_read_root_is_the_only_writable_part(client, daemon):
    ws = daemon.new_workspace({"src/a.py": "x = 1\n", "out/.keep": ""})
    policy = {"filesystem": {"writeRoots": ["/workspace/out"], "readRoots": ["/workspace", "/workspace/out"]}}
    script = ("cat /workspace/src/a.py; echo new > /workspace/out/made.txt && echo wrote-out; "
              "echo bad > /workspace/src/a.py || echo denied-src; echo bad > /workspace/evil.txt || echo denied-root")
    out = client.run(call(ws, sh(script), policy))
    assert out.stdout.split() == [b"x", b"=", b"1", b"wrote-out", b"denied-src", b"denied-root"]
    assert (ws / "out" / "made.txt").read_text() == "new\n"
    assert (ws / "src" / "a.py").read_text() == "x = 1\n"
    assert not (ws / "evil.txt").exists()


def test_a_read_root_inside_a_write_root_stays_read_only(client, daemon):
    ws = daemon.new_workspace({"out/sub/keep.txt": "kept\n", "out/.keep": ""})
    policy = {"filesystem": {"writeRoots": ["/workspace/out"], "readRoots": ["/workspace/out/sub"]}}
    script = ("echo new > /workspace/out/made.txt && echo wrote-out; "
              "echo bad > /workspace/out/sub/keep.txt || echo denied-sub")
    out = client.run(call(ws, sh(script), policy))
    assert out.stdout.split() == [b"wrote-out", b"denied-sub"], out.stderr
    assert (ws / "out" / "made.txt").read_text() == "new\n"
    assert (ws / "out" / "sub" / "keep.txt").read_text() == "kept\n"


def test_explain_shows_the_normalized_roots(daemon):
    # src/x does not exist: it is covered by /workspace, a read root too, so it is never looked for.
    ws = daemon.new_workspace({"src/a.py": "x = 1\n", "out/.keep": ""})
    policy = {"filesystem": {"readRoots": ["/workspace", "src", "src/x"], "writeRoots": ["out", "/workspace/out/"]}}
    with SandboxdClient(str(daemon.socket)) as client:
        explained = client.explain(policy, str(ws))
    shown = json.loads(explained.effective_policy_json)
    assert (shown["readRoots"], shown["writeRoots"]) == (["/workspace"], ["/workspace/out"])
