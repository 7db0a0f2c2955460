"""A/B of a call's cost between two trees: the daemon of another checkout (an older
commit in a `git worktree`, its natives built there with `make native`) run through
PYTHONPATH beside this tree's, alternated round by round. Cold `true` and leased `true`
on both backends; prints each path's medians and the paired ratio (the median of the
rounds' new/old).

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

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("daemon", "client")]

from sandboxd.testing import make_daemon, prepared_call  # noqa: E402

BACKENDS = ("docker", "nsjail")


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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the other tree (a checkout with its natives built)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=10, help="calls of each path per round")
    args = ap.parse_args()
    old = Path(args.old).resolve()
    daemons = {"old": start("old", f"{old}/daemon:{old}/client"), "new": start("new", "")}
    try:
        clients = {k: d.client() for k, d in daemons.items()}
        workspaces = {k: d.new_workspace({"f": "x"}) for k, d in daemons.items()}
        leases = {(k, b): clients[k].acquire_sandbox(str(workspaces[k]), adapter=b) for k in daemons for b in BACKENDS}
        time.sleep(3)  # the pools' refills settle
        samples: dict[tuple[str, str, str], list[float]] = {}
        for r in range(args.rounds):
            for k in ("old", "new") if r % 2 == 0 else ("new", "old"):
                for b in BACKENDS:
                    cold = prepared_call(workspaces[k], ["true"], runtime={"adapter": b})
                    warm = prepared_call(workspaces[k], ["true"], runtime={"adapter": b, "leaseId": leases[(k, b)].lease_id})
                    for kind, request in (("cold", cold), ("leased", warm)):
                        block = [timed_ms(clients[k], request) for _ in range(args.block)]
                        samples.setdefault((k, kind, b), []).append(statistics.median(block))
        print("| path | old median ms | new median ms | paired new/old |")
        print("|---|---|---|---|")
        for kind in ("cold", "leased"):
            for b in BACKENDS:
                o, n = samples[("old", kind, b)], samples[("new", kind, b)]
                ratio = statistics.median(y / x for x, y in zip(o, n))
                print(f"| {kind} `true` on {b} | {statistics.median(o):.1f} | {statistics.median(n):.1f} | {ratio:.2f}x |")
    finally:
        for d in daemons.values():
            d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
