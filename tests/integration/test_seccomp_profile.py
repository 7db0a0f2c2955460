"""Integration tests for seccomp/sandboxd-docker.json.

These start REAL containers (image sandboxd/default:latest, built on demand by
images/build.sh) and run tests/probes/escape_probe.py inside them.  They need
a reachable Docker daemon and FAIL (never skip) when there is none: run
scripts/ensure-docker.sh first.

Every container gets the label sandboxd.test=1, network_mode="none", and is
force-removed at teardown.
"""

import json
import pathlib

from sandboxd.core.assets import SECCOMP_PROFILE, packaged
import platform
import subprocess

import docker
import docker.errors
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROFILE_PATH = packaged(SECCOMP_PROFILE)
PROBE_PATH = ROOT / "tests" / "probes" / "escape_probe.py"
BUILD_SCRIPT = ROOT / "images" / "build.sh"
IMAGE = "sandboxd/default:latest"
TEST_LABELS = {"sandboxd.test": "1"}

PROFILE_TEXT = PROFILE_PATH.read_text()
PROFILE = json.loads(PROFILE_TEXT)
PROBE_SRC = PROBE_PATH.read_text()
X86_64 = platform.machine() == "x86_64"

# Must be refused with EPERM by our profile, whatever capabilities are added.
DENIED_EPERM = [
    "io_uring_setup",
    "ptrace_traceme",
    "socket_af_vsock",
    "socket_af_vsock_highbits",
    "socket_af_alg",
    "socket_af_packet_raw",
    "socket_af_inet_raw",
    "socket_af_inet6_raw",
    "socketpair_af_inet",
    "unshare_newuser",
    "mount_tmpfs",
    "keyctl",
    "bpf",
    "perf_event_open",
    "userfaultfd",
] + (["i386_socket_af_vsock"] if X86_64 else [])

# Must keep working under our profile.
ALLOWED = [
    "socket_af_inet_stream",
    "socket_af_inet_dgram",
    "socket_af_inet6_stream",
    "socket_af_unix_stream",
    "socket_af_unix_dgram",
    "socket_af_netlink_route",
    "socketpair_af_unix",
]


# --- fixtures -------------------------------------------------------------------

@pytest.fixture(scope="module")
def docker_client():
    try:
        client = docker.from_env(timeout=120)
        client.ping()
        client.info()
    except Exception as exc:  # no daemon -> FAIL, never skip
        pytest.fail(
            f"Docker daemon not reachable ({exc!r}); run scripts/ensure-docker.sh",
            pytrace=False,
        )
    yield client
    client.close()


@pytest.fixture(scope="module")
def sandbox_image(docker_client):
    try:
        docker_client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        # Content-addressed and cached: instant when already built.
        proc = subprocess.run(
            ["bash", str(BUILD_SCRIPT), "default"],
            capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            pytest.fail(
                f"images/build.sh default failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}",
                pytrace=False,
            )
        docker_client.images.get(IMAGE)
    return IMAGE


@pytest.fixture
def containers():
    """Registry of containers created by a test; all force-removed at teardown."""
    created = []
    yield created
    for container in created:
        try:
            container.remove(force=True, v=True)
        except docker.errors.NotFound:
            pass


def run_in_container(client, registry, image, command, *, seccomp, cap_add=(),
                     security_opt_extra=(), timeout=120, **extra):
    """Create+start a labelled, network-less container; return (exit_code, stdout, stderr)."""
    kwargs = dict(
        image=image,
        command=command,
        detach=True,
        labels=dict(TEST_LABELS),
        network_mode="none",
        security_opt=["seccomp=" + seccomp, *security_opt_extra],
        mem_limit="256m",
        pids_limit=128,
    )
    if cap_add:
        kwargs["cap_add"] = list(cap_add)
    kwargs.update(extra)
    container = client.containers.create(**kwargs)
    registry.append(container)  # registered before start: removed even if start fails
    container.start()
    status = container.wait(timeout=timeout)
    out = container.logs(stdout=True, stderr=False).decode(errors="replace")
    err = container.logs(stdout=False, stderr=True).decode(errors="replace")
    return status["StatusCode"], out, err


def run_probe(client, registry, image, *, seccomp, cap_add=(), **extra):
    code, out, err = run_in_container(
        client, registry, image, ["python3", "-c", PROBE_SRC],
        seccomp=seccomp, cap_add=cap_add, **extra,
    )
    assert code == 0, f"probe exited {code}\nstdout:\n{out}\nstderr:\n{err}"
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines, f"probe printed nothing; stderr:\n{err}"
    results = json.loads(lines[-1])
    assert set(results) >= set(DENIED_EPERM) | set(ALLOWED)
    return results


def assert_profile_verdicts(results):
    wrong_denied = {n: results[n] for n in DENIED_EPERM if results[n]["errname"] != "EPERM"}
    wrong_allowed = {n: results[n] for n in ALLOWED if not results[n]["ok"]}
    assert not wrong_denied, f"expected EPERM from seccomp, got: {wrong_denied}"
    assert not wrong_allowed, f"expected these to work, got: {wrong_allowed}"
    for name in DENIED_EPERM:
        assert results[name] == {"ok": False, "errno": 1, "errname": "EPERM"}, name
    if X86_64:
        # 32-bit socketcall() cannot carry argument checks; our explicit rule
        # makes it ENOSYS instead of letting libseccomp's implicit allow through.
        assert results["i386_socketcall_af_vsock"]["ok"] is False
        assert results["i386_socketcall_af_vsock"]["errname"] == "ENOSYS"


# --- static checks on the profile file --------------------------------------------

def _allow_rules(name):
    return [r for r in PROFILE["syscalls"] if name in r["names"] and r["action"] == "SCMP_ACT_ALLOW"]


def test_profile_file_structure():
    assert PROFILE["defaultAction"] == "SCMP_ACT_ERRNO"
    assert PROFILE["defaultErrnoRet"] == 1
    actions = {r["action"] for r in PROFILE["syscalls"]}
    assert actions <= {"SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"}, "denials must be errno, never kill/trap"
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register", "ptrace",
                 "process_vm_readv", "process_vm_writev", "kcmp", "socketcall",
                 "unshare", "setns", "mount", "bpf", "perf_event_open", "keyctl",
                 "open_by_handle_at", "userfaultfd"):
        assert not _allow_rules(name), f"{name} must not be allowed"
    socket_rules = _allow_rules("socket")
    assert socket_rules
    families = set()
    for rule in socket_rules:
        assert rule["names"] == ["socket"]
        fam = [a for a in rule.get("args", []) if a["index"] == 0]
        assert len(fam) == 1 and fam[0]["op"] == "SCMP_CMP_EQ", rule
        families.add(fam[0]["value"])
        if fam[0]["value"] in (2, 10):  # inet: stream/dgram only
            typ = [a for a in rule["args"] if a["index"] == 1]
            assert typ and typ[0]["op"] == "SCMP_CMP_MASKED_EQ" and typ[0]["value"] == 0xF
            assert typ[0]["valueTwo"] in (1, 2)
    assert families == {1, 2, 10, 16}
    pair_rules = _allow_rules("socketpair")
    assert [[(a["index"], a["op"], a["value"]) for a in r["args"]] for r in pair_rules] == [
        [(0, "SCMP_CMP_EQ", 1)]
    ]
    socketcall = [r for r in PROFILE["syscalls"] if "socketcall" in r["names"]]
    assert len(socketcall) == 1 and socketcall[0]["action"] == "SCMP_ACT_ERRNO"
    assert "args" not in socketcall[0]
    # capabilities must not widen the filter (except chroot / NUMA policy)
    caps = {c for r in PROFILE["syscalls"] for c in r.get("includes", {}).get("caps", [])}
    assert caps <= {"CAP_SYS_CHROOT", "CAP_SYS_NICE"}
    assert not any("caps" in r.get("excludes", {}) for r in PROFILE["syscalls"])


# --- real containers -------------------------------------------------------------

def test_profile_blocks_escape_syscalls(docker_client, sandbox_image, containers):
    results = run_probe(docker_client, containers, sandbox_image, seccomp=PROFILE_TEXT)
    assert_profile_verdicts(results)


def test_profile_blocks_even_with_added_capabilities(docker_client, sandbox_image, containers):
    """With NET_RAW, SYS_PTRACE and SYS_ADMIN granted, only the profile stands in the way."""
    results = run_probe(
        docker_client, containers, sandbox_image,
        seccomp=PROFILE_TEXT, cap_add=["NET_RAW", "SYS_PTRACE", "SYS_ADMIN"],
    )
    assert_profile_verdicts(results)


def test_control_probe_detects_when_unconfined(docker_client, sandbox_image, containers):
    """Without seccomp the same probes succeed, so the assertions above can fail."""
    results = run_probe(
        docker_client, containers, sandbox_image,
        seccomp="unconfined", cap_add=["NET_RAW"],
    )
    for name in ("socket_af_packet_raw", "socket_af_inet_raw", "ptrace_traceme"):
        assert results[name]["ok"] is True, f"{name}: {results[name]}"
    io_uring_disabled = pathlib.Path("/proc/sys/kernel/io_uring_disabled")
    if not io_uring_disabled.exists() or io_uring_disabled.read_text().strip() == "0":
        assert results["io_uring_setup"]["ok"] is True, results["io_uring_setup"]
    # AF_VSOCK may be absent from the kernel (EAFNOSUPPORT) but must not be EPERM.
    assert results["socket_af_vsock"]["errname"] != "EPERM"
    for name in ALLOWED:
        assert results[name]["ok"] is True, f"{name}: {results[name]}"


def test_profile_under_hardened_runtime(docker_client, sandbox_image, containers):
    """The profile together with the settings the daemon is expected to use."""
    results = run_probe(
        docker_client, containers, sandbox_image,
        seccomp=PROFILE_TEXT,
        security_opt_extra=["no-new-privileges"],
        cap_drop=["ALL"],
        user="1000:1000",
        read_only=True,
        tmpfs={"/tmp": "rw,nosuid,nodev,size=16m"},
        init=True,
    )
    assert_profile_verdicts(results)


WORKLOAD = r"""
set -eu
tr '\0' ' ' </proc/1/cmdline; echo
cd /tmp
git init -q repo && cd repo
echo hello > f.txt
git add f.txt
git -c user.email=t@example.invalid -c user.name=t commit -q -m init
git log --oneline | wc -l
python3 - <<'EOF'
import os, socket, subprocess, threading, tempfile, multiprocessing
t = threading.Thread(target=lambda: None); t.start(); t.join()
print(subprocess.run(["sh", "-c", "echo sub"], capture_output=True, text=True).stdout.strip())
with multiprocessing.Pool(2) as pool:
    assert pool.map(abs, [-1, -2]) == [1, 2]
a, b = socket.socketpair(); a.send(b"x"); assert b.recv(1) == b"x"
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
cli = socket.create_connection(srv.getsockname()); conn, _ = srv.accept()
cli.sendall(b"ping"); assert conn.recv(4) == b"ping"
print("python-ok")
EOF
ps -eo pid,comm >/dev/null
echo WORKLOAD-OK
"""


def test_profile_allows_normal_workload(docker_client, sandbox_image, containers):
    """git, python threads/processes/loopback sockets and procps work under the profile."""
    code, out, err = run_in_container(
        docker_client, containers, sandbox_image, ["bash", "-c", WORKLOAD],
        seccomp=PROFILE_TEXT,
        security_opt_extra=["no-new-privileges"],
        cap_drop=["ALL"],
        user="1000:1000",
        read_only=True,
        tmpfs={"/tmp": "rw,nosuid,nodev,size=16m"},
        init=True,
    )
    assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    assert "WORKLOAD-OK" in out and "python-ok" in out and "sub" in out
    first = out.splitlines()[0]
    assert "docker-init" in first or "tini" in first, f"PID 1 is not docker-init: {first!r}"
