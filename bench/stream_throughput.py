"""Streaming throughput: SIZE bytes of stdout from a sandbox to the client, through the
daemon (attach socket -> spool -> gRPC -> client, also stored as an artifact) versus
`docker run --log-driver none` piped into a reader, in one run. Also line-oriented
output (many small writes). Prints MB/s medians and the ratio.

    .venv/bin/python bench/stream_throughput.py [--mb 200] [-n 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("daemon", "client", "contract", "testing")]

from sandboxd_testing import make_daemon, prepared_call  # noqa: E402
from sandboxd_contract.pb import sandboxd_pb2 as pb  # noqa: E402


def docker_cli(image: str, argv: list[str]) -> int:
    proc = subprocess.Popen(["docker", "run", "--rm", "--pull", "never", "--network", "none", "--log-driver", "none", image, *argv],
                            stdout=subprocess.PIPE)
    n = 0
    while chunk := proc.stdout.read(1 << 20):
        n += len(chunk)
    proc.wait()
    return n


def through_daemon(client, call) -> int:
    n = 0
    for event in client.execute(call):
        if event.WhichOneof("kind") == "output" and event.output.stream == pb.OUTPUT_STREAM_STDOUT:
            n += len(event.output.data)
    return n


def measure(fn, n: int, size: int) -> list[float]:
    rates = []
    for _ in range(n):
        t = time.perf_counter()
        got = fn()
        dt = time.perf_counter() - t
        assert got == size, (got, size)
        rates.append(size / dt / 1e6)
    return rates


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("-n", type=int, default=3)
    ap.add_argument("--image", default="sandboxd/default:latest")
    args = ap.parse_args()
    size = args.mb * 1_000_000
    bulk = ["head", "-c", str(size), "/dev/zero"]
    lines_count = 2_000_000
    lines = ["seq", "1", str(lines_count)]
    lines_size = sum(len(str(i)) + 1 for i in range(1, lines_count + 1))

    with tempfile.TemporaryDirectory(prefix="sandboxd-bench-") as tmp:
        d = make_daemon(Path(tmp)).start()
        try:
            ws = d.new_workspace()
            client = d.client()
            policy = {"process": {"maxStdoutBytes": size + 1, "timeoutMs": 600_000}}
            # Alternating the two paths run by run, so that neither gets the machine's
            # quieter moments (or the page cache's writeback) to itself.
            def pair(path_a, path_b, size_):
                a, b = [], []
                for _ in range(args.n):
                    a += measure(path_a, 1, size_)
                    b += measure(path_b, 1, size_)
                return a, b

            bulk_docker, bulk_daemon = pair(lambda: docker_cli(args.image, bulk),
                                            lambda: through_daemon(client, prepared_call(ws, bulk, policy, image=args.image)), size)
            lines_docker, lines_daemon = pair(lambda: docker_cli(args.image, lines),
                                              lambda: through_daemon(client, prepared_call(ws, lines, policy, image=args.image)),
                                              lines_size)
            rows = [
                (f"bulk {args.mb} MB: docker run --log-driver none", bulk_docker),
                (f"bulk {args.mb} MB: sandboxd Execute", bulk_daemon),
                (f"lines ({lines_size // 1_000_000} MB of seq): docker run --log-driver none", lines_docker),
                (f"lines ({lines_size // 1_000_000} MB of seq): sandboxd Execute", lines_daemon),
            ]
            client.close()
        finally:
            d.stop()

    print(f"stdout throughput, n={args.n}, image {args.image}; MB/s including container start")
    print("| path                                               | median MB/s | vs docker run |")
    print("|----------------------------------------------------|-------------|---------------|")
    for i, (name, rates) in enumerate(rows):
        base = statistics.median(rows[i - i % 2][1])
        print(f"| {name:<50} | {statistics.median(rates):11.1f} | {statistics.median(rates) / base:12.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
