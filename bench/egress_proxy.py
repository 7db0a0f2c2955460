"""Egress proxy: is it a bottleneck? In one run:

  * a 100 MB download from an allowed server (allowed.test, in a network namespace of
    this bench's own on a veth pair, as tests/integration/egress_hosts.py makes it; its
    address exempted from the private-network rule by this bench's daemon config: the
    proxy refuses every loopback address, exempted or not), with curl: directly on the
    host (the baseline, over the same veth), and from inside an allowlist sandbox
    through the shim and the daemon's proxy, on Docker and on nsjail;
  * connections per second: the same Python client opening fresh connections for small
    requests (8 threads), directly on the host and from inside a sandbox through the proxy.

Times are measured by curl / the client itself, so sandbox start-up is not counted.
Prints a table of medians and ratios to the direct baseline. Needs root (ip netns).

    .venv/bin/python bench/egress_proxy.py [-n 5] [--mb 100] [--requests 2000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / d) for d in ("daemon", "client", "contract", "testing")] + [str(ROOT)]

from sandboxd_testing import make_daemon, prepared_call  # noqa: E402
from tests.integration.egress_hosts import RemoteHosts  # noqa: E402

CONN_RATE = r"""
import json, sys, threading, time, urllib.request
url, total, proxy = sys.argv[1], int(sys.argv[2]), sys.argv[3]
handlers = [urllib.request.ProxyHandler({"http": proxy} if proxy else {})]
opener = urllib.request.build_opener(*handlers)
errors = []
def worker(n):
    for _ in range(n):
        try:
            opener.open(url, timeout=30).read()
        except Exception as e:
            errors.append(repr(e))
threads = [threading.Thread(target=worker, args=(total // 8,)) for _ in range(8)]
t = time.perf_counter()
for th in threads: th.start()
for th in threads: th.join()
print(json.dumps({"rate": (total // 8 * 8) / (time.perf_counter() - t), "errors": len(errors)}))
"""


def row(name: str, samples: list[float], unit: str, baseline: float | None) -> str:
    med = statistics.median(samples)
    ratio = f"{med / baseline:.2f}x" if baseline else "-"
    return f"| {name:<44} | {med:10.1f} {unit:<6} | {ratio:>9} |"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="sandboxd-bench-hosts-", dir="/tmp"))
    hosts = RemoteHosts(workdir, tag="b", subnet="10.215").start()
    server_addr = hosts.allowed_ip
    big = f"http://allowed.test/bytes/{args.mb << 20}"
    small = "http://allowed.test/small"

    base = Path(tempfile.mkdtemp(prefix="sandboxd-bench-egress-", dir="/tmp"))
    base.chmod(0o755)
    d = make_daemon(base, egress=hosts.daemon_egress_settings()).start()
    policy = {"network": {"egress": "allowlist", "allowDomains": ["allowed.test"]}}
    curl = ["curl", "-sS", "-o", "/dev/null", "-w", "%{speed_download}"]
    try:
        ws = d.new_workspace({"rate.py": CONN_RATE})
        client = d.client()

        def in_sandbox(adapter: str, argv: list[str]) -> str:
            out = client.run(prepared_call(ws, argv, policy, runtime={"adapter": adapter,
                                                                      "image": "sandboxd/default:latest"}),
                             timeout_s=600)
            if out.result.status != "success":
                raise RuntimeError(f"{adapter}: {out.stderr.decode()[-2000:]}")
            return out.stdout.decode()

        def host(argv: list[str]) -> str:
            # The host has no allowed.test: resolve it the way the proxy's DNS server does.
            return subprocess.run(argv, check=True, capture_output=True, text=True).stdout

        direct_big = ["curl", "-sS", "-o", "/dev/null", "-w", "%{speed_download}",
                      "--resolve", f"allowed.test:80:{server_addr}", "--noproxy", "*", big]
        download: dict[str, list[float]] = {"direct": [], "docker": [], "nsjail": []}
        rate: dict[str, list[float]] = {"direct": [], "docker": [], "nsjail": []}
        host_small = small.replace("allowed.test", server_addr)
        rate_script = str(ws / "rate.py")
        for _ in range(args.n):  # alternating, so drift hits every path alike
            download["direct"].append(float(host(direct_big)) / 2**20)
            for adapter in ("docker", "nsjail"):
                download[adapter].append(float(in_sandbox(adapter, curl + [big])) / 2**20)
            r = json.loads(host([sys.executable, rate_script, host_small, str(args.requests), ""]))
            rate["direct"].append(r["rate"])
            for adapter in ("docker", "nsjail"):
                r = json.loads(in_sandbox(adapter, ["python3", "/workspace/rate.py", small, str(args.requests),
                                                    "http://127.0.0.1:3128"]))
                if r["errors"]:
                    raise RuntimeError(f"{adapter}: {r['errors']} failed requests")
                rate[adapter].append(r["rate"])

        print(f"\negress proxy, n={args.n} (medians; ratio to the direct baseline)\n")
        print(f"| {'path':<44} | {'median':>17} | {'vs direct':>9} |")
        print(f"|{'-' * 46}|{'-' * 19}|{'-' * 11}|")
        base_dl = statistics.median(download["direct"])
        print(row(f"{args.mb} MB download, host curl direct", download["direct"], "MB/s", None))
        for adapter in ("docker", "nsjail"):
            print(row(f"{args.mb} MB download, {adapter} sandbox via proxy", download[adapter], "MB/s", base_dl))
        base_rate = statistics.median(rate["direct"])
        print(row("new connections, host client direct", rate["direct"], "conn/s", None))
        for adapter in ("docker", "nsjail"):
            print(row(f"new connections, {adapter} sandbox via proxy", rate[adapter], "conn/s", base_rate))
    finally:
        d.stop()
        hosts.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
