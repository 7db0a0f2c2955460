"""A/B of a call's cost between two trees: the daemon of another checkout (an older
commit in a `git worktree`, its natives built there with `make native`) run through
PYTHONPATH beside this tree's, alternated round by round. On both backends: cold `true`,
leased `true`, a streamed 16 MB of stdout (Execute), and a recorded call (file-access
recording on, a writable workspace of 300 files, the command reading and writing some);
prints each path's medians and the paired ratio (the median of the rounds' new/old).

    git worktree add /tmp/ab-old <commit> && make -C /tmp/ab-old native
    .venv/bin/python bench/ab_calls.py --old /tmp/ab-old [--rounds 8] [--block 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("daemon", "client", "contract", "testing")]

from sandboxd_testing import make_daemon, prepared_call  # noqa: E402

BACKENDS = ("docker", "nsjail")
STREAM_BYTES = 16_000_000  # the default stdout cap is 16 MiB
RECORDED_FILES = 300
RECORDED_ARGV = ["sh", "-c", "cat /workspace/d/f1* >/dev/null; for i in 1 2 3 4 5; do echo $i > /workspace/out$i; done; "
                             "rm -f /workspace/out*"]


def start(tag: str, pythonpath: str):
    base = Path(tempfile.mkdtemp(prefix=f"sandboxd-bench-ab-{tag}-", dir="/tmp"))
    base.chmod(0o755)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return make_daemon(base, env=env, pools={"min_idle": 1, "max_size": 3}).start()


def timed_ms(client, request) -> float:
    t = time.perf_counter()
    out = client.run(request)
    ms = (time.perf_counter() - t) * 1000
    assert out.result.status == "success", out.result
    return ms


def streamed_ms(client, request) -> float:
    """An Execute whose stdout is read off the stream as it comes."""
    t = time.perf_counter()
    got = 0
    for event in client.execute(request):
        if event.WhichOneof("kind") == "output":
            got += len(event.output.data)
    ms = (time.perf_counter() - t) * 1000
    assert got == STREAM_BYTES, got
    return ms


def paths(workspace: Path, recorded: Path, lease_ids: dict[str, str]):
    """(name, backend, request, timer, calls per round) of every compared path."""
    for b in BACKENDS:
        runtime = {"adapter": b}
        yield "cold `true`", b, prepared_call(workspace, ["true"], runtime=runtime), timed_ms, 1
        yield "leased `true`", b, prepared_call(workspace, ["true"], runtime={**runtime, "leaseId": lease_ids[b]}), timed_ms, 1
        yield f"streamed {STREAM_BYTES // 1_000_000} MB", b, prepared_call(
            workspace, ["head", "-c", str(STREAM_BYTES), "/dev/zero"], runtime=runtime), streamed_ms, 0.3
        yield "recorded call (300 files)", b, prepared_call(
            recorded, RECORDED_ARGV, {"filesystem": {"writeRoots": ["/workspace"]}, "audit": {"recordFileAccess": True}},
            runtime=runtime), timed_ms, 0.5


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the other tree (a checkout with its natives built)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=10, help="calls of each path per round")
    ap.add_argument("--only", default="", help="measure only the paths whose name contains this")
    args = ap.parse_args()
    old = Path(args.old).resolve()
    daemons = {"old": start("old", f"{old}/daemon:{old}/client"), "new": start("new", "")}
    try:
        clients = {k: d.client() for k, d in daemons.items()}
        workspaces = {k: d.new_workspace({"f": "x"}) for k, d in daemons.items()}
        recorded = {k: d.new_workspace({f"d/f{i}": f"{i}\n" for i in range(RECORDED_FILES)}) for k, d in daemons.items()}
        leases = {(k, b): clients[k].acquire_sandbox(str(workspaces[k]), adapter=b) for k in daemons for b in BACKENDS}
        time.sleep(3)  # the pools' refills settle
        samples: dict[tuple[str, str, str], list[float]] = {}
        names: list[tuple[str, str]] = []
        for r in range(args.rounds):
            for k in ("old", "new") if r % 2 == 0 else ("new", "old"):
                lease_ids = {b: leases[(k, b)].lease_id for b in BACKENDS}
                for name, b, request, timer, share in paths(workspaces[k], recorded[k], lease_ids):
                    if args.only not in f"{name} on {b}":
                        continue
                    if (name, b) not in names:
                        names.append((name, b))
                    block = [timer(clients[k], request) for _ in range(max(2, int(args.block * share)))]
                    samples.setdefault((k, name, b), []).append(statistics.median(block))
        print("| path | old median ms | new median ms | paired new/old |")
        print("|---|---|---|---|")
        for name, b in names:
            o, n = samples[("old", name, b)], samples[("new", name, b)]
            ratio = statistics.median(y / x for x, y in zip(o, n))
            print(f"| {name} on {b} | {statistics.median(o):.1f} | {statistics.median(n):.1f} | {ratio:.2f}x |")
    finally:
        for d in daemons.values():
            d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
