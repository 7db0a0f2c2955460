"""Artifact collection cost: what keeping a call's changed files (`file` artifacts) and
its `diff` artifact adds to the call, against the same call on a daemon with both off
(`artifacts: {collect_files: false, diff: false}`). Two daemons run side by side; each
round runs the same call on both, back to back in alternating order, on Docker and on
nsjail (the call's runtime.adapter), each run in a fresh writable workspace
(writeRoots: /workspace). Two calls:

- created: writes 100 text files of 10 KB and one binary file of 100 MB (101 file
  artifacts; the diff has the 100 text files and names the large one, which is over
  diff_max_file_kb);
- edited: the workspace holds 100 text files of 10 KB; the call appends a line to each
  (100 file artifacts; the diff has 100 text hunks against the baseline's copies).

Every run's content is its own (a token in it): nothing is deduplicated by the blob
store or the baseline across runs. Times are the client's wall time of the Run RPC.
After each call (untimed) the forensic index is caught up, the workspace removed and
the page cache's dirty pages written out, so that no call's leftovers land in the next
one's time. With collection on, every run is checked: the expected number of file
artifacts, one diff with one hunk per text file, nothing omitted; with it off, none.
"paired" is the median of the rounds' on/off ratios, with a bootstrap interval.

    .venv/bin/python bench/artifact_collection.py [-n 5] [--backends docker,nsjail]
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("daemon", "client", "contract", "testing")]

from sandboxd_testing import DaemonProcess, make_daemon, prepared_call  # noqa: E402

SMALL_FILES = 100
SMALL_BYTES = 10 * 1024
LARGE_MB = 100
WRITABLE = {"filesystem": {"writeRoots": ["/workspace"]}}
OFF = {"collect_files": False, "diff": False}

# argv[1]: the run's token, in every file (no two runs write the same bytes).
CREATE = f"""
import os, sys
token = sys.argv[1]
os.makedirs("/workspace/small")
for i in range({SMALL_FILES}):
    line = f"file {{i}} of run {{token}}: some text to diff\\n"
    with open(f"/workspace/small/f{{i:03d}}.txt", "w") as f:
        f.write((line * ({SMALL_BYTES} // len(line) + 1))[:{SMALL_BYTES}])
with open("/workspace/large.bin", "wb") as f:
    f.write(token.encode().ljust(1 << 20, b"\\0"))
    zeros = bytes(1 << 20)
    for _ in range({LARGE_MB} - 1):
        f.write(zeros)
"""
APPEND = f"""
import sys
for i in range({SMALL_FILES}):
    with open(f"/workspace/src/f{{i:03d}}.txt", "a") as f:
        f.write(f"appended by run {{sys.argv[1]}}\\n")
"""


def text_file(i: int, token: str) -> str:
    line = f"line of file {i} in workspace {token}\n"
    return (line * (SMALL_BYTES // len(line) + 1))[:SMALL_BYTES]


@dataclass(frozen=True)
class Scenario:
    name: str
    script: str
    file_artifacts: int  # expected with collection on
    text_hunks: int  # expected in the diff
    seeded: bool  # the workspace starts with the 100 text files (src/)
    named: tuple[str, ...] = ()  # paths the diff must name (not diff)

    def workspace(self, d: DaemonProcess, token: str) -> Path:
        if not self.seeded:
            return d.new_workspace()
        return d.new_workspace({f"src/f{i:03d}.txt": text_file(i, token) for i in range(SMALL_FILES)})


SCENARIOS = (
    Scenario(f"created: {SMALL_FILES} x 10 KB + 1 x {LARGE_MB} MB", CREATE, SMALL_FILES + 1, SMALL_FILES,
             seeded=False, named=("workspace/large.bin",)),
    Scenario(f"edited: {SMALL_FILES} x 10 KB text (append a line)", APPEND, SMALL_FILES, SMALL_FILES,
             seeded=True),
)


@dataclass
class Row:
    name: str
    times: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    files: int = 0
    diff_bytes: int = 0
    collected_mb: float = 0.0


def download(client, artifact_id: str) -> bytes:
    sink = io.BytesIO()
    client.download_artifact(artifact_id, sink)
    return sink.getvalue()


def check_collected(client, out, scenario: Scenario, row: Row) -> None:
    """Fails loudly unless the call left what collection should have kept."""
    arts = list(out.result.artifacts)
    files = [a for a in arts if a.kind == "file"]
    diffs = [a for a in arts if a.kind == "diff"]
    if len(files) != scenario.file_artifacts or len(diffs) != 1 or list(out.result.artifacts_omitted):
        raise RuntimeError(f"{scenario.name}: {len(files)} file artifacts (expected {scenario.file_artifacts}), "
                           f"{len(diffs)} diffs (expected 1), omitted: {list(out.result.artifacts_omitted)}")
    text = download(client, diffs[0].artifact_id).decode(errors="replace")
    hunks = sum(1 for line in text.splitlines() if line.startswith("@@ "))
    missing = [p for p in scenario.named if p not in text]
    if hunks != scenario.text_hunks or missing:
        raise RuntimeError(f"{scenario.name}: the diff has {hunks} hunks (expected {scenario.text_hunks}); "
                           f"not named: {missing}\n{text[:2000]}")
    row.files, row.diff_bytes = len(files), diffs[0].size_bytes
    row.collected_mb = sum(a.size_bytes for a in files) / 2**20


def check_not_collected(out, scenario: Scenario) -> None:
    kinds = {a.kind for a in out.result.artifacts}
    if kinds & {"file", "diff"}:
        raise RuntimeError(f"{scenario.name}: collection is off, yet the call left {sorted(kinds)}")


def run_once(d: DaemonProcess, client, adapter: str, scenario: Scenario, collect: bool, row: Row) -> float:
    """One call in a fresh workspace: its Run RPC's wall time in ms (checked, then cleaned up)."""
    token = uuid.uuid4().hex
    ws = scenario.workspace(d, token)
    call = prepared_call(ws, ["python3", "-c", scenario.script, token], WRITABLE,
                         runtime={"adapter": adapter, "image": "sandboxd/default:latest"})
    start = time.perf_counter()
    out = client.run(call)
    ms = (time.perf_counter() - start) * 1000
    if out.result.status != "success":
        raise RuntimeError(f"{adapter}, {scenario.name}: {out.result.status}\n{out.stderr.decode()[-1000:]}")
    if collect:
        check_collected(client, out, scenario, row)
    else:
        check_not_collected(out, scenario)
    # Untimed: the forensic index catches up, the workspace goes, and the dirty pages
    # (the 100 MB file, the blobs) are written out now rather than during the next call.
    client.query_calls(page_size=1)
    shutil.rmtree(ws)
    os.sync()
    return ms


def measure(daemons: dict[bool, DaemonProcess], clients: dict, adapter: str, scenario: Scenario,
            rounds: int) -> Row:
    row = Row(f"{adapter}: {scenario.name}")
    for i in range(rounds + 1):  # round 0 warms caches (the image, the rootfs) and is not kept
        for collect in (True, False) if i % 2 else (False, True):
            ms = run_once(daemons[collect], clients[collect], adapter, scenario, collect, row)
            if i:
                row.times[collect].append(ms)
    return row


def interval(ratios: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap interval (2.5th to 97.5th percentile) of the median of `ratios`;
    approximate: with 5 rounds it covers less than 95 %."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return medians[int(resamples * 0.025)], medians[int(resamples * 0.975) - 1]


def print_table(rows: list[Row], rounds: int) -> None:
    print(f"\nartifact collection cost, n={rounds} paired rounds; Run RPC wall time in ms")
    print("(off: collect_files and diff off; on: the defaults; paired: median of the rounds' on/off ratios,")
    print(" with a bootstrap interval of it; files: file artifacts per call, MB: their bytes; diff: its KB)\n")
    print(f"| {'call':<52} | {'off':>8} | {'on':>8} | {'on/off':>7} | {'paired':>7} | {'interval':>14} "
          f"| {'files':>5} | {'MB':>6} | {'diff':>6} |")
    print(f"|{'-' * 54}|{'-' * 10}|{'-' * 10}|{'-' * 9}|{'-' * 9}|{'-' * 16}|{'-' * 7}|{'-' * 8}|{'-' * 8}|")
    for row in rows:
        on, off = statistics.median(row.times[True]), statistics.median(row.times[False])
        ratios = [a / b for a, b in zip(row.times[True], row.times[False])]
        low, high = interval(ratios)
        print(f"| {row.name:<52} | {off:8.1f} | {on:8.1f} | {on / off:6.2f}x | {statistics.median(ratios):6.2f}x "
              f"| {low:5.2f} - {high:5.2f}x | {row.files:5d} | {row.collected_mb:6.1f} | {row.diff_bytes / 1024:6.0f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5, help="paired rounds per row (after one warm-up round)")
    ap.add_argument("--backends", default="docker,nsjail", help="the calls' runtime.adapter, comma-separated")
    args = ap.parse_args()
    # nsjail mounts as the sandbox user: the workspaces' parents must be traversable.
    base = Path(tempfile.mkdtemp(prefix="sandboxd-bench-collect-", dir="/tmp"))
    base.chmod(0o755)
    daemons = {True: make_daemon(base / "on"), False: make_daemon(base / "off", artifacts=OFF)}
    clients = {}
    try:
        for collect, d in daemons.items():
            d.start()
            clients[collect] = d.client()
        rows = [measure(daemons, clients, adapter, scenario, args.n)
                for adapter in args.backends.split(",") for scenario in SCENARIOS]
        print_table(rows, args.n)
    finally:
        for client in clients.values():
            client.close()
        for d in daemons.values():
            d.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
