"""A real sandboxd subprocess on a private socket, state dir and workspace root: what
the integration tests and the benchmarks run against. Not used by the daemon itself."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sandboxd_client import SandboxdClient

from sandboxd.api.server import serving
from sandboxd.core.mounts import unmount

SANDBOXD = str(Path(sys.executable).with_name("sandboxd"))
WORKSPACE_UID = 1000
_counter = itertools.count()

# Waits for a daemon are stretched by this factor on a slow host (the cgroup v2 guest,
# whose CPU is emulated): SANDBOXD_TEST_TIME_SCALE.
TIME_SCALE = float(os.environ.get("SANDBOXD_TEST_TIME_SCALE", "1"))
# The backends the tests run on. A host without Docker (the cgroup v2 guest) names only
# nsjail: its daemons then default to nsjail.
TEST_BACKENDS = [b for b in os.environ.get("SANDBOXD_TEST_BACKENDS", "docker,nsjail").split(",") if b]


@dataclass
class DaemonProcess:
    base: Path
    socket: Path
    state_dir: Path
    workspace_root: Path
    config: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    daemon_id: str = ""
    started_at: float = 0.0

    @property
    def log_path(self) -> Path:
        return self.base / "daemon.log"

    def start(self, timeout_s: float = 30.0) -> "DaemonProcess":
        timeout_s *= TIME_SCALE
        self.started_at = time.time()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([SANDBOXD, "--config", str(self.config)], env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandboxd exited with {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists() and self.healthy():
                self.daemon_id = (self.state_dir / "daemon_id").read_text().strip()
                return self
            time.sleep(0.05)
        raise RuntimeError(f"sandboxd did not become healthy:\n{self.log()}")

    def healthy(self) -> bool:
        return serving(self.socket)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # The secrets tmpfs the daemon mounts below its runtime dir: a killed daemon left
        # it (its next start would wipe and unmount it); a test's directories go after this.
        unmount(str(self.base / "runtime" / "secrets"))
        return self.proc.returncode

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def client(self) -> SandboxdClient:
        return SandboxdClient(str(self.socket))

    def new_workspace(self, files: dict[str, str] | None = None, uid: int = WORKSPACE_UID) -> Path:
        ws = self.workspace_root / f"ws{next(_counter)}"
        ws.mkdir(mode=0o750)
        for rel, content in (files or {}).items():
            p = ws / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(content)
        for dirpath, _dirnames, filenames in os.walk(ws):
            os.chown(dirpath, uid, uid)
            for n in filenames:
                os.chown(os.path.join(dirpath, n), uid, uid)
        return ws


def make_daemon(base: Path, env: dict[str, str] | None = None, **settings) -> DaemonProcess:
    """Writes a config under `base` (socket, state dir, one workspace root); call
    .start() to run it."""
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o755)
    root = base / "workspaces"
    root.mkdir(exist_ok=True)
    os.chmod(root, 0o755)
    d = DaemonProcess(base=base, socket=base / "run" / "sandboxd.sock", state_dir=base / "state",
                      workspace_root=root, config=base / "sandboxd.yaml",
                      env=dict(env or {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}))
    # The daemon's code from another tree (checking that a test fails on older code).
    if os.environ.get("SANDBOXD_TEST_DAEMON_PYTHONPATH"):
        d.env["PYTHONPATH"] = os.environ["SANDBOXD_TEST_DAEMON_PYTHONPATH"]
    config: dict[str, Any] = {
        "socket_path": str(d.socket),
        "state_dir": str(d.state_dir),
        "workspace_roots": [str(root)],
        "log_level": "INFO",
        # Tests never reach real DNS: every name the proxy may resolve is in `hosts`.
        "egress": {"socket_dir": str(base / "egress"), "system_dns": False},
        "runtime_dir": str(base / "runtime"),
    }
    config["egress"].update(settings.pop("egress", {}))
    if "docker" not in TEST_BACKENDS:
        config["default_backend"] = "nsjail"
    config.update(settings)
    d.config.write_text(yaml.safe_dump(octal_modes(config)))
    return d


def octal_modes(value: Any) -> Any:
    """`value` with every int under a `*_mode` key written as an octal string: the
    daemon refuses a mode spelled in decimal, which is how safe_dump writes ints."""
    if isinstance(value, dict):
        return {k: f"0o{v:o}" if str(k).endswith("_mode") and isinstance(v, int) and not isinstance(v, bool)
                else octal_modes(v) for k, v in value.items()}
    if isinstance(value, list):
        return [octal_modes(v) for v in value]
    return value


def prepared_call(workspace: Path, argv: list[str], policy: dict | None = None, **extra) -> dict:
    """A prepared call in its JSON form, with no authorization needed."""
    c = {
        "toolId": extra.pop("tool_id", "test.shell"),
        "toolVersion": "1",
        "argv": argv,
        "workspace": str(workspace),
        "authorization": {"status": "not_required"},
        "runtime": {"image": extra.pop("image", "sandboxd/default:latest")},
    }
    if policy is not None:
        c["policy"] = policy
    c.update(extra)
    return c


def wait_for(predicate, timeout_s: float = 5.0, interval_s: float = 0.01):
    """predicate()'s first true value within `timeout_s`, else its last (false) one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()


def timed_ms(fn, n: int, warmup: int = 2) -> list[float]:
    """Wall times of n calls of fn, in ms, after `warmup` untimed ones (for bench/)."""
    return timed_interleaved_ms({"": fn}, n, warmup)[""]


def timed_interleaved_ms(fns: dict[str, Callable[[], object]], n: int, warmup: int = 2) -> dict[str, list[float]]:
    """Wall times in ms of n calls of each fn, taken round by round (each path once per
    round) so that a slow spell of the machine lands on every path alike, not on the one
    that happened to be running (for bench/)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(n):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            out[name].append((time.perf_counter() - t) * 1000)
    return out

