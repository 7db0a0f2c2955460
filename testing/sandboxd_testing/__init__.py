"""The test harness: a real sandboxd subprocess on a private socket, state dir and workspace
root, and calls for it. What the integration tests, the benchmarks and the scripts run
against; a package of its own, beside the daemon (which never imports the client) and
the client."""

from sandboxd_testing.harness import (SANDBOXD, TEST_BACKENDS, TIME_SCALE, WORKSPACE_UID, DaemonProcess, make_daemon,
                                       prepared_call, timed_interleaved_ms, timed_ms, wait_for)

__all__ = ["SANDBOXD", "TEST_BACKENDS", "TIME_SCALE", "WORKSPACE_UID", "DaemonProcess", "make_daemon", "prepared_call",
           "timed_interleaved_ms", "timed_ms", "wait_for"]
