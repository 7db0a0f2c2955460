"""The installed wheels against the checkout: builds the three wheels
(scripts/build-wheels.sh), installs them into a fresh venv under /tmp (pip from the
local wheel files, their dependencies from the index), then runs two daemons side by
side, the checkout's (`.venv/bin/sandboxd`, the editable install) and the installed
venv's `sandboxd`, each started from a directory outside the checkout with the same
environment (no PYTHONPATH) and its own socket, state and runtime dirs. Both are timed
in the same run, interleaved call by call (ABAB..., BABA... in the next round):
a cold `true` on nsjail and on Docker (Execute on a fresh sandbox) and a leased `true`
on Docker and on nsjail (a warm sandbox's command). The client (this tree's) is the
same for both: what differs is the daemon. Prints medians, p90 and installed/checkout
per path, both as a ratio of medians and paired (the median of the rounds' ratios).

    .venv/bin/python bench/installed_wheel.py [-n 40] [--cold 2] [--leased 5] [--warmup 2] [--no-isolation]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(CHECKOUT / d) for d in ("daemon", "client", "contract", "testing")]

import docker  # noqa: E402

from sandboxd_client import SandboxdClient  # noqa: E402
from sandboxd_testing import DaemonProcess, make_daemon, prepared_call  # noqa: E402

IMAGE = "sandboxd/default:latest"
CHECKOUT_DAEMON = CHECKOUT / ".venv" / "bin" / "sandboxd"
ARMS = ("checkout", "installed")
# (row name, backend, leased?) in the order each round runs them.
PATHS = (("cold `true`, nsjail", "nsjail", False), ("cold `true`, Docker", "docker", False),
         ("leased `true`, Docker", "docker", True), ("leased `true`, nsjail", "nsjail", True))
LEASE_MS = 3_600_000  # the daemon's max_lease_s: no lease may run out during the bench


def outside_env() -> dict[str, str]:
    """The environment with nothing that leads back to the checkout (no PYTHONPATH,
    no VIRTUAL_ENV, no PATH entry inside it): what pip and the daemons run with."""
    path = [p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
            if p and not Path(p).resolve().is_relative_to(CHECKOUT)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP") and str(CHECKOUT) not in v}
    env["PATH"] = os.pathsep.join(path)
    return env


def daemon_env() -> dict[str, str]:
    """Both daemons get exactly this: the harness's minimal environment."""
    return {"PATH": outside_env()["PATH"], "LANG": "C.UTF-8"}


def step(what: str, argv: list[str], cwd: Path) -> float:
    """Runs one setup command outside the checkout; its seconds, or its output on failure."""
    t = time.monotonic()
    p = subprocess.run(argv, cwd=cwd, env=outside_env(), capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed ({p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return time.monotonic() - t


def install_wheels(work: Path, outside: Path, no_isolation: bool) -> Path:
    """The venv (under `work`) into which the freshly built wheels were installed."""
    wheels, venv = work / "wheels", work / "venv"
    build = [str(CHECKOUT / "scripts" / "build-wheels.sh"), str(wheels)] + (["--no-isolation"] if no_isolation else [])
    seconds = {"build": step("building the wheels", build, CHECKOUT)}
    # The base interpreter, not the dev venv's: the new venv must not see the checkout.
    base_python = Path(sys.base_prefix) / "bin" / "python3"
    seconds["venv"] = step("making the venv", [str(base_python), "-m", "venv", str(venv)], outside)
    seconds["pip"] = step("installing the wheels", [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                                                     "--disable-pip-version-check",
                                                     *map(str, sorted(wheels.glob("*.whl")))], outside)
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import sandboxd; print(sandboxd.__file__)"],
                           cwd=outside, env=outside_env(), capture_output=True, text=True, check=True)
    module = Path(probe.stdout.strip())
    if not module.is_relative_to(venv) or module.is_relative_to(CHECKOUT):
        raise RuntimeError(f"the venv's sandboxd is {module}, not the installed one")
    print("wheels: " + ", ".join(p.name for p in sorted(wheels.glob("*.whl"))))
    print("setup (s): " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    return venv


@dataclass
class Arm:
    """One daemon under test, with its client, workspace and a lease per backend."""

    name: str
    binary: Path
    daemon: DaemonProcess
    client: SandboxdClient
    requests: dict[str, dict] = field(default_factory=dict)


def start_daemon(binary: Path, d: DaemonProcess, cwd: Path, timeout_s: float = 60.0) -> None:
    """`binary --config` from `cwd`, in a session of its own (a Ctrl-C on the terminal
    reaches this script, which stops it in order), until it serves."""
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen([str(binary), "--config", str(d.config)], cwd=cwd, env=d.env, stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            raise RuntimeError(f"{binary} exited with {d.proc.returncode}:\n{d.log()}")
        if d.socket.exists() and d.healthy():
            d.daemon_id = (d.state_dir / "daemon_id").read_text().strip()
            return
        time.sleep(0.05)
    raise RuntimeError(f"{binary} did not become healthy:\n{d.log()}")


def stop_daemon(d: DaemonProcess, engine) -> None:
    """Stopped, every container labelled with its id removed, its directory gone."""
    try:
        d.stop()
    finally:
        if d.daemon_id:
            for c in engine.containers.list(all=True, filters={"label": f"sandboxd.daemon_id={d.daemon_id}"}):
                with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                    c.remove(force=True)
        shutil.rmtree(d.base, ignore_errors=True)


def open_arm(name: str, binary: Path, outside: Path, engine, cleanup: contextlib.ExitStack) -> Arm:
    base = Path(tempfile.mkdtemp(prefix=f"sandboxd-bench-wheel-{name}-", dir="/tmp"))
    base.chmod(0o755)  # nsjail mounts as the sandbox user: the workspace's parents must be traversable
    d = make_daemon(base, env=daemon_env(), pools={"min_idle": 1, "max_size": 3})
    cleanup.callback(stop_daemon, d, engine)
    start_daemon(binary, d, outside)
    arm = Arm(name, binary, d, d.client())
    cleanup.callback(arm.client.close)
    ws = d.new_workspace({"f": "x"})
    for row, backend, leased in PATHS:
        runtime = {"adapter": backend, "image": IMAGE}
        if leased:
            lease = arm.client.acquire_sandbox(str(ws), adapter=backend, image=IMAGE, lease_ms=LEASE_MS)
            runtime["leaseId"] = lease.lease_id
        arm.requests[row] = prepared_call(ws, ["true"], runtime=runtime)
    return arm


def settle_pools(arms: list[Arm], timeout_s: float = 60.0) -> None:
    """Until every pool has refilled its idle sandbox after the leases took theirs, so
    that no refill runs beside the timed calls."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(p.idle >= 1 for a in arms for p in a.client.list_pools()):
            return
        time.sleep(0.1)
    print("warning: a pool had not refilled its idle sandbox within the wait", file=sys.stderr)


def one_call_ms(arm: Arm, row: str) -> float:
    t = time.perf_counter()
    out = arm.client.run(arm.requests[row])
    ms = (time.perf_counter() - t) * 1000
    if out.result.status != "success" or out.result.exit_code != 0:
        raise RuntimeError(f"{arm.name}: {row} did not succeed: {out.result}")
    return ms


def measure(arms: list[Arm], rounds: int, calls: dict[bool, int],
            warmup: int) -> dict[tuple[str, str], list[list[float]]]:
    """{(arm, row): [each round's call times]}, `calls[leased]` calls of a path per arm
    and round. Each round runs the paths in order, every call on one arm and then on
    the other (ABAB...), the arms' order swapped every other round (BABA...): a slow
    spell of the machine falls on both alike."""
    samples: dict[tuple[str, str], list[list[float]]] = {(a.name, row): [] for a in arms for row, _, _ in PATHS}
    for r in range(-warmup, rounds):
        order = arms if r % 2 == 0 else arms[::-1]
        block: dict[tuple[str, str], list[float]] = {key: [] for key in samples}
        for row, _backend, leased in PATHS:
            for _ in range(calls[leased]):
                for arm in order:
                    block[(arm.name, row)].append(one_call_ms(arm, row))
        if r >= 0:  # the first rounds (an nsjail image root exported, first imports) are not counted
            for key, times in block.items():
                samples[key].append(times)
    return samples


def p90(values: list[float]) -> float:
    s = sorted(values)
    return s[max(0, -(-len(s) * 9 // 10) - 1)]


def report(samples: dict[tuple[str, str], list[list[float]]], args: argparse.Namespace) -> None:
    print(f"\ninstalled wheel against the checkout, {args.n} rounds (+{args.warmup} uncounted), "
          f"{args.cold} cold and {args.leased} leased calls per path, arm and round; times in ms\n")
    print("| path | checkout median | checkout p90 | installed median | installed p90 "
          "| installed/checkout | paired |")
    print("|---|---|---|---|---|---|---|")
    for row, _backend, _leased in PATHS:
        rounds = {a: samples[(a, row)] for a in ARMS}
        flat = {a: [t for block in rounds[a] for t in block] for a in ARMS}
        med = {a: statistics.median(flat[a]) for a in ARMS}
        paired = statistics.median(statistics.median(i) / statistics.median(c)
                                   for c, i in zip(rounds["checkout"], rounds["installed"]))
        print(f"| {row} | {med['checkout']:.2f} | {p90(flat['checkout']):.2f} | {med['installed']:.2f} | "
              f"{p90(flat['installed']):.2f} | {med['installed'] / med['checkout']:.2f}x | {paired:.2f}x |")


def files_mapped(pid: int, inside: Path) -> list[str]:
    """The files under `inside` that the process maps (its shared libraries)."""
    mapped = {line.split(None, 5)[5].strip() for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
              if len(line.split(None, 5)) == 6}
    return sorted(m for m in mapped if Path(m).is_relative_to(inside))


def check_provenance(arms: list[Arm], venv: Path) -> None:
    """After the calls (the helpers' libraries are loaded by then): the installed daemon
    maps nothing from the checkout and its relay library from the venv; the checkout's
    daemon maps its relay library from the checkout."""
    by_name = {a.name: a for a in arms}
    installed = by_name["installed"].daemon.proc
    checkout = by_name["checkout"].daemon.proc
    assert installed is not None and checkout is not None
    from_checkout = files_mapped(installed.pid, CHECKOUT)
    if from_checkout or not [m for m in files_mapped(installed.pid, venv) if m.endswith("libsandboxd-relay.so")]:
        raise RuntimeError(f"the installed daemon is not the venv's: it maps {from_checkout or 'no venv relay'}")
    if not [m for m in files_mapped(checkout.pid, CHECKOUT) if m.endswith("libsandboxd-relay.so")]:
        raise RuntimeError("the checkout's daemon does not map the checkout's relay library")


def interrupted(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cleanups, as a Ctrl-C does


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=40, help="counted rounds")
    ap.add_argument("--cold", type=int, default=2, help="cold calls per path, arm and round")
    ap.add_argument("--leased", type=int, default=5, help="leased calls per path, arm and round")
    ap.add_argument("--warmup", type=int, default=2, help="uncounted rounds first")
    ap.add_argument("--no-isolation", action="store_true", help="passed to scripts/build-wheels.sh")
    args = ap.parse_args()
    if min(args.n, args.cold, args.leased) < 1 or args.warmup < 0:
        ap.error("-n, --cold and --leased must be at least 1, --warmup at least 0")
    signal.signal(signal.SIGTERM, interrupted)
    engine = docker.from_env(timeout=120)
    with contextlib.ExitStack() as cleanup:
        work = Path(tempfile.mkdtemp(prefix="sandboxd-bench-wheel-", dir="/tmp"))
        cleanup.callback(shutil.rmtree, work, ignore_errors=True)
        outside = work / "cwd"
        outside.mkdir()
        venv = install_wheels(work, outside, args.no_isolation)
        arms = [open_arm("checkout", CHECKOUT_DAEMON, outside, engine, cleanup),
                open_arm("installed", venv / "bin" / "sandboxd", outside, engine, cleanup)]
        settle_pools(arms)
        t = time.monotonic()
        samples = measure(arms, args.n, {False: args.cold, True: args.leased}, args.warmup)
        print(f"measured in {time.monotonic() - t:.1f} s")
        check_provenance(arms, venv)
        report(samples, args)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
