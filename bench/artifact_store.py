"""Artifact store throughput: the local blob store against the S3 store on loopback
(SeaweedFS, `weed server -s3`, started here), in one process, the same blobs.

write: local = `LocalBlobStore.put` of a finished spool file (fsynced; what a call waits
for in both configurations); S3 = `S3BlobStore.upload` of it (sha256 + MD5 pass, PUT,
HEAD: what the uploader does behind the call). read: `open` + read to the end, the
sha256 verified, from each store. Medians of -n runs, MB/s, and S3 / local.

Usage: .venv/bin/python bench/artifact_store.py [-n 5] [--sizes 1,100]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from seaweed import BUCKET, SeaweedS3  # noqa: E402  (the tests' server helper)

from sandboxd.core.settings import ArtifactSettings  # noqa: E402
from sandboxd.ledger.blobs import LocalBlobStore  # noqa: E402
from sandboxd.ledger.s3_blobs import s3_store  # noqa: E402


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def read_all(f) -> None:
    with f:
        while f.read(1024 * 1024):
            pass


def measure(size_mb: int, runs: int, work: Path, local: LocalBlobStore, s3) -> dict[str, float]:
    """Median MB/s of each path for blobs of `size_mb` (a fresh blob per run: no dedup)."""
    times: dict[str, list[float]] = {"local write": [], "S3 write": [], "local read": [], "S3 read": []}
    for run in range(runs):
        data = os.urandom(size_mb * 1024 * 1024)
        content_hash = "sha256:" + hashlib.sha256(data).hexdigest()
        spool = work / f"spool-{size_mb}-{run}"
        spool.write_bytes(data)
        times["local write"].append(timed(lambda: local.put(spool, content_hash)))
        times["S3 write"].append(timed(lambda: s3.upload(local.path(content_hash), content_hash)))
        times["local read"].append(timed(lambda: read_all(local.open(content_hash))))
        times["S3 read"].append(timed(lambda: read_all(s3.open(content_hash))))
        local.remove(content_hash)
        s3.remove(content_hash)
    return {name: size_mb / statistics.median(t) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=5, help="runs per size (median)")
    parser.add_argument("--sizes", default="1,100", help="blob sizes in MB, comma-separated")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="sandboxd-bench-s3-"))
    (base / "weed").mkdir()
    server = SeaweedS3(base / "weed").start()
    try:
        creds = base / "credentials"
        settings = ArtifactSettings(**server.artifact_settings(creds, prefix="bench/"))
        assert settings.bucket == BUCKET
        s3 = s3_store(settings)
        local = LocalBlobStore(base / "blobs")
        print(f"artifact store throughput, MB/s (median of {args.n}); S3 = SeaweedFS on loopback")
        print(f"{'size':>7} | {'local write':>11} | {'S3 write':>9} | {'ratio':>6} | {'local read':>10} | "
              f"{'S3 read':>8} | {'ratio':>6}")
        for size in (int(s) for s in args.sizes.split(",")):
            r = measure(size, args.n, base, local, s3)
            print(f"{size:>4} MB | {r['local write']:>11.0f} | {r['S3 write']:>9.0f} | "
                  f"{r['S3 write'] / r['local write']:>5.2f}x | {r['local read']:>10.0f} | {r['S3 read']:>8.0f} | "
                  f"{r['S3 read'] / r['local read']:>5.2f}x")
        s3.close()
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
