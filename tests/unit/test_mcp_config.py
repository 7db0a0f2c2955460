"""sandboxd-mcp's operator options (pure: no daemon, no listener): the policy they make,
the refusals of options that cannot be served (an open HTTP endpoint above all), the
bearer token's file and check, and the shape of the package (modules and functions
within the house limits). docs/MCP.md's client configurations parse as its options."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from sandboxd_client.mcp import cli
from sandboxd_client.mcp.config import UsageError, server_config
from sandboxd_client.mcp.http import MIN_TOKEN_CHARS, BearerAuth, load_token, transport_security

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "client" / "sandboxd_client" / "mcp"


def config(tmp_path, *flags: str):
    return server_config(["--workspace", str(tmp_path), *flags])


def test_the_default_is_a_read_only_workspace_without_network(tmp_path):
    c = config(tmp_path)
    assert c.operator.policy == {"process": {"timeoutMs": 60_000}}
    assert c.operator.read_roots == ("/workspace",) and not c.operator.write_roots and c.operator.egress == "none"
    assert c.http is None and c.lease and c.workspace == str(tmp_path)


def test_presets_make_the_policy_and_a_flag_never_contradicts_the_file(tmp_path):
    c = config(tmp_path, "-w", ".", "--network", "pypi.org,*.pythonhosted.org", "--timeout-ms", "9000",
               "--memory-mb", "512", "-e", "CI=1")
    assert c.operator.policy == {
        "filesystem": {"readRoots": ["/workspace"], "writeRoots": ["."]},
        "network": {"egress": "allowlist", "allowDomains": ["pypi.org", "*.pythonhosted.org"]},
        "environment": {"injectedEnv": {"CI": "1"}}, "process": {"timeoutMs": 9000, "maxMemoryMb": 512}}
    assert c.operator.write_roots == ("/workspace",) and c.operator.timeout_ms == 9000
    policy = tmp_path / "p.yaml"
    policy.write_text("network: {egress: none}\nprocess: {timeoutMs: 1000}\n")
    assert config(tmp_path, "--policy", str(policy)).operator.timeout_ms == 1000
    for flags, named in ((["--network", "open"], "--network open contradicts policy.network.egress"),
                         (["--timeout-ms", "2000"], "--timeout-ms 2000 contradicts policy.process.timeoutMs")):
        with pytest.raises(UsageError, match=re.escape(named)):
            config(tmp_path, "--policy", str(policy), *flags)


@pytest.mark.parametrize("flags,named", [
    (["--http", "127.0.0.1:8765"], "--http needs --token-file or mutual TLS"),
    (["--http", "0.0.0.0:8765", "--token-file", "t"], "not a loopback address; give --allow-remote"),
    (["--http", "8765", "--token-file", "t"], "expected HOST:PORT"),
    (["--http", "127.0.0.1:70000", "--token-file", "t"], "expected HOST:PORT"),
    (["--token-file", "t"], "--token-file goes with --http"),
    (["--http", "127.0.0.1:1", "--http-tls-cert", "c"], "go together"),
    (["--http", "127.0.0.1:1", "--http-client-ca", "ca", "--token-file", "t"], "needs --http-tls-cert"),
    (["--timeout-ms", "0"], "--timeout-ms 0: must be positive"),
    (["--output-cap-bytes", "255"], "--output-cap-bytes 255: must be at least 256"),
    (["--max-write-bytes", "0"], "--max-write-bytes 0"),
])
def test_options_that_cannot_be_served_are_refused_by_name(tmp_path, flags, named):
    with pytest.raises(UsageError, match=re.escape(named)):
        config(tmp_path, *flags)


def test_http_on_loopback_or_with_allow_remote(tmp_path):
    c = config(tmp_path, "--http", "[::1]:0", "--token-file", "t")
    assert (c.http.host, c.http.port, c.http.loopback) == ("::1", 0, True)
    remote = config(tmp_path, "--http", "0.0.0.0:8765", "--http-tls-cert", "c", "--http-tls-key", "k",
                    "--http-client-ca", "ca", "--allow-remote")
    assert remote.http.mutual_tls and not remote.http.loopback
    assert not transport_security(remote.http).enable_dns_rebinding_protection
    local = transport_security(c.http)
    assert local.enable_dns_rebinding_protection and "[::1]:*" in local.allowed_hosts


def test_the_command_exits_2_with_the_reason(tmp_path, capsys):
    assert cli.main(["--workspace", str(tmp_path / "nope")]) == 2
    assert "--workspace" in capsys.readouterr().err
    assert cli.main(["--workspace", str(tmp_path), "--http", "127.0.0.1:1"]) == 2
    assert "never open" in capsys.readouterr().err


def test_a_token_file_must_be_private_and_the_token_long(tmp_path):
    f = tmp_path / "token"
    f.write_text("s" * MIN_TOKEN_CHARS + "\n")
    f.chmod(0o644)
    with pytest.raises(UsageError, match="chmod 600"):
        load_token(str(f))
    f.chmod(0o600)
    assert load_token(str(f)) == "s" * MIN_TOKEN_CHARS
    for bad in ("s" * (MIN_TOKEN_CHARS - 1), "two words-long-enough-here"):
        f.write_text(bad)
        with pytest.raises(UsageError, match="one word"):
            load_token(str(f))
    with pytest.raises(UsageError, match="No such file"):
        load_token(str(tmp_path / "absent"))


def asgi_status(app, headers: list[tuple[bytes, bytes]]) -> int:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    anyio.run(app, {"type": "http", "headers": headers}, receive, send)
    return sent[0]["status"]


def test_bearer_auth_lets_only_the_token_through():
    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    app = BearerAuth(inner, "t" * 20)
    assert asgi_status(app, [(b"authorization", b"Bearer " + b"t" * 20)]) == 200
    for headers in ([], [(b"authorization", b"Bearer " + b"t" * 19)], [(b"authorization", b"t" * 20)],
                    [(b"authorization", b"Basic dDp0")],
                    [(b"authorization", b"Bearer " + b"t" * 20), (b"authorization", b"Bearer x")]):
        assert asgi_status(app, headers) == 401, headers


def test_docs_client_configurations_are_options_the_server_takes(tmp_path):
    blocks = re.findall(r"```json\n(.*?)```", (ROOT / "docs" / "MCP.md").read_text(), re.S)
    servers = [s for b in blocks for s in json.loads(b).get("mcpServers", {}).values()]
    assert len(servers) >= 2
    for s in servers:
        assert s.get("command") == "sandboxd-mcp" or s.get("type") == "http" or "url" in s
        if "args" in s:
            args = [a if not a.startswith("/home/") else str(tmp_path) for a in s["args"]]
            server_config(args)


def test_the_package_keeps_the_house_limits():
    """No module over 500 lines, no function over 80 (tests/unit/test_layers.py's
    measure, applied to this package)."""
    for path in PACKAGE.glob("*.py"):
        source = path.read_text()
        assert len(source.splitlines()) <= 500, path
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 80, f"{path.name}:{node.name}"


NO_SDK = """
import sys
for name in ("mcp", "mcp.server", "mcp_types"):
    sys.modules[name] = None  # an install without the `mcp` extra
from sandboxd_client.mcp.cli import main
sys.exit(main(["--workspace", sys.argv[1]]))
"""


def test_without_the_mcp_extra_it_says_how_to_get_it(tmp_path):
    out = subprocess.run([sys.executable, "-c", NO_SDK, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "pip install 'sandboxd-client[mcp]'" in out.stderr, out.stderr
