"""`sandboxctl cp` throughput: one 100 MB file into and out of a leased Docker sandbox's
workspace, against `docker cp` of the same file into and out of a plain container of the
same image (sandboxd/default:latest, `sleep infinity`, a host directory bound at
/workspace so that both land on the same kind of storage), in the same run; and, as the
equally durable baseline of an upload, `docker cp` followed by sync(2). The
in-process client (`SandboxdClient.upload` / `download` on the same lease, no process
start) is timed beside them, so that the CLI's Python start-up shows; a 1 KB upload of
each path shows that fixed cost alone.

A round runs every path once per row, the order reversed every other round; one
uncounted round first. Before each upload its destination is removed (untimed), after
each download the local copy is checked (size; sha256 in the first round) and removed,
and dirty pages are written out (untimed), so that no path pays for another's leftovers.
Note what is not alike: an upload through sandboxd is written as the sandbox's user and
fsynced before it is renamed into place (it lands whole or not at all) and every
download's sha256 is checked by the client; `docker cp` does neither.

    .venv/bin/python bench/transfer_cp.py [-n 5] [--mb 100]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("daemon", "client", "contract", "testing")]

from sandboxd_client import SandboxdClient  # noqa: E402
from sandboxd_client.transfer import target  # noqa: E402
from sandboxd_testing import make_daemon  # noqa: E402

IMAGE = "sandboxd/default:latest"
SANDBOXCTL = str(Path(sys.executable).with_name("sandboxctl"))
WRITABLE = {"filesystem": {"writeRoots": ["/workspace"]}}
PATHS = ("sandboxctl cp", "client in-process", "docker cp")
# docker cp does not fsync: this one syncs after it, as durable as sandboxd's upload.
SYNCED = "docker cp + sync"
UPLOAD_PATHS = PATHS + (SYNCED,)


def run(argv: list[str]) -> None:
    out = subprocess.run(argv, capture_output=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {out.returncode}\n{out.stderr.decode()[-2000:]}")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def random_file(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 1 << 20))
            f.write(chunk)
            left -= len(chunk)
    return path


@dataclass
class Row:
    name: str
    size: int
    paths: tuple[str, ...] = PATHS
    times: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.times = {p: [] for p in self.paths}


@dataclass
class Setup:
    """The lease, its workspace on the host, the plain container and its bound directory."""

    socket: str
    client: SandboxdClient
    lease_id: str
    lease_ws: Path
    container: str
    container_ws: Path
    local: Path  # downloads land here

    def upload_ops(self, source: Path) -> dict[str, Callable[[], None]]:
        name = source.name

        def docker_synced() -> None:
            run(["docker", "cp", str(source), f"{self.container}:/workspace/{name}"])
            os.sync()
        return {
            SYNCED: docker_synced,
            "sandboxctl cp": lambda: run([SANDBOXCTL, "--socket", self.socket, "cp", str(source),
                                          f"{self.lease_id}:/workspace/{name}"]),
            "client in-process": lambda: self.client.upload(target(lease_id=self.lease_id), f"/workspace/{name}",
                                                            source),
            "docker cp": lambda: run(["docker", "cp", str(source), f"{self.container}:/workspace/{name}"]),
        }

    def landed_upload(self, path: str, name: str) -> Path:
        return (self.container_ws if path.startswith("docker") else self.lease_ws) / name

    def download_ops(self, name: str) -> dict[str, Callable[[], None]]:
        dest = self.local / name
        return {
            "sandboxctl cp": lambda: run([SANDBOXCTL, "--socket", self.socket, "cp",
                                          f"{self.lease_id}:/workspace/{name}", str(dest)]),
            "client in-process": lambda: self.client.download(target(lease_id=self.lease_id), f"/workspace/{name}",
                                                              dest),
            "docker cp": lambda: run(["docker", "cp", f"{self.container}:/workspace/{name}", str(dest)]),
        }


def timed(op: Callable[[], None]) -> float:
    start = time.perf_counter()
    op()
    return (time.perf_counter() - start) * 1000


def measure_upload(s: Setup, source: Path, digest: str, rounds: int) -> Row:
    row = Row(f"upload {source.stat().st_size // 1024} KB" if source.stat().st_size < 1 << 20
              else f"upload {source.stat().st_size >> 20} MB", source.stat().st_size, UPLOAD_PATHS)
    ops = s.upload_ops(source)
    for i in range(rounds + 1):  # round 0 warms caches and is not kept
        for path in UPLOAD_PATHS if i % 2 else reversed(UPLOAD_PATHS):
            landed = s.landed_upload(path, source.name)
            landed.unlink(missing_ok=True)
            os.sync()
            ms = timed(ops[path])
            if landed.stat().st_size != row.size or (i == 0 and sha256(landed) != digest):
                raise RuntimeError(f"{path}: {landed} is not the file sent")
            if i:
                row.times[path].append(ms)
    return row


def measure_download(s: Setup, source: Path, digest: str, rounds: int) -> Row:
    """The file each side already holds (the upload rows left it there)."""
    row = Row(f"download {source.stat().st_size >> 20} MB", source.stat().st_size)
    ops = s.download_ops(source.name)
    dest = s.local / source.name
    for i in range(rounds + 1):
        for path in PATHS if i % 2 else reversed(PATHS):
            ms = timed(ops[path])
            if dest.stat().st_size != row.size or (i == 0 and sha256(dest) != digest):
                raise RuntimeError(f"{path}: {dest} is not the file in the sandbox")
            dest.unlink()
            os.sync()
            if i:
                row.times[path].append(ms)
    return row


def print_table(rows: list[Row], rounds: int) -> None:
    print(f"\nsandboxctl cp against docker cp, leased Docker sandbox vs plain container of {IMAGE}; "
          f"n={rounds} rounds, medians")
    print("(MB/s: the file's MiB over the median; ratio: the median against docker cp's, lower is faster)\n")
    print(f"| {'row':<16} | {'path':<18} | {'median ms':>9} | {'MB/s':>7} | {'vs docker cp':>12} |")
    print(f"|{'-' * 18}|{'-' * 20}|{'-' * 11}|{'-' * 9}|{'-' * 14}|")
    for row in rows:
        docker = statistics.median(row.times["docker cp"])
        for path in row.paths:
            ms = statistics.median(row.times[path])
            rate = row.size / 2**20 / (ms / 1000)
            print(f"| {row.name:<16} | {path:<18} | {ms:9.1f} | {rate:7.1f} | {ms / docker:11.2f}x |")


def start_container(host_dir: Path) -> str:
    name = f"sandboxd-bench-cp-{uuid.uuid4().hex[:12]}"
    run(["docker", "run", "-d", "--name", name, "--label", "sandboxd.bench=transfer_cp",
         "-v", f"{host_dir}:/workspace", IMAGE, "sleep", "infinity"])
    return name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5, help="rounds per row (after one warm-up round)")
    ap.add_argument("--mb", type=int, default=100, help="the large file's size in MiB")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="sandboxd-bench-cp-", dir="/tmp"))
    base.chmod(0o755)
    d = make_daemon(base / "daemon")
    container, lease_id = "", ""
    client: SandboxdClient | None = None
    try:
        d.start()
        client = d.client()
        ws = d.new_workspace()
        lease_id = client.acquire_sandbox(str(ws), WRITABLE, image=IMAGE, adapter="docker").lease_id
        (base / "plain").mkdir()
        container = start_container(base / "plain")
        (base / "local").mkdir()
        s = Setup(str(d.socket), client, lease_id, ws, container, base / "plain", base / "local")
        big = random_file(base / "big.bin", args.mb << 20)
        small = random_file(base / "small.bin", 1024)
        rows = [measure_upload(s, small, sha256(small), args.n), measure_upload(s, big, sha256(big), args.n),
                measure_download(s, big, sha256(big), args.n)]
        print_table(rows, args.n)
    finally:
        if client is not None and lease_id:
            client.release_sandbox(lease_id)
        if client is not None:
            client.close()
        if container:
            subprocess.run(["docker", "rm", "-f", container], capture_output=True, timeout=60)
        d.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
