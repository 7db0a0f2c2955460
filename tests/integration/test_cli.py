"""`sandboxctl` as a user runs it: a real process against the real daemon."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

SANDBOXCTL = str(Path(sys.executable).with_name("sandboxctl"))


def ctl(daemon, *args: str, stdin: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([SANDBOXCTL, "--socket", str(daemon.socket), *args], input=stdin,
                          capture_output=True, timeout=timeout)


def test_exec_passes_output_and_exit_code(daemon, workspace):
    p = ctl(daemon, "exec", "--workspace", str(workspace), "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (p.returncode, p.stdout, p.stderr) == (7, b"out\n", b"err\n")


def test_exec_json_prints_the_result_after_the_output(daemon, workspace):
    p = ctl(daemon, "exec", "--json", "--workspace", str(workspace), "--env", "WHO=agent", "--", "sh", "-c", "echo hi $WHO")
    assert p.returncode == 0
    first, last = p.stdout.split(b"\n", 1)
    assert first == b"hi agent"
    result = json.loads(last)
    assert result["status"] == "success" and result["exitCode"] == 0 and result["stdoutPreview"] == "hi agent\n"
    assert {a["kind"] for a in result["artifacts"]} == {"stdout"}


def test_exec_timeout_exits_124(daemon, workspace):
    p = ctl(daemon, "exec", "--timeout-ms", "500", "--workspace", str(workspace), "--", "sleep", "30")
    assert p.returncode == 124


def test_exec_memory_kill_exits_137(daemon, workspace):
    bomb = "a = []\nwhile True:\n    a.append(bytearray(8 * 1024 * 1024))\n"
    p = ctl(daemon, "exec", "--memory-mb", "48", "--workspace", str(workspace), "--", "python3", "-c", bomb)
    assert p.returncode == 137


def test_exec_refusal_exits_125_with_the_reason(daemon, workspace, tmp_path):
    p = ctl(daemon, "exec", "--workspace", str(tmp_path), "--", "true")
    assert p.returncode == 125
    assert b"PERMISSION_DENIED" in p.stderr and b"workspace" in p.stderr


def test_exec_policy_file_yaml(daemon, tmp_path):
    ws = daemon.new_workspace({"out/.keep": "", "in.txt": "data\n"})
    policy = tmp_path / "policy.yaml"
    policy.write_text("filesystem:\n  readRoots: [/workspace]\n  writeRoots: [/workspace/out]\nprocess:\n  timeoutMs: 5000\n")
    p = ctl(daemon, "exec", "--policy", str(policy), "--workspace", str(ws), "--", "sh", "-c", "cp /workspace/in.txt /workspace/out/copy.txt")
    assert p.returncode == 0, p.stderr
    assert (ws / "out" / "copy.txt").read_text() == "data\n"


def test_exec_stdin(daemon, workspace):
    p = ctl(daemon, "exec", "--stdin", "--workspace", str(workspace), "--", "wc", "-c", stdin=b"12345")
    assert p.stdout.strip() == b"5"


def test_artifact_get_trace_and_explain(daemon, workspace, tmp_path):
    p = ctl(daemon, "exec", "--json", "--workspace", str(workspace), "--", "sh", "-c",
            "seq 1 1000; cat /workspace/README.md /workspace/src/app.py > /dev/null")
    result = json.loads(p.stdout.splitlines()[-1])
    artifact = result["artifacts"][0]
    target = tmp_path / "stdout.txt"
    g = ctl(daemon, "artifact", "get", artifact["artifactId"], "-o", str(target))
    assert g.returncode == 0 and b"verified" in g.stderr
    assert "sha256:" + hashlib.sha256(target.read_bytes()).hexdigest() == artifact["contentHash"]
    assert target.read_bytes() == b"".join(b"%d\n" % i for i in range(1, 1001))

    ls = ctl(daemon, "artifact", "ls", result["toolCallId"], "--json")
    assert [a["artifactId"] for a in json.loads(ls.stdout)] == [artifact["artifactId"]]

    t = ctl(daemon, "trace", result["toolCallId"], "--json")
    assert t.returncode == 0
    events = [json.loads(line) for line in t.stdout.splitlines()]
    assert events[0]["type"] == "ToolCallRequested" and events[-1]["type"] == "ArtifactPersisted"
    assert all(e["hashVerified"] for e in events)
    human = ctl(daemon, "trace", result["toolCallId"])
    assert b"ToolCallFinished" in human.stdout and human.returncode == 0
    # The reads, summed up for people under their FileAccessObserved event.
    assert b"2 read: read /workspace/README.md, read /workspace/src/app.py\n" in human.stdout, human.stdout

    missing = ctl(daemon, "trace", "tc-does-not-exist")
    assert missing.returncode == 1 and b"NOT_FOUND" in missing.stderr

    policy = tmp_path / "p.json"
    policy.write_text(json.dumps({"process": {"maxPids": 64}, "network": {"egress": "open", "denyPrivateNetworks": False}}))
    e = ctl(daemon, "explain", "--json", "--policy", str(policy), "--workspace", str(workspace))
    explained = json.loads(e.stdout)
    assert explained["spec"]["pids_limit"] == 64 and explained["spec"]["network_mode"] == "bridge"
    assert explained["effectivePolicy"]["egress"] == "open"
