"""The daemon's own life: graceful shutdown, crash and restart, admission limits."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from sandboxd_client import errors

from .conftest import call, leftover_sandboxes, sandbox_containers, sh, wait_for


def _start_sleeper(d, ws, seconds: int = 120, adapter: str = "docker"):
    """Starts a long call on its own thread; returns once its sandbox runs."""
    c = d.client()
    sleeper = call(ws, sh(f"echo up; sleep {seconds}"))
    sleeper["runtime"]["adapter"] = adapter
    stream = c.execute(sleeper)
    it = iter(stream)
    ready = threading.Event()
    outcome: dict = {}

    def consume():
        try:
            for event in it:
                outcome["tool_call_id"] = event.tool_call_id
                if event.WhichOneof("kind") == "output":
                    ready.set()
                if event.WhichOneof("kind") == "finished":
                    outcome["result"] = event.finished.result
        except errors.SandboxdClientError as exc:
            outcome["error"] = exc
        finally:
            ready.set()

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    assert ready.wait(30)
    return t, outcome, c


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_graceful_shutdown_cancels_calls_and_removes_sandboxes(spare_daemon, docker_engine, adapter):
    d = spare_daemon().start()
    ws = d.new_workspace()
    t, outcome, c = _start_sleeper(d, ws, adapter=adapter)
    assert len(leftover_sandboxes(docker_engine, d)) == 1
    assert d.stop(signal.SIGTERM) == 0
    t.join(10)
    assert not leftover_sandboxes(docker_engine, d)
    assert outcome.get("result") is not None and outcome["result"].status == "cancelled"
    c.close()


def test_a_dead_daemons_docker_sandbox_still_ends_at_its_deadline(spare_daemon, docker_engine):
    """nsjail's jails carry their own time limit; a container's is the daemon's, so a
    watcher beside the daemon kills it at its deadline once the daemon is gone."""
    d = spare_daemon().start()
    ws = d.new_workspace()
    c = d.client()
    sleeper = call(ws, sh("echo up; sleep 600"), {"process": {"timeoutMs": 2000}})
    stream = iter(c.execute(sleeper))
    for event in stream:
        if event.WhichOneof("kind") == "output":
            break
    d.stop(signal.SIGKILL)
    running = lambda: [x for x in docker_engine.api.containers(  # noqa: E731
        filters={"label": f"sandboxd.daemon_id={d.daemon_id}", "status": "running"})]
    assert running(), "the container outlives its daemon"
    assert wait_for(lambda: not running(), timeout_s=20), "the container ran past its deadline without its daemon"
    # Once none is left, nothing of the dead daemon stays mounted either.
    staged = d.base / "runtime" / "mounts"
    mounted = lambda: [line for line in Path("/proc/self/mountinfo").read_text().splitlines()  # noqa: E731
                       if f" {staged}/" in line]
    assert wait_for(lambda: not mounted(), timeout_s=20), mounted()
    assert not docker_engine.api.containers(all=True, filters={"label": f"sandboxd.daemon_id={d.daemon_id}"})
    c.close()
    d.start()  # and the restart removes what is left
    assert not leftover_sandboxes(docker_engine, d)


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_restart_after_a_crash_reaps_orphaned_sandboxes(spare_daemon, docker_engine, adapter):
    d = spare_daemon().start()
    ws = d.new_workspace()
    t, _outcome, c = _start_sleeper(d, ws, adapter=adapter)
    d.stop(signal.SIGKILL)
    # An nsjail started ahead of a call (a spawn slot) reads EOF for its config and exits
    # without running anything: nobody has to clean those up.
    assert wait_for(lambda: not [o for o in leftover_sandboxes(docker_engine, d) if o.startswith(".slot-")],
                    timeout_s=5)
    orphans = leftover_sandboxes(docker_engine, d)
    assert len(orphans) == 1, "a killed daemon cannot clean up; its restart must"
    d.start()
    assert not leftover_sandboxes(docker_engine, d)
    # Events written before the crash are still there and intact.
    with d.client() as c2:
        out = c2.run(call(ws, ["echo", "after restart"]))
        assert out.stdout == b"after restart\n"
    c.close()


def test_concurrency_limit_answers_resource_exhausted(spare_daemon, docker_engine):
    d = spare_daemon(max_concurrent_calls=1).start()
    ws = d.new_workspace()
    t, outcome, c = _start_sleeper(d, ws, seconds=30)
    with d.client() as c2:
        with pytest.raises(errors.ResourceExhausted):
            c2.run(call(ws, ["true"]))
        assert c2.cancel(outcome["tool_call_id"], "done")
    t.join(15)
    assert wait_for(lambda: not sandbox_containers(docker_engine, d.daemon_id))
    c.close()


def test_daemon_refuses_to_start_without_its_seccomp_profile(spare_daemon, tmp_path):
    d = spare_daemon(seccomp_profile=str(tmp_path / "missing.json"))
    with pytest.raises(RuntimeError) as exc:
        d.start(timeout_s=15)
    assert "seccomp profile" in str(exc.value)


def test_root_owned_workspace_runs_as_the_configured_uid(spare_daemon):
    d = spare_daemon(root_workspace_uid=4242, root_workspace_gid=4343).start()
    ws = d.new_workspace(uid=0)
    ws.chmod(0o755)  # the mapped uid gets no more than the modes give it
    out_dir = ws / "out"
    out_dir.mkdir()
    os.chown(out_dir, 4242, 4343)
    with d.client() as c:
        out = c.run(call(ws, sh("id -u; id -g; touch /workspace/out/made"),
                         {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"]}}))
    assert out.stdout.split() == [b"4242", b"4343"]
    st = (out_dir / "made").stat()
    assert (st.st_uid, st.st_gid) == (4242, 4343)


def test_async_client_runs_a_call(daemon, workspace):
    import asyncio

    from sandboxd_client import AsyncSandboxdClient

    async def go():
        async with AsyncSandboxdClient(str(daemon.socket)) as c:
            outcome = await c.run(call(workspace, sh("echo async; echo e >&2")))
            trace = await c.get_trace(outcome.tool_call_id)
            arts = await c.list_artifacts(outcome.tool_call_id)
            return outcome, trace, arts

    outcome, trace, arts = asyncio.run(go())
    assert outcome.stdout == b"async\n" and outcome.stderr == b"e\n" and outcome.result.status == "success"
    assert trace[-1].type == "ArtifactPersisted" and len(arts) == 2


def test_trace_verify_and_export_detect_an_edited_event(spare_daemon, tmp_path):
    import sqlite3
    import subprocess
    import sys
    from pathlib import Path

    ctl = [str(Path(sys.executable).with_name("sandboxctl"))]
    d = spare_daemon().start()
    ws = d.new_workspace()
    with d.client() as c:
        first = c.run(call(ws, ["echo", "one"]))
        c.run(call(ws, ["echo", "two"]))
        assert c.verify_log().ok
    export = tmp_path / "log.jsonl"
    p = subprocess.run(ctl + ["--socket", str(d.socket), "trace", "export", "-o", str(export)], capture_output=True)
    assert p.returncode == 0 and len(export.read_text().splitlines()) == 16, p.stderr
    offline = subprocess.run(ctl + ["trace", "verify", "--file", str(export)], capture_output=True)
    assert offline.returncode == 0 and offline.stdout.startswith(b"ok:")

    # Someone edits the recorded exit code of the first call in the database.
    with sqlite3.connect(d.state_dir / "sandboxd.db") as db:
        seq, payload = db.execute("SELECT seq, payload_json FROM events WHERE tool_call_id = ? AND type = ?",
                                  (first.tool_call_id, "ToolCallFinished")).fetchone()
        db.execute("UPDATE events SET payload_json = ? WHERE seq = ?", (payload.replace('"exitCode":0', '"exitCode":1'), seq))
    p = subprocess.run(ctl + ["--socket", str(d.socket), "trace", "verify", "--json"], capture_output=True)
    report = json.loads(p.stdout)
    assert p.returncode == 1 and not report["ok"] and report["firstBadSeq"] == seq and "edited" in report["reason"]

    # A removed line of an export is found offline too.
    lines = export.read_text().splitlines()
    del lines[5]
    export.write_text("\n".join(lines) + "\n")
    offline = subprocess.run(ctl + ["trace", "verify", "--file", str(export), "--json"], capture_output=True)
    assert offline.returncode == 1 and json.loads(offline.stdout)["firstBadSeq"] == 7


def test_the_last_call_is_checkpointed_while_the_daemon_runs(spare_daemon):
    """The log's head is written down after a call (off the caller's path), not only at
    a graceful stop, and the last of calls that ended within the checkpoints' interval
    (one a second by default) too, once the interval has passed: a daemon killed
    afterwards leaves it on disk, and the log verifies against it."""
    d = spare_daemon(checkpoint_interval_s=3.0).start()
    ws = d.new_workspace()
    path = d.state_dir / "checkpoints.jsonl"

    def last_checkpoint() -> str:
        lines = path.read_text().splitlines() if path.exists() else []
        return json.loads(lines[-1])["hash"] if lines else ""

    with d.client() as c:
        t = time.monotonic()
        for word in ("one", "two", "three"):  # jails: tens of milliseconds each
            out = c.run(call(ws, ["echo", word], runtime={"adapter": "nsjail", "image": "sandboxd/default:latest"}))
            assert out.result.status == "success"
        head = c.verify_log().head_hash
        assert time.monotonic() - t < 3.0  # within one interval: the first was written, the last skipped
        assert last_checkpoint() != head
        assert wait_for(lambda: last_checkpoint() == head, 10), (last_checkpoint(), head)
        with pytest.raises(errors.InvalidArgument):  # a refusal is on the log, and checkpointed too
            c.run(call(ws, [], runtime={"adapter": "nsjail", "image": "sandboxd/default:latest"}))
        refused = c.verify_log().head_hash
    assert refused != head
    assert wait_for(lambda: last_checkpoint() == refused, 10), (last_checkpoint(), refused)
    head = refused
    d.stop(signal.SIGKILL)
    assert last_checkpoint() == head
    d.start()
    with d.client() as c:
        assert c.verify_log().ok


def test_checkpoints_catch_a_truncated_or_rechained_log(spare_daemon):
    """Dropping the last call's events, or rewriting history and re-chaining it so every
    hash checks out again, still fails verification against the checkpoints."""
    import sqlite3

    from sandboxd_contract.canonical import event_hash

    d = spare_daemon().start()
    ws = d.new_workspace()
    with d.client() as c:
        first = c.run(call(ws, ["echo", "one"]))
        last = c.run(call(ws, ["echo", "two"]))
        report = c.verify_log()
        assert report.ok
    d.stop()  # a graceful stop always writes the head down
    checkpoints = [json.loads(x) for x in (d.state_dir / "checkpoints.jsonl").read_text().splitlines()]
    assert checkpoints and checkpoints[-1]["hash"] == report.head_hash
    db = sqlite3.connect(d.state_dir / "sandboxd.db")
    saved = db.execute("SELECT * FROM events WHERE tool_call_id = ? ORDER BY seq", (last.tool_call_id,)).fetchall()
    db.execute("DELETE FROM events WHERE tool_call_id = ?", (last.tool_call_id,))
    db.commit()
    d.start()
    with d.client() as c:
        report = c.verify_log()
    assert not report.ok and "removed from its end" in report.reason and report.first_bad_seq == saved[0][0]
    # Offline too: a truncated export does not reach the last checkpoint.
    import subprocess
    import sys
    from pathlib import Path

    ctl = [str(Path(sys.executable).with_name("sandboxctl"))]
    export = d.base / "truncated.jsonl"
    assert subprocess.run(ctl + ["--socket", str(d.socket), "trace", "export", "-o", str(export)]).returncode == 0
    offline = subprocess.run(ctl + ["trace", "verify", "--file", str(export), "--checkpoints",
                                    str(d.state_dir / "checkpoints.jsonl"), "--json"], capture_output=True)
    assert offline.returncode == 1 and "removed from its end" in json.loads(offline.stdout)["reason"]
    plain = subprocess.run(ctl + ["trace", "verify", "--file", str(export)], capture_output=True)
    assert plain.returncode == 0  # the chain alone cannot tell: that is what checkpoints are for

    # Put them back, then rewrite the first call's exit code and re-chain everything after it.
    d.stop()
    db.executemany("INSERT INTO events VALUES (?,?,?,?,?,?,?,?,?)", saved)
    rows = db.execute("SELECT seq, event_id, tool_call_id, type, time, parent_event_id, payload_json, prev_hash"
                      " FROM events ORDER BY seq").fetchall()
    prev = None
    for seq, event_id, tc, typ, time_, parent, payload, prev_hash in rows:
        if tc == first.tool_call_id and typ == "ToolCallFinished":
            payload = payload.replace('"exitCode":0', '"exitCode":1')
        prev = prev_hash if prev is None else prev
        h = event_hash(seq, event_id, tc, typ, time_, parent, payload, prev)
        db.execute("UPDATE events SET payload_json = ?, prev_hash = ?, hash = ? WHERE seq = ?", (payload, prev, h, seq))
        prev = h
    db.commit()
    db.close()
    d.start()
    with d.client() as c:
        report = c.verify_log()
    assert not report.ok and "rewritten" in report.reason


def test_a_backend_that_fails_its_checks_is_refused_never_bypassed(spare_daemon, tmp_path):
    d = spare_daemon(nsjail={"nsjail_binary": str(tmp_path / "no-such-nsjail")}).start()
    ws = d.new_workspace()
    with d.client() as c:
        jailed = call(ws, ["true"])
        jailed["runtime"]["adapter"] = "nsjail"
        with pytest.raises(errors.Unavailable) as exc:
            c.run(jailed)
        assert "runtime.adapter" in exc.value.message and "no-such-nsjail" in exc.value.message
        assert c.run(call(ws, ["echo", "docker still works"])).stdout == b"docker still works\n"
    assert "backend nsjail unavailable" in d.log()


def test_argv_and_stdin_above_the_daemons_limits_are_refused(spare_daemon, docker_engine):
    d = spare_daemon(limits={"max_argv_bytes": 64, "max_stdin_bytes": 8}).start()
    ws = d.new_workspace()
    with d.client() as c:
        with pytest.raises(errors.InvalidArgument) as exc:
            c.run(call(ws, ["echo", "x" * 100]))
        assert exc.value.message.startswith("argv:")
        with pytest.raises(errors.InvalidArgument) as exc:
            c.run(call(ws, ["cat"], stdin=b"123456789"))
        assert exc.value.message.startswith("stdin:")
        assert c.run(call(ws, ["cat"], stdin=b"12345678")).stdout == b"12345678"
    assert not leftover_sandboxes(docker_engine, d)


def test_a_daemon_that_fails_halfway_unwinds_what_it_made(tmp_path, docker_engine):
    """build_daemon in this process, failing at nearly its last step (its TCP port is
    taken): the threads it started have ended, the descriptors it opened are closed,
    and no public socket is left behind."""
    import gc
    import socket as socketlib

    from sandboxd.core import hostfacts
    from sandboxd.core.errors import BackendUnavailable
    from sandboxd.core.safe_open import library_descriptors
    from sandboxd.core.settings import load_settings
    from sandboxd.main import build_daemon
    from sandboxd_testing import make_daemon

    from .test_mtls import make_ca, make_cert

    ca = make_ca(tmp_path, "ca")
    cert, key = make_cert(tmp_path, "server", "sandboxd", ca, server=True)
    taken = socketlib.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    address = f"127.0.0.1:{taken.getsockname()[1]}"
    d = make_daemon(tmp_path / "d", nsjail={"enabled": False},
                    tcp={"address": address, "cert_file": str(cert), "key_file": str(key), "client_ca_file": str(ca[0])})
    settings = load_settings(str(d.config))
    host = hostfacts.probe()
    threads_before = {t.ident for t in threading.enumerate()}
    fds_before = set(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(BackendUnavailable, match="cannot listen") as failed:
            build_daemon(settings, host)
    finally:
        taken.close()
    del failed  # its traceback's frames hold what build_daemon made
    gc.collect()

    def new_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]

    def new_fds() -> dict[str, str]:
        out = {}
        for fd in set(os.listdir("/proc/self/fd")) - fds_before:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # listdir's own descriptor
            # gRPC core's pollers, and the native libraries loaded (load_library), live as
            # long as the process.
            if not target.startswith("anon_inode:") and int(fd) not in library_descriptors():
                out[fd] = target
        return out

    assert wait_for(lambda: not new_threads(), timeout_s=30), new_threads()
    assert wait_for(lambda: not new_fds(), timeout_s=10), sorted(new_fds().values())
    assert not settings.socket_path.exists()
    assert not os.path.ismount(settings.secrets_path)  # the secrets tmpfs it mounted is gone
