"""The file watch's two ways of reading events, A/B: two daemons of this tree, one with
settings.file_watch_fid (events name a directory handle and a file) and one without (a
descriptor per event), their calls alternated in one run. Each runs `git status` in a
read-only workspace whose index is stale (so git reads all 3,000 files), recorded and
unrecorded; printed: medians, the recorded call's extra time, the paired median ratio,
and the daemon's CPU per recorded call.

    .venv/bin/python bench/fid_mode.py [--adapter docker] [-n 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("daemon", "client", "contract", "testing")]

from file_access import git_workspace  # noqa: E402  (bench/, this script's directory)
from sandboxd_testing import make_daemon, prepared_call  # noqa: E402
from sandboxd_contract.canonical import file_accesses  # noqa: E402


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapter", default="docker")
    ap.add_argument("-n", type=int, default=100)
    args = ap.parse_args()
    daemons = {}
    try:
        for mode in ("descriptor", "fid"):
            base = Path(tempfile.mkdtemp(prefix=f"sandboxd-bench-fid-{mode}-", dir="/tmp"))
            base.chmod(0o755)
            d = make_daemon(base, file_watch_fid=mode == "fid").start()
            daemons[mode] = (d, d.client(), git_workspace(d, 3000))
        argv = ["git", "-c", "safe.directory=*", "status", "--short"]
        times = {(m, r): [] for m in daemons for r in (True, False)}
        cpu = {m: 0 for m in daemons}
        paths = {}
        for i in range(args.n + 1):
            order = list(daemons.items()) if i % 2 else list(daemons.items())[::-1]
            for mode, (d, client, ws) in order:
                for record in (True, False) if i % 2 else (False, True):
                    call = prepared_call(ws, argv, {"audit": {"recordFileAccess": record}},
                                         runtime={"adapter": args.adapter, "image": "sandboxd/default:latest"})
                    ticks = cpu_ticks(d.proc.pid)
                    t = time.perf_counter()
                    out = client.run(call)
                    ms = (time.perf_counter() - t) * 1000
                    if out.result.status != "success":
                        raise RuntimeError(out.stderr.decode()[-500:])
                    client.query_calls(page_size=1)  # the index catches up, untimed
                    if not i:
                        continue  # the first round warms caches
                    times[(mode, record)].append(ms)
                    if record:
                        cpu[mode] += cpu_ticks(d.proc.pid) - ticks
                        paths[mode] = sum(len(file_accesses(json.loads(e.payload_json)))
                                          for e in client.get_trace(out.tool_call_id) if e.type == "FileAccessObserved")
        hz = os.sysconf("SC_CLK_TCK")
        print(f"\n`git status`, read-only, stale index, {args.adapter}, n={args.n}; ms\n")
        print(f"| {'file watch':<11} | {'off':>7} | {'on':>7} | {'extra':>6} | {'paired':>7} | {'daemon CPU on':>13} | "
              f"{'paths':>5} |")
        print(f"|{'-' * 13}|{'-' * 9}|{'-' * 9}|{'-' * 8}|{'-' * 9}|{'-' * 15}|{'-' * 7}|")
        for mode in daemons:
            on, off = statistics.median(times[(mode, True)]), statistics.median(times[(mode, False)])
            paired = statistics.median(a / b for a, b in zip(times[(mode, True)], times[(mode, False)]))
            print(f"| {mode:<11} | {off:7.1f} | {on:7.1f} | {on - off:+6.1f} | {paired:6.3f}x | "
                  f"{cpu[mode] * 1000 / hz / args.n:10.1f} ms | {paths[mode]:5d} |")
    finally:
        for d, _, _ in daemons.values():
            d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
