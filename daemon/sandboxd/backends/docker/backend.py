"""DockerBackend: one container per sandbox, through the Docker SDK's low-level API.
The command's stdout and stderr are FIFOs the daemon reads directly (the shim opens
them before it execs the command): the engine's own copy of container output
(containerd-shim to dockerd to the attach socket) costs about as much CPU as everything
else of a 200 MB stream together. The attach socket (log driver off: json-file logging
cuts throughput several-fold) still carries stdin and whatever runs before the shim
hands over. Docker SDK exceptions are translated in errors.py and nowhere else."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import socket
import subprocess
import threading
import time
from dataclasses import replace
from collections.abc import Iterable
from typing import Any

from sandboxd.backends import backstop, staging
from sandboxd.backends.cgroups import cgroup_usage, oom_kills_in
from sandboxd.backends.oom_guard import OomGuard
from sandboxd.backends.docker.compile import (CGROUP_DRIVERS, CgroupDriver, DockerSpec, cgroup_dir_for,
                                              compile_docker, sandbox_slice)
from sandboxd.backends.docker.errors import CONFLICT, NOT_FOUND, EngineRefused, dockerd
from sandboxd.backends.docker.output import (WRITER_GRACE_S, frame_size_needed, make_stdio_fifos, open_stdio_fifos,
                                             parse_frames, pump_fifos, remove_stdio_fifos)
from sandboxd.core.hostfacts import CGROUP_ROOT
from sandboxd.sandbox.signals import signal_name
from sandboxd.core.errors import BackendUnavailable, FailedPrecondition, InternalError, SandboxdError
from sandboxd.core import assets
from sandboxd.policy.models import BASE_ENV_NAMES, EffectivePolicy
from sandboxd.policy.preflight import HostPlan
from sandboxd.sandbox.output import OutputSpool
from sandboxd.sandbox.protocol import ExitStatus, ResourceUsage, SandboxHandle
from sandboxd.sandbox.spec import LABEL_PREFIX, Attachments, SandboxIdentity, is_warm_sandbox

__all__ = ["DockerBackend", "WRITER_GRACE_S", "create_args", "frame_size_needed", "host_config_args",
           "load_seccomp_profile", "make_stdio_fifos", "open_stdio_fifos", "parse_frames", "pump_fifos",
           "remove_stdio_fifos"]

log = logging.getLogger("sandboxd.docker")
_RECV_BYTES = 4 << 20


def create_args(spec: DockerSpec) -> dict[str, Any]:
    """Container-config part of the create call (pure)."""
    return {
        "image": spec.image,
        # The argv alone (the shim first): an image's ENTRYPOINT would run before the shim,
        # so before the file-access watch, and nsjail never runs it. [""] clears it.
        "entrypoint": [""],
        "command": list(spec.argv),
        "user": spec.user,
        "working_dir": spec.working_dir,
        "environment": dict(spec.env),
        "labels": dict(spec.labels),
        "name": spec.name,
        "hostname": spec.hostname,
        "stdin_open": spec.stdin_open,
        "tty": False,
    }


def check_image_env(image: str, env: Iterable[str]) -> None:
    """Docker adds an image's ENV to every container's environment, and no API call
    takes it away: a sandbox's environment would no longer be exactly its policy's (an
    image could set LD_PRELOAD), and differ from nsjail's. An image setting anything the
    base environment does not set over is refused by name (pure)."""
    extra = sorted({entry.partition("=")[0] for entry in env} - set(BASE_ENV_NAMES))
    if extra:
        raise FailedPrecondition(f"image {image!r} sets {', '.join(extra)} in its ENV, which Docker would add to "
                                 f"every sandbox's environment: only {', '.join(BASE_ENV_NAMES)} (which every "
                                 "call sets itself) are allowed; build the image without them", field="runtime.image")


def host_config_args(spec: DockerSpec, seccomp_json: str) -> dict[str, Any]:
    """Host-config part of the create call (pure; SDK types are built by the caller)."""
    return {
        "mounts": [
            {
                "Type": m.type,
                "Target": m.target,
                "ReadOnly": m.read_only,
                **({"Source": m.source, "BindOptions": {"Propagation": "rprivate"}} if m.type == "bind" else {}),
                **({"TmpfsOptions": {"SizeBytes": m.tmpfs_size_bytes, "Mode": m.tmpfs_mode}} if m.type == "tmpfs" else {}),
            }
            for m in spec.mounts
        ],
        "network_mode": spec.network_mode,
        "read_only": spec.read_only_rootfs,
        "cap_drop": list(spec.cap_drop),
        "security_opt": (["no-new-privileges:true"] if spec.no_new_privileges else []) + [f"seccomp={seccomp_json}"],
        "init": spec.init,
        "mem_limit": spec.memory_bytes,
        "memswap_limit": spec.memory_bytes,  # equal: no swap
        "pids_limit": spec.pids_limit,
        "nano_cpus": spec.nano_cpus,
        "ulimits": [{"Name": n, "Soft": s, "Hard": h} for n, s, h in spec.ulimits],
        "cgroup_parent": spec.cgroup_parent,
        "log_config": {"Type": "none", "Config": {}},
        "ipc_mode": "private",
    }


def remove_cgroup(rel: str, slice_unit: str | None = None) -> None:
    """Removes a sandbox's parent cgroup (relative to the hierarchies' root) in every
    hierarchy: dockerd leaves it behind. Under the systemd driver it is `slice_unit`,
    which systemd keeps active until it is stopped (its directory goes with it)."""
    if slice_unit is not None:
        _stop_slice(slice_unit)
    for path in sorted(glob.glob(f"{CGROUP_ROOT}/*/{rel}") + glob.glob(f"{CGROUP_ROOT}/{rel}"), key=len, reverse=True):
        for child in sorted(glob.glob(f"{path}/*/"), key=len, reverse=True):
            try:
                os.rmdir(child)
            except OSError:
                pass
        try:
            os.rmdir(path)
        except OSError:
            pass


def _stop_slice(unit: str) -> None:
    try:
        proc = subprocess.run(["systemctl", "stop", "--no-block", unit], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("cannot stop the sandbox's slice %s: %s", unit, exc)
        return
    if proc.returncode != 0:
        log.warning("cannot stop the sandbox's slice %s: %s", unit, proc.stderr.strip()[-300:])


# How often removals dockerd did not answer are tried again, and for how long.
REMOVAL_RETRY_S = 1.0
REMOVAL_GIVE_UP_S = 600.0


class DockerBackend:
    name = "docker"
    removal_retry_s = REMOVAL_RETRY_S
    removal_give_up_s = REMOVAL_GIVE_UP_S

    def __init__(self, docker_host: str | None, seccomp_path: str, mask_file: str, stdio_dir: str = ""):
        import docker  # heavy; only when this backend is used

        # Where each sandbox's output FIFOs live; "" reads output from the attach socket.
        self._stdio_dir = stdio_dir
        if stdio_dir:
            # Root's alone: a sandbox sees only its own directory, bound in.
            os.makedirs(stdio_dir, mode=0o700, exist_ok=True)
            os.chmod(stdio_dir, 0o700)
            for name in os.listdir(stdio_dir):  # before any call: an earlier run's
                remove_stdio_fifos(os.path.join(stdio_dir, name))

        self._docker_host = docker_host
        self._backstop: subprocess.Popen[bytes] | None = None
        self._pending_lock = threading.Lock()
        self._pending_removals: dict[str, float] = {}  # engine id -> when it was first tried
        self._remover: threading.Thread | None = None
        self._seccomp_name = os.path.basename(seccomp_path)
        self._seccomp_json = load_seccomp_profile(seccomp_path)
        self._mask_file = mask_file
        self._oom = OomGuard()
        self._cgroup_driver: CgroupDriver = "cgroupfs"  # dockerd's, as check() finds it
        with dockerd("make a client"):
            self._api: Any = docker.APIClient(base_url=docker_host or "unix:///var/run/docker.sock",
                                              version="auto", timeout=120)

    def start_backstop(self, daemon_id: str, staging_root: str) -> None:
        """Starts the watcher that enforces this daemon's containers' deadlines once the
        daemon is gone, then unmounts its staged roots (backstop.py). Its pipe is held,
        never written, until the end."""
        self._backstop = backstop.spawn(daemon_id, staging_root, self._docker_host)

    def close(self) -> None:
        """Lets go of the backstop's pipe: the watcher then does what it does once the
        daemon is gone (removes its overdue containers, unmounts its staged roots). A
        daemon that stops, or fails to start, closes it; one that dies, the kernel."""
        if self._backstop is not None and self._backstop.stdin is not None:
            self._backstop.stdin.close()

    def check(self) -> None:
        with dockerd("answer a ping", refusal=BackendUnavailable):
            self._api.ping()
            driver = str(self._api.info().get("CgroupDriver", ""))
        if driver not in CGROUP_DRIVERS:
            raise BackendUnavailable(f"dockerd's cgroup driver is {driver or 'unknown'}; the Docker backend places "
                                     f"sandboxes' cgroups under {' or '.join(CGROUP_DRIVERS)} only")
        self._cgroup_driver = "systemd" if driver == "systemd" else "cgroupfs"

    def _remove_cgroup(self, spec: DockerSpec) -> None:
        remove_cgroup(spec.cgroup_dir, spec.cgroup_parent if spec.cgroup_driver == "systemd" else None)

    def compile(self, policy: EffectivePolicy, plan: HostPlan, identity: SandboxIdentity, *,
                argv: tuple[str, ...], image: str, stdin_open: bool,
                attachments: Attachments | None = None) -> DockerSpec:
        attachments = attachments or Attachments()
        if self._stdio_dir and attachments.shim_host_path and not attachments.control_host_socket:
            attachments = replace(attachments, stdio_host_dir=os.path.join(self._stdio_dir, identity.sandbox_id))
        return compile_docker(policy, plan, identity, argv=argv, image=image, stdin_open=stdin_open,
                              mask_file=self._mask_file, seccomp_profile=self._seccomp_name,
                              attachments=attachments, cgroup_driver=self._cgroup_driver)

    def image_digest(self, image: str) -> str:
        return self.resolve_image(image)[0]

    def resolve_image(self, image: str) -> tuple[str, tuple[str, ...]]:
        with dockerd(f"inspect {image!r}", refusal=BackendUnavailable, image=image):
            info = self._api.inspect_image(image)
        check_image_env(image, (info.get("Config") or {}).get("Env") or ())
        return str(info["Id"]), tuple(info.get("RepoTags") or ())

    def create(self, spec: DockerSpec) -> SandboxHandle:
        sandbox_id = spec.labels[f"{LABEL_PREFIX}sandbox_id"]
        with contextlib.ExitStack() as undo:  # a half-made sandbox is unwound, in reverse
            undo.callback(self._release_host_parts, spec)
            if spec.staging is not None:
                staging.stage(spec.staging)  # dockerd is told only these paths, never the workspace's
            if spec.stdio_host_dir:
                uid, gid = (int(x) for x in spec.user.split(":"))
                make_stdio_fifos(spec.stdio_host_dir, uid, gid)
            undo.callback(self._remove_cgroup, spec)
            undo.callback(self._remove, spec.name)  # made even if dockerd's answer was lost
            with dockerd("create the sandbox"):
                host_config = self._api.create_host_config(**host_config_args(spec, self._seccomp_json))
                container = self._api.create_container(**create_args(spec), host_config=host_config)
            undo.pop_all()
        return SandboxHandle(sandbox_id=sandbox_id, engine_id=container["Id"], spec=spec)

    def start(self, handle: SandboxHandle, sink: OutputSpool, stdin: bytes) -> None:
        spec: DockerSpec = handle.spec
        with contextlib.ExitStack() as undo:
            # The read ends are open before the sandbox starts: the shim's opens never block.
            fifos = open_stdio_fifos(spec.stdio_host_dir) if spec.stdio_host_dir else {}
            for fd in fifos.values():
                undo.callback(os.close, fd)
            wake_r = wake_w = -1
            if fifos:
                wake_r, wake_w = os.pipe2(os.O_CLOEXEC)
                undo.callback(os.close, wake_r)
                undo.callback(os.close, wake_w)
            with dockerd("start the sandbox"):
                sock = self._api.attach_socket(handle.engine_id, params={
                    "stdin": 1 if spec.stdin_open else 0, "stdout": 1, "stderr": 1, "stream": 1})
                raw: socket.socket = getattr(sock, "_sock", sock)
                undo.callback(raw.close)
                self._api.start(handle.engine_id)
            undo.pop_all()  # the pumps' from here on
        self._watch_oom(handle)
        if fifos:
            threading.Thread(target=self._pump, args=(raw, sink, handle, wake_w), daemon=True,
                             name=f"attach-{handle.sandbox_id}").start()
            handle.reader = threading.Thread(target=pump_fifos, args=(fifos, wake_r, sink, handle), daemon=True,
                                             name=f"pump-{handle.sandbox_id}")
        else:
            handle.reader = threading.Thread(target=self._pump, args=(raw, sink, handle, -1), daemon=True,
                                             name=f"pump-{handle.sandbox_id}")
        handle.reader.start()
        if spec.stdin_open:
            threading.Thread(target=self._feed, args=(raw, stdin), daemon=True,
                             name=f"stdin-{handle.sandbox_id}").start()

    def _watch_oom(self, handle: SandboxHandle) -> None:
        """An OOM kill of any of its processes ends the whole container (oom_guard.py);
        not a warm sandbox's: that would end the lease's sandbox with its command."""
        if is_warm_sandbox(handle.spec.labels):
            return
        rel = handle.spec.container_cgroup_dir(handle.engine_id)
        v1 = f"{CGROUP_ROOT}/memory/{rel}"
        try:
            handle.unwatch_oom = self._oom.watch(v1 if os.path.isdir(v1) else f"{CGROUP_ROOT}/{rel}",
                                                 lambda: self.kill(handle))
        except OSError as exc:  # gone already (it ended at once); its end says if it was an OOM kill
            log.debug("no OOM watch for %s: %s", handle.sandbox_id, exc)

    @staticmethod
    def _feed(raw: socket.socket, data: bytes) -> None:
        try:
            raw.sendall(data)
            raw.shutdown(socket.SHUT_WR)  # EOF on the command's stdin
        except OSError:
            pass  # the command exited without reading all of it

    @staticmethod
    def _pump(raw: socket.socket, sink: OutputSpool, handle: SandboxHandle, wake_fd: int) -> None:
        """Frames from the attach socket into `sink` until the container's stdio ends;
        then output is closed, or (FIFOs) `wake_fd` tells their pump so."""
        buf = bytearray(_RECV_BYTES)
        view = memoryview(buf)
        end = 0
        try:
            while True:
                if end == len(buf):  # one frame larger than the buffer: grow it
                    view.release()
                    buf.extend(bytes(max(len(buf), frame_size_needed(buf) - len(buf))))
                    view = memoryview(buf)
                got = raw.recv_into(view[end:])
                if not got:
                    break
                end += got
                used = parse_frames(view[:end], sink)
                if used:
                    view[:end - used] = view[used:end]
                    end -= used
        except OSError as exc:
            log.warning("attach stream of %s broke: %s", handle.sandbox_id, exc)
        finally:
            view.release()
            try:
                raw.close()
            except OSError:
                pass
            if wake_fd >= 0:
                os.close(wake_fd)  # EOF on the FIFO pump's wake pipe
            else:
                handle.output_closed.set()

    def wait(self, handle: SandboxHandle, timeout_s: float) -> bool:
        return handle.output_closed.wait(max(0.0, timeout_s))

    def sandbox_pid(self, handle: SandboxHandle) -> int:
        """A host pid inside the running sandbox, 0 while there is none: one from the
        container's own cgroup (a file read; an inspect takes milliseconds), else its
        init as the engine reports it."""
        rel = handle.spec.container_cgroup_dir(handle.engine_id)
        for procs in (f"{CGROUP_ROOT}/pids/{rel}/cgroup.procs", f"{CGROUP_ROOT}/{rel}/cgroup.procs"):
            try:
                with open(procs) as f:
                    first = f.readline().strip()
            except OSError:
                continue
            if first.isdigit():
                return int(first)
        with dockerd("inspect the sandbox"):
            return int(self._api.inspect_container(handle.engine_id)["State"]["Pid"] or 0)

    def kill(self, handle: SandboxHandle) -> None:
        # SIGKILL to the container's init ends its whole PID namespace.
        try:
            with dockerd("kill the sandbox", refusal=None):
                self._api.kill(handle.engine_id)
        except EngineRefused as exc:
            if exc.status_code not in (NOT_FOUND, CONFLICT):  # gone, or not running any more
                raise InternalError(f"dockerd failed to kill the sandbox: {exc.explanation}") from None

    def collect(self, handle: SandboxHandle) -> tuple[ExitStatus, ResourceUsage]:
        handle.stop_oom_watch()
        with dockerd("report how the sandbox ended"):
            code = int(self._api.wait(handle.engine_id, timeout=30)["StatusCode"])
            state = self._api.inspect_container(handle.engine_id)["State"]
        # dockerd's flag, or the kernel's own count: dockerd learns of an OOM kill from an
        # event it may miss (cgroup v2, systemd's driver, a slow host); the sandbox's
        # cgroup counts every kill in it.
        oom_killed = bool(state.get("OOMKilled")) or oom_kills_in(handle.spec.cgroup_dir) > 0
        status = ExitStatus(exit_code=code, signal=signal_name(code), oom_killed=oom_killed)
        return status, cgroup_usage(handle.spec.cgroup_dir)

    def destroy(self, handle: SandboxHandle) -> None:
        handle.stop_oom_watch()
        self._remove(handle.engine_id)
        self._remove_cgroup(handle.spec)
        self._release_host_parts(handle.spec)

    def _remove(self, ref: str) -> None:
        """Removes the container now, or once dockerd answers again."""
        if not self._force_remove(ref):
            self._remove_later(ref)

    def _remove_later(self, engine_id: str) -> None:
        """dockerd did not answer (restarting): the container is removed once it does,
        by a thread that asks every REMOVAL_RETRY_S, not at the daemon's next start."""
        with self._pending_lock:
            self._pending_removals.setdefault(engine_id, time.monotonic())
            if self._remover is not None and self._remover.is_alive():
                return
            self._remover = threading.Thread(target=self._retry_removals, name="docker-removals", daemon=True)
            self._remover.start()

    def _retry_removals(self) -> None:
        while True:
            time.sleep(self.removal_retry_s)
            with self._pending_lock:
                pending = dict(self._pending_removals)
            done = {engine_id for engine_id in pending if self._force_remove(engine_id, quiet=True)}
            given_up = {engine_id for engine_id, since in pending.items()
                        if engine_id not in done and time.monotonic() - since > self.removal_give_up_s}
            for engine_id in given_up:  # the daemon's next start, or its backstop, removes it
                log.error("gave up removing container %s after %.0f s", engine_id, self.removal_give_up_s)
            with self._pending_lock:
                for engine_id in done | given_up:
                    self._pending_removals.pop(engine_id, None)
                if not self._pending_removals:
                    self._remover = None
                    return
            if done:
                log.info("removed %d sandboxes once dockerd answered again", len(done))

    def pending_removals(self) -> int:
        with self._pending_lock:
            return len(self._pending_removals)

    @staticmethod
    def _release_host_parts(spec: DockerSpec) -> None:
        remove_stdio_fifos(spec.stdio_host_dir)
        if spec.staging is not None:
            staging.release(spec.staging.directory)

    def _force_remove(self, ref: str, quiet: bool = False) -> bool:
        """Whether the container is gone (or going); False when dockerd did not answer
        (`quiet`: a retry, already said)."""
        try:
            with dockerd("remove a container", refusal=None):
                self._api.remove_container(ref, force=True, v=True)
        except EngineRefused as exc:
            if exc.status_code in (NOT_FOUND, CONFLICT):  # gone, or its removal already under way
                return True
            if not quiet:
                log.error("could not remove container %s: %s", ref, exc.explanation)
            return exc.status_code is None or exc.status_code < 500
        except BackendUnavailable as exc:
            if not quiet:
                log.warning("%s to the removal of %s: retried until it does", exc.reason, ref)
            return False
        return True

    def has_sandbox(self, sandbox_id: str) -> bool:
        """Whether any container of that sandbox exists (True when dockerd cannot say)."""
        try:
            with dockerd("list containers"):
                return bool(self._api.containers(all=True, quiet=True,
                                                 filters={"label": f"{LABEL_PREFIX}sandbox_id={sandbox_id}"}))
        except SandboxdError:  # in doubt, it exists
            return True

    def reap_orphans(self, daemon_id: str) -> int:
        with dockerd("list containers", refusal=BackendUnavailable):
            containers = self._api.containers(all=True, filters={"label": f"{LABEL_PREFIX}daemon_id={daemon_id}"})
        for c in containers:
            self._force_remove(c["Id"])
            sandbox_id = (c.get("Labels") or {}).get(f"{LABEL_PREFIX}sandbox_id")
            if sandbox_id:
                remove_cgroup(cgroup_dir_for(sandbox_id, self._cgroup_driver),
                              sandbox_slice(sandbox_id) if self._cgroup_driver == "systemd" else None)
        return len(containers)


def load_seccomp_profile(path: str) -> str:
    """The profile's JSON text (read by assets.read_seccomp_profile: opened once, never
    through a symlink nor blocking on a FIFO), validated; a missing or broken profile
    stops the daemon."""
    text = assets.read_seccomp_profile(path)
    try:
        json.loads(text)
    except ValueError as exc:
        raise BackendUnavailable(f"seccomp profile {path} is unusable: {exc}") from None
    return text
