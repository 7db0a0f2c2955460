"""sandboxd check's probes on the real filesystem (as root), each driven into its
failure: the daemon's directories looked at without making anything (hostdirs'
inspect_* functions), workspace roots, the nsjail binary's hash, the jail's init, the
cgroup layouts, the daemon's own files, fanotify, and what dockerd said (its version,
cgroup driver and images, given as facts)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from sandboxd.backends.cgroup_home import plan_home
from sandboxd.backends.cgroups import V2_CONTROLLERS
from sandboxd.check import dockerd_probes, nsjail_probes, probes
from sandboxd.check.dirs import dir_findings
from sandboxd.check.dockerd_probes import DockerFacts
from sandboxd.check.report import DAEMON
from sandboxd.core import hostdirs
from sandboxd.core.errors import FailedPrecondition
from sandboxd.core.hostfacts import HostFacts
from sandboxd.core.settings import DaemonSettings

from .fifos import finishes, make_fifo

BOB = 1001


@pytest.fixture(autouse=True)
def running_as_root():
    if os.geteuid() != 0:
        pytest.fail("these tests chown to another uid: run them as root, as the daemon and CI do")


@pytest.fixture
def public_tmp():
    """A directory every user may traverse (pytest's own are 0700 on the way)."""
    path = Path(tempfile.mkdtemp(prefix="sandboxd-check-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def settings_under(tmp_path: Path, **over) -> DaemonSettings:
    data = {"state_dir": tmp_path / "state", "runtime_dir": tmp_path / "runtime",
            "socket_path": tmp_path / "run" / "sandboxd.sock", "workspace_roots": [tmp_path / "ws"],
            "egress": {"socket_dir": str(tmp_path / "egress")}, "nsjail": {"rootfs_dir": str(tmp_path / "rootfs")}}
    data.update(over)
    return DaemonSettings.model_validate(data)


def tree(path: Path) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), path) for d, dirs, files in os.walk(path) for n in dirs + files}


def bobs_dir(path: Path, mode: int = 0o755) -> Path:
    path.mkdir(parents=True)
    os.chown(path, BOB, BOB)
    os.chmod(path, mode)
    return path


# -------------------------------------------------------------------- the daemon's directories

class TestInspectPrivateDir:
    def test_a_missing_dir_names_its_first_missing_component_and_is_not_made(self, tmp_path):
        target = tmp_path / "a" / "b" / "c"
        assert hostdirs.inspect_private_dir(target, setting="state_dir") == str(tmp_path / "a")
        assert not (tmp_path / "a").exists()

    def test_an_existing_own_dir_is_accepted_and_left_as_it_is(self, tmp_path):
        target = tmp_path / "state"
        target.mkdir(mode=0o750)
        os.chmod(target, 0o750)
        assert hostdirs.inspect_private_dir(target, setting="state_dir") == ""
        assert target.stat().st_mode & 0o777 == 0o750  # ensure_private_dir would re-mode it; a look does not

    def test_a_planted_dir_is_refused_as_the_start_would(self, tmp_path):
        planted = bobs_dir(tmp_path / "planted")
        with pytest.raises(FailedPrecondition) as exc:
            hostdirs.inspect_private_dir(planted, setting="runtime_dir")
        assert exc.value.field == "runtime_dir" and "owned by uid 1001" in exc.value.reason

    def test_a_dir_below_a_planted_one_is_refused(self, tmp_path):
        planted = bobs_dir(tmp_path / "planted", 0o777)
        with pytest.raises(FailedPrecondition) as exc:
            hostdirs.inspect_private_dir(planted / "state", setting="state_dir")
        assert "on the way to" in exc.value.reason
        assert not (planted / "state").exists()

    def test_a_symlink_is_refused(self, tmp_path):
        (tmp_path / "real").mkdir()
        (tmp_path / "link").symlink_to(tmp_path / "real")
        with pytest.raises(FailedPrecondition) as exc:
            hostdirs.inspect_private_dir(tmp_path / "link", setting="state_dir")
        assert "symbolic link" in exc.value.reason

    def test_a_relative_path_is_refused(self):
        with pytest.raises(FailedPrecondition) as exc:
            hostdirs.inspect_private_dir("relative/state", setting="state_dir")
        assert exc.value.message == "state_dir: relative/state must be an absolute path"

    def test_an_operators_secrets_dir_on_a_disk_is_refused_without_being_made(self, tmp_path):
        with pytest.raises(FailedPrecondition) as exc:
            hostdirs.inspect_secrets_dir(tmp_path / "secrets", daemon_mounts=False)
        assert exc.value.field == "secrets_dir" and "not a tmpfs" in exc.value.reason
        assert not (tmp_path / "secrets").exists()

    def test_an_operators_secrets_dir_to_be_made_on_a_tmpfs_passes(self):
        path = Path("/dev/shm") / f"sandboxd-check-{os.getpid()}" / "secrets"
        assert hostdirs.inspect_secrets_dir(path, daemon_mounts=False) == str(path.parent)
        assert not path.parent.exists()


class TestDirFindings:
    def test_every_dir_would_be_made_and_nothing_is(self, tmp_path):
        before = tree(tmp_path)
        got = {f.probe: f for f in dir_findings(settings_under(tmp_path))}
        assert set(got) == {"state_dir", "runtime_dir", "socket_path", "egress.socket_dir", "nsjail.rootfs_dir",
                            "secrets_dir"}
        assert all(f.status == "ok" and "would be created" in f.reason for f in got.values()), got
        assert tree(tmp_path) == before

    def test_a_planted_dir_fails_with_its_setting(self, tmp_path):
        planted = bobs_dir(tmp_path / "planted")
        got = {f.probe: f for f in dir_findings(settings_under(tmp_path, state_dir=planted))}
        assert got["state_dir"].status == "fail" and got["state_dir"].field == "state_dir"
        assert got["state_dir"].needed_by == (DAEMON,) and "uid 1001" in got["state_dir"].reason
        assert got["runtime_dir"].status == "ok"


# -------------------------------------------------------------------- workspace roots

class TestWorkspaceRoots:
    def test_a_usable_root(self, tmp_path):
        (tmp_path / "ws").mkdir()
        got = probes.workspace_findings(settings_under(tmp_path))
        assert [(f.status, f.field) for f in got] == [("ok", "workspace_roots[0]")]

    def test_a_missing_root_warns_and_none_usable_fails(self, tmp_path):
        got = probes.workspace_findings(settings_under(tmp_path))
        assert [f.status for f in got] == ["warn", "fail"]
        assert "cannot be used" in got[0].reason and "no workspace root is usable" in got[1].reason

    def test_a_root_open_to_everyone_without_the_sticky_bit_warns(self, tmp_path):
        root = tmp_path / "ws"
        root.mkdir()
        os.chmod(root, 0o777)
        got = probes.workspace_findings(settings_under(tmp_path))
        assert got[0].status == "warn" and "sticky" in got[0].reason

    def test_a_root_inside_the_runtime_dir_warns(self, tmp_path):
        root = tmp_path / "runtime" / "ws"
        root.mkdir(parents=True)
        got = probes.workspace_findings(settings_under(tmp_path, workspace_roots=[root]))
        assert got[0].status == "warn" and "lies in runtime_dir" in got[0].reason


# -------------------------------------------------------------------- nsjail

def a_binary(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "nsjail"
    shutil.copy("/bin/true", path)
    os.chmod(path, 0o755)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


class TestNsjail:
    def test_a_binary_with_the_configured_hash(self, tmp_path):
        path, digest = a_binary(tmp_path)
        s = settings_under(tmp_path, nsjail={"nsjail_binary": str(path), "nsjail_binary_sha256": digest})
        assert nsjail_probes.binary_finding(s).status == "ok"
        got = nsjail_probes.sha256_finding(s)
        assert got.status == "ok" and "matches nsjail.nsjail_binary_sha256" in got.reason

    def test_another_hash_fails_naming_both(self, tmp_path):
        path, digest = a_binary(tmp_path)
        s = settings_under(tmp_path, nsjail={"nsjail_binary": str(path), "nsjail_binary_sha256": "0" * 64})
        got = nsjail_probes.sha256_finding(s)
        assert got.status == "fail" and got.needed_by == ("nsjail",)
        assert digest in got.reason and "0" * 64 in got.reason and got.field == "nsjail.nsjail_binary_sha256"

    def test_the_pin_refuses_another_binary(self, tmp_path):
        path, digest = a_binary(tmp_path)
        got = nsjail_probes.sha256_finding(settings_under(tmp_path, nsjail={"nsjail_binary": str(path)}))
        assert got.status == "fail" and digest in got.reason and "pinned" in got.reason

    def test_unchecked_warns(self, tmp_path):
        path, _ = a_binary(tmp_path)
        s = settings_under(tmp_path, nsjail={"nsjail_binary": str(path), "nsjail_binary_sha256": "unchecked"})
        assert nsjail_probes.sha256_finding(s).status == "warn"

    def test_a_missing_binary(self, tmp_path):
        s = settings_under(tmp_path, nsjail={"nsjail_binary": str(tmp_path / "absent")})
        assert nsjail_probes.binary_finding(s).status == "fail"
        assert nsjail_probes.sha256_finding(s).status == "fail"

    def test_a_dynamic_init_fails(self, tmp_path):
        s = settings_under(tmp_path, nsjail={"init_binary": "/bin/true"})
        got = nsjail_probes.init_finding(s)
        assert got.status == "fail" and "not a static executable" in got.reason

    def test_disabled_is_one_warning(self, tmp_path):
        got = nsjail_probes.nsjail_findings(settings_under(tmp_path, nsjail={"enabled": False}), facts("v1"))
        assert [(f.probe, f.status) for f in got] == [("nsjail", "warn")]

    def test_v2_without_a_controller_fails_naming_it(self, tmp_path):
        (tmp_path / "cgroup.controllers").write_text("cpu memory io\n")
        got = nsjail_probes.cgroup_controllers_finding(settings_under(tmp_path), facts("v2", str(tmp_path)))
        assert got.status == "fail" and "does not offer pids" in got.reason

    def test_v2_without_the_join_helper_fails(self, tmp_path):
        (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
        s = settings_under(tmp_path, cgroup_exec_binary=str(tmp_path / "absent"))
        got = nsjail_probes.cgroup_controllers_finding(s, facts("v2", str(tmp_path)))
        assert got.status == "fail" and "join helper" in got.reason

    def test_the_jails_cgroup_placement_is_said_and_a_delegation_that_cannot_be_is_a_failure(self, tmp_path):
        ok = nsjail_probes.cgroup_placement_finding(settings_under(tmp_path), facts("v1", str(tmp_path)))
        assert ok.status == "ok" and "top of each v1 hierarchy" in ok.reason
        asked = settings_under(tmp_path, nsjail={"cgroup_placement": "delegated"})
        refused = nsjail_probes.cgroup_placement_finding(asked, facts("v1", str(tmp_path)))
        assert (refused.status, refused.field) == ("fail", "nsjail.cgroup_placement") and "v2" in refused.reason
        assert "nsjail-cgroup-placement" in [f.probe for f in nsjail_probes.nsjail_findings(asked, facts("v1"))]

    def test_a_cgroup_of_systemds_not_delegated_is_a_warning(self, tmp_path, monkeypatch):
        monkeypatch.setattr(nsjail_probes, "own_cgroup", lambda text: "user.slice/session-1.scope")
        monkeypatch.setattr(nsjail_probes, "find_home", lambda *a: plan_home("v2", "user.slice/session-1.scope",
                                                                              False, "auto"))
        got = nsjail_probes.cgroup_placement_finding(settings_under(tmp_path), facts("v2", str(tmp_path)))
        assert got.status == "warn" and "not delegated" in got.reason and "Delegate=yes" in got.reason

    def test_v1_without_a_controller_fails(self, tmp_path):
        for c in ("memory", "cpu", "cpuacct"):
            (tmp_path / c).mkdir()
            (tmp_path / c / "cgroup.procs").write_text("")
        got = nsjail_probes.cgroup_controllers_finding(settings_under(tmp_path), facts("v1", str(tmp_path)))
        assert got.status == "fail" and "pids" in got.reason

    def test_a_rootfs_dir_sandbox_users_cannot_reach(self, tmp_path, public_tmp):
        open_dir = public_tmp / "rootfs"
        reachable = nsjail_probes.rootfs_finding(settings_under(tmp_path, nsjail={"rootfs_dir": str(open_dir)}))
        assert reachable.status == "ok"
        closed = public_tmp / "closed"
        closed.mkdir(mode=0o700)
        os.chmod(closed, 0o700)
        got = nsjail_probes.rootfs_finding(settings_under(tmp_path, nsjail={"rootfs_dir": str(closed / "rootfs")}))
        assert got.status == "fail" and got.reason.endswith(f"but {closed} is not searchable by others")

    def test_a_broken_seccomp_profile(self, tmp_path):
        (tmp_path / "profile.json").write_text('{"defaultAction": 1}')
        got = nsjail_probes.seccomp_bpf_finding(settings_under(tmp_path, seccomp_profile=tmp_path / "profile.json"))
        assert got.status == "fail" and got.field == "seccomp_profile"


    def test_a_fifo_as_the_seccomp_profile_fails_without_blocking(self, tmp_path):
        fifo = make_fifo(tmp_path / "profile.json", 0o644)
        got = finishes(fifo, lambda: nsjail_probes.seccomp_bpf_finding(settings_under(tmp_path, seccomp_profile=fifo)))
        assert got.status == "fail" and got.field == "seccomp_profile" and "is a FIFO" in got.reason


# -------------------------------------------------------------------- the host

def facts(version, root: str = "/sys/fs/cgroup") -> HostFacts:
    return HostFacts(kernel="6.1", cgroup_root=root, cgroup_version=version, fanotify_dfid_name=True)


class TestHost:
    def test_cgroup_layouts(self, tmp_path):
        assert probes.cgroup_finding(facts(None, str(tmp_path))).status == "fail"
        assert "v2" in probes.cgroup_finding(facts("v2", str(tmp_path))).reason
        assert probes.cgroup_finding(facts("v1", str(tmp_path))).reason.startswith("v1")
        (tmp_path / "unified").mkdir()
        (tmp_path / "unified" / "cgroup.controllers").write_text("")
        assert probes.cgroup_finding(facts("v1", str(tmp_path))).reason.startswith("hybrid")

    def test_root(self):
        assert probes.root_finding().status == "ok"

    def test_missing_assets(self, tmp_path):
        s = settings_under(tmp_path, seccomp_profile=tmp_path / "absent.json", relay_library=tmp_path / "absent.so",
                           shim_binary=Path("/bin/true"))
        got = {f.probe: f for f in probes.asset_findings(s)}
        assert got["seccomp-profile"].status == "fail" and got["seccomp-profile"].needed_by == ("docker", "nsjail")
        assert got["relay-library"].status == "fail" and got["relay-library"].needed_by == (DAEMON,)
        assert got["sandbox-shim"].status == "fail"  # dynamic: not usable in any image

    def test_a_fifo_as_the_seccomp_profile_fails_without_blocking(self, tmp_path):
        fifo = make_fifo(tmp_path / "profile.json", 0o644)
        got = finishes(fifo, lambda: {f.probe: f for f in probes.asset_findings(settings_under(
            tmp_path, seccomp_profile=fifo))})
        assert got["seccomp-profile"].status == "fail" and "is a FIFO" in got["seccomp-profile"].reason

    def test_fifos_named_as_the_native_helpers_fail_without_blocking(self, tmp_path):
        # In a process of its own: a dlopen blocked on a FIFO holds the interpreter's lock,
        # so no thread of this one could end the wait; a child is killed at its timeout.
        fifo = make_fifo(tmp_path / "helper", 0o755)  # executable bits: os.access(X_OK) passes
        (tmp_path / "cg").mkdir()
        (tmp_path / "cg" / "cgroup.controllers").write_text(" ".join(V2_CONTROLLERS))
        code = textwrap.dedent(f"""
            import json
            from sandboxd.check import nsjail_probes, probes
            from sandboxd.core.hostfacts import HostFacts
            from sandboxd.core.settings import DaemonSettings
            s = DaemonSettings(relay_library={str(fifo)!r}, shim_binary={str(fifo)!r},
                               cgroup_exec_binary={str(fifo)!r}, file_audit={{"reader_library": {str(fifo)!r}}})
            v1 = HostFacts(kernel="6.1", cgroup_root="/sys/fs/cgroup", cgroup_version="v1", fanotify_dfid_name=True)
            v2 = HostFacts(kernel="6.1", cgroup_root={str(tmp_path / "cg")!r}, cgroup_version="v2",
                           fanotify_dfid_name=True)
            found = probes.asset_findings(s) + [probes.fanotify_finding(s, v1),
                                                nsjail_probes.cgroup_controllers_finding(s, v2)]
            print(json.dumps({{f.probe: [f.status, f.reason] for f in found}}))
        """)
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("check blocked on a FIFO named as a native helper")
        got = json.loads(done.stdout)
        assert got["relay-library"][0] == "fail" and "is a FIFO" in got["relay-library"][1]
        assert got["sandbox-shim"][0] == "fail"
        assert got["fanotify"][0] == "warn" and "is a FIFO" in got["fanotify"][1]
        assert got["nsjail-cgroups"][0] == "fail" and "join helper" in got["nsjail-cgroups"][1]

    def test_file_recording_off_or_without_its_reader_warns(self, tmp_path):
        off = probes.fanotify_finding(settings_under(tmp_path, file_watch=False), facts("v1"))
        assert off.status == "warn" and off.field == "file_watch"
        s = settings_under(tmp_path, file_audit={"reader_library": str(tmp_path / "absent.so")})
        try:
            got = probes.fanotify_finding(s, facts("v1"))
        finally:
            probes.filewatch.use_reader_library(None)
        assert got.status == "warn" and "recordFileAccess will be refused" in got.reason


# -------------------------------------------------------------------- dockerd's answers

def docker_facts(api="1.41", driver="cgroupfs", tags=("sandboxd/default:latest",), default_id="sha256:" + "a" * 64):
    return DockerFacts({"Version": "20.10", "ApiVersion": api}, {"CgroupDriver": driver, "CgroupVersion": "1"},
                       tags, default_id)


class TestDockerd:
    def test_an_old_api_fails(self):
        assert dockerd_probes._version_finding("unix:///x", docker_facts(api="1.40")).status == "fail"
        assert dockerd_probes._version_finding("unix:///x", docker_facts()).status == "ok"

    def test_both_cgroup_drivers_are_supported_and_another_is_not(self):
        for driver in ("cgroupfs", "systemd"):
            got = dockerd_probes._driver_finding(docker_facts(driver=driver))
            assert got.status == "ok" and driver in got.reason
        got = dockerd_probes._driver_finding(docker_facts(driver="none"))
        assert got.status == "fail" and "native.cgroupdriver=systemd" in got.reason and got.needed_by == ("docker",)

    def test_a_missing_default_image_fails(self, tmp_path):
        got = dockerd_probes.image_finding(settings_under(tmp_path), docker_facts(default_id=None))
        assert got.status == "fail" and got.field == "default_image" and "make images" in got.reason

    def test_a_default_image_not_allowed_fails(self, tmp_path):
        s = settings_under(tmp_path, default_image="other/image", allowed_images=["sandboxd/*"])
        got = dockerd_probes.image_finding(s, docker_facts(tags=("other/image:latest",)))
        assert got.status == "fail" and "not allowed by allowed_images" in got.reason

    def test_present_and_allowed(self, tmp_path):
        got = dockerd_probes.image_finding(settings_under(tmp_path),
                                           docker_facts(tags=("sandboxd/default:latest", "debian:12")))
        assert got.status == "ok" and "sandboxd/default:latest" in got.reason and "debian" not in got.reason

    def test_an_unreachable_dockerd_fails_both_lines(self, tmp_path):
        s = settings_under(tmp_path, docker_host=f"unix://{tmp_path}/absent.sock")
        got = dockerd_probes.docker_findings(s)
        assert [(f.probe, f.status) for f in got] == [("dockerd", "fail"), ("images", "fail")]
        assert f"{tmp_path}/absent.sock" in got[0].reason and got[0].field == "docker_host"


# -------------------------------------------------------------------- files settings name

class TestCredentialFiles:
    SECRET = "ghp_never-printed-by-check"

    def bindings(self, tmp_path: Path) -> dict:
        src = tmp_path / "src"
        src.mkdir(mode=0o700)
        good = src / "good"
        good.write_text(self.SECRET)
        good.chmod(0o600)
        loose = src / "loose"
        loose.write_text(self.SECRET)
        loose.chmod(0o640)
        bobs = src / "bobs"
        bobs.write_text(self.SECRET)
        bobs.chmod(0o600)
        os.chown(bobs, BOB, BOB)
        (src / "link").symlink_to(good)
        make_fifo(src / "fifo")
        files = {"good": good, "loose": loose, "bobs": bobs, "link": src / "link", "fifo": src / "fifo",
                 "missing": src / "missing"}
        out: dict = {name: {"file": str(path), "principals": ["alice"]} for name, path in files.items()}
        out["from-env"] = {"env": "SOME_VAR", "principals": ["alice"]}
        return out

    def test_each_file_binding_is_looked_at_as_the_broker_reads_it_and_nothing_of_it_is_told(self, tmp_path):
        s = settings_under(tmp_path, credentials=self.bindings(tmp_path))
        found = finishes(tmp_path / "src" / "fifo", lambda: probes.credential_file_findings(s))
        got = {f.field: f for f in found}
        assert set(got) == {f"credentials.{n}.file" for n in ("good", "loose", "bobs", "link", "fifo", "missing")}
        assert got["credentials.good.file"].status == "ok" and "mode 0600" in got["credentials.good.file"].reason
        for name, said in (("loose", "mode 0640"), ("bobs", f"uid {BOB}"), ("link", "symbolic link"),
                           ("fifo", "is a FIFO"), ("missing", "does not exist")):
            f = got[f"credentials.{name}.file"]
            assert f.status == "warn" and said in f.reason and f"credential {name!r} are refused" in f.reason, f
        assert all(self.SECRET not in f.reason for f in found)


class TestTlsFiles:
    def test_none_without_a_tcp_listener(self, tmp_path):
        assert probes.tls_findings(settings_under(tmp_path)) == []

    def test_the_key_must_be_private_and_no_file_a_symlink(self, tmp_path):
        for name in ("cert.pem", "real-ca.pem"):
            (tmp_path / name).write_text("PEM")
        key = tmp_path / "key.pem"
        key.write_text("PRIVATE KEY")
        key.chmod(0o640)
        (tmp_path / "ca.pem").symlink_to(tmp_path / "real-ca.pem")
        s = settings_under(tmp_path, tcp={"address": "127.0.0.1:7443", "cert_file": str(tmp_path / "cert.pem"),
                                          "key_file": str(key), "client_ca_file": str(tmp_path / "ca.pem")})
        got = {f.field: f for f in probes.tls_findings(s)}
        assert got["tcp.cert_file"].status == "ok"
        assert got["tcp.key_file"].status == "fail" and "mode 0640" in got["tcp.key_file"].reason
        assert got["tcp.client_ca_file"].status == "fail" and "symbolic link" in got["tcp.client_ca_file"].reason
        assert all(f.needed_by == (DAEMON,) for f in got.values())
        key.chmod(0o600)
        assert {f.field: f.status for f in probes.tls_findings(s)}["tcp.key_file"] == "ok"


def test_a_docker_hosts_userinfo_is_masked(tmp_path):
    # A loopback port nobody listens on: dockerd "does not answer", named without the password.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    found = dockerd_probes.docker_findings(settings_under(tmp_path, docker_host=f"tcp://ops:hunter2-pw@127.0.0.1:{port}"))
    dockerd = next(f for f in found if f.probe == "dockerd")
    assert dockerd.status == "fail" and f"dockerd at tcp://***@127.0.0.1:{port} does not answer" in dockerd.reason
    assert all("hunter2-pw" not in f.reason for f in found)
