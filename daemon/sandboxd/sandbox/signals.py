"""How every engine reports a command killed by a signal: as 128+N, N the signal (Docker,
nsjail, and the fake backend that stands in for them)."""

from __future__ import annotations

import signal


def signal_name(exit_code: int) -> str:
    """The signal's name ("SIGKILL") when `exit_code` is 128+N for a signal N; "" when
    the command exited on its own. Docker's init and nsjail both report a child killed
    by signal N so."""
    if 128 < exit_code < 128 + 65:
        try:
            return signal.Signals(exit_code - 128).name
        except ValueError:
            return f"SIG{exit_code - 128}"
    return ""
