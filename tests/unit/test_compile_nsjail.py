"""sandboxd.backends.nsjail.compile.compile_nsjail: golden files for representative inputs, plus
targeted asserts on the properties the jail's safety depends on, and on the mount view
being compile_docker's. Regenerate the golden files with UPDATE_GOLDEN=1."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from sandboxd.backends.docker.compile import compile_docker
from sandboxd.sandbox.spec import (EGRESS_SOCKET_PATH, MAX_OPEN_FILES, SHIM_PATH, Attachments, EgressAttachment, SandboxIdentity)
from sandboxd.backends.nsjail.compile import (CPU_PERIOD_US, INIT_PATH, NSJAIL_CGROUP_ROOT, SECCOMP_PROGRAM_PATH, TIME_LIMIT_SLACK_S,
                                     NsjailMount,
                                     NsjailSpec, cgroup_for, compile_nsjail, quote)
from sandboxd.core.errors import FailedPrecondition, Unimplemented
from sandboxd.policy.models import is_within
from sandboxd.policy.preflight import Bind, HostPlan, Mask

from .conftest import resolve
from .test_compile import case_kept_temp  # the same inputs make both engines' goldens

GOLDEN = Path(__file__).parent / "golden"
MASK_FILE = "/var/lib/sandboxd-rootfs/mask"
ROOTFS = "/var/lib/sandboxd-rootfs/78556e5995ea7e893f9f4a87836b9f569a512bb793d12acd8a56ea0a1dcac5bc"
SECCOMP = "/var/lib/sandboxd-rootfs/seccomp-0123456789abcdef.bpf"
SHIM = "/var/lib/sandboxd-runtime/sandbox-shim"
NSJAIL = "/opt/sandboxd/.venv/lib/python3.11/site-packages/nsjail/bin/nsjail"
INIT = "/usr/bin/tini-static"
WS = "/srv/sandboxd/workspaces/alice/project"
MB = 2**20


def _compile(policy, plan, *, stdin_open=False, argv=("python3", "-c", "print(1)"), ident=None,
             attachments=None) -> NsjailSpec:
    return compile_nsjail(policy, plan, ident or SandboxIdentity("daemon-1", "sbx-0001", "tc-0001"),
                          argv=argv, rootfs=ROOTFS, stdin_open=stdin_open, mask_file=MASK_FILE,
                          shim_binary=SHIM, seccomp_program_path=SECCOMP, nsjail_binary=NSJAIL, init_binary=INIT,
                          attachments=attachments or Attachments())


def _docker(policy, plan):
    return compile_docker(policy, plan, SandboxIdentity("daemon-1", "sbx-0001", "tc-0001"), argv=("true",),
                          image="sandboxd/default:latest", stdin_open=False, mask_file=MASK_FILE,
                          seccomp_profile="sandboxd-docker.json")


# ------------------------------------------------------------------ cases


def case_default():
    """No filesystem section: the whole workspace read-only, no network."""
    policy = resolve()
    plan = HostPlan(workspace=WS, uid=1000, gid=1000, binds=(Bind("/workspace", WS, True),), masks=())
    return policy, plan, {}


def case_partial_workspace():
    """Parts of the workspace visible, writable output, masks, custom limits."""
    policy = resolve({
        "filesystem": {
            "readRoots": ["/workspace/src", "/workspace/docs"],
            "writeRoots": ["/workspace/out", "/tmp/build"],
            "blockedPaths": ["/workspace/src/.env", "/workspace/src/secrets"],
            "cwd": "src",
        },
        "environment": {"injectedEnv": {"MODE": "test", "EMPTY": ""}},
        "process": {"timeoutMs": "120000", "maxMemoryMb": 1024, "maxStdoutBytes": 1048576, "maxStderrBytes": 65536,
                    "maxPids": 64, "cpuMillicores": 2500, "maxFileSizeMb": 100, "maxTmpSizeMb": 32},
    })
    plan = HostPlan(
        workspace=WS, uid=1000, gid=1001,
        binds=(Bind("/workspace/src", f"{WS}/src", True), Bind("/workspace/docs", f"{WS}/docs", True),
               Bind("/workspace/out", f"{WS}/out", False)),
        masks=(Mask("/workspace/src/.env", "file"), Mask("/workspace/src/secrets", "dir")),
    )
    return policy, plan, {"stdin_open": True, "argv": ("make", "-C", "/workspace/src", "test")}


def case_writable_workspace_custom_temp():
    """The whole workspace writable, a custom tempDir used as cwd, inherited env, and
    values the config must quote (quotes, backslashes, newlines, non-ASCII, ':')."""
    policy = resolve({
        "filesystem": {
            "writeRoots": ["/workspace"],
            "blockedPaths": [".git", "id_rsa"],
            "tempDir": "/scratch",
            "cwd": "/scratch/run",
        },
        "environment": {"inheritedEnv": ["TZ"],
                        "injectedEnv": {"PATH": "/opt/bin:/usr/bin", "QUOTED": 'a "b" \\ c\nd é:f'}},
        "audit": {"recordCommand": False},
    }, inheritable={"TZ": "Europe/Paris"})
    ws = "/srv/sandboxd/workspaces/bob:2/project"
    plan = HostPlan(
        workspace=ws, uid=2000, gid=2000,
        binds=(Bind("/workspace", ws, False),),
        masks=(Mask("/workspace/.git", "dir"), Mask("/workspace/id_rsa", "file")),
    )
    return policy, plan, {"argv": ("sh", "-c", "ls -la /workspace"),
                          "ident": SandboxIdentity("daemon-2", "sbx-abcdef", "tc-writable")}


CASES = {
    "default": case_default,
    "kept_temp": case_kept_temp,
    "partial_workspace": case_partial_workspace,
    "writable_workspace_custom_temp": case_writable_workspace_custom_temp,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    policy, plan, kwargs = CASES[name]()
    got = json.loads(json.dumps(_compile(policy, plan, **kwargs).to_json_dict()))
    path = GOLDEN / f"nsjail_{name}.json"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps(got, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    assert path.exists(), f"{path} missing: run with UPDATE_GOLDEN=1"
    want = json.loads(path.read_text())
    assert got == want


def test_golden_files_have_no_strays():
    names = {p.name for p in GOLDEN.glob("nsjail_*.json")}
    assert names == {f"nsjail_{n}.json" for n in CASES}


# ------------------------------------------------------------------ targeted asserts


@pytest.fixture(params=sorted(CASES))
def compiled(request):
    policy, plan, kwargs = CASES[request.param]()
    return policy, plan, _compile(policy, plan, **kwargs)


def _config(spec: NsjailSpec) -> list[str]:
    return spec.config_text().splitlines()


def _unquote(literal: str) -> str:
    assert literal.startswith('"') and literal.endswith('"')
    return literal[1:-1].encode("ascii").decode("unicode_escape").encode("latin-1").decode("utf-8")


def test_hardening_is_always_on(compiled):
    _, _, spec = compiled
    assert spec.keep_caps is False and spec.no_new_privileges is True
    lines = _config(spec)
    for line in ("keep_env: false", "keep_caps: false", "disable_no_new_privs: false", "skip_setsid: false",
                 "clone_newnet: true", "clone_newuser: true", "clone_newns: true", "clone_newpid: true",
                 "clone_newipc: true", "clone_newuts: true", "clone_newcgroup: true", "mode: ONCE",
                 "rlimit_as_type: INF", "nice_level: 0"):
        assert line in lines, line
    assert not any(line.startswith(("cap:", "pass_fd", "disable_clone", "seccomp_string", "seccomp_policy_file",
                                    "keep_env: true")) for line in lines)
    # The jail's first process is the shim, which loads the seccomp program, then the init.
    assert spec.init_argv == (SHIM_PATH, "--seccomp", SECCOMP_PROGRAM_PATH, "--", INIT_PATH, "--")
    assert lines[-1].startswith(f'exec_bin {{ path: "{SHIM_PATH}" arg0: "{SHIM_PATH}" arg: "--seccomp" '
                                f'arg: "{SECCOMP_PROGRAM_PATH}" arg: "--" arg: "{INIT_PATH}" arg: "--" ')
    mounts = {m.dst: m for m in spec.mounts}
    assert mounts[SHIM_PATH].src == SHIM and not mounts[SHIM_PATH].rw and not mounts[SHIM_PATH].noexec
    assert mounts[SECCOMP_PROGRAM_PATH].src == SECCOMP and not mounts[SECCOMP_PROGRAM_PATH].rw
    assert mounts[SECCOMP_PROGRAM_PATH].noexec


def test_ids_are_mapped_to_themselves_and_never_root(compiled):
    _, plan, spec = compiled
    lines = _config(spec)
    assert [line for line in lines if line.startswith("uidmap")] == [
        f'uidmap {{ inside_id: "{plan.uid}" outside_id: "{plan.uid}" count: 1 }}']
    assert [line for line in lines if line.startswith("gidmap")] == [
        f'gidmap {{ inside_id: "{plan.gid}" outside_id: "{plan.gid}" count: 1 }}']
    assert (spec.uid, spec.gid) == (plan.uid, plan.gid)


@pytest.mark.parametrize("uid,gid", [(0, 1000), (1000, 0)])
def test_root_is_refused(uid, gid):
    policy, plan, _ = case_default()
    with pytest.raises(FailedPrecondition):
        _compile(policy, replace(plan, uid=uid, gid=gid))


def test_env_equals_policy_env_exactly(compiled):
    policy, _, spec = compiled
    assert spec.env == policy.env and spec.env is not policy.env
    envars = [_unquote(line.removeprefix("envar: ")) for line in _config(spec) if line.startswith("envar:")]
    assert envars == [f"{k}={v}" for k, v in policy.env.items()]


def test_quote_round_trips():
    for value in ['plain', 'a "b" \\ c', "line\nbreak\ttab", "é ü 漢字", "colon:a:b", "\x7f\x01"]:
        q = quote(value)
        assert all(0x20 <= ord(c) < 0x7F for c in q)
        assert _unquote(q) == value


def test_cwd_hostname_and_limits(compiled):
    policy, _, spec = compiled
    lines = _config(spec)
    assert f"cwd: {quote(policy.cwd)}" in lines and 'hostname: "sandbox"' in lines
    assert spec.memory_bytes == policy.memory_bytes
    assert spec.pids_max == policy.max_pids + 1  # nsjail itself
    assert spec.cpu_period_us == CPU_PERIOD_US
    assert spec.cpu_quota_us * 1_000_000_000 // CPU_PERIOD_US == policy.cpu_millicores * 1_000_000
    assert spec.timeout_ms == policy.timeout_ms
    assert spec.time_limit_s * 1000 >= policy.timeout_ms + TIME_LIMIT_SLACK_S * 1000
    assert (spec.max_stdout_bytes, spec.max_stderr_bytes) == (policy.max_stdout_bytes, policy.max_stderr_bytes)


def test_rlimits(compiled):
    policy, _, spec = compiled
    rl = dict(spec.rlimits)
    assert rl["fsize_mb"] * MB == policy.max_file_size_bytes
    assert rl["nofile"] == MAX_OPEN_FILES and rl["core_mb"] == 0
    lines = _config(spec)
    assert f"rlimit_fsize: {rl['fsize_mb']}" in lines and f"rlimit_nofile: {MAX_OPEN_FILES}" in lines
    assert "rlimit_core: 0" in lines and "rlimit_cpu_type: INF" in lines


def test_cgroup_and_labels(compiled):
    _, plan, spec = compiled
    sandbox_id = spec.labels["sandboxd.sandbox_id"]
    daemon_id = spec.labels["sandboxd.daemon_id"]
    assert spec.cgroup == cgroup_for(daemon_id, sandbox_id) == f"{NSJAIL_CGROUP_ROOT}/{daemon_id}/{sandbox_id}"
    assert spec.labels["sandboxd.workspace"] == plan.workspace
    assert spec.name == f"sandboxd-{sandbox_id}"


@pytest.mark.parametrize("daemon_id,sandbox_id", [("a/b", "sbx-1"), ("d", "../x"), ("", "sbx-1"), ("d", "sbx 1")])
def test_ids_that_cannot_name_a_cgroup_are_refused(daemon_id, sandbox_id):
    policy, plan, _ = case_default()
    with pytest.raises(FailedPrecondition):
        _compile(policy, plan, ident=SandboxIdentity(daemon_id, sandbox_id, "tc"))


def test_command_line():
    policy, plan, kwargs = case_partial_workspace()
    spec = _compile(policy, plan, **kwargs)
    # The same for every jail: the command is the config's last line.
    assert spec.command("/proc/self/fd/7", 9) == [NSJAIL, "--config", "/proc/self/fd/7", "--log_fd", "9"]
    assert spec.config_text().splitlines()[-1] == (
        'exec_bin { path: "/dev/sandboxd/shim" arg0: "/dev/sandboxd/shim" arg: "--seccomp" arg: "/dev/sandboxd/seccomp" '
        'arg: "--" arg: "/dev/init" arg: "--" arg: "make" arg: "-C" arg: "/workspace/src" arg: "test" }')
    assert spec.stdin_open is True
    assert _compile(*case_default()[:2]).stdin_open is False


# ------------------------------------------------------------------ mounts


def test_root_first_read_only_and_system_mounts(compiled):
    _, plan, spec = compiled
    root = spec.mounts[0]
    assert root == NsjailMount(dst="/", src=ROOTFS, is_bind=True, rw=False, is_dir=True, nosuid=True, nodev=True)
    by_dst = {m.dst: m for m in spec.mounts}
    assert by_dst["/proc"].fstype == "proc" and by_dst["/proc"].rw is False
    assert by_dst["/dev"].fstype == "tmpfs" and by_dst["/dev"].rw is False
    assert by_dst[INIT_PATH] == NsjailMount(dst=INIT_PATH, src=INIT, is_bind=True, rw=False, is_dir=False,
                                            nosuid=True, nodev=True)
    devices = sorted(m.dst for m in spec.mounts if m.is_bind and m.src.startswith("/dev/"))
    assert devices == ["/dev/full", "/dev/null", "/dev/random", "/dev/tty", "/dev/urandom", "/dev/zero"]
    assert all(m.src == m.dst and m.rw and m.noexec for m in spec.mounts if m.dst in devices)
    assert by_dst["/dev/shm"].noexec and by_dst["/dev/pts"].fstype == "devpts"
    # Nothing of the host but the image, the workspace, the mask file, devices, init,
    # the shim, the seccomp program and persistOutputs' tmpfs (noexec, as the engine's).
    for m in spec.mounts:
        if m.is_bind and plan.outputs_dir and m.src == plan.outputs_dir:
            assert m.rw and m.noexec and m.nosuid and m.nodev
        elif m.is_bind:
            assert m.src in (ROOTFS, INIT, MASK_FILE, SHIM, SECCOMP) or m.src.startswith("/dev/") or \
                is_within(m.src, spec.labels["sandboxd.workspace"]), m


def test_workspace_mounts_are_docker_s(compiled):
    """Same targets in the same order, same writability and sources as compile_docker."""
    policy, plan, spec = compiled
    docker = _docker(policy, plan).mounts
    ours = [m for m in spec.mounts if is_within(m.dst, "/workspace") or m.dst == policy.temp_dir]
    assert [m.dst for m in ours] == [m.target for m in docker]
    for d, n in zip(docker, ours):
        assert n.fstype == ("tmpfs" if d.type == "tmpfs" else "")
        if d.type == "bind":
            assert n.is_bind and n.src == d.source and n.rw == (not d.read_only)
            assert n.nosuid and n.nodev
        elif d.target == policy.temp_dir:
            assert n.rw and n.options == f"size={policy.tmp_size_bytes},mode=1777" and n.noexec
        else:
            # /workspace's base or a blocked directory: the tmpfs is the sandbox user's,
            # so it is read-only here, and a blocked one has no permission bits at all.
            assert not n.rw
            size, mode = re.fullmatch(r"size=(\d+),mode=([0-7]+)", n.options).groups()
            assert int(size) == d.tmpfs_size_bytes
            assert mode == ("0" if d.read_only else "755")


def test_blocked_file_is_the_mask_file_read_only():
    policy, plan, kwargs = case_partial_workspace()
    [m] = [m for m in _compile(policy, plan, **kwargs).mounts if m.dst == "/workspace/src/.env"]
    assert m == NsjailMount(dst="/workspace/src/.env", src=MASK_FILE, is_bind=True, rw=False, is_dir=False,
                            nosuid=True, nodev=True)


def test_mounts_parents_before_children(compiled):
    _, _, spec = compiled
    targets = [m.dst for m in spec.mounts]
    assert len(targets) == len(set(targets))
    for i, parent in enumerate(targets):
        for child in targets[:i]:
            assert not (child != parent and is_within(child, parent)), f"{child} mounted before its parent {parent}"


def test_paths_with_colons_are_quoted_not_split():
    policy, plan, kwargs = case_writable_workspace_custom_temp()
    lines = _config(_compile(policy, plan, **kwargs))
    assert 'mount { src: "/srv/sandboxd/workspaces/bob:2/project" dst: "/workspace" is_bind: true rw: true ' \
           'nosuid: true nodev: true }' in lines


def test_write_root_in_temp_dir_is_the_tmpfs():
    policy, plan, kwargs = case_partial_workspace()
    targets = [m.dst for m in _compile(policy, plan, **kwargs).mounts]
    assert "/tmp/build" not in targets and "/tmp" in targets


# ------------------------------------------------------------------ network and determinism


def test_egress_open_is_refused():
    policy, plan, _ = case_default()
    with pytest.raises(Unimplemented) as err:
        _compile(replace(policy, egress="open", deny_private_networks=False), plan)
    assert err.value.field == "policy.network.egress"


def test_egress_allowlist_needs_its_attachment():
    policy, plan, _ = case_default()
    with pytest.raises(ValueError):
        _compile(replace(policy, egress="allowlist", allow_domains=("pypi.test",)), plan)


def test_egress_allowlist_binds_the_proxy_socket_and_wraps_the_command():
    policy, plan, _ = case_default()
    policy = replace(policy, egress="allowlist", allow_domains=("pypi.test",))
    att = Attachments("/var/lib/sandboxd-runtime/sandbox-shim",
                      EgressAttachment("/var/lib/sandboxd-egress/sbx-0001.sock", 3128))
    spec = _compile(policy, plan, attachments=att)
    assert spec.network == "none"  # still a fresh namespace with loopback only
    by_dst = {m.dst: m for m in spec.mounts}
    sock = by_dst[EGRESS_SOCKET_PATH]
    assert sock.src == att.egress.socket_host_path and sock.is_bind and not sock.rw and sock.noexec
    shim = by_dst[SHIM_PATH]  # the backend's shim, bound once
    assert shim.src == SHIM and not shim.rw and not shim.noexec
    assert [m.dst for m in spec.mounts].count(SHIM_PATH) == 1
    assert spec.argv[:5] == (SHIM_PATH, "--egress", EGRESS_SOCKET_PATH, "3128", "--")
    assert spec.config_text().splitlines()[-1].startswith(
        f'exec_bin {{ path: "{SHIM_PATH}" arg0: "{SHIM_PATH}" arg: "--seccomp" arg: "{SECCOMP_PROGRAM_PATH}" '
        f'arg: "--" arg: "{INIT_PATH}" arg: "--" arg: "{SHIM_PATH}" arg: "--egress" ')
    assert spec.env["HTTPS_PROXY"] == spec.env["http_proxy"] == "http://127.0.0.1:3128"
    assert "127.0.0.1" in spec.env["NO_PROXY"]


def test_network_is_none(compiled):
    _, _, spec = compiled
    assert spec.network == "none"
    assert "iface_no_lo: false" in _config(spec)
    assert not any(line.startswith(("macvlan", "iface_own", "user_net")) for line in _config(spec))


def test_compile_is_deterministic_and_json_serializable():
    for factory in CASES.values():
        policy, plan, kwargs = factory()
        a, b = _compile(policy, plan, **kwargs), _compile(policy, plan, **kwargs)
        assert a.to_json_dict() == b.to_json_dict()
        assert json.loads(json.dumps(a.to_json_dict()))["config"] == a.config_text().splitlines()


@pytest.mark.parametrize("arg", ['say "hi"', "back\\slash", "two\nlines", "caf\u00e9 \u2603", '" } mount { src: "/"',
                                 "", "\t\x01\x7f"])
def test_any_argument_reaches_the_command_as_one_literal(arg):
    policy, plan, _ = case_default()
    spec = _compile(policy, plan, argv=("echo", arg))
    last = spec.config_text().splitlines()[-1]
    assert last.endswith(f'arg: "echo" arg: {quote(arg)} }}')
    # Only printable ASCII, with every quote and backslash escaped: nothing can end the string early.
    body = last[last.index('arg: "echo"'):]
    assert all(0x20 <= ord(c) < 0x7F for c in body)
    assert unquote(quote(arg)) == arg


def unquote(literal: str) -> str:
    """The protobuf text-format reading of a literal quote() made."""
    assert literal[0] == literal[-1] == '"'
    out, i, body = bytearray(), 0, literal[1:-1]
    while i < len(body):
        if body[i] == "\\":
            if body[i + 1] in "01234567":
                out.append(int(body[i + 1:i + 4], 8))
                i += 4
            else:
                out.append(ord(body[i + 1]))
                i += 2
        else:
            assert body[i] != '"'
            out.append(ord(body[i]))
            i += 1
    return out.decode("utf-8")


# ------------------------------------------------------------------ cgroup limits


def _limit_writes(monkeypatch, limits, present):
    from sandboxd.backends import cgroups

    writes = []
    monkeypatch.setattr(cgroups, "_write", lambda path, value: writes.append((path.split("/")[-1], value)))
    cgroups.V1().write_limits("sandboxd-nsjail/d/sbx", limits, present)
    return writes


MEM = {"memory/memory.limit_in_bytes": "1024", "memory/memory.memsw.limit_in_bytes": "1024", "pids/pids.max": "64"}


def test_limits_already_in_a_slot_are_not_written_again(monkeypatch):
    assert _limit_writes(monkeypatch, MEM, dict(MEM)) == []
    assert _limit_writes(monkeypatch, MEM, {**MEM, "pids/pids.max": "32"}) == [("pids.max", "64")]


def test_memory_and_swap_are_written_in_the_order_the_kernel_accepts(monkeypatch):
    # Fresh (unlimited) or lowering: the memory limit first, then memory+swap.
    assert _limit_writes(monkeypatch, MEM, {})[:2] == [("memory.limit_in_bytes", "1024"),
                                                       ("memory.memsw.limit_in_bytes", "1024")]
    lower = {"memory/memory.limit_in_bytes": "2048", "memory/memory.memsw.limit_in_bytes": "2048"}
    assert _limit_writes(monkeypatch, MEM, lower)[:2] == [("memory.limit_in_bytes", "1024"),
                                                          ("memory.memsw.limit_in_bytes", "1024")]
    # Raising: memory+swap first (it may never be below the memory limit).
    higher = {"memory/memory.limit_in_bytes": "512", "memory/memory.memsw.limit_in_bytes": "512"}
    assert _limit_writes(monkeypatch, MEM, higher)[:2] == [("memory.memsw.limit_in_bytes", "1024"),
                                                           ("memory.limit_in_bytes", "1024")]


def test_a_staged_plan_names_staging_paths_and_leaves_its_masks_to_staging():
    """Staged roots are bound recursively with their masks already in place; nsjail,
    as the sandbox user, could not open a mode-000 mask file to mount over it again."""
    policy, plan, kwargs = case_partial_workspace()
    staged = replace(plan, staging_dir="/var/lib/sandboxd-runtime/mounts/sbx-0001")
    spec = _compile(policy, staged, **kwargs)
    targets = {m.dst: m for m in spec.mounts}
    assert targets["/workspace/src"].src == "/var/lib/sandboxd-runtime/mounts/sbx-0001/0"
    assert targets["/workspace/out"].src == "/var/lib/sandboxd-runtime/mounts/sbx-0001/2"
    assert "/workspace/src/.env" not in targets and "/workspace/src/secrets" not in targets
    assert spec.staging is not None
    assert [(m.bind_index, m.relative_path, m.kind) for m in spec.staging.masks] == [(0, ".env", "file"),
                                                                                    (0, "secrets", "dir")]
    assert spec.staging.mask_file == MASK_FILE
    unstaged = {m.dst for m in _compile(policy, plan, **kwargs).mounts}
    assert {"/workspace/src/.env", "/workspace/src/secrets"} <= unstaged
