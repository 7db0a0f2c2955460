"""An MCP `run_command` of `true` over stdio (the official MCP client, `ClientSession` +
`stdio_client`, driving `.venv/bin/sandboxd-mcp` in its warm lease) against the raw
client's leased call (`SandboxdClient.acquire_sandbox`, then `run` with runtime.leaseId),
on Docker and on nsjail, in one run against one daemon of its own. The raw call is the
very request the MCP server sends (its policy, toolId, argv; `SandboxdMcp.call_json`),
in a lease of the same pool, so the ratio is the MCP layer's cost alone.

Every round runs each path once, interleaved (the order reversed every other round) so
that a slow spell lands on every path alike. Beside the two compared paths, each round
also times what splits the difference: an MCP `ping` over the same stdio (the SDK's
framing and the two processes' hop, with no tool work), and the server's own
`call_tool` run in this process (argument checks, plan, policy copy, thread hop, the
daemon call, the reply; no MCP transport). Then the server's pure per-call work and
anyio's thread hop alone. Prints median, p90, p99 per path, MCP/raw, and whether each
backend meets issue 23's target (MCP within 2x of raw, and under 20 ms at p50).

Then it profiles `--profile N` more MCP calls on Docker on both sides (this process, and a
server run under cProfile; its worker thread, the daemon call, is not in the server's
profile) and prints where their time goes, by package and by function.

    .venv/bin/python bench/mcp_roundtrip.py [-n 1500] [--warmup 20] [--profile 300]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(CHECKOUT / d) for d in ("daemon", "client", "contract", "testing")]

import anyio  # noqa: E402
import docker  # noqa: E402
from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402
from mcp_types import Implementation  # noqa: E402

from sandboxd_client import SandboxdClient  # noqa: E402
from sandboxd_client.mcp.arguments import check_arguments  # noqa: E402
from sandboxd_client.mcp.config import server_config  # noqa: E402
from sandboxd_client.mcp.results import reply_for  # noqa: E402
from sandboxd_client.mcp.server import SandboxdMcp  # noqa: E402
from sandboxd_client.mcp.tools import plan  # noqa: E402
from sandboxd_testing import DaemonProcess, make_daemon  # noqa: E402

IMAGE = "sandboxd/default:latest"
BACKENDS = ("docker", "nsjail")
SANDBOXD_MCP = CHECKOUT / ".venv" / "bin" / "sandboxd-mcp"
ARGUMENTS = {"command": ["true"]}  # an argv list: run as is, no `sh -c`
AGENT = Implementation(name="bench-mcp-roundtrip", version="1")
TARGET_RATIO = 2.0
TARGET_P50_MS = 20.0
# (path key, row name) in the order a round runs them on each backend.
PATHS = (("mcp", "MCP run_command over stdio"), ("raw", "raw leased Run (same request)"),
         ("ping", "MCP ping over stdio (framing floor)"), ("inproc", "server call_tool in-process (no MCP)"))


@dataclass
class Backend:
    """One backend's paths: its MCP session, the same server's code in this process
    and the raw client with its own lease of the same pool."""

    name: str
    session: ClientSession
    app: SandboxdMcp
    client: SandboxdClient
    raw_request: dict[str, Any]
    ctx: Any

    async def mcp(self) -> None:
        result = await self.session.call_tool("run_command", ARGUMENTS)
        if result.is_error or result.structured_content["exit_code"] != 0:
            raise RuntimeError(f"MCP run_command on {self.name} failed: {result.content}")

    async def raw(self) -> None:
        # Blocking on purpose: the raw client is synchronous; nothing else is in flight.
        outcome = self.client.run(self.raw_request)
        if outcome.result.status != "success":
            raise RuntimeError(f"raw leased call on {self.name} failed: {outcome.result}")

    async def ping(self) -> None:
        await self.session.send_ping()

    async def inproc(self) -> None:
        reply = await self.app.call_tool(self.ctx, "run_command", dict(ARGUMENTS))
        if reply.is_error:
            raise RuntimeError(f"in-process call_tool on {self.name} failed: {reply.text}")


def server_argv(d: DaemonProcess, ws: Path, adapter: str) -> list[str]:
    return ["--socket", str(d.socket), "--workspace", str(ws), "--image", IMAGE, "--adapter", adapter]


# The server under a profiler that its client switches on and off (SIGUSR1, SIGUSR2: the
# stats written to argv[1]), so that its start and warm-up calls stay out of the profile.
PROFILED_SERVER = """
import cProfile, os, signal, sys
from sandboxd_client.mcp.cli import main
out = sys.argv.pop(1)
prof = cProfile.Profile()
def stop(*_):
    prof.disable()
    prof.dump_stats(out)
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
signal.signal(signal.SIGUSR2, stop)
open(out + ".pid", "w").write(str(os.getpid()))
sys.exit(main(sys.argv[1:]))
"""


def server_params(argv: list[str], profile_to: Path | None = None) -> StdioServerParameters:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    if profile_to is None:
        return StdioServerParameters(command=str(SANDBOXD_MCP), args=argv, env=env)
    python = str(SANDBOXD_MCP.with_name("python"))
    return StdioServerParameters(command=python, env=env, args=["-c", PROFILED_SERVER, str(profile_to), *argv])


@contextlib.asynccontextmanager
async def mcp_session(argv: list[str], errlog: Any, profile_to: Path | None = None):
    async with stdio_client(server_params(argv, profile_to), errlog=errlog) as (read, write):
        async with ClientSession(read, write, client_info=AGENT) as session:
            await session.initialize()
            await session.list_tools()  # the client caches the tools' output schemas
            yield session


def stub_ctx() -> Any:
    """What the server's call_tool reads of a request context: the client's name (in
    the stdio session, its initialize) and the HTTP headers (none on stdio)."""
    return SimpleNamespace(session=SimpleNamespace(client_params=SimpleNamespace(client_info=AGENT)), request=None)


def release_quietly(client: SandboxdClient, lease_id: str) -> None:
    with contextlib.suppress(Exception):  # expired or gone: the daemon's stop reaps it anyway
        client.release_sandbox(lease_id)


async def open_backend(stack: contextlib.AsyncExitStack, d: DaemonProcess, ws: Path, adapter: str,
                       errlog: Any) -> Backend:
    argv = server_argv(d, ws, adapter)
    session = await stack.enter_async_context(mcp_session(argv, errlog))
    app = SandboxdMcp(server_config(argv))
    stack.push_async_callback(anyio.to_thread.run_sync, app.runner.close)
    client = d.client()
    stack.callback(client.close)
    ctx = stub_ctx()
    spec = app.specs["run_command"]
    request = app.call_json(spec, plan("run_command", app.config.operator, app.config.limits,
                                       check_arguments("run_command", spec.fields, ARGUMENTS)), ctx)
    lease = client.acquire_sandbox(str(ws), app.config.operator.policy, image=IMAGE, adapter=adapter)
    stack.callback(release_quietly, client, lease.lease_id)
    request["runtime"] = {**request["runtime"], "leaseId": lease.lease_id}
    return Backend(adapter, session, app, client, request, ctx)


async def settle(backends: list[Backend], timeout_s: float = 60.0) -> None:
    """Once every path holds its lease: waits until each pool has refilled its idle
    sandbox, so that no refill runs during the timing."""
    client = backends[0].client
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pools = client.list_pools()
        if pools and all(p.idle >= 1 for p in pools):
            return
        await anyio.sleep(0.1)
    print("warning: the pools did not settle; timing anyway", file=sys.stderr)


async def measure(backends: list[Backend], n: int, warmup: int) -> dict[tuple[str, str], list[float]]:
    """ms per call of each (backend, path), round by round; the order is reversed every
    other round (ABAB... then ...BABA) so that neither path is always first."""
    order: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        (f"{b.name}/{key}", getattr(b, key)) for b in backends for key, _ in PATHS]
    out: dict[tuple[str, str], list[float]] = {}
    for r in range(warmup + n):
        for label, fn in order if r % 2 == 0 else reversed(order):
            t = time.perf_counter()
            await fn()
            ms = (time.perf_counter() - t) * 1000
            if r >= warmup:
                name, key = label.split("/")
                out.setdefault((name, key), []).append(ms)
    return out


async def pure_work_ms(b: Backend, n: int) -> dict[str, list[float]]:
    """The server's per-call work with no I/O (argument check, plan, the call's JSON with
    its policy copy; the reply from a finished outcome), and anyio's hop to a worker
    thread and back (where the server makes its blocking daemon call)."""
    app, spec = b.app, b.app.specs["run_command"]
    outcome = b.client.run(b.raw_request)
    limits = app.config.limits
    times: dict[str, list[float]] = {"request": [], "reply": [], "hop": []}
    for _ in range(n):
        t = time.perf_counter()
        p = plan("run_command", app.config.operator, limits, check_arguments("run_command", spec.fields, ARGUMENTS))
        app.call_json(spec, p, b.ctx)
        t1 = time.perf_counter()
        reply_for(p, outcome, limits.output_bytes, limits.read_bytes, limits.list_entries)
        t2 = time.perf_counter()
        await anyio.to_thread.run_sync(lambda: None)
        t3 = time.perf_counter()
        for key, a, z in (("request", t, t1), ("reply", t1, t2), ("hop", t2, t3)):
            times[key].append((z - a) * 1000)
    return times


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * q))]


def report(samples: dict[tuple[str, str], list[float]], pure: dict[str, list[float]], n: int) -> bool:
    """Prints the tables; True when every backend meets the target."""
    print(f"\nMCP round trip against the raw leased call, `true`, n={n} rounds, interleaved; ms\n")
    print("| backend | path | median | p90 | p99 |")
    print("|---|---|---|---|---|")
    for name in BACKENDS:
        for key, row in PATHS:
            s = samples[(name, key)]
            print(f"| {name} | {row} | {statistics.median(s):.2f} | {pct(s, 0.9):.2f} | {pct(s, 0.99):.2f} |")
    print(f"\n| backend | MCP median | raw median | MCP/raw | target (<= {TARGET_RATIO:g}x and p50 < "
          f"{TARGET_P50_MS:g} ms) | paired MCP/raw |")
    print("|---|---|---|---|---|---|")
    met_all = True
    for name in BACKENDS:
        m, r = samples[(name, "mcp")], samples[(name, "raw")]
        ratio = statistics.median(m) / statistics.median(r)
        paired = statistics.median(a / b for a, b in zip(m, r))
        met = ratio <= TARGET_RATIO and statistics.median(m) < TARGET_P50_MS
        met_all &= met
        print(f"| {name} | {statistics.median(m):.2f} | {statistics.median(r):.2f} | {ratio:.2f}x | "
              f"{'met' if met else 'MISSED'} | {paired:.2f}x |")
    print("\nwhere the MCP call's time goes (medians, ms):\n")
    print("| backend | raw daemon call | + server layer (in-process call_tool - raw) | "
          "+ MCP transport and SDKs (MCP - in-process) | of which a bare ping |")
    print("|---|---|---|---|---|")
    for name in BACKENDS:
        med = {key: statistics.median(samples[(name, key)]) for key, _ in PATHS}
        print(f"| {name} | {med['raw']:.2f} | {med['inproc'] - med['raw']:.2f} | {med['mcp'] - med['inproc']:.2f} | "
              f"{med['ping']:.2f} |")
    print(f"\nserver's pure per-call work: request (args, plan, call JSON) {statistics.median(pure['request']):.3f} ms, "
          f"reply {statistics.median(pure['reply']):.3f} ms; anyio thread hop {statistics.median(pure['hop']):.3f} ms")
    return met_all


def by_package(stats: pstats.Stats) -> dict[str, float]:
    """Own time (s) by top-level package or stdlib module."""
    out: dict[str, float] = {}
    for (file, _line, func), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if file == "~":
            key = "builtin " + func
        elif "site-packages/" in file:
            key = file.split("site-packages/")[1].split("/")[0].removesuffix(".py")
        elif "/sandboxd_client/" in file:
            key = "sandboxd_client." + file.split("/sandboxd_client/")[1].split("/")[0].removesuffix(".py")
        else:
            key = "stdlib " + Path(file).parent.name + "/" + Path(file).name
        out[key] = out.get(key, 0.0) + tt
    return out


IDLE = ("<method 'poll' of 'select.epoll' objects>", "<method 'poll' of 'select.poll' objects>")


def print_profile(side: str, stats: pstats.Stats, calls: int, top: int = 12) -> None:
    """Own time per call by package and by function, the loop's idle wait (epoll) left out."""
    packages = {k: v for k, v in by_package(stats).items() if k.removeprefix("builtin ") not in IDLE}
    print(f"\n{side}: {sum(packages.values()) / calls * 1000:.2f} ms busy per call in its main thread")
    print("| package or module | us per call |")
    print("|---|---|")
    for key, tt in sorted(packages.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {key} | {tt / calls * 1e6:.0f} |")
    # (cProfile counts each resumption of a coroutine as an entry.)
    print("\n| function (own time) | us per call | entries per call |")
    print("|---|---|---|")
    busy = [kv for kv in stats.stats.items() if kv[0][2] not in IDLE]  # type: ignore[attr-defined]
    for (file, line, func), (_cc, nc, tt, _ct, _callers) in sorted(busy, key=lambda kv: -kv[1][2])[:top]:
        where = "/".join(Path(file).parts[-2:]) + f":{line}" if file != "~" else "(C)"
        print(f"| {func} {where} | {tt / calls * 1e6:.0f} | {nc / calls:.1f} |")


async def profile_calls(d: DaemonProcess, ws: Path, calls: int, work: Path, errlog: Any) -> None:
    """N MCP calls on Docker, profiled in this process and in the server (switched on
    after 20 warm-up calls, off after the N)."""
    server_profile = work / "server.prof"
    mine = cProfile.Profile()
    async with mcp_session(server_argv(d, ws, "docker"), errlog, server_profile) as session:
        for _ in range(20):  # the lease taken, everything imported and warm
            await session.call_tool("run_command", ARGUMENTS)
        server_pid = int(Path(f"{server_profile}.pid").read_text())
        os.kill(server_pid, signal.SIGUSR1)
        await session.send_ping()  # the server has handled the signal before the first call
        t = time.perf_counter()
        mine.enable()
        for _ in range(calls):
            await session.call_tool("run_command", ARGUMENTS)
        mine.disable()
        wall_ms = (time.perf_counter() - t) * 1000 / calls
        os.kill(server_pid, signal.SIGUSR2)
        await session.send_ping()
        for _ in range(100):
            if server_profile.exists():
                break
            await anyio.sleep(0.05)
    print(f"\nprofile of {calls} MCP calls on Docker ({wall_ms:.2f} ms each, profiling on):")
    print_profile("client (this process: ClientSession, stdio_client)", pstats.Stats(mine), calls)
    if server_profile.exists():
        print_profile("server (sandboxd-mcp main thread; the daemon call is in a worker thread, not here)",
                      pstats.Stats(str(server_profile)), calls)
    else:
        print("the server wrote no profile", file=sys.stderr)


def check_leases(client: SandboxdClient, ws: Path) -> None:
    """Every path runs in a warm lease of its own: the MCP server's, the in-process
    server's and the raw client's, on each backend (a server without one would time
    fresh sandboxes)."""
    held = sorted(h.lease.backend for h in client.list_running().leases if h.workspace == str(ws))
    if held != sorted(BACKENDS * 3):
        raise RuntimeError(f"expected three leases on each backend, found {held}")


async def run(d: DaemonProcess, args: argparse.Namespace, work: Path) -> bool:
    ws = d.new_workspace({"README.md": "bench\n"})
    with open(work / "mcp-servers.log", "w") as errlog:
        async with contextlib.AsyncExitStack() as stack:
            backends = [await open_backend(stack, d, ws, b, errlog) for b in BACKENDS]
            for b in backends:  # each path takes its lease (MCP and in-process: at their first call)
                await b.mcp()
                await b.inproc()
                await b.raw()
            check_leases(backends[0].client, ws)
            await settle(backends)
            t = time.monotonic()
            samples = await measure(backends, args.n, args.warmup)
            print(f"measured in {time.monotonic() - t:.1f} s")
            pure = await pure_work_ms(backends[0], 1000)
        met = report(samples, pure, args.n)
        if args.profile:
            await profile_calls(d, ws, args.profile, work, errlog)
    return met


def stop_daemon(d: DaemonProcess) -> None:
    """Stopped, every container labelled with its id removed."""
    try:
        d.stop()
    finally:
        if d.daemon_id:
            engine = docker.from_env()
            for c in engine.containers.list(all=True, filters={"label": f"sandboxd.daemon_id={d.daemon_id}"}):
                with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                    c.remove(force=True)
            engine.close()


def interrupted(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cleanups, as a Ctrl-C does


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=1500, help="counted rounds (each path once per backend)")
    ap.add_argument("--warmup", type=int, default=20, help="uncounted rounds first")
    ap.add_argument("--profile", type=int, default=300, metavar="N", help="then profile N MCP calls on Docker (0: not)")
    args = ap.parse_args()
    if args.n < 1 or args.warmup < 0 or args.profile < 0:
        ap.error("-n must be at least 1, --warmup and --profile at least 0")
    signal.signal(signal.SIGTERM, interrupted)
    work = Path(tempfile.mkdtemp(prefix="sandboxd-bench-mcp-", dir="/tmp"))
    work.chmod(0o755)  # nsjail mounts as the sandbox user: the workspace's parents must be traversable
    try:
        d = make_daemon(work / "daemon", pools={"min_idle": 1, "max_size": 6}, quotas={"leases": 8})
        try:
            d.start()
            met = anyio.run(run, d, args, work)
        finally:
            stop_daemon(d)
    except KeyboardInterrupt:
        print("interrupted: the daemon is stopped and its sandboxes removed", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\ntarget {'met' if met else 'MISSED'} on {'every backend' if met else 'at least one backend'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
