"""Cold start: N runs of `true` through the daemon (one fresh container per call, end to
end through gRPC) versus `docker run --rm` with the same image and a bare subprocess,
all measured in one run. Prints a table of medians and ratios to `docker run`.

    .venv/bin/python bench/cold_start.py [-n 30] [--image sandboxd/default:latest]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("daemon", "client")]

from sandboxd.testing import make_daemon, prepared_call  # noqa: E402


def timed(fn, n: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def row(name: str, samples: list[float], baseline: float | None) -> str:
    med = statistics.median(samples)
    p90 = sorted(samples)[int(len(samples) * 0.9) - 1]
    ratio = f"{med / baseline:.2f}x" if baseline else "-"
    return f"| {name:<38} | {med:9.1f} | {p90:9.1f} | {ratio:>8} |"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=30)
    ap.add_argument("--image", default="sandboxd/default:latest")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="sandboxd-bench-") as tmp:
        d = make_daemon(Path(tmp)).start()
        try:
            ws = d.new_workspace()
            client = d.client()
            call = prepared_call(ws, ["true"], image=args.image)

            def through_daemon():
                r = client.run(call).result
                assert r.exit_code == 0, r

            docker_cmd = ["docker", "run", "--rm", "--pull", "never", "--network", "none", args.image, "true"]
            results = {
                "bare subprocess `true`": timed(lambda: subprocess.run(["true"], check=True), args.n),
                "docker run --rm (CLI)": timed(lambda: subprocess.run(docker_cmd, check=True), args.n),
                "sandboxd Execute (gRPC, fresh container)": timed(through_daemon, args.n),
            }
            client.close()
        finally:
            d.stop()

    base = statistics.median(results["docker run --rm (CLI)"])
    print(f"cold start, n={args.n}, image {args.image}; times in ms")
    print("| path                                   |  median   |   p90     | vs docker run |")
    print("|----------------------------------------|-----------|-----------|----------|")
    for name, samples in results.items():
        print(row(name, samples, base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
