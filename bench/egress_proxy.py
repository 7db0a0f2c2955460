"""Egress proxy: is it a bottleneck? In one run:

  * a 100 MB download from an allowed local server (bench.test -> 127.0.0.2, exempted
    from the private-network rule by this bench's daemon config), with curl:
    directly on the host (the baseline), and from inside an allowlist sandbox through
    the shim and the daemon's proxy, on Docker and on nsjail;
  * connections per second: the same Python client opening fresh connections for small
    requests (8 threads), directly on the host and from inside a sandbox through the proxy.

Times are measured by curl / the client itself, so sandbox start-up is not counted.
Prints a table of medians and ratios to the direct baseline.

    .venv/bin/python bench/egress_proxy.py [-n 5] [--mb 100] [--requests 2000]
"""

from __future__ import annotations

import argparse
import http.server
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("daemon", "client")]

from sandboxd.testing import make_daemon, prepared_call  # noqa: E402

SERVER_ADDR = "127.0.0.2"
CHUNK = b"x" * (1 << 20)

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


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 - http.server's naming
        size = int(self.path.rsplit("/", 1)[1]) if self.path.startswith("/bytes/") else 2
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("Connection", "close")
        self.end_headers()
        left = size
        while left:
            piece = CHUNK[:left]
            self.wfile.write(piece)
            left -= len(piece)
        self.close_connection = True

    def log_message(self, *args):
        pass


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

    server = http.server.ThreadingHTTPServer((SERVER_ADDR, 0), Handler)
    server.daemon_threads = True
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    big = f"http://bench.test:{port}/bytes/{args.mb << 20}"
    small = f"http://bench.test:{port}/small"

    base = Path(tempfile.mkdtemp(prefix="sandboxd-bench-egress-", dir="/tmp"))
    base.chmod(0o755)
    d = make_daemon(base, egress={"hosts": {"bench.test": [SERVER_ADDR]},
                                  "exempt_networks": [f"{SERVER_ADDR}/32"]}).start()
    policy = {"network": {"egress": "allowlist", "allowDomains": ["bench.test"]}}
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
            # The host has no bench.test: resolve it the way the proxy's table does.
            return subprocess.run(argv, check=True, capture_output=True, text=True).stdout

        direct_big = ["curl", "-sS", "-o", "/dev/null", "-w", "%{speed_download}",
                      "--resolve", f"bench.test:{port}:{SERVER_ADDR}", "--noproxy", "*", big]
        download: dict[str, list[float]] = {"direct": [], "docker": [], "nsjail": []}
        rate: dict[str, list[float]] = {"direct": [], "docker": [], "nsjail": []}
        host_small = small.replace("bench.test", SERVER_ADDR)
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
        server.shutdown()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
