"""Principals from peer credentials, and tenant isolation. A connection's principal is
fixed when it connects: the test connects with another effective uid, then returns."""

from __future__ import annotations

import io
import os
from contextlib import contextmanager

import grpc
import pytest

from sandboxd_client import SandboxdClient, errors
from sandboxd_client.client import run_request
from sandboxd_contract.pb import sandboxd_pb2 as pb
from sandboxd_contract.pb import sandboxd_pb2_grpc as pb_grpc
from sandboxd_client.transfer import target

from .conftest import call

ALICE, BOB, STRANGER = 1000, 1001, 1002


@contextmanager
def client_as(d, uid: int):
    os.seteuid(uid)
    try:
        c = SandboxdClient(str(d.socket))
        c.wait_ready(10)
    finally:
        os.seteuid(0)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def tenants(spare_daemon):
    d = spare_daemon(principals={0: "root", ALICE: "alice", BOB: "bob"}, admins=["root"], socket_mode=0o666).start()
    return d


def test_tenants_see_only_their_own_calls(tenants):
    d = tenants
    alice_ws = d.new_workspace({"notes.txt": "alice's\n"}, uid=ALICE)
    bob_ws = d.new_workspace({"notes.txt": "bob's\n"}, uid=BOB)
    with client_as(d, ALICE) as alice, client_as(d, BOB) as bob:
        mine = alice.run(call(alice_ws, ["cat", "/workspace/notes.txt"]))
        assert mine.stdout == b"alice's\n"
        artifact = mine.result.artifacts[0].artifact_id
        trace = alice.get_trace(mine.tool_call_id)
        assert '"principal":"alice"' in trace[0].payload_json

        # Bob cannot tell Alice's call from one that does not exist.
        attempts = {
            "trace": lambda: bob.get_trace(mine.tool_call_id),
            "artifacts": lambda: bob.list_artifacts(mine.tool_call_id),
            "download": lambda: bob.download_artifact(artifact, io.BytesIO()),
            "cancel": lambda: bob.cancel(mine.tool_call_id),
            "export": lambda: list(bob.export_events(mine.tool_call_id)),
        }
        for name, attempt in attempts.items():
            with pytest.raises(errors.NotFound):
                attempt()
                pytest.fail(f"{name} answered bob")
        with pytest.raises(errors.PermissionDenied):
            bob.verify_log()
        # Nor run in her workspace (it would run as her).
        with pytest.raises(errors.PermissionDenied) as exc:
            bob.run(call(alice_ws, ["cat", "/workspace/notes.txt"]))
        assert "workspace" in exc.value.message
        assert bob.run(call(bob_ws, ["cat", "/workspace/notes.txt"])).stdout == b"bob's\n"

        # The same idempotency key is each tenant's own.
        keyed = call(alice_ws, ["echo", "a"])
        keyed["runtime"]["idempotencyKey"] = "shared-key"
        first = alice.run(keyed)
        keyed_bob = call(bob_ws, ["echo", "a"])
        keyed_bob["runtime"]["idempotencyKey"] = "shared-key"
        assert bob.run(keyed_bob).tool_call_id != first.tool_call_id

    with client_as(d, 0) as admin:  # the admin role reads every tenant's traces
        assert admin.get_trace(mine.tool_call_id)[0].tool_call_id == mine.tool_call_id
        assert admin.verify_log().ok


def test_an_unknown_uid_is_unauthenticated(tenants):
    ws = tenants.new_workspace(uid=STRANGER)
    with client_as(tenants, STRANGER) as stranger:
        with pytest.raises(errors.Unauthenticated):
            stranger.run(call(ws, ["true"]))
        with pytest.raises(errors.Unauthenticated):
            stranger.get_trace("tc-anything")


def test_socket_owner_group_and_mode_come_from_the_config(spare_daemon):
    import stat

    d = spare_daemon(principals={0: "root", ALICE: "alice"}, socket_mode=0o660, socket_group=str(ALICE)).start()
    st = os.stat(d.socket)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, ALICE, 0o660)
    # Group members get in; alice (gid 1000 as her own group) is one of them.
    os.setegid(ALICE)
    try:
        with client_as(d, ALICE) as alice:
            alice.query_calls()
    finally:
        os.setegid(0)
    # Anyone else is stopped by the file mode before the daemon even sees them.
    with pytest.raises(PermissionError):
        os.seteuid(BOB)
        try:
            import socket

            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(str(d.socket))
            finally:
                s.close()
        finally:
            os.seteuid(0)


def test_file_transfer_is_each_tenants_own(tenants, tmp_path):
    """Another tenant's workspace, lease and transfer record read as absent (or refused,
    for a workspace, as for a call); a tenant's upload lands as its own uid."""
    d = tenants
    alice_ws = d.new_workspace({"notes.txt": "alice's\n"}, uid=ALICE)
    src = tmp_path / "up.txt"  # read by the test process (root again when it sends)
    src.write_text("from a tenant\n")
    with client_as(d, ALICE) as alice, client_as(d, BOB) as bob:
        lease = alice.acquire_sandbox(str(alice_ws), {"filesystem": {"writeRoots": ["/workspace"]}})
        mine = alice.upload(target(lease_id=lease.lease_id), "/workspace/a.txt", src)
        assert os.stat(alice_ws / "a.txt").st_uid == ALICE
        writable = {"filesystem": {"writeRoots": ["/workspace"]}}
        with pytest.raises(errors.PermissionDenied, match="workspace"):
            bob.upload(target(alice_ws, policy=writable), "/workspace/b.txt", src)
        with pytest.raises(errors.PermissionDenied, match="workspace"):
            bob.download(target(alice_ws), "/workspace/notes.txt", tmp_path / "stolen")
        with pytest.raises(errors.NotFound):
            bob.download(target(lease_id=lease.lease_id), "/workspace/notes.txt", tmp_path / "stolen")
        with pytest.raises(errors.NotFound):
            bob.get_trace(mine.transfer_id)
        assert not (tmp_path / "stolen").exists() and not (alice_ws / "b.txt").exists()
        assert alice.get_trace(mine.transfer_id)[0].type == "FilesTransferred"
        alice.release_sandbox(lease.lease_id)



def _answer(attempt) -> tuple[str, str]:
    """An RPC's refusal, as a caller sees it: its status and its text."""
    try:
        result = attempt()
        if hasattr(result, "__next__"):
            list(result)
    except grpc.RpcError as err:
        return err.code().name, err.details()
    return "OK", ""


def test_another_tenants_ids_are_answered_as_missing_ones_are(tenants, tmp_path):
    """For every RPC that takes a call, transfer, artifact or lease id, Bob gets the same
    status and text for one of Alice's as for an id that never existed (the id itself
    aside): no answer tells him hers exist."""
    d = tenants
    alice_ws = d.new_workspace({"notes.txt": "alice's\n"}, uid=ALICE)
    bob_ws = d.new_workspace(uid=BOB)
    src = tmp_path / "up.txt"
    src.write_text("x\n")
    with client_as(d, ALICE) as alice, client_as(d, BOB) as bob:
        mine = alice.run(call(alice_ws, ["cat", "/workspace/notes.txt"]))
        lease = alice.acquire_sandbox(str(alice_ws), {"filesystem": {"writeRoots": ["/workspace"]}})
        moved = alice.upload(target(lease_id=lease.lease_id), "/workspace/a.txt", src)
        ids = {"call": mine.tool_call_id, "transfer": moved.transfer_id,
               "artifact": mine.result.artifacts[0].artifact_id, "lease": lease.lease_id}
        missing = {"call": "tc-" + "0" * 24, "transfer": "xfer-" + "0" * 24,
                   "artifact": "art-" + "0" * 24, "lease": "lease-" + "0" * 24}
        channel = grpc.insecure_channel(f"unix://{d.socket}")
        exec_stub, trace_stub = pb_grpc.ExecutionServiceStub(channel), pb_grpc.TraceServiceStub(channel)
        art_stub, pool_stub = pb_grpc.ArtifactServiceStub(channel), pb_grpc.PoolServiceStub(channel)
        file_stub = pb_grpc.FileServiceStub(channel)

        def probes(which: dict[str, str]) -> dict[str, tuple[str, str]]:
            rpcs = {
                "Cancel": lambda: exec_stub.Cancel(pb.CancelRequest(tool_call_id=which["call"])),
                "StreamOutput": lambda: exec_stub.StreamOutput(pb.StreamOutputRequest(tool_call_id=which["call"])),
                "GetTrace(call)": lambda: trace_stub.GetTrace(pb.GetTraceRequest(tool_call_id=which["call"])),
                "GetTrace(transfer)": lambda: trace_stub.GetTrace(pb.GetTraceRequest(
                    tool_call_id=which["transfer"])),
                "ExportEvents": lambda: trace_stub.ExportEvents(pb.ExportEventsRequest(tool_call_id=which["call"])),
                "ListArtifacts": lambda: art_stub.ListArtifacts(pb.ListArtifactsRequest(tool_call_id=which["call"])),
                "DownloadArtifact": lambda: art_stub.DownloadArtifact(pb.DownloadArtifactRequest(
                    artifact_id=which["artifact"])),
                "ReleaseSandbox": lambda: pool_stub.ReleaseSandbox(pb.ReleaseSandboxRequest(
                    lease_id=which["lease"])),
                "Download(lease)": lambda: file_stub.Download(pb.DownloadRequest(
                    target=pb.TransferTarget(lease_id=which["lease"]), path="/workspace/notes.txt")),
                "Run(leased)": lambda: exec_stub.Run(run_request(call(
                    bob_ws, ["true"], runtime={"leaseId": which["lease"]}))),
            }
            answers = {}
            os.seteuid(BOB)  # the stub's connection is made as Bob on its first call
            try:
                for name, rpc in rpcs.items():
                    code, text = _answer(rpc)
                    for kind, value in which.items():
                        text = text.replace(value, f"<{kind}>")
                    answers[name] = (code, text)
            finally:
                os.seteuid(0)
            return answers

        try:
            theirs, none = probes(ids), probes(missing)
            for name in theirs:
                assert theirs[name] == none[name], name
                assert theirs[name][0] == "NOT_FOUND", (name, theirs[name])
        finally:
            channel.close()
            alice.release_sandbox(lease.lease_id)
