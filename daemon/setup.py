"""The daemon's wheel carries native helpers (sandboxd/assets, built by `make native`),
so it is tagged for the platform they were built on, never py3-none-any; and it is
refused without them rather than built into a daemon that cannot start a sandbox.
Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel

# core/assets.py names the same files; the daemon looks for them beside the package.
NATIVE_ASSETS = ("sandbox-shim", "libsandboxd-fanotify.so", "libsandboxd-relay.so", "sandboxd-cgroup-exec",
                 "seccomp/sandboxd-docker.json")
ASSETS_DIR = Path(__file__).resolve().parent / "sandboxd" / "assets"


class NativeDistribution(Distribution):
    """Says it has extension modules: the package then installs to platlib, at the
    wheel's root (not under .data/purelib), and bdist_wheel treats it as impure."""

    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    """py3-none-<platform>: the ELF helpers tie the wheel to the platform, but nothing
    ties it to one CPython ABI (the helpers are loaded with ctypes or executed)."""

    def get_tag(self) -> tuple[str, str, str]:
        _python, _abi, platform = super().get_tag()
        return "py3", "none", platform

    def run(self) -> None:
        missing = [name for name in NATIVE_ASSETS if not (ASSETS_DIR / name).is_file()]
        if missing:
            raise SystemExit(f"sandboxd's native helpers are missing from {ASSETS_DIR}: {', '.join(missing)} "
                             "(run `make native` first)")
        super().run()


setup(distclass=NativeDistribution, cmdclass={"bdist_wheel": PlatformWheel})
