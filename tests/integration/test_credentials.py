"""The credential broker for real, on both backends: a call names binding ids, the
sandbox gets the values (as env through the shim, or as a file on its tmpfs), and the
values never reach the client, the artifacts, the trace or the engine's config."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import textwrap

import pytest

from sandboxd_testing import make_daemon
from sandboxd_client import errors

from .conftest import BACKENDS, DAEMON_ENV, AdapterClient, call, sh, docker_client, public_tmpdir, sandbox_containers, stop_and_clean

FILE_SECRET = "ghp_file_secret_9f8e7d6c5b4a3210"
ENV_SECRET = "env-secret-Zq81-p0w3r-7777"
CMD_SECRET = "cmd-secret-value-4242-abcdef"


@pytest.fixture(scope="module")
def broker_daemon(docker_engine):
    base = public_tmpdir("sandboxd-creds-")
    secret_file = base / "gh-token"
    secret_file.write_text(FILE_SECRET + "\n")
    secret_file.chmod(0o600)
    loose = base / "loose-token"
    loose.write_text("whatever\n")
    loose.chmod(0o644)
    d = make_daemon(base / "d", env={**DAEMON_ENV, "SANDBOXD_TEST_TOKEN": ENV_SECRET}, credentials={
        "gh": {"file": str(secret_file), "principals": ["root"], "tools": ["test.*"]},
        "envtok": {"env": "SANDBOXD_TEST_TOKEN", "principals": ["root"]},
        "cmdtok": {"command": ["printf", CMD_SECRET], "principals": ["root"]},
        "alice-only": {"env": "SANDBOXD_TEST_TOKEN", "principals": ["alice"]},
        "loose": {"file": str(loose), "principals": ["root"]},
    }).start()
    yield d
    stop_and_clean(d, docker_engine, base)


@pytest.fixture(params=BACKENDS)
def bc(broker_daemon, request):
    c = AdapterClient(str(broker_daemon.socket), request.param)
    yield c
    c.close()


def py(script: str) -> list[str]:
    return ["python3", "-c", textwrap.dedent(script)]


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def with_refs(ws, argv, refs, env_allowed=True, **extra):
    c = call(ws, argv, {"environment": {"secretEnvAllowed": env_allowed}}, **extra)
    c["credentialRefs"] = refs
    return c


def test_env_and_file_targets_carry_the_values(bc, broker_daemon):
    ws = broker_daemon.new_workspace()
    out = bc.run(with_refs(ws, py("""
        import hashlib, os
        h = lambda b: hashlib.sha256(b).hexdigest()
        print(h(os.environ["GH_TOKEN"].encode()), h(os.environ["ENV_TOKEN"].encode()))
        print(h(open("/tmp/creds/cmd.txt", "rb").read()), oct(os.stat("/tmp/creds/cmd.txt").st_mode & 0o777))
        try:
            open("/tmp/creds/cmd.txt", "a")
        except OSError as e:
            print("read-only", type(e).__name__)
    """), [{"bindingId": "gh", "envName": "GH_TOKEN"}, {"bindingId": "envtok", "envName": "ENV_TOKEN"},
           {"bindingId": "cmdtok", "filePath": "/tmp/creds/cmd.txt"}]))
    assert out.result.status == "success", out.stderr
    lines = out.stdout.decode().split("\n")
    assert lines[0] == f"{sha(FILE_SECRET)} {sha(ENV_SECRET)}"  # the file's trailing newline is not part of it
    assert lines[1] == f"{sha(CMD_SECRET)} 0o400"
    assert lines[2].startswith("read-only")
    injected = [json.loads(e.payload_json) for e in bc.get_trace(out.tool_call_id) if e.type == "CredentialInjected"]
    assert injected == [
        {"bindingId": "gh", "principal": "root", "target": {"env": "GH_TOKEN"}},
        {"bindingId": "envtok", "principal": "root", "target": {"env": "ENV_TOKEN"}},
        {"bindingId": "cmdtok", "principal": "root", "target": {"file": "/tmp/creds/cmd.txt"}},
    ]
    # Nothing is left on the daemon's tmpfs once the sandbox is gone.
    assert (broker_daemon.base / "runtime" / "secrets").is_dir()
    assert not list((broker_daemon.base / "runtime" / "secrets").glob("*/*"))


def test_printed_secrets_never_reach_the_client_the_artifacts_or_the_trace(bc, broker_daemon):
    ws = broker_daemon.new_workspace()
    out = bc.run(with_refs(ws, py("""
        import base64, os, sys, time
        s = os.environ["GH_TOKEN"]
        print("plain:", s, flush=True)
        half = len(s) // 2
        sys.stdout.write("split:" + s[:half]); sys.stdout.flush(); time.sleep(0.3)
        sys.stdout.write(s[half:] + "\\n"); sys.stdout.flush()
        print("b64:", base64.b64encode(s.encode()).decode(), flush=True)
        print("b64-offset:", base64.b64encode(b"xy" + s.encode()).decode(), flush=True)
        print("urlsafe:", base64.urlsafe_b64encode(b"x" + s.encode()).decode(), flush=True)
        print("hex:", s.encode().hex(), flush=True)
        print("stderr:", s, file=sys.stderr, flush=True)
        with open("/tmp/creds/f") as f:
            print("file:", f.read())
    """), [{"bindingId": "gh", "envName": "GH_TOKEN"}, {"bindingId": "cmdtok", "filePath": "/tmp/creds/f"}]))
    assert out.result.status == "success", out.stderr
    streamed = out.stdout + out.stderr
    stored = b""
    for ref in bc.list_artifacts(out.tool_call_id):
        buf = io.BytesIO()
        bc.download_artifact(ref.artifact_id, buf)
        stored += buf.getvalue()
    trace = "".join(e.payload_json for e in bc.get_trace(out.tool_call_id)).encode()
    previews = (out.result.stdout_preview + out.result.stderr_preview).encode()
    for secret in (FILE_SECRET, CMD_SECRET):
        raw = secret.encode()
        forms = [raw, base64.b64encode(raw), raw.hex().encode(), base64.b64encode(b"xy" + raw)[4:-4],
                 base64.urlsafe_b64encode(b"x" + raw)[4:-4]]
        for where, data in (("stream", streamed), ("artifacts", stored), ("trace", trace), ("previews", previews)):
            for form in forms:
                assert form not in data, (where, form)
    text = out.stdout.decode()
    assert text.count("[REDACTED:gh]") >= 6 and "[REDACTED:cmdtok]" in text
    assert "[REDACTED:gh]" in out.stderr.decode()
    assert "plain: [REDACTED:gh]\n" in text and "split:[REDACTED:gh]\n" in text


def test_a_secret_written_to_a_file_is_struck_from_its_artifact_and_the_diff(bc, broker_daemon):
    """The file itself keeps the value (the call wrote it); what the daemon keeps of it
    (the file artifact, the diff, under a name chosen after the secret too) does not."""
    ws = broker_daemon.new_workspace({"config.ini": "token = none\n"})
    c = with_refs(ws, sh(f"printf 'token = %s\\n' \"$GH_TOKEN\" > /workspace/config.ini; "
                         f"cp /workspace/config.ini \"/workspace/copy-$GH_TOKEN\""),
                  [{"bindingId": "gh", "envName": "GH_TOKEN"}])
    c["policy"]["filesystem"] = {"writeRoots": ["/workspace"]}
    out = bc.run(c)
    assert out.result.status == "success", out.stderr
    assert (ws / "config.ini").read_text() == f"token = {FILE_SECRET}\n"
    kept = {a.path: a for a in out.result.artifacts if a.kind in ("file", "diff")}
    assert set(kept) == {"/workspace/config.ini", "/workspace/copy-[REDACTED:gh]", ""}, set(kept)
    for ref in kept.values():
        buf = io.BytesIO()
        bc.download_artifact(ref.artifact_id, buf)
        assert FILE_SECRET.encode() not in buf.getvalue() and b"[REDACTED:gh]" in buf.getvalue(), ref
    trace = "".join(e.payload_json for e in bc.get_trace(out.tool_call_id))
    assert FILE_SECRET not in trace


def test_docker_inspect_of_a_running_sandbox_shows_no_secret(broker_daemon, docker_engine):
    ws = broker_daemon.new_workspace()
    c = AdapterClient(str(broker_daemon.socket), "docker")
    stream = c.execute(with_refs(ws, ["sh", "-c", "echo up; sleep 20"],
                                 [{"bindingId": "envtok", "envName": "TOKEN"},
                                  {"bindingId": "cmdtok", "filePath": "/tmp/c"}]))
    events = iter(stream)
    try:
        for event in events:
            if event.WhichOneof("kind") == "output":  # "up": streamed at once, redaction or not
                break
        [container] = [x for x in sandbox_containers(docker_engine, broker_daemon.daemon_id) if x.status == "running"]
        details = docker_client().api.inspect_container(container.id)
        inspected = json.dumps(details)
        for secret in (ENV_SECRET, CMD_SECRET, base64.b64encode(ENV_SECRET.encode()).decode()):
            assert secret not in inspected
        # Not even the variable is in the container's config: the shim sets it inside.
        assert not [e for e in details["Config"]["Env"] if e.startswith("TOKEN=")]
        # The daemon's own environment holds ENV_SECRET; nothing of it reaches the sandbox
        # but through the binding (an env var of the command, read from its file).
        proc_env = [open(f"/proc/{pid}/environ", "rb").read() for pid in _pids_of(container)]
        assert any(b"TOKEN=" + ENV_SECRET.encode() in env for env in proc_env)
        assert not any(b"SANDBOXD_TEST_TOKEN" in env for env in proc_env)
    finally:
        stream.cancel()
        c.close()


def _pids_of(container) -> list[int]:
    top = container.top(ps_args="-o pid")
    return [int(p[0]) for p in top["Processes"] if os.path.exists(f"/proc/{p[0]}/environ")]


@pytest.mark.parametrize("refs, env_allowed, field, kind", [
    ([{"bindingId": "gh", "envName": "T"}], False, "credentialRefs[0].envName", errors.PermissionDenied),
    ([{"bindingId": "alice-only", "envName": "T"}], True, "credentialRefs[0].bindingId", errors.PermissionDenied),
    ([{"bindingId": "no-such-binding", "envName": "T"}], True, "credentialRefs[0].bindingId", errors.PermissionDenied),
    ([{"bindingId": "gh", "filePath": "/workspace/token"}], True, "credentialRefs[0].filePath", errors.InvalidArgument),
    ([{"bindingId": "gh", "envName": "T", "filePath": "/tmp/t"}], True, "credentialRefs[0]", errors.InvalidArgument),
    ([{"bindingId": "loose", "filePath": "/tmp/t"}], True, "credentialRefs[0].bindingId", errors.FailedPrecondition),
])
def test_refused_references_name_the_field_and_start_nothing(broker_daemon, docker_engine, refs, env_allowed, field,
                                                              kind):
    ws = broker_daemon.new_workspace()
    with broker_daemon.client() as c, pytest.raises(kind) as exc:
        c.run(with_refs(ws, ["true"], refs, env_allowed=env_allowed))
    assert field in exc.value.message
    if refs[0]["bindingId"] in ("alice-only", "no-such-binding"):
        # Not allowed and not existing read the same: no oracle for binding ids.
        assert "is not available to root" in exc.value.message
    assert "whatever" not in exc.value.message and FILE_SECRET not in exc.value.message
    # Refused before anything was created: no container ever carried this call's id.
    assert exc.value.tool_call_id
    assert not docker_engine.api.containers(all=True, filters={"label": f"sandboxd.tool_call_id={exc.value.tool_call_id}"})


def test_a_tool_the_binding_does_not_list_is_refused(broker_daemon):
    ws = broker_daemon.new_workspace()
    with broker_daemon.client() as c, pytest.raises(errors.PermissionDenied):
        c.run(with_refs(ws, ["true"], [{"bindingId": "gh", "envName": "T"}], tool_id="other.tool"))


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_a_leased_sandbox_takes_env_credentials_per_command(broker_daemon, adapter):
    ws = broker_daemon.new_workspace()
    with broker_daemon.client() as c:
        lease = c.acquire_sandbox(str(ws), {"environment": {"secretEnvAllowed": True}}, adapter=adapter)
        cmd = with_refs(ws, py("""
            import hashlib, os
            print(hashlib.sha256(os.environ["GH_TOKEN"].encode()).hexdigest())
            print("leak:", os.environ["GH_TOKEN"])
        """), [{"bindingId": "gh", "envName": "GH_TOKEN"}])
        cmd["runtime"].update({"leaseId": lease.lease_id, "adapter": adapter})
        out = c.run(cmd)
        assert out.result.status == "success", out.stderr
        assert out.stdout.decode().split("\n")[:2] == [sha(FILE_SECRET), "leak: [REDACTED:gh]"]
        # The next command of the lease does not inherit it.
        plain = with_refs(ws, py("import os; print(os.environ.get('GH_TOKEN', 'absent'))"), [])
        plain["runtime"].update({"leaseId": lease.lease_id, "adapter": adapter})
        assert c.run(plain).stdout == b"absent\n"
        injected = [json.loads(e.payload_json) for e in c.get_trace(out.tool_call_id) if e.type == "CredentialInjected"]
        assert injected == [{"bindingId": "gh", "principal": "root", "target": {"env": "GH_TOKEN"}}]
        c.release_sandbox(lease.lease_id)


@pytest.mark.parametrize("adapter", ["docker", "nsjail"])
def test_a_leased_sandbox_takes_file_credentials_per_command_and_never_follows_a_planted_link(broker_daemon, adapter):
    ws = broker_daemon.new_workspace()
    policy = {"filesystem": {"writeRoots": ["/workspace"]}}
    with broker_daemon.client() as c:
        lease = c.acquire_sandbox(str(ws), policy, adapter=adapter)

        def leased(argv, refs):
            cmd = with_refs(ws, argv, refs)
            cmd["policy"].update(policy)
            cmd["runtime"].update({"leaseId": lease.lease_id, "adapter": adapter})
            return c.run(cmd)

        # An earlier command of the lease plants links where the credential will go.
        planted = leased(["sh", "-c", "mkdir -p /tmp/creds && ln -s /workspace/stolen /tmp/creds/gh "
                                      "&& ln -s /workspace /tmp/via"], [])
        assert planted.result.status == "success", planted.stderr
        out = leased(py("""
            import hashlib, os
            st = os.lstat("/tmp/creds/gh")
            print(hashlib.sha256(open("/tmp/creds/gh").read().encode()).hexdigest(), oct(st.st_mode & 0o777))
            print(hashlib.sha256(open("/tmp/abcdefghij").read().encode()).hexdigest())
        """), [{"bindingId": "gh", "filePath": "/tmp/creds/gh"}, {"bindingId": "cmdtok", "filePath": "/tmp/abcdefghij"}])
        assert out.result.status == "success", out.stderr
        assert out.stdout.decode().split() == [sha(FILE_SECRET), "0o400", sha(CMD_SECRET)]
        assert not (ws / "stolen").exists()
        # A directory link on the way is refused, not followed into the workspace.
        refused = leased(["true"], [{"bindingId": "gh", "filePath": "/tmp/via/gh"}])
        assert refused.result.status == "error" and "symlink" in refused.result.error.message
        assert not (ws / "gh").exists()
        # The next command finds nothing of it.
        after = leased(["sh", "-c", "ls -a /tmp/creds /tmp; cat /tmp/creds/gh /tmp/abcdefghij 2>&1 || echo gone"], [])
        assert after.stdout.endswith(b"gone\n"), after.stdout
        assert FILE_SECRET.encode() not in after.stdout and CMD_SECRET.encode() not in after.stdout
        listing = after.stdout.split(b"cat:")[0].split()
        assert b"abcdefghij" not in listing and b"gh" not in listing  # both went, not only one of them
        injected = [json.loads(e.payload_json) for e in c.get_trace(out.tool_call_id) if e.type == "CredentialInjected"]
        assert injected == [{"bindingId": "gh", "principal": "root", "target": {"file": "/tmp/creds/gh"}},
                            {"bindingId": "cmdtok", "principal": "root", "target": {"file": "/tmp/abcdefghij"}}]
        c.release_sandbox(lease.lease_id)
