"""The daemon's own host directories (sandboxd.core.hostdirs) and the credential broker's use
of them, on the real filesystem, as root: another local user (uid 1001, "bob") plants
directories and symlinks where the daemon will look, and each plant is refused or
harmless. Bob's things are made by root here and handed to him with chown."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sandboxd.core import hostdirs
from sandboxd.secrets.broker import CredentialBroker, ResolvedSecret
from sandboxd.core.errors import FailedPrecondition
from sandboxd.core.hostdirs import (check_daemon_dirs, ensure_private_dir, filesystem_type, open_secrets_dir,
                                     require_memory_filesystem)
from sandboxd.core.settings import DaemonSettings

from .test_credentials import SANDBOX_GID, SANDBOX_UID, SECRETS, after_mkdir

BOB = 1001
BOB_VALUE = b"bob-planted-value"


@pytest.fixture(autouse=True)
def running_as_root():
    if os.geteuid() != 0:
        pytest.fail("these tests chown to another uid: run them as root, as the daemon and CI do")


@pytest.fixture
def fds():
    """Descriptors a test opened: closed after it."""
    opened: list[int] = []
    yield opened
    for fd in opened:
        os.close(fd)


@pytest.fixture
def brokers():
    made: list[CredentialBroker] = []

    def make(secrets_dir: Path, **kw) -> CredentialBroker:
        b = CredentialBroker({}, secrets_dir, environment={}, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def bobs_dir(path: Path, mode: int = 0o755) -> Path:
    path.mkdir(parents=True)
    os.chown(path, BOB, BOB)
    os.chmod(path, mode)
    return path


def sticky_dir(path: Path) -> Path:
    """Like /tmp or /dev/shm: root's, world-writable, sticky."""
    path.mkdir()
    os.chmod(path, 0o1777)
    return path


def refused(path: Path, mode: int = 0o711, setting: str = "secrets_dir") -> FailedPrecondition:
    with pytest.raises(FailedPrecondition) as exc:
        fd = ensure_private_dir(path, mode, setting=setting)
        os.close(fd)
    assert exc.value.field == setting
    assert exc.value.message.startswith(f"{setting}: ")
    return exc.value


def same_dir(fd: int, path: Path) -> bool:
    return hostdirs.same_inode(os.fstat(fd), os.stat(path, follow_symlinks=False))


# -------------------------------------------------------------------- ensure_private_dir

class TestEnsurePrivateDir:
    def test_makes_every_missing_component_whatever_the_umask(self, tmp_path, fds):
        target = tmp_path / "a" / "b" / "secrets"
        old = os.umask(0o077)
        try:
            fds.append(ensure_private_dir(target, 0o711, setting="secrets_dir"))
        finally:
            os.umask(old)
        assert same_dir(fds[0], target)
        assert stat.S_IMODE(target.stat().st_mode) == 0o711
        for parent in (tmp_path / "a", tmp_path / "a" / "b"):
            st = parent.stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)

    def test_an_existing_dir_of_the_daemon_gets_its_mode(self, tmp_path, fds):
        target = tmp_path / "state"
        target.mkdir(mode=0o755)
        fds.append(ensure_private_dir(target, 0o700, setting="state_dir"))
        assert stat.S_IMODE(target.stat().st_mode) == 0o700
        assert same_dir(fds[0], target)

    def test_a_shared_dir_is_checked_but_never_re_moded(self, tmp_path, fds):
        target = tmp_path / "run"
        target.mkdir()
        os.chmod(target, 0o751)
        fds.append(ensure_private_dir(target, 0o755, setting="socket_path", set_mode=False))
        assert stat.S_IMODE(target.stat().st_mode) == 0o751

    def test_below_a_sticky_world_writable_dir(self, tmp_path, fds):
        shm = sticky_dir(tmp_path / "shm")
        fds.append(ensure_private_dir(shm / "sandboxd-secrets", 0o711, setting="secrets_dir"))
        assert (shm / "sandboxd-secrets").stat().st_uid == 0

    def test_the_descriptor_stays_on_the_directory_checked(self, tmp_path, fds):
        target = tmp_path / "secrets"
        fd = ensure_private_dir(target, 0o711, setting="secrets_dir")
        fds.append(fd)
        st = os.fstat(fd)
        assert stat.S_ISDIR(st.st_mode)
        assert os.listdir(fd) == []
        assert fcntl_flags(fd) & os.O_CLOEXEC or not os.get_inheritable(fd)


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFD)


class TestPlanted:
    """Each way bob could prepare the place: refused, naming the setting, and nothing
    of his is changed."""

    def test_a_dir_bob_made_first_in_a_sticky_dir(self, tmp_path):
        # The finding: /dev/shm/sandboxd-secrets made by bob before the daemon started.
        planted = bobs_dir(sticky_dir(tmp_path / "shm") / "sandboxd-secrets", 0o755)
        exc = refused(planted)
        assert "uid 1001" in exc.reason and str(planted) in exc.reason
        st = planted.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (BOB, 0o755)  # not taken over

    @pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775, 0o733])
    def test_a_dir_of_the_daemon_writable_by_others(self, tmp_path, mode):
        planted = tmp_path / "secrets"
        planted.mkdir()
        os.chmod(planted, mode)
        exc = refused(planted)
        assert f"{mode:04o}" in exc.reason
        assert stat.S_IMODE(planted.stat().st_mode) == mode

    def test_a_symlink_to_a_dir_of_bob(self, tmp_path):
        target = bobs_dir(tmp_path / "bob", 0o777)
        link = sticky_dir(tmp_path / "shm") / "sandboxd-secrets"
        link.symlink_to(target)
        exc = refused(link)
        assert "symbolic link" in exc.reason
        assert stat.S_IMODE(target.stat().st_mode) == 0o777

    def test_a_symlink_even_to_a_dir_of_the_daemon(self, tmp_path):
        target = tmp_path / "real"
        target.mkdir(mode=0o711)
        link = tmp_path / "secrets"
        link.symlink_to(target)
        assert "symbolic link" in refused(link).reason

    def test_a_symlink_component_on_the_way(self, tmp_path):
        real_parent = tmp_path / "real"
        real_parent.mkdir()
        (tmp_path / "via").symlink_to(real_parent)
        exc = refused(tmp_path / "via" / "secrets")
        assert "symbolic link" in exc.reason and "on the way to" in exc.reason
        assert not (real_parent / "secrets").exists()

    def test_a_component_on_the_way_owned_by_bob(self, tmp_path):
        bob = bobs_dir(tmp_path / "bob", 0o755)
        exc = refused(bob / "secrets")
        assert "uid 1001" in exc.reason
        assert not (bob / "secrets").exists()

    def test_a_world_writable_component_without_the_sticky_bit(self, tmp_path):
        loose = tmp_path / "loose"
        loose.mkdir()
        os.chmod(loose, 0o777)
        (loose / "secrets").mkdir(mode=0o711)
        exc = refused(loose / "secrets")
        assert str(loose) in exc.reason and "0777" in exc.reason

    def test_a_regular_file_where_the_dir_goes(self, tmp_path):
        (tmp_path / "secrets").write_bytes(b"")
        assert "not a directory" in refused(tmp_path / "secrets").reason

    def test_bob_wins_the_race_between_look_and_mkdir(self, tmp_path, monkeypatch):
        shm = sticky_dir(tmp_path / "shm")
        target = shm / "sandboxd-secrets"
        real_mkdir = os.mkdir

        def mkdir(path, *args, **kw):
            if os.path.basename(os.fspath(path)) == "sandboxd-secrets" and not os.path.lexists(target):
                real_mkdir(target)  # made by bob just before the daemon's mkdir
                os.chown(target, BOB, BOB)
                os.chmod(target, 0o777)
            real_mkdir(path, *args, **kw)

        monkeypatch.setattr(os, "mkdir", mkdir)
        assert "uid 1001" in refused(target).reason

    @pytest.mark.parametrize("path, why", [("relative/secrets", "absolute"), ("/tmp/../etc", "'..'"),
                                           ("/tmp/a\0b", "NUL"), ("/", "/ cannot")])
    def test_paths_that_are_never_accepted(self, path, why):
        assert why in refused(Path(path) if "\0" not in path else path).reason  # type: ignore[arg-type]


# -------------------------------------------------------------------- check_daemon_dirs

def settings_under(tmp_path: Path, **over) -> DaemonSettings:
    data = {"state_dir": tmp_path / "state", "runtime_dir": tmp_path / "runtime", "secrets_dir": tmp_path / "secrets",
            "socket_path": tmp_path / "run" / "sandboxd.sock", "workspace_roots": [tmp_path / "ws"],
            "egress": {"socket_dir": str(tmp_path / "egress")}, "nsjail": {"rootfs_dir": str(tmp_path / "rootfs")}}
    data.update(over)
    return DaemonSettings.model_validate(data)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


class TestCheckDaemonDirs:
    def test_every_dir_is_made_and_held(self, tmp_path):
        s = settings_under(tmp_path)
        got = check_daemon_dirs(s)
        try:
            assert set(got) == {"state_dir", "runtime_dir", "socket_path", "egress.socket_dir", "nsjail.rootfs_dir"}
            paths = {"state_dir": s.state_dir, "runtime_dir": s.runtime_dir,
                     "socket_path": s.socket_path.parent, "egress.socket_dir": s.egress.socket_dir,
                     "nsjail.rootfs_dir": s.nsjail.rootfs_dir}
            for name, fd in got.items():
                assert same_dir(fd, paths[name]), name
            modes = {name: stat.S_IMODE(p.stat().st_mode) for name, p in paths.items()}
            assert modes == {"state_dir": 0o700, "runtime_dir": 0o711, "socket_path": 0o755,
                             "egress.socket_dir": 0o711, "nsjail.rootfs_dir": 0o755}
        finally:
            for fd in got.values():
                os.close(fd)

    def test_disabled_parts_are_not_looked_at(self, tmp_path):
        s = settings_under(tmp_path, egress={"enabled": False, "socket_dir": str(tmp_path / "egress")},
                           nsjail={"enabled": False})
        got = check_daemon_dirs(s)
        for fd in got.values():
            os.close(fd)
        assert "egress.socket_dir" not in got and "nsjail.rootfs_dir" not in got
        assert not (tmp_path / "egress").exists()

    @pytest.mark.parametrize("setting", ["state_dir", "runtime_dir", "egress.socket_dir"])
    def test_a_planted_dir_refuses_and_closes_what_was_opened(self, tmp_path, setting):
        planted = bobs_dir(tmp_path / "planted", 0o755)
        key, _, sub = setting.partition(".")
        over = {key: {"socket_dir": str(planted)}} if sub else {key: planted}
        s = settings_under(tmp_path, **over)
        before = open_fds()
        with pytest.raises(FailedPrecondition) as exc:
            check_daemon_dirs(s)
        assert exc.value.field == setting and "uid 1001" in exc.value.reason
        assert open_fds() == before


# -------------------------------------------------------------------- the secrets dir

class TestSecretsDir:
    def test_the_defaults_are_below_no_directory_another_user_may_write_in(self):
        s = DaemonSettings()
        assert s.secrets_dir is None and s.secrets_path == s.runtime_dir / "secrets"
        for path in (s.state_dir, s.runtime_dir, s.secrets_path, s.egress.socket_dir, s.nsjail.rootfs_dir):
            assert not any(part in ("tmp", "shm") for part in path.parts), path

    def test_an_operators_tmpfs_is_used_as_it_is(self, fds):
        path = Path("/dev/shm") / f"sandboxd-unit-{os.getpid()}"
        try:
            fd, mounted = open_secrets_dir(path, daemon_mounts=False)
            fds.append(fd)
            assert not mounted and same_dir(fd, path) and stat.S_IMODE(path.stat().st_mode) == 0o711
        finally:
            os.rmdir(path)

    def test_an_operators_dir_on_a_disk_is_refused_and_closed(self, tmp_path):
        before = open_fds()
        with pytest.raises(FailedPrecondition) as exc:
            open_secrets_dir(tmp_path / "secrets", daemon_mounts=False)
        assert exc.value.field == "secrets_dir" and "not a tmpfs" in exc.value.reason
        assert open_fds() == before

    def test_a_planted_dir_is_refused_before_anything_is_mounted(self, tmp_path):
        planted = bobs_dir(tmp_path / "planted", 0o755)
        before = open_fds()
        with pytest.raises(FailedPrecondition) as exc:
            open_secrets_dir(planted, daemon_mounts=True)
        assert exc.value.field == "secrets_dir" and "uid 1001" in exc.value.reason
        assert open_fds() == before and not os.path.ismount(planted)


# -------------------------------------------------------------------- memory filesystems

class TestMemoryFilesystem:
    def test_dev_shm_is_a_tmpfs(self, fds):
        fds.append(os.open("/dev/shm", os.O_RDONLY | os.O_DIRECTORY))
        assert filesystem_type(fds[-1]) == "tmpfs"
        require_memory_filesystem(fds[-1], "/dev/shm", setting="secrets_dir")

    def test_a_disk_is_refused(self, fds):
        fds.append(os.open("/", os.O_RDONLY | os.O_DIRECTORY))
        kind = filesystem_type(fds[-1])
        assert kind and kind not in ("tmpfs", "ramfs")  # this host's root is a disk
        with pytest.raises(FailedPrecondition) as exc:
            require_memory_filesystem(fds[-1], "/", setting="secrets_dir")
        assert exc.value.field == "secrets_dir" and kind in exc.value.reason

    def test_the_broker_can_insist_on_a_tmpfs(self, tmp_path, brokers):
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        on_disk = filesystem_type(fd) not in ("tmpfs", "ramfs")
        os.close(fd)
        assert on_disk, "pytest's tmp_path is expected on a disk here"
        with pytest.raises(FailedPrecondition) as exc:
            brokers(tmp_path / "secrets", require_memory_fs=True)
        assert exc.value.field == "secrets_dir"


# -------------------------------------------------------------------- the broker

SECRET = (ResolvedSecret("gh", b"alice-real-secret", file_path="/tmp/key"),)


class TestBrokerRefusesPlantedSecretsDir:
    def test_a_secrets_dir_bob_made_first(self, tmp_path, brokers):
        planted = bobs_dir(sticky_dir(tmp_path / "shm") / "sandboxd-secrets", 0o755)
        with pytest.raises(FailedPrecondition) as exc:
            brokers(planted)
        assert exc.value.field == "secrets_dir" and "uid 1001" in exc.value.reason
        assert stat.S_IMODE(planted.stat().st_mode) == 0o755  # not made the daemon's

    def test_a_secrets_dir_with_loose_modes(self, tmp_path, brokers):
        loose = tmp_path / "secrets"
        loose.mkdir()
        os.chmod(loose, 0o777)
        with pytest.raises(FailedPrecondition) as exc:
            brokers(loose)
        assert exc.value.field == "secrets_dir"

    def test_a_symlink_to_a_dir_of_bob(self, tmp_path, brokers):
        target = bobs_dir(tmp_path / "bob", 0o777)
        (tmp_path / "secrets").symlink_to(target)
        with pytest.raises(FailedPrecondition):
            brokers(tmp_path / "secrets")

    def test_a_symlink_on_the_way(self, tmp_path, brokers):
        target = bobs_dir(tmp_path / "bob", 0o777)
        (tmp_path / "via").symlink_to(target)
        with pytest.raises(FailedPrecondition):
            brokers(tmp_path / "via" / "secrets")
        assert not (target / "secrets").exists()


class TestBrokerPerSandboxDirs:
    def test_a_sandbox_dir_bob_made_first_gets_nothing(self, tmp_path, brokers):
        b = brokers(tmp_path / "secrets")
        planted = bobs_dir(tmp_path / "secrets" / "sbx-1", 0o777)
        (planted / "0").write_bytes(BOB_VALUE)
        with pytest.raises(OSError):
            b.materialize("sbx-1", SECRET, SANDBOX_UID, SANDBOX_GID)
        assert (planted / "0").read_bytes() == BOB_VALUE
        assert sorted(os.listdir(planted)) == ["0"]

    def test_a_swap_between_mkdir_and_open_writes_nothing_into_bobs_dir(self, tmp_path, brokers, monkeypatch):
        b = brokers(tmp_path / "secrets")
        base = tmp_path / "secrets" / "sbx-1"

        def swap(_path):
            os.rename(base, tmp_path / "moved")
            bobs_dir(base, 0o777)

        after_mkdir(monkeypatch, "sbx-1", swap)
        with pytest.raises(FailedPrecondition):
            b.materialize("sbx-1", SECRET, SANDBOX_UID, SANDBOX_GID)
        assert os.listdir(base) == []  # bob's: nothing of alice's secret
        assert os.listdir(tmp_path / "moved") == []

    def test_a_swap_while_the_files_are_written_leaves_nothing(self, tmp_path, brokers, monkeypatch):
        import sandboxd.secrets.broker as credentials

        b = brokers(tmp_path / "secrets")
        base = tmp_path / "secrets" / "sbx-1"
        real_write = credentials._write_secret

        def swap_then_write(*args):
            if not (tmp_path / "moved").exists():
                os.rename(base, tmp_path / "moved")
                bobs_dir(base, 0o777)
            real_write(*args)

        monkeypatch.setattr(credentials, "_write_secret", swap_then_write)
        with pytest.raises(FailedPrecondition):
            b.materialize("sbx-1", SECRETS, SANDBOX_UID, SANDBOX_GID)
        assert os.listdir(base) == []
        assert os.listdir(tmp_path / "moved") == []  # what was written went with the failure

    def test_a_secrets_dir_replaced_after_start_up_is_refused(self, tmp_path, brokers):
        b = brokers(tmp_path / "secrets")
        os.rename(tmp_path / "secrets", tmp_path / "old")
        bobs_dir(tmp_path / "secrets", 0o777)
        with pytest.raises(FailedPrecondition) as exc:
            b.materialize("sbx-1", SECRET, SANDBOX_UID, SANDBOX_GID)
        assert "replaced" in exc.value.reason
        assert os.listdir(tmp_path / "secrets") == [] and os.listdir(tmp_path / "old") == []

class TestBrokerRelease:
    def test_nothing_of_the_secret_outlives_release(self, tmp_path, brokers):
        b = brokers(tmp_path / "secrets")
        b.materialize("sbx-1", SECRETS, SANDBOX_UID, SANDBOX_GID)
        # The engines bind these by path: every directory on the way is root's and
        # writable by nobody else, so no name in it can be swapped.
        for m in b.mounts("sbx-1", SECRETS):
            path = Path(m.host_path)
            for d in (path.parent, path.parent.parent):
                st = os.lstat(d)
                assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0
                assert not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            st = os.lstat(path)
            assert stat.S_ISREG(st.st_mode) and (st.st_uid, stat.S_IMODE(st.st_mode)) == (SANDBOX_UID, 0o400)
        # A descriptor (or a bind mount still up) on a file keeps its inode: it must
        # hold nothing any more.
        held = [os.open(m.host_path, os.O_RDONLY) for m in b.mounts("sbx-1", SECRETS)]
        try:
            b.release("sbx-1")
            assert not (tmp_path / "secrets" / "sbx-1").exists()
            for fd in held:
                assert os.pread(fd, 100, 0) == b""
        finally:
            for fd in held:
                os.close(fd)

    def test_release_through_a_planted_symlink_touches_nothing_outside(self, tmp_path, brokers):
        b = brokers(tmp_path / "secrets")
        outside = bobs_dir(tmp_path / "bob", 0o755)
        (outside / "keep").write_bytes(b"keep")
        (tmp_path / "secrets" / "sbx-1").symlink_to(outside)
        b.release("sbx-1")
        assert (outside / "keep").read_bytes() == b"keep"
        assert not os.path.lexists(tmp_path / "secrets" / "sbx-1")

    @pytest.mark.parametrize("bad", ["../victim", "..", "sbx-1/..", ""])
    def test_release_of_a_name_that_is_no_sandbox_id_never_raises_nor_escapes(self, tmp_path, brokers, bad):
        b = brokers(tmp_path / "secrets")
        b.materialize("sbx-1", SECRET, SANDBOX_UID, SANDBOX_GID)
        victim = tmp_path / "victim"
        victim.mkdir()
        (victim / "keep").write_bytes(b"keep")
        b.release(bad)
        assert (victim / "keep").read_bytes() == b"keep"
        assert (tmp_path / "secrets" / "sbx-1" / "0").read_bytes() == SECRET[0].value

    def test_release_logs_and_never_raises(self, tmp_path, brokers, caplog, monkeypatch):
        b = brokers(tmp_path / "secrets")
        b.materialize("sbx-1", SECRETS, SANDBOX_UID, SANDBOX_GID)

        def no_rmdir(*_a, **_kw):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "rmdir", no_rmdir)
        b.release("sbx-1")  # no exception
        monkeypatch.undo()
        assert "removing the secrets of sbx-1 failed" in caplog.text
        assert "alice" not in caplog.text and "ghp_token" not in caplog.text
        assert os.listdir(tmp_path / "secrets" / "sbx-1") == []  # the files went all the same
