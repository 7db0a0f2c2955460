"""sandboxd.backends.docker.compile.compile_docker: golden files for representative inputs, plus
targeted asserts on the properties the sandbox's safety depends on.
Regenerate the golden files with UPDATE_GOLDEN=1."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sandboxd.backends.docker.backend import host_config_args
from sandboxd.backends.docker.compile import BACKSTOP_SLACK_S, DockerSpec, compile_docker
from sandboxd.sandbox.spec import (
    MASK_DIR_TMPFS_BYTES,
    MAX_OPEN_FILES,
    WORKSPACE_BASE_TMPFS_BYTES,
    SHIM_PATH,
    STDIO_DIR,
    GATE_PATH,
    Attachments,
    SecretMount,
    EGRESS_SOCKET_PATH,
    EgressAttachment,
    MountSpec,
    SandboxIdentity,
    network_plan,
)
from sandboxd.policy.models import is_within
from sandboxd.policy.preflight import Bind, HostPlan, Mask

from .conftest import resolve

GOLDEN = Path(__file__).parent / "golden"
MASK_FILE = "/var/lib/sandboxd/mask/empty"
WS = "/srv/sandboxd/workspaces/alice/project"
STAGED = "/var/lib/sandboxd-runtime/mounts/sbx-0001"
MB = 2**20


def _compile(policy, plan, *, stdin_open=False, argv=("python3", "-c", "print(1)"),
             image="sandboxd/default:latest", ident=None, attachments=None) -> DockerSpec:
    return compile_docker(policy, plan, ident or SandboxIdentity("daemon-1", "sbx-0001", "tc-0001"),
                          argv=argv, image=image, stdin_open=stdin_open,
                          mask_file=MASK_FILE, seccomp_profile="sandboxd-docker.json",
                          attachments=attachments or Attachments())


# ------------------------------------------------------------------ cases


def case_default():
    """No filesystem section: the whole workspace read-only, no network."""
    policy = resolve()
    plan = HostPlan(workspace=WS, uid=1000, gid=1000, binds=(Bind("/workspace", WS, True),), masks=())
    return policy, plan, {}


def case_partial_workspace():
    """Parts of the workspace visible, writable output, masks, open egress, custom limits."""
    policy = resolve({
        "filesystem": {
            "readRoots": ["/workspace/src", "/workspace/docs"],
            "writeRoots": ["/workspace/out", "/tmp/build"],
            "blockedPaths": ["/workspace/src/.env", "/workspace/src/secrets"],
            "cwd": "src",
        },
        "network": {"egress": "open", "denyPrivateNetworks": False},
        "environment": {"injectedEnv": {"MODE": "test", "EMPTY": ""}},
        "process": {"timeoutMs": "120000", "maxMemoryMb": 1024, "maxStdoutBytes": 1048576, "maxStderrBytes": 65536,
                    "maxPids": 64, "cpuMillicores": 2500, "maxFileSizeMb": 100, "maxTmpSizeMb": 32},
    })
    plan = HostPlan(
        workspace=WS, uid=1000, gid=1001,
        binds=(Bind("/workspace/src", f"{WS}/src", True), Bind("/workspace/docs", f"{WS}/docs", True),
               Bind("/workspace/out", f"{WS}/out", False, dev=64769, ino=4242)),
        masks=(Mask("/workspace/src/.env", "file"), Mask("/workspace/src/secrets", "dir")),
        workspace_dev=64769, workspace_ino=77, staging_dir=STAGED,
    )
    return policy, plan, {"stdin_open": True, "argv": ("make", "-C", "/workspace/src", "test")}


def test_staged_roots_are_mounted_from_the_staging_directory_only():
    """The engine is handed the staging paths, never a path of the workspace, which its
    owner could swap for a symlink between the host checks and the mount."""
    policy, plan, kwargs = case_partial_workspace()
    spec = _compile(policy, plan, **kwargs)
    binds = {m.target: m.source for m in spec.mounts if m.source.startswith((WS, STAGED))}
    assert binds == {"/workspace/src": "/var/lib/sandboxd-runtime/mounts/sbx-0001/0",
                     "/workspace/docs": "/var/lib/sandboxd-runtime/mounts/sbx-0001/1",
                     "/workspace/out": "/var/lib/sandboxd-runtime/mounts/sbx-0001/2"}
    assert spec.staging is not None and spec.staging.uid == 1000
    assert [(b.host_path, b.staged_path) for b in spec.staging.binds] == [
        (f"{WS}/src", "/var/lib/sandboxd-runtime/mounts/sbx-0001/0"),
        (f"{WS}/docs", "/var/lib/sandboxd-runtime/mounts/sbx-0001/1"),
        (f"{WS}/out", "/var/lib/sandboxd-runtime/mounts/sbx-0001/2")]
    assert (spec.staging.binds[2].dev, spec.staging.binds[2].ino) == (64769, 4242)


def case_writable_workspace_custom_temp():
    """The whole workspace writable, a custom tempDir used as cwd, inherited env."""
    policy = resolve({
        "filesystem": {
            "writeRoots": ["/workspace"],
            "blockedPaths": [".git", "id_rsa"],
            "tempDir": "/scratch",
            "cwd": "/scratch/run",
        },
        "environment": {"inheritedEnv": ["TZ"], "injectedEnv": {"PATH": "/opt/bin:/usr/bin"}},
        "audit": {"recordCommand": False},
    }, inheritable={"TZ": "Europe/Paris"})
    plan = HostPlan(
        workspace=WS, uid=2000, gid=2000,
        binds=(Bind("/workspace", WS, False),),
        masks=(Mask("/workspace/.git", "dir"), Mask("/workspace/id_rsa", "file")),
    )
    return policy, plan, {"image": "sandboxd/busybox:1", "argv": ("sh", "-c", "ls -la /workspace"),
                          "ident": SandboxIdentity("daemon-2", "sbx-abcdef", "tc-writable")}


def case_egress_allowlist():
    """allowlist: no network, the proxy's socket and the shim bound in, argv wrapped."""
    policy = resolve({"network": {"egress": "allowlist", "allowDomains": ["pypi.test", "*.files.test"]},
                      "environment": {"injectedEnv": {"HTTP_PROXY": "http://elsewhere:1"}}})
    plan = HostPlan(workspace=WS, uid=1000, gid=1000, binds=(Bind("/workspace", WS, True),), masks=())
    att = Attachments("/var/lib/sandboxd-runtime/sandbox-shim",
                      EgressAttachment("/var/lib/sandboxd-egress/sbx-0001.sock", 3128))
    return policy, plan, {"attachments": att, "argv": ("pip", "download", "requests")}


def case_kept_temp():
    """persistOutputs: the daemon's tmpfs bound at tempDir instead of the engine's."""
    policy = resolve({"filesystem": {"writeRoots": ["/workspace"], "persistOutputs": True},
                      "process": {"maxTmpSizeMb": 16}})
    plan = HostPlan(workspace=WS, uid=1000, gid=1000, binds=(Bind("/workspace", WS, False),), masks=(),
                    outputs_dir="/var/lib/sandboxd-runtime/outputs/sbx-0001")
    return policy, plan, {}


CASES = {
    "default": case_default,
    "kept_temp": case_kept_temp,
    "egress_allowlist": case_egress_allowlist,
    "partial_workspace": case_partial_workspace,
    "writable_workspace_custom_temp": case_writable_workspace_custom_temp,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    policy, plan, kwargs = CASES[name]()
    got = json.loads(json.dumps(_compile(policy, plan, **kwargs).to_json_dict()))
    path = GOLDEN / f"compile_{name}.json"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    assert path.exists(), f"{path} missing: run with UPDATE_GOLDEN=1"
    want = json.loads(path.read_text())
    assert got == want


def test_golden_files_have_no_strays():
    names = {p.name for p in GOLDEN.glob("compile_*.json")}
    assert names == {f"compile_{n}.json" for n in CASES}


# ------------------------------------------------------------------ targeted asserts


@pytest.fixture(params=sorted(CASES))
def compiled(request):
    policy, plan, kwargs = CASES[request.param]()
    return policy, plan, _compile(policy, plan, **kwargs)


def test_hardening_is_always_on(compiled):
    _, _, spec = compiled
    assert spec.cap_drop == ("ALL",)
    assert spec.read_only_rootfs is True
    assert spec.no_new_privileges is True
    assert spec.init is True
    assert spec.seccomp_profile == "sandboxd-docker.json"


def test_user_is_the_plan_uid_gid(compiled):
    _, plan, spec = compiled
    assert spec.user == f"{plan.uid}:{plan.gid}"
    assert not spec.user.startswith("0:")


def test_env_equals_policy_env_exactly(compiled):
    policy, _, spec = compiled
    proxy_names = {"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"}
    proxy_names |= {n.lower() for n in proxy_names}
    if policy.egress == "allowlist":
        assert proxy_names <= set(spec.env)
        assert {k: v for k, v in spec.env.items() if k not in proxy_names} == \
            {k: v for k, v in policy.env.items() if k not in proxy_names}
    else:
        assert spec.env == policy.env
    assert spec.env is not policy.env


def test_working_dir_and_limits(compiled):
    policy, _, spec = compiled
    assert spec.working_dir == policy.cwd
    assert spec.memory_bytes == policy.memory_bytes
    assert spec.pids_limit == policy.max_pids
    assert spec.nano_cpus == policy.cpu_millicores * 1_000_000
    assert spec.timeout_ms == policy.timeout_ms
    assert (spec.max_stdout_bytes, spec.max_stderr_bytes) == (policy.max_stdout_bytes, policy.max_stderr_bytes)


def test_ulimits(compiled):
    policy, _, spec = compiled
    u = {name: (soft, hard) for name, soft, hard in spec.ulimits}
    assert u == {"fsize": (policy.max_file_size_bytes,) * 2, "nofile": (MAX_OPEN_FILES,) * 2, "core": (0, 0)}


def test_mounts_parents_before_children(compiled):
    _, _, spec = compiled
    targets = [m.target for m in spec.mounts]
    for i, parent in enumerate(targets):
        for child in targets[:i]:
            assert not (child != parent and is_within(child, parent)), f"{child} mounted before its parent {parent}"


def test_mount_targets_are_unique(compiled):
    _, _, spec = compiled
    targets = [m.target for m in spec.mounts]
    assert len(targets) == len(set(targets))


def test_temp_dir_tmpfs(compiled):
    policy, plan, spec = compiled
    [tmp] = [m for m in spec.mounts if m.target == policy.temp_dir]
    if policy.persist_outputs:  # the daemon's own tmpfs, which outlives the sandbox
        assert tmp == MountSpec("bind", policy.temp_dir, source=plan.outputs_dir, read_only=False)
    else:
        assert tmp == MountSpec("tmpfs", policy.temp_dir, tmpfs_size_bytes=policy.tmp_size_bytes, tmpfs_mode=0o1777)


def test_labels(compiled):
    _, plan, spec = compiled
    assert set(spec.labels) == {"sandboxd.daemon_id", "sandboxd.sandbox_id", "sandboxd.tool_call_id", "sandboxd.workspace",
                                "sandboxd.deadline_s"}
    assert spec.labels["sandboxd.workspace"] == plan.workspace
    # The deadline the backstop enforces without the daemon: the timeout (whole seconds,
    # up) and a slack, never less than the timeout itself.
    policy = compiled[0]
    assert int(spec.labels["sandboxd.deadline_s"]) == -(-policy.timeout_ms // 1000) + BACKSTOP_SLACK_S
    assert spec.name == f"sandboxd-{spec.labels['sandboxd.sandbox_id']}"
    assert spec.cgroup_parent == f"/sandboxd/{spec.labels['sandboxd.sandbox_id']}"
    assert spec.cgroup_dir == f"sandboxd/{spec.labels['sandboxd.sandbox_id']}"
    assert spec.container_cgroup_dir("c0ffee") == f"sandboxd/{spec.labels['sandboxd.sandbox_id']}/c0ffee"


def test_under_systemds_driver_each_sandbox_is_a_slice_inside_sandboxd_slice():
    policy, plan, _ = case_default()
    spec = compile_docker(policy, plan, SandboxIdentity("daemon-1", "sbx-0a1b-2c", "tc-0001"),
                          argv=("true",), image="sandboxd/default:latest", stdin_open=False, mask_file=MASK_FILE,
                          seccomp_profile="sandboxd-docker.json", cgroup_driver="systemd")
    # A '-' in a slice's name nests it: the id's own become '_', one level below sandboxd.slice.
    assert spec.cgroup_parent == "sandboxd-sbx_0a1b_2c.slice"
    assert spec.cgroup_dir == "sandboxd.slice/sandboxd-sbx_0a1b_2c.slice"
    assert spec.container_cgroup_dir("c0ffee") == "sandboxd.slice/sandboxd-sbx_0a1b_2c.slice/docker-c0ffee.scope"
    assert host_config_args(spec, "{}")["cgroup_parent"] == "sandboxd-sbx_0a1b_2c.slice"


def test_label_values_are_the_identity():
    policy, plan, _ = case_default()
    spec = _compile(policy, plan, ident=SandboxIdentity("dmn", "sbx-9", "tc-9"))
    assert spec.labels["sandboxd.daemon_id"] == "dmn"
    assert spec.labels["sandboxd.sandbox_id"] == "sbx-9"
    assert spec.labels["sandboxd.tool_call_id"] == "tc-9"


def test_network_none():
    policy, plan, _ = case_default()
    assert _compile(policy, plan).network_mode == "none"


def test_network_open_is_bridge():
    policy, plan, kwargs = case_partial_workspace()
    assert _compile(policy, plan, **kwargs).network_mode == "bridge"


def test_whole_workspace_bind_has_no_base_tmpfs():
    policy, plan, _ = case_default()
    spec = _compile(policy, plan)
    assert [m for m in spec.mounts if m.target == "/workspace"] == [MountSpec("bind", "/workspace", WS, True)]


def test_workspace_is_root_owned_tmpfs_when_not_a_root():
    policy, plan, kwargs = case_partial_workspace()
    spec = _compile(policy, plan, **kwargs)
    [base] = [m for m in spec.mounts if m.target == "/workspace"]
    assert base.type == "tmpfs"
    assert base.tmpfs_mode == 0o755
    assert base.tmpfs_size_bytes == WORKSPACE_BASE_TMPFS_BYTES
    # Mounted before everything inside it; root owns a tmpfs unless told otherwise,
    # and the spec carries no owner for it.
    first_inside = min(i for i, m in enumerate(spec.mounts) if m.target.startswith("/workspace/"))
    assert spec.mounts.index(base) < first_inside
    assert base.source == "" and base.read_only is False


def test_empty_roots_still_get_workspace_tmpfs():
    policy = resolve({"filesystem": {}})
    spec = _compile(policy, HostPlan(WS, 1000, 1000, (), ()))
    assert [m.target for m in spec.mounts] == ["/tmp", "/workspace"]
    assert all(m.type == "tmpfs" for m in spec.mounts)


def test_binds_keep_read_only_flags():
    policy, plan, kwargs = case_partial_workspace()
    spec = _compile(policy, plan, **kwargs)
    binds = {m.target: m for m in spec.mounts if m.type == "bind" and m.source != MASK_FILE}
    assert binds == {
        "/workspace/src": MountSpec("bind", "/workspace/src", f"{STAGED}/0", True),
        "/workspace/docs": MountSpec("bind", "/workspace/docs", f"{STAGED}/1", True),
        "/workspace/out": MountSpec("bind", "/workspace/out", f"{STAGED}/2", False),
    }


def test_blocked_file_is_read_only_bind_of_mask_file():
    policy, plan, kwargs = case_partial_workspace()
    spec = _compile(policy, plan, **kwargs)
    [m] = [m for m in spec.mounts if m.target == "/workspace/src/.env"]
    assert m == MountSpec("bind", "/workspace/src/.env", source=MASK_FILE, read_only=True)


def test_blocked_dir_is_a_read_only_tmpfs_closed_to_the_sandbox_user():
    policy, plan, kwargs = case_partial_workspace()
    spec = _compile(policy, plan, **kwargs)
    [m] = [m for m in spec.mounts if m.target == "/workspace/src/secrets"]
    assert m == MountSpec("tmpfs", "/workspace/src/secrets", read_only=True,
                          tmpfs_size_bytes=MASK_DIR_TMPFS_BYTES, tmpfs_mode=0o500)


def test_masks_come_after_the_bind_they_cover():
    policy, plan, kwargs = case_partial_workspace()
    targets = [m.target for m in _compile(policy, plan, **kwargs).mounts]
    assert targets.index("/workspace/src") < targets.index("/workspace/src/.env")
    assert targets.index("/workspace/src") < targets.index("/workspace/src/secrets")
    assert targets.index("/workspace") < targets.index("/workspace/src")


def test_write_root_in_temp_dir_is_not_mounted():
    policy, plan, kwargs = case_partial_workspace()
    targets = [m.target for m in _compile(policy, plan, **kwargs).mounts]
    assert "/tmp/build" not in targets and "/tmp" in targets


def test_stdin_open_and_argv_pass_through():
    policy, plan, kwargs = case_partial_workspace()
    spec = _compile(policy, plan, **kwargs)
    assert spec.stdin_open is True
    assert spec.argv == ("make", "-C", "/workspace/src", "test")
    policy, plan, _ = case_default()
    assert _compile(policy, plan).stdin_open is False


def test_compile_is_deterministic():
    for factory in CASES.values():
        policy, plan, kwargs = factory()
        assert _compile(policy, plan, **kwargs).to_json_dict() == _compile(policy, plan, **kwargs).to_json_dict()


def test_to_json_dict_is_json_serializable():
    policy, plan, kwargs = case_partial_workspace()
    d = _compile(policy, plan, **kwargs).to_json_dict()
    assert json.loads(json.dumps(d))["mounts"][0]["type"] == "tmpfs"


def test_egress_allowlist_cannot_compile_without_its_proxy():
    # Without the attachment an allowlist would be a cut-off sandbox or, worse, an open one.
    from dataclasses import replace
    policy, plan, _ = case_default()
    with pytest.raises(ValueError):
        _compile(replace(policy, egress="allowlist", allow_domains=("pypi.test",)), plan)
    policy, plan, kwargs = case_egress_allowlist()
    with pytest.raises(ValueError):
        _compile(replace(policy, egress="none", allow_domains=()), plan, attachments=kwargs["attachments"])


def test_egress_allowlist_has_no_network_but_the_proxy():
    policy, plan, kwargs = case_egress_allowlist()
    spec = _compile(policy, plan, **kwargs)
    assert spec.network_mode == "none"
    binds = {m.target: m for m in spec.mounts if m.type == "bind"}
    assert binds[EGRESS_SOCKET_PATH].source == kwargs["attachments"].egress.socket_host_path
    assert binds[EGRESS_SOCKET_PATH].read_only and binds[SHIM_PATH].read_only
    assert spec.argv == (SHIM_PATH, "--egress", EGRESS_SOCKET_PATH, "3128", "--", "pip", "download", "requests")
    # The daemon's proxy wins over a policy that names another: it is the only way out anyway.
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        assert spec.env[name] == "http://127.0.0.1:3128"


def test_egress_open_that_denies_private_networks_is_proxied():
    from dataclasses import replace
    policy, plan, kwargs = case_egress_allowlist()
    open_policy = replace(policy, egress="open", allow_domains=())
    spec = _compile(open_policy, plan, **kwargs)
    assert spec.network_mode == "none" and spec.argv[0] == SHIM_PATH
    assert network_plan(open_policy, kwargs["attachments"].egress)["allowDomains"] == ["(any)"]
    with pytest.raises(ValueError):
        _compile(open_policy, plan)
    bridge = replace(open_policy, deny_private_networks=False)
    assert _compile(bridge, plan).network_mode == "bridge"
    with pytest.raises(ValueError):
        _compile(bridge, plan, attachments=kwargs["attachments"])


def test_secrets_are_read_only_file_binds_and_env_ones_go_through_the_shim():
    policy, plan, _ = case_default()
    att = Attachments("/rt/sandbox-shim", None, (
        SecretMount("gh", "/dev/shm/s/sbx-0001/0", "/dev/sandboxd/secrets/0", env_name="GH_TOKEN"),
        SecretMount("npmrc", "/dev/shm/s/sbx-0001/1", "/tmp/.npmrc"),
    ))
    spec = _compile(policy, plan, attachments=att, argv=("git", "push"))
    binds = {m.target: m for m in spec.mounts if m.type == "bind"}
    assert binds["/dev/sandboxd/secrets/0"].source == "/dev/shm/s/sbx-0001/0"
    assert binds["/tmp/.npmrc"].source == "/dev/shm/s/sbx-0001/1" and binds["/tmp/.npmrc"].read_only
    assert spec.argv == (SHIM_PATH, "--env", "GH_TOKEN=/dev/sandboxd/secrets/0", "--", "git", "push")
    # The engine is never told a value: not in env, labels or anywhere in the spec.
    assert "GH_TOKEN" not in spec.env
    # The file target lands on the tmpfs it lives in: the tmpfs is mounted first.
    targets = [m.target for m in spec.mounts]
    assert targets.index("/tmp") < targets.index("/tmp/.npmrc")
    # Only file secrets: no shim needed.
    files_only = Attachments("/rt/sandbox-shim", None, (SecretMount("npmrc", "/h/1", "/tmp/.npmrc"),))
    assert _compile(policy, plan, attachments=files_only).argv == ("python3", "-c", "print(1)")


def test_output_fifos_are_a_read_only_bind_and_the_shim_opens_them_before_the_gate():
    policy, plan, _ = case_default()
    att = Attachments("/rt/sandbox-shim", gate_host_path="/rt/gates/sbx-1", stdio_host_dir="/rt/stdio/sbx-1")
    assert att.needs_shim
    spec = _compile(policy, plan, attachments=att, argv=("ls",))
    assert spec.argv == (SHIM_PATH, "--stdio", STDIO_DIR, "--gate", GATE_PATH, "--", "ls")
    binds = {m.target: m for m in spec.mounts if m.type == "bind"}
    assert binds[STDIO_DIR].source == "/rt/stdio/sbx-1" and binds[STDIO_DIR].read_only
    assert spec.stdio_host_dir == "/rt/stdio/sbx-1"
    # Alone, the FIFOs still need the shim (it is what opens them).
    only = _compile(policy, plan, attachments=Attachments("/rt/sandbox-shim", stdio_host_dir="/rt/stdio/sbx-1"),
                    argv=("ls",))
    assert only.argv == (SHIM_PATH, "--stdio", STDIO_DIR, "--", "ls")
    # A warm sandbox's supervisor passes each command its own descriptors instead.
    warm = Attachments("/rt/sandbox-shim", control_host_socket="/rt/c.sock", stdio_host_dir="/rt/stdio/sbx-1")
    assert "--stdio" not in _compile(policy, plan, attachments=warm, argv=("ls",)).argv
    assert _compile(policy, plan, argv=("ls",)).stdio_host_dir == ""


def test_network_plan_shows_the_proxy_and_patterns():
    policy, plan, kwargs = case_egress_allowlist()
    shown = network_plan(policy, kwargs["attachments"].egress)
    assert shown["proxy"] == "http://127.0.0.1:3128"
    assert shown["allowDomains"] == ["pypi.test", "*.files.test"]
    assert shown["denyPrivateNetworks"] is True
    assert network_plan(*case_default()[:1], None)["network"] == "loopback only"


def test_plain_is_asdict_as_json_without_its_copies():
    from dataclasses import asdict, dataclass

    from sandboxd.sandbox.spec import plain

    @dataclass(frozen=True)
    class Inner:
        a: tuple[str, ...]
        b: dict[str, int]

    @dataclass(frozen=True)
    class Outer:
        name: str
        inner: tuple[Inner, ...]
        extra: dict[str, object]
        n: int | None = None

    value = Outer("x", (Inner(("p", "q"), {"k": 1}), Inner((), {})), {"nested": [Inner(("z",), {})], "t": (1, 2)})
    assert json.dumps(plain(value), sort_keys=True) == json.dumps(asdict(value), sort_keys=True)
    assert plain(value)["inner"][0]["a"] == ["p", "q"]
