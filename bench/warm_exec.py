"""Warm exec: `true` in a leased warm sandbox, end to end through gRPC (acquire once,
then run + collect the result), versus a cold call (a fresh sandbox per call) on the same
backend, the Docker SDK's exec_run in a running container, and a bare subprocess, all
and llm-sandbox's session exec (the peer baseline), measured in one run. Prints medians,
p99, each path's ratio to exec_run (the machine runs in spells up to twice as slow:
the ratio holds across them) and the cold/warm ratio; then N concurrent
agents each running M short commands in their own leases (errors, p99, daemon memory).

    .venv/bin/python bench/warm_exec.py [-n 50] [--agents 20] [--commands 50]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("daemon", "client", "contract", "testing")]

import docker  # noqa: E402

from sandboxd_testing import make_daemon, prepared_call  # noqa: E402
from sandboxd_testing import timed_ms  # noqa: E402




def p99(samples: list[float]) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * 0.99))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=50)
    ap.add_argument("--agents", type=int, default=20)
    ap.add_argument("--commands", type=int, default=50)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="sandboxd-bench-warm-", dir="/tmp"))
    base.chmod(0o755)
    # One principal plays every agent: its caps are raised to the agents' number (each
    # acquires and releases its lease with a unary RPC, all at once).
    d = make_daemon(base, max_concurrent_calls=64, quotas={"concurrent_calls": 64, "pools": args.agents + 4, "leases": args.agents + 4},
                    rpc_limits={"unary_calls_per_principal": args.agents + 4},
                    pools={"min_idle": 1, "max_size": max(4, args.agents + 2)}).start()
    rows: list[tuple[str, list[float]]] = []
    try:
        ws = d.new_workspace()
        client = d.client()
        for adapter in ("docker", "nsjail"):
            lease = client.acquire_sandbox(str(ws), adapter=adapter)
            # The pool refills its idle sandbox in the background: let that finish first,
            # so the timing is of the leased command alone.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                    p.pool_key == lease.pool_key and p.idle >= 1 for p in client.list_pools()):
                time.sleep(0.05)
            warm_call = prepared_call(ws, ["true"], runtime={"adapter": adapter, "image": "sandboxd/default:latest",
                                                             "leaseId": lease.lease_id})
            rows.append((f"{adapter}: leased warm sandbox",
                         timed_ms(lambda: client.run(warm_call), args.n, warmup=3)))
            cold_call = prepared_call(ws, ["true"], runtime={"adapter": adapter, "image": "sandboxd/default:latest"})
            rows.append((f"{adapter}: cold call (fresh sandbox)",
                         timed_ms(lambda: client.run(cold_call), max(10, args.n // 5), warmup=3)))
            client.release_sandbox(lease.lease_id)
            time.sleep(2)  # the released sandbox's removal, off the next measurement
        engine = docker.from_env()
        box = engine.containers.run("sandboxd/default:latest", ["sleep", "600"], detach=True, network_mode="none")
        try:
            rows.append(("docker SDK exec_run in a running container",
                         timed_ms(lambda: box.exec_run(["true"]), args.n, warmup=3)))
        finally:
            box.remove(force=True)
        rows.append(("bare subprocess", timed_ms(lambda: subprocess.run(["true"]), args.n, warmup=3)))
        try:
            from llm_sandbox import SandboxSession
        except ImportError:
            print("llm-sandbox is not installed (make bench installs it): its row is missing")
        else:
            # The peer baseline: its session exec on the same local image, Docker backend.
            with SandboxSession(lang="python", image="sandboxd/default:latest", keep_template=True,
                                skip_environment_setup=True, verbose=False) as session:
                rows.append(("llm-sandbox session execute_command", timed_ms(lambda: session.execute_command("true"),
                                                                          args.n, warmup=3)))

        print(f"\nwarm exec, n={args.n}; times in ms\n")
        exec_run = statistics.median(dict(rows)["docker SDK exec_run in a running container"])
        print(f"| {'path':<44} | {'median':>8} | {'p99':>8} | {'/ exec_run':>10} |")
        print(f"|{'-' * 46}|{'-' * 10}|{'-' * 10}|{'-' * 12}|")
        for name, samples in rows:
            print(f"| {name:<44} | {statistics.median(samples):8.2f} | {p99(samples):8.2f} | "
                  f"{statistics.median(samples) / exec_run:9.3f}x |")
        for adapter in ("docker", "nsjail"):
            warm = statistics.median(dict(rows)[f"{adapter}: leased warm sandbox"])
            cold = statistics.median(dict(rows)[f"{adapter}: cold call (fresh sandbox)"])
            print(f"{adapter}: cold / warm = {cold / warm:.1f}x")

        # Concurrent agents, each with its own lease and workspace.
        latencies: list[float] = []
        errors: list[str] = []
        lock = threading.Lock()

        def agent(i: int) -> None:
            try:
                aws = d.new_workspace()
                c = d.client()
                lease = c.acquire_sandbox(str(aws), wait_ms=60_000)
                for _ in range(args.commands):
                    call = prepared_call(aws, ["true"], runtime={"image": "sandboxd/default:latest",
                                                                 "leaseId": lease.lease_id})
                    t = time.perf_counter()
                    out = c.run(call)
                    ms = (time.perf_counter() - t) * 1000
                    with lock:
                        latencies.append(ms)
                        if out.result.status != "success":
                            errors.append(out.result.error.message)
                c.release_sandbox(lease.lease_id)
                c.close()
            except Exception as exc:  # noqa: BLE001 - counted
                with lock:
                    errors.append(repr(exc))

        threads = [threading.Thread(target=agent, args=(i,)) for i in range(args.agents)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        rss = 0
        while any(t.is_alive() for t in threads):
            rss = max(rss, int(Path(f"/proc/{d.proc.pid}/status").read_text().split("VmRSS:")[1].split()[0]))
            time.sleep(0.2)
        wall = time.perf_counter() - t0
        print(f"\n{args.agents} agents x {args.commands} commands (docker leases): {len(latencies)} commands in "
              f"{wall:.1f} s, errors {len(errors)}, median {statistics.median(latencies):.1f} ms, "
              f"p99 {p99(latencies):.1f} ms, daemon peak RSS {rss // 1024} MiB")
        if errors:
            print("first error:", errors[0])
    finally:
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
