"""A FIFO where a setting names a file, and a guard for code that might open it for
reading and block there (a daemon's start, or `sandboxd check`, hung for good): the
code runs on a thread; if it has not finished in time, the FIFO is opened for writing
and closed, which ends the blocked open with an EOF, and the test fails."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HANG_S = 5.0


def make_fifo(path: Path, mode: int = 0o600) -> Path:
    os.mkfifo(path, mode)
    os.chmod(path, mode)
    return path


def finishes(fifo: Path, fn: Callable[[], Any], timeout_s: float = HANG_S) -> Any:
    """fn()'s result (or its exception, raised here), unless it blocks on `fifo`."""
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            done["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        for _ in range(50):  # the reader's open is woken by a writer; a read by its close
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            thread.join(0.1)
            if not thread.is_alive():
                break
        pytest.fail(f"blocked on the FIFO {fifo} for {timeout_s:g} s (a start or check would hang for good)")
    if "error" in done:
        raise done["error"]
    return done.get("result")
