"""A workspace root swapped for a symlink between the host checks and the mount (the
red-team's finding: renameat2(RENAME_EXCHANGE) every millisecond while calls run). The
engine must only ever mount the inode that was checked: each call either sees the
workspace's own directory or is refused, on both backends, for read and write roots."""

from __future__ import annotations

import ctypes
import os
import tempfile
import threading
from pathlib import Path

import pytest

from sandboxd_client import errors

from .conftest import WORKSPACE_UID, call, sh

RENAME_EXCHANGE = 2
CALLS = 24
MAX_CALLS = 3 * CALLS  # a slow machine may refuse every call of a run; go on until one ran
HOLD_EVERY = 16  # after this many exchanges (an even number: `data` is itself again) ...
HOLD_S = 0.03  # ... it stays for as long as a call's checks and mounts take, so some calls run


def _exchange(dir_fd: int, a: str, b: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.renameat2(dir_fd, a.encode(), dir_fd, b.encode(), RENAME_EXCHANGE)


class Swapper:
    """Swaps `data` and `link` (a symlink out of the workspace) as fast as it can."""

    def __init__(self, workspace: Path):
        self._fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        exchanges = 0
        while not self._stop.is_set():
            _exchange(self._fd, "data", "link")
            exchanges += 1
            self._stop.wait(HOLD_S if exchanges % HOLD_EVERY == 0 else 0.0005)

    def __enter__(self) -> "Swapper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if os.path.islink(f"/proc/self/fd/{self._fd}/data"):
            _exchange(self._fd, "data", "link")
        os.close(self._fd)


@pytest.fixture
def swap_setup(daemon, client):
    """A workspace whose `data` alternates with a symlink to a directory the workspace
    owner may not reach on the host (Docker mounts as root) or that lies outside the
    workspace (nsjail mounts as the sandbox user, who can reach it)."""
    outside = Path(tempfile.mkdtemp(prefix=f"outside-{client.adapter}-", dir=daemon.base))
    if client.adapter == "docker":
        (outside / "inner").mkdir()
        outside.chmod(0o700)  # root's: uid 1000 cannot traverse it on the host
        target = outside / "inner"
    else:
        outside.chmod(0o755)
        target = outside
    (target / "secret.txt").write_text("OUTSIDE-THE-WORKSPACE\n")
    os.chown(target, WORKSPACE_UID, WORKSPACE_UID)
    target.chmod(0o777)
    ws = daemon.new_workspace({"data/mine.txt": "mine\n"})
    os.symlink(str(target), ws / "link")
    return ws, target


def _ran(outputs: list) -> bool:
    return any(r.result.exit_code == 0 and b"mine" in r.stdout for r in outputs)


def _attempts(client, ws: Path, policy: dict, argv: list[str]) -> tuple[list, int]:
    outputs, refused = [], 0
    with Swapper(ws):
        while len(outputs) + refused < CALLS or (not _ran(outputs) and len(outputs) + refused < MAX_CALLS):
            try:
                outcome = client.run(call(ws, argv, policy))
                if "changed after it was checked" in outcome.result.error.message:
                    assert outcome.result.error.code == "FAILED_PRECONDITION", outcome.result.error
                    refused += 1  # found at the mount: refused with nothing run
                else:
                    outputs.append(outcome)
            except (errors.FailedPrecondition, errors.PermissionDenied) as exc:
                assert "policy.filesystem" in exc.message or "changed after it was checked" in exc.message, exc
                refused += 1
    return outputs, refused


def test_a_swapped_read_root_never_mounts_what_it_was_swapped_for(daemon, client, swap_setup):
    ws, target = swap_setup
    outputs, refused = _attempts(client, ws, {"filesystem": {"readRoots": ["/workspace/data"]}},
                                 sh("cat /workspace/data/secret.txt /workspace/data/mine.txt 2>/dev/null; true"))
    leaked = [r.stdout for r in outputs if b"OUTSIDE" in r.stdout]
    assert not leaked, f"{len(leaked)} of {len(outputs) + refused} calls read the file outside the workspace"
    assert all(r.stdout == b"mine\n" for r in outputs), [
        (r.result.status, r.result.error.message, r.stdout) for r in outputs if r.stdout != b"mine\n"]
    assert any(r.stdout == b"mine\n" for r in outputs), "no call ran: the test proves nothing"
    assert not list(Path(daemon.base, "runtime", "mounts").glob("*")), "staged mounts left behind"


def test_a_swapped_write_root_never_writes_where_it_was_swapped_for(daemon, client, swap_setup):
    ws, target = swap_setup
    outputs, refused = _attempts(client, ws, {"filesystem": {"writeRoots": ["/workspace/data"]}},
                                 sh("echo planted > $(mktemp /workspace/data/planted-XXXXXX) && ls /workspace/data"))
    assert not list(target.glob("planted-*")), "a call wrote into the directory outside the workspace"
    assert any(b"mine.txt" in r.stdout for r in outputs), "no call ran: the test proves nothing"
    assert len(list((ws / "data").glob("planted-*"))) == sum(r.result.exit_code == 0 for r in outputs)

