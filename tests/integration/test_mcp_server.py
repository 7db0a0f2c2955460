"""sandboxd-mcp for real: the installed `sandboxd-mcp` driven by the official MCP client
over stdio and over streamable HTTP, against a real daemon. Tools list with honest
annotations; commands run in a warm lease (held while the server runs, given back when
it ends); files are read and written inside the operator's policy and refused outside
it; a model cannot widen the policy; output is capped with the whole as a resource; the
HTTP endpoint wants its token (or a client certificate); the calls are on the audit with
the MCP client's name and session; a daemon that goes away is a tool error, and the
server serves again once it is back."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx2
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import Implementation

from sandboxd_testing import prepared_call

from .conftest import BACKENDS, DEFAULT_IMAGE, WORKSPACE_UID, wait_for
from .test_mtls import make_ca, make_cert

SANDBOXD_MCP = str(Path(sys.executable).with_name("sandboxd-mcp"))
AGENT = Implementation(name="pytest-agent", version="7.1")


@pytest.fixture(autouse=True)
def no_warm_sandbox_left(daemon):
    """The server's leases come from pools of the shared daemon, which keep sandboxes
    warm after them (and their staged mounts, which later tests count): drained after
    each test."""
    yield
    with daemon.client() as c:
        c.drain_pools()
        wait_for(lambda: not c.list_pools(), timeout_s=30)


def server_args(d, ws: Path, *flags: str) -> list[str]:
    return ["--socket", str(d.socket), "--workspace", str(ws), "--image", DEFAULT_IMAGE, *flags]


@asynccontextmanager
async def stdio_session(d, ws: Path, *flags: str, errlog=None):
    params = StdioServerParameters(command=SANDBOXD_MCP, args=server_args(d, ws, *flags),
                                   env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    async with stdio_client(params, errlog=errlog or sys.stderr) as (read, write):
        async with ClientSession(read, write, client_info=AGENT) as session:
            await session.initialize()
            yield session


async def call(session: ClientSession, tool: str, **arguments):
    return await session.call_tool(tool, arguments)


def text(result) -> str:
    return "\n".join(c.text for c in result.content if c.type == "text")


def requested(client, tool_call_id: str) -> dict:
    first = client.get_trace(tool_call_id)[0]
    assert first.type == "ToolCallRequested"
    return json.loads(first.payload_json)


def held_leases(client, ws: Path) -> list:
    return [h for h in client.list_running().leases if h.workspace == str(ws)]


def test_stdio_runs_commands_in_a_lease_and_files_inside_the_policy(daemon):
    ws = daemon.new_workspace({"README.md": "hello workspace\n", "src/app.py": "print('app')\n"})

    async def scenario():
        async with stdio_session(daemon, ws, "-w", ".") as s:
            tools = {t.name: t for t in (await s.list_tools()).tools}
            assert set(tools) == {"run_command", "read_file", "write_file", "list_files", "search_files"}
            assert tools["read_file"].annotations.read_only_hint and not tools["read_file"].annotations.destructive_hint
            assert tools["run_command"].annotations.destructive_hint and not tools["run_command"].annotations.open_world_hint
            assert tools["run_command"].input_schema["additionalProperties"] is False

            ran = await call(s, "run_command", command=["sh", "-c", "cat README.md; echo oops >&2; exit 3"])
            assert not ran.is_error and ran.structured_content["exit_code"] == 3
            assert ran.structured_content["stdout"] == "hello workspace\n" and ran.structured_content["stderr"] == "oops\n"
            assert text(ran).startswith("exit code 3")
            with daemon.client() as c:
                lease = held_leases(c, ws)
                assert len(lease) == 1, "the first call took a warm lease"
            shell = await call(s, "run_command", command="echo $((6*7)) | tr 4 x; pwd; cat", stdin="from stdin")
            assert shell.structured_content["stdout"] == "x2\n/workspace\nfrom stdin"
            inside = await call(s, "run_command", command=["pwd"], cwd="src")
            assert inside.structured_content["stdout"] == "/workspace/src\n"

            wrote = await call(s, "write_file", path="notes/todo.txt", content="ship it\n", create_dirs=True)
            assert not wrote.is_error, text(wrote)
            assert (ws / "notes" / "todo.txt").read_text() == "ship it\n"
            assert (ws / "notes" / "todo.txt").stat().st_uid == WORKSPACE_UID
            read = await call(s, "read_file", path="/workspace/notes/todo.txt")
            assert read.structured_content["content"] == "ship it\n" and text(read) == "ship it\n"

            listed = await call(s, "list_files", path=".", max_depth=2)
            paths = {e["path"]: e["type"] for e in listed.structured_content["entries"]}
            assert paths["src"] == "directory" and paths["src/app.py"] == "file" and paths["notes/todo.txt"] == "file"
            found = await call(s, "search_files", pattern="print\\(", glob="*.py")
            assert "/workspace/src/app.py:1:print('app')" in found.structured_content["matches"]
            missing = await call(s, "search_files", pattern="no-such-text-anywhere")
            assert not missing.is_error and missing.structured_content["matches"] == ""
            return [r.structured_content["tool_call_id"] for r in (ran, shell, wrote, read, listed, found)], lease[0]

    ids, lease = anyio.run(scenario)
    with daemon.client() as c:
        assert held_leases(c, ws) == [], "the lease is given back when the session ends"
        leased = [e.type for e in c.get_trace(lease.lease.lease_id)]
        assert leased == ["SandboxLeased", "SandboxLeaseEnded"]
        for tool_call_id, tool in zip(ids, ["run_command", "run_command", "write_file", "read_file", "list_files",
                                            "search_files"]):
            req = requested(c, tool_call_id)
            assert req["proposedBy"] == "mcp:pytest-agent/7.1" and req["sessionId"].startswith("mcp-server:")
            assert req["toolId"] == f"mcp.{tool}" and req["runtime"]["leaseId"] == lease.lease.lease_id
        audited = {a.tool_call_id: a for a in c.iter_calls(workspace=str(ws))}
        assert set(ids) <= set(audited) and audited[ids[0]].tool_id == "mcp.run_command"
        assert audited[ids[0]].exit_code == 3 and "cat README.md" in audited[ids[0]].command


def test_a_model_cannot_widen_the_operators_policy(daemon):
    ws = daemon.new_workspace({"README.md": "keep me\n", "out/.keep": "", "big.bin": "x" * 5000})
    os.symlink("/etc/passwd", ws / "passwd-link")
    os.symlink("../README.md", ws / "out" / "readme-link")
    with daemon.client() as c:  # the same principal's artifact, of a call this server did not make
        theirs = c.run(prepared_call(ws, ["echo", "not for the model"])).result.artifacts[0].artifact_id

    async def scenario():
        async with stdio_session(daemon, ws, "-w", "out", "--timeout-ms", "5000", "--max-read-bytes", "4096",
                                 "--max-write-bytes", "100", "--output-cap-bytes", "1024",
                                 "--max-resource-bytes", "108894") as s:
            outside = await call(s, "write_file", path="README.md", content="gone\n")
            assert outside.is_error and outside.structured_content["refusal"]["argument"] == "path"
            assert "write roots are /workspace/out" in text(outside)
            up = await call(s, "write_file", path="../../etc/x", content="x")
            assert up.is_error and "outside the workspace" in text(up)
            # A symlink under the write root that leads to a read-only file: the sandbox refuses.
            through = await call(s, "write_file", path="out/readme-link", content="gone\n")
            assert through.is_error and through.structured_content["refusal"]["code"] == "write_failed", text(through)
            escape = await call(s, "read_file", path="passwd-link")
            assert escape.is_error and escape.structured_content["refusal"]["code"] == "outside_workspace"
            big = await call(s, "write_file", path="out/big.txt", content="y" * 101)
            assert big.is_error and "101 bytes, more than the 100" in text(big)
            too_big = await call(s, "read_file", path="big.bin")
            assert too_big.is_error and too_big.structured_content["refusal"]["code"] == "too_large"
            shell = await call(s, "run_command", command="echo gone > /workspace/README.md")
            assert shell.structured_content["exit_code"] != 0 and "Read-only" in shell.structured_content["stderr"]

            longer = await call(s, "run_command", command="sleep 30", timeout_ms=5001)
            assert longer.is_error and longer.structured_content["refusal"]["argument"] == "timeout_ms"
            assert "5000 ms" in text(longer)
            with pytest.raises(MCPError) as widened:
                await call(s, "run_command", command="curl example.com", network="open")
            assert "'network'" in widened.value.message and "unknown argument" in widened.value.message
            with pytest.raises(MCPError) as malformed:
                await call(s, "run_command", command="true", timeout_ms="soon")
            assert "'timeout_ms'" in malformed.value.message

            slow = await call(s, "run_command", command=["sleep", "30"], timeout_ms=300)
            assert slow.is_error and slow.structured_content["timed_out"] and text(slow).startswith("error: timed out")

            flood = await call(s, "run_command", command="seq 1 20000")
            out = flood.structured_content
            assert out["stdout"].startswith("1\n2\n") and out["stdout"].endswith("19999\n20000\n")
            assert out["stdout_cut_bytes"] > 0 and len(out["stdout"]) < 1400
            uri = next(a["uri"] for a in out["artifacts"] if a["kind"] == "stdout")
            assert uri in out["stdout"]
            whole = await s.read_resource(uri)  # 108894 bytes: just within --max-resource-bytes
            assert whole.contents[0].text == "".join(f"{i}\n" for i in range(1, 20001))
            more = await call(s, "run_command", command="seq 1 20001")
            over = next(a["uri"] for a in more.structured_content["artifacts"] if a["kind"] == "stdout")
            with pytest.raises(MCPError) as too_big:
                await s.read_resource(over)
            assert "108900 bytes, more than the 108894" in too_big.value.message
            listed = await s.list_resources()
            assert uri in {str(r.uri) for r in listed.resources}
            with pytest.raises(MCPError) as not_ours:
                await s.read_resource(f"sandboxd://artifacts/{theirs}")
            assert "not one this server's calls produced" in not_ours.value.message

    anyio.run(scenario)
    assert (ws / "README.md").read_text() == "keep me\n"
    assert not (ws / "out" / "big.txt").exists() and sorted(os.listdir(ws / "out")) == [".keep", "readme-link"]


OOM_BOMB = ["python3", "-c", "b = bytearray(512 * 2**20); print(len(b))"]


def test_a_memory_kill_is_a_tool_error(daemon):
    ws = daemon.new_workspace()

    async def scenario():
        async with stdio_session(daemon, ws, "--memory-mb", "64", "--no-lease") as s:
            hog = await call(s, "run_command", command=OOM_BOMB)
            assert hog.is_error and hog.structured_content["oom_killed"], text(hog)
            assert text(hog).startswith("error: killed for memory")
            again = await call(s, "run_command", command=["echo", "still here"])
            assert again.structured_content["stdout"] == "still here\n"

    anyio.run(scenario)


def test_a_memory_kill_in_the_lease_is_a_tool_error(daemon):
    ws = daemon.new_workspace()

    async def scenario():
        async with stdio_session(daemon, ws, "--memory-mb", "64") as s:
            hog = await call(s, "run_command", command=OOM_BOMB)
            assert hog.structured_content["exit_code"] == 137 and hog.structured_content["signal"] == "SIGKILL"
            assert hog.is_error and hog.structured_content["oom_killed"], text(hog)

    anyio.run(scenario)


def start_http_server(d, ws: Path, tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    log = open(tmp_path / "mcp-http.log", "w+")
    proc = subprocess.Popen([SANDBOXD_MCP, *server_args(d, ws, "--http", "127.0.0.1:0", *flags)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)

    def url() -> str | None:
        log.seek(0)
        for line in log.read().splitlines():
            if line.startswith("sandboxd-mcp: serving "):
                return line.split()[-1]
        assert proc.poll() is None, log.read()
        return None

    found = wait_for(url, timeout_s=20)
    assert found, "sandboxd-mcp did not start serving"
    return proc, found


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    assert proc.wait(20) in (0, -signal.SIGTERM)  # (uvicorn ends by the signal it was given)


def test_streamable_http_wants_its_token_and_names_the_session(daemon, tmp_path):
    ws = daemon.new_workspace({"README.md": "over http\n"})
    token = "t0ken-" + os.urandom(12).hex()
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    proc, url = start_http_server(daemon, ws, tmp_path, "--token-file", str(token_file))
    assert url.startswith("http://127.0.0.1:") and url.endswith("/mcp")
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "curl", "version": "1"}}}
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    try:
        for auth in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": token}):
            refused = httpx2.post(url, json=init, headers=headers | auth, timeout=10, trust_env=False)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"

        async def scenario():
            async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60,
                                          trust_env=False) as http:
                async with streamable_http_client(url, http_client=http) as (read, write):
                    async with ClientSession(read, write, client_info=AGENT) as s:
                        await s.initialize()
                        assert "write_file" not in {t.name for t in (await s.list_tools()).tools}
                        ran = await call(s, "run_command", command=["cat", "README.md"])
                        assert ran.structured_content["stdout"] == "over http\n" and not ran.is_error
                        with pytest.raises(MCPError) as unknown:  # a read-only server: not offered
                            await call(s, "write_file", path="x", content="y")
                        assert "unknown tool 'write_file'" in unknown.value.message
                        return ran.structured_content["tool_call_id"]

        tool_call_id = anyio.run(scenario)
        with daemon.client() as c:
            req = requested(c, tool_call_id)
            assert req["proposedBy"] == "mcp:pytest-agent/7.1" and req["sessionId"].startswith("mcp-session:")
            assert held_leases(c, ws), "the lease is held while the server runs"
    finally:
        stop(proc)
    with daemon.client() as c:
        assert held_leases(c, ws) == [], "the lease is given back when the server ends"


def tls_context(ca, cert) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca[0]))
    if cert is not None:
        context.load_cert_chain(str(cert[0]), str(cert[1]))
    return context


def test_streamable_http_over_mutual_tls(daemon, tmp_path):
    ws = daemon.new_workspace()
    ca = make_ca(tmp_path, "ca")
    server = make_cert(tmp_path, "server", "sandboxd-mcp", ca, server=True)
    agent = make_cert(tmp_path, "agent", "agent", ca)
    other = make_cert(tmp_path, "other", "agent", make_ca(tmp_path, "other-ca"))
    proc, url = start_http_server(daemon, ws, tmp_path, "--http-tls-cert", str(server[0]), "--http-tls-key",
                                  str(server[1]), "--http-client-ca", str(ca[0]))
    assert url.startswith("https://127.0.0.1:")
    try:
        for cert in (None, other):
            with httpx2.Client(verify=tls_context(ca, cert), timeout=10, trust_env=False) as h, \
                    pytest.raises(httpx2.HTTPError):
                h.post(url, json={})

        async def scenario():
            async with httpx2.AsyncClient(verify=tls_context(ca, agent), timeout=60,
                                          trust_env=False) as http:
                async with streamable_http_client(url, http_client=http) as (read, write):
                    async with ClientSession(read, write, client_info=AGENT) as s:
                        await s.initialize()
                        ran = await call(s, "run_command", command="echo mutual")
                        assert ran.structured_content["stdout"] == "mutual\n"

        anyio.run(scenario)
    finally:
        stop(proc)


def test_a_daemon_that_goes_away_is_a_tool_error_until_it_is_back(spare_daemon):
    d = spare_daemon().start()
    ws = d.new_workspace({"a.txt": "still here\n"})

    async def scenario():
        async with stdio_session(d, ws) as s:
            first = await call(s, "read_file", path="a.txt")
            assert first.structured_content["content"] == "still here\n"
            d.stop()
            down = await call(s, "read_file", path="a.txt")
            assert down.is_error and down.structured_content["error"]["code"] == "UNAVAILABLE"
            assert "not answering" in text(down) and str(d.socket) in text(down)
            d.start()  # its leases did not survive it: the server takes a new one unasked
            back = await call(s, "read_file", path="a.txt")
            assert not back.is_error, text(back)
            assert back.structured_content["content"] == "still here\n"
            return first.structured_content["tool_call_id"], back.structured_content["tool_call_id"]

    first, back = anyio.run(scenario)
    with d.client() as c:
        leases = {requested(c, i)["runtime"]["leaseId"] for i in (first, back)}
        assert len(leases) == 2 and "" not in leases


def test_a_client_of_the_2026_protocol_is_served_too(daemon):
    """mcp.Client speaks the per-request protocol (2026-07-28) when the server does: no
    initialize, the client's name in every request's envelope."""
    from mcp import Client

    ws = daemon.new_workspace({"a.txt": "modern\n"})

    async def scenario():
        params = StdioServerParameters(command=SANDBOXD_MCP, args=server_args(daemon, ws),
                                       env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        async with Client(params, client_info=AGENT) as c:
            ran = await c.call_tool("run_command", {"command": ["cat", "a.txt"]})
            assert ran.structured_content["stdout"] == "modern\n"
            return ran.structured_content["tool_call_id"]

    tool_call_id = anyio.run(scenario)
    with daemon.client() as c:
        assert requested(c, tool_call_id)["proposedBy"] == "mcp:pytest-agent/7.1"


def raw_stdio_server(d, ws: Path) -> subprocess.Popen:
    proc = subprocess.Popen([SANDBOXD_MCP, *server_args(d, ws)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    for message in ({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                        "protocolVersion": "2025-11-25", "capabilities": {},
                        "clientInfo": {"name": "raw", "version": "1"}}},
                    {"jsonrpc": "2.0", "method": "notifications/initialized"}):
        proc.stdin.write(json.dumps(message).encode() + b"\n")
        proc.stdin.flush()
    assert b'"id":1' in proc.stdout.readline()
    return proc


def tool_call(proc: subprocess.Popen, request_id: int, command: list[str]) -> None:
    proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {
        "name": "run_command", "arguments": {"command": command}}}).encode() + b"\n")
    proc.stdin.flush()


@pytest.mark.parametrize("busy", [False, True])
def test_sigterm_ends_a_stdio_server_and_gives_the_lease_back(daemon, busy):
    """A client (or an operator) that signals without closing stdin first: the server
    still ends at once, and its lease is given back, even with a command running."""
    ws = daemon.new_workspace()
    proc = raw_stdio_server(daemon, ws)
    try:
        tool_call(proc, 2, ["true"])
        assert b'"exit_code":0' in proc.stdout.readline()
        with daemon.client() as c:
            assert len(held_leases(c, ws)) == 1
        if busy:
            tool_call(proc, 3, ["sleep", "60"])
            with daemon.client() as c:
                assert wait_for(lambda: [r for r in c.list_running().calls if r.workspace == str(ws)], timeout_s=10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with daemon.client() as c:
        assert wait_for(lambda: not held_leases(c, ws), timeout_s=20), "the lease was not given back"
        assert wait_for(lambda: not [r for r in c.list_running().calls if r.workspace == str(ws)], timeout_s=20)


def test_at_start_a_refused_policy_exits_2_and_an_absent_daemon_is_only_a_warning(daemon, tmp_path):
    outside = subprocess.run([SANDBOXD_MCP, *server_args(daemon, tmp_path)], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=60)
    assert outside.returncode == 2 and "sandboxd refuses this policy or workspace" in outside.stderr, outside.stderr
    ws = daemon.new_workspace()

    async def scenario():
        params = StdioServerParameters(command=SANDBOXD_MCP, args=["--socket", str(tmp_path / "absent.sock"),
                                                                   "--workspace", str(ws)],
                                       env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        with open(tmp_path / "stderr", "w") as errlog:
            async with stdio_client(params, errlog=errlog) as (read, write):
                async with ClientSession(read, write, client_info=AGENT) as s:
                    await s.initialize()
                    down = await call(s, "list_files")
                    assert down.is_error and down.structured_content["error"]["code"] == "UNAVAILABLE"

    anyio.run(scenario)
    assert "does not answer" in (tmp_path / "stderr").read_text()


@pytest.mark.parametrize("adapter", BACKENDS)
def test_an_agent_never_reads_the_workspaces_secret_files(daemon, adapter):
    """Issue 32: `-w .` and no policy file, and the agent read .env. The daemon's
    always_blocked masks it in every call, whatever the server's policy says."""
    ws = daemon.new_workspace({".env": "SECRET=hunter2\n", ".env.example": "SECRET=\n", "README.md": "hi\n"})

    async def scenario():
        async with stdio_session(daemon, ws, "-w", ".", "--adapter", adapter) as s:
            read = await call(s, "read_file", path=".env")
            ran = await call(s, "run_command",
                             command=["sh", "-c", "cat .env; cat /workspace/./.env; grep -rs hunter2 ."])
            found = await call(s, "search_files", pattern="hunter2")
            example = await call(s, "read_file", path=".env.example")
            return read, ran, found, example

    read, ran, found, example = anyio.run(scenario)
    for result in (read, ran, found):
        assert "hunter2" not in text(result) and "hunter2" not in json.dumps(result.structured_content)
    assert read.is_error or read.structured_content.get("content", "") == ""
    assert example.structured_content["content"] == "SECRET=\n"
    with daemon.client() as c:
        checked = next(json.loads(e.payload_json) for e in c.get_trace(ran.structured_content["tool_call_id"])
                       if e.type == "ToolPolicyChecked")
    assert "/workspace/.env" in checked["masks"]
    assert any(n.startswith("always_blocked: .env masks /workspace/.env") for n in checked["notes"])


def test_a_policy_lowering_deny_private_networks_is_refused_for_an_unlisted_principal(daemon, tmp_path):
    """The shared daemon lists no principal in egress.private_networks_principals."""
    ws = daemon.new_workspace()
    policy = tmp_path / "open.json"
    policy.write_text(json.dumps({"network": {"egress": "allowlist", "allowDomains": ["pypi.org"],
                                              "denyPrivateNetworks": False}}))
    refused = subprocess.run([SANDBOXD_MCP, *server_args(daemon, ws), "--policy", str(policy)],
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stderr
    assert "PERMISSION_DENIED" in refused.stderr or "permission" in refused.stderr.lower(), refused.stderr
    assert "policy.network.denyPrivateNetworks" in refused.stderr
    assert "egress.private_networks_principals" in refused.stderr
