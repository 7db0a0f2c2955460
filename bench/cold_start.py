"""Cold start: N runs of `true` through the daemon (one fresh sandbox per call, end to
end through gRPC) on Docker and on nsjail, versus `docker run --rm` with the same image,
the bare nsjail binary chrooted into the same exported image, and a bare subprocess,
all measured in one run, round by round. Prints a table of medians and ratios to `docker run`.

    .venv/bin/python bench/cold_start.py [-n 30] [--image sandboxd/default:latest]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("daemon", "client", "contract", "testing")]

import docker  # noqa: E402

from sandboxd.backends.nsjail.host import find_nsjail_binary  # noqa: E402
from sandboxd.core.settings import NsjailSettings  # noqa: E402
from sandboxd_testing import make_daemon, prepared_call  # noqa: E402
from sandboxd_testing import timed_interleaved_ms  # noqa: E402




def row(name: str, samples: list[float], baseline: float | None) -> str:
    med = statistics.median(samples)
    p90 = sorted(samples)[int(len(samples) * 0.9) - 1]
    ratio = f"{med / baseline:.2f}x" if baseline else "-"
    return f"| {name:<38} | {med:9.1f} | {p90:9.1f} | {ratio:>13} |"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=30)
    ap.add_argument("--image", default="sandboxd/default:latest")
    args = ap.parse_args()

    # nsjail mounts as the sandbox user: the workspace's parents must be traversable.
    base = Path(tempfile.mkdtemp(prefix="sandboxd-bench-", dir="/tmp"))
    base.chmod(0o755)
    d = make_daemon(base).start()
    try:
        ws = d.new_workspace()
        client = d.client()

        def through_daemon(adapter: str):
            call = prepared_call(ws, ["true"], image=args.image)
            call["runtime"]["adapter"] = adapter

            def once():
                r = client.run(call).result
                assert r.exit_code == 0, r
            return once

        through_daemon("nsjail")()  # exports the image root once
        image_hex = docker.from_env().images.get(args.image).id.split(":", 1)[1]
        rootfs = NsjailSettings().rootfs_dir / image_hex
        bare_nsjail = [find_nsjail_binary(), "-Mo", "-q", "--chroot", str(rootfs), "-u", "1000:1000:1",
                       "-g", "1000:1000:1", "--", "/bin/true"]
        docker_cmd = ["docker", "run", "--rm", "--pull", "never", "--network", "none", args.image, "true"]
        # Round by round: every path once per round, so the machine's slow spells (large
        # on this 2-core VM) fall on all of them alike.
        results = timed_interleaved_ms({
            "bare subprocess `true`": lambda: subprocess.run(["true"], check=True),
            "bare nsjail binary (chroot, userns)": lambda: subprocess.run(bare_nsjail, check=True),
            "sandboxd Execute on nsjail (gRPC)": through_daemon("nsjail"),
            "docker run --rm (CLI)": lambda: subprocess.run(docker_cmd, check=True),
            "sandboxd Execute on docker (gRPC)": through_daemon("docker"),
        }, args.n)
        client.close()
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)

    base = statistics.median(results["docker run --rm (CLI)"])
    print(f"cold start, n={args.n}, image {args.image}; times in ms")
    print("| path                                   |  median   |   p90     | vs docker run |")
    print("|----------------------------------------|-----------|-----------|---------------|")
    for name, samples in results.items():
        print(row(name, samples, base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
