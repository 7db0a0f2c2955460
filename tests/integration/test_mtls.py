"""TCP is mutual TLS or nothing: the principal comes from the client certificate's
subject, a client without a certificate (or with one from another CA, or naming nobody
the daemon knows) is refused, and plain TCP cannot even be configured."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from sandboxd_testing import make_daemon
from sandboxd_client import SandboxdClient, TlsFiles, errors

from .conftest import DAEMON_ENV, call, public_tmpdir
from .test_tenants import ALICE, client_as


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
            "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert))
    return cert, key


def make_cert(d: Path, name: str, cn: str, ca: tuple[Path, Path], *, server: bool = False) -> tuple[Path, Path]:
    key, csr, cert, ext = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem", d / f"{name}.ext"
    openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={cn}",
            "-keyout", str(key), "-out", str(csr))
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n" if server else "extendedKeyUsage=clientAuth\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
            "-days", "1", "-extfile", str(ext), "-out", str(cert))
    return cert, key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pki():
    d = public_tmpdir("sandboxd-pki-")
    ca = make_ca(d, "ca")
    other_ca = make_ca(d, "other-ca")
    return {
        "dir": d, "ca": ca,
        "server": make_cert(d, "server", "sandboxd", ca, server=True),
        "alice": make_cert(d, "alice", "alice", ca),
        "mallory": make_cert(d, "mallory", "mallory", ca),
        "impostor": make_cert(d, "impostor", "alice", other_ca),
    }


@pytest.fixture
def tls_daemon(spare_daemon, pki):
    port = free_port()
    d = spare_daemon(principals={0: "root", ALICE: "alice"}, socket_mode=0o666,
                     tcp={"address": f"127.0.0.1:{port}", "cert_file": str(pki["server"][0]),
                          "key_file": str(pki["server"][1]), "client_ca_file": str(pki["ca"][0])}).start()
    d.tcp_target = f"127.0.0.1:{port}"
    return d


def tls_client(d, pki, who: str) -> SandboxdClient:
    cert, key = pki[who]
    return SandboxdClient(target=d.tcp_target, tls=TlsFiles(str(pki["ca"][0]), str(cert), str(key)))


def test_a_client_certificate_is_the_principal(tls_daemon, pki):
    d = tls_daemon
    ws = d.new_workspace({"who.txt": "alice's workspace\n"}, uid=ALICE)
    with tls_client(d, pki, "alice") as alice, client_as(d, ALICE) as alice_on_socket, d.client() as root:
        out = alice.run(call(ws, ["cat", "/workspace/who.txt"]))
        assert out.stdout == b"alice's workspace\n"
        assert '"principal":"alice"' in alice.get_trace(out.tool_call_id)[0].payload_json
        # The same tenant as alice's uid on the socket; root's calls stay invisible to her.
        assert alice_on_socket.get_trace(out.tool_call_id)
        mine = root.run(call(d.new_workspace(uid=ALICE + 1), ["true"]))
        with pytest.raises(errors.NotFound):
            alice.get_trace(mine.tool_call_id)


def test_no_certificate_another_ca_or_an_unknown_subject_is_refused(tls_daemon, pki):
    import grpc

    d = tls_daemon
    ws = d.new_workspace(uid=ALICE)
    # No client certificate: the handshake itself fails.
    channel = grpc.secure_channel(d.tcp_target, grpc.ssl_channel_credentials(
        root_certificates=Path(pki["ca"][0]).read_bytes()))
    from sandboxd_contract.pb import sandboxd_pb2 as pb
    from sandboxd_contract.pb import sandboxd_pb2_grpc as pb_grpc

    with pytest.raises(grpc.RpcError) as exc:
        pb_grpc.AuditServiceStub(channel).QueryCalls(pb.QueryCallsRequest(), timeout=5)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()
    # A certificate for "alice" from a CA the daemon does not trust.
    with tls_client(d, pki, "impostor") as impostor, pytest.raises(errors.Unavailable):
        impostor.query_calls()
    # A trusted certificate whose subject is nobody the daemon knows.
    with tls_client(d, pki, "mallory") as mallory, pytest.raises(errors.Unauthenticated) as refused:
        mallory.run(call(ws, ["true"]))
    assert "CN=mallory" in refused.value.message


def test_sandboxctl_over_mutual_tls(tls_daemon, pki):
    from .test_cli import SANDBOXCTL

    d = tls_daemon
    ws = d.new_workspace(uid=ALICE)
    tls = ["--tcp", d.tcp_target, "--tls-ca", str(pki["ca"][0]), "--tls-cert", str(pki["alice"][0]),
           "--tls-key", str(pki["alice"][1])]
    p = subprocess.run([SANDBOXCTL, *tls, "exec", "--workspace", str(ws), "--", "echo", "over tls"],
                       capture_output=True, timeout=60)
    assert (p.returncode, p.stdout) == (0, b"over tls\n"), p.stderr
    p = subprocess.run([SANDBOXCTL, "--tcp", d.tcp_target, "audit"], capture_output=True, timeout=60)
    assert p.returncode != 0 and b"mutual TLS" in p.stderr


def test_plain_tcp_cannot_be_configured(tmp_path):
    base = public_tmpdir("sandboxd-plaintcp-")
    d = make_daemon(base, env=DAEMON_ENV, tcp={"address": "127.0.0.1:7443"})
    with pytest.raises(RuntimeError) as exc:
        d.start(timeout_s=20)
    assert "tcp.cert_file" in str(exc.value) or "cert_file" in str(exc.value)


def test_the_tls_files_are_read_once_safely_or_the_daemon_does_not_start(spare_daemon, pki, tmp_path):
    """The key the daemon's own and closed to others; no file through a link; a FIFO in a
    file's place refused, never waited on (the start would hang for good)."""
    loose_key = tmp_path / "loose.key"
    loose_key.write_bytes(pki["server"][1].read_bytes())
    loose_key.chmod(0o644)
    linked_cert = tmp_path / "linked.pem"
    linked_cert.symlink_to(pki["server"][0])
    fifo_ca = tmp_path / "ca.fifo"
    os.mkfifo(fifo_ca)
    good = {"cert_file": str(pki["server"][0]), "key_file": str(pki["server"][1]),
            "client_ca_file": str(pki["ca"][0])}
    for setting, path, why in (("key_file", loose_key, "closed to group and others"), ("cert_file", linked_cert, "symbolic link"),
                               ("client_ca_file", fifo_ca, "is not a file")):
        d = spare_daemon(tcp={"address": f"127.0.0.1:{free_port()}", **good, setting: str(path)})
        with pytest.raises(RuntimeError, match=f"tcp.{setting}") as refused:
            d.start(timeout_s=20)
        assert why in str(refused.value)
