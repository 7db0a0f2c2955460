"""nsjail: its compiler, backend, and the seccomp filter it loads."""
