"""Integration fixtures: a real sandboxd subprocess on a temporary socket, real dockerd,
real images. A missing engine or image is a failure, never a skip."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandboxd_testing as testing
from sandboxd.backends import staging
from sandboxd.backends.cgroups import detect
from sandboxd_testing import TEST_BACKENDS, WORKSPACE_UID, DaemonProcess, make_daemon, prepared_call
from sandboxd_client import SandboxdClient

from .guests import GUEST_MODULES, QUEUE

LAYOUT = detect()  # the host's cgroup layout, probed once for the tests

DEFAULT_IMAGE = "sandboxd/default:latest"
BUSYBOX_IMAGE = "sandboxd/busybox:latest"
DAEMON_SECRET = "sandboxd-daemon-secret-7f3a91"
DAEMON_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SANDBOXD_TEST_DAEMON_SECRET": DAEMON_SECRET,
              "LANG": "C.UTF-8", "TZ": "Europe/Berlin"}
__all__ = ["WORKSPACE_UID", "call", "sh", "wait_for", "sandbox_containers"]
# The backends the conformance suite runs on (SANDBOXD_TEST_BACKENDS).
BACKENDS = TEST_BACKENDS


def docker_client():
    import docker

    return docker.from_env(timeout=60)


@pytest.fixture(scope="session")
def docker_engine():
    if "docker" not in BACKENDS:
        yield None
        return
    try:
        client = docker_client()
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure here means no engine
        pytest.fail(f"dockerd is not reachable ({exc}); run `make docker` (scripts/ensure-docker.sh)")
    for image in (DEFAULT_IMAGE, BUSYBOX_IMAGE):
        try:
            client.images.get(image)
        except Exception:  # noqa: BLE001
            pytest.fail(f"image {image} is missing; run `make images`")
    yield client
    client.close()


def pytest_collection_modifyitems(items) -> None:
    """The qemu guests' tests last (guests.py): a failure of the host's own comes first."""
    items.sort(key=lambda item: item.path.name in GUEST_MODULES)  # stable: each group keeps its order


@pytest.fixture(scope="session")
def background_guests(request, docker_engine):
    """The selected tests' guests, started by the first test that waits for one (the
    guests' preparation exports and saves images with dockerd)."""
    modules = {item.path.name: item.module for item in request.session.items if item.path.name in GUEST_MODULES}
    for name in GUEST_MODULES:
        if name in modules:
            QUEUE.add(modules[name].GUEST)
    yield QUEUE
    QUEUE.stop()


def sandbox_containers(client, daemon_id: str) -> list:
    if client is None:  # no Docker on this host (SANDBOXD_TEST_BACKENDS)
        return []
    import docker

    # The SDK inspects each listed container: one removed in between (a pool's
    # sandbox being destroyed) is a 404 that only means "gone", so list again.
    for _ in range(20):
        try:
            return client.containers.list(all=True, filters={"label": f"sandboxd.daemon_id={daemon_id}"})
        except docker.errors.NotFound:
            time.sleep(0.05)
    return client.containers.list(all=True, filters={"label": f"sandboxd.daemon_id={daemon_id}"})


def remove_container(c) -> None:
    """Removed, or being removed by someone else (a killed daemon's backstop)."""
    import docker

    try:
        c.remove(force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as exc:
        if exc.status_code != 409:
            raise


def stop_and_clean(d: DaemonProcess, docker_engine, base: Path) -> None:
    """A module's own daemon at its end: stopped, every container of it removed, its
    directory gone; a sandbox it left behind fails the module."""
    d.stop()
    leftovers = leftover_sandboxes(docker_engine, d)
    for c in sandbox_containers(docker_engine, d.daemon_id):
        remove_container(c)
    shutil.rmtree(base, ignore_errors=True)
    assert not leftovers, f"sandboxes left behind: {leftovers}"


def public_tmpdir(prefix: str) -> Path:
    """A temporary directory every user may traverse: nsjail mounts as the sandbox user,
    so the workspaces' parents must be reachable by it (pytest's own are mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


def nsjail_leftovers(d: DaemonProcess) -> list[str]:
    """Jail cgroups of this daemon that still hold a process other than the daemon. A
    running daemon's spawn slots (".slot-*": an nsjail waiting for a config, no jail
    yet) are its own; once it has stopped, they must be empty too."""
    root = Path(LAYOUT.pids_dir(f"sandboxd-nsjail/{d.daemon_id}"))
    running = d.proc is not None and d.proc.poll() is None
    found = []
    for cg in root.glob("*/"):
        # (On cgroup v2 a sandbox keeps its slot's name, marked with its id.)
        if running and cg.name.startswith(".slot-") and not LAYOUT.marked(f"sandboxd-nsjail/{d.daemon_id}/{cg.name}"):
            continue
        try:
            pids = {int(p) for p in (cg / "cgroup.procs").read_text().split()}
        except OSError:
            continue
        if pids - {d.proc.pid if d.proc else -1}:
            found.append(LAYOUT.marked(f"sandboxd-nsjail/{d.daemon_id}/{cg.name}") or cg.name)
    return found


def nsjail_sandbox_ids(daemon_id: str) -> set[str]:
    """The sandboxes whose jail cgroups a daemon has now: named after them (cgroup v1),
    or a spawn slot's cgroup marked with their id (v2, where cgroups cannot be renamed)."""
    parent = f"sandboxd-nsjail/{daemon_id}"
    ids = set()
    for name in LAYOUT.children(parent):
        sandbox_id = LAYOUT.marked(f"{parent}/{name}") if name.startswith(".slot-") else name
        if sandbox_id:
            ids.add(sandbox_id)
    return ids


def kill_nsjail_leftovers(d: DaemonProcess) -> None:
    """After a daemon killed with SIGKILL: its jails' processes (a restart would reap them)."""
    import signal as _signal

    root = Path(LAYOUT.pids_dir(f"sandboxd-nsjail/{d.daemon_id}"))
    for cg in root.glob("*/"):
        try:
            pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                os.kill(pid, _signal.SIGKILL)
            except ProcessLookupError:
                pass


def leftover_sandboxes(docker_engine, d: DaemonProcess) -> list[str]:
    return [c.name for c in sandbox_containers(docker_engine, d.daemon_id)] + nsjail_leftovers(d)


@pytest.fixture(scope="session")
def daemon(docker_engine) -> Iterator[DaemonProcess]:
    base = public_tmpdir("sandboxd-it-")
    # LC_ALL: allowed, but not in the daemon's environment.
    d = make_daemon(base, env=DAEMON_ENV, inheritable_env=["LANG", "TZ", "LC_ALL"],
                    limits={"max_timeout_ms": 120_000}).start()
    yield d
    stop_and_clean(d, docker_engine, base)


@pytest.fixture
def spare_daemon(docker_engine):
    """Daemons of the test's own, for tests that stop, kill or restrict them."""
    made: list[DaemonProcess] = []
    base = public_tmpdir("sandboxd-spare-")

    def factory(**settings) -> DaemonProcess:
        d = make_daemon(base / f"d{len(made)}", env=DAEMON_ENV, **settings)
        made.append(d)
        return d

    yield factory
    for d in made:
        d.stop(signal.SIGKILL)
        if d.daemon_id:
            # A create the killed daemon had in flight may still land in dockerd: look
            # until two looks in a row find nothing.
            quiet = 0
            while quiet < 2:
                found = sandbox_containers(docker_engine, d.daemon_id)
                for c in found:
                    remove_container(c)
                quiet = 0 if found else quiet + 1
                time.sleep(0.3)
            kill_nsjail_leftovers(d)
        # A killed daemon's staged roots are binds of its workspaces: unmounted before
        # anything is removed (a removal through them would reach the workspaces).
        staging.reap(str(d.base / "runtime" / "mounts"))
    shutil.rmtree(base, ignore_errors=True)


class AdapterClient(SandboxdClient):
    """A client whose calls name one backend: the conformance suite runs every
    behaviour test through it once per backend."""

    def __init__(self, socket_path: str, adapter: str):
        super().__init__(socket_path)
        self.adapter = adapter

    def _on_backend(self, call):
        if isinstance(call, dict):
            call = {**call, "runtime": {**call.get("runtime", {})}}
            call["runtime"].setdefault("adapter", self.adapter)
        return call

    def execute(self, call, timeout_s=None):
        return super().execute(self._on_backend(call), timeout_s)

    def run(self, call, timeout_s=None):
        return super().run(self._on_backend(call), timeout_s)


@pytest.fixture(params=BACKENDS)
def client(daemon, request) -> Iterator[AdapterClient]:
    c = AdapterClient(str(daemon.socket), request.param)
    yield c
    c.close()


@pytest.fixture
def workspace(daemon) -> Path:
    return daemon.new_workspace({"README.md": "hello workspace\n", "src/app.py": "print('app')\n"})


def call(workspace, argv: list[str], policy: dict | None = None, **extra) -> dict:
    return prepared_call(workspace, argv, policy, **extra)


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.1):
    return testing.wait_for(predicate, timeout_s, interval_s)
