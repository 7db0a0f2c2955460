"""What nsjail's side of the host throws (OSError from descriptors, pipes, cgroup files
and spawns; a subprocess's timeout; a cgroup hierarchy or seccomp profile the host
cannot give) translated into the daemon's errors here and nowhere else. (dockerd's, met
while exporting images, are backends/docker/errors.py's.)"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

from sandboxd.backends.cgroups import CgroupUnavailable
from sandboxd.backends.nsjail.seccomp_bpf import ProfileError
from sandboxd.core.errors import InternalError, SandboxdError


@contextlib.contextmanager
def host_step(doing: str, *, fault: type[SandboxdError] = InternalError) -> Iterator[None]:
    """One step of making or running a jail: a host failure becomes `fault` ("cannot
    <doing>: <why>"); the daemon's own errors pass as they are."""
    try:
        yield
    except SandboxdError:
        raise
    except subprocess.TimeoutExpired as exc:
        raise fault(f"cannot {doing}: {exc.cmd[0] if exc.cmd else 'it'} did not finish in {exc.timeout:g} s") from None
    except (OSError, CgroupUnavailable, ProfileError, UnicodeDecodeError) as exc:
        raise fault(f"cannot {doing}: {exc}") from None
