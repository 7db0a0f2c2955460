"""Integration fixtures: a real sandboxd subprocess on a temporary socket, real dockerd,
real images. A missing engine or image is a failure, never a skip."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxd.testing import WORKSPACE_UID, DaemonProcess, make_daemon, prepared_call
from sandboxd_client import SandboxdClient

DEFAULT_IMAGE = "sandboxd/default:latest"
BUSYBOX_IMAGE = "sandboxd/busybox:latest"
DAEMON_SECRET = "sandboxd-daemon-secret-7f3a91"
DAEMON_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SANDBOXD_TEST_DAEMON_SECRET": DAEMON_SECRET,
              "LANG": "C.UTF-8", "TZ": "Europe/Berlin"}
__all__ = ["WORKSPACE_UID", "call", "sh", "wait_for", "sandbox_containers"]


def docker_client():
    import docker

    return docker.from_env(timeout=60)


@pytest.fixture(scope="session")
def docker_engine():
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


def sandbox_containers(client, daemon_id: str) -> list:
    return client.containers.list(all=True, filters={"label": f"sandboxd.daemon_id={daemon_id}"})


@pytest.fixture(scope="session")
def daemon(docker_engine, tmp_path_factory) -> Iterator[DaemonProcess]:
    d = make_daemon(tmp_path_factory.mktemp("sandboxd"), env=DAEMON_ENV, inheritable_env=["LANG", "TZ"],
                    limits={"max_timeout_ms": 120_000}).start()
    yield d
    d.stop()
    leftovers = sandbox_containers(docker_engine, d.daemon_id)
    for c in leftovers:
        c.remove(force=True)
    assert not leftovers, f"containers left behind: {[c.name for c in leftovers]}"


@pytest.fixture
def spare_daemon(docker_engine, tmp_path):
    """Daemons of the test's own, for tests that stop, kill or restrict them."""
    made: list[DaemonProcess] = []

    def factory(**settings) -> DaemonProcess:
        d = make_daemon(tmp_path / f"d{len(made)}", env=DAEMON_ENV, **settings)
        made.append(d)
        return d

    yield factory
    for d in made:
        d.stop(signal.SIGKILL)
        if d.daemon_id:
            for c in sandbox_containers(docker_engine, d.daemon_id):
                c.remove(force=True)


@pytest.fixture
def client(daemon) -> Iterator[SandboxdClient]:
    c = daemon.client()
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
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()
