"""dockerd restarts in the middle of a cold call, a leased command and a pool's refill:
the calls end (retryable), and the containers dockerd could not remove while it was
down are removed as soon as it answers again, not at the daemon's next start.

This test stops and starts the machine's dockerd (scripts/ensure-docker.sh)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from .conftest import call, sh, wait_for

REPO = Path(__file__).resolve().parents[2]


def restart_dockerd() -> None:
    pids = [int(p) for p in subprocess.run(["pidof", "dockerd"], capture_output=True, text=True).stdout.split()]
    assert pids, "no dockerd runs"
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    assert wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), timeout_s=60), \
        "dockerd did not stop"
    subprocess.run([str(REPO / "scripts" / "ensure-docker.sh")], check=True, stdin=subprocess.DEVNULL)


def _streamed(client, request) -> tuple[threading.Thread, dict, threading.Event]:
    outcome: dict = {}
    up = threading.Event()

    def consume():
        try:
            for event in client.execute(request):
                if event.WhichOneof("kind") == "output":
                    up.set()
                if event.WhichOneof("kind") == "finished":
                    outcome["result"] = event.finished.result
        except Exception as exc:  # noqa: BLE001 - what the caller saw is the outcome
            outcome["error"] = exc
        finally:
            up.set()

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    return t, outcome, up


def _not_running(docker_engine, d) -> list[str]:
    return [c["Names"][0] for c in docker_engine.api.containers(
        all=True, filters={"label": f"sandboxd.daemon_id={d.daemon_id}"}) if c["State"] != "running"]


def test_a_dockerd_restart_leaves_no_container_behind(spare_daemon, docker_engine):
    d = spare_daemon(pools={"min_idle": 1, "max_size": 2}).start()
    cold_ws, warm_ws = d.new_workspace(), d.new_workspace()
    with d.client() as c, d.client() as c2:
        lease = c.acquire_sandbox(str(warm_ws))
        leased = call(warm_ws, sh("echo up; sleep 300"))
        leased["runtime"].update({"leaseId": lease.lease_id, "adapter": "docker"})
        runs = [_streamed(c, call(cold_ws, sh("echo up; sleep 300"))), _streamed(c2, leased)]
        for _, outcome, up in runs:
            assert up.wait(30) and "error" not in outcome, outcome
        restart_dockerd()
        for t, outcome, _ in runs:
            t.join(60)
            result = outcome.get("result")
            assert result is not None and result.status == "error", outcome
        # What dockerd could not remove while it was down goes once it answers, and the
        # pool's refills that failed meanwhile left nothing either.
        deadline = time.monotonic() + 30
        while _not_running(docker_engine, d) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _not_running(docker_engine, d)
        assert not left, "\n".join([str(left)] + [line for line in d.log_path.read_text().splitlines()
                                 if any(x[len("/sandboxd-"):] in line for x in left) or "dockerd" in line or "pools" in line][-40:])
        assert wait_for(lambda: c.list_pools() and c.list_pools()[0].idle >= 1, timeout_s=60), "the pool never refilled"
        ok = c.run(call(cold_ws, ["echo", "after"]))
        assert ok.stdout == b"after\n"
    d.stop()
    assert not docker_engine.api.containers(all=True, filters={"label": f"sandboxd.daemon_id={d.daemon_id}"})
