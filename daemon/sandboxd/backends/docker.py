"""DockerBackend: one container per sandbox, through the Docker SDK's low-level API.
The command's stdout and stderr are FIFOs the daemon reads directly (the shim opens
them before it execs the command): the engine's own copy of container output
(containerd-shim to dockerd to the attach socket) costs about as much CPU as everything
else of a 200 MB stream together. The attach socket (log driver off: json-file logging
cuts throughput several-fold) still carries stdin and whatever runs before the shim
hands over. Docker SDK exceptions are translated here and nowhere else."""

from __future__ import annotations

import fcntl
import functools
import glob
import json
import logging
import os
import select
import shutil
import signal as signal_module
import socket
import subprocess
import threading
import time
from dataclasses import replace
from typing import Any

import requests

from ..compile import LABEL_PREFIX, Attachments, DockerSpec, SandboxIdentity, cgroup_parent_for, compile_docker
from ..errors import BackendUnavailable, FailedPrecondition, InternalError
from ..output import STDERR, STDOUT, OutputSpool
from . import CGROUP_ROOT, ExitStatus, ResourceUsage, SandboxHandle
from . import backstop, staging
from .cgroups import cgroup_usage

log = logging.getLogger("sandboxd.docker")
_RECV_BYTES = 4 << 20
_FIFO_READ_BYTES = 1 << 20
# How long output FIFOs stay open after their container has ended (pump_fifos).
WRITER_GRACE_S = 0.5


def create_args(spec: DockerSpec) -> dict[str, Any]:
    """Container-config part of the create call (pure)."""
    return {
        "image": spec.image,
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


def parse_frames(buf: bytes | bytearray | memoryview, sink: OutputSpool) -> int:
    """Writes every complete multiplexed frame of `buf` into `sink`; returns the number
    of bytes consumed. Frame: 1 byte stream, 3 zero bytes, 4 bytes big-endian size.
    Consecutive frames of one stream go to the sink as one write."""
    view = memoryview(buf)
    pos, end = 0, len(view)
    run_stream, run_parts = 0, []
    while end - pos >= 8:
        size = int.from_bytes(view[pos + 4:pos + 8], "big")
        if end - pos - 8 < size:
            break
        stream = STDERR if view[pos] == 2 else STDOUT
        if stream != run_stream and run_parts:
            sink.write_parts(run_stream, run_parts)
            run_parts = []
        run_stream = stream
        run_parts.append(view[pos + 8:pos + 8 + size])
        pos += 8 + size
    if run_parts:
        sink.write_parts(run_stream, run_parts)
    return pos


def frame_size_needed(buf: bytes | bytearray | memoryview) -> int:
    """Bytes the frame at the start of `buf` needs in all (0 if its header is incomplete)."""
    if len(buf) < 8:
        return 0
    return 8 + int.from_bytes(bytes(buf[4:8]), "big")


def _signal_name(exit_code: int) -> str:
    # Docker reports 128+N when the init's child died of signal N.
    if 128 < exit_code < 128 + 65:
        try:
            return signal_module.Signals(exit_code - 128).name
        except ValueError:
            return f"SIG{exit_code - 128}"
    return ""


def remove_cgroup(cgroup_parent: str) -> None:
    rel = cgroup_parent.strip("/")
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


def _engine_errors_are_unavailable(method):
    """dockerd gone or unreachable (connection refused, reset, timeouts) is
    BackendUnavailable, never a bare transport exception."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (requests.exceptions.RequestException, ConnectionError) as exc:
            raise BackendUnavailable(f"dockerd did not answer: {type(exc).__name__}") from None

    return wrapper


class DockerBackend:
    name = "docker"

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

        self._errors = docker.errors
        self._docker_host = docker_host
        self._backstop: subprocess.Popen | None = None
        self._seccomp_name = os.path.basename(seccomp_path)
        self._seccomp_json = load_seccomp_profile(seccomp_path)
        self._mask_file = mask_file
        try:
            self._api = docker.APIClient(base_url=docker_host or "unix:///var/run/docker.sock",
                                         version="auto", timeout=120)
        except docker.errors.DockerException as exc:
            raise BackendUnavailable(f"cannot reach dockerd: {exc}") from None

    def start_backstop(self, daemon_id: str) -> None:
        """Starts the watcher that enforces this daemon's containers' deadlines once the
        daemon is gone (backstop.py). Its pipe is held, never written, until the end."""
        self._backstop = backstop.spawn(daemon_id, self._docker_host)

    def check(self) -> None:
        try:
            self._api.ping()
        except Exception as exc:  # any transport failure means: no engine
            raise BackendUnavailable(f"dockerd does not answer: {exc}") from None

    def compile(self, policy, plan, identity: SandboxIdentity, *, argv: tuple[str, ...], image: str,
                stdin_open: bool, attachments=None) -> DockerSpec:
        attachments = attachments or Attachments()
        if self._stdio_dir and attachments.shim_host_path and not attachments.control_host_socket:
            attachments = replace(attachments, stdio_host_dir=os.path.join(self._stdio_dir, identity.sandbox_id))
        return compile_docker(policy, plan, identity, argv=argv, image=image, stdin_open=stdin_open,
                              mask_file=self._mask_file, seccomp_profile=self._seccomp_name,
                              attachments=attachments)

    @_engine_errors_are_unavailable
    def image_digest(self, image: str) -> str:
        return self.resolve_image(image)[0]

    def resolve_image(self, image: str) -> tuple[str, tuple[str, ...]]:
        try:
            info = self._api.inspect_image(image)
            return info["Id"], tuple(info.get("RepoTags") or ())
        except self._errors.ImageNotFound:
            raise FailedPrecondition(f"image {image!r} is not present in the local engine "
                                     "(nothing is pulled; build it with images/build.sh)", field="runtime.image") from None
        except self._errors.APIError as exc:
            raise BackendUnavailable(f"dockerd failed to inspect {image!r}: {exc.explanation}") from None

    @_engine_errors_are_unavailable
    def create(self, spec: DockerSpec) -> SandboxHandle:
        sandbox_id = spec.labels[f"{LABEL_PREFIX}sandbox_id"]
        try:
            if spec.staging is not None:
                staging.stage(spec.staging)  # dockerd is told only these paths, never the workspace's
            if spec.stdio_host_dir:
                uid, gid = (int(x) for x in spec.user.split(":"))
                make_stdio_fifos(spec.stdio_host_dir, uid, gid)
            host_config = self._api.create_host_config(**host_config_args(spec, self._seccomp_json))
            container = self._api.create_container(**create_args(spec), host_config=host_config)
        except self._errors.APIError as exc:
            self._force_remove(spec.name)
            remove_cgroup(spec.cgroup_parent)
            self._release_host_parts(spec)
            raise InternalError(f"dockerd refused the sandbox: {exc.explanation}") from None
        except BaseException:
            self._release_host_parts(spec)
            raise
        return SandboxHandle(sandbox_id=sandbox_id, engine_id=container["Id"], spec=spec)

    @_engine_errors_are_unavailable
    def start(self, handle: SandboxHandle, sink: OutputSpool, stdin: bytes) -> None:
        spec: DockerSpec = handle.spec
        # The read ends are open before the sandbox starts: the shim's opens never block.
        fifos = open_stdio_fifos(spec.stdio_host_dir) if spec.stdio_host_dir else {}
        wake_r = wake_w = -1
        raw: socket.socket | None = None
        try:
            if fifos:
                wake_r, wake_w = os.pipe2(os.O_CLOEXEC)
            sock = self._api.attach_socket(handle.engine_id, params={
                "stdin": 1 if spec.stdin_open else 0, "stdout": 1, "stderr": 1, "stream": 1})
            raw = getattr(sock, "_sock", sock)
            self._api.start(handle.engine_id)
        except BaseException as exc:
            for fd in (*fifos.values(), wake_r, wake_w):
                if fd >= 0:
                    os.close(fd)
            if raw is not None:
                raw.close()
            if isinstance(exc, self._errors.APIError):
                raise InternalError(f"dockerd failed to start the sandbox: {exc.explanation}") from None
            raise
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

    @_engine_errors_are_unavailable
    def sandbox_pid(self, handle: SandboxHandle) -> int:
        """A host pid inside the running sandbox, 0 while there is none: one from the
        container's own cgroup (a file read; an inspect takes milliseconds), else its
        init as the engine reports it."""
        rel = f"{handle.spec.cgroup_parent.strip('/')}/{handle.engine_id}"
        for procs in (f"{CGROUP_ROOT}/pids/{rel}/cgroup.procs", f"{CGROUP_ROOT}/{rel}/cgroup.procs"):
            try:
                with open(procs) as f:
                    first = f.readline().strip()
            except OSError:
                continue
            if first.isdigit():
                return int(first)
        return int(self._api.inspect_container(handle.engine_id)["State"]["Pid"] or 0)

    def kill(self, handle: SandboxHandle) -> None:
        # SIGKILL to the container's init ends its whole PID namespace.
        try:
            self._api.kill(handle.engine_id)
        except self._errors.NotFound:
            pass
        except self._errors.APIError as exc:
            if exc.status_code != 409:  # 409: not running any more
                raise InternalError(f"dockerd failed to kill the sandbox: {exc.explanation}") from None

    @_engine_errors_are_unavailable
    def collect(self, handle: SandboxHandle) -> tuple[ExitStatus, ResourceUsage]:
        try:
            code = int(self._api.wait(handle.engine_id, timeout=30)["StatusCode"])
            state = self._api.inspect_container(handle.engine_id)["State"]
        except self._errors.APIError as exc:
            raise InternalError(f"dockerd lost the sandbox: {exc.explanation}") from None
        status = ExitStatus(exit_code=code, signal=_signal_name(code), oom_killed=bool(state.get("OOMKilled")))
        return status, cgroup_usage(handle.spec.cgroup_parent)

    def destroy(self, handle: SandboxHandle) -> None:
        self._force_remove(handle.engine_id)
        remove_cgroup(handle.spec.cgroup_parent)
        self._release_host_parts(handle.spec)

    @staticmethod
    def _release_host_parts(spec: DockerSpec) -> None:
        remove_stdio_fifos(spec.stdio_host_dir)
        if spec.staging is not None:
            staging.release(spec.staging.directory)

    def _force_remove(self, ref: str) -> None:
        try:
            self._api.remove_container(ref, force=True, v=True)
        except self._errors.NotFound:
            pass
        except self._errors.APIError as exc:
            if exc.status_code != 409:  # removal already in progress
                log.error("could not remove container %s: %s", ref, exc.explanation)

    def has_sandbox(self, sandbox_id: str) -> bool:
        """Whether any container of that sandbox exists (True when dockerd cannot say)."""
        try:
            return bool(self._api.containers(all=True, quiet=True,
                                             filters={"label": f"{LABEL_PREFIX}sandbox_id={sandbox_id}"}))
        except Exception:  # noqa: BLE001 - in doubt, it exists
            return True

    @_engine_errors_are_unavailable
    def reap_orphans(self, daemon_id: str) -> int:
        containers = self._api.containers(all=True, filters={"label": f"{LABEL_PREFIX}daemon_id={daemon_id}"})
        for c in containers:
            self._force_remove(c["Id"])
            sandbox_id = (c.get("Labels") or {}).get(f"{LABEL_PREFIX}sandbox_id")
            if sandbox_id:
                remove_cgroup(cgroup_parent_for(sandbox_id))
        return len(containers)


def make_stdio_fifos(directory: str, uid: int, gid: int) -> None:
    """A sandbox's stdout and stderr FIFOs, which its user can write and not read. The directory is
    bound read-only into the sandbox, so they cannot be replaced or re-moded from it."""
    remove_stdio_fifos(directory)
    os.mkdir(directory, 0o711)
    for name in ("stdout", "stderr"):
        path = os.path.join(directory, name)
        os.mkfifo(path, 0o200)  # write-only: a command cannot read (steal) its own record
        os.chown(path, uid, gid)


def remove_stdio_fifos(directory: str) -> None:
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def open_stdio_fifos(directory: str) -> dict[int, int]:
    """{stream: read end}, non-blocking (an open for reading would wait for a writer),
    with a 1 MiB pipe where the kernel allows it (fewer wake-ups per megabyte)."""
    fds: dict[int, int] = {}
    try:
        for stream, name in ((STDOUT, "stdout"), (STDERR, "stderr")):
            fds[stream] = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                fcntl.fcntl(fds[stream], fcntl.F_SETPIPE_SZ, _FIFO_READ_BYTES)
            except OSError:
                pass
    except OSError as exc:
        for fd in fds.values():
            os.close(fd)
        raise InternalError(f"the sandbox's output pipes could not be opened: {exc.strerror}") from None
    return fds


def pump_fifos(fifos: dict[int, int], wake_fd: int, sink: OutputSpool, handle: SandboxHandle,
               grace_s: float = WRITER_GRACE_S) -> None:
    """Reads the output FIFOs into `sink` until every writer is gone and the container
    has ended (EOF on `wake_fd`, from the attach pump), then closes the output.

    A FIFO read returns 0 whenever no process holds a write end: before the shim opened
    it, and after the command and all its children closed it. poll() reports a hang-up
    only for the second, so a stream ends at a 0 read after poll said it was ready. Once
    the container has ended, what is left ends `grace_s` later whatever holds it: a
    stream no process ever opened, or one a process outside the container holds open
    (through /proc/<pid>/fd of the command, as the same uid): the call never waits on it."""
    streams = {fd: stream for stream, fd in fifos.items()}
    poller = select.poll()
    for fd in streams:
        poller.register(fd, select.POLLIN)
    poller.register(wake_fd, select.POLLIN)
    unstored = False  # a write to the spool failed (said once)

    def drain(fd: int) -> bool:
        """Reads what is there; True when the stream is over."""
        nonlocal unstored
        while True:
            try:
                data = os.read(fd, _FIFO_READ_BYTES)
            except BlockingIOError:
                return False  # a writer is still there
            except OSError as exc:
                log.warning("output pipe of %s broke: %s", handle.sandbox_id, exc)
                return True
            if not data:
                return True
            try:
                sink.write(streams[fd], data)
            except OSError as exc:  # e.g. the spool's disk is full: read on, never block the command
                if not unstored:
                    log.error("output of %s could not be stored: %s", handle.sandbox_id, exc)
                unstored = True

    def end(fd: int) -> None:
        poller.unregister(fd)
        os.close(fd)
        del streams[fd]

    try:
        deadline: float | None = None  # set once the container has ended
        while streams or deadline is None:
            if deadline is None:
                ready = poller.poll()
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    for fd in list(streams):
                        drain(fd)
                        end(fd)
                    break
                ready = poller.poll(left * 1000)
            for fd, _ in ready:
                if fd == wake_fd:
                    deadline = time.monotonic() + grace_s
                    poller.unregister(wake_fd)
                elif fd in streams and drain(fd):
                    end(fd)
    finally:
        for fd in streams:
            os.close(fd)
        os.close(wake_fd)
        handle.output_closed.set()


def load_seccomp_profile(path: str) -> str:
    """The profile's JSON text, validated; a missing or broken profile stops the daemon."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        json.loads(text)
    except (OSError, ValueError) as exc:
        raise BackendUnavailable(f"seccomp profile {path} is unusable: {exc}") from None
    return text
