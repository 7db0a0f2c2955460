"""The high-level client for real, on both backends, blocking and asyncio: a Sandbox
leases a warm sandbox for its `with` block (its commands share it, each a call of its
own), runs, streams, reads, writes and lists through sandboxd calls, refuses a write
outside the policy's write roots by name with nothing written, and gives its lease back
at exit, when the block raises too."""

from __future__ import annotations

import asyncio
import io
import json
import time

import pytest

from sandboxd_client import (AsyncSandbox, AsyncSandboxdClient, CommandFailed, PathNotWritable, Sandbox,
                             SandboxdClient, errors)
from sandboxd_client import sandbox_errors as file_errors
from sandboxd_testing import TIME_SCALE, make_daemon

from .conftest import BACKENDS, DAEMON_ENV, call, public_tmpdir, stop_and_clean

WRITE_OUT = {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"],
                            "blockedPaths": ["/workspace/out/private"]}}


@pytest.fixture(scope="module")
def pooled(docker_engine):
    base = public_tmpdir("sandboxd-hl-client-")
    d = make_daemon(base, env=DAEMON_ENV, pools={"min_idle": 1, "max_size": 2}).start()
    yield d
    stop_and_clean(d, docker_engine, base)


@pytest.fixture
def ws(pooled):
    ws = pooled.new_workspace({"README.md": "read me\n", "out/keep.txt": "kept\n", "out/private/key": "secret\n"})
    (ws / "out" / "to-readme").symlink_to("../README.md")  # a write root's link to a read-only file
    return ws


def assert_lease_gone(d, ws, lease_id: str, adapter: str) -> None:
    """The lease is over: a command in it is refused as unknown, and nobody holds it."""
    with d.client() as c:
        leased = call(ws, ["true"], WRITE_OUT)
        leased["runtime"].update({"leaseId": lease_id, "adapter": adapter})
        with pytest.raises(errors.NotFound):
            c.run(leased)
        assert lease_id not in {held.lease.lease_id for held in c.list_running().leases}


def snapshot(ws) -> dict[str, bytes]:
    return {str(p.relative_to(ws)): p.read_bytes() for p in sorted(ws.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("adapter", BACKENDS)
def test_commands_share_the_leased_sandbox_and_each_is_a_call(pooled, ws, adapter):
    with Sandbox(ws, policy=WRITE_OUT, adapter=adapter, socket=str(pooled.socket)) as sb:
        lease_id = sb.lease_id
        assert sb.backend == adapter and lease_id.startswith("lease_")
        first = sb.run(["sh", "-c", "echo warm > /tmp/state; echo hi; echo oops >&2; exit 3"])
        assert (first.exit_code, first.stdout, first.stderr, first.status) == (3, b"hi\n", b"oops\n", "error")
        assert first.error.code == "NONZERO_EXIT" and not first.timed_out and not first.oom_killed
        assert {a.kind for a in first.artifacts} >= {"stdout", "stderr"} and first.tool_call_id
        with pytest.raises(CommandFailed) as failed:
            first.check()
        assert "exited with 3" in failed.value.message and "oops" in failed.value.message
        assert failed.value.result is first and failed.value.tool_call_id == first.tool_call_id
        with pytest.raises(CommandFailed):
            sb.run(["false"], check=True)
        # The next command runs in the same sandbox (its /tmp is the lease's).
        second = sb.run(["sh", "-c", 'cat /tmp/state; cat; echo "$GREETING"; pwd'], stdin="from stdin\n",
                        env={"GREETING": "hello"}, cwd="/workspace/out").check()
        assert second.text == "warm\nfrom stdin\nhello\n/workspace/out\n" and second.ok
        assert second.tool_call_id != first.tool_call_id
        checked = next(e for e in sb.client.get_trace(second.tool_call_id) if e.type == "ToolPolicyChecked")
        payload = json.loads(checked.payload_json)
        assert (payload["leaseId"], payload["sandboxId"]) == (lease_id, sb.sandbox_id)
    assert_lease_gone(pooled, ws, lease_id, adapter)


@pytest.mark.parametrize("adapter", BACKENDS)
def test_a_streamed_command_gives_its_output_as_it_comes(pooled, ws, adapter):
    with Sandbox(ws, policy=WRITE_OUT, adapter=adapter, socket=str(pooled.socket)) as sb:
        stream = sb.stream(["sh", "-c", "echo one; echo two >&2; sleep 1; echo three"])
        chunks, arrived = [], []
        for chunk in stream:
            chunks.append(chunk)
            arrived.append(time.monotonic())
        result = stream.result
        assert result.ok and result.tool_call_id == stream.tool_call_id
        assert b"".join(c.data for c in chunks if c.stream == "stdout") == result.stdout == b"one\nthree\n"
        assert b"".join(c.data for c in chunks if c.stream == "stderr") == result.stderr == b"two\n"
        # "one" came before the command slept, not with its end.
        first_one = next(t for c, t in zip(chunks, arrived) if c.data.startswith(b"one"))
        assert arrived[-1] - first_one > 0.5, [(c.stream, c.data) for c in chunks]
        # Leaving a stream early cancels its command; the lease goes on.
        with sb.stream(["sh", "-c", "echo started; sleep 60"]) as abandoned:
            for chunk in abandoned:
                assert chunk.data == b"started\n"
                break
        assert _wait(lambda: any(e.type == "ToolResultValidated" for e in sb.client.get_trace(abandoned.tool_call_id)))
        validated = [e for e in sb.client.get_trace(abandoned.tool_call_id) if e.type == "ToolResultValidated"]
        assert json.loads(validated[0].payload_json)["result"]["status"] == "cancelled"
        assert sb.run(["echo", "after"]).text == "after\n"


def _wait(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s * TIME_SCALE
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("adapter", BACKENDS)
def test_files_are_read_written_and_listed_through_the_sandbox(pooled, ws, adapter):
    with Sandbox(ws, policy=WRITE_OUT, adapter=adapter, socket=str(pooled.socket)) as sb:
        assert sb.read_file("/workspace/README.md") == b"read me\n" and sb.read_text("README.md") == "read me\n"
        content = b"bytes \x00\xff and\nlines\n"
        sb.write_file("/workspace/out/new.bin", content)
        assert (ws / "out" / "new.bin").read_bytes() == content
        assert (ws / "out" / "new.bin").stat().st_uid == 1000  # the workspace's owner wrote it
        assert sb.read_file("/workspace/out/new.bin") == content
        sb.write_file("/workspace/out/keep.txt", "replaced\n")
        assert (ws / "out" / "keep.txt").read_text() == "replaced\n"
        sb.write_file("/workspace/out/deep/er/file.txt", "deep\n", parents=True)
        assert (ws / "out" / "deep" / "er" / "file.txt").read_text() == "deep\n"
        sb.write_file("/tmp/scratch.txt", "in the tempDir\n")  # the lease's own tmpfs
        assert sb.run(["cat", "/tmp/scratch.txt"]).text == "in the tempDir\n"
        sb.run(["sh", "-c", "cd /workspace/out && touch -- .hidden -dash 'new\nline' && mkdir sub"]).check()
        entries = {e.name: e for e in sb.list_files("/workspace/out")}
        assert set(entries) - {"private"} == {"new.bin", "keep.txt", "deep", "to-readme", ".hidden", "-dash",
                                              "new\nline", "sub"}  # (a blocked path may show as its mask)
        assert entries["new.bin"].is_file and entries["new.bin"].size == len(content)
        assert entries["sub"].is_dir and entries["to-readme"].kind == "symlink"
        assert entries["new.bin"].path == "/workspace/out/new.bin" and entries["new.bin"].mode & 0o600 == 0o600
        assert [e.name for e in sb.list_files("out/deep")] == ["er"]
        # What is not there, or not a file, or not a directory, says so.
        with pytest.raises(FileNotFoundError):
            sb.read_file("/workspace/missing.txt")
        with pytest.raises(file_errors.SandboxFileNotFound):
            sb.read_file("/workspace/out/private/key")  # blocked: never visible
        with pytest.raises(IsADirectoryError):
            sb.read_file("/workspace/out")
        with pytest.raises(NotADirectoryError):
            sb.list_files("/workspace/README.md")
        with pytest.raises(FileNotFoundError) as missing_parent:
            sb.write_file("/workspace/out/nowhere/x.txt", "x")
        assert "parents=True" in str(missing_parent.value)
    assert not (ws / "out" / "nowhere").exists()


@pytest.mark.parametrize("adapter", BACKENDS)
def test_a_write_outside_the_write_roots_is_refused_and_nothing_is_written(pooled, ws, adapter):
    before = snapshot(ws)
    with Sandbox(ws, policy=WRITE_OUT, adapter=adapter, socket=str(pooled.socket)) as sb:
        said = {}
        for path in ("/workspace/README.md", "/workspace/new.txt", "/etc/passwd", "/workspace/out/private/key",
                     "/workspace/out/../README.md", "out/../new.txt"):
            with pytest.raises(PathNotWritable) as refused:
                sb.write_file(path, "overwritten\n")
            assert refused.value.tool_call_id == ""  # refused before any call was sent
            assert isinstance(refused.value, PermissionError) and refused.value.code.name == "PERMISSION_DENIED"
            said[path] = refused.value.message
        assert said["/workspace/new.txt"].startswith("/workspace/new.txt is not under the sandbox's write roots "
                                                     "(/workspace/out) nor its tempDir (/tmp)")
        assert said["out/../new.txt"] == said["/workspace/new.txt"]
        assert "blocked path" in said["/workspace/out/private/key"]
        # A link in a write root to a read-only file: the sandbox itself refuses the write.
        with pytest.raises(PathNotWritable) as in_sandbox:
            sb.write_file("/workspace/out/to-readme", "through the link\n")
        assert in_sandbox.value.tool_call_id and "refused the write" in in_sandbox.value.message
    assert snapshot(ws) == before and not (ws / "new.txt").exists()


@pytest.mark.parametrize("adapter", BACKENDS)
def test_a_command_past_its_timeout_is_killed_and_the_lease_goes_on(pooled, ws, adapter):
    with Sandbox(ws, policy=WRITE_OUT, adapter=adapter, socket=str(pooled.socket)) as sb:
        slow = sb.run(["sleep", "30"], timeout_ms=300)
        assert slow.timed_out and slow.status == "error" and slow.error.code == "TIMEOUT"
        assert slow.raw.usage.latency_ms < 10_000
        with pytest.raises(CommandFailed) as failed:
            slow.check()
        assert "timed out" in failed.value.message
        assert sb.run(["echo", "still here"]).check().text == "still here\n"


@pytest.mark.parametrize("adapter", BACKENDS)
def test_an_exception_in_the_block_still_releases_the_lease(pooled, ws, adapter):
    with pytest.raises(ZeroDivisionError):
        with Sandbox(ws, policy=WRITE_OUT, adapter=adapter, socket=str(pooled.socket)) as sb:
            lease_id = sb.lease_id
            sb.run(["true"])
            1 / 0
    assert_lease_gone(pooled, ws, lease_id, adapter)
    with pytest.raises(RuntimeError, match="not open"):
        sb.run(["true"])


def test_a_given_client_stays_open_and_a_refused_acquire_holds_nothing(pooled, ws, tmp_path):
    with SandboxdClient(str(pooled.socket)) as client:
        with Sandbox(ws, client=client) as sb:
            assert sb.client is client and sb.run(["true"]).ok
        assert client.list_pools()  # still usable after the block
        with pytest.raises(errors.SandboxdClientError):  # not under the daemon's workspace roots
            with Sandbox(tmp_path, client=client):
                pytest.fail("a workspace outside the daemon's roots was leased")
        assert not client.list_running().leases


@pytest.mark.parametrize("adapter", BACKENDS)
def test_the_async_sandbox_does_the_same(pooled, ws, adapter):
    before = snapshot(ws)

    async def go():
        async with AsyncSandbox(ws, policy=WRITE_OUT, adapter=adapter, socket=str(pooled.socket)) as sb:
            lease_id = sb.lease_id
            ran = await sb.run(["sh", "-c", "echo async > /tmp/state; cat; exit 2"], stdin=b"in\n")
            assert (ran.exit_code, ran.stdout) == (2, b"in\n") and not ran.ok
            stream = sb.stream(["sh", "-c", "cat /tmp/state; echo e >&2"])
            chunks = [c async for c in stream]
            assert {(c.stream, c.data) for c in chunks} == {("stdout", b"async\n"), ("stderr", b"e\n")}
            assert stream.result.ok and stream.result.stdout == b"async\n"
            await sb.write_file("/workspace/out/a.txt", "async write\n")
            assert await sb.read_file("/workspace/out/a.txt") == b"async write\n"
            assert "a.txt" in [e.name for e in await sb.list_files("/workspace/out")]
            with pytest.raises(PathNotWritable):
                await sb.write_file("/workspace/README.md", "no\n")
            with pytest.raises(FileNotFoundError):
                await sb.read_file("/workspace/nothing")
            slow = await sb.run(["sleep", "30"], timeout_ms=300)
            assert slow.timed_out and slow.error.code == "TIMEOUT"
        return lease_id

    lease_id = asyncio.run(go())
    assert_lease_gone(pooled, ws, lease_id, adapter)
    assert (ws / "out" / "a.txt").read_text() == "async write\n"
    assert snapshot(ws) == {**before, "out/a.txt": b"async write\n"}

    async def raising():
        async with AsyncSandboxdClient(str(pooled.socket)) as client:
            with pytest.raises(KeyError):
                async with AsyncSandbox(ws, policy=WRITE_OUT, adapter=adapter, client=client) as sb:
                    held = sb.lease_id
                    raise KeyError("in the block")
            pools = await client.list_pools()
            return held, pools

    held, pools = asyncio.run(raising())
    assert pools
    assert_lease_gone(pooled, ws, held, adapter)


def test_a_second_writer_of_a_workspace_waits_for_it_up_to_wait_ms(pooled, ws):
    """A sandbox that may write a workspace holds it alone, until it is gone: a Sandbox
    opened meanwhile retries for wait_ms (0: not at all), and one opened right after
    the first is released gets it as soon as the old sandbox is removed."""
    socket = str(pooled.socket)
    with Sandbox(ws, policy=WRITE_OUT, socket=socket) as first:
        with pytest.raises(errors.Aborted) as busy:
            Sandbox(ws, policy=WRITE_OUT, socket=socket, wait_ms=0).open()
        assert "workspace" in busy.value.message
        started = time.monotonic()
        with pytest.raises(errors.Aborted):
            Sandbox(ws, policy=WRITE_OUT, socket=socket, wait_ms=800).open()
        assert 0.6 <= time.monotonic() - started < 5 * TIME_SCALE
        first_sandbox = first.sandbox_id
    for _ in range(2):
        with Sandbox(ws, policy=WRITE_OUT, socket=socket) as again:
            assert again.sandbox_id != first_sandbox and again.run(["true"]).ok


def test_the_async_client_answers_what_the_blocking_one_does(pooled, ws):
    """AsyncSandboxdClient's pools, audit, trace, explain and artifact methods, for real,
    against the blocking client's answers."""
    with SandboxdClient(str(pooled.socket)) as blocking:
        ran = blocking.run(call(ws, ["sh", "-c", "echo parity"]))

    async def go():
        async with AsyncSandboxdClient(str(pooled.socket)) as c:
            await c.wait_ready(10)
            explained = await c.explain(WRITE_OUT, str(ws), adapter="nsjail" if "nsjail" in BACKENDS else "docker")
            assert json.loads(explained.effective_policy_json)["writeRoots"] == ["/workspace/out"]
            [stdout_ref] = [a for a in await c.list_artifacts(ran.tool_call_id) if a.kind == "stdout"]
            sink = io.BytesIO()
            assert (await c.download_artifact(stdout_ref.artifact_id, sink)).content_hash == stdout_ref.content_hash
            assert sink.getvalue() == b"parity\n"
            events = [e async for e in c.export_events(tool_call_id=ran.tool_call_id)]
            assert [e.type for e in events] == [e.type for e in await c.get_trace(ran.tool_call_id)]
            assert (await c.verify_log()).ok
            page = await c.query_calls(workspace=str(ws), page_size=1)
            every = [s.tool_call_id async for s in c.iter_calls(workspace=str(ws), page_size=1)]
            assert ran.tool_call_id in every and len(page.calls) == 1
            status = await c.create_pool(str(ws))
            lease = await c.acquire_sandbox(str(ws), wait_ms=20_000)
            assert lease.pool_key == status.pool_key
            assert lease.lease_id in {h.lease.lease_id for h in (await c.list_running()).leases}
            await c.release_sandbox(lease.lease_id)
            with pytest.raises(errors.NotFound):
                await c.release_sandbox(lease.lease_id)
            deadline = time.monotonic() + 20 * TIME_SCALE  # the pool warms its idle sandbox again
            while not [p for p in await c.list_pools() if p.pool_key == status.pool_key and p.idle]:
                assert time.monotonic() < deadline, await c.list_pools()
                await asyncio.sleep(0.1)
            assert await c.drain_pools(status.pool_key) >= 1

    asyncio.run(go())
