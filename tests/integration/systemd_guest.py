"""Runs inside the systemd-booted cgroup v2 guest of test_systemd_unit.py, as root, with
the checkout's venv: starts dockerd (systemd's cgroup driver) and sandboxd through
deploy/systemd/sandboxd.service, runs calls on both backends, stops the unit, and
writes what it saw to RESULT (JSON) for the host's test to judge. It asserts nothing
itself: every observation is kept, so a failure shows the whole picture.

    systemd_guest.py EXCHANGE_DIR REPO"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

IMAGE = "sandboxd/busybox:latest"
CONFIG = Path("/etc/sandboxd/sandboxd.yaml")
UNIT_DIR = Path("/etc/systemd/system")
SOCKET = "/run/sandboxd/sandboxd.sock"
WORKSPACES = Path("/srv/sandboxd/workspaces")
CG = "/sys/fs/cgroup"
UNIT_CGROUP = f"{CG}/system.slice/sandboxd.service"
BACKENDS = ("docker", "nsjail")


def sh(command: str, timeout: float = 600) -> dict:
    t = time.monotonic()
    p = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=timeout)
    return {"rc": p.returncode, "out": p.stdout.strip()[-4000:], "err": p.stderr.strip()[-4000:],
            "s": round(time.monotonic() - t, 1)}


def install(repo: Path) -> None:
    CONFIG.parent.mkdir(parents=True, exist_ok=True)
    CONFIG.write_text(f"default_image: {IMAGE}\nallowed_images: [\"sandboxd/*\"]\n"
                      f"workspace_roots: [{WORKSPACES}]\n")
    (UNIT_DIR / "sandboxd.service").write_text((repo / "deploy/systemd/sandboxd.service").read_text())
    dropin = UNIT_DIR / "sandboxd.service.d"
    dropin.mkdir(parents=True, exist_ok=True)
    # The documented way to another layout: ExecStart= emptied, then set anew.
    (dropin / "checkout.conf").write_text(f"[Service]\nExecStart=\nExecStart={repo}/.venv/bin/sandboxd "
                                          f"--config {CONFIG}\n")
    ws = WORKSPACES / "demo"
    ws.mkdir(parents=True, exist_ok=True)
    (ws / "in.txt").write_text("from the workspace\n")
    for path in (ws, ws / "in.txt"):
        os.chown(path, 1000, 1000)


def unit_state() -> dict:
    shown = sh("systemctl show -p ActiveState -p SubState -p MainPID -p Result -p NRestarts sandboxd")["out"]
    return dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)


def cgroup_of(pid: int | str) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text().strip()
    except OSError as exc:
        return f"unreadable: {exc}"


def delegate_xattr(path: str) -> str:
    try:
        return os.getxattr(path, "trusted.delegate").decode()
    except OSError as exc:
        return f"none: {exc.strerror}"


def call(workspace: Path, backend: str, script: str, process: dict | None = None) -> dict:
    c = {"toolId": "guest", "toolVersion": "1", "argv": ["/bin/sh", "-c", script], "workspace": str(workspace),
         "authorization": {"status": "not_required"}, "runtime": {"image": IMAGE, "adapter": backend}}
    if process:
        c["policy"] = {"process": process}
    return c


def run(client, workspace: Path, backend: str, script: str, process: dict | None = None) -> dict:
    t = time.monotonic()
    try:
        out = client.run(call(workspace, backend, script, process), timeout_s=300)
    except Exception as exc:  # the observation is the failure
        return {"error": f"{type(exc).__name__}: {exc}", "s": round(time.monotonic() - t, 1)}
    r = out.result
    return {"status": r.status, "exit_code": r.exit_code, "signal": r.signal, "oom_killed": r.oom_killed,
            "stdout": out.stdout.decode(errors="replace")[-2000:], "stderr": out.stderr.decode(errors="replace")[-2000:],
            "error_code": r.error.code, "s": round(time.monotonic() - t, 1)}


def placement_while_running(client, workspace: Path, backend: str) -> dict:
    """Where a running call's processes are, seen from the host: the cgroup of the
    sandbox's `sleep`, found by its unique argument."""
    marker = {"docker": "7.25", "nsjail": "7.5"}[backend]
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(run(client, workspace, backend, f"sleep {marker}; echo ok")))
    thread.start()
    seen = ""
    deadline = time.monotonic() + 60
    while not seen and time.monotonic() < deadline:
        for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
            try:
                if Path(cmdline).read_bytes().split(b"\0")[:2] == [b"sleep", marker.encode()]:
                    seen = cgroup_of(cmdline.split("/")[2])
            except OSError:
                continue
        time.sleep(0.2)
    thread.join()
    return {"cgroup": seen, "call": done}


def calls(repo: Path, result: dict) -> None:
    sys.path[:0] = [str(repo / "client"), str(repo / "contract")]
    from sandboxd_client import SandboxdClient

    ws = WORKSPACES / "demo"
    with SandboxdClient(SOCKET) as client:
        for backend in BACKENDS:
            seen = result.setdefault(backend, {})
            seen["hello"] = run(client, ws, backend, "cat /workspace/in.txt; echo to-stderr >&2; exit 7")
            seen["placement"] = placement_while_running(client, ws, backend)
            # A memory eater (tail keeps its one endless line): the whole call is killed.
            seen["memory"] = run(client, ws, backend, "tail /dev/zero; echo parent-went-on",
                                 {"maxMemoryMb": 32, "timeoutMs": 120000})
            # At most 8 processes: the 9th fork fails.
            seen["pids"] = run(client, ws, backend, "i=0; while [ $i -lt 20 ]; do sleep 30 & i=$((i+1)); "
                                                    "echo started $i; done; echo all-started",
                               {"maxPids": 8, "timeoutMs": 120000})


def main() -> int:
    exchange, repo = Path(sys.argv[1]), Path(sys.argv[2])
    result: dict = {}
    try:
        result["docker_start"] = sh("systemctl start docker")
        result["docker_driver"] = sh("docker info --format '{{.CgroupDriver}} {{.CgroupVersion}}'")["out"]
        result["load"] = sh(f"docker load -i {exchange}/busybox.tar")
        install(repo)
        sh("systemctl daemon-reload")
        result["start"] = sh("systemctl start sandboxd", timeout=900)  # Type=notify: returns once READY=1
        state = unit_state()
        result["started"] = state
        result["main_cgroup"] = cgroup_of(state.get("MainPID", "0"))
        result["delegate"] = delegate_xattr(UNIT_CGROUP)
        result["unit_subtree_control"] = Path(f"{UNIT_CGROUP}/cgroup.subtree_control").read_text().strip()
        result["unit_procs"] = Path(f"{UNIT_CGROUP}/cgroup.procs").read_text().split()
        result["unit_children"] = sorted(os.listdir(UNIT_CGROUP))
        result["jails_top"] = sorted(p[len(UNIT_CGROUP):] for p in glob.glob(f"{UNIT_CGROUP}/sandboxes/*/*"))
        calls(repo, result)
        result["slices_before_stop"] = sh("systemctl list-units --all --plain --no-legend 'sandboxd-*.slice'")["out"]
        result["stop"] = sh("systemctl stop sandboxd", timeout=300)
        result["stopped"] = unit_state()
        time.sleep(2)  # the slices' --no-block stops
        result["after_stop"] = {
            "unit_cgroup_exists": os.path.exists(UNIT_CGROUP),
            "containers": sh("docker ps -aq --filter label=sandboxd.daemon_id")["out"],
            "slices": sh("systemctl list-units --all --plain --no-legend 'sandboxd-*.slice'")["out"],
            "slice_dirs": sorted(glob.glob(f"{CG}/sandboxd.slice/*.slice")),
            "top_level_jails": os.path.exists(f"{CG}/sandboxd-nsjail"),
        }
        result["journal"] = sh("journalctl -u sandboxd --no-pager -o cat | tail -40")["out"]
    except Exception:
        result["exception"] = traceback.format_exc()
        result["journal"] = sh("journalctl -u sandboxd --no-pager -o cat | tail -60")["out"]
    (exchange / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
