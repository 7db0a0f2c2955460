"""tempDir is memory (a tmpfs charged to the sandbox's limit), and an OOM kill must mean
the same on both backends. Before: a call that filled tempDir inside a smaller
maxMemoryMb was OOM-killed instead of getting ENOSPC, and Docker killed only the writer
(the call exited 0 with oomKilled) while nsjail ended the whole call with 137."""

from __future__ import annotations

from .conftest import call, sh


def test_a_full_temp_dir_is_enospc_not_an_oom_kill(client, workspace):
    # 128 MB of memory: tempDir defaults to 96 MB, and writing 200 MB into it runs out of space.
    # (dd's message kept in a variable: a file in the full /tmp could not hold it)
    script = ("err=$(dd if=/dev/zero of=/tmp/fill bs=1M count=200 2>&1); echo dd=$?; "
              "echo \"$err\" | grep -o 'No space left on device' | head -1; df -m /tmp | tail -1 | awk '{print $2}'")
    out = client.run(call(workspace, sh(script), {"process": {"maxMemoryMb": 128, "timeoutMs": 60000}}))
    r = out.result
    assert not r.oom_killed and r.status == "success" and r.exit_code == 0, (r, out.stderr)
    lines = out.stdout.decode().split()
    assert lines[0] == "dd=1" and "No space left on device" in out.stdout.decode(), out.stdout
    assert lines[-1] == "96"  # the tmpfs's size in MB


def test_an_oom_kill_ends_the_whole_call_on_both_backends(client, workspace):
    # A child is killed at the limit; its parent would go on. The whole call ends, the same way.
    bomb = "a = []\nwhile True:\n    a.append(bytearray(8 * 1024 * 1024))\n"
    script = f"python3 -c '{bomb}'; echo parent-went-on; sleep 5; echo still-here"
    out = client.run(call(workspace, sh(script), {"process": {"maxMemoryMb": 64, "timeoutMs": 30000}}))
    r = out.result
    assert r.oom_killed and r.status == "error" and r.error.code == "OOM_KILLED", r
    assert r.exit_code == 137 and r.signal == "SIGKILL" and not r.timed_out, r
    assert b"still-here" not in out.stdout
