"""The operator's floors under every caller's policy (issue 32), for real on both backends.
always_blocked: well-known secret files masked in every call as a policy's blockedPaths
are, whatever the policy; the trace and ExplainPolicy say which rule hid each; file
transfers never send one; a policy cannot show one; a leased command never runs where
its sandbox does not mask one; the operator alone turns the list off.
egress.private_networks_principals: only a listed principal may set denyPrivateNetworks
to false; anyone else is refused on every path, before anything is made, on record. (No
traffic at all: the refusal is at admission.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sandboxd.core.settings import DaemonSettings
from sandboxd_client import errors
from sandboxd_client.transfer import target
from sandboxd_testing import WORKSPACE_UID, make_daemon

from .conftest import BACKENDS, DAEMON_ENV, DEFAULT_IMAGE, AdapterClient, call, public_tmpdir, sh, stop_and_clean
from .test_tenants import client_as

ALICE = WORKSPACE_UID  # listed in egress.private_networks_principals; root (an admin) is not
# The default list, and one pattern at any depth (the default names the workspace's top only).
ALWAYS_BLOCKED = [*DaemonSettings().always_blocked, "**/credentials.json"]
SECRETS = {".env": "SECRET=hunter2\n", ".env.example": "SECRET=changeme\n", "sub/.env": "SUB=in-a-subdirectory\n",
           "sub/credentials.json": '{"token": "t0p-s3cret"}\n', ".ssh/id_ed25519": "PRIVATE KEY\n",
           "README.md": "hello\n"}
LOWERED = {"network": {"egress": "allowlist", "allowDomains": ["pypi.org"], "denyPrivateNetworks": False}}


@pytest.fixture(scope="module")
def floors(docker_engine):
    base = public_tmpdir("sandboxd-floors-")
    d = make_daemon(base, env=DAEMON_ENV, principals={0: "root", ALICE: "alice"}, admins=["root"],
                    socket_mode=0o666, egress={"private_networks_principals": ["alice"]},
                    always_blocked=ALWAYS_BLOCKED).start()
    yield d
    stop_and_clean(d, docker_engine, base)


@pytest.fixture(params=BACKENDS)
def adapter(request) -> str:
    return request.param


@pytest.fixture
def root(floors, adapter):
    c = AdapterClient(str(floors.socket), adapter)
    yield c
    c.close()


def checked(client, tool_call_id: str) -> dict:
    return next(json.loads(e.payload_json) for e in client.get_trace(tool_call_id) if e.type == "ToolPolicyChecked")


def rejected(client, tool_call_id: str) -> dict:
    events = client.get_trace(tool_call_id)
    assert [e.type for e in events] == ["ToolCallRequested", "ToolCallRejected"]
    return json.loads(events[-1].payload_json)


# ------------------------------------------------------------------ always_blocked


@pytest.mark.parametrize("policy", [None, {"filesystem": {"writeRoots": ["/workspace"], "blockedPaths": []}}],
                         ids=["no-policy", "writable"])
def test_secret_files_are_masked_in_every_call_and_the_trace_names_the_rule(floors, root, policy):
    ws = floors.new_workspace(SECRETS)
    out = root.run(call(ws, sh("cat .env /workspace/./.env /proc/self/cwd/.env; echo rc=$?; cat .env.example; "
                               "cat sub/.env; cat sub/credentials.json; ls .ssh; grep -rs hunter2 /workspace; "
                               "echo x > .env; rm -f .env; mv .env gone; echo end"), policy))
    stdout = out.stdout.decode()
    assert out.result.status == "success", out.stderr
    assert "hunter2" not in stdout and "t0p-s3cret" not in stdout and "PRIVATE KEY" not in stdout
    assert "rc=1" in stdout and "SECRET=changeme" in stdout, stdout  # a template stays readable
    assert "SUB=in-a-subdirectory" in stdout  # the default is the top level only ...
    assert stdout.endswith("end\n")
    assert (ws / ".env").read_text() == "SECRET=hunter2\n"  # ... and nothing could change or move it
    seen = checked(root, out.tool_call_id)
    assert {"/workspace/.env", "/workspace/.ssh", "/workspace/sub/credentials.json"} <= set(seen["masks"])
    assert "/workspace/.env.example" not in seen["masks"] and "/workspace/sub/.env" not in seen["masks"]
    for rule, path in ((".env", "/workspace/.env"), (".ssh/", "/workspace/.ssh"),
                       ("**/credentials.json", "/workspace/sub/credentials.json")):
        assert any(n.startswith(f"always_blocked: {rule} masks {path}") for n in seen["notes"]), seen["notes"]


def test_explain_shows_what_always_blocked_masks(floors, root):
    ws = floors.new_workspace(SECRETS)
    explained = root.explain(None, str(ws), adapter=root.adapter)
    assert any(n.startswith("always_blocked: .env masks /workspace/.env") for n in explained.notes), explained.notes
    staged = {m["relative_path"] for m in json.loads(explained.spec_json)["staging"]["masks"]}  # placed on the inode
    assert {".env", ".ssh", "sub/credentials.json"} <= staged and ".env.example" not in staged


def test_a_policy_cannot_show_an_always_blocked_path(floors, root):
    ws = floors.new_workspace(SECRETS)
    for policy, field in (({"filesystem": {"readRoots": ["/workspace/.ssh"]}}, "policy.filesystem.readRoots[0]"),
                          ({"filesystem": {"readRoots": ["/workspace/.env"]}}, "policy.filesystem.readRoots[0]")):
        with pytest.raises(errors.PermissionDenied) as exc:
            root.run(call(ws, ["true"], policy))
        assert field in exc.value.message and "always_blocked" in exc.value.message
        assert rejected(root, exc.value.tool_call_id)["field"] == field
    with pytest.raises(errors.PermissionDenied) as exc:  # nor a workspace inside one (`-w ~/.ssh`)
        root.run(call(ws / ".ssh", ["true"]))
    assert "always_blocked: .ssh/" in exc.value.message


def test_a_leased_command_is_refused_once_a_secret_appears_its_sandbox_does_not_mask(floors, adapter):
    ws = floors.new_workspace(SECRETS)
    c = AdapterClient(str(floors.socket), adapter)
    lease = c.acquire_sandbox(str(ws), adapter=adapter)
    try:
        leased = {"runtime": {"adapter": adapter, "leaseId": lease.lease_id}}
        out = c.run(call(ws, sh("cat .env; echo rc=$?"), **leased))
        assert b"hunter2" not in out.stdout and b"rc=1" in out.stdout
        (ws / ".env.production").write_text("PROD=s3cret\n")  # the owner adds one while the lease is held
        os.chown(ws / ".env.production", WORKSPACE_UID, WORKSPACE_UID)
        with pytest.raises(errors.FailedPrecondition) as exc:
            c.run(call(ws, sh("cat .env.production"), **leased))
        assert lease.lease_id in exc.value.message and "always_blocked: .env.*" in exc.value.message
        assert rejected(c, exc.value.tool_call_id)["field"] == "runtime.leaseId"
        # A fresh sandbox masks it.
        out = c.run(call(ws, sh("cat .env.production; echo rc=$?")))
        assert b"s3cret" not in out.stdout and b"rc=1" in out.stdout
    finally:
        c.release_sandbox(lease.lease_id)
        c.close()


def test_a_transfer_never_sends_an_always_blocked_file(floors, tmp_path):
    ws = floors.new_workspace(SECRETS)
    with floors.client() as c:
        with pytest.raises(errors.PermissionDenied, match="blocked"):
            c.download(target(ws), "/workspace/.env", tmp_path / "env")
        result = c.download(target(ws), "/workspace", tmp_path / "all")
    got = {str(p.relative_to(tmp_path / "all")) for p in (tmp_path / "all").rglob("*") if p.is_file()}
    assert got == {".env.example", "README.md", "sub/.env"}
    assert {s.split(":")[0] for s in result.skipped} >= {"/workspace/.env", "/workspace/.ssh",
                                                        "/workspace/sub/credentials.json"}


def test_the_operator_alone_turns_the_list_off(spare_daemon):
    d = spare_daemon(always_blocked=[]).start()
    ws = d.new_workspace(SECRETS)
    for adapter in BACKENDS:
        with AdapterClient(str(d.socket), adapter) as c:
            out = c.run(call(ws, ["cat", "/workspace/.env"]))
            assert out.stdout == b"SECRET=hunter2\n" and checked(c, out.tool_call_id)["masks"] == []


# ------------------------------------------------------------------ egress.private_networks_principals


def test_an_unlisted_principal_cannot_lower_deny_private_networks_anywhere(floors, root):
    ws = floors.new_workspace({"README.md": "hi\n"})
    with pytest.raises(errors.PermissionDenied) as exc:
        root.run(call(ws, ["true"], LOWERED))  # root: an admin, and still not listed
    assert "policy.network.denyPrivateNetworks" in exc.value.message
    assert "egress.private_networks_principals" in exc.value.message
    said = rejected(root, exc.value.tool_call_id)
    assert said["field"] == "policy.network.denyPrivateNetworks" and "private_networks_principals" in said["reason"]
    for attempt in (lambda: root.explain(LOWERED, str(ws), adapter=root.adapter),
                    lambda: root.acquire_sandbox(str(ws), LOWERED, adapter=root.adapter),
                    lambda: root.create_pool(str(ws), LOWERED, adapter=root.adapter)):
        with pytest.raises(errors.PermissionDenied) as exc:
            attempt()
        assert "policy.network.denyPrivateNetworks" in exc.value.message
        # On record as a refused call is, under the id the error names.
        assert rejected(root, exc.value.tool_call_id)["field"] == "policy.network.denyPrivateNetworks"
    assert not [p for p in root.list_pools() if p.workspace == str(ws)]  # nothing half-created


def test_a_listed_principal_may_lower_it(floors, adapter):
    ws = floors.new_workspace({"README.md": "hi\n"}, uid=ALICE)
    with client_as(floors, ALICE) as alice:
        out = alice.run(call(ws, ["cat", "/workspace/README.md"], LOWERED,
                             runtime={"image": DEFAULT_IMAGE, "adapter": adapter}))
        assert out.stdout == b"hi\n", out.stderr
        assert json.loads(alice.get_trace(out.tool_call_id)[1].payload_json)["effectivePolicy"][
            "denyPrivateNetworks"] is False
        explained = alice.explain(LOWERED, str(ws), adapter=adapter)
        assert json.loads(explained.network_plan_json)["denyPrivateNetworks"] is False
        lease = alice.acquire_sandbox(str(ws), LOWERED, adapter=adapter)
        alice.release_sandbox(lease.lease_id)
