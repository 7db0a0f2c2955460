"""The three wheels installed outside the checkout (docs/INSTALL.md): built by
scripts/build-wheels.sh, installed into a fresh venv, and run from a directory and an
environment that know nothing of the checkout. The installed daemon serves a call on
each backend through the installed sandboxctl and client library, and nothing it
imports or maps comes from the checkout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from sandboxd_testing import TEST_BACKENDS, DaemonProcess, make_daemon

from .conftest import public_tmpdir, stop_and_clean

CHECKOUT = Path(__file__).resolve().parents[2]
WHEELS = ("sandboxd", "sandboxd_client", "sandboxd_contract")


def outside_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment less anything that could lead back to the checkout:
    no PYTHONPATH or VIRTUAL_ENV, no PATH entry inside it, no variable naming it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP") and str(CHECKOUT) not in v}
    env["PATH"] = os.pathsep.join(p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                                  if p and not Path(p).resolve().is_relative_to(CHECKOUT))
    env.update(extra or {})
    return env


def daemon_env() -> dict[str, str]:
    """As the harness gives its daemons, plus PYTHONVERBOSE: every module the daemon
    imports is then logged with the file it came from."""
    return {"PATH": outside_env()["PATH"], "LANG": "C.UTF-8", "PYTHONVERBOSE": "1"}


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, wheel dir, durations): the wheels built from the checkout, installed into a
    venv under /tmp made by the base interpreter (not the dev venv's)."""
    wheels = tmp_path_factory.mktemp("wheels")
    venv = Path(tempfile.mkdtemp(prefix="sandboxd-install-venv-", dir="/tmp"))
    outside = Path(tempfile.mkdtemp(prefix="sandboxd-install-cwd-", dir="/tmp"))
    durations: dict[str, float] = {}
    try:
        t = time.monotonic()
        built = run([str(CHECKOUT / "scripts" / "build-wheels.sh"), str(wheels)], CHECKOUT, outside_env())
        assert built.returncode == 0, built.stderr
        durations["build"] = time.monotonic() - t
        base_python = Path(sys.base_prefix) / "bin" / "python3"
        assert not base_python.resolve().is_relative_to(CHECKOUT)
        t = time.monotonic()
        made = run([str(base_python), "-m", "venv", str(venv)], outside, outside_env())
        assert made.returncode == 0, made.stderr
        pip = run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                   *map(str, sorted(wheels.glob("*.whl")))], outside, outside_env())
        assert pip.returncode == 0, pip.stdout + pip.stderr
        durations["venv+pip"] = time.monotonic() - t
        yield venv, wheels, outside, durations
    finally:
        shutil.rmtree(venv, ignore_errors=True)
        shutil.rmtree(outside, ignore_errors=True)


def wheel_metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        [path] = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(z.read(path).decode())


def test_the_wheels_and_their_requirements(installed):
    _venv, wheels, _outside, _durations = installed
    found = {p.name.split("-")[0]: p for p in wheels.glob("*.whl")}
    assert set(found) == set(WHEELS)
    # The daemon's wheel carries ELF helpers: platform-tagged; the other two are pure.
    assert found["sandboxd"].name.startswith("sandboxd-") and "-py3-none-linux_" in found["sandboxd"].name
    assert found["sandboxd_client"].name.endswith("-py3-none-any.whl")
    # Libraries take ranges; the daemon (an application) pins what the dev venv runs.
    for name in ("sandboxd_client", "sandboxd_contract"):
        # (an extra's marker says `extra == "mcp"`: only the version specifiers count)
        pinned = [r for r in wheel_metadata(found[name]).get_all("Requires-Dist")
                  if any(s.operator == "==" for s in Requirement(r).specifier)]
        assert not pinned, name
    pins = dict(r.split("==") for r in wheel_metadata(found["sandboxd"]).get_all("Requires-Dist"))
    version = wheel_metadata(found["sandboxd_contract"])["Version"]
    assert pins.pop("sandboxd-contract") == version == wheel_metadata(found["sandboxd"])["Version"]
    assert {k: v for k, v in pins.items() if metadata.version(k) != v} == {}
    # The build ran on copies: nothing was left beside the sources.
    for project in ("contract", "client", "daemon"):
        assert not (CHECKOUT / project / "build").exists()
        assert not list((CHECKOUT / project).glob("*.egg-info"))


def test_the_installed_packages_and_commands_are_the_venvs(installed):
    venv, wheels, outside, _durations = installed
    site = site_packages(venv)
    probe = ("import sys, sandboxd, sandboxd_client, sandboxd_contract\n"
             "from sandboxd.core import assets\n"
             "print(sandboxd.__file__, sandboxd_client.__file__, sandboxd_contract.__file__)\n"
             "print(*(assets.packaged(n) for n in (assets.SHIM, assets.FANOTIFY_READER, assets.RELAY_LIBRARY,"
             " assets.CGROUP_EXEC, assets.SECCOMP_PROFILE)))\n"
             "print(*sys.path)\n")
    p = run([str(venv / "bin" / "python"), "-c", probe], outside, outside_env())
    assert p.returncode == 0, p.stderr
    modules, asset_paths, path = (line.split() for line in p.stdout.splitlines())
    assert all(Path(m).is_relative_to(site) for m in modules), modules
    assert all(Path(a).is_relative_to(site / "sandboxd" / "assets") and Path(a).is_file() for a in asset_paths)
    assert all(os.access(a, os.X_OK) for a in asset_paths[:4]), "pip kept the helpers' exec bits"
    assert not [e for e in path if e and Path(e).resolve().is_relative_to(CHECKOUT)], path
    version = wheel_metadata(next(wheels.glob("sandboxd_contract-*.whl")))["Version"]
    for command in ("sandboxd", "sandboxctl"):
        # `--version` is being added beside this test: until the parser knows it, its
        # absence is reported, not failed; once it does, it must print the version.
        usage = run([str(venv / "bin" / command), "--help"], outside, outside_env())
        if "--version" not in usage.stdout:
            warnings.warn(f"{command} has no --version yet")
            continue
        v = run([str(venv / "bin" / command), "--version"], outside, outside_env())
        assert v.returncode == 0 and version in v.stdout + v.stderr, (v.stdout, v.stderr)


def start_installed(venv: Path, d: DaemonProcess, cwd: Path, timeout_s: float = 30.0) -> DaemonProcess:
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen([str(venv / "bin" / "sandboxd"), "--config", str(d.config)], cwd=cwd, env=d.env,
                                  stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert d.proc.poll() is None, f"the installed sandboxd exited with {d.proc.returncode}:\n{d.log()}"
        if d.socket.exists() and d.healthy():
            d.daemon_id = (d.state_dir / "daemon_id").read_text().strip()
            return d
        time.sleep(0.05)
    raise AssertionError(f"the installed sandboxd did not become healthy:\n{d.log()}")


def checkout_files_in_use(pid: int) -> list[str]:
    """What the process maps (shared libraries) or holds open inside the checkout."""
    used = [line.split(None, 5)[5].strip() for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if len(line.split(None, 5)) == 6]
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            used.append(os.readlink(fd))
        except OSError:
            pass
    return sorted({u for u in used if u.startswith(str(CHECKOUT) + "/") or u == str(CHECKOUT)})


def test_the_installed_daemon_serves_both_backends(installed, docker_engine):
    venv, _wheels, outside, durations = installed
    base = public_tmpdir("sandboxd-install-")
    d = make_daemon(base, env=daemon_env())
    assert "PYTHONPATH" not in d.env
    try:
        t = time.monotonic()
        start_installed(venv, d, outside)
        ws = d.new_workspace({"in.txt": "from the workspace\n"})
        ctl = [str(venv / "bin" / "sandboxctl"), "--socket", str(d.socket)]
        for backend in TEST_BACKENDS:
            p = run([*ctl, "exec", "--adapter", backend, "--workspace", str(ws), "--", "sh", "-c",
                     "cat /workspace/in.txt; echo to-stderr >&2; exit 7"], outside, outside_env(), timeout=120)
            assert (p.returncode, p.stdout, p.stderr) == (7, "from the workspace\n", "to-stderr\n"), backend
        library = ("import sys\nfrom sandboxd_client import SandboxdClient\n"
                   "with SandboxdClient(sys.argv[1]) as c:\n"
                   "    o = c.run({'toolId': 't', 'toolVersion': '1', 'argv': ['sh', '-c', 'echo lib; exit 3'],"
                   " 'workspace': sys.argv[2], 'authorization': {'status': 'not_required'},"
                   " 'runtime': {'adapter': sys.argv[3]}})\n"
                   "print(o.result.status, o.result.exit_code, o.stdout.decode().strip())\n")
        for backend in TEST_BACKENDS:
            p = run([str(venv / "bin" / "python"), "-c", library, str(d.socket), str(ws), backend], outside,
                    outside_env(), timeout=120)
            assert (p.returncode, p.stdout.split()) == (0, ["error", "3", "lib"]), (backend, p.stdout, p.stderr)
        durations["daemon+calls"] = time.monotonic() - t
        assert d.proc is not None
        maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
        site_assets = f"{site_packages(venv)}/sandboxd/assets/"
        assert site_assets + "libsandboxd-relay.so" in maps and site_assets + "libsandboxd-fanotify.so" in maps
        assert checkout_files_in_use(d.proc.pid) == []
        assert d.stop(signal.SIGTERM) == 0, d.log()
        log = d.log_path.read_text()
        # Every module the daemon imported, with the file it came from (PYTHONVERBOSE):
        # its own from the venv, none from the checkout.
        assert f"{site_assets[:-len('assets/')]}main.py" in log
        assert str(CHECKOUT) not in log
    finally:
        stop_and_clean(d, docker_engine, base)
    print("\ninstall test durations (s): " + ", ".join(f"{k} {v:.1f}" for k, v in durations.items()))
