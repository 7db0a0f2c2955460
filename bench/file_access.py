"""File-access recording overhead: a file-heavy workload with audit.recordFileAccess on
versus off, in one run (alternating), on Docker and nsjail. The workspace is a git
repository of N small test modules (one unittest case each); the workloads are
`git status`, a test run (`python3 -m unittest discover` over the N test files), and a
stress case that only imports every module (file opens back to back, nothing else), on
a read-only workspace (the watch alone) and a writable one (the watch and the hashed
before/after walk of the write root). Times are
the whole call, end to end through gRPC; after each call (untimed) a forensic query
waits for the index to catch up, and its time is reported too. "paired" is the median
of each round's on/off ratio (the two ran back to back), with a 95 % bootstrap interval:
on this machine a 30 ms call moves by more than the 10 % target between rounds.

    .venv/bin/python bench/file_access.py [-n 7] [--files 3000] [--only 'nsjail: git status'] [--fid]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("daemon", "client", "contract", "testing")]

from sandboxd_contract.canonical import file_accesses  # noqa: E402
from sandboxd_testing import WORKSPACE_UID, make_daemon, prepared_call  # noqa: E402

TEST_MODULE = """import unittest

VALUE_{i} = {i}


class Test{i}(unittest.TestCase):
    def test_value(self):
        self.assertEqual(VALUE_{i} * 2, {twice})
"""
TEST_RUN = """
import importlib.util, pathlib, sys
n = 0
for p in sorted(pathlib.Path("/workspace/pkg").rglob("*.py")):
    spec = importlib.util.spec_from_file_location(p.stem, p)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    n += 1
print(n, "modules ran")
"""


def git_workspace(d, n_files: int) -> Path:
    """A workspace of `d` holding a git repository of `n_files` unittest modules (in
    packages of 100), committed, then given to the sandbox user: new ctimes, so the
    index is stale for a git that cannot write it (a read-only workspace)."""
    files = {f"pkg/m{i // 100}/test_mod{i}.py": TEST_MODULE.format(i=i, twice=2 * i) for i in range(n_files)}
    files.update({f"pkg/m{i}/__init__.py": "" for i in range((n_files + 99) // 100)})
    files["pkg/__init__.py"] = ""
    ws = d.new_workspace(files)
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "b",
           "GIT_COMMITTER_EMAIL": "b@b"}
    for cmd in (["git", "init", "-q"], ["git", "-c", "safe.directory=*", "add", "-A"],
                ["git", "-c", "safe.directory=*", "commit", "-qm", "x"]):
        subprocess.run(cmd, cwd=ws, check=True, env=env, capture_output=True)
    for dirpath, dirnames, filenames in os.walk(ws):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), WORKSPACE_UID, WORKSPACE_UID)
    return ws


def interval(ratios: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap interval (2.5th to 97.5th percentile) of the median of `ratios`: how far
    the machine's noise leaves the paired figure uncertain. Approximate: with few rounds
    (-n 7 gives 6 ratios) it covers less than 95 %."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return medians[int(resamples * 0.025)], medians[int(resamples * 0.975) - 1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=7)
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--only", default="", help="measure only the rows whose name contains this")
    ap.add_argument("--fid", action="store_true", help="the daemon's file watch in FID mode (settings.file_watch_fid)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="sandboxd-bench-fa-", dir="/tmp"))
    base.chmod(0o755)
    d = make_daemon(base, file_watch_fid=args.fid).start()
    try:
        ws = git_workspace(d, args.files)
        client = d.client()
        workloads = {"git status": ["git", "-c", "safe.directory=*", "status", "--short"],
                     f"test run (unittest, {args.files} test files)": [
                         "python3", "-m", "unittest", "discover", "-q", "-s", "/workspace/pkg", "-t", "/workspace",
                         "-p", "test_*.py"],
                     "stress: import every module": ["python3", "-c", TEST_RUN]}
        rows = []
        mounts = {"read-only": {}, "writable": {"filesystem": {"writeRoots": ["/workspace"]}}}
        for adapter in ("docker", "nsjail"):
            for (name, argv), (mode, fs) in ((w, m) for w in workloads.items() for m in mounts.items()):
                if args.only not in f"{adapter}: {name}, {mode}":
                    continue
                times = {True: [], False: []}
                catch_up = {True: [], False: []}
                events = {True: 0, False: 0}
                for i in range(args.n + 1):
                    for record in (True, False) if i % 2 else (False, True):
                        call = prepared_call(ws, argv, {**fs, "audit": {"recordFileAccess": record}},
                                             runtime={"adapter": adapter, "image": "sandboxd/default:latest"})
                        t = time.perf_counter()
                        out = client.run(call)
                        ms = (time.perf_counter() - t) * 1000
                        if out.result.status != "success":
                            raise RuntimeError(out.stderr.decode()[-500:])
                        # A query first brings the forensic index up to the log's head: its
                        # time is the indexing a call leaves behind, which must not spill
                        # into the next (timed) call.
                        t = time.perf_counter()
                        client.query_calls(page_size=1)
                        if i:  # the first round warms caches
                            times[record].append(ms)
                            catch_up[record].append((time.perf_counter() - t) * 1000)
                        events[record] = sum(len(file_accesses(json.loads(e.payload_json)))
                                             for e in client.get_trace(out.tool_call_id)
                                             if e.type == "FileAccessObserved")
                on, off = statistics.median(times[True]), statistics.median(times[False])
                # Each round ran both, back to back: the median of the rounds' ratios
                # follows the machine's slow and fast spells less than a ratio of medians.
                ratios = [a / b for a, b in zip(times[True], times[False])]
                paired = statistics.median(ratios)
                rows.append((f"{adapter}: {name}, {mode}", off, on, on / off, paired, interval(ratios), events[True],
                             statistics.median(catch_up[True]), statistics.median(catch_up[False])))
        print(f"\nfile-access recording overhead, {args.files} files, n={args.n}"
              f"{', FID mode' if args.fid else ''}; call times in ms\n")
        print("(index on/off: the query after each call, which waits for the forensic index to catch up;")
        print(f" 95 % of paired: a bootstrap interval of the median of the {args.n} rounds' ratios, approximate)\n")
        print(f"| {'workload':<58} | {'off':>8} | {'on':>8} | {'on/off':>7} | {'paired':>7} | {'95 % of paired':>14} "
              f"| {'paths':>6} | {'index on/off':>13} |")
        print(f"|{'-' * 60}|{'-' * 10}|{'-' * 10}|{'-' * 9}|{'-' * 9}|{'-' * 16}|{'-' * 8}|{'-' * 15}|")
        for name, off, on, ratio, paired, (low, high), n_events, idx_on, idx_off in rows:
            print(f"| {name:<58} | {off:8.1f} | {on:8.1f} | {ratio:6.2f}x | {paired:6.2f}x | {low:5.2f} - {high:5.2f}x "
                  f"| {n_events:6d} | {idx_on:5.1f} / {idx_off:5.1f} |")
    finally:
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
