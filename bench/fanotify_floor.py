"""What fanotify's events cost a file-heavy command before the daemon does anything with
them: the floor under the file-access recording's overhead (bench/file_access.py).

On the host, outside any sandbox, in a bind mount of its own (the kind of mount a
sandbox's workspace is), each workload runs in rounds, each way once per round, in a shuffled order:
- off: no mark;
- kernel only: the mount marked as a call's watch marks it (FAN_OPEN | FAN_CLOSE_WRITE),
  nothing reading while the command runs; the queued events are dropped after: the
  cost each open pays in the command's own context (an event made and queued). Not
  quite the floor: a queue left to grow cost the command more here than one the
  reader keeps short;
- the same with FID mode's event format (FAN_REPORT_DFID_NAME: the directory's handle
  and the name, made in the command's context, instead of a reference to its path);
- reader: the daemon's own FileWatch, reading as the command runs, as calls use it
  (its stop, which drains and exports, in its own column).

Workloads: `git status --short` over a stale index of N files that it may not refresh
(GIT_OPTIONAL_LOCKS=0: every file is opened and hashed, as in a read-only workspace),
and `cat` of the N files.

    .venv/bin/python bench/fanotify_floor.py [-n 31] [--files 3000]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "daemon")]

from sandboxd.recording.filewatch import (AT_FDCWD, FAN_CLASS_NOTIF, FAN_CLOEXEC, FAN_CLOSE_WRITE, FAN_MARK_ADD,  # noqa: E402
                                FAN_MARK_MOUNT, FAN_NONBLOCK, FAN_OPEN, FAN_REPORT_DFID_NAME, FAN_UNLIMITED_QUEUE,
                                FileWatch)
from sandboxd.recording.libc import libc  # noqa: E402

GIT_ENV = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b",
           "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@b"}


def make_tree(root: Path, n_files: int) -> None:
    """A git repository of `n_files` small modules, committed, then chowned (new ctimes:
    the index is stale for every file)."""
    for i in range(n_files):
        path = root / f"pkg/m{i // 100}/mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"VALUE_{i} = {i}\n")
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "x"]):
        subprocess.run(cmd, cwd=root, check=True, env=GIT_ENV, capture_output=True)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), 1000, 1000)


def timed(argv: list[str], cwd: Path) -> float:
    t = time.perf_counter()
    subprocess.run(argv, cwd=cwd, env=GIT_ENV, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return (time.perf_counter() - t) * 1000


def kernel_only(argv: list[str], mount: Path, fid: bool) -> float:
    """The command under a mark nobody reads until it has ended."""
    flags = FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK | FAN_UNLIMITED_QUEUE | (FAN_REPORT_DFID_NAME if fid else 0)
    fd = libc().fanotify_init(flags, os.O_RDONLY | os.O_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "fanotify_init")
    try:
        if libc().fanotify_mark(fd, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_OPEN | FAN_CLOSE_WRITE, AT_FDCWD,
                               os.fsencode(mount)) < 0:
            raise OSError(ctypes.get_errno(), f"fanotify_mark {mount}")
        return timed(argv, mount)
    finally:
        os.close(fd)  # the queued events go with the group


def with_reader(argv: list[str], mount: Path) -> tuple[float, float, int]:
    watch = FileWatch(os.getpid(), (str(mount),))
    watch.start()
    try:
        ms = timed(argv, mount)
    except BaseException:
        watch.stop()
        raise
    t = time.perf_counter()
    paths = watch.stop()
    return ms, (time.perf_counter() - t) * 1000, len(paths)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=31)
    ap.add_argument("--files", type=int, default=3000)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="sandboxd-bench-floor-", dir="/tmp"))
    mount = base / "tree"
    mount.mkdir()
    make_tree(mount, args.files)
    subprocess.run(["mount", "--bind", str(mount), str(mount)], check=True)
    try:
        workloads = {"git status, stale index": ["git", "-c", "safe.directory=*", "status", "--short"],
                     f"cat {args.files} files": ["/bin/sh", "-c", "cat pkg/*/*.py > /dev/null"]}
        rows = []
        rng = random.Random(0)
        for name, argv in workloads.items():
            times: dict[str, list[float]] = {k: [] for k in ("off", "kernel", "kernel-fid", "reader", "stop")}
            paths = 0
            for i in range(args.n + 1):
                round_: dict[str, float] = {}
                ways = ["off", "kernel", "kernel-fid", "reader"]
                rng.shuffle(ways)  # no way always first after another
                for way in ways:
                    if way == "reader":
                        round_["reader"], round_["stop"], paths = with_reader(argv, mount)
                    else:
                        round_[way] = timed(argv, mount) if way == "off" else kernel_only(argv, mount, way == "kernel-fid")
                if i:  # the first round warms caches
                    for k, v in round_.items():
                        times[k].append(v)
            off = times["off"]
            times["reader+stop"] = [a + b for a, b in zip(times["reader"], times["stop"])]
            paired = {k: statistics.median(a / b for a, b in zip(times[k], off))
                      for k in ("kernel", "kernel-fid", "reader", "reader+stop")}
            rows.append((name, statistics.median(off), *(statistics.median(times[k]) for k in ("kernel", "kernel-fid",
                                                                                                 "reader", "stop")),
                         paired, paths))
        print(f"\nfanotify's floor, on the host, {args.files} files, n={args.n}; ms, (paired: median of each round's "
              "ratio to off)\n")
        print(f"| {'workload':<24} | {'off':>6} | {'kernel only':>16} | {'kernel only, FID':>16} "
              f"| {'reader':>16} | {'stop':>5} | {'reader + stop':>13} | {'paths':>5} |")
        print(f"|{'-' * 26}|{'-' * 8}|{'-' * 18}|{'-' * 18}|{'-' * 18}|{'-' * 7}|{'-' * 15}|{'-' * 7}|")
        for name, off, kernel, kernel_fid, reader, stop, paired, paths in rows:
            cells = [f"{ms:6.1f} ({paired[k]:4.2f}x)" for ms, k in ((kernel, "kernel"), (kernel_fid, "kernel-fid"),
                                                                  (reader, "reader"))]
            print(f"| {name:<24} | {off:6.1f} | {cells[0]:>16} | {cells[1]:>16} | {cells[2]:>16} | {stop:5.1f} "
                  f"| {paired['reader+stop']:12.2f}x | {paths:5d} |")
    finally:
        subprocess.run(["umount", str(mount)], check=False)
        subprocess.run(["rm", "-rf", str(base)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
