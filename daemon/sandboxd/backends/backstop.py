"""The Docker sandboxes' deadline when the daemon is gone. A container has no wall-clock
limit of its own (nsjail's jails do: time_limit), and the daemon's timeout dies with the
daemon: a command of a killed daemon ran on until the daemon came back. So each daemon
starts this watcher beside it, in a session of its own, holding a pipe the daemon never
writes. When the pipe closes (the daemon ended, however), the watcher removes every
container of that daemon that has ended, and each running one once its own deadline
has passed (its creation
time plus the limit in its `sandboxd.deadline_s` label). When none is left it unmounts
the daemon's staged workspace roots (staging.py; a jail still running keeps its own
copies) and exits; it exits at once when a daemon with the same id runs again (that
daemon reaps them itself).

Run as `python -m sandboxd.backends.backstop DAEMON_ID STAGING_ROOT [DOCKER_HOST]`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Any

from sandboxd.backends.hostlocks import daemon_running
from sandboxd.backends import staging

log = logging.getLogger("sandboxd.backstop")
DEADLINE_LABEL = "sandboxd.deadline_s"
POLL_S = 1.0


def spawn(daemon_id: str, staging_root: str, docker_host: str | None) -> subprocess.Popen[bytes]:
    """The watcher of this daemon's containers; the daemon keeps the returned process's
    stdin open for as long as it lives (and never writes to it)."""
    # -P and cwd "/": nothing of the directory the daemon was started from is importable
    # (the watcher imports the Docker SDK only once the daemon is gone, as root).
    argv = [sys.executable, "-P", "-m", "sandboxd.backends.backstop", daemon_id, staging_root] + (
        [docker_host] if docker_host else [])
    path = [p for p in sys.path if os.path.isabs(p)]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, cwd="/", start_new_session=True, close_fds=True)


def overdue(containers: list[dict[str, Any]], now: float) -> list[str]:
    """The ids of containers to remove now (pure): those that ended, and running ones
    past their deadline. (The daemon would have removed both.)"""
    out = []
    for c in containers:
        limit = (c.get("Labels") or {}).get(DEADLINE_LABEL, "")
        if not limit.isdigit():
            continue  # not one this daemon version labelled: left to its restart
        if c.get("State") != "running" or c.get("Created", now) + int(limit) <= now:
            out.append(c["Id"])
    return out


def watch(daemon_id: str, staging_root: str, docker_host: str | None) -> int:
    import docker  # heavy: only in the watcher's own process

    api = docker.APIClient(base_url=docker_host or "unix:///var/run/docker.sock", version="auto", timeout=30)
    while True:
        if daemon_running(daemon_id):
            return 0  # a new run of the daemon reaps what is left
        try:
            containers = api.containers(all=True, filters={"label": f"sandboxd.daemon_id={daemon_id}"})
        except Exception:  # noqa: BLE001 - dockerd restarting: ask again
            time.sleep(POLL_S)
            continue
        if not containers:
            if not daemon_running(daemon_id):
                staging.reap(staging_root)
            return 0
        for container_id in overdue(containers, time.time()):
            try:
                api.remove_container(container_id, force=True, v=True)
            except Exception:  # noqa: BLE001 - gone meanwhile, or dockerd restarting
                pass
        time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    daemon_id, staging_root, docker_host = argv[0], argv[1], (argv[2] if len(argv) > 2 else None)
    while sys.stdin.buffer.read(4096):  # until the daemon's end closes the pipe
        pass
    return watch(daemon_id, staging_root, docker_host)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
